"""Tensor parallelism (``--tp-size 2``) on CPU with gloo and the tiny random GQA Llama: the same
tokens as one rank, every control request acknowledged by every rank of the group (pause
storm with no KV leaked on any rank, weight updates), the pause lease decided by rank 0's
clock; and DP=2 x TP=2."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from engine_test_utils import (
    assert_kv_all_back,
    broadcast_weight_sync,
    check_complete,
    storm_requests,
    wait_for,
)

import sglang as sgl
from sglang.srt.managers.dp_reply_merge import merge_tp_replies
from sglang.srt.managers.io_struct import (
    FlushCacheReqOutput,
    GetInternalStateReqOutput,
    PauseGenerationReqInput,
    PauseGenerationReqOutput,
    PauseStateOutput,
)
from sglang.srt.managers.pause_state import PauseState
from sglang.srt.managers.tp_group_io import merge_turn_replies

TP = 2
# Fewer than engine_test_utils.MAX_NEW: a TP=2 step takes ~6 ms, so these still run seconds.
MAX_NEW = 400
KV_TOKENS = 20000  # per rank: small enough for the invariant checks to be quick
PROMPTS = [[10 + i, 20, 30, 40 + i] for i in range(6)]


def _greedy(max_new: int = MAX_NEW) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}


def _rank_states(engine: sgl.Engine) -> list[dict[str, Any]]:
    """Every TP rank's KV summary, of every DP replica."""
    states = engine.get_server_info()["internal_states"]
    assert all(s["tp_size"] == TP for s in states)
    ranks = [r for s in states for r in s["tp_ranks"]]
    assert [r["tp_rank"] for r in ranks] == list(range(TP)) * len(states)
    return ranks


def _check_no_leak(engine: sgl.Engine) -> None:
    """Every rank of every replica idle with all its KV back, before any flush; the ranks of a
    group agree on every count (they take the same decisions)."""
    wait_for(lambda: all(r["running_batch_size"] == 0 for r in _rank_states(engine)))
    ranks = _rank_states(engine)
    for rank in ranks:
        assert rank["waiting_queue_size"] == 0
        assert_kv_all_back(rank)
    for group_start in range(0, len(ranks), TP):
        group = ranks[group_start : group_start + TP]
        for key in ("tree_cache_size", "free_kv_tokens", "num_loop_turns", "forward_ct_decode"):
            assert len({r[key] for r in group}) == 1, (key, group)


def _storm(engine: sgl.Engine, num: int, seconds: float) -> None:
    """Requests of different lengths under random pauses, continues, flushes and aborts: each
    ends exactly once, with aligned tokens and logprobs, and no rank leaks KV."""
    storm_requests(engine, random.Random(5), num, seconds, base_len=30, step=11)
    _check_no_leak(engine)  # before any flush: a leak on any rank shows here
    assert engine.flush_cache().success


# ---- unit: the group's reply merge and the leader's clock (no processes) ---------------------
def test_turn_replies_merge_per_request_naming_the_failed_rank() -> None:
    ok = FlushCacheReqOutput(success=True, flushed_items=7, req_id="f")
    refused = FlushCacheReqOutput(success=False, error_msg="2 request(s) hold KV", req_id="f")
    pause = PauseGenerationReqOutput(True, "ok", "retract", 0, 3, 0, 3, req_id="p")
    notice = PauseStateOutput(True, "retract")
    [n, p, f] = merge_turn_replies([[notice, pause, ok], [notice, pause, refused]])
    assert n is notice
    assert p.num_retracted == 3 and p.num_waiting == 3  # the same requests: not summed
    assert not f.success and f.error_msg == "TP rank 1: 2 request(s) hold KV"
    [lost] = merge_turn_replies([[ok], []])  # a rank that did not answer fails the reply
    assert not lost.success and "TP rank 1: no reply from TP rank 1" in lost.error_msg


def test_tp_state_lists_every_rank() -> None:
    states = {r: GetInternalStateReqOutput({"available_kv_tokens": 10 - r, "x": r}, "s")
              for r in range(TP)}
    merged = merge_tp_replies(states)
    assert merged.internal_state["x"] == 0 and merged.internal_state["tp_size"] == TP
    assert [(r["tp_rank"], r["available_kv_tokens"]) for r in
            merged.internal_state["tp_ranks"]] == [(0, 10), (1, 9)]


