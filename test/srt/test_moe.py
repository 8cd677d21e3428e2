"""Mixture-of-experts models end to end (layers/moe.py; the per-layer numerics against
transformers are in test_models.py, tensor parallelism in test_tensor_parallel_model.py).

A tiny random Qwen3-MoE (8 experts, 3 per token) through ``sglang.Engine``: greedy tokens and
logprobs equal transformers'; every pause mode keeps the token accounting exact; weight updates
from transformers' live (stacked-expert) parameters and from disk (per-expert names) give the
updated model's tokens; deterministic mode is batch-invariant and survives a retract bitwise.
Routed experts (``--enable-return-routed-experts``) over HTTP against transformers' router, and
unchanged by batching and retraction.
"""

from __future__ import annotations

import base64
import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_test_utils import (
    NUM_REQS,
    assert_kv_all_back,
    engine_state,
    ids_and_logprobs,
    post,
    request_pool,
    submit_greedy,
    wait_running,
)
from model_test_utils import hf_greedy, make_runner
from server_test_utils import ServerProcess
from transformers import AutoModelForCausalLM

import sglang as sgl
from sglang.srt.layers.moe import SparseMoE, route, unstack_expert_weights
from sglang.srt.model_executor.cuda_graph_runner import cuda_graph_off_reason
from sglang.srt.server_args import ServerArgs

PROMPTS = [[5, 17, 3, 99, 250, 8, 41], [30, 31, 32, 33], [200, 7, 7]]
NUM_NEW = 10
GREEDY = {"temperature": 0, "max_new_tokens": NUM_NEW, "ignore_eos": True}
MAX_NEW = 400  # pause tests: long enough to be interrupted, short enough for 2 cores


@pytest.fixture(scope="module")
def moe_dir(tiny_model_dir) -> Path:
    return tiny_model_dir("qwen3_moe")


@pytest.fixture(scope="module")
def hf_model(moe_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(moe_dir: Path):
    with sgl.Engine(model_path=str(moe_dir), random_seed=0) as eng:
        yield eng


def _greedy(engine: sgl.Engine, prompts: list[list[int]] = PROMPTS) -> list[dict]:
    return engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)


def _check_against_hf(outs: list[dict], hf: torch.nn.Module) -> None:
    for prompt, out in zip(PROMPTS, outs):
        want_ids, want_logits = hf_greedy(hf, prompt, NUM_NEW)
        assert out["output_ids"] == want_ids
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        want = [torch.log_softmax(lg, -1)[t].item() for lg, t in zip(want_logits, want_ids)]
        assert got == pytest.approx(want, abs=1e-4)


def test_route_picks_top_k_and_renormalizes() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 3.5]])
    weights, ids = route(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[1, 2], [3, 0]]
    torch.testing.assert_close(weights, probs.gather(-1, ids))
    weights, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))


def test_sparse_moe_is_the_weighted_sum_of_its_experts() -> None:
    """The block against a direct per-token loop, and each row independent of its batch."""
    torch.manual_seed(0)
    block = SparseMoE(16, 5, 2, renormalize=True, make_expert=lambda: torch.nn.Linear(16, 16))
    torch.nn.init.normal_(block.gate.weight)
    x = torch.randn(7, 16)
    out = block(x)
    weights, ids = route(block.gate(x), 2, renormalize=True)
    for t in range(7):
        want = sum(weights[t, j] * block.experts[int(ids[t, j])](x[t]) for j in range(2))
        torch.testing.assert_close(out[t], want)
    torch.testing.assert_close(block(x[2:3]), out[2:3])
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        SparseMoE(16, 2, 3, renormalize=True, make_expert=lambda: torch.nn.Linear(16, 16))


