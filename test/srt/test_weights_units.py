"""Unit tests of the weight-update building blocks: prefix-cache invalidation (stale trees),
validation on a meta twin, reading weights back, and the per-token version spans."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.managers.io_struct import BatchStrOutput, TokenizedGenerateReqInput
from sglang.srt.managers.scheduler_output import _extend_version_spans, _spans_from
from sglang.srt.managers.tokenizer_req_state import ReqState
from sglang.srt.mem_cache import RadixCache, TokenToKVPoolAllocator
from sglang.srt.model_loader import get_model
from sglang.srt.model_loader import weight_update as wu
from sglang.srt.sampling.sampling_params import SamplingParams


# ---- prefix cache: invalidate -----------------------------------------------------------------
def _cache(size: int = 64, page_size: int = 1) -> tuple[TokenToKVPoolAllocator, RadixCache]:
    alloc = TokenToKVPoolAllocator(size, page_size, "cpu", debug=True)
    return alloc, RadixCache(alloc, page_size)


def _insert(alloc: TokenToKVPoolAllocator, cache: RadixCache, key: list[int]) -> None:
    kv = alloc.alloc_extend([0], [len(key)], [-1])
    n = cache.insert(key, kv)
    alloc.free(kv[:n])


@pytest.mark.parametrize("page_size", [1, 4])
def test_invalidate_frees_unlocked_and_detaches_locked(page_size: int) -> None:
    alloc, cache = _cache(64, page_size)
    locked_key = list(range(1, 9))
    _insert(alloc, cache, locked_key)
    _insert(alloc, cache, [1, 2, 3, 4, 9, 9, 9, 9])  # shares one page with locked_key
    _insert(alloc, cache, [50, 51, 52, 53])
    match = cache.match_prefix(locked_key)
    cache.lock(match.handle)
    assert cache.total_size() == 16
    freed = cache.invalidate()
    assert freed == 8  # the unlocked branch [9 ...] and the [50 ...] entry
    assert cache.stale_size() == 8 and cache.evictable_size() == cache.protected_size() == 0
    assert cache.total_size() == 8
    assert alloc.available_size() == 64 - 8
    assert cache.match_prefix(locked_key).device_indices.numel() == 0  # never matched again
    cache.check_integrity()
    # New KV for the same tokens goes into the fresh tree, next to the stale copy.
    _insert(alloc, cache, locked_key)
    assert cache.match_prefix(locked_key).device_indices.numel() == 8
    cache.check_integrity()
    cache.unlock(match.handle)  # the last lock on the stale path: its slots are freed
    assert cache.stale_size() == 0 and cache.total_size() == 8
    assert alloc.available_size() == 64 - 8
    cache.check_integrity()


def test_stale_nodes_wait_for_every_lock() -> None:
    alloc, cache = _cache()
    _insert(alloc, cache, [1, 2, 3, 4])
    _insert(alloc, cache, [1, 2, 7, 7])
    first, second = cache.match_prefix([1, 2, 3, 4]), cache.match_prefix([1, 2, 7, 7])
    empty = cache.match_prefix([99])  # a handle at the root
    for m in (first, second, empty):
        cache.lock(m.handle)
    cache.invalidate()
    assert cache.stale_size() == 6
    with pytest.raises(AssertionError):
        cache.lock(first.handle)  # stale handles cannot be locked again
    cache.unlock(first.handle)
    assert cache.stale_size() == 4  # [3, 4] freed; [1, 2] still under the other lock
    cache.check_integrity()
    cache.unlock(second.handle)
    cache.unlock(empty.handle)  # the detached root itself: nothing to free
    assert cache.stale_size() == 0 and alloc.available_size() == 64
    cache.check_integrity()


def test_invalidate_without_locks_is_a_full_eviction() -> None:
    alloc, cache = _cache()
    _insert(alloc, cache, [1, 2, 3])
    _insert(alloc, cache, [4, 5])
    assert cache.invalidate() == 5
    assert cache.total_size() == 0 and alloc.available_size() == 64
    cache.check_integrity()


def test_integrity_counts_stale_tokens() -> None:
    alloc, cache = _cache()
    _insert(alloc, cache, [1, 2, 3])
    m = cache.match_prefix([1, 2, 3])
    cache.lock(m.handle)
    cache.invalidate()
    cache._stale_size -= 1  # corrupt the bookkeeping: the check must notice
    with pytest.raises(AssertionError, match="stale"):
        cache.check_integrity()


# ---- validation on a meta twin, and reading back ------------------------------------------
@pytest.fixture(scope="module")
def live(tiny_model_dir) -> tuple[torch.nn.Module, ModelConfig]:
    config = ModelConfig(str(tiny_model_dir("llama")))
    return get_model(config, "cpu"), config


def _variant(src: Path, dst: Path, edit_tensors=None, edit_config=None) -> ModelConfig:
    shutil.copytree(src, dst)
    if edit_tensors is not None:
        tensors = load_file(dst / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    if edit_config is not None:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config)
        (dst / "config.json").write_text(json.dumps(config))
    return ModelConfig(str(dst))


def test_validation_accepts_a_full_checkpoint_and_names_each_problem(live, tmp_path) -> None:
    model, config = live
    meta = wu.build_meta_model(model, config)
    assert all(p.device.type == "meta" for p in meta.parameters())
    wu.validate_checkpoint(meta, config)  # the live checkpoint itself is fine
    src = Path(config.model_path)
    up = "model.layers.1.mlp.up_proj.weight"
    missing = _variant(src, tmp_path / "missing", lambda t: t.pop(up))
    with pytest.raises(wu.WeightUpdateError, match=r"gate_up_proj.weight\[1\]"):
        wu.validate_checkpoint(meta, missing)
    k_proj = "model.layers.0.self_attn.k_proj.weight"
    shape = _variant(src, tmp_path / "shape", lambda t: t.update({k_proj: t[k_proj][:16]}))
    with pytest.raises(wu.WeightUpdateError, match="shape mismatch for shard 'k'"):
        wu.validate_checkpoint(meta, shape)
    extra = _variant(src, tmp_path / "extra", lambda t: t.update(stray=torch.zeros(2)))
    with pytest.raises(wu.WeightUpdateError, match="unexpected weight 'stray'"):
        wu.validate_checkpoint(meta, extra)
    rope = _variant(src, tmp_path / "rope",
                    edit_config=lambda c: c["rope_parameters"].update(rope_theta=500.0))
    with pytest.raises(wu.WeightUpdateError, match="rope_parameters"):
        wu.check_config_compatible(config, rope)
    wider = _variant(src, tmp_path / "wide", edit_config=lambda c: c.update(hidden_size=128))
    with pytest.raises(wu.WeightUpdateError, match="hidden_size: 64 -> 128"):
        wu.check_config_compatible(config, wider)
    # Nothing above touched the live model.
    reference = load_file(src / "model.safetensors")
    assert torch.equal(model.model.layers[1].mlp.gate_up_proj.weight[128:], reference[up])


def test_tensor_validation_and_direct_loads(live) -> None:
    model, config = live
    meta = wu.build_meta_model(model, config)
    q = "model.layers.0.self_attn.q_proj.weight"
    good = (q, torch.full((64, 64), 0.5))
    for bad, message in [
        ([good, ("model.layers.0.self_attn.q_proj.weight", torch.zeros(3))], "shape mismatch"),
        ([good, ("model.nope.weight", torch.zeros(1))], "unexpected weight"),
        ([good, (q, [1.0])], "torch.Tensor"),
        ([], "non-empty"),
    ]:
        with pytest.raises(wu.WeightUpdateError, match=message):
            wu.validate_tensors(meta, bad, None)
    with pytest.raises(wu.WeightUpdateError, match="load_format"):
        wu.validate_tensors(meta, [good], "gguf")
    fused = "model.layers.0.self_attn.qkv_proj.weight"
    with pytest.raises(wu.WeightUpdateError, match="no parameter named"):
        wu.validate_tensors(meta, [(q, good[1])], "direct")
    before = model.get_parameter(fused).detach().clone()
    new_qkv = torch.randn(128, 64)
    wu.validate_tensors(meta, [(fused, new_qkv)], "direct")
    wu.load_tensors(model, [(fused, new_qkv)], "direct")
    assert torch.equal(torch.tensor(wu.get_weights_by_name(model, fused, 1000)), new_qkv)
    # Shards by their HF names, truncated along the first dimension.
    assert torch.equal(torch.tensor(wu.get_weights_by_name(model, q, 5)), new_qkv[:5])
    k = wu.get_weights_by_name(model, "model.layers.0.self_attn.k_proj.weight", 1000)
    assert torch.equal(torch.tensor(k), new_qkv[64:96])
    with pytest.raises(wu.WeightUpdateError, match="no weight named"):
        wu.get_weights_by_name(model, "model.layers.9.mlp.up_proj.weight")
    wu.load_tensors(model, [(fused, before)], "direct")


# ---- version spans --------------------------------------------------------------------------
def test_scheduler_side_spans_and_increments() -> None:
    spans: list[list] = []
    for n, version in enumerate(["a", "a", "b", "b", "a"], start=1):
        _extend_version_spans(spans, version, n)
    assert spans == [["a", 0, 2], ["b", 2, 4], ["a", 4, 5]]
    assert _spans_from(spans, 3) == [["b", 3, 4], ["a", 4, 5]]
    assert _spans_from(spans, 5) == []


def _str_output(ids: list[int], total: int, spans: list[list] | None) -> BatchStrOutput:
    return BatchStrOutput(
        rids=["r"], finished_reasons=[None], output_strs=[""], output_ids=[ids],
        prompt_tokens=[3], completion_tokens=[total], cached_tokens=[0], retraction_counts=[0],
        weight_version_spans=None if spans is None else [spans], weight_version="b",
    )


def test_frontend_merges_increments_into_spans() -> None:
    req = TokenizedGenerateReqInput("r", None, [1, 2, 3], SamplingParams())
    state = ReqState(req, asyncio.Event(), None, None, False)
    state.apply(_str_output([7, 8], 2, [["a", 0, 2]]), 0)
    state.apply(_str_output([9], 3, [["a", 2, 3]]), 0)
    state.apply(_str_output([4, 5], 5, [["a", 3, 4], ["b", 4, 5]]), 0)
    meta = state.to_output()["meta_info"]
    assert meta["weight_versions"] == [
        {"version": "a", "start": 0, "end": 4}, {"version": "b", "start": 4, "end": 5}
    ]
    assert meta["weight_version"] == "b"
    # A sender without spans: the new tokens take the scheduler's current label.
    state.apply(_str_output([6], 6, None), 0)
    assert state.to_output()["meta_info"]["weight_versions"][-1] == {
        "version": "b", "start": 4, "end": 6
    }


def test_tensor_requests_do_not_ship_whole_storages() -> None:
    from sglang.srt.entrypoints.engine_weights import tensor_request

    bucket = torch.arange(1000, dtype=torch.float32)
    req = tensor_request({"a": bucket[10:20].view(2, 5), "b": bucket}, None, True, "v", False)
    (name_a, a), (name_b, b) = req.named_tensors
    assert (name_a, name_b) == ("a", "b") and req.weight_version == "v"
    assert a.untyped_storage().nbytes() == 40 and torch.equal(a, bucket[10:20].view(2, 5))
    assert b is bucket  # already owns its storage: not copied
