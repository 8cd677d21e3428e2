"""Upstream's low-level launch API, as RL frameworks' server modes call it (verl, AReaL).

verl's server mode does, with upstream's names::

    tokenizer_manager, template_manager, scheduler_info, *_ = _launch_subprocesses(server_args)
    set_global_state(_GlobalState(tokenizer_manager, template_manager, scheduler_info))
    # ... then serves sglang.srt.entrypoints.http_server.app with its own uvicorn server

From upstream 0.5.10 on, verl calls the classmethod instead (the tuple is upstream's newer
order, with the scheduler infos in a :class:`SchedulerInitResult`)::

    tokenizer_manager, template_manager, port_args, scheduler_init_result, watchdog = (
        Engine._launch_subprocesses(server_args=..., init_tokenizer_manager_func=...))

``_launch_subprocesses`` starts the scheduler and detokenizer processes and builds the
TokenizerManager in the calling process (the same as :class:`~sglang.srt.entrypoints.engine.
Engine` does); the processes are killed and the IPC directory removed when the interpreter
exits (or earlier by the caller's ``kill_process_tree``). ``set_global_state`` attaches the
manager to the module-level ``http_server.app``.

Chat templates live in the TokenizerManager here, so there is no separate TemplateManager: the
``template_manager`` element of the returned tuple is None, and ``_GlobalState`` accepts it.
The three process functions upstream lets a caller replace (``init_tokenizer_manager_func``
and the two ``run_*_process_func``) are accepted when they are this build's own (the names
``sglang.srt.entrypoints.engine`` exports), and refused otherwise: a framework's own
process function would be written against upstream's internals.
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.server_args import PortArgs, ServerArgs

logger = logging.getLogger(__name__)


def init_tokenizer_manager(
    server_args: ServerArgs, port_args: PortArgs, scheduler_info: dict[str, Any]
) -> tuple[TokenizerManager, None]:
    """The TokenizerManager of a launched engine and its (absent) template manager."""
    return TokenizerManager(server_args, port_args, scheduler_info), None


@dataclass
class _GlobalState:
    """What the module-level HTTP app serves (upstream's field names). ``scheduler_info`` that
    is not a dict (verl passes the third element of the 0.5.10 tuple, the port args) is
    replaced by the manager's own."""

    tokenizer_manager: Any
    template_manager: Any = None
    scheduler_info: Any = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.scheduler_info, dict):
            self.scheduler_info = dict(self.tokenizer_manager.scheduler_info)


@dataclass
class SchedulerInitResult:
    """The scheduler side of a launch (upstream 0.5.10's name and fields). The processes are
    ready when it is returned, so ``wait_for_ready`` returns at once; ``wait_for_completion``
    blocks until every engine process exited."""

    scheduler_infos: list[dict[str, Any]]
    wait_for_ready: Callable[[], None] = lambda: None
    wait_for_completion: Callable[[], None] = lambda: None
    engine_info_bootstrap_server: Any = None


# Parameter -> (module, name) of this build's own function for it.
_OWN_FUNCS: dict[str, tuple[str, str]] = {
    "init_tokenizer_manager_func": (__name__, "init_tokenizer_manager"),
    "run_scheduler_process_func": (
        "sglang.srt.managers.scheduler_process",
        "run_scheduler_process",
    ),
    "run_detokenizer_process_func": (
        "sglang.srt.managers.detokenizer_manager",
        "run_detokenizer_process",
    ),
}


def _is_own(param: str, func: Callable[..., Any]) -> bool:
    module, name = _OWN_FUNCS[param]
    return getattr(func, "__module__", None) == module and getattr(func, "__name__", None) == name


def _launch_subprocesses(
    server_args: ServerArgs,
    port_args: PortArgs | None = None,
    init_tokenizer_manager_func: Callable[..., Any] | None = None,
    run_scheduler_process_func: Callable[..., Any] | None = None,
    run_detokenizer_process_func: Callable[..., Any] | None = None,
) -> tuple[TokenizerManager, None, dict[str, Any], PortArgs]:
    """Start the engine processes; returns ``(tokenizer_manager, template_manager=None,
    scheduler_info, port_args)``. The manager is not started: the loop that serves it (the
    HTTP app's lifespan) starts it.

    ``port_args`` is not used: this build allocates its own IPC endpoints (returned as the
    last element). Raises ValueError for a process function that is not this build's own,
    RuntimeError when a process fails to start (none is left running then).
    """
    from sglang.srt.entrypoints.engine import launch_engine_processes
    from sglang.srt.entrypoints.engine_processes import kill_engine_processes

    given = {
        "init_tokenizer_manager_func": init_tokenizer_manager_func,
        "run_scheduler_process_func": run_scheduler_process_func,
        "run_detokenizer_process_func": run_detokenizer_process_func,
    }
    for name, func in given.items():
        if func is not None and not _is_own(name, func):
            raise ValueError(
                f"{name}={getattr(func, '__qualname__', func)!r} is not supported: this build "
                "runs its own processes (pass sglang.srt.entrypoints.engine's or None)"
            )
    if port_args is not None:
        logger.debug("_launch_subprocesses: port_args ignored, IPC endpoints are allocated here")
    tokenizer_manager, scheduler_info, processes = launch_engine_processes(server_args)
    atexit.register(kill_engine_processes, processes, tokenizer_manager.port_args)
    return tokenizer_manager, None, scheduler_info, tokenizer_manager.port_args


def launch_subprocesses_0510(
    server_args: ServerArgs,
    init_tokenizer_manager_func: Callable[..., Any] | None = None,
    run_scheduler_process_func: Callable[..., Any] | None = None,
    run_detokenizer_process_func: Callable[..., Any] | None = None,
    port_args: PortArgs | None = None,
) -> tuple[TokenizerManager, None, PortArgs, SchedulerInitResult, None]:
    """Upstream 0.5.10's ``Engine._launch_subprocesses``: the same launch as
    :func:`_launch_subprocesses`, returned as ``(tokenizer_manager, template_manager=None,
    port_args, scheduler_init_result, subprocess_watchdog=None)``. There is no watchdog object:
    the TokenizerManager watches the processes itself (callers fail fast when one dies)."""
    tokenizer_manager, _, scheduler_info, own_port_args = _launch_subprocesses(
        server_args, port_args, init_tokenizer_manager_func, run_scheduler_process_func,
        run_detokenizer_process_func,
    )
    processes = list(tokenizer_manager.watched_processes)

    def wait_for_completion() -> None:
        for process in processes:
            process.join()

    result = SchedulerInitResult([scheduler_info], wait_for_completion=wait_for_completion)
    return tokenizer_manager, None, own_port_args, result, None
