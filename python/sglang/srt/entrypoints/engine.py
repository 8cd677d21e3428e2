"""Engine: the in-process API, ``sglang.Engine(model_path=...)``.

Processes (DESIGN §3)::

    caller threads ──► Engine ──► private asyncio loop thread: TokenizerManager
                                     │ ZMQ                        ▲ ZMQ
                                     ▼                            │
                                  scheduler process ──► detokenizer process

Sync methods submit coroutines to the private loop and block on the result, so a ``generate``
blocking one thread never blocks another thread's calls. Async methods bridge from the
caller's loop into the private loop with ``asyncio.wrap_future``, so many ``async_generate``
tasks run side by side in one user loop.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import functools
import logging
import os
import signal
import threading
import weakref
from collections.abc import AsyncIterator, Coroutine, Iterator
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from sglang.srt.entrypoints import engine_weights, replies
from sglang.srt.entrypoints.engine_processes import (
    SHUTDOWN_STEP_TIMEOUT_S,
    StartingChildren,
    kill_processes,
    remove_ipc_dir,
    run_follower_node,
    start_engine_children,
)
from sglang.srt.entrypoints.EngineBase import EngineBase
from sglang.srt.managers.io_struct import (
    IGNORED_GENERATE_FIELDS,
    UNSUPPORTED_GENERATE_FIELDS,
    ContinueGenerationReqInput,
    FlushCacheReqOutput,
    GenerateReqInput,
    LoadLoRAAdapterFromTensorsReqInput,
    LoadLoRAAdapterReqInput,
    LoRAUpdateOutput,
    PauseGenerationReqInput,
    ReleaseMemoryOccupationReqInput,
    ReleaseMemoryOccupationReqOutput,
    ResumeMemoryOccupationReqInput,
    ResumeMemoryOccupationReqOutput,
    UnloadLoRAAdapterReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightVersionReqInput,
)
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.server_args import ServerArgs
from sglang.srt.server_args_upstream import server_args_from_kwargs

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_END = object()  # marks the end of a generate_request iterator across loops


async def _memory_call(
    manager: TokenizerManager, release: bool, tags: list[str] | None
) -> dict[str, Any]:
    """Release (or resume) memory through ``manager``; the reply as a dict. ValueError for bad
    tags (before anything is sent), RuntimeError when the scheduler refuses."""
    out: ReleaseMemoryOccupationReqOutput | ResumeMemoryOccupationReqOutput
    if release:
        out = await manager.release_memory_occupation(ReleaseMemoryOccupationReqInput(tags))
    else:
        out = await manager.resume_memory_occupation(ResumeMemoryOccupationReqInput(tags))
    if not out.success:
        raise RuntimeError(out.message)
    return replies.memory_reply(out)


def launch_engine_processes(
    server_args: ServerArgs, starting: StartingChildren | None = None
) -> tuple[TokenizerManager, dict, list[BaseProcess]]:
    """Start the scheduler and detokenizer processes and build the TokenizerManager.

    ``starting``: children already started by
    :func:`~sglang.srt.entrypoints.engine_processes.start_engine_children` for these
    ``server_args`` (the HTTP launcher starts them before its own imports); None starts them
    here.

    Returns the manager (not started: call its ``start()`` inside the loop that will own it),
    the scheduler's ready info, and the child processes (the manager already watches them).
    Raises RuntimeError with the failing child's own message when either fails to start; no
    child process is left running in that case. On a node other than node 0 (``--node-rank``
    > 0) it runs that node's scheduler ranks until they exit and then raises SystemExit (0
    when they all exited cleanly), see :func:`run_follower_node`.
    """
    if server_args.node_rank > 0:
        raise SystemExit(run_follower_node(server_args))
    if starting is None:
        starting = start_engine_children(server_args)
    try:
        ready = starting.wait_ready()
        procs = starting.procs
        tokenizer_manager = TokenizerManager(server_args, starting.port_args, ready[procs[0]])
        tokenizer_manager.watch_processes(procs)
        if server_args.dp_size * server_args.tp_size > 1:
            from sglang.srt.managers.data_parallel_controller import start_group_watchdog

            start_group_watchdog(procs)
    except BaseException:
        starting.kill()
        raise
    return tokenizer_manager, ready[procs[0]], procs


class _LazyFunction:
    """A class attribute that is ``module.name``, imported when first read."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        import importlib

        return getattr(importlib.import_module(self.module), self.name)