def test_stacked_expert_tensors_split_per_expert() -> None:
    gate_up, down = torch.randn(3, 8, 4), torch.randn(3, 4, 4)
    names = [
        ("model.layers.0.mlp.experts.gate_up_proj", gate_up),
        ("model.layers.0.mlp.experts.down_proj", down),
        ("model.norm.weight", torch.ones(4)),
    ]
    out = dict(unstack_expert_weights(names))
    assert torch.equal(out["model.layers.0.mlp.experts.2.gate_up_proj.weight"], gate_up[2])
    assert torch.equal(out["model.layers.0.mlp.experts.1.down_proj.weight"], down[1])
    assert "model.norm.weight" in out and len(out) == 7
    with pytest.raises(ValueError, match="3 dimensions"):
        list(unstack_expert_weights([("layers.0.mlp.experts.down_proj", torch.ones(2, 2))]))


def test_moe_models_decode_eagerly_on_cuda(moe_dir: Path) -> None:
    model = torch.nn.Sequential(SparseMoE(8, 2, 1, True, lambda: torch.nn.Linear(8, 8)))
    args = ServerArgs(model_path=str(moe_dir), device="cuda")
    assert "MoE" in str(cuda_graph_off_reason(args, 1, model))
    assert cuda_graph_off_reason(args, 1, torch.nn.Linear(2, 2)) is None


def test_greedy_tokens_and_logprobs_match_transformers(engine, hf_model) -> None:
    _check_against_hf(_greedy(engine), hf_model)


@pytest.mark.parametrize("mode", ["retract", "in_place", "abort"])
def test_pause_modes_keep_the_token_accounting(engine, mode: str) -> None:
    with request_pool(engine, NUM_REQS) as pool:
        futs = submit_greedy(engine, pool, max_new=MAX_NEW, return_entropy=True)
        wait_running(lambda: engine_state(engine))
        reply = engine.pause_generation(mode=mode)
        assert reply["status"] == "ok"
        engine.continue_generation()
        outs = [f.result(timeout=120) for f in futs]
    for out in outs:
        meta = out["meta_info"]
        num = len(out["output_ids"])
        assert num == meta["completion_tokens"] == len(meta["output_token_logprobs"])
        assert len(meta["output_token_entropy"]) == num
        assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
        if mode == "abort":
            assert meta["finish_reason"]["type"] == "abort" and num < MAX_NEW
        else:
            assert meta["finish_reason"] == {"type": "length", "length": MAX_NEW}
        assert (meta["total_retractions"] >= 1) == (mode == "retract")
    assert_kv_all_back(engine_state(engine))


def test_weight_updates_from_live_parameters_and_from_disk(engine, hf_model, moe_dir) -> None:
    """transformers' live parameters name each block's experts as two stacked tensors; the
    checkpoint on disk names them one by one. Both load, and the tokens follow the weights."""
    updated = copy.deepcopy(hf_model)
    with torch.no_grad():
        for param in updated.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    names = [name for name, _ in updated.named_parameters()]
    assert "model.layers.0.mlp.experts.gate_up_proj" in names  # the stacked form is tested
    ok, message = engine.update_weights_from_tensor(list(updated.named_parameters()))
    assert ok, message
    _check_against_hf(_greedy(engine), updated)
    ok, message, _ = engine.update_weights_from_disk(str(moe_dir))
    assert ok, message
    _check_against_hf(_greedy(engine), hf_model)


