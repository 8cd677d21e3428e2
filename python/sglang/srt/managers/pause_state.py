"""The scheduler's pause state: mode resolution, the pause lease and the ``wait`` drain.

This module decides *what* a pause means; the Scheduler's handlers do the queue moves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from sglang.srt.managers.io_struct import PAUSE_MODES, PauseGenerationReqInput


class PauseModeError(ValueError):
    pass


# Spellings seen in the wild (the JAX port's docs write "in-place").
_ALIASES = {"in-place": "in_place", "inplace": "in_place"}


def resolve_pause_mode(mode: str, clear_cache: bool) -> tuple[str, bool]:
    """Map SGLang's and vLLM's vocabularies to (abort | retract | in_place | wait, flush).

    ========== ============ =====================
    requested  clear_cache  resolved
    ========== ============ =====================
    abort      any          abort (+ flush)
    retract    any          retract (+ flush)
    in_place   False        in_place (also spelled in-place)
    in_place   True         refused: KV is kept
    keep       False        in_place
    keep       True         retract + flush
    wait       any          wait (+ flush when drained)
    ========== ============ =====================
    """
    mode = _ALIASES.get(mode, mode)
    if mode not in PAUSE_MODES:
        raise PauseModeError(
            f"Unknown pause mode {mode!r}; expected one of {', '.join(PAUSE_MODES)}"
        )
    if mode == "keep":
        return ("retract", True) if clear_cache else ("in_place", False)
    if mode == "in_place" and clear_cache:
        raise PauseModeError("clear_cache is not possible with mode 'in_place' (its KV is kept)")
    return mode, clear_cache


@dataclass
class PauseState:
    """Set while the engine is paused (or draining for a ``wait`` pause)."""

    mode: str
    flush: bool
    since: float = field(default_factory=time.time)  # wall clock, reported to users
    # The pause lease: the engine continues by itself at this monotonic time.
    lease_deadline: float | None = None
    # ``wait`` mode: the request to answer once drained, and the drain deadline.
    pending: PauseGenerationReqInput | None = None
    drain_deadline: float | None = None

    @staticmethod
    def create(req: PauseGenerationReqInput, mode: str, flush: bool) -> PauseState:
        now = time.monotonic()
        deadline = None if req.timeout_s is None else now + req.timeout_s
        if mode == "wait":
            return PauseState(mode, flush, pending=req, drain_deadline=deadline)
        return PauseState(mode, flush, lease_deadline=deadline)

    @property
    def draining(self) -> bool:
        return self.pending is not None

    def lease_expired(self) -> bool:
        return self.lease_deadline is not None and time.monotonic() >= self.lease_deadline

    def drain_expired(self) -> bool:
        return self.drain_deadline is not None and time.monotonic() >= self.drain_deadline
