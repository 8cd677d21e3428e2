"""Small shared helpers: the one message serializer, type dispatch, processes, and the process
setup helpers that RL frameworks import from upstream's ``sglang.srt.utils`` (same names and
signatures; docs/compatibility.md lists them)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import pickle
import resource
import signal
import socket
import tempfile
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as installed_version
from typing import Any

from packaging.version import Version

from sglang.srt import environ

logger = logging.getLogger(__name__)


# The one serializer for inter-process messages (dataclasses from io_struct, tensors included).
def dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> Any:
    return pickle.loads(data)


class TypeBasedDispatcher:
    """Route a message to the handler registered for its exact type; unknown types raise."""

    def __init__(self, table: list[tuple[type, Callable[[Any], Any]]]) -> None:
        self._table = dict(table)

    def register(self, msg_type: type, handler: Callable[[Any], Any]) -> None:
        """Route ``msg_type`` to ``handler`` (replacing any handler it had)."""
        self._table[msg_type] = handler

    def __call__(self, obj: Any) -> Any:
        handler = self._table.get(type(obj))
        if handler is None:
            raise TypeError(f"No handler for message type {type(obj).__name__}")
        return handler(obj)


def kill_process_tree(parent_pid: int, include_parent: bool = True) -> None:
    """SIGKILL every descendant of ``parent_pid``, and ``parent_pid`` itself when
    ``include_parent`` (upstream's signature). Processes already gone are skipped; with
    ``include_parent=False`` and ``parent_pid == os.getpid()`` the caller survives."""
    import psutil

    try:
        parent = psutil.Process(parent_pid)
    except psutil.NoSuchProcess:
        return
    for child in parent.children(recursive=True):
        _kill(child.pid)
    if include_parent:
        _kill(parent_pid)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def configure_logger(level: str, prefix: str = "") -> None:
    """Configure the root logger of a process (each subprocess calls this once)."""
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format=f"[%(asctime)s{prefix}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )


# ---- process setup helpers with upstream's names ---------------------------------------------
def is_port_available(port: int) -> bool:
    """Whether a TCP server could bind ``port`` on all interfaces right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def assert_pkg_version(pkg: str, min_version: str, message: str) -> None:
    """Raise when distribution ``pkg`` is missing or older than ``min_version`` (PEP 440
    order); ``message`` is appended to the error. Returns None when the version suffices."""
    try:
        found = installed_version(pkg)
    except PackageNotFoundError:
        raise RuntimeError(
            f"{pkg} with minimum required version {min_version} is not installed. {message}"
        ) from None
    if Version(found) < Version(min_version):
        raise RuntimeError(
            f"{pkg} is installed with version {found}, which is less than the minimum "
            f"required version {min_version}. {message}"
        )


@functools.cache
def is_cuda() -> bool:
    """Whether torch is a CUDA build and sees a CUDA device (False on ROCm and CPU)."""
    import torch

    return torch.version.cuda is not None and torch.cuda.is_available()


def set_ulimit(target_soft_limit: int = 65535) -> None:
    """Raise this process's soft limit of open files to ``target_soft_limit`` (capped at the
    hard limit), so many concurrent HTTP connections and IPC sockets fit. Never lowers it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = target_soft_limit if hard == resource.RLIM_INFINITY else min(target_soft_limit, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as e:
            logger.warning("Could not raise the open-file limit to %d: %s", target, e)


def set_prometheus_multiproc_dir() -> str:
    """Point prometheus_client's multi-process mode at a directory (a fresh temporary one
    unless ``PROMETHEUS_MULTIPROC_DIR`` is set already) and return it."""
    current = environ.prometheus_multiproc_dir()
    if current:
        return current
    path = tempfile.mkdtemp(prefix="sglang-prometheus-")
    environ.set_prometheus_multiproc_dir(path)
    return path


# Triton's FileCacheManager writes cache entries atomically (a per-process temporary file then a
# rename) since triton 3.0; older versions raced when several processes compiled one kernel.
_PROCESS_SAFE_TRITON = Version("3.0.0")


def maybe_set_triton_cache_manager() -> None:
    """Make Triton's kernel cache safe for several processes compiling at once. With triton
    >= 3.0 its own cache manager is (nothing to change); an older triton raises RuntimeError
    naming the fix, since this build does not ship a replacement cache manager."""
    try:
        found = Version(installed_version("triton"))
    except PackageNotFoundError:
        return  # no triton, no kernel cache
    if found < _PROCESS_SAFE_TRITON:
        raise RuntimeError(
            f"triton {found} races when several processes fill its kernel cache; "
            f"install triton>={_PROCESS_SAFE_TRITON}"
        )