def test_refused_update_changes_nothing(engine, hf_model) -> None:
    before = [ids_and_logprobs(out) for out in _greedy(engine)]
    bad = [("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(8, 96, 7))]
    ok, message = engine.update_weights_from_tensor(bad)
    assert not ok and "shape" in message
    assert [ids_and_logprobs(out) for out in _greedy(engine)] == before


def _routing(meta: dict, num_layers: int, top_k: int) -> np.ndarray:
    """meta_info["routed_experts"] decoded: int32 ``[rows, num_layers, top_k]``."""
    raw = base64.b64decode(meta["routed_experts"])
    return np.frombuffer(raw, dtype=np.int32).reshape(-1, num_layers, top_k)


def test_routed_experts_need_the_server_flag(engine, tiny_model_dir) -> None:
    with pytest.raises(ValueError, match="--enable-return-routed-experts"):
        engine.generate(input_ids=[1, 2], sampling_params=GREEDY, return_routed_experts=True)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        make_runner(tiny_model_dir("llama"), enable_return_routed_experts=True)


@pytest.fixture(scope="module")
def routing_server(tiny_model_dir):
    """Qwen2-MoE (layer 1 dense) recording routed experts, over HTTP."""
    path = tiny_model_dir("qwen2_moe", mlp_only_layers=[1])
    with ServerProcess(path, "--enable-return-routed-experts") as server:
        yield server, path


def test_routed_experts_over_http_match_the_router(routing_server) -> None:
    """Rows are the positions ``[start, prompt + output - 1)``: each token fed to the model,
    its 3 experts per layer as transformers' router ranks them, -1 in the dense layer; a
    cached prefix keeps the routing it was computed with."""
    server, path = routing_server
    prompt = [5, 17, 3, 99, 250, 8, 41]
    body = {"input_ids": prompt, "sampling_params": GREEDY, "return_routed_experts": True}
    first = post(server, "/generate", body)
    assert first.status_code == 200, first.text
    out = first.json()
    routing = _routing(out["meta_info"], 2, 3)
    fed = prompt + out["output_ids"][:-1]
    assert routing.shape == (len(fed), 2, 3)
    assert out["meta_info"]["routed_experts_start_len"] == 0
    assert (routing[:, 1] == -1).all()  # mlp_only_layers: no router
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        router_logits = hf(torch.tensor([fed]), output_router_logits=True).router_logits
    probs = torch.softmax(router_logits[0].reshape(len(fed), -1).float(), -1)
    assert routing[:, 0].tolist() == probs.topk(3, dim=-1).indices.tolist()

    again = post(server, "/generate", {**body, "routed_experts_start_len": 4}).json()
    assert again["meta_info"]["cached_tokens"] > 0
    assert again["meta_info"]["routed_experts_start_len"] == 4
    assert np.array_equal(_routing(again["meta_info"], 2, 3), routing[4:])
    prompt_only = {**body, "sampling_params": {"max_new_tokens": 0}}
    routing_only = _routing(post(server, "/generate", prompt_only).json()["meta_info"], 2, 3)
    assert np.array_equal(routing_only, routing[: len(prompt) - 1])
    plain = post(server, "/generate", {"input_ids": prompt, "sampling_params": GREEDY}).json()
    assert "routed_experts" not in plain["meta_info"]
    for bad in ({"routed_experts_start_len": 8}, {"routed_experts_start_len": -1},
                {"return_routed_experts": "yes"}):
        r = post(server, "/generate", {**body, **bad})
        assert r.status_code == 400 and next(iter(bad)) in r.text, r.text


def test_deterministic_mode_is_batch_invariant_through_a_retract(moe_dir: Path) -> None:
    """Tokens, logprobs and routed experts of a request: the same alone, in a batch, and
    through a retract (re-prefilled from its own tokens)."""
    prompt = PROMPTS[0]
    params = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
    kw = {"return_logprob": True, "return_routed_experts": True}

    def result(out: dict) -> tuple:
        return (*ids_and_logprobs(out), out["meta_info"]["routed_experts"])

    with sgl.Engine(
        model_path=str(moe_dir),
        random_seed=0,
        enable_deterministic_inference=True,
        enable_return_routed_experts=True,
    ) as eng:
        alone = result(eng.generate(input_ids=prompt, sampling_params=params, **kw))
        assert _routing({"routed_experts": alone[2]}, 2, 3).shape[0] == len(prompt) + MAX_NEW - 1
        others = [[3, 1, 4, 1, 5, 9, 2, 6], [42] * 20, [7, 7]]
        batch = eng.generate(input_ids=[*others, prompt], sampling_params=params, **kw)
        assert result(batch[-1]) == alone
        with request_pool(eng, 2) as pool:
            futs = [
                pool.submit(eng.generate, input_ids=p, sampling_params=params, **kw)
                for p in (others[0], prompt)
            ]
            wait_running(lambda: engine_state(eng), 2)
            assert eng.pause_generation(mode="retract")["num_retracted"] == 2
            eng.continue_generation()
            outs = [f.result(timeout=120) for f in futs]
        assert outs[1]["meta_info"]["total_retractions"] >= 1
        assert result(outs[1]) == alone
        assert result(outs[0]) == result(batch[0])