# Upstream's launch API, which RL frameworks import from this module (launch_compat.py),
# resolved on first use: the scheduler's module must not be imported into the launcher early.
_LAZY_NAMES = {
    "_launch_subprocesses": "sglang.srt.entrypoints.launch_compat",
    "init_tokenizer_manager": "sglang.srt.entrypoints.launch_compat",
    "run_scheduler_process": "sglang.srt.managers.scheduler_process",
    "run_detokenizer_process": "sglang.srt.managers.detokenizer_manager",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY_NAMES:
        import importlib

        return getattr(importlib.import_module(_LAZY_NAMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


async def _anext(gen: AsyncIterator) -> Any:
    """Next item of ``gen``, or ``_END`` (a StopAsyncIteration does not cross futures well)."""
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        return _END


async def _aclose(gen: Any) -> None:
    await gen.aclose()


async def _first_output(gen: Any) -> Any:
    """The one item a non-stream ``generate_request`` yields; the iterator is then closed."""
    try:
        return await gen.__anext__()
    finally:
        await gen.aclose()


def _shutdown_from_atexit(ref: weakref.ref) -> None:
    engine = ref()
    if engine is not None:
        engine.shutdown()


# Engines not shut down yet, for the SIGTERM handler; and the handler it replaced.
_live_engines: weakref.WeakSet[Engine] = weakref.WeakSet()
_previous_sigterm_handler: Any = signal.SIG_DFL


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM with engines alive: a handler installed before them decides (call it: if it
    exits, ``atexit`` shuts the engines down; if it returns, they keep serving). Otherwise,
    as the default action would, the process ends by the signal, but first every engine is
    shut down: no child process is left and the IPC directories are removed."""
    previous = _previous_sigterm_handler
    if callable(previous):
        previous(signum, frame)
        return
    for engine in list(_live_engines):
        try:
            engine.shutdown()
        except Exception:  # the process ends whatever happened to one engine
            logger.warning("Shutting an engine down on SIGTERM failed", exc_info=True)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    raise SystemExit(128 + signum)  # not reached: the default action ends the process


def _install_sigterm_handler() -> None:
    """Install :func:`_on_sigterm`, remembering the handler it replaces. Only in the main
    thread (the only one Python lets set handlers), and not where SIGTERM is ignored or
    handled outside Python (that choice stays)."""
    global _previous_sigterm_handler
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGTERM)
    if current is _on_sigterm or current is None or current == signal.SIG_IGN:
        return
    _previous_sigterm_handler = current
    signal.signal(signal.SIGTERM, _on_sigterm)


class Engine(EngineBase):
    """The in-process engine, an :class:`EngineBase` as upstream's. ``Engine(**kwargs)`` takes
    :class:`ServerArgs` fields (or, as upstream, ``Engine(server_args=ServerArgs(...))``) and
    upstream SGLang's other ServerArgs keywords: one that does not apply to this build is
    ignored with one logged warning, one that would change results is a ValueError naming it,
    an unknown name a TypeError (docs/compatibility.md).

    Public methods follow SGLang's ``Engine``. After :meth:`shutdown` (also run at exit, on
    SIGTERM unless a handler of the caller's takes it, see :func:`_on_sigterm`, and, best
    effort, on garbage collection) no child process nor IPC directory is left and every
    method raises RuntimeError. A request that fails validation raises ValueError; a dead
    scheduler makes pending and later calls raise RuntimeError.
    """

    # Upstream's launch hooks (verl's server mode passes them back to _launch_subprocesses);
    # resolved on first use, like the module's lazy names.
    init_tokenizer_manager_func = _LazyFunction("sglang.srt.entrypoints.launch_compat",
                                                "init_tokenizer_manager")
    run_scheduler_process_func = _LazyFunction("sglang.srt.managers.scheduler_process",
                                               "run_scheduler_process")
    run_detokenizer_process_func = _LazyFunction("sglang.srt.managers.detokenizer_manager",
                                                 "run_detokenizer_process")

    @classmethod
    def _launch_subprocesses(cls, server_args: ServerArgs, *args: Any, **kwargs: Any) -> tuple:
        """Upstream 0.5.10's launch for servers that serve the module-level HTTP app
        themselves: ``(tokenizer_manager, None, port_args, scheduler_init_result, None)``
        (see :func:`~sglang.srt.entrypoints.launch_compat.launch_subprocesses_0510`)."""
        from sglang.srt.entrypoints.launch_compat import launch_subprocesses_0510

        return launch_subprocesses_0510(server_args, *args, **kwargs)

    def __init__(self, **kwargs: Any) -> None:
        if "server_args" in kwargs:  # upstream's Engine(server_args=ServerArgs(...))
            server_args = kwargs.pop("server_args")
            if kwargs or not isinstance(server_args, ServerArgs):
                raise TypeError("Engine(server_args=...) takes a ServerArgs and nothing else")
            kwargs = dataclasses.asdict(server_args)
        # Upstream's other ServerArgs keywords: ignored with a warning or refused by name.
        self.server_args = server_args_from_kwargs(kwargs)
        # From here on shutdown() has something to undo.
        self._closed = False
        self._procs: list[BaseProcess] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.tokenizer_manager: TokenizerManager | None = None
        self._atexit_hook = functools.partial(_shutdown_from_atexit, weakref.ref(self))
        atexit.register(self._atexit_hook)
        _live_engines.add(self)
        _install_sigterm_handler()
        try:
            tm, self.scheduler_info, self._procs = launch_engine_processes(self.server_args)
            self.tokenizer_manager = tm
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(
                target=self._loop.run_forever, name="sglang-engine-loop", daemon=True
            )
            self._thread.start()
            self._run(self._start_manager())
        except BaseException:
            self.shutdown()
            raise
        self.tokenizer = tm.tokenizer

    async def _start_manager(self) -> None:
        self._manager().start()

    # ---- generation --------------------------------------------------------------------------
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
        stream: bool = False,
        rid: str | list[str] | None = None,
        return_entropy: bool | list[bool] = False,
        return_text_in_logprobs: bool = False,
        entropy_mode: str | list[str | None] | None = None,
        entropy_top_k: int | list[int | None] | None = None,
        lora_path: str | list[str | None] | None = None,
        return_routed_experts: bool | list[bool] = False,
        routed_experts_start_len: int | list[int] = 0,
        **upstream_kwargs: Any,
    ) -> dict | list[dict] | Iterator[dict]:
        """Generate for one prompt (-> dict) or a batch (-> list); ``stream`` -> iterator.

        Stream items carry the cumulative text and ids (a batch's items also an "index").
        Leaving a stream early aborts its request(s). Upstream SGLang's other arguments
        (``image_data``, ``token_ids_logprob``, ...) are accepted when unset
        (None / False) and refused with ValueError when set: this engine lacks those features.
        ``lora_path``: the LoRA adapter name (one per prompt for a batch; None: the base
        model; docs/lora.md); one that is not loaded is a ValueError.
        ``return_routed_experts``: the MoE routing of positions ``[routed_experts_start_len,
        seqlen - 1)`` in ``meta_info["routed_experts"]`` (needs
        ``enable_return_routed_experts``; docs/models.md).
        """
        obj = _make_request(locals())
        if stream:
            return self._sync_stream(obj)
        return self._run(_first_output(self._manager().generate_request(obj)))

    def _sync_stream(self, obj: GenerateReqInput) -> Iterator[dict]:
        gen = self._manager().generate_request(obj)
        try:
            while (item := self._run(_anext(gen))) is not _END:
                yield item
        finally:
            if not self._closed:
                self._run(_aclose(gen))

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
        stream: bool = False,
        rid: str | list[str] | None = None,
        return_entropy: bool | list[bool] = False,
        return_text_in_logprobs: bool = False,
        entropy_mode: str | list[str | None] | None = None,
        entropy_top_k: int | list[int | None] | None = None,
        lora_path: str | list[str | None] | None = None,
        return_routed_experts: bool | list[bool] = False,
        routed_experts_start_len: int | list[int] = 0,
        **upstream_kwargs: Any,
    ) -> dict | list[dict] | AsyncIterator[dict]:
        """Like :meth:`generate`, awaited in the caller's loop; ``stream`` -> async iterator."""
        obj = _make_request(locals())
        if stream:
            return self._async_stream(obj)
        return await self._bridge(_first_output(self._manager().generate_request(obj)))

    async def _async_stream(self, obj: GenerateReqInput) -> AsyncIterator[dict]:
        gen = self._manager().generate_request(obj)
        try:
            while (item := await self._bridge(_anext(gen))) is not _END:
                yield item
        finally:
            if not self._closed:
                await self._bridge(_aclose(gen))

    # ---- control -----------------------------------------------------------------------------
    def get_server_info(self) -> dict[str, Any]:
        """Server args, the scheduler's ready info, ``internal_states`` and ``version``."""
        internal_states = self._run(self._manager().get_internal_state())
        return replies.server_info(
            self.server_args.to_dict(), self.scheduler_info, internal_states
        )

    def get_model_info(self) -> dict[str, Any]:
        """What this engine serves now (as ``GET /get_model_info``): ``model_path`` (the last
        checkpoint loaded), ``tokenizer_path``, ``is_generation``, ``weight_version``,
        ``model_type``, ``architectures`` and upstream's other keys."""
        return self._run(self._model_info())

    async def async_get_model_info(self) -> dict[str, Any]:
        return await self._bridge(self._model_info())

    def _model_info(self) -> Coroutine[Any, Any, dict[str, Any]]:
        return replies.model_info(
            self._manager(), self.server_args.tokenizer_path, self.scheduler_info
        )

    def flush_cache(self) -> FlushCacheReqOutput:
        """Flush the prefix cache; ``.success`` False (with ``.error_msg``) when refused."""
        return self._run(self._manager().flush_cache())

    async def async_flush_cache(self) -> FlushCacheReqOutput:
        return await self._bridge(self._manager().flush_cache())

    def abort_request(
        self,
        rid: str | None = None,
        abort_all: bool = False,
        match_prefix: bool = False,
        lora_name: str | None = None,
    ) -> int:
        """Abort ``rid`` (exact; every rid starting with it when ``match_prefix``), every
        request of LoRA adapter ``lora_name``, or everything; returns once the abort took
        effect, with the number of requests ended. Each aborted caller gets its partial output
        with finish_reason type "abort"."""
        if lora_name is not None:
            return self._run(self._manager().abort_lora_requests(lora_name))
        return self._run(self._manager().abort_request_async(rid or "", abort_all, match_prefix))

    async def async_abort_request(
        self, rid: str | None = None, abort_all: bool = False, match_prefix: bool = False
    ) -> int:
        return await self._bridge(
            self._manager().abort_request_async(rid or "", abort_all, match_prefix)
        )

    def pause_generation(
        self,
        mode: str = "retract",
        clear_cache: bool = False,
        timeout_s: float | None = None,
        lora_name: str | None = None,
    ) -> dict[str, Any]:
        """Pause generation (modes: abort, retract, in_place; vLLM's keep and wait).

        Returns once paused, with what it did (``num_running``, ``num_retracted``,
        ``num_aborted``, ``num_waiting``). ``timeout_s`` is a lease after which the engine
        continues by itself (for ``wait``: how long to wait for running requests). Raises
        ValueError for an unknown mode (the state is unchanged). With ``lora_name`` only
        that LoRA adapter's requests pause (abort, retract or in_place; docs/lora.md).
        """
        return self._run(_pause(self._manager(), mode, clear_cache, timeout_s, lora_name))

    async def async_pause_generation(
        self,
        mode: str = "retract",
        clear_cache: bool = False,
        timeout_s: float | None = None,
        lora_name: str | None = None,
    ) -> dict[str, Any]:
        return await self._bridge(
            _pause(self._manager(), mode, clear_cache, timeout_s, lora_name)
        )

    def continue_generation(self, lora_name: str | None = None) -> dict[str, Any]:
        """Resume after a pause (of the engine, or of adapter ``lora_name``); idempotent."""
        return self._run(_continue(self._manager(), lora_name))

    async def async_continue_generation(self, lora_name: str | None = None) -> dict[str, Any]:
        return await self._bridge(_continue(self._manager(), lora_name))

    # ---- LoRA adapters (docs/lora.md) -----------------------------------------------------
    def load_lora_adapter(
        self,
        lora_name: str,
        lora_path: str,
        pinned: bool = False,
        weight_version: str | None = None,
    ) -> LoRAUpdateOutput:
        """Load the PEFT adapter at ``lora_path`` as ``lora_name`` (over a paused adapter's
        name: update its weights). ``.success`` False with ``.error_message`` when refused."""
        obj = LoadLoRAAdapterReqInput(lora_name, lora_path, pinned, weight_version=weight_version)
        return self._run(self._manager().load_lora_adapter(obj))

    async def async_load_lora_adapter(
        self,
        lora_name: str,
        lora_path: str,
        pinned: bool = False,
        weight_version: str | None = None,
    ) -> LoRAUpdateOutput:
        obj = LoadLoRAAdapterReqInput(lora_name, lora_path, pinned, weight_version=weight_version)
        return await self._bridge(self._manager().load_lora_adapter(obj))

    def load_lora_adapter_from_tensors(
        self,
        lora_name: str,
        tensors: dict[str, torch.Tensor] | list[tuple[str, torch.Tensor]],
        config_dict: dict[str, Any],
        load_format: str | None = None,
        weight_version: str | None = None,
    ) -> LoRAUpdateOutput:
        """Load (or, over a paused adapter's name, update) an adapter from PEFT-named tensors
        (``...layers.0.self_attn.q_proj.lora_A.weight``, as ``get_peft_model_state_dict``
        gives them) and its adapter config (adapter_config.json's content), without a
        checkpoint on disk. Upstream's signature; only the default ``load_format``."""
        obj = _lora_tensors_request(lora_name, tensors, config_dict, load_format, weight_version)
        return self._run(self._manager().load_lora_adapter_from_tensors(obj))

    async def async_load_lora_adapter_from_tensors(
        self,
        lora_name: str,
        tensors: dict[str, torch.Tensor] | list[tuple[str, torch.Tensor]],
        config_dict: dict[str, Any],
        load_format: str | None = None,
        weight_version: str | None = None,
    ) -> LoRAUpdateOutput:
        obj = _lora_tensors_request(lora_name, tensors, config_dict, load_format, weight_version)
        return await self._bridge(self._manager().load_lora_adapter_from_tensors(obj))

    def unload_lora_adapter(self, lora_name: str) -> LoRAUpdateOutput:
        """Unload ``lora_name``; refused while requests of it run or wait."""
        return self._run(self._manager().unload_lora_adapter(UnloadLoRAAdapterReqInput(lora_name)))

    async def async_unload_lora_adapter(self, lora_name: str) -> LoRAUpdateOutput:
        return await self._bridge(
            self._manager().unload_lora_adapter(UnloadLoRAAdapterReqInput(lora_name))
        )

    # ---- weights (docs/weights.md) -------------------------------------------------------------
    def update_weights_from_disk(
        self,
        model_path: str,
        load_format: str | None = None,
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> tuple[bool, str, int]:
        """Load the checkpoint at ``model_path`` (same architecture and shapes) into the running
        model. Returns ``(success, message, num_paused_requests)``; a refused update (bad path,
        config, missing tensor, shape mismatch) changes nothing."""
        obj = UpdateWeightFromDiskReqInput(
            model_path, load_format, abort_all_requests, weight_version, flush_cache
        )
        return self._run(engine_weights.update_from_disk(self._manager(), obj))

    async def async_update_weights_from_disk(
        self,
        model_path: str,
        load_format: str | None = None,
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> tuple[bool, str, int]:
        obj = UpdateWeightFromDiskReqInput(
            model_path, load_format, abort_all_requests, weight_version, flush_cache
        )
        return await self._bridge(engine_weights.update_from_disk(self._manager(), obj))

    def update_weights_from_tensor(
        self,
        named_tensors: list[tuple[str, Any]] | dict[str, Any],
        load_format: str | None = None,
        flush_cache: bool = True,
        *,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
    ) -> tuple[bool, str]:
        """Copy ``named_tensors`` (HF checkpoint names, fused shards allowed; parameter names
        with ``load_format="direct"``) into the model; any subset of the weights. Returns
        ``(success, message)``; a refused update (unknown name, shape) changes nothing."""
        obj = engine_weights.tensor_request(
            named_tensors, load_format, flush_cache, weight_version, abort_all_requests
        )
        return self._run(engine_weights.update_from_tensor(self._manager(), obj))

    async def async_update_weights_from_tensor(
        self,
        named_tensors: list[tuple[str, Any]] | dict[str, Any],
        load_format: str | None = None,
        flush_cache: bool = True,
        *,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
    ) -> tuple[bool, str]:
        obj = engine_weights.tensor_request(
            named_tensors, load_format, flush_cache, weight_version, abort_all_requests
        )
        return await self._bridge(engine_weights.update_from_tensor(self._manager(), obj))

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """Values of weight ``name`` (parameter or HF name) as float lists, first dimension cut
        to ``truncate_size``. Raises ValueError when no weight has that name."""
        return self._run(engine_weights.get_weights(self._manager(), name, truncate_size))

    async def async_get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        return await self._bridge(engine_weights.get_weights(self._manager(), name, truncate_size))

    def update_weight_version(
        self, new_version: str, abort_all_requests: bool = False
    ) -> dict[str, Any]:
        """Relabel the current weights (tokens from now on carry ``new_version``); aborts
        every request only with ``abort_all_requests``. Raises ValueError for an empty label."""
        obj = UpdateWeightVersionReqInput(new_version, abort_all_requests)
        return self._run(engine_weights.update_version(self._manager(), obj))

    async def async_update_weight_version(
        self, new_version: str, abort_all_requests: bool = False
    ) -> dict[str, Any]:
        obj = UpdateWeightVersionReqInput(new_version, abort_all_requests)
        return await self._bridge(engine_weights.update_version(self._manager(), obj))

    # ---- profiling (docs/native_api.md#profiling) --------------------------------------------
    def start_profile(self, **kwargs: Any) -> None:
        """Start the torch profiler in every scheduler rank; ``kwargs`` as
        ``TokenizerManager.start_profile`` (``output_dir``, ``num_steps``, ``activities``, ...).
        RuntimeError when refused (a profile runs already), ValueError for bad arguments."""
        self._run(self._manager().start_profile(**kwargs))

    def stop_profile(self) -> None:
        """Stop the profiler and write each rank's trace (RuntimeError when none runs)."""
        self._run(self._manager().stop_profile())

    # ---- memory occupation (docs/memory.md) --------------------------------------------------
    def release_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Free the KV cache and/or weights (``tags``: "kv_cache", "weights", "cuda_graph";
        None = all) until :meth:`resume_memory_occupation`; nothing runs meanwhile. Raises
        ValueError for an unknown tag and RuntimeError when refused (a request holds KV)."""
        return self._run(_memory_call(self._manager(), True, tags))

    async def async_release_memory_occupation(
        self, tags: list[str] | None = None
    ) -> dict[str, Any]:
        return await self._bridge(_memory_call(self._manager(), True, tags))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Allocate the memory of ``tags`` (None = all) again; resumed weights are reloaded
        from the checkpoint they last came from (see docs/memory.md)."""
        return self._run(_memory_call(self._manager(), False, tags))

    async def async_resume_memory_occupation(
        self, tags: list[str] | None = None
    ) -> dict[str, Any]:
        return await self._bridge(_memory_call(self._manager(), False, tags))

    # ---- lifecycle ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Kill the child processes and stop the loop thread (idempotent, never hangs)."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        atexit.unregister(self._atexit_hook)
        _live_engines.discard(self)
        tm, loop, thread = self.tokenizer_manager, self._loop, self._thread
        on_loop_thread = thread is threading.current_thread()
        if tm is not None and loop is not None and loop.is_running() and not on_loop_thread:
            try:
                asyncio.run_coroutine_threadsafe(tm.close(), loop).result(SHUTDOWN_STEP_TIMEOUT_S)
            except Exception:
                logger.warning("Closing the tokenizer manager failed", exc_info=True)
        kill_processes(self._procs)
        if tm is not None:
            remove_ipc_dir(tm.port_args)
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
            if thread is not None and not on_loop_thread:
                thread.join(SHUTDOWN_STEP_TIMEOUT_S)
                if not loop.is_running():
                    loop.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        # Best effort: at interpreter teardown modules may already be gone.
        with contextlib.suppress(Exception):
            self.shutdown()

    # ---- helpers -----------------------------------------------------------------------------
    def _manager(self) -> TokenizerManager:
        if self._closed or self.tokenizer_manager is None:
            raise RuntimeError("The engine is shut down")
        return self.tokenizer_manager

    def _private_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("The engine is shut down")
        return self._loop

    def _run(self, coro: Coroutine) -> Any:
        """Run ``coro`` on the private loop and block this thread until it is done."""
        if self._closed:
            coro.close()
            raise RuntimeError("The engine is shut down")
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("Sync Engine methods cannot be called from the engine's loop")
        return asyncio.run_coroutine_threadsafe(coro, self._private_loop()).result()

    async def _bridge(self, coro: Coroutine) -> Any:
        """Await ``coro`` (run on the private loop) from the caller's loop."""
        if self._closed:
            coro.close()
            raise RuntimeError("The engine is shut down")
        future = asyncio.run_coroutine_threadsafe(coro, self._private_loop())
        return await asyncio.wrap_future(future)


async def _pause(
    tm: TokenizerManager,
    mode: str,
    clear_cache: bool,
    timeout_s: float | None,
    lora_name: str | None = None,
) -> dict[str, Any]:
    out = await tm.pause_generation(
        PauseGenerationReqInput(
            mode=mode, clear_cache=clear_cache, timeout_s=timeout_s, lora_name=lora_name
        )
    )
    if not out.success:
        raise ValueError(out.message)
    return replies.pause_reply(out)


async def _continue(tm: TokenizerManager, lora_name: str | None = None) -> dict[str, Any]:
    return replies.continue_reply(
        await tm.continue_generation(ContinueGenerationReqInput(lora_name=lora_name))
    )


# Upstream SGLang's Engine.generate arguments beyond this engine's own: passed on to
# GenerateReqInput, which accepts them unset (verl passes image_data=None) and refuses a set
# one for a feature this engine lacks.
_UPSTREAM_ONLY_ARGS = frozenset(UNSUPPORTED_GENERATE_FIELDS + IGNORED_GENERATE_FIELDS)


def _check_upstream_args(kwargs: dict[str, Any]) -> None:
    """TypeError for an argument upstream does not know either."""
    unknown = sorted(set(kwargs) - _UPSTREAM_ONLY_ARGS)
    if unknown:
        raise TypeError(f"generate() got unexpected keyword argument(s): {', '.join(unknown)}")


def _make_request(args: dict[str, Any]) -> GenerateReqInput:
    """A GenerateReqInput from ``generate``'s arguments (SGLang's defaults for None)."""
    _check_upstream_args(args["upstream_kwargs"])
    return GenerateReqInput(
        text=args["prompt"],
        input_ids=args["input_ids"],
        sampling_params=args["sampling_params"],
        rid=args["rid"],
        return_logprob=args["return_logprob"],
        logprob_start_len=-1 if args["logprob_start_len"] is None else args["logprob_start_len"],
        top_logprobs_num=0 if args["top_logprobs_num"] is None else args["top_logprobs_num"],
        return_text_in_logprobs=args["return_text_in_logprobs"],
        stream=args["stream"],
        return_entropy=args["return_entropy"],
        entropy_mode=args["entropy_mode"],
        entropy_top_k=args["entropy_top_k"],
        lora_path=args.get("lora_path"),
        return_routed_experts=args["return_routed_experts"],
        routed_experts_start_len=args["routed_experts_start_len"],
        **args["upstream_kwargs"],
    )


def _lora_tensors_request(
    lora_name: str,
    tensors: dict[str, torch.Tensor] | list[tuple[str, torch.Tensor]],
    config_dict: dict[str, Any],
    load_format: str | None,
    weight_version: str | None,
) -> LoadLoRAAdapterFromTensorsReqInput:
    """The request of ``load_lora_adapter_from_tensors``; ValueError for a ``load_format``
    (only the default one is supported for LoRA tensors)."""
    if load_format is not None:
        raise ValueError(f"load_format {load_format!r} is not supported for LoRA tensors")
    return LoadLoRAAdapterFromTensorsReqInput(
        lora_name, dict(tensors), dict(config_dict), weight_version
    )
