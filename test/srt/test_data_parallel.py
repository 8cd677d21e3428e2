"""Data parallelism (``--dp-size 2``) on CPU with the tiny random Llama: the same tokens as one
scheduler, requests spread over both ranks, control requests acknowledged by every rank (pause
storm, aborts, weight updates), a dead rank surfacing quickly; Engine and HTTP."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import torch
from engine_test_utils import (
    MAX_NEW,
    assert_kv_all_back,
    broadcast_weight_sync,
    check_complete,
    post,
    request_pool,
    storm_requests,
    wait_for,
)
from server_test_utils import ServerProcess

import sglang as sgl
from sglang.srt.managers.data_parallel_controller import FRONTEND, DpRouter
from sglang.srt.managers.dp_reply_merge import merge_replies
from sglang.srt.managers.io_struct import (
    AbortReq,
    GetInternalStateReqOutput,
    GetWeightsByNameReqInput,
    PauseGenerationReqOutput,
    PauseStateOutput,
    ReleaseMemoryOccupationReqInput,
    ReleaseMemoryOccupationReqOutput,
    ResumeMemoryOccupationReqInput,
    ResumeMemoryOccupationReqOutput,
)

DP = 2
PROMPTS = [[10 + i, 20, 30, 40 + i] for i in range(6)]


def _states(engine: sgl.Engine) -> list[dict[str, Any]]:
    states = engine.get_server_info()["internal_states"]
    assert [s["dp_rank"] for s in states] == list(range(DP))
    return states


def _running_per_rank(engine: sgl.Engine) -> list[int]:
    return [s["running_batch_size"] for s in _states(engine)]


def _greedy(max_new: int = MAX_NEW) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}


def _submit(engine: sgl.Engine, pool: ThreadPoolExecutor, n: int, prefix: str,
            max_new: int = MAX_NEW) -> list[Any]:
    return [
        pool.submit(engine.generate, input_ids=PROMPTS[i % len(PROMPTS)],
                    sampling_params=_greedy(max_new), rid=f"{prefix}-{i}", return_logprob=True)
        for i in range(n)
    ]


def _check_no_leak(engine: sgl.Engine) -> None:
    """Every rank idle with all its KV back, before any flush."""
    wait_for(lambda: sum(_running_per_rank(engine)) == 0)
    for state in _states(engine):
        assert state["waiting_queue_size"] == 0
        assert_kv_all_back(state)


# ---- unit: routing and merging (no processes) -------------------------------------------------
def test_router_round_robin_and_abort_targets() -> None:
    router = DpRouter(DP, "round_robin")
    assert [router.assign(f"r{i}") for i in range(4)] == [0, 1, 0, 1]
    assert router.targets(AbortReq(rid="r1")) == [1]
    assert router.targets(AbortReq(rid="unknown")) == [0, 1]
    assert router.targets(AbortReq(rid="r", match_prefix=True)) == [0, 1]
    assert router.targets(AbortReq(abort_all=True)) == [0, 1]
    assert router.targets(GetWeightsByNameReqInput("w")) == [0]
    router.finished(1, ["r1", "r3"])
    assert router.num_unfinished == [2, 0] and "r1" not in router.rid_to_rank


def test_router_shortest_queue() -> None:
    router = DpRouter(3, "shortest_queue")
    assert [router.assign(f"a{i}") for i in range(3)] == [0, 1, 2]
    router.finished(1, ["a1"])
    assert router.assign("b") == 1
    router.finished(0, ["a0"])
    router.finished(2, ["a2"])
    assert sorted(router.assign(f"c{i}") for i in range(2)) == [0, 2]


def test_router_merges_replies_and_pause_state() -> None:
    router = DpRouter(DP, "round_robin")
    router.expect("p", [0, 1])
    assert router.on_reply(0, PauseStateOutput(True, "retract")) == []  # rank 1 still runs
    assert router.on_reply(0, PauseGenerationReqOutput(True, "ok", "retract", 0, 2, 0, 2,
                                                       req_id="p")) == []
    assert router.on_reply(1, PauseStateOutput(True, "retract")) == [
        (FRONTEND, PauseStateOutput(True, "retract"))
    ]
    [(dest, out)] = router.on_reply(
        1, PauseGenerationReqOutput(True, "ok", "retract", 0, 3, 0, 3, req_id="p")
    )
    assert dest == FRONTEND
    assert out.success and out.num_retracted == 5 and out.num_waiting == 5
    assert router.on_reply(1, PauseStateOutput(False)) == [(FRONTEND, PauseStateOutput(False))]


def test_router_undoes_a_release_that_another_rank_refused() -> None:
    router = DpRouter(DP, "round_robin")
    release = ReleaseMemoryOccupationReqInput(["kv_cache"], req_id="m")
    router.expect("m", [0, 1], release)
    assert router.on_reply(0, ReleaseMemoryOccupationReqOutput(True, "ok", ["kv_cache"],
                                                               req_id="m")) == []
    [(dest, undo)] = router.on_reply(
        1, ReleaseMemoryOccupationReqOutput(False, "a request holds KV", [], req_id="m")
    )
    assert dest == 0 and isinstance(undo, ResumeMemoryOccupationReqInput)
    assert undo.tags == ["kv_cache"]
    [(dest, out)] = router.on_reply(0, ResumeMemoryOccupationReqOutput(True, "ok", [],
                                                                       req_id=undo.req_id))
    assert dest == FRONTEND and out.req_id == "m" and not out.success
    assert out.message == "DP rank 1: a request holds KV (undone on DP rank(s) [0])"
    assert out.released_tags == []


def test_merge_failure_names_the_rank() -> None:
    merged = merge_replies({
        0: ReleaseMemoryOccupationReqOutput(True, "ok", ["kv_cache"], req_id="x"),
        1: ReleaseMemoryOccupationReqOutput(False, "a request holds KV", [], req_id="x"),
    })
    assert not merged.success and merged.message == "DP rank 1: a request holds KV"
    assert merged.released_tags == ["kv_cache"]
    states = merge_replies({r: GetInternalStateReqOutput({"a": r}, "x") for r in range(2)})
    assert states.internal_states == [{"a": 0, "dp_rank": 0}, {"a": 1, "dp_rank": 1}]


# ---- Engine at DP=2 ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_path(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def engine(model_path: str) -> Iterator[sgl.Engine]:
    with sgl.Engine(model_path=model_path, random_seed=0, dp_size=DP) as eng:
        yield eng


@pytest.fixture(autouse=True)
def _resume_and_drain(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "engine" in request.fixturenames:
        eng = request.getfixturevalue("engine")
        eng.continue_generation()
        eng.abort_request(abort_all=True)


def _batch_outputs(engine: sgl.Engine) -> list[tuple[list[int], list[int]]]:
    greedy = engine.generate(input_ids=PROMPTS, sampling_params=_greedy(24))
    seeded = engine.generate(
        input_ids=PROMPTS,
        sampling_params=[{"temperature": 1.0, "max_new_tokens": 24, "ignore_eos": True,
                          "sampling_seed": 100 + i} for i in range(len(PROMPTS))],
    )
    return [(g["output_ids"], s["output_ids"]) for g, s in zip(greedy, seeded)]


def test_dp2_outputs_equal_dp1(engine: sgl.Engine, model_path: str) -> None:
    dp2 = _batch_outputs(engine)
    with sgl.Engine(model_path=model_path, random_seed=0) as single:
        dp1 = _batch_outputs(single)
    assert dp2 == dp1


def test_requests_spread_over_ranks(engine: sgl.Engine) -> None:
    with request_pool(engine, 4) as pool:
        futs = _submit(engine, pool, 4, "spread")
        wait_for(lambda: _running_per_rank(engine) == [2, 2])
        rids = [set(s["running_batch_rids"]) for s in _states(engine)]
        assert rids[0] | rids[1] == {f"spread-{i}" for i in range(4)} and not rids[0] & rids[1]
        outs = [f.result(timeout=120) for f in futs]
    for out in outs:
        check_complete(out, MAX_NEW)
    _check_no_leak(engine)


def test_abort_by_rid_reaches_its_rank(engine: sgl.Engine) -> None:
    with request_pool(engine, 4) as pool:
        futs = _submit(engine, pool, 4, "ab")
        wait_for(lambda: _running_per_rank(engine) == [2, 2])
        holder = next(r for r, s in enumerate(_states(engine)) if "ab-3" in s["running_batch_rids"])
        assert engine.abort_request(rid="ab-3") == 1
        out = futs[3].result(timeout=30)
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert "ab-3" not in _states(engine)[holder]["running_batch_rids"]
        assert engine.abort_request(rid="ab", match_prefix=True) == 3
        for fut in futs[:3]:
            assert fut.result(timeout=30)["meta_info"]["finish_reason"]["type"] == "abort"
    _check_no_leak(engine)


def test_retract_pause_reply_sums_ranks_and_state_is_all_ranks(engine: sgl.Engine) -> None:
    with request_pool(engine, 4) as pool:
        futs = _submit(engine, pool, 4, "rt")
        wait_for(lambda: _running_per_rank(engine) == [2, 2])
        reply = engine.pause_generation(mode="retract")
        assert reply["status"] == "ok" and reply["num_retracted"] == 4
        states = _states(engine)
        assert all(s["engine_paused"] and s["running_batch_size"] == 0 for s in states)
        assert [s["waiting_queue_size"] for s in states] == [2, 2]
        assert engine.tokenizer_manager is not None and engine.tokenizer_manager.is_paused
        assert engine.flush_cache().success  # no rank holds KV
        assert not any(f.done() for f in futs)
        assert engine.continue_generation()["was_paused"]
        assert not engine.tokenizer_manager.is_paused
        outs = [f.result(timeout=120) for f in futs]
    for out in outs:
        check_complete(out, MAX_NEW)
        assert out["meta_info"]["total_retractions"] == 1


def test_in_place_pause_refuses_flush_naming_ranks(engine: sgl.Engine) -> None:
    with request_pool(engine, 4) as pool:
        futs = _submit(engine, pool, 4, "ip")
        wait_for(lambda: _running_per_rank(engine) == [2, 2])
        reply = engine.pause_generation(mode="in_place")
        assert reply["num_running"] == 4
        flush = engine.flush_cache()
        assert not flush.success and "DP rank 0:" in flush.error_msg
        assert "DP rank 1:" in flush.error_msg
        engine.continue_generation()
        for fut in futs:
            check_complete(fut.result(timeout=120), MAX_NEW)


def test_pause_lease_expires_on_every_rank(engine: sgl.Engine) -> None:
    reply = engine.pause_generation(mode="retract", timeout_s=0.5)
    assert reply["status"] == "ok"
    assert all(s["engine_paused"] for s in _states(engine))
    tm = engine.tokenizer_manager
    assert tm is not None and tm.is_paused
    wait_for(lambda: not any(s["engine_paused"] for s in _states(engine)), timeout=10)
    wait_for(lambda: not tm.is_paused, timeout=10)
    out = engine.generate(input_ids=PROMPTS[0], sampling_params=_greedy(4))
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_server_args_dp_values() -> None:
    from sglang.srt.server_args import ServerArgs

    assert ServerArgs(model_path="m", device="cpu", load_balance_method="auto") \
        .resolved_load_balance_method() == "round_robin"
    with pytest.raises(ValueError, match="--dp-size"):
        ServerArgs(model_path="m", device="cpu", dp_size=0)
    with pytest.raises(ValueError, match="--load-balance-method"):
        ServerArgs(model_path="m", device="cpu", load_balance_method="minimum_tokens")


def test_pause_storm_every_request_ends_once_no_leak(engine: sgl.Engine) -> None:
    storm_requests(engine, random.Random(11), 16, 3.0, base_len=40, step=13)
    _check_no_leak(engine)  # before any flush: a leak on either rank shows here
    assert engine.flush_cache().success


def test_update_weights_from_disk_applies_on_every_rank(
    engine: sgl.Engine, tiny_model_dir, model_path: str
) -> None:
    other = str(tiny_model_dir("llama", initializer_range=0.5))
    same_prompt = [PROMPTS[0]] * DP  # round robin: one copy per rank
    before = [o["output_ids"] for o in engine.generate(input_ids=same_prompt,
                                                       sampling_params=_greedy(16))]
    assert before[0] == before[1]
    ok, message, _ = engine.update_weights_from_disk(other, weight_version="v2")
    assert ok, message
    assert [s["weight_version"] for s in _states(engine)] == ["v2"] * DP
    after = [o["output_ids"] for o in engine.generate(input_ids=same_prompt,
                                                      sampling_params=_greedy(16))]
    assert after[0] == after[1] != before[0]
    ok, message, _ = engine.update_weights_from_disk(model_path, weight_version="v3")
    assert ok, message
    again = engine.generate(input_ids=same_prompt, sampling_params=_greedy(16))
    assert [o["output_ids"] for o in again] == before
    refused = engine.update_weights_from_disk("/nonexistent/checkpoint")
    assert not refused[0]
    assert [s["weight_version"] for s in _states(engine)] == ["v3"] * DP


def test_tensor_update_version_and_memory_on_every_rank(engine: sgl.Engine) -> None:
    same_prompt = [PROMPTS[1]] * DP  # round robin: one copy per rank
    before = [o["output_ids"] for o in engine.generate(input_ids=same_prompt,
                                                       sampling_params=_greedy(12))]
    head = torch.tensor(engine.get_weights_by_name("lm_head.weight", truncate_size=10_000))
    ok, message = engine.update_weights_from_tensor([("lm_head.weight", -head)],
                                                    weight_version="neg")
    assert ok, message
    after = [o["output_ids"] for o in engine.generate(input_ids=same_prompt,
                                                      sampling_params=_greedy(12))]
    assert after[0] == after[1] != before[0]
    assert engine.update_weights_from_tensor([("lm_head.weight", head)])[0]
    assert engine.update_weight_version("relabelled")["success"]
    assert [s["weight_version"] for s in _states(engine)] == ["relabelled"] * DP
    # Released on both ranks, then resumed on both.
    assert engine.release_memory_occupation(["kv_cache"])["released_tags"] == ["kv_cache"]
    assert engine.resume_memory_occupation(["kv_cache"])["released_tags"] == []
    # Refused on the rank holding a request, succeeded on the other: undone there.
    with request_pool(engine, 1) as pool:
        fut = pool.submit(engine.generate, input_ids=PROMPTS[0], sampling_params=_greedy(MAX_NEW),
                          return_logprob=True)
        wait_for(lambda: sum(_running_per_rank(engine)) == 1)
        engine.pause_generation(mode="in_place")
        with pytest.raises(RuntimeError, match=r"DP rank \d: .*undone on DP rank"):
            engine.release_memory_occupation(["kv_cache"])
        engine.continue_generation()
        check_complete(fut.result(timeout=120), MAX_NEW)
    again = engine.generate(input_ids=same_prompt, sampling_params=_greedy(12))
    assert [o["output_ids"] for o in again] == before  # both ranks serve, original weights
    _check_no_leak(engine)


def test_update_weights_from_distributed_reaches_every_rank(engine: sgl.Engine) -> None:
    """Upstream's layout: each DP rank joins the trainer's group (world_size = 1 + DP, ranks
    rank_offset + dp_rank) and receives the broadcast itself; a group too small for every rank
    is refused before any rank joins."""
    same_prompt = [PROMPTS[2]] * DP
    before = [o["output_ids"] for o in engine.generate(input_ids=same_prompt,
                                                       sampling_params=_greedy(12))]
    head = torch.tensor(engine.get_weights_by_name("lm_head.weight", truncate_size=10_000))
    broadcast_weight_sync(engine, DP, "dp", -head)
    assert [s["weight_version"] for s in _states(engine)] == ["broadcast"] * DP
    after = [o["output_ids"] for o in engine.generate(input_ids=same_prompt,
                                                      sampling_params=_greedy(12))]
    assert after[0] == after[1] != before[0]
    assert engine.update_weights_from_tensor([("lm_head.weight", head)])[0]


def test_killed_rank_fails_callers_and_stops_the_group(model_path: str) -> None:
    eng = sgl.Engine(model_path=model_path, random_seed=0, dp_size=DP)
    try:
        procs = {p.name: p for p in eng._procs}
        # Paused first, so that neither request can finish before the kill however fast the
        # host is (racing a running request against the poll failed CI once).
        eng.pause_generation(mode="in_place")
        with ThreadPoolExecutor(2) as pool:
            futs = [pool.submit(eng.generate, input_ids=PROMPTS[i],
                                sampling_params=_greedy(MAX_NEW)) for i in range(2)]
            wait_for(lambda: [s["waiting_queue_size"] for s in _states(eng)] == [1, 1])
            killed_at = time.monotonic()
            os.kill(procs["sglang-scheduler-dp1"].pid, signal.SIGKILL)
            for fut in futs:
                with pytest.raises(RuntimeError, match="scheduler died"):
                    fut.result(timeout=10)
            assert time.monotonic() - killed_at < 5
        with pytest.raises(RuntimeError, match="scheduler died"):
            eng.generate(input_ids=PROMPTS[0], sampling_params=_greedy(4))
        wait_for(lambda: not any(p.is_alive() for p in procs.values()), timeout=10)
    finally:
        eng.shutdown()


# ---- HTTP at DP=2 -----------------------------------------------------------------------------
def test_http_generate_pause_continue(model_path: str) -> None:
    with ServerProcess(model_path, "--dp-size", str(DP), "--random-seed", "0",
                       "--load-balance-method", "shortest_queue") as server:
        def generate(i: int) -> dict:
            body = {"input_ids": PROMPTS[i], "return_logprob": True,
                    "sampling_params": _greedy(MAX_NEW)}
            r = post(server, "/generate", body)
            assert r.status_code == 200, r.text
            return r.json()

        def states() -> list[dict]:
            info = httpx.get(server.url + "/get_server_info", timeout=30).json()
            return info["internal_states"]

        # Requests admitted while paused queue on their ranks (2 each) and start together.
        assert post(server, "/pause_generation", {"mode": "in_place"}).json()["status"] == "ok"
        with ThreadPoolExecutor(4) as pool:
            futs = [pool.submit(generate, i) for i in range(4)]
            wait_for(lambda: [s["waiting_queue_size"] for s in states()] == [2, 2])
            assert all(s["engine_paused"] for s in states())
            assert post(server, "/continue_generation").json()["was_paused"]
            wait_for(lambda: [s["running_batch_size"] for s in states()] == [2, 2])
            reply = post(server, "/pause_generation", {"mode": "retract"}).json()
            assert reply["status"] == "ok" and reply["num_retracted"] == 4
            assert [s["dp_rank"] for s in states()] == [0, 1]
            assert httpx.get(server.url + "/is_paused", timeout=10).json()["is_paused"]
            assert post(server, "/continue_generation").json()["was_paused"]
            outs = [f.result(timeout=120) for f in futs]
        assert not httpx.get(server.url + "/is_paused", timeout=10).json()["is_paused"]
        for out in outs:
            check_complete(out, MAX_NEW)
            assert out["meta_info"]["total_retractions"] == 1
        wait_for(lambda: all(s["running_batch_size"] == 0 for s in states()))
        for state in states():
            assert_kv_all_back(state)
