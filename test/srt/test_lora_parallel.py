"""Multi-LoRA serving with tensor and data parallelism (docs/lora.md, "TP and DP"), on CPU.

* Unit (one process): each TP rank's A / B slices of an adapter are the right slices of the
  full adapter (GQA, and one KV head replicated on both ranks), and the ranks' hooked layer
  outputs assemble into the one-rank output (column layers: the rank's rows; row layers: the
  partial sums add up, the delta counted once).
* TP=2 engine against a TP=1 server (the reference, also the /v1/models check): the same
  greedy tokens per adapter and in a batch mixing two adapters and the base model; refused
  adapters leave every rank serving with identical adapter sets and slots; an adapter pushed
  as tensors; an adapter-scoped retract pause while another adapter runs.
* DP=2: adapters load on both replicas, outputs equal the reference, unload reaches both.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_test_utils import MAX_NEW, engine_state, post, wait_for
from test_lora import ALL, write_adapter

import sglang as sgl
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed import parallel_state
from sglang.srt.distributed.parallel_state import GroupCoordinator
from sglang.srt.lora.layers import LoRABatchInfo
from sglang.srt.lora.lora_manager import LoRAManager
from sglang.srt.managers.data_parallel_controller import FRONTEND, DpRouter
from sglang.srt.managers.dp_reply_merge import merge_replies, merge_tp_replies, settle_lora_unload
from sglang.srt.managers.io_struct import (
    LoRAPauseStateOutput,
    LoRAUpdateOutput,
    UnloadLoRAAdapterReqInput,
)
from sglang.srt.model_loader import get_model
from sglang.srt.server_args import ServerArgs

TP = 2
PROMPTS = [[5, 17, 33, 80, 120, 7], [9, 9, 41, 200, 3], [100, 101, 102, 103, 104, 105, 106]]
SHORT = 8
GREEDY = {"temperature": 0, "max_new_tokens": SHORT}
# name -> (seed, rank, target modules)
ADAPTERS = {"a": (1, 4, ALL), "b": (2, 8, ["q_proj", "v_proj"]), "c": (3, 4, ALL)}
LORA_ARGS = {"max_loras_per_batch": 2, "max_lora_rank": 8, "max_total_tokens": 4096}


@pytest.fixture(scope="module")
def lora_dirs(tiny_model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
              ) -> dict[str, Path]:
    base = tiny_model_dir("llama")  # 4 heads, 2 KV heads: one KV head per rank
    root = tmp_path_factory.mktemp("lora-parallel")
    dirs = {"base": base}
    for name, (seed, rank, targets) in ADAPTERS.items():
        dirs[name] = write_adapter(base, root / name, seed, rank, targets)
    return dirs


# ---- unit: each rank's slice (one process, stand-in groups) -----------------------------------
def _as_rank(monkeypatch: pytest.MonkeyPatch, base: Path, adapter: Path, rank: int, tp: int
             ) -> tuple[dict[str, torch.nn.Module], LoRAManager]:
    """The model's modules (by name) built and loaded as rank ``rank`` of ``tp``, and its
    LoRAManager with adapter "x" in slot 0, applied to every row. A stand-in group: loading
    runs no collective; the hooks later run in a group of one, so a row-parallel layer's
    output (and its LoRA shrink) stays this rank's partial sum."""
    monkeypatch.setattr(parallel_state, "_TP", GroupCoordinator(rank=rank, world_size=tp))
    try:
        model = get_model(ModelConfig(str(base), dtype="float32", device="cpu"), "cpu")
        args = ServerArgs(model_path=str(base), lora_paths=[f"x={adapter}"], max_lora_rank=8,
                          max_loras_per_batch=1)
        manager = LoRAManager(model, args)
    finally:
        monkeypatch.setattr(parallel_state, "_TP", GroupCoordinator(rank=0, world_size=1))
    for target in manager.targets.values():
        target.write_slot(0, manager.loaded["x"].adapter)
    manager.batch = LoRABatchInfo([(0, None)])
    return dict(model.named_modules()), manager


