"""What the HTTP server needs of the TokenizerManager, as a Protocol.

``create_app`` (http_server.py), its routers (http_weights.py), the OpenAI serving classes
and ``ServerMetrics.refresh`` talk to the frontend only through these members. The real
:class:`~sglang.srt.managers.tokenizer_manager.TokenizerManager` implements it, and so do the
test fakes that serve the app without engine processes (test/srt/test_http_app.py), which
tests check with ``isinstance`` (the protocol is runtime-checkable: that checks the member
names; mypy checks the signatures where a concrete manager is passed as this type).

Contracts the HTTP layer relies on, beyond the signatures:

- Control methods (pause, continue, flush, weights, memory) return once the scheduler has
  acted, with its reply; a refusal is ``success=False`` with a message, never an exception.
- ``generate_request`` raises ValueError before anything is sent when a request is invalid;
  closing its iterator early aborts the request's unfinished rids.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from sglang.srt.managers.io_struct import (
    ContinueGenerationReqInput,
    ContinueGenerationReqOutput,
    DestroyWeightsUpdateGroupReqInput,
    FlushCacheReqOutput,
    GenerateReqInput,
    GetWeightsByNameReqInput,
    GetWeightsByNameReqOutput,
    InitWeightsUpdateGroupReqInput,
    PauseGenerationReqInput,
    PauseGenerationReqOutput,
    ProfileReqOutput,
    ReleaseMemoryOccupationReqInput,
    ReleaseMemoryOccupationReqOutput,
    ResumeMemoryOccupationReqInput,
    ResumeMemoryOccupationReqOutput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightFromDiskReqOutput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightsFromTensorReqOutput,
    UpdateWeightVersionReqInput,
    UpdateWeightVersionReqOutput,
)

if TYPE_CHECKING:
    import fastapi
    from fastapi import Request

    from sglang.srt.managers.request_validation import RequestLimits


class WatchedProcess(Protocol):
    """An engine process the frontend watches (``multiprocessing.Process`` is one)."""

    def is_alive(self) -> bool: ...


@runtime_checkable
class TokenizerManagerProtocol(Protocol):
    """The frontend as the HTTP server uses it (see the module docstring for the contracts)."""

    @property
    def tokenizer(self) -> Any:
        """The HF tokenizer (``encode``, ``decode``, ``apply_chat_template``); None when the
        server runs with ``--skip-tokenizer-init``."""

    @property
    def served_model_name(self) -> str: ...

    @property
    def model_path(self) -> str:
        """The checkpoint served now (a weight update from disk changes it)."""

    @property
    def context_len(self) -> int: ...

    @property
    def limits(self) -> RequestLimits:
        """What requests are checked against (model sizes and the server's request limits)."""

    @property
    def is_paused(self) -> bool:
        """Generation is paused as far as this frontend knows."""

    @property
    def memory_released(self) -> bool:
        """The KV cache or the weights are released (nothing can decode until resumed)."""

    def start(self) -> None:
        """Start the frontend's tasks on the running event loop (idempotent)."""

    def watch_processes(self, procs: list[WatchedProcess]) -> None:
        """Fail every caller once one of ``procs`` has exited."""

    async def close(self) -> None:
        """Fail pending callers and release the frontend's sockets and tasks."""

    def generate_request(
        self, obj: GenerateReqInput, request: fastapi.Request | None = None
    ) -> AsyncGenerator[Any, None]:
        """Outputs of ``obj``: one dict (or a list for a batch) unless streaming, else a dict
        per update. ``request``: its client disconnecting aborts the rids."""

    async def abort_request_async(
        self, rid: str = "", abort_all: bool = False, match_prefix: bool = False
    ) -> int:
        """Abort ``rid`` (or all, or every rid with that prefix); how many requests ended."""

    async def flush_cache(self) -> FlushCacheReqOutput: ...

    async def get_internal_state(self) -> list[dict[str, Any]]:
        """One dict per scheduler (DESIGN §2 keys)."""

    async def pause_generation(self, obj: PauseGenerationReqInput) -> PauseGenerationReqOutput: ...

    async def continue_generation(
        self, obj: ContinueGenerationReqInput | None = None
    ) -> ContinueGenerationReqOutput: ...

    async def update_weights_from_disk(
        self, obj: UpdateWeightFromDiskReqInput
    ) -> UpdateWeightFromDiskReqOutput: ...

    async def update_weights_from_tensor(
        self, obj: UpdateWeightsFromTensorReqInput, request: fastapi.Request | None = None
    ) -> UpdateWeightsFromTensorReqOutput:
        """Copy tensors (or upstream's serialized payload) into the model; refused when invalid
        (``success=False``)."""

    async def init_weights_update_group(
        self, obj: InitWeightsUpdateGroupReqInput, request: fastapi.Request | None = None
    ) -> tuple[bool, str]:
        """Join a trainer's weight-broadcast group: upstream's ``(success, message)``."""

    async def update_weights_from_distributed(
        self, obj: UpdateWeightsFromDistributedReqInput, request: fastapi.Request | None = None
    ) -> tuple[bool, str]:
        """Receive broadcast tensors and load them: ``(success, message)``."""

    async def destroy_weights_update_group(
        self, obj: DestroyWeightsUpdateGroupReqInput, request: fastapi.Request | None = None
    ) -> tuple[bool, str]: ...

    async def get_weights_by_name(
        self, obj: GetWeightsByNameReqInput
    ) -> GetWeightsByNameReqOutput: ...

    async def update_weight_version(
        self, obj: UpdateWeightVersionReqInput
    ) -> UpdateWeightVersionReqOutput: ...

    async def start_profile(
        self,
        output_dir: str | None = None,
        start_step: int | None = None,
        num_steps: int | None = None,
        activities: list[str] | None = None,
        with_stack: bool | None = None,
        record_shapes: bool | None = None,
        profile_by_stage: bool = False,
        merge_profiles: bool = False,
        profile_prefix: str | None = None,
        profile_stages: list[str] | None = None,
    ) -> ProfileReqOutput:
        """Start the torch profiler in every scheduler rank (docs/native_api.md#profiling)."""

    async def stop_profile(self) -> ProfileReqOutput:
        """Stop it and write the traces."""

    async def release_memory_occupation(
        self, obj: ReleaseMemoryOccupationReqInput
    ) -> ReleaseMemoryOccupationReqOutput: ...

    async def resume_memory_occupation(
        self, obj: ResumeMemoryOccupationReqInput
    ) -> ResumeMemoryOccupationReqOutput: ...


def tokenizer_manager_of(request: Request) -> TokenizerManagerProtocol:
    """The frontend serving an HTTP request (set on the app by ``create_app``)."""
    return request.app.state.tokenizer_manager
