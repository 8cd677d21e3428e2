"""Shared helpers (upstream's ``sglang.srt.utils`` package: the names RL frameworks import
from it live here, with upstream's signatures; docs/compatibility.md lists them)."""

from __future__ import annotations

from sglang.srt.utils.common import (
    TypeBasedDispatcher,
    assert_pkg_version,
    configure_logger,
    dumps,
    is_cuda,
    is_port_available,
    kill_process_tree,
    loads,
    maybe_set_triton_cache_manager,
    set_prometheus_multiproc_dir,
    set_ulimit,
)
from sglang.srt.utils.multiprocessing_serializer import MultiprocessingSerializer
from sglang.srt.utils.network import (
    get_free_port,
    get_ip,
    get_local_ip_auto,
    get_open_port,
    get_zmq_socket,
)

__all__ = [
    "MultiprocessingSerializer",
    "TypeBasedDispatcher",
    "assert_pkg_version",
    "configure_logger",
    "dumps",
    "get_free_port",
    "get_ip",
    "get_local_ip_auto",
    "get_open_port",
    "get_zmq_socket",
    "is_cuda",
    "is_port_available",
    "kill_process_tree",
    "loads",
    "maybe_set_triton_cache_manager",
    "set_prometheus_multiproc_dir",
    "set_ulimit",
]