def test_pause_deadlines_follow_the_leader_clock() -> None:
    state = PauseState()
    state.follow_leader_clock()
    state.start(PauseGenerationReqInput(mode="retract", timeout_s=0.01), "retract", False)
    time.sleep(0.02)
    assert state.deadline_due()  # what rank 0 reads and broadcasts
    assert not state.lease_expired()  # no rank decides on its own clock
    state.expire()
    assert state.lease_expired()
    state.start(PauseGenerationReqInput(mode="retract", timeout_s=60), "retract", False)
    assert not state.lease_expired()  # a verdict applies to the deadline it was made for
    state.expire()
    state.resume()
    assert not state.lease_expired() and not state.deadline_due()


def test_server_args_parallelism_values() -> None:
    from sglang.srt.server_args import ServerArgs

    ok = ServerArgs(model_path="m", device="cpu", tp_size=4, nnodes=2, node_rank=1,
                    dist_init_addr="10.0.0.1:5000", dist_timeout=30)
    assert (ok.tp_size, ok.nnodes, ok.node_rank) == (4, 2, 1)
    for kwargs, needle in [
        ({"tp_size": 0}, "--tp-size"),
        ({"tp_size": 3, "nnodes": 2, "dist_init_addr": "h:1"}, "multiple of --nnodes"),
        ({"tp_size": 2, "nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"}, "--node-rank"),
        ({"tp_size": 2, "nnodes": 2}, "--dist-init-addr"),
        ({"tp_size": 2, "nnodes": 2, "dist_init_addr": "nohost"}, "HOST:PORT"),
        ({"tp_size": 2, "nnodes": 2, "dp_size": 2, "dist_init_addr": "h:1"}, "--dp-size"),
        ({"dist_timeout": 0}, "--dist-timeout"),
    ]:
        with pytest.raises(ValueError, match=needle):
            ServerArgs(model_path="m", device="cpu", **kwargs)


# ---- Engine at TP=2 ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_path(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))  # 4 attention heads, 2 KV heads (GQA)


@pytest.fixture(scope="module")
def engine(model_path: str) -> Iterator[sgl.Engine]:
    with sgl.Engine(model_path=model_path, random_seed=0, tp_size=TP,
                    max_total_tokens=KV_TOKENS) as eng:
        yield eng


