"""sglang: an SGLang-compatible serving engine with native interruptible sampling.

``import sglang`` is cheap: ``Engine`` and ``ServerArgs`` are imported on first use, so
importing the package does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sglang.version import __version__

__all__ = ["Engine", "ServerArgs", "__version__"]

if TYPE_CHECKING:
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.server_args import ServerArgs


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from sglang.srt.entrypoints.engine import Engine

        return Engine
    if name == "ServerArgs":
        from sglang.srt.server_args import ServerArgs

        return ServerArgs
    raise AttributeError(f"module 'sglang' has no attribute {name!r}")
