"""The package version: the upstream SGLang API level this build is compatible with, plus a
local label naming this engine (PEP 440), so that version gates in RL frameworks
(``sglang>=0.5.10.post1``, ``sglang==0.5.10.post1``) accept it. docs/compatibility.md says what
the promise covers."""

from __future__ import annotations

# The upstream release whose Python imports, Engine keywords and HTTP API this build mirrors.
UPSTREAM_API_VERSION = "0.5.10.post1"
LOCAL_LABEL = "interruptible"

__version__ = f"{UPSTREAM_API_VERSION}+{LOCAL_LABEL}"