@pytest.fixture(autouse=True)
def _resume_and_drain(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "engine" in request.fixturenames:
        eng = request.getfixturevalue("engine")
        eng.continue_generation()
        eng.abort_request(abort_all=True)


def _outputs(engine: sgl.Engine) -> list[tuple[list[int], list[float], list[int]]]:
    greedy = engine.generate(input_ids=PROMPTS, sampling_params=_greedy(24), return_logprob=True)
    seeded = engine.generate(
        input_ids=PROMPTS,
        sampling_params=[{"temperature": 1.0, "max_new_tokens": 24, "ignore_eos": True,
                          "sampling_seed": 100 + i} for i in range(len(PROMPTS))],
    )
    return [
        (g["output_ids"], [lp for lp, _, _ in g["meta_info"]["output_token_logprobs"]],
         s["output_ids"])
        for g, s in zip(greedy, seeded)
    ]


def test_tp2_outputs_equal_tp1(engine: sgl.Engine, model_path: str) -> None:
    tp2 = _outputs(engine)
    with sgl.Engine(model_path=model_path, random_seed=0, max_total_tokens=KV_TOKENS) as single:
        tp1 = _outputs(single)
    for (ids2, lps2, seeded2), (ids1, lps1, seeded1) in zip(tp2, tp1):
        assert ids2 == ids1 and seeded2 == seeded1
        assert lps2 == pytest.approx(lps1, abs=1e-4)  # a sharded sum rounds differently


def test_retract_pause_counts_each_request_once(engine: sgl.Engine) -> None:
    with ThreadPoolExecutor(3) as pool:
        futs = [pool.submit(engine.generate, input_ids=PROMPTS[i], sampling_params=_greedy(),
                            return_logprob=True) for i in range(3)]
        wait_for(lambda: all(r["running_batch_size"] == 3 for r in _rank_states(engine)))
        reply = engine.pause_generation(mode="retract")
        assert reply["status"] == "ok" and reply["num_retracted"] == 3  # not 3 per rank
        ranks = _rank_states(engine)
        assert all(r["engine_paused"] and r["waiting_queue_size"] == 3 for r in ranks)
        assert all(r["private_kv_tokens"] == 0 for r in ranks)  # every rank released its KV
        turns = ranks[0]["num_loop_turns"]
        wait_for(lambda: _rank_states(engine)[0]["num_loop_turns"] > turns + 3)
        assert all(r["forward_ct_decode"] == ranks[0]["forward_ct_decode"]
                   for r in _rank_states(engine))  # nothing decoded on any rank while paused
        assert engine.continue_generation()["was_paused"]
        for fut in futs:
            out = fut.result(timeout=120)
            check_complete(out, MAX_NEW)
            assert out["meta_info"]["total_retractions"] == 1
    _check_no_leak(engine)


def test_in_place_pause_refuses_flush_on_every_rank(engine: sgl.Engine) -> None:
    with ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(engine.generate, input_ids=PROMPTS[i], sampling_params=_greedy(),
                            return_logprob=True) for i in range(2)]
        wait_for(lambda: all(r["running_batch_size"] == 2 for r in _rank_states(engine)))
        assert engine.pause_generation(mode="in_place")["num_running"] == 2
        flush = engine.flush_cache()
        assert not flush.success
        assert "TP rank 0:" in flush.error_msg and "TP rank 1:" in flush.error_msg
        engine.continue_generation()
        for fut in futs:
            check_complete(fut.result(timeout=120), MAX_NEW)


def test_pause_lease_expires_on_every_rank_together(engine: sgl.Engine) -> None:
    assert engine.pause_generation(mode="retract", timeout_s=0.5)["status"] == "ok"
    assert all(r["engine_paused"] for r in _rank_states(engine))
    wait_for(lambda: not any(r["engine_paused"] for r in _rank_states(engine)), timeout=10)
    tm = engine.tokenizer_manager
    assert tm is not None
    wait_for(lambda: not tm.is_paused, timeout=10)
    out = engine.generate(input_ids=PROMPTS[0], sampling_params=_greedy(4))
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_wait_pause_drains_then_answers(engine: sgl.Engine) -> None:
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(engine.generate, input_ids=PROMPTS[0], sampling_params=_greedy(),
                          return_logprob=True)  # long enough to be seen running
        wait_for(lambda: _rank_states(engine)[0]["running_batch_size"] == 1)
        reply = engine.pause_generation(mode="wait")
        assert reply["status"] == "ok"
        check_complete(fut.result(timeout=60), MAX_NEW)  # it finished before the pause answered
    assert all(r["engine_paused"] and r["running_batch_size"] == 0 for r in _rank_states(engine))
    engine.continue_generation()


def test_wait_pause_drain_timeout_retracts_on_every_rank(engine: sgl.Engine) -> None:
    """The drain's deadline is rank 0's verdict: both ranks retract the straggler together."""
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(engine.generate, input_ids=PROMPTS[2], sampling_params=_greedy(),
                          return_logprob=True)
        wait_for(lambda: _rank_states(engine)[0]["running_batch_size"] == 1)
        reply = engine.pause_generation(mode="wait", timeout_s=0.3)
        assert reply["status"] == "ok" and reply["num_retracted"] == 1
        ranks = _rank_states(engine)
        assert all(r["engine_paused"] and r["waiting_queue_size"] == 1 for r in ranks)
        assert all(r["private_kv_tokens"] == 0 for r in ranks)
        engine.continue_generation()
        out = fut.result(timeout=120)
        check_complete(out, MAX_NEW)
        assert out["meta_info"]["total_retractions"] == 1


def test_pause_storm_every_request_ends_once_no_leak_on_any_rank(engine: sgl.Engine) -> None:
    _storm(engine, num=12, seconds=3.0)


