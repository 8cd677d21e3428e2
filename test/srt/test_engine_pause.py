"""Interruptible sampling through Engine: pause/continue in every mode, flush, abort, races."""

from __future__ import annotations

import random

import pytest
from engine_test_utils import (
    MAX_NEW,
    NUM_REQS,
    assert_kv_all_back,
    check_complete,
    control_storm,
    engine_state,
    request_pool,
    submit_greedy,
    wait_for,
    wait_loop_turns,
    wait_running,
)

# Loop turns a paused scheduler runs before a test checks that nothing was scheduled.
PAUSED_TURNS = 20


@pytest.fixture(autouse=True)
def _resume_and_drain(engine):
    yield
    engine.continue_generation()
    engine.abort_request(abort_all=True)


def test_retract_pause_releases_kv_and_resumes(engine) -> None:
    with request_pool(engine, NUM_REQS) as pool:
        futs = submit_greedy(engine, pool)
        before = wait_running(lambda: engine_state(engine))
        reply = engine.pause_generation(mode="retract")
        after = engine_state(engine)
        assert reply["status"] == "ok" and reply["num_retracted"] == NUM_REQS
        assert after["engine_paused"] and after["pause_mode"] == "retract"
        assert after["running_batch_size"] == 0
        assert after["waiting_queue_size"] == before["waiting_queue_size"] + NUM_REQS
        assert after["available_kv_tokens"] > before["available_kv_tokens"]
        later = wait_loop_turns(lambda: engine_state(engine), PAUSED_TURNS)
        assert later["forward_ct_decode"] == after["forward_ct_decode"]  # nothing decoded
        assert later["running_batch_size"] == 0
        assert not any(f.done() for f in futs)
        engine.continue_generation()
        outs = [f.result(timeout=60) for f in futs]
    for out in outs:
        check_complete(out)
        assert out["meta_info"]["total_retractions"] >= 1


def test_in_place_pause_keeps_requests_and_kv(engine) -> None:
    with request_pool(engine, NUM_REQS) as pool:
        futs = submit_greedy(engine, pool)
        wait_running(lambda: engine_state(engine))
        reply = engine.pause_generation(mode="in_place")
        after = engine_state(engine)
        assert reply["num_running"] == NUM_REQS and reply["num_retracted"] == 0
        later = wait_loop_turns(lambda: engine_state(engine), PAUSED_TURNS)
        assert later["running_batch_rids"] == after["running_batch_rids"]
        assert len(later["running_batch_rids"]) == NUM_REQS
        assert later["waiting_queue_size"] == after["waiting_queue_size"] == 0
        assert later["available_kv_tokens"] == after["available_kv_tokens"]
        assert later["forward_ct_decode"] == after["forward_ct_decode"]
        engine.continue_generation()
        outs = [f.result(timeout=60) for f in futs]
    for out in outs:
        check_complete(out)
        assert out["meta_info"]["total_retractions"] == 0


def test_alternating_modes_over_three_cycles(engine) -> None:
    with request_pool(engine, NUM_REQS) as pool:
        futs = submit_greedy(engine, pool)
        wait_running(lambda: engine_state(engine))
        for mode in ("retract", "in_place", "retract"):
            engine.pause_generation(mode=mode)
            state = engine_state(engine)
            assert state["engine_paused"]
            engine.continue_generation()
            wait_running(lambda: engine_state(engine))
        outs = [f.result(timeout=60) for f in futs]
    for out in outs:
        check_complete(out)
        assert out["meta_info"]["total_retractions"] == 2


