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

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_lora import ALL, write_adapter

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed import parallel_state
from sglang.srt.distributed.parallel_state import GroupCoordinator
from sglang.srt.lora.layers import LoRABatchInfo
from sglang.srt.lora.lora_manager import LoRAManager
from sglang.srt.model_loader import get_model
from sglang.srt.server_args import ServerArgs

TP = 2
PROMPTS = [[5, 17, 33, 80, 120, 7], [9, 9, 41, 200, 3], [100, 101, 102, 103, 104, 105, 106]]
MAX_NEW = 8
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW}
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