def _lm_head(engine: sgl.Engine) -> torch.Tensor:
    """The whole LM head, gathered from the ranks' vocabulary shards."""
    return torch.tensor(engine.get_weights_by_name("lm_head.weight", truncate_size=10_000))


def _same_prompt_ids(engine: sgl.Engine, n: int = 12) -> list[int]:
    return engine.generate(input_ids=PROMPTS[1], sampling_params=_greedy(n))["output_ids"]


def test_weight_updates_apply_on_every_rank(
    engine: sgl.Engine, tiny_model_dir, model_path: str
) -> None:
    before = engine.generate(input_ids=PROMPTS[1], sampling_params=_greedy(12),
                             return_logprob=True)
    other = str(tiny_model_dir("llama", initializer_range=0.5))
    ok, message, _ = engine.update_weights_from_disk(other, weight_version="v2")
    assert ok, message
    assert [r["weight_version"] for r in _rank_states(engine)] == ["v2"] * TP
    # Every rank's shard holds the new checkpoint (the gathered weight is the file's).
    from safetensors.torch import load_file

    [file] = [f for f in os.listdir(other) if f.endswith(".safetensors")]
    down = load_file(os.path.join(other, file))["model.layers.0.mlp.down_proj.weight"]
    gathered = engine.get_weights_by_name("model.layers.0.mlp.down_proj.weight", 10_000)
    assert torch.equal(torch.tensor(gathered), down)
    assert _same_prompt_ids(engine) != before["output_ids"]
    ok, message, _ = engine.update_weights_from_disk(model_path, weight_version="v3")
    assert ok, message
    assert _same_prompt_ids(engine) == before["output_ids"]
    # Refused updates change nothing on any rank: bit-identical tokens and logprobs (compared
    # with the same prefix-cache state: the prompt is cached now).
    before = engine.generate(input_ids=PROMPTS[1], sampling_params=_greedy(12),
                             return_logprob=True)
    assert not engine.update_weights_from_disk("/nonexistent/checkpoint")[0]
    bad_shape = torch.zeros(3, 3)
    ok, message = engine.update_weights_from_tensor([("lm_head.weight", bad_shape)])
    assert not ok and "TP rank 0:" in message
    again = engine.generate(input_ids=PROMPTS[1], sampling_params=_greedy(12),
                            return_logprob=True)
    assert again["output_ids"] == before["output_ids"]
    assert again["meta_info"]["output_token_logprobs"] == \
        before["meta_info"]["output_token_logprobs"]
    assert [r["weight_version"] for r in _rank_states(engine)] == ["v3"] * TP
    # A tensor update reaches every rank.
    head = torch.tensor(engine.get_weights_by_name("lm_head.weight", truncate_size=10_000))
    ok, message = engine.update_weights_from_tensor([("lm_head.weight", -head)],
                                                    weight_version="neg")
    assert ok, message
    assert [r["weight_version"] for r in _rank_states(engine)] == ["neg"] * TP
    assert torch.equal(_lm_head(engine), -head)  # every rank's vocabulary rows
    assert _same_prompt_ids(engine) != before["output_ids"]
    assert engine.update_weights_from_tensor([("lm_head.weight", head)])[0]
    assert _same_prompt_ids(engine) == before["output_ids"]


def test_serialized_tensors_one_entry_per_rank(engine: sgl.Engine) -> None:
    """Upstream's ``serialized_named_tensors``: entry r goes to TP rank r, undecoded. Rank 0
    gets the negated head, rank 1 the head as it is: only rank 0's vocabulary rows change."""
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
    from sglang.srt.utils import MultiprocessingSerializer

    head = _lm_head(engine)
    payloads = [MultiprocessingSerializer.serialize([("lm_head.weight", t)], output_str=True)
                for t in (-head, head)]
    tm = engine.tokenizer_manager
    assert tm is not None
    obj = UpdateWeightsFromTensorReqInput([], None, True, False, "per-rank",
                                          serialized_named_tensors=payloads)
    out = engine._run(tm.update_weights_from_tensor(obj))
    assert out.success, out.message
    half = head.shape[0] // TP
    got = _lm_head(engine)
    assert torch.equal(got[:half], -head[:half]) and torch.equal(got[half:], head[half:])
    short = UpdateWeightsFromTensorReqInput([], None, True, False, None,
                                            serialized_named_tensors=payloads[:1])
    assert not engine._run(tm.update_weights_from_tensor(short)).success
    assert engine.update_weights_from_tensor([("lm_head.weight", head)])[0]
    assert torch.equal(_lm_head(engine), head)


