"""Scheduler-side LoRA rules, as pure functions over requests (the Scheduler core applies them).

* A step never holds more distinct adapters than ``--max-loras-per-batch`` (the slots): a
  waiting request of another adapter waits until one of the running adapters has no request
  left. The base model (``lora_name`` None) takes no slot.
* Requests of an adapter paused by name (``pause_generation(lora_name=...)``) are neither
  admitted nor decoded; the rest of the batch runs on.
"""

from __future__ import annotations

from collections.abc import Iterable

from sglang.srt.managers.schedule_batch import Req


def admissible(
    waiting: list[Req], running: Iterable[Req], paused: set[str], max_loras: int
) -> list[Req]:
    """The waiting requests that may be admitted now, in queue order."""
    in_use = {r.lora_name for r in running if r.lora_name is not None}
    out = []
    for req in waiting:
        name = req.lora_name
        if name is not None:
            if name in paused:
                continue
            if name not in in_use:
                if len(in_use) >= max_loras:
                    continue
                in_use.add(name)
        out.append(req)
    return out


def unpaused(reqs: list[Req], paused: set[str]) -> list[Req]:
    """``reqs`` without the requests of paused adapters."""
    if not paused:
        return reqs
    return [r for r in reqs if r.lora_name not in paused]
