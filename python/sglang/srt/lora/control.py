"""Adapter-scoped control (docs/lora.md): load / unload, and pause / continue / abort of one
LoRA adapter while every other adapter and the base model keep running.

:class:`LoRAControl` decides and answers; the queue moves it needs are the Scheduler core's
lifecycle methods (``retract_where``, ``abort_where``, ``set_paused``), so the core stays the
only owner of the waiting queue and the running batch.

State of one adapter ``A``::

    RUNNING ── pause(abort | retract | in_place) ──────────────► PAUSED(mode)
       │  └─ pause(wait) ─► DRAINING ── A's running requests ───►│   (timeout_s: the
       │                    (A admits nothing)  finished           │    stragglers retract)
       └◄──────────────── continue(lora_name=A) ◄─────────────────┘

PAUSED: A's requests are neither admitted nor decoded (in_place ones keep their KV);
DRAINING: A admits nothing new, its running requests decode to the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sglang.srt.lora.adapter import LoRAError
from sglang.srt.managers.io_struct import (
    ContinueGenerationReqInput,
    ContinueGenerationReqOutput,
    LoadLoRAAdapterFromTensorsReqInput,
    LoadLoRAAdapterReqInput,
    LoRAPauseStateOutput,
    LoRAUpdateOutput,
    PauseGenerationReqInput,
    PauseGenerationReqOutput,
    UnloadLoRAAdapterReqInput,
)
from sglang.srt.managers.pause_state import PauseModeError, resolve_pause_mode
from sglang.srt.managers.weight_updater import agree_on_refusal

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler import Scheduler

_NOT_ENABLED = "LoRA is not enabled (start with --enable-lora)"


class LoRAControl:
    def __init__(self, core: Scheduler, lora: Any) -> None:
        """``lora``: the worker's LoRAManager (None when LoRA is off)."""
        self.core = core
        self.lora = lora
        self.paused: dict[str, str] = {}  # adapter -> the mode it was paused with
        # adapter -> (its ``wait`` pause, answered once drained; the drain's deadline)
        self.draining: dict[str, tuple[PauseGenerationReqInput, float | None]] = {}

    # ---- what the scheduler asks each turn ---------------------------------------------------
    def no_decode(self) -> set[str]:
        """Adapters whose requests must not decode."""
        return set(self.paused)

    def no_admission(self) -> set[str]:
        """Adapters whose waiting requests must not be admitted."""
        return set(self.paused) | set(self.draining)

    def is_loaded(self, name: str) -> bool:
        return self.lora is not None and name in self.lora.loaded

    def version_of(self, req: Req) -> str | None:
        """The weight label of ``req``'s adapter (None: the base model's label applies)."""
        name = req.lora_name
        return None if name is None or not self.is_loaded(name) else str(self.lora.version(name))

    def has_drain_to_answer(self) -> bool:
        return any(not self._reqs(name)[0] for name in self.draining)

    def check_drains(self) -> None:
        """End each drain whose adapter has no request holding KV left, or whose deadline
        passed (its stragglers are retracted); the adapter is then paused."""
        now = time.monotonic()
        for name, (recv, deadline) in list(self.draining.items()):
            holders, _ = self._reqs(name)
            if holders and (deadline is None or now < deadline):
                continue
            del self.draining[name]
            self.paused[name] = "wait"
            num = self.core.retract_where(_of_adapter(name)) if holders else 0
            self.core.reply(self._paused_reply(recv, "wait", num_retracted=num))

    def announce(self) -> None:
        """Tell the frontend which adapters now refuse admission (paused or draining)."""
        self.core.reply(LoRAPauseStateOutput(sorted(self.no_admission())))

    def internal_state(self) -> dict[str, Any]:
        return {
            "lora_adapters": [] if self.lora is None else self.lora.describe(),
            "paused_loras": dict(self.paused),
            "draining_loras": sorted(self.draining),
        }

    # ---- load / unload -----------------------------------------------------------------------
    def handle_load(
        self, recv: LoadLoRAAdapterReqInput | LoadLoRAAdapterFromTensorsReqInput
    ) -> LoRAUpdateOutput:
        """Load an adapter (from disk or pushed tensors), or reload one over its name (an
        adapter weight update): refused while requests of it hold KV, unless it is paused."""
        if self.lora is None:
            return self._reply(recv.req_id, _NOT_ENABLED)
        name = recv.lora_name
        holders, _ = self._reqs(name)
        if name in self.lora.loaded and holders and name not in self.paused:
            return self._reply(
                recv.req_id,
                f"LoRA adapter {name!r} is loaded and {len(holders)} of its requests are "
                "running; pause it first (pause_generation with lora_name) to update it",
            )
        adapter = None
        try:
            if isinstance(recv, LoadLoRAAdapterReqInput):
                adapter = self.lora.prepare(name, recv.lora_path)
            else:
                label = f"<tensors of {name}>"
                adapter = self.lora.prepare(name, label, recv.tensors, recv.config_dict)
            error = None
        except Exception as e:  # whatever is on disk or was sent: a refusal changes nothing
            error = str(e) if isinstance(e, LoRAError) else f"{type(e).__name__}: {e}"
        # Every TP rank read and sliced the adapter itself: all of them commit, or none.
        error = agree_on_refusal(error)
        if error is not None:
            return self._reply(recv.req_id, error)
        assert adapter is not None  # prepared without a refusal
        self.lora.commit(adapter, recv.weight_version)
        return self._reply(recv.req_id)

    def handle_unload(self, recv: UnloadLoRAAdapterReqInput) -> LoRAUpdateOutput:
        """Unload an adapter; refused while any request of it is running or waiting."""
        if self.lora is None:
            return self._reply(recv.req_id, _NOT_ENABLED)
        name = recv.lora_name
        if name not in self.lora.loaded:
            return self._reply(recv.req_id, f"LoRA adapter {name!r} is not loaded")
        holders, waiting = self._reqs(name)
        if holders or waiting:
            return self._reply(
                recv.req_id,
                f"LoRA adapter {name!r} has {len(holders) + len(waiting)} request(s) running "
                "or waiting; abort them (abort_request with lora_name) or let them finish",
            )
        self.lora.unload(name)
        if self.paused.pop(name, None) is not None:
            self.announce()
        return self._reply(recv.req_id)

    # ---- pause / continue --------------------------------------------------------------------
    def pause(self, recv: PauseGenerationReqInput) -> PauseGenerationReqOutput | None:
        """Pause one adapter's requests (DESIGN §5 modes, scoped); None while a ``wait``
        drains (answered by :meth:`check_drains`)."""
        name = recv.lora_name
        assert name is not None
        try:
            if not self.is_loaded(name):
                raise PauseModeError(f"LoRA adapter {name!r} is not loaded")
            mode, flush = resolve_pause_mode(recv.mode, recv.clear_cache)
            if flush or (recv.timeout_s is not None and mode != "wait"):
                raise PauseModeError(
                    "clear_cache and a lease (timeout_s) are not supported with lora_name "
                    "(an adapter update starts a fresh prefix-cache namespace by itself)"
                )
            if recv.timeout_s is not None and not recv.timeout_s > 0:
                raise PauseModeError(f"timeout_s must be > 0, got {recv.timeout_s}")
        except PauseModeError as e:
            return PauseGenerationReqOutput(success=False, message=str(e), req_id=recv.req_id)
        self._end_drain(name)  # a newer pause supersedes a drain
        mine = lambda r: r.lora_name == name
        if mode == "wait":
            deadline = None if recv.timeout_s is None else time.monotonic() + recv.timeout_s
            self.paused.pop(name, None)
            self.core.set_paused(mine, False)
            self.draining[name] = (recv, deadline)
            self.announce()
            self.check_drains()
            return None
        self.paused[name] = mode
        self.announce()
        num_aborted = num_retracted = 0
        if mode == "abort":
            num_aborted = self.core.abort_where(mine, "Aborted by pause_generation")
        else:
            num_retracted = self.core.retract_where(mine, running=mode == "retract")
            self.core.set_paused(mine, True)
        return self._paused_reply(recv, mode, num_retracted, num_aborted)

    def cont(self, recv: ContinueGenerationReqInput) -> ContinueGenerationReqOutput:
        """Resume an adapter paused by name (its in-place requests decode again)."""
        name = recv.lora_name or ""
        self._end_drain(name)
        was_paused = self.paused.pop(name, None) is not None
        self.core.set_paused(_of_adapter(name), False)
        self.announce()
        return ContinueGenerationReqOutput(success=True, was_paused=was_paused, req_id=recv.req_id)

    # ---- helpers -----------------------------------------------------------------------------
    def _end_drain(self, name: str) -> None:
        """Answer a pending ``wait`` pause of ``name`` now (as if it had drained)."""
        pending = self.draining.pop(name, None)
        if pending is not None:
            self.paused[name] = "wait"
            self.core.reply(self._paused_reply(pending[0], "wait"))

    def _reqs(self, name: str) -> tuple[list[Req], list[Req]]:
        """(KV holders, waiting requests) of adapter ``name``."""
        holders = [r for r in self.core.kv_holders() if r.lora_name == name]
        return holders, [r for r in self.core.waiting_queue if r.lora_name == name]

    def _paused_reply(
        self, recv: PauseGenerationReqInput, mode: str, num_retracted: int = 0,
        num_aborted: int = 0,
    ) -> PauseGenerationReqOutput:
        holders, waiting = self._reqs(recv.lora_name or "")
        return PauseGenerationReqOutput(
            success=True,
            message="Generation paused successfully.",
            mode=mode,
            num_running=len(holders),
            num_retracted=num_retracted,
            num_aborted=num_aborted,
            num_waiting=len(waiting),
            req_id=recv.req_id,
        )

    def _reply(self, req_id: str, error: str = "") -> LoRAUpdateOutput:
        described = [] if self.lora is None else self.lora.describe()
        loaded = {d["lora_name"]: d["lora_path"] for d in described}
        return LoRAUpdateOutput(not error, error, loaded, req_id)


def _of_adapter(name: str) -> Callable[[Req], bool]:
    """The predicate "request of adapter ``name``"."""
    return lambda req: req.lora_name == name
