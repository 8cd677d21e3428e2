"""The scheduler's pause state machine: mode resolution, the pause lease and the ``wait`` drain.

One owner: the Scheduler core holds the only :class:`PauseState`; the TokenizerManager mirrors
what the scheduler reports (``PauseStateOutput``) and keeps no clock of its own. This module
decides *what* a pause means; the Scheduler's lifecycle methods do the queue moves::

                 pause(abort | retract | in_place)
    RUNNING ─────────────────────────────────────────► PAUSED
       ▲  │  pause(wait)                                 │ ▲
       │  └──────────────► DRAINING ── drained ─────────►│ │ (or the drain's timeout:
       │                      │         or timed out     │ │  stragglers are retracted)
       └── continue ──────────┘                          │ │
       └── continue, or the lease (timeout_s) expired ◄──┘ │
                                   a newer pause ──────────┘
"""

from __future__ import annotations

import enum
import time

from sglang.srt.managers.io_struct import PAUSE_MODES, PauseGenerationReqInput


class PauseModeError(ValueError):
    pass


class PausePhase(enum.Enum):
    RUNNING = "running"  # admitting and decoding
    DRAINING = "draining"  # a ``wait`` pause: running requests finish, nothing new is admitted
    PAUSED = "paused"  # nothing is admitted or decoded


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
    if not isinstance(mode, str):
        raise PauseModeError(f"mode must be a string, got {type(mode).__name__}")
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


class PauseState:
    """Phase, mode and deadlines of the engine's pause. Transitions only through the methods
    below; every reader asks :attr:`phase` (or the two predicates).

    Deadlines (the lease, the ``wait`` drain) are read from this process's clock, unless
    :meth:`follow_leader_clock` was called: tensor-parallel ranks must take the same decision
    at the same loop turn, so TP rank 0 alone reads its clock (:meth:`deadline_due`) and
    sends the verdict with the turn's inputs; every rank then applies it (:meth:`expire`).
    """

    def __init__(self) -> None:
        self.local_clock = True
        self._reset()

    def follow_leader_clock(self) -> None:
        """Decide deadlines only through :meth:`expire` (a tensor-parallel rank)."""
        self.local_clock = False

    def _reset(self) -> None:
        self.phase = PausePhase.RUNNING
        self.mode: str | None = None  # resolved mode while not RUNNING
        self.flush = False  # flush the cache once paused (clear_cache / keep+clear)
        self.since: float | None = None  # wall clock of the pause, reported to users
        # The lease: the engine continues by itself at this monotonic time (PAUSED only).
        self.lease_deadline: float | None = None
        # ``wait`` mode: the request to answer once drained, and the drain's deadline.
        self.pending: PauseGenerationReqInput | None = None
        self.drain_deadline: float | None = None
        self._expired = False  # the leader said the current deadline has passed

    # ---- predicates --------------------------------------------------------------------------
    @property
    def paused(self) -> bool:
        """True unless RUNNING (what users see as ``engine_paused``)."""
        return self.phase is not PausePhase.RUNNING

    def admits_new(self) -> bool:
        """New requests may start their prefill (RUNNING only)."""
        return self.phase is PausePhase.RUNNING

    def allows_forward(self) -> bool:
        """Admitted requests may run (RUNNING, or DRAINING until they finish)."""
        return self.phase is not PausePhase.PAUSED

    def lease_expired(self) -> bool:
        return self.phase is PausePhase.PAUSED and self._passed(self.lease_deadline)

    def drain_expired(self) -> bool:
        return self.phase is PausePhase.DRAINING and self._passed(self.drain_deadline)

    def _passed(self, deadline: float | None) -> bool:
        if deadline is None:
            return False
        return time.monotonic() >= deadline if self.local_clock else self._expired

    def deadline_due(self) -> bool:
        """By this process's clock, whether the deadline of the current phase (the lease
        while PAUSED, the drain's while DRAINING) has passed: what TP rank 0 decides for
        every rank at the start of a loop turn."""
        deadline = {PausePhase.PAUSED: self.lease_deadline,
                    PausePhase.DRAINING: self.drain_deadline}.get(self.phase)
        return deadline is not None and time.monotonic() >= deadline

    def expire(self) -> None:
        """The leader's verdict: the current deadline has passed (until the next transition,
        which starts a new deadline or none)."""
        self._expired = True

    # ---- transitions -------------------------------------------------------------------------
    def start(self, recv: PauseGenerationReqInput, mode: str, flush: bool) -> None:
        """RUNNING/PAUSED/DRAINING -> PAUSED, or -> DRAINING for ``wait``. A pending drain must
        have been answered first (:meth:`end_drain`)."""
        assert self.pending is None, "answer the pending wait pause before a new pause"
        now = time.monotonic()
        deadline = None if recv.timeout_s is None else now + recv.timeout_s
        self.mode, self.flush, self.since = mode, flush, time.time()
        self._expired = False
        if mode == "wait":
            self.phase = PausePhase.DRAINING
            self.pending, self.drain_deadline, self.lease_deadline = recv, deadline, None
        else:
            self.phase = PausePhase.PAUSED
            self.lease_deadline, self.drain_deadline = deadline, None

    def end_drain(self) -> PauseGenerationReqInput:
        """DRAINING -> PAUSED; returns the ``wait`` request to answer now."""
        assert self.pending is not None, "no drain in progress"
        recv, self.pending = self.pending, None
        self.phase, self.drain_deadline = PausePhase.PAUSED, None
        self._expired = False
        return recv

    def resume(self) -> None:
        """Any phase -> RUNNING (continue_generation, or the lease expired)."""
        self._reset()