def test_abort_pause_ends_every_request(engine) -> None:
    with request_pool(engine, NUM_REQS + 2) as pool:
        futs = submit_greedy(engine, pool)
        wait_running(lambda: engine_state(engine))
        reply = engine.pause_generation(mode="abort")
        assert reply["num_aborted"] == NUM_REQS
        outs = [f.result(timeout=30) for f in futs]
        state = engine_state(engine)
        assert state["running_batch_size"] == 0 and state["waiting_queue_size"] == 0
        # requests sent while paused wait, visible, and run only after continue
        late = submit_greedy(engine, pool, n=2, max_new=8)
        wait_for(lambda: engine_state(engine)["waiting_queue_size"] == 2)
        state = wait_loop_turns(lambda: engine_state(engine), PAUSED_TURNS)
        assert state["waiting_queue_size"] == 2 and state["running_batch_size"] == 0
        assert not any(f.done() for f in late)
        engine.continue_generation()
        late_outs = [f.result(timeout=30) for f in late]
    for out in outs:
        meta = out["meta_info"]
        assert meta["finish_reason"]["type"] == "abort"
        assert 0 < len(out["output_ids"]) < MAX_NEW
        assert len(out["output_ids"]) == meta["completion_tokens"]
        assert len(meta["output_token_logprobs"]) == len(out["output_ids"])
    for out in late_outs:
        check_complete(out, 8)


def test_flush_refused_in_place_allowed_after_retract(engine) -> None:
    with request_pool(engine, NUM_REQS) as pool:
        futs = submit_greedy(engine, pool)
        wait_running(lambda: engine_state(engine))
        engine.pause_generation(mode="in_place")
        refused = engine.flush_cache()
        assert not refused.success and "hold KV" in refused.error_msg
        engine.pause_generation(mode="retract")
        assert_kv_all_back(engine_state(engine))
        flushed = engine.flush_cache()
        assert flushed.success
        state = engine_state(engine)
        assert state["tree_cache_size"] == 0 and state["req_to_token_pool_used"] == 0
        assert state["available_kv_tokens"] == state["max_total_num_tokens"]
        assert state["waiting_queue_size"] == NUM_REQS
        engine.continue_generation()
        for f in futs:
            check_complete(f.result(timeout=60))


def test_flush_after_generation_resets_state(engine) -> None:
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    prompts = [[5, 6, 7, 8, 9], [9, 8, 7]]
    engine.flush_cache()
    initial = engine_state(engine)
    first = engine.generate(input_ids=prompts, sampling_params=params)
    for _ in range(3):
        assert engine.flush_cache().success
        state = engine_state(engine)
        assert state["available_kv_tokens"] == initial["available_kv_tokens"]
        assert state["tree_cache_size"] == 0 and state["req_to_token_pool_used"] == 0
        assert state["forward_ct_decode"] == 0
        assert state["new_token_ratio"] == state["init_new_token_ratio"]
        assert state["running_batch_size"] == 0 and state["waiting_queue_size"] == 0
        assert state["cur_batch_is_none"] and state["last_batch_is_none"]
        assert state["chunked_req_is_none"]
        again = engine.generate(input_ids=prompts, sampling_params=params)
        assert [o["output_ids"] for o in again] == [o["output_ids"] for o in first]


def test_pause_idempotent_and_bad_mode(engine) -> None:
    assert engine.continue_generation()["was_paused"] is False
    engine.pause_generation(mode="in_place")
    assert engine.pause_generation(mode="in-place")["mode"] == "in_place"  # the peer's spelling
    with pytest.raises(ValueError, match="Unknown pause mode"):
        engine.pause_generation(mode="sideways")
    assert engine_state(engine)["pause_mode"] == "in_place"  # unchanged by the bad call
    assert engine.continue_generation()["was_paused"] is True
    assert engine.continue_generation()["was_paused"] is False
    assert not engine_state(engine)["engine_paused"]


def test_abort_by_rid_during_pause(engine) -> None:
    with request_pool(engine, 2) as pool:
        engine.pause_generation(mode="in_place")
        params = {"max_new_tokens": 8, "ignore_eos": True}
        a = pool.submit(engine.generate, input_ids=[1, 2, 3], sampling_params=params, rid="job-a")
        b = pool.submit(engine.generate, input_ids=[1, 2, 4], sampling_params=params, rid="job-b")
        wait_for(lambda: engine_state(engine)["waiting_queue_size"] == 2)
        assert engine.abort_request(rid="job") == 0  # exact match only
        assert engine.abort_request(rid="job-a") == 1
        out_a = a.result(timeout=10)
        assert out_a["meta_info"]["finish_reason"]["type"] == "abort"
        assert out_a["output_ids"] == []
        assert engine.abort_request(rid="job", match_prefix=True) == 1
        assert b.result(timeout=10)["meta_info"]["finish_reason"]["type"] == "abort"


