"""The engine's child processes: start them, wait until they are ready, kill them.

This module imports neither torch nor the tokenizer stack, so a launcher can start the
children first and import the rest while they start (``python -m sglang.launch_server`` does:
on a 2-core host the children's start-up and the launcher's imports then overlap instead of
following each other). The children's entry points live here or in equally light modules, as
a spawned child imports the module of its entry point before it runs.

:func:`start_engine_children` starts the processes of this node and returns a
:class:`StartingChildren`; :meth:`StartingChildren.wait_ready` collects their ready messages.
``sglang.srt.entrypoints.engine.launch_engine_processes`` does both and builds the
TokenizerManager.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import threading
from dataclasses import dataclass
from multiprocessing import connection as mp_connection
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from sglang.srt.managers.detokenizer_manager import (
    exit_when_parent_dies,
    run_detokenizer_process,
)
from sglang.srt.server_args import PortArgs, ServerArgs, rank_label
from sglang.srt.utils import kill_process_tree

logger = logging.getLogger(__name__)

# How often the launcher checks that its children are alive while the scheduler starts.
_READY_POLL_S = 0.5
# Upper bound on each step of shutdown, so that shutdown itself never hangs.
SHUTDOWN_STEP_TIMEOUT_S = 5.0


def _run_scheduler_child(
    server_args: ServerArgs,
    port_args: PortArgs,
    pipe_writer: Connection,
    dp_rank: int | None = None,
    tp_rank: int = 0,
    dist_init_method: str | None = None,
) -> None:
    """Entry of the scheduler process: it follows the launcher's death, then runs.
    ``dp_rank``: one data-parallel rank of ``server_args.dp_size``; ``tp_rank``: its rank in
    the replica's tensor-parallel group, which meets at ``dist_init_method``."""
    from sglang.srt.layers.batch_invariant import pin_cpu_blas_numerics
    from sglang.srt.managers.scheduler_process import run_scheduler_process

    if server_args.enable_deterministic_inference:
        pin_cpu_blas_numerics()  # before the first GEMM of this process
    exit_when_parent_dies()
    run_scheduler_process(server_args, port_args, pipe_writer, dp_rank, tp_rank, dist_init_method)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _tp_init_methods(server_args: ServerArgs) -> list[str | None]:
    """The rendezvous of each DP replica's TP group (None without TP): ``--dist-init-addr``
    (its port + the DP rank), else a free local port per replica."""
    if server_args.tp_size == 1:
        return [None] * server_args.dp_size
    if server_args.dist_init_addr is not None:
        host, _, port = server_args.dist_init_addr.rpartition(":")
        return [f"tcp://{host}:{int(port) + r}" for r in range(server_args.dp_size)]
    return [f"tcp://127.0.0.1:{_free_port()}" for _ in range(server_args.dp_size)]


def _scheduler_children(server_args: ServerArgs) -> list[tuple[str, str, Any, tuple]]:
    """(process name, label, entry, extra args) of each scheduler rank on this node, DP rank 0
    TP rank 0 first. Node k runs TP ranks k*tp/nnodes ... (k+1)*tp/nnodes - 1 of each replica."""
    dp, tp = server_args.dp_size, server_args.tp_size
    per_node = tp // server_args.nnodes
    first = server_args.node_rank * per_node
    children = []
    for dp_rank, init_method in enumerate(_tp_init_methods(server_args)):
        for tp_rank in range(first, first + per_node):
            name = "scheduler" + (f"-dp{dp_rank}" if dp > 1 else "") + (
                f"-tp{tp_rank}" if tp > 1 else ""
            )
            label = rank_label(dp_rank if dp > 1 else None, tp_rank, tp) or f"sglang-{name}"
            extra = (dp_rank if dp > 1 else None, tp_rank, init_method)
            children.append((name, label, _run_scheduler_child, extra))
    return children


def _engine_children(server_args: ServerArgs) -> list[tuple[str, str, Any, tuple]]:
    """(name, label, entry, extra args) of each child process; the scheduler (DP rank 0, TP
    rank 0) first. A node other than node 0 runs only its scheduler ranks."""
    from sglang.srt.managers.data_parallel_controller import (
        run_data_parallel_controller_process,
    )

    children = _scheduler_children(server_args)
    if server_args.node_rank > 0:
        return children
    if server_args.dp_size > 1:
        children.append(
            ("dp-controller", "sglang-dp-controller", run_data_parallel_controller_process, ())
        )
    return children + [("detokenizer", "sglang-detokenizer", run_detokenizer_process, ())]


def _start_children(
    server_args: ServerArgs, port_args: PortArgs
) -> tuple[list[BaseProcess], dict[Connection, tuple[BaseProcess, str]]]:
    """Start every child of this node; returns them and, per ready pipe, (process, label).
    Appends to the returned list as it goes, so a failure midway kills what started."""
    ctx = mp.get_context("spawn")
    procs: list[BaseProcess] = []
    readers: dict[Connection, tuple[BaseProcess, str]] = {}
    try:
        for name, label, target, extra in _engine_children(server_args):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=target,
                args=(server_args, port_args, writer, *extra),
                name=f"sglang-{name}",
            )
            proc.start()
            writer.close()  # the child's copy stays open: EOF on the reader means it died
            procs.append(proc)
            readers[reader] = (proc, label)
    except BaseException:
        kill_processes(procs)
        for reader in readers:
            reader.close()
        raise
    return procs, readers


