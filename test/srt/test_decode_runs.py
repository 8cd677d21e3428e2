"""Decode runs (ReqKV.alloc_decode on CPU): each request's decoded tokens take consecutive
slots from a run it reserved, its unused reservation is freed by every exit path, and the
reservations never make a full pool retract requests or refuse a step it could hold."""

from __future__ import annotations

import pytest
from scheduler_test_utils import (
    assert_no_leak,
    control,
    expected_output,
    make_core,
    run_until_idle,
    submit,
)

from sglang.srt.managers.io_struct import AbortReq, PauseGenerationReqInput
from sglang.srt.managers.req_kv import decode_run_length
from sglang.srt.managers.scheduler import Scheduler


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))


def _decoded_slots(core: Scheduler, rid: str) -> list[int]:
    req = next(r for r in core.running_batch.reqs if r.rid == rid)
    row = core.kv.req_to_token_pool.req_to_token[req.req_pool_idx]
    return row[req.prompt_len : req.kv_len].tolist()


def test_run_length_per_device_and_pool() -> None:
    assert decode_run_length("cpu", 1, 1 << 20) == 32
    assert decode_run_length("cpu", 1, 256) == 4  # at most 1/64 of the pool
    assert decode_run_length("cpu", 1, 64) == 1  # too small a pool: no runs
    assert decode_run_length("cpu", 16, 1 << 20) == 1  # paged pools keep pages instead
    assert decode_run_length("cuda", 1, 1 << 20) == 1


def test_decoded_tokens_lie_in_runs_and_are_exact(model_dir: str) -> None:
    core, _, sink = make_core(model_dir, max_total_tokens=4096)
    assert core.kv.decode_run == 32
    prompts = {f"r{i}": list(range(20 + 7 * i, 30 + 7 * i)) for i in range(4)}
    for rid, prompt in prompts.items():
        submit(core, rid, prompt, 70)
    for _ in range(40):
        core.run_step()
        core.check_invariants()
    for rid in prompts:
        slots = _decoded_slots(core, rid)
        assert len(slots) >= 32
        # The first 32 decoded tokens fill one run, side by side; the interleaved batch
        # would put them 4 slots apart.
        assert slots[:32] == list(range(slots[0], slots[0] + 32))
    assert core.kv.reserved_slots > 0
    run_until_idle(core)
    vocab = core.model_config.vocab_size
    for rid, prompt in prompts.items():
        assert sink.by_rid[rid].output_ids == expected_output(prompt, 70, vocab)
    assert core.kv.reserved_slots == 0
    assert_no_leak(core)


@pytest.mark.parametrize(
    "exit_path",
    [
        AbortReq(abort_all=True),
        PauseGenerationReqInput(mode="abort"),
        PauseGenerationReqInput(mode="retract"),
    ],
    ids=["abort_request", "pause_abort", "pause_retract"],
)
def test_every_exit_frees_the_reservation(model_dir: str, exit_path: object) -> None:
    core, _, sink = make_core(model_dir, max_total_tokens=4096)
    for i in range(3):
        submit(core, f"r{i}", list(range(30 + i, 40 + i)), 60)
    for _ in range(5):
        core.run_step()
    assert core.kv.reserved_slots == 3 * 32 - 3 * 4  # 4 decode steps taken from each run
    control(core, sink, exit_path)
    assert core.kv.reserved_slots == 0
    core.check_invariants()
    if isinstance(exit_path, PauseGenerationReqInput) and exit_path.mode == "retract":
        # Re-admitted after continue: the re-prefill and the new runs hold exactly again.
        assert all(not r.decode_slots for r in core.waiting_queue)
    else:
        assert_no_leak(core)


def test_full_pool_takes_single_slots_and_still_finishes_exactly(model_dir: str) -> None:
    """A pool too small for 8 requests at once (runs of 4): reservations stop while it is
    short, decode retracts as it would without them, every token is exact and nothing leaks."""
    core, _, sink = make_core(model_dir, max_total_tokens=256)
    assert core.kv.decode_run == 4
    prompts = {f"r{i}": list(range(20 + 9 * i, 28 + 9 * i)) for i in range(8)}
    for rid, prompt in prompts.items():
        submit(core, rid, prompt, 40, return_logprob=True)
    runs_seen = False
    while core.has_runnable_work():
        core.run_step()
        core.check_invariants()
        runs_seen |= any(r.decode_slots for r in core.running_batch.reqs)
    assert runs_seen
    vocab = core.model_config.vocab_size
    for rid, prompt in prompts.items():
        rec = sink.by_rid[rid]
        assert rec.finished_reasons == [{"type": "length", "length": 40}]
        assert rec.output_ids == expected_output(prompt, 40, vocab)
        assert len(rec.logprobs) == 40
    assert sum(sink.by_rid[rid].num_retractions for rid in prompts) >= 1
    assert_no_leak(core)


def test_runs_stop_while_the_pool_is_short(model_dir: str) -> None:
    core, _, _ = make_core(model_dir, max_total_tokens=256)
    kv = core.kv
    assert kv._run_length(8) == 4  # 32 reserved: 1/8 of the pool
    assert kv._run_length(9) == 1  # 36 would be more
    held = kv.allocator.alloc_slots(160)
    assert held is not None
    assert kv._run_length(1) == 4  # 92 free after: over a quarter
    more = kv.allocator.alloc_slots(40)
    assert more is not None
    assert kv._run_length(1) == 1  # 52 free after: under a quarter
    kv.allocator.free(held)
    kv.allocator.free(more)
