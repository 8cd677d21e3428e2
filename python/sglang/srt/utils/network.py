"""ZMQ sockets between the engine's processes, and the port and address helpers RL frameworks
import (upstream's ``sglang.srt.utils.network``)."""

from __future__ import annotations

import socket

import zmq
import zmq.asyncio

from sglang.srt import environ
from sglang.srt.utils.common import is_port_available


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


def get_free_port() -> int:
    """A TCP port free on every interface now (the OS picks it; it may be taken later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def get_open_port() -> int:
    """As upstream: the first free port from ``$SGLANG_PORT`` upwards when it is set, else
    :func:`get_free_port`."""
    port = environ.start_port()
    if port is None:
        return get_free_port()
    while not is_port_available(port):
        port += 1
    return port


def get_ip() -> str:
    """This machine's outward IP address: ``$SGLANG_HOST_IP`` / ``$HOST_IP`` when set, else the
    source address of a route to a public address (a UDP connect sends nothing), else
    127.0.0.1."""
    stated = environ.host_ip()
    if stated is not None:
        return stated
    for family, target in ((socket.AF_INET, "8.8.8.8"), (socket.AF_INET6, "2001:4860:4860::8888")):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as sock:
                sock.connect((target, 80))
                return str(sock.getsockname()[0])
        except OSError:
            continue
    return "127.0.0.1"


def get_local_ip_auto(fallback: str | None = None) -> str:
    """Upstream's name for :func:`get_ip` (``fallback`` is returned instead of 127.0.0.1 when
    no route was found and it is given)."""
    ip = get_ip()
    return fallback if ip == "127.0.0.1" and fallback is not None else ip