def run_follower_node(server_args: ServerArgs) -> int:
    """Node ``--node-rank`` k > 0 of a multi-node engine: start this node's TP ranks (no HTTP,
    no frontend: node 0 serves), wait until they exit and return the exit status: 0 when all
    exited cleanly, 1 when one failed to start (logged as "TP rank R failed to start: ...")
    or died. When one rank exits, the others are stopped (they would fail anyway: their
    group lost a peer)."""
    port_args = PortArgs.init_new()  # unused: ranks other than TP rank 0 open no socket
    procs: list[BaseProcess] = []
    readers: dict[Connection, tuple[BaseProcess, str]] = {}
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)  # a stop: clean up, exit 0
    try:
        procs, readers = _start_children(server_args, port_args)
        _wait_for_ready(readers)
        logger.info(
            "Node %d: %s ready; serving until they exit",
            server_args.node_rank, ", ".join(label for _, label in readers.values()),
        )
        ended = mp_connection.wait([proc.sentinel for proc in procs])
        for proc in procs:
            if proc.sentinel in ended:
                proc.join(SHUTDOWN_STEP_TIMEOUT_S)  # its exit code (the sentinel came first)
        dead = [(proc, label) for proc, label in readers.values() if proc.exitcode is not None]
        logger.error(
            "Node %d: %s exited; stopping this node", server_args.node_rank,
            ", ".join(f"{label} (exit code {proc.exitcode})" for proc, label in dead),
        )
        return 0 if all(proc.exitcode == 0 for proc, _ in dead) else 1
    except RuntimeError as e:
        logger.error("Node %d failed to start: %s", server_args.node_rank, e)
        return 1
    except KeyboardInterrupt:
        logger.info("Node %d: stopping its ranks", server_args.node_rank)
        return 0
    finally:
        kill_processes(procs)
        for reader in readers:
            reader.close()
        remove_ipc_dir(port_args)


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def exit_on_signal(signum: int, frame: object) -> None:
    """A signal handler that unwinds (``finally`` blocks run) with exit status 128 + signum."""
    raise SystemExit(128 + signum)


def _wait_for_ready(
    readers: dict[Connection, tuple[BaseProcess, str]],
) -> dict[BaseProcess, dict]:
    """Each child's ready message (without its "status"), keyed by process.

    Raises RuntimeError with the first error a child reports, or naming the child that exited
    without reporting (by its label: "TP rank 1", "detokenizer", ...). Every child reports
    through its own pipe, so the cause named is the failing child's own message whichever
    process happens to exit first.
    """
    pending = dict(readers)
    ready: dict[BaseProcess, dict] = {}
    while pending:
        for ready_reader in mp_connection.wait(list(pending), timeout=_READY_POLL_S):
            assert isinstance(ready_reader, Connection), "we wait on pipe connections only"
            proc, label = pending.pop(ready_reader)
            try:
                msg: dict[str, Any] = ready_reader.recv()
            except EOFError:
                proc.join(SHUTDOWN_STEP_TIMEOUT_S)
                raise RuntimeError(
                    f"{label} exited with code {proc.exitcode} before reporting ready"
                ) from None
            if msg.get("status") != "ready":
                raise RuntimeError(f"{label} failed to start: {msg.get('message')}")
            ready[proc] = {k: v for k, v in msg.items() if k != "status"}
    return ready


def kill_processes(procs: list[BaseProcess]) -> None:
    """Kill each process with its descendants and reap it."""
    for proc in procs:
        if proc.pid is not None:
            kill_process_tree(proc.pid)
    for proc in procs:
        if proc.pid is not None:
            proc.join(SHUTDOWN_STEP_TIMEOUT_S)


def kill_engine_processes(procs: list[BaseProcess], port_args: PortArgs) -> None:
    """Kill the engine's processes (with their descendants), then remove the IPC directory."""
    kill_processes(procs)
    remove_ipc_dir(port_args)


def remove_ipc_dir(port_args: PortArgs) -> None:
    """Remove the private directory of the IPC sockets (after the processes are gone)."""
    path = port_args.tokenizer_ipc_name.removeprefix("ipc://")
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


@dataclass
class StartingChildren:
    """This node's child processes, started and not yet known to be ready. The scheduler
    (DP rank 0, TP rank 0) is ``procs[0]``; ``readers`` maps each child's ready pipe to it and
    its label."""

    port_args: PortArgs
    procs: list[BaseProcess]
    readers: dict[Connection, tuple[BaseProcess, str]]

    def wait_ready(self) -> dict[BaseProcess, dict]:
        """Each child's ready message (see :func:`_wait_for_ready`), then the pipes are closed.
        Raises RuntimeError as that function does; the caller then calls :meth:`kill`."""
        try:
            return _wait_for_ready(self.readers)
        finally:
            self.close_pipes()

    def close_pipes(self) -> None:
        """Close this side of the ready pipes (idempotent)."""
        for reader in self.readers:
            reader.close()

    def kill(self) -> None:
        """Kill the children (with their descendants) and remove the IPC directory."""
        self.close_pipes()
        kill_engine_processes(self.procs, self.port_args)

    def kill_on_sigterm(self) -> None:
        """From now until another handler replaces it, SIGTERM kills the children, removes the
        IPC directory and then ends this process by the signal, as the default action would.
        (A handler that raised instead could be swallowed by the code it interrupts, such as a
        third-party module being imported that catches every exception.)"""

        def handler(signum: int, frame: object) -> None:
            self.kill()
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

        signal.signal(signal.SIGTERM, handler)


def start_engine_children(server_args: ServerArgs) -> StartingChildren:
    """Start the scheduler rank(s), the data-parallel controller (DP > 1) and the detokenizer
    of node 0 without waiting for them. On failure nothing is left running."""
    port_args = PortArgs.init_new()
    try:
        procs, readers = _start_children(server_args, port_args)
    except BaseException:
        remove_ipc_dir(port_args)
        raise
    return StartingChildren(port_args, procs, readers)
