"""The scheduler's release_memory_occupation / resume_memory_occupation handlers (docs/memory.md).

RL frameworks that share a device between trainer and rollout engine free the engine's memory
while they train, then bring it back to sync weights and generate again::

    pause_generation(mode="retract")            # or wait for the rollout to end
    release_memory_occupation()                 # KV cache and weights freed
    ... train ...
    resume_memory_occupation(tags=["weights"])
    update_weights_from_tensor(...)             # or from disk
    resume_memory_occupation(tags=["kv_cache"])
    continue_generation()

Rules: a release is refused while a request holds KV (running, chunked, or paused in place);
requests waiting in the queue (retracted ones included) hold none and simply wait. While any
tag is released nothing is scheduled; weight updates and reads are refused while the weights
are. Releasing the KV cache flushes the prefix cache first. Resumed weights are reloaded from
the checkpoint they last came from on disk; after a tensor update (no file to re-read) they
come back zero-filled and must be pushed again before generating. Both calls are idempotent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from sglang.srt.managers.control_hooks import SchedulerHooks
from sglang.srt.managers.io_struct import (
    ReleaseMemoryOccupationReqInput,
    ReleaseMemoryOccupationReqOutput,
    ResumeMemoryOccupationReqInput,
    ResumeMemoryOccupationReqOutput,
)

logger = logging.getLogger(__name__)

KV_CACHE, WEIGHTS, CUDA_GRAPH = "kv_cache", "weights", "cuda_graph"
# Upstream's tags. The CUDA graphs read the weights and the KV pool: releasing either drops
# them too, and they are captured again once all three are back (nothing to do without graphs).
MEMORY_TAGS = (KV_CACHE, WEIGHTS, CUDA_GRAPH)


def resolve_tags(tags: list[str] | None) -> list[str]:
    """``tags`` checked and de-duplicated (None = all); ValueError naming a wrong one."""
    if tags is None:
        return list(MEMORY_TAGS)
    if isinstance(tags, str) or not isinstance(tags, list):
        raise ValueError(f"tags must be a list of {list(MEMORY_TAGS)} or null, got {tags!r}")
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise ValueError(f"unknown memory tag(s) {unknown}; known: {list(MEMORY_TAGS)}")
    return [t for t in MEMORY_TAGS if t in tags]


class MemoryBackend(Protocol):
    """The owner of the memory (the ModelRunner)."""

    def release_kv_cache(self) -> None: ...
    def resume_kv_cache(self) -> None: ...
    def release_weights(self) -> None: ...
    def resume_weights(self) -> None: ...
    def release_cuda_graph(self) -> None: ...
    def resume_cuda_graph(self) -> None: ...


class MemoryOccupation:
    """Which memory of one scheduler is released. Owns that set; the memory itself stays with
    the ModelRunner (weights, KV pool).

    ``restore_weights`` is called after the weights were re-allocated (the WeightUpdater's
    ``restore_after_resume``); it returns a note for the caller.
    """

    def __init__(
        self, backend: MemoryBackend, hooks: SchedulerHooks, restore_weights: Callable[[], str]
    ) -> None:
        self.backend = backend
        self.hooks = hooks
        self.restore_weights = restore_weights
        self.released: set[str] = set()

    def blocks_forward(self) -> bool:
        """True while weights or KV cache are released: the scheduler runs nothing."""
        return bool(self.released & {KV_CACHE, WEIGHTS})

    def weights_released(self) -> bool:
        return WEIGHTS in self.released

    def release(self, recv: ReleaseMemoryOccupationReqInput) -> ReleaseMemoryOccupationReqOutput:
        try:
            tags = resolve_tags(recv.tags)
        except ValueError as e:
            return ReleaseMemoryOccupationReqOutput(False, str(e), self._state(), recv.req_id)
        holders = self.hooks.num_kv_holders()
        if holders:
            message = (
                f"{holders} request(s) hold KV cache (running or paused in place); pause with "
                "mode 'retract' or 'abort' (or let them finish) before releasing memory"
            )
            return ReleaseMemoryOccupationReqOutput(False, message, self._state(), recv.req_id)
        new = [t for t in tags if t not in self.released]
        if new:
            # Before the tensors they read are freed (a no-op when already dropped).
            self.backend.release_cuda_graph()
        if KV_CACHE in new:
            flushed = self.hooks.flush_cache()
            assert flushed, "a flush with no KV holder cannot be refused"
            self.backend.release_kv_cache()
        if WEIGHTS in new:
            self.backend.release_weights()
        self.released.update(new)
        logger.info("Released memory: %s", new or "nothing new")
        message = f"Released {new}." if new else "Already released."
        return ReleaseMemoryOccupationReqOutput(True, message, self._state(), recv.req_id)

    def resume(self, recv: ResumeMemoryOccupationReqInput) -> ResumeMemoryOccupationReqOutput:
        try:
            tags = resolve_tags(recv.tags)
        except ValueError as e:
            return ResumeMemoryOccupationReqOutput(False, str(e), self._state(), recv.req_id)
        back = [t for t in tags if t in self.released]
        notes = []
        if WEIGHTS in back:
            self.backend.resume_weights()
            notes.append(self.restore_weights())
        if KV_CACHE in back:
            self.backend.resume_kv_cache()
        self.released.difference_update(back)
        if back and not self.released:
            self.backend.resume_cuda_graph()
        logger.info("Resumed memory: %s", back or "nothing released")
        message = " ".join([f"Resumed {back}." if back else "Nothing to resume.", *notes])
        return ResumeMemoryOccupationReqOutput(True, message, self._state(), recv.req_id)

    def _state(self) -> list[str]:
        return [t for t in MEMORY_TAGS if t in self.released]
