"""Interruptible sampling through Engine: pause/continue in every mode, flush, abort, races."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

import sglang as sgl

MAX_NEW = 400
NUM_REQS = 4


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with sgl.Engine(model_path=str(tiny_model_dir("llama")), random_seed=0) as eng:
        yield eng


@pytest.fixture(autouse=True)
def _resume_and_drain(engine):
    yield
    engine.continue_generation()
    engine.abort_request(abort_all=True)


def _state(engine: sgl.Engine) -> dict:
    return engine.get_server_info()["internal_states"][0]


def _wait_for(pred: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


def _submit(
    engine: sgl.Engine,
    pool: ThreadPoolExecutor,
    n: int = NUM_REQS,
    max_new: int = MAX_NEW,
    **kw: object,
) -> list[Future]:
    params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    return [
        pool.submit(
            engine.generate,
            input_ids=[10 + i, 20, 30, 40 + i],
            sampling_params=params,
            return_logprob=True,
            **kw,
        )
        for i in range(n)
    ]


def _running(engine: sgl.Engine, n: int = NUM_REQS) -> dict:
    """Wait until ``n`` requests decode, then return the state."""
    _wait_for(lambda: _state(engine)["running_batch_size"] == n)
    return _state(engine)


def _check_complete(out: dict, max_new: int = MAX_NEW) -> None:
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": max_new}
    assert len(out["output_ids"]) == meta["completion_tokens"] == max_new
    assert len(meta["output_token_logprobs"]) == max_new
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]


def test_retract_pause_releases_kv_and_resumes(engine) -> None:
    with ThreadPoolExecutor(NUM_REQS) as pool:
        futs = _submit(engine, pool)
        before = _running(engine)
        reply = engine.pause_generation(mode="retract")
        after = _state(engine)
        assert reply["status"] == "ok" and reply["num_retracted"] == NUM_REQS
        assert after["engine_paused"] and after["pause_mode"] == "retract"
        assert after["running_batch_size"] == 0
        assert after["waiting_queue_size"] == before["waiting_queue_size"] + NUM_REQS
        assert after["available_kv_tokens"] > before["available_kv_tokens"]
        decoded = after["forward_ct_decode"]
        time.sleep(0.2)
        assert _state(engine)["forward_ct_decode"] == decoded  # nothing decodes while paused
        assert not any(f.done() for f in futs)
        engine.continue_generation()
        outs = [f.result(timeout=60) for f in futs]
    for out in outs:
        _check_complete(out)
        assert out["meta_info"]["total_retractions"] >= 1


def test_in_place_pause_keeps_requests_and_kv(engine) -> None:
    with ThreadPoolExecutor(NUM_REQS) as pool:
        futs = _submit(engine, pool)
        _running(engine)
        reply = engine.pause_generation(mode="in_place")
        after = _state(engine)
        assert reply["num_running"] == NUM_REQS and reply["num_retracted"] == 0
        time.sleep(0.2)
        later = _state(engine)
        assert later["running_batch_rids"] == after["running_batch_rids"]
        assert len(later["running_batch_rids"]) == NUM_REQS
        assert later["waiting_queue_size"] == after["waiting_queue_size"] == 0
        assert later["available_kv_tokens"] == after["available_kv_tokens"]
        assert later["forward_ct_decode"] == after["forward_ct_decode"]
        engine.continue_generation()
        outs = [f.result(timeout=60) for f in futs]
    for out in outs:
        _check_complete(out)
        assert out["meta_info"]["total_retractions"] == 0


def test_alternating_modes_over_three_cycles(engine) -> None:
    with ThreadPoolExecutor(NUM_REQS) as pool:
        futs = _submit(engine, pool, max_new=480)
        _running(engine)
        for mode in ("retract", "in_place", "retract"):
            engine.pause_generation(mode=mode)
            state = _state(engine)
            assert state["engine_paused"]
            engine.continue_generation()
            _running(engine)
        outs = [f.result(timeout=60) for f in futs]
    for out in outs:
        _check_complete(out, 480)
        assert out["meta_info"]["total_retractions"] == 2


def test_abort_pause_ends_every_request(engine) -> None:
    with ThreadPoolExecutor(NUM_REQS + 2) as pool:
        futs = _submit(engine, pool)
        _running(engine)
        reply = engine.pause_generation(mode="abort")
        assert reply["num_aborted"] == NUM_REQS
        outs = [f.result(timeout=30) for f in futs]
        state = _state(engine)
        assert state["running_batch_size"] == 0 and state["waiting_queue_size"] == 0
        # requests sent while paused wait, visible, and run only after continue
        late = _submit(engine, pool, n=2, max_new=8)
        _wait_for(lambda: _state(engine)["waiting_queue_size"] == 2)
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
        _check_complete(out, 8)


def test_flush_refused_in_place_allowed_after_retract(engine) -> None:
    with ThreadPoolExecutor(NUM_REQS) as pool:
        futs = _submit(engine, pool)
        _running(engine)
        engine.pause_generation(mode="in_place")
        refused = engine.flush_cache()
        assert not refused.success and "hold KV" in refused.error_msg
        engine.pause_generation(mode="retract")
        flushed = engine.flush_cache()
        assert flushed.success
        state = _state(engine)
        assert state["tree_cache_size"] == 0 and state["req_to_token_pool_used"] == 0
        assert state["available_kv_tokens"] == state["max_total_num_tokens"]
        assert state["waiting_queue_size"] == NUM_REQS
        engine.continue_generation()
        for f in futs:
            _check_complete(f.result(timeout=60))


def test_flush_after_generation_resets_state(engine) -> None:
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    prompts = [[5, 6, 7, 8, 9], [9, 8, 7]]
    engine.flush_cache()
    initial = _state(engine)
    first = engine.generate(input_ids=prompts, sampling_params=params)
    for _ in range(3):
        assert engine.flush_cache().success
        state = _state(engine)
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
    assert _state(engine)["pause_mode"] == "in_place"  # unchanged by the bad call
    assert engine.continue_generation()["was_paused"] is True
    assert engine.continue_generation()["was_paused"] is False
    assert not _state(engine)["engine_paused"]


def test_abort_by_rid_during_pause(engine) -> None:
    with ThreadPoolExecutor(2) as pool:
        engine.pause_generation(mode="in_place")
        params = {"max_new_tokens": 8, "ignore_eos": True}
        a = pool.submit(engine.generate, input_ids=[1, 2, 3], sampling_params=params, rid="job-a")
        b = pool.submit(engine.generate, input_ids=[1, 2, 4], sampling_params=params, rid="job-b")
        _wait_for(lambda: _state(engine)["waiting_queue_size"] == 2)
        assert engine.abort_request(rid="job") == 0  # exact match only
        assert engine.abort_request(rid="job-a") == 1
        out_a = a.result(timeout=10)
        assert out_a["meta_info"]["finish_reason"]["type"] == "abort"
        assert out_a["output_ids"] == []
        assert engine.abort_request(rid="job", match_prefix=True) == 1
        assert b.result(timeout=10)["meta_info"]["finish_reason"]["type"] == "abort"


def test_vllm_vocabulary(engine) -> None:
    with ThreadPoolExecutor(NUM_REQS) as pool:
        futs = _submit(engine, pool)
        _running(engine)
        reply = engine.pause_generation(mode="keep", clear_cache=True)
        assert reply["mode"] == "retract" and reply["flushed"]
        assert _state(engine)["tree_cache_size"] == 0
        engine.continue_generation()
        _running(engine)
        reply = engine.pause_generation(mode="keep")
        assert reply["mode"] == "in_place" and reply["num_running"] == NUM_REQS
        engine.continue_generation()
        for f in futs:
            _check_complete(f.result(timeout=60))
        futs = _submit(engine, pool, max_new=60)
        _running(engine)
        reply = engine.pause_generation(mode="wait")  # returns once the running ones finished
        assert reply["num_running"] == 0
        assert all(f.done() for f in futs)
        for f in futs:
            _check_complete(f.result(), 60)
        engine.continue_generation()


def test_pause_lease_expires(engine) -> None:
    with ThreadPoolExecutor(NUM_REQS) as pool:
        futs = _submit(engine, pool, max_new=100)
        _running(engine)
        engine.pause_generation(mode="in_place", timeout_s=0.3)
        assert _state(engine)["engine_paused"]
        for f in futs:  # the lease ends the pause without any continue call
            _check_complete(f.result(timeout=30), 100)
        assert not _state(engine)["engine_paused"]


def test_stress_random_control_calls(engine) -> None:
    rng = random.Random(7)
    engine.flush_cache()
    initial = _state(engine)["available_kv_tokens"]
    num = 24
    with ThreadPoolExecutor(num) as pool:
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
        stop = threading.Event()

        def driver() -> None:
            while not stop.is_set():
                action = rng.choice(
                    ["retract", "in_place", "abort", "continue", "flush", "abort_one"]
                )
                if action in ("retract", "in_place", "abort"):
                    engine.pause_generation(mode=action)
                elif action == "continue":
                    engine.continue_generation()
                elif action == "flush":
                    engine.flush_cache()
                else:
                    engine.abort_request(rid=f"stress-{rng.randrange(num)}")
                time.sleep(rng.uniform(0, 0.02))
            engine.continue_generation()

        control = threading.Thread(target=driver)
        control.start()
        time.sleep(2.0)
        stop.set()
        control.join()
        outs = [f.result(timeout=60) for f in futs]
    for out in outs:
        meta = out["meta_info"]
        assert meta["finish_reason"]["type"] in ("length", "abort")
        assert len(out["output_ids"]) == meta["completion_tokens"]
    _wait_for(lambda: _state(engine)["running_batch_size"] == 0)
    assert engine.flush_cache().success
    assert _state(engine)["available_kv_tokens"] == initial


def test_pause_abort_races_tokenization(engine) -> None:
    """A pause racing a big batch still being tokenized: every request ends exactly once."""
    texts = [f"request {i} " + "lorem ipsum dolor " * 12 for i in range(16)]
    params = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
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
            _check_complete(out, 64)
    state = _state(engine)
    assert state["running_batch_size"] == 0 and state["waiting_queue_size"] == 0
