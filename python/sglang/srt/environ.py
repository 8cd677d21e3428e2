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
