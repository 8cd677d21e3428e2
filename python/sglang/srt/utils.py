"""Small shared helpers: ZMQ sockets, the one message serializer, type dispatch, processes."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
from collections.abc import Callable
from typing import Any

import zmq

logger = logging.getLogger(__name__)


def get_zmq_socket(context: zmq.Context, socket_type: int, endpoint: str, bind: bool) -> zmq.Socket:
    """A PUSH or PULL socket on ``endpoint`` with unbounded high-water marks."""
    sock = context.socket(socket_type)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


# The one serializer for inter-process messages (dataclasses from io_struct, tensors included).
def dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> Any:
    return pickle.loads(data)


class TypeBasedDispatcher:
    """Route a message to the handler registered for its exact type; unknown types raise."""

    def __init__(self, table: list[tuple[type, Callable[[Any], Any]]]) -> None:
        self._table = dict(table)

    def __call__(self, obj: Any) -> Any:
        handler = self._table.get(type(obj))
        if handler is None:
            raise TypeError(f"No handler for message type {type(obj).__name__}")
        return handler(obj)


def kill_process_tree(pid: int, include_self: bool = True) -> None:
    """Kill ``pid``'s children (and ``pid`` itself if asked), ignoring processes already gone."""
    try:
        import psutil
    except ImportError:  # psutil is optional; fall back to the direct pid only
        if include_self:
            _kill(pid)
        return
    try:
        parent = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    for child in parent.children(recursive=True):
        _kill(child.pid)
    if include_self:
        _kill(pid)


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