def test_vllm_vocabulary(engine) -> None:
    with request_pool(engine, NUM_REQS) as pool:
        futs = submit_greedy(engine, pool)
        wait_running(lambda: engine_state(engine))
        reply = engine.pause_generation(mode="keep", clear_cache=True)
        assert reply["mode"] == "retract" and reply["flushed"]
        assert engine_state(engine)["tree_cache_size"] == 0
        engine.continue_generation()
        wait_running(lambda: engine_state(engine))
        reply = engine.pause_generation(mode="keep")
        assert reply["mode"] == "in_place" and reply["num_running"] == NUM_REQS
        engine.continue_generation()
        for f in futs:
            check_complete(f.result(timeout=60))
        futs = submit_greedy(engine, pool)
        wait_running(lambda: engine_state(engine))
        reply = engine.pause_generation(mode="wait")  # returns once the running ones finished
        assert reply["num_running"] == 0 and reply["num_retracted"] == 0
        state = engine_state(engine)
        assert state["running_batch_size"] == 0 and state["pause_phase"] == "paused"
        for f in futs:  # each ran to its end before the pause took effect
            out = f.result(timeout=60)
            check_complete(out)
            assert out["meta_info"]["total_retractions"] == 0
        engine.continue_generation()


def test_pause_lease_expires(engine) -> None:
    with request_pool(engine, NUM_REQS) as pool:
        futs = submit_greedy(engine, pool)
        wait_running(lambda: engine_state(engine))
        engine.pause_generation(mode="in_place", timeout_s=0.3)
        assert engine_state(engine)["engine_paused"]
        for f in futs:  # the lease ends the pause without any continue call
            check_complete(f.result(timeout=30))
        assert not engine_state(engine)["engine_paused"]


def test_stress_random_control_calls(engine) -> None:
    rng = random.Random(7)
    engine.flush_cache()
    initial = engine_state(engine)["available_kv_tokens"]
    num = 24
    with request_pool(engine, num) as pool:
        futs = [
            pool.submit(
                engine.generate,
                input_ids=[rng.randrange(3, 400) for _ in range(9)],
                sampling_params={
                    "max_new_tokens": rng.randint(5, 120),
                    "ignore_eos": True,
                    "temperature": 1.0,
                },
                rid=f"stress-{i}",
            )
            for i in range(num)
        ]
        control_storm(engine, rng, [f"stress-{i}" for i in range(num)], 2.0, 0.02)
        outs = [f.result(timeout=60) for f in futs]
    for out in outs:
        meta = out["meta_info"]
        assert meta["finish_reason"]["type"] in ("length", "abort")
        assert len(out["output_ids"]) == meta["completion_tokens"]
    wait_for(lambda: engine_state(engine)["running_batch_size"] == 0)
    assert_kv_all_back(engine_state(engine))
    assert engine.flush_cache().success
    assert engine_state(engine)["available_kv_tokens"] == initial


def test_pause_abort_races_tokenization(engine) -> None:
    """A pause racing a big batch still being tokenized: every request ends exactly once."""
    texts = [f"request {i} " + "lorem ipsum dolor " * 12 for i in range(16)]
    params = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}
    with request_pool(engine, 1) as pool:
        fut = pool.submit(engine.generate, texts, params, return_logprob=True)
        reply = engine.pause_generation(mode="abort")
        engine.continue_generation()
        outs = fut.result(timeout=60)
    assert len(outs) == len(texts)
    aborted = [o for o in outs if o["meta_info"]["finish_reason"]["type"] == "abort"]
    assert len(aborted) == reply["num_aborted"]
    for out in outs:
        assert len(out["output_ids"]) == out["meta_info"]["completion_tokens"]
        if out not in aborted:
            check_complete(out, 64)
    state = engine_state(engine)
    assert state["running_batch_size"] == 0 and state["waiting_queue_size"] == 0
    assert_kv_all_back(state)
