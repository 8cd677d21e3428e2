"""The Scheduler core's LoRA rules with the scripted worker (no model): adapter-scoped pause
step by step, the slot limit, load / unload gates. Real adapters: test_lora.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from scheduler_test_utils import control, expected_output, make_core, run_until_idle, submit

from sglang.srt.lora.adapter import LoRAError
from sglang.srt.managers.io_struct import (
    AbortReq,
    ContinueGenerationReqInput,
    LoadLoRAAdapterReqInput,
    LoRAPauseStateOutput,
    PauseGenerationReqInput,
    UnloadLoRAAdapterReqInput,
)
from sglang.srt.managers.schedule_batch import ReqStatus

PROMPT_A, PROMPT_B = [11, 12, 13, 14], [21, 22, 23]
N = 12


class FakeLoRA:
    """The LoRAManager surface the scheduler uses, with no weights."""

    def __init__(self, names: list[str]) -> None:
        self.loaded = {n: i + 1 for i, n in enumerate(names)}
        self.versions = dict.fromkeys(names, "1")

    def uid(self, name: str | None) -> int:
        return 0 if name is None else self.loaded[name]

    def version(self, name: str) -> str:
        return self.versions[name]

    def prepare(self, name: str, path: str, *_: Any) -> str:
        """Checks only; the "adapter" is its name (commit gets it back)."""
        if path == "bad":
            raise LoRAError("bad adapter")
        return name

    def commit(self, name: str, version: str | None = None) -> None:
        self.loaded[name] = max(self.loaded.values(), default=0) + 1
        self.versions[name] = version or "2"

    def unload(self, name: str) -> None:
        del self.loaded[name]

    def describe(self) -> list[dict]:
        return [{"lora_name": n, "lora_path": f"/p/{n}"} for n in self.loaded]


@pytest.fixture
def core_of(tiny_model_dir: Callable[..., Path]) -> Callable[..., Any]:
    def make(**kw: Any) -> Any:
        core, _, sink = make_core(str(tiny_model_dir("llama")), **kw)
        core.lora = core.lora_ctl.lora = FakeLoRA(["a", "b", "c"])
        core.kv.lora_uid = core.lora.uid
        return core, sink

    return make


def outputs(sink: Any, rid: str) -> list[int]:
    rec = sink.by_rid.get(rid)
    return [] if rec is None else rec.output_ids


@pytest.mark.parametrize("mode", ["in_place", "retract", "abort"])
def test_paused_adapter_stops_and_the_other_never_stalls(core_of: Callable, mode: str) -> None:
    core, sink = core_of()
    vocab = core.model_config.vocab_size
    submit(core, "A", PROMPT_A, N, lora_path="a")
    submit(core, "B", PROMPT_B, N, lora_path="b")
    for _ in range(3):
        core.run_step()
    reply = control(core, sink, PauseGenerationReqInput(mode=mode, lora_name="a"))
    assert reply.success and reply.mode == mode
    assert sink.last_reply(LoRAPauseStateOutput).paused == ["a"]  # the frontend's mirror
    num_a = len(core.running_batch.reqs[0].output_ids) if mode == "in_place" else None
    held_a = [r for r in core.kv_holders() if r.lora_name == "a"]
    assert len(held_a) == (1 if mode == "in_place" else 0)
    if held_a:
        assert held_a[0].status is ReqStatus.PAUSED
    submit(core, "A2", PROMPT_A, 2, lora_path="a")  # waits while a is paused
    b_len = len([r for r in core.running_batch.reqs if r.rid == "B"][0].output_ids)
    while not sink.finished("B"):
        assert core.run_step()  # every step runs, and decodes B
        b_len += 1
        b = [r for r in core.running_batch.reqs if r.rid == "B"]
        assert not b or len(b[0].output_ids) == b_len
        core.check_invariants()
    assert outputs(sink, "B") == expected_output(PROMPT_B, N, vocab)
    assert not core.has_runnable_work()  # a paused adapter's requests are no busy work
    assert [r.rid for r in core.waiting_queue] == (["A2"] if mode != "retract" else ["A", "A2"])
    if num_a is not None:
        assert len(held_a[0].output_ids) == num_a  # paused in place: nothing decoded
    control(core, sink, ContinueGenerationReqInput(lora_name="a"))
    assert sink.last_reply(LoRAPauseStateOutput).paused == []
    run_until_idle(core)
    if mode == "abort":
        assert sink.by_rid["A"].finished_reasons[0]["type"] == "abort"
        assert outputs(sink, "A") == expected_output(PROMPT_A, N, vocab)[: len(outputs(sink, "A"))]
    else:
        assert outputs(sink, "A") == expected_output(PROMPT_A, N, vocab)
    assert outputs(sink, "A2") == expected_output(PROMPT_A, 2, vocab)
    assert core.flush_cache().success


def test_slot_limit(core_of: Callable) -> None:
    core, sink = core_of(max_loras_per_batch=2)
    for rid, lora in (("A", "a"), ("B", "b"), ("C", "c"), ("D", None), ("A2", "a")):
        submit(core, rid, PROMPT_A, 4 if rid != "A" else 8, lora_path=lora)
    seen = []
    while core.has_runnable_work():
        core.run_step()
        names = {r.lora_name for r in core.kv_holders()} - {None}
        assert len(names) <= 2
        seen.append(names)
    assert {"a", "b"} in seen and any("c" in s for s in seen)  # c ran once a slot freed
    assert all(sink.finished(r) for r in ("A", "B", "C", "D", "A2"))


def test_load_unload_gates(core_of: Callable) -> None:
    core, sink = core_of()
    submit(core, "A", PROMPT_A, N, lora_path="a")
    core.run_step()
    out = control(core, sink, UnloadLoRAAdapterReqInput("a"))
    assert not out.success and "1 request(s) running or waiting" in out.error_message
    out = control(core, sink, LoadLoRAAdapterReqInput("a", "/p/a2"))
    assert not out.success and "pause it first" in out.error_message
    control(core, sink, PauseGenerationReqInput(mode="in_place", lora_name="a"))
    out = control(core, sink, LoadLoRAAdapterReqInput("a", "/p/a2", weight_version="v2"))
    assert out.success and set(out.loaded_adapters) == {"a", "b", "c"}
    assert not control(core, sink, LoadLoRAAdapterReqInput("x", "bad")).success
    assert control(core, sink, AbortReq(lora_name="a")).num_aborted == 1
    assert control(core, sink, UnloadLoRAAdapterReqInput("a")).success
    assert core.internal_state()["paused_loras"] == {}  # unloading forgets its pause
    submit(core, "Z", PROMPT_A, 2, lora_path="a")  # no longer loaded: refused, not queued
    assert sink.by_rid["Z"].finished_reasons[0]["message"] == "LoRA adapter 'a' is not loaded"
    bad = control(core, sink, PauseGenerationReqInput(mode="retract", clear_cache=True,
                                                      lora_name="b"))
    assert not bad.success and "not supported with lora_name" in bad.message
    assert core.internal_state()["paused_loras"] == {}


@pytest.mark.parametrize("timeout_s", [None, 1e-6])
def test_wait_drains_one_adapter(core_of: Callable, timeout_s: float | None) -> None:
    """wait: a's running request decodes to its end (or, past timeout_s, is retracted), a's
    new requests are not admitted, b runs on; the reply comes once drained."""
    core, sink = core_of()
    vocab = core.model_config.vocab_size
    submit(core, "A", PROMPT_A, N, lora_path="a")
    submit(core, "B", PROMPT_B, 2 * N, lora_path="b")
    core.run_step()
    msg = PauseGenerationReqInput(mode="wait", lora_name="a", timeout_s=timeout_s)
    first = control(core, sink, msg)
    if timeout_s is None:
        assert first is None  # draining: answered later
        assert core.internal_state()["draining_loras"] == ["a"]
    submit(core, "A2", PROMPT_A, 2, lora_path="a")
    run_until_idle(core)
    reply = [r for r in sink.replies if getattr(r, "req_id", None) == msg.req_id]
    assert len(reply) == 1 and reply[0].success and reply[0].mode == "wait"
    assert core.internal_state()["paused_loras"] == {"a": "wait"}
    assert outputs(sink, "B") == expected_output(PROMPT_B, 2 * N, vocab)
    assert [r.rid for r in core.waiting_queue][-1] == "A2" and not sink.finished("A2")
    if timeout_s is None:
        assert outputs(sink, "A") == expected_output(PROMPT_A, N, vocab)
        assert reply[0].num_retracted == 0
    else:
        assert reply[0].num_retracted == 1 and not sink.finished("A")
    control(core, sink, ContinueGenerationReqInput(lora_name="a"))
    run_until_idle(core)
    assert outputs(sink, "A") == expected_output(PROMPT_A, N, vocab)
    assert outputs(sink, "A2") == expected_output(PROMPT_A, 2, vocab)


def test_global_wait_does_not_wait_for_an_adapter_paused_in_place(core_of: Callable) -> None:
    core, sink = core_of()
    vocab = core.model_config.vocab_size
    submit(core, "A", PROMPT_A, N, lora_path="a")
    submit(core, "B", PROMPT_B, N, lora_path="b")
    core.run_step()
    control(core, sink, PauseGenerationReqInput(mode="in_place", lora_name="a"))
    msg = PauseGenerationReqInput(mode="wait")
    assert control(core, sink, msg) is None  # B still running: the engine drains
    run_until_idle(core)
    reply = [r for r in sink.replies if getattr(r, "req_id", None) == msg.req_id]
    assert len(reply) == 1 and reply[0].success  # drained although A holds KV, paused
    assert sink.finished("B") and not sink.finished("A")
    control(core, sink, ContinueGenerationReqInput())
    run_until_idle(core)
    assert not sink.finished("A")  # the global continue leaves the adapter's pause alone
    control(core, sink, ContinueGenerationReqInput(lora_name="a"))
    run_until_idle(core)
    assert outputs(sink, "A") == expected_output(PROMPT_A, N, vocab)
