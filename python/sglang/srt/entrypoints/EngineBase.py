"""``EngineBase``: the abstract engine interface (upstream's ``sglang.srt.entrypoints.EngineBase``).

:class:`sglang.srt.entrypoints.engine.Engine` implements it in process; RL frameworks subclass
it for engines they reach another way (verl's ``HttpServerAdapter`` talks to a server over
HTTP), so that rollout code holds either behind one type. The abstract methods are upstream's
list: generation, cache flush, tensor weight updates, memory release/resume, shutdown.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class EngineBase(ABC):
    """An engine that generates, takes new weights and lends its memory back.

    Subclasses choose the return values (the in-process ``Engine`` returns dicts and
    ``(success, message)`` tuples, an HTTP adapter the server's JSON replies); what each
    method must *do* is stated below. Instantiating a subclass that lacks one raises
    TypeError (``abc``)."""

    @abstractmethod
    def generate(
        self,
        prompt: Any = None,
        sampling_params: Any = None,
        input_ids: Any = None,
        **kwargs: Any,
    ) -> Any:
        """Generate for one prompt or a batch (text ``prompt`` or token ``input_ids``) with
        ``sampling_params``; upstream's other keywords (``return_logprob``, ``stream``,
        ``lora_path``, ``rid``, ...) go by name."""

    @abstractmethod
    def flush_cache(self) -> Any:
        """Drop the prefix (radix) cache, so no later request reuses KV computed before."""

    @abstractmethod
    def update_weights_from_tensor(
        self,
        named_tensors: list[tuple[str, Any]],
        load_format: str | None = None,
        flush_cache: bool = True,
    ) -> Any:
        """Copy ``(name, tensor)`` pairs into the running model (a value may be a
        ``LocalSerializedTensor``: one payload per tensor-parallel rank); flush the prefix
        cache afterwards when ``flush_cache``."""

    @abstractmethod
    def release_memory_occupation(self) -> Any:
        """Free the engine's accelerator memory (weights, KV cache) until resumed."""

    @abstractmethod
    def resume_memory_occupation(self) -> Any:
        """Take back the memory :meth:`release_memory_occupation` freed."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the engine and free everything it holds."""