def test_update_weights_from_distributed_reaches_every_rank(engine: sgl.Engine) -> None:
    """Upstream's layout: every TP rank joins the trainer's group (world_size = 1 + TP,
    ranks rank_offset + tp_rank), receives the broadcast and loads its part; a group too small
    for every rank is refused before any rank joins."""
    before = _same_prompt_ids(engine)
    head = torch.tensor(engine.get_weights_by_name("lm_head.weight", truncate_size=10_000))
    broadcast_weight_sync(engine, TP, "tp", -head)
    assert [r["weight_version"] for r in _rank_states(engine)] == ["broadcast"] * TP
    assert torch.equal(_lm_head(engine), -head)  # every rank's vocabulary rows
    assert _same_prompt_ids(engine) != before
    assert engine.update_weights_from_tensor([("lm_head.weight", head)])[0]
    assert _same_prompt_ids(engine) == before


# ---- DP=2 x TP=2 ------------------------------------------------------------------------------
def test_dp2_tp2_storm_abort_and_states(model_path: str) -> None:
    with sgl.Engine(model_path=model_path, random_seed=0, tp_size=TP, dp_size=2,
                    max_total_tokens=KV_TOKENS) as eng:
        states = eng.get_server_info()["internal_states"]
        assert [(s["dp_rank"], s["tp_size"]) for s in states] == [(0, TP), (1, TP)]
        with ThreadPoolExecutor(4) as pool:
            futs = [pool.submit(eng.generate, input_ids=PROMPTS[i], sampling_params=_greedy(),
                                rid=f"ab-{i}", return_logprob=True) for i in range(4)]
            wait_for(lambda: [r["running_batch_size"] for r in _rank_states(eng)] == [2] * 4)
            assert eng.abort_request(rid="ab-3") == 1  # reaches the replica that holds it
            assert futs[3].result(timeout=30)["meta_info"]["finish_reason"]["type"] == "abort"
            reply = eng.pause_generation(mode="retract")
            assert reply["num_retracted"] == 3  # summed over replicas, once per TP group
            assert eng.continue_generation()["was_paused"]
            for fut in futs[:3]:
                check_complete(fut.result(timeout=120), MAX_NEW)
        _check_no_leak(eng)
        _storm(eng, num=8, seconds=2.0)
        # A rank that dies (TP rank 1 of replica 1) fails every caller within seconds and
        # stops every engine process: its group's rank 0 loses its peer, the launcher the rest.
        procs = {p.name: p for p in eng._procs}
        assert set(procs) == {"sglang-scheduler-dp0-tp0", "sglang-scheduler-dp0-tp1",
                              "sglang-scheduler-dp1-tp0", "sglang-scheduler-dp1-tp1",
                              "sglang-dp-controller", "sglang-detokenizer"}
        with ThreadPoolExecutor(2) as pool:
            futs = [pool.submit(eng.generate, input_ids=PROMPTS[i], sampling_params=_greedy())
                    for i in range(2)]
            wait_for(lambda: [r["running_batch_size"] for r in _rank_states(eng)] == [1] * 4)
            eng.pause_generation(mode="in_place")  # neither request can finish meanwhile
            killed_at = time.monotonic()
            os.kill(procs["sglang-scheduler-dp1-tp1"].pid, signal.SIGKILL)
            for fut in futs:
                with pytest.raises(RuntimeError, match="scheduler died"):
                    fut.result(timeout=10)
            assert time.monotonic() - killed_at < 5
        with pytest.raises(RuntimeError, match="scheduler died"):
            eng.generate(input_ids=PROMPTS[0], sampling_params=_greedy(4))
        wait_for(lambda: not any(p.is_alive() for p in procs.values()), timeout=10)
