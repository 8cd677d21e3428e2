"""ZMQ sockets between the engine's processes (upstream's ``sglang.srt.utils.network``)."""

from __future__ import annotations

import zmq
import zmq.asyncio


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


def get_async_zmq_socket(
    context: zmq.asyncio.Context, socket_type: int, endpoint: str, bind: bool
) -> zmq.asyncio.Socket:
    """:func:`get_zmq_socket` for an asyncio context (its sockets' I/O is awaitable)."""
    sock = get_zmq_socket(context, socket_type, endpoint, bind)
    assert isinstance(sock, zmq.asyncio.Socket), "an asyncio context makes asyncio sockets"
    return sock