def _rank_rows(proj: str, rank: int, cfg: Any) -> range:
    """Rank ``rank``'s rows of ``proj``'s full output, written out from the head layout: q
    heads split evenly; KV heads split evenly, or head ``rank * KVH // TP`` replicated when
    there are fewer KV heads than ranks; gate / up halves split evenly."""
    d = cfg.hidden_size // cfg.num_attention_heads
    if proj == "q_proj":
        size = cfg.num_attention_heads // TP * d
        return range(rank * size, (rank + 1) * size)
    if proj in ("k_proj", "v_proj"):
        kvh = cfg.num_key_value_heads
        start = rank * kvh // TP * d
        return range(start, start + max(1, kvh // TP) * d)
    size = cfg.intermediate_size // TP
    return range(rank * size, (rank + 1) * size)


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_each_rank_holds_its_slice_and_outputs_assemble(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Callable[..., Path], tmp_path: Path,
    kv_heads: int,
) -> None:
    from transformers import AutoConfig

    base = tiny_model_dir("llama", num_key_value_heads=kv_heads)
    cfg = AutoConfig.from_pretrained(base)
    adapter = write_adapter(base, tmp_path / "x", 7, 4, ALL)
    full_modules, full = _as_rank(monkeypatch, base, adapter, 0, 1)
    ranks = [_as_rank(monkeypatch, base, adapter, r, TP) for r in range(TP)]
    full_w = full.loaded["x"].adapter.weights
    for rank, (_, manager) in enumerate(ranks):
        local = manager.loaded["x"].adapter.weights
        assert local.keys() == full_w.keys()
        for (layer, proj), (a, b) in full_w.items():
            la, lb = local[(layer, proj)]
            if proj in ("o_proj", "down_proj"):  # A's columns of the rank's input, B whole
                cols = a.shape[1] // TP
                assert torch.equal(la, a[:, rank * cols : (rank + 1) * cols])
                assert torch.equal(lb, b)
            else:  # A whole, B's rows of the rank's output shard
                rows = _rank_rows(proj, rank, cfg)
                assert torch.equal(la, a) and torch.equal(lb, b[rows.start : rows.stop])
    torch.manual_seed(0)
    prefix = "model.layers.1."
    kv_rows = cfg.num_key_value_heads * cfg.hidden_size // cfg.num_attention_heads
    full_offsets = {"q_proj": 0, "k_proj": cfg.hidden_size, "v_proj": cfg.hidden_size + kv_rows,
                    "gate_proj": 0, "up_proj": cfg.intermediate_size}
    # Column layers: each rank's output is its rows of the full output, LoRA included.
    for name, parts in (("self_attn.qkv_proj", ["q_proj", "k_proj", "v_proj"]),
                        ("mlp.gate_up_proj", ["gate_proj", "up_proj"])):
        x = torch.randn(5, cfg.hidden_size)
        with torch.no_grad():
            want = full_modules[prefix + name](x)
            full.batch = None
            assert not torch.allclose(full_modules[prefix + name](x), want)  # LoRA counts
            full.batch = LoRABatchInfo([(0, None)])
        for rank, (modules, _) in enumerate(ranks):
            with torch.no_grad():
                got = modules[prefix + name](x)
            rows = [full_offsets[p] + r for p in parts for r in _rank_rows(p, rank, cfg)]
            assert torch.allclose(got, want[:, rows], atol=1e-5), (name, rank)
    # Row layers: the ranks' partial outputs (base + LoRA) add up to the full one.
    for name, width in (("self_attn.o_proj", cfg.hidden_size),
                        ("mlp.down_proj", cfg.intermediate_size)):
        x = torch.randn(5, width)
        cols = width // TP
        with torch.no_grad():
            want = full_modules[prefix + name](x)
            got = sum(modules[prefix + name](x[:, r * cols : (r + 1) * cols])
                      for r, (modules, _) in enumerate(ranks))
        assert torch.allclose(got, want, atol=1e-5), name


# ---- unit: replies of several ranks (no processes) ---------------------------------------------
def test_lora_replies_merge_over_ranks() -> None:
    ok = LoRAUpdateOutput(True, "", {"a": "/a", "b": "/b"}, "x")
    refused = LoRAUpdateOutput(False, "rank 1: bad shape", {"a": "/a"}, "x")
    # TP: the ranks agreed on the refusal; it is said once.
    merged = merge_tp_replies({0: refused, 1: refused})
    assert not merged.success and merged.error_message == "rank 1: bad shape"
    # DP: the failing replica is named; only adapters loaded on every replica are listed.
    merged = merge_replies({0: ok, 1: refused})
    assert not merged.success and merged.error_message == "DP rank 1: rank 1: bad shape"
    assert merged.loaded_adapters == {"a": "/a"}


def test_dp_unload_settles_once_no_replica_has_the_adapter() -> None:
    running = LoRAUpdateOutput(False, "LoRA adapter 'b' has 1 request(s) running", {"b": "/b"})
    gone = LoRAUpdateOutput(True, "", {})
    not_loaded = LoRAUpdateOutput(False, "LoRA adapter 'b' is not loaded", {})
    first = settle_lora_unload("b", {0: gone, 1: running})
    assert not first.success and first.error_message.startswith("DP rank 1: ")
    retry = settle_lora_unload("b", {0: not_loaded, 1: gone})  # after the abort
    assert retry.success and retry.error_message == ""
    assert not settle_lora_unload("b", {0: not_loaded, 1: not_loaded}).success


def test_dp_router_reports_an_adapter_paused_while_any_replica_has_it_paused() -> None:
    router = DpRouter(2, "round_robin")
    assert router.on_reply(0, LoRAPauseStateOutput(["a"])) == [
        (FRONTEND, LoRAPauseStateOutput(["a"]))
    ]
    assert router.on_reply(1, LoRAPauseStateOutput(["a"])) == []
    assert router.on_reply(0, LoRAPauseStateOutput([])) == []  # replica 1 still holds "a"
    assert router.on_reply(1, LoRAPauseStateOutput([])) == [(FRONTEND, LoRAPauseStateOutput([]))]
    unload = UnloadLoRAAdapterReqInput("b", req_id="u")
    router.expect("u", [0, 1], unload)
    assert router.on_reply(0, LoRAUpdateOutput(False, "'b' is not loaded", {}, "u")) == []
    [(dest, out)] = router.on_reply(1, LoRAUpdateOutput(True, "", {}, "u"))
    assert dest == FRONTEND and out.success and out.req_id == "u"


# ---- TP=2 engine against the TP=1 server --------------------------------------------------------
@pytest.fixture(scope="module")
def reference_server(lora_dirs: dict[str, Path]) -> Iterator[Any]:
    """TP=1, serving "a" and "b": the reference outputs, and the HTTP checks."""
    from server_test_utils import ServerProcess

    with ServerProcess(
        lora_dirs["base"], "--skip-server-warmup", "--lora-paths", f"a={lora_dirs['a']}",
        f"b={lora_dirs['b']}", "--max-loras-per-batch", "2", "--max-lora-rank", "8",
        "--max-total-tokens", "4096",
    ) as s:
        yield s


def reference_ids(server: Any, prompts: list[list[int]], names: list[str | None],
                  max_new: int = SHORT) -> list[list[int]]:
    """Greedy output ids of the TP=1 server, one batch."""
    params = {**GREEDY, "max_new_tokens": max_new, "ignore_eos": True}
    r = post(server, "/generate", {"input_ids": prompts, "lora_path": names,
                                   "sampling_params": params})
    assert r.status_code == 200, r.text
    return [o["output_ids"] for o in r.json()]


def output_ids(engine: sgl.Engine, prompts: list[list[int]], names: list[str | None],
               max_new: int = SHORT) -> list[list[int]]:
    params = {**GREEDY, "max_new_tokens": max_new, "ignore_eos": True}
    outs = engine.generate(input_ids=prompts, sampling_params=params, lora_path=names)
    return [o["output_ids"] for o in outs]


@pytest.fixture(scope="module")
def tp2(lora_dirs: dict[str, Path]) -> Iterator[sgl.Engine]:
    paths = [f"{n}={lora_dirs[n]}" for n in ("a", "b")]
    with sgl.Engine(model_path=str(lora_dirs["base"]), random_seed=0, tp_size=TP,
                    lora_paths=paths, **LORA_ARGS) as eng:
        yield eng


def rank_adapters(engine: sgl.Engine) -> list[list[dict[str, Any]]]:
    """Each TP rank's loaded adapters (name, path, rank, version, slot...); asserts that
    every rank of every replica holds the same ones in the same slots."""
    states = engine.get_server_info()["internal_states"]
    per_rank = [r["lora_adapters"] for s in states for r in s["tp_ranks"]]
    assert all(adapters == per_rank[0] for adapters in per_rank), per_rank
    return per_rank


def test_tp2_tokens_equal_tp1(tp2: sgl.Engine, reference_server: Any) -> None:
    """Each adapter alone and a batch mixing two adapters and the base model."""
    for name in ("a", "b", None):
        names = [name] * len(PROMPTS)
        assert output_ids(tp2, PROMPTS, names) == reference_ids(reference_server, PROMPTS, names)
    mixed = ["a", "b", None]
    assert output_ids(tp2, PROMPTS, mixed) == reference_ids(reference_server, PROMPTS, mixed)
    adapters = rank_adapters(tp2)[0]
    assert {d["lora_name"] for d in adapters} == {"a", "b"}


def test_tp2_refused_adapters_leave_every_rank_serving(
    tp2: sgl.Engine, lora_dirs: dict[str, Path], tmp_path: Path, reference_server: Any
) -> None:
    from conftest import write_tiny_model

    other = write_tiny_model(tmp_path / "other", "llama", hidden_size=32, intermediate_size=64)
    wrong = write_adapter(other, tmp_path / "wrong", 6, 4, ALL)
    big = write_adapter(lora_dirs["base"], tmp_path / "big", 5, 16, ["q_proj"])
    before = rank_adapters(tp2)
    out = tp2.load_lora_adapter("wrong", str(wrong))
    assert not out.success and "the base model needs" in out.error_message
    assert "rank 0:" in out.error_message and "rank 1:" in out.error_message  # named
    out = tp2.load_lora_adapter("big", str(big))
    assert not out.success and "rank 16 > --max-lora-rank 8" in out.error_message
    out = tp2.load_lora_adapter("notpeft", str(lora_dirs["base"]))
    assert not out.success and "not a PEFT LoRA checkpoint" in out.error_message
    # Over a loaded name: refused, and "a" keeps its weights (and version) on every rank.
    out = tp2.load_lora_adapter("a", str(wrong))
    assert not out.success and set(out.loaded_adapters) == {"a", "b"}
    assert rank_adapters(tp2) == before
    mixed = ["a", "b", None]
    assert output_ids(tp2, PROMPTS, mixed) == reference_ids(reference_server, PROMPTS, mixed)


def test_tp2_adapter_from_tensors_and_slot_eviction(
    tp2: sgl.Engine, lora_dirs: dict[str, Path], reference_server: Any
) -> None:
    """Every rank slices the whole pushed tensors; a third adapter with two slots evicts the
    least recently used one, identically on both ranks."""
    from safetensors.torch import load_file

    tensors = load_file(str(lora_dirs["c"] / "adapter_model.safetensors"))
    config = json.loads((lora_dirs["c"] / "adapter_config.json").read_text())
    out = tp2.load_lora_adapter_from_tensors("c", tensors, config)
    assert out.success, out.error_message
    r = post(reference_server, "/load_lora_adapter",
             {"lora_name": "c", "lora_path": str(lora_dirs["c"])})
    assert r.status_code == 200, r.text
    try:
        names = ["c", "a", None]
        assert output_ids(tp2, PROMPTS, names) == reference_ids(reference_server, PROMPTS, names)
        slots = {d["lora_name"]: d["slot"] for d in rank_adapters(tp2)[0]}
        assert slots["b"] is None and {slots["a"], slots["c"]} == {0, 1}
    finally:
        assert tp2.unload_lora_adapter("c").success
        assert post(reference_server, "/unload_lora_adapter", {"lora_name": "c"}).status_code == 200
    assert {d["lora_name"] for d in rank_adapters(tp2)[0]} == {"a", "b"}


def test_tp2_pause_one_adapter_retract_while_other_runs(tp2: sgl.Engine) -> None:
    long = 96  # ~1.5 s: a TP=2 step with adapters takes ~17 ms
    want = output_ids(tp2, PROMPTS[:2], ["a", "b"], long)  # uninterrupted, TP=2
    params = {**GREEDY, "max_new_tokens": long, "ignore_eos": True}
    with ThreadPoolExecutor(2) as pool:
        fut_a = pool.submit(tp2.generate, input_ids=PROMPTS[0], sampling_params=params,
                            lora_path="a")
        fut_b = pool.submit(tp2.generate, input_ids=PROMPTS[1], sampling_params=params,
                            lora_path="b")
        wait_for(lambda: engine_state(tp2)["running_batch_size"] == 2)
        reply = tp2.pause_generation(mode="retract", lora_name="a")
        assert reply["num_retracted"] == 1  # once per TP group
        assert fut_b.result(60)["output_ids"] == want[1]  # b ran to its end meanwhile
        assert not fut_a.done()
        ranks = engine_state(tp2)["tp_ranks"]
        assert [r["paused_loras"] for r in ranks] == [{"a": "retract"}] * TP
        assert tp2.continue_generation(lora_name="a")["was_paused"]
        out_a = fut_a.result(60)
    assert out_a["output_ids"] == want[0]  # resumed seamlessly
    assert out_a["meta_info"]["total_retractions"] == 1


# ---- DP=2 -------------------------------------------------------------------------------------
def test_dp2_load_outputs_pause_unload(lora_dirs: dict[str, Path], reference_server: Any) -> None:
    from sglang.srt.managers.tokenizer_manager import EnginePausedError

    with sgl.Engine(model_path=str(lora_dirs["base"]), random_seed=0, dp_size=2,
                    lora_paths=[f"a={lora_dirs['a']}"], paused_admission="reject",
                    **LORA_ARGS) as eng:
        out = eng.load_lora_adapter("b", str(lora_dirs["b"]))
        assert out.success and set(out.loaded_adapters) == {"a", "b"}
        states = eng.get_server_info()["internal_states"]
        assert [{d["lora_name"] for d in s["lora_adapters"]} for s in states] == [{"a", "b"}] * 2
        # Requests with lora_path are spread over both replicas like any other.
        prompts, names = PROMPTS + PROMPTS[:1], ["a", "b", None, "b"]
        assert output_ids(eng, prompts, names) == reference_ids(reference_server, prompts, names)
        # Adapter-scoped pause reaches both replicas; the frontend refuses "a" meanwhile.
        reply = eng.pause_generation(mode="retract", lora_name="a")
        assert reply["mode"] == "retract" and reply["num_retracted"] == 0
        states = eng.get_server_info()["internal_states"]
        assert [s["paused_loras"] for s in states] == [{"a": "retract"}] * 2
        with pytest.raises(EnginePausedError, match="'a' is paused"):
            eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path="a")
        assert eng.continue_generation(lora_name="a")["was_paused"]
        assert output_ids(eng, PROMPTS[:1], ["a"]) == reference_ids(reference_server,
                                                                    PROMPTS[:1], ["a"])
        # An unload refused on the replica where "b" runs, unloaded on the other: the retry
        # after the abort completes it on both.
        long = {**GREEDY, "max_new_tokens": MAX_NEW, "ignore_eos": True}
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(eng.generate, input_ids=PROMPTS[1], sampling_params=long,
                              lora_path="b")
            wait_for(lambda: sum(s["running_batch_size"]
                                 for s in eng.get_server_info()["internal_states"]) == 1)
            out = eng.unload_lora_adapter("b")
            assert not out.success and "DP rank" in out.error_message
            assert "running or waiting" in out.error_message
            assert set(out.loaded_adapters) == {"a"}  # no longer on every replica
            assert eng.abort_request(lora_name="b") == 1
            assert fut.result(60)["meta_info"]["finish_reason"]["type"] == "abort"
        out = eng.unload_lora_adapter("b")
        assert out.success and set(out.loaded_adapters) == {"a"}
        states = eng.get_server_info()["internal_states"]
        assert [{d["lora_name"] for d in s["lora_adapters"]} for s in states] == [{"a"}] * 2
        assert not eng.unload_lora_adapter("b").success  # loaded nowhere


# ---- /v1/models -------------------------------------------------------------------------------
def test_v1_models_lists_loaded_adapters(reference_server: Any, lora_dirs: dict[str, Path]
                                         ) -> None:
    import httpx

    def models() -> list[dict[str, Any]]:
        r = httpx.get(reference_server.url + "/v1/models", timeout=30)
        assert r.status_code == 200
        return r.json()["data"]

    base, *adapters = models()
    assert base["parent"] is None and base["max_model_len"] > 0
    assert [(m["id"], m["root"], m["parent"], m["max_model_len"]) for m in adapters] == [
        (n, str(lora_dirs[n]), base["id"], None) for n in ("a", "b")
    ]
    assert post(reference_server, "/load_lora_adapter",
                {"lora_name": "c", "lora_path": str(lora_dirs["c"])}).status_code == 200
    assert [m["id"] for m in models()] == [base["id"], "a", "b", "c"]
    assert post(reference_server, "/unload_lora_adapter", {"lora_name": "c"}).status_code == 200
    assert [m["id"] for m in models()] == [base["id"], "a", "b"]
