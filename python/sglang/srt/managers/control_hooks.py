"""What the weight and memory handlers may ask of the Scheduler core, and nothing more."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerHooks:
    """Callbacks into the Scheduler core, so WeightUpdater and MemoryOccupation depend on these
    few operations instead of on the whole scheduler (and tests can pass their own)."""

    abort_all: Callable[[str], int]  # finish every request with an abort; returns how many
    num_kv_holders: Callable[[], int]  # requests holding KV (running, chunked, paused in place)
    flush_cache: Callable[[], bool]  # full flush; False when refused (a request holds KV)
    invalidate_cache: Callable[[], None]  # make every cached prefix unmatchable
    num_alive: Callable[[], int]  # requests not finished (waiting, chunked, running)
