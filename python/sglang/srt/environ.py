"""The one module that reads environment variables (DESIGN §10): every other module asks here.

Only variables that belong to other tools are read (the engine's own knobs are ServerArgs).
"""

from __future__ import annotations

import os

_TRUE = ("1", "true", "on", "yes")


def triton_interpret_enabled() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``), which makes
    Triton kernels usable on CPU tensors (slowly: for tests)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


def prometheus_multiproc_dir() -> str | None:
    """prometheus_client's multi-process directory (``PROMETHEUS_MULTIPROC_DIR``), if set."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


def set_prometheus_multiproc_dir(path: str) -> None:
    """Set ``PROMETHEUS_MULTIPROC_DIR`` for this process and the processes it starts."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path


def profile_flag(name: str) -> bool:
    """Upstream's on-by-default profiler switches (``SGLANG_PROFILE_WITH_STACK``,
    ``SGLANG_PROFILE_RECORD_SHAPES``): off only for "0", "false", "no" or "off"."""
    return os.environ.get(name, "true").strip().lower() not in ("0", "false", "no", "off")


def torch_profiler_dir() -> str | None:
    """Where profiler traces go without an ``output_dir`` (``SGLANG_TORCH_PROFILER_DIR``)."""
    return os.environ.get("SGLANG_TORCH_PROFILER_DIR") or None


def start_port() -> int | None:
    """The first port ``get_open_port`` tries (``SGLANG_PORT``), if set."""
    port = os.environ.get("SGLANG_PORT")
    return None if port is None else int(port)


def host_ip() -> str | None:
    """This machine's address as the deployment states it (``SGLANG_HOST_IP``, then
    ``HOST_IP``), if set."""
    return os.environ.get("SGLANG_HOST_IP") or os.environ.get("HOST_IP") or None
