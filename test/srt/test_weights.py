"""Weight updates between pause and continue, through Engine and HTTP (docs/weights.md).

Two tiny Llama checkpoints with the same config and different random weights (A, B) give
different greedy tokens. References come from transformers (plain argmax steps), including
the one an in_place update must follow: A's KV for everything decoded before the pause, B's
weights from there on.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from server_test_utils import ServerProcess

import sglang as sgl

PROMPT = [10, 20, 30, 40, 50, 60]
NUM_NEW = 64
CONTEXT_LEN = 4096
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


def _greedy_params(n: int = NUM_NEW) -> dict:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


# ---- checkpoints and references -------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """A, B (same config, other seed) and refused variants of A."""
    from transformers import AutoConfig, AutoModelForCausalLM

    # A long context, so that test_rl_recipe_over_http's request outlasts the client's pause.
    a = Path(tiny_model_dir("llama", max_position_embeddings=CONTEXT_LEN))
    root = tmp_path_factory.mktemp("weights")
    b = root / "B"
    shutil.copytree(a, b)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(a), dtype=torch.float32)
    model.save_pretrained(b)
    dirs = {"A": a, "B": b}
    tensors = load_file(a / "model.safetensors")
    variants = {
        "missing": lambda t: t.pop("model.layers.1.mlp.down_proj.weight"),
        "shape": lambda t: t.update({Q_PROJ: t[Q_PROJ][:, :32].contiguous()}),
    }
    for name, edit in variants.items():
        shutil.copytree(a, root / name)
        edited = dict(tensors)
        edit(edited)
        save_file(edited, root / name / "model.safetensors", metadata={"format": "pt"})
        dirs[name] = root / name
    shutil.copytree(a, root / "rope")
    config = (root / "rope" / "config.json").read_text()
    (root / "rope" / "config.json").write_text(config.replace("10000.0", "20000.0"))
    dirs["rope"] = root / "rope"
    return dirs


@pytest.fixture(scope="module")
def hf(ckpt) -> dict[str, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    return {k: AutoModelForCausalLM.from_pretrained(ckpt[k], dtype=torch.float32).eval()
            for k in ("A", "B")}


@torch.no_grad()
def _hf_continue(model: torch.nn.Module, past: object, token: int, n: int) -> list[int]:
    """Feed ``token`` on top of ``past`` and take ``n`` argmax steps."""
    out = []
    for _ in range(n):
        step = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past, token = step.past_key_values, int(step.logits[0, -1].argmax())
        out.append(token)
    return out


@torch.no_grad()
def _hf_greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    step = model(torch.tensor([ids]), use_cache=True)
    first = int(step.logits[0, -1].argmax())
    return [first] + _hf_continue(model, step.past_key_values, first, n - 1)


@torch.no_grad()
def _hf_mixed(hf: dict, ids: list[int], before: list[int], n: int) -> list[int]:
    """What in_place gives: A computed the KV of ``ids + before[:-1]``; B takes over there."""
    past = hf["A"](torch.tensor([ids + before[:-1]]), use_cache=True).past_key_values
    return _hf_continue(hf["B"], past, before[-1], n)


# ---- engine -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(ckpt) -> Iterator[sgl.Engine]:
    with sgl.Engine(model_path=str(ckpt["A"]), random_seed=0) as eng:
        yield eng


@pytest.fixture(autouse=True)
def _weights_a(request) -> None:
    """Every engine test starts from A labelled "A", running, with an empty cache."""
    if "engine" not in request.fixturenames:
        return
    engine, ckpt = request.getfixturevalue("engine"), request.getfixturevalue("ckpt")
    engine.continue_generation()
    engine.abort_request(abort_all=True)
    assert engine.update_weights_from_disk(str(ckpt["A"]), weight_version="A")[0]


def _state(engine: sgl.Engine) -> dict:
    return engine.get_server_info()["internal_states"][0]


def _spans(*parts: tuple[str, int, int]) -> list[dict]:
    return [{"version": v, "start": s, "end": e} for v, s, e in parts]


def _check_stream_spans(chunks: list[dict]) -> None:
    """Every cumulative chunk's spans tile its tokens; later chunks only extend earlier ones."""
    previous: list[dict] = []
    for chunk in chunks:
        meta = chunk["meta_info"]
        spans = meta["weight_versions"]
        assert spans[0]["start"] == 0 and spans[-1]["end"] == meta["completion_tokens"]
        assert all(a["end"] == b["start"] for a, b in zip(spans, spans[1:]))
        assert meta["weight_version"] == spans[-1]["version"]
        if previous:
            assert spans[: len(previous) - 1] == previous[:-1]
        previous = spans


def _interrupted(engine: sgl.Engine, mode: str, between: Callable[[], None],
                 prompt: list[int] = PROMPT) -> list[dict]:
    """Stream a greedy request; after its first chunk pause in ``mode``, run ``between``,
    continue, and return every chunk."""
    it = engine.generate(input_ids=prompt, sampling_params=_greedy_params(), stream=True)
    chunks = [next(it)]
    engine.pause_generation(mode=mode)
    between()
    engine.continue_generation()
    chunks.extend(it)
    _check_stream_spans(chunks)
    return chunks


def test_update_from_disk_switches_tokens_labels_and_cache(engine, ckpt, hf) -> None:
    ref_a, ref_b = _hf_greedy(hf["A"], PROMPT, 24), _hf_greedy(hf["B"], PROMPT, 24)
    assert ref_a != ref_b
    out = engine.generate(input_ids=PROMPT, sampling_params=_greedy_params(24))
    assert out["output_ids"] == ref_a
    assert out["meta_info"]["weight_versions"] == _spans(("A", 0, 24))
    ok, message, num_paused = engine.update_weights_from_disk(str(ckpt["B"]), weight_version="B")
    assert ok and "Succeeded" in message and num_paused == 0
    state = _state(engine)
    assert state["weight_version"] == "B" and state["tree_cache_size"] == 0  # flushed
    out = engine.generate(input_ids=PROMPT, sampling_params=_greedy_params(24))
    assert out["output_ids"] == ref_b and out["meta_info"]["cached_tokens"] == 0
    assert out["meta_info"]["weight_version"] == "B"
    assert out["meta_info"]["weight_versions"] == _spans(("B", 0, 24))
    # Without a new label the version stays; the weights still change.
    assert engine.update_weights_from_disk(str(ckpt["A"]))[0]
    out = engine.generate(input_ids=PROMPT, sampling_params=_greedy_params(24))
    assert out["output_ids"] == ref_a and out["meta_info"]["weight_version"] == "B"


def test_in_place_pause_update_continue(engine, ckpt, hf) -> None:
    def update() -> None:
        assert engine.update_weights_from_disk(str(ckpt["B"]), weight_version="B")[:3:2] == (
            True, 1)

    final = _interrupted(engine, "in_place", update)[-1]
    spans = final["meta_info"]["weight_versions"]
    k = spans[0]["end"]
    assert 0 < k < NUM_NEW and spans == _spans(("A", 0, k), ("B", k, NUM_NEW))
    tokens = final["output_ids"]
    assert tokens[:k] == _hf_greedy(hf["A"], PROMPT, NUM_NEW)[:k]
    assert tokens[k:] == _hf_mixed(hf, PROMPT, tokens[:k], NUM_NEW - k)
    assert tokens[k:] != _hf_greedy(hf["A"], PROMPT, NUM_NEW)[k:]
    assert final["meta_info"]["total_retractions"] == 0


def test_retract_flush_update_continue(engine, ckpt, hf) -> None:
    def update() -> None:
        assert engine.flush_cache().success
        assert engine.update_weights_from_disk(str(ckpt["B"]), weight_version="B")[0]

    final = _interrupted(engine, "retract", update)[-1]
    spans = final["meta_info"]["weight_versions"]
    k = spans[0]["end"]
    assert 0 < k < NUM_NEW and spans == _spans(("A", 0, k), ("B", k, NUM_NEW))
    tokens = final["output_ids"]
    assert tokens[:k] == _hf_greedy(hf["A"], PROMPT, NUM_NEW)[:k]
    # Everything after the resume is B's, re-prefilled KV included.
    assert tokens[k:] == _hf_greedy(hf["B"], PROMPT + tokens[:k], NUM_NEW - k)
    assert final["meta_info"]["total_retractions"] == 1
    assert final["meta_info"]["cached_tokens"] == 0


def test_abort_pause_update_and_resubmit(engine, ckpt, hf) -> None:
    it = engine.generate(input_ids=PROMPT, sampling_params=_greedy_params(), stream=True)
    next(it)
    engine.pause_generation(mode="abort")
    partial = list(it)[-1]
    k = partial["meta_info"]["completion_tokens"]
    assert partial["meta_info"]["finish_reason"]["type"] == "abort" and 0 < k < NUM_NEW
    assert partial["meta_info"]["weight_versions"] == _spans(("A", 0, k))
    assert engine.update_weights_from_disk(str(ckpt["B"]), weight_version="B")[0]
    engine.continue_generation()
    resumed = engine.generate(input_ids=PROMPT + partial["output_ids"],
                              sampling_params=_greedy_params(NUM_NEW - k))
    assert resumed["output_ids"] == _hf_greedy(hf["B"], PROMPT + partial["output_ids"],
                                               NUM_NEW - k)
    assert resumed["meta_info"]["weight_versions"] == _spans(("B", 0, NUM_NEW - k))


def test_no_request_matches_old_weight_cache(engine, ckpt, hf) -> None:
    params = _greedy_params(16)
    # 1. flush_cache=False still makes old entries unmatchable.
    engine.generate(input_ids=PROMPT, sampling_params=params)
    assert engine.update_weights_from_disk(str(ckpt["B"]), weight_version="B",
                                           flush_cache=False)[0]
    out = engine.generate(input_ids=PROMPT, sampling_params=params)
    assert out["meta_info"]["cached_tokens"] == 0
    assert out["output_ids"] == _hf_greedy(hf["B"], PROMPT, 16)
    # 2. A request paused in place holds a cached prefix computed by A across the update.
    assert engine.update_weights_from_disk(str(ckpt["A"]), weight_version="A")[0]
    engine.generate(input_ids=PROMPT, sampling_params=params)
    long_prompt = PROMPT + [7, 8, 9]
    it = engine.generate(input_ids=long_prompt, sampling_params=_greedy_params(), stream=True)
    assert next(it)["meta_info"]["cached_tokens"] > 0
    engine.pause_generation(mode="in_place")
    assert engine.update_weights_from_disk(str(ckpt["B"]), weight_version="B")[0]
    assert _state(engine)["tree_cache_size"] > 0  # the locked old prefix, now unmatchable
    engine.continue_generation()
    fresh = engine.generate(input_ids=PROMPT, sampling_params=params)
    assert fresh["meta_info"]["cached_tokens"] == 0
    assert fresh["output_ids"] == _hf_greedy(hf["B"], PROMPT, 16)
    mixed = list(it)[-1]["output_ids"]
    # 3. The mixed-weight KV of the finished request was not cached either.
    probe = long_prompt + mixed[:20]
    out = engine.generate(input_ids=probe, sampling_params=params)
    cached_seq = PROMPT + fresh["output_ids"]
    common = next(i for i, (x, y) in enumerate(zip(probe, cached_seq)) if x != y)
    assert out["meta_info"]["cached_tokens"] == common
    assert out["output_ids"] == _hf_greedy(hf["B"], probe, 16)
    state = _state(engine)
    assert state["available_kv_tokens"] == state["max_total_num_tokens"]  # nothing leaked


def test_refused_updates_change_nothing(engine, ckpt) -> None:
    def run() -> dict:
        return engine.generate(input_ids=PROMPT, sampling_params=_greedy_params(32),
                               return_logprob=True)

    reference = run()
    cache_size = _state(engine)["tree_cache_size"]
    refusals = {
        str(ckpt["A"]) + "-nope": "not a loadable checkpoint",
        str(ckpt["missing"]): "down_proj.weight",
        str(ckpt["shape"]): "shape mismatch",
        str(ckpt["rope"]): "rope_parameters",
    }
    for path, reason in refusals.items():
        ok, message, _ = engine.update_weights_from_disk(path, weight_version="bad")
        assert not ok and reason in message, message
        state = _state(engine)
        assert state["weight_version"] == "A" and state["tree_cache_size"] == cache_size
    q_before = engine.get_weights_by_name(Q_PROJ)
    ok, message = engine.update_weights_from_tensor(
        [(Q_PROJ, torch.zeros(64, 64)), ("model.layers.0.mlp.up_proj.weight", torch.zeros(3))]
    )
    assert not ok and "shape mismatch" in message
    assert engine.get_weights_by_name(Q_PROJ) == q_before  # the valid first tensor was not applied
    assert engine.flush_cache().success  # the same (uncached) path as the reference run
    again = run()
    assert again["output_ids"] == reference["output_ids"]
    assert again["meta_info"]["output_token_logprobs"] == reference["meta_info"][
        "output_token_logprobs"]
    assert again["meta_info"]["weight_versions"] == _spans(("A", 0, 32))


def test_update_from_tensor_round_trips(engine, ckpt, hf) -> None:
    b = load_file(ckpt["B"] / "model.safetensors")
    ok, _ = engine.update_weights_from_tensor([(Q_PROJ, b[Q_PROJ])], weight_version="A+q")
    assert ok
    assert torch.equal(torch.tensor(engine.get_weights_by_name(Q_PROJ)), b[Q_PROJ])
    assert torch.equal(torch.tensor(engine.get_weights_by_name(Q_PROJ, truncate_size=3)),
                       b[Q_PROJ][:3])
    fused = engine.get_weights_by_name("model.layers.0.self_attn.qkv_proj.weight", 1000)
    assert torch.equal(torch.tensor(fused)[:64], b[Q_PROJ])
    with pytest.raises(ValueError, match="no weight named"):
        engine.get_weights_by_name("model.layers.7.self_attn.q_proj.weight")
    ok, _ = engine.update_weights_from_tensor(b, weight_version="B-tensors")
    assert ok
    out = engine.generate(input_ids=PROMPT, sampling_params=_greedy_params(24))
    assert out["output_ids"] == _hf_greedy(hf["B"], PROMPT, 24)
    assert out["meta_info"]["weight_versions"] == _spans(("B-tensors", 0, 24))


def test_relabel_only_changes_the_label(engine, hf) -> None:
    def relabel() -> None:
        assert engine.update_weight_version("A-relabelled")["num_aborted"] == 0

    final = _interrupted(engine, "in_place", relabel)[-1]
    k = final["meta_info"]["weight_versions"][0]["end"]
    assert final["meta_info"]["weight_versions"] == _spans(
        ("A", 0, k), ("A-relabelled", k, NUM_NEW))
    assert final["output_ids"] == _hf_greedy(hf["A"], PROMPT, NUM_NEW)
    assert _state(engine)["weight_version"] == "A-relabelled"
    it = engine.generate(input_ids=PROMPT, sampling_params=_greedy_params(), stream=True)
    next(it)
    assert engine.update_weight_version("v3", abort_all_requests=True)["num_aborted"] == 1
    assert list(it)[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    with pytest.raises(ValueError, match="non-empty"):
        engine.update_weight_version("")


def test_async_weight_methods(engine, ckpt) -> None:
    b_q = load_file(ckpt["B"] / "model.safetensors")[Q_PROJ]

    async def sync_cycle() -> tuple:
        ok, _, _ = await engine.async_update_weights_from_disk(str(ckpt["B"]), weight_version="B")
        q = await engine.async_get_weights_by_name(Q_PROJ, 1)
        pushed, _ = await engine.async_update_weights_from_tensor({Q_PROJ: torch.zeros(64, 64)})
        relabel = await engine.async_update_weight_version("zeros")
        return ok, q, pushed, relabel, await engine.async_get_weights_by_name(Q_PROJ, 1)

    ok, q, pushed, relabel, zeroed = asyncio.run(sync_cycle())
    assert ok and pushed and relabel["new_version"] == "zeros"
    assert torch.equal(torch.tensor(q), b_q[:1]) and zeroed == [[0.0] * 64]


# ---- HTTP ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(ckpt) -> Iterator[ServerProcess]:
    with ServerProcess(ckpt["A"], "--random-seed", "0", "--skip-server-warmup") as srv:
        yield srv


def test_weight_endpoints_over_http(server, ckpt, hf) -> None:
    url = server.url
    bad = httpx.post(url + "/update_weights_from_disk", json={"model_path": "/no/such/dir"})
    assert bad.status_code == 400
    assert bad.json()["success"] is False and "not a loadable checkpoint" in bad.json()["message"]
    r = httpx.post(url + "/update_weights_from_disk", timeout=60,
                   json={"model_path": str(ckpt["B"]), "weight_version": "B"})
    assert r.status_code == 200 and r.json()["success"] is True
    assert r.json()["num_paused_requests"] == 0
    info = httpx.get(url + "/get_model_info").json()
    assert info["weight_version"] == "B" and info["model_path"] == str(ckpt["B"])
    out = httpx.post(url + "/generate", timeout=60, json={
        "input_ids": PROMPT, "sampling_params": _greedy_params(12)}).json()
    assert out["output_ids"] == _hf_greedy(hf["B"], PROMPT, 12)
    assert out["meta_info"]["weight_versions"] == _spans(("B", 0, 12))
    b = load_file(ckpt["B"] / "model.safetensors")
    got = httpx.request("GET", url + "/get_weights_by_name",
                        json={"name": Q_PROJ, "truncate_size": 2}).json()
    assert torch.equal(torch.tensor(got), b[Q_PROJ][:2])
    assert httpx.post(url + "/get_weights_by_name", json={"name": "nope"}).status_code == 400
    r = httpx.post(url + "/update_weight_version", json={"new_version": "v2"})
    assert r.json() == {"success": True, "message": "Weight version updated to v2",
                        "new_version": "v2", "num_aborted": 0}
    state = httpx.get(url + "/get_server_info").json()["internal_states"][0]
    assert state["weight_version"] == "v2"
    completion = httpx.post(url + "/v1/completions", timeout=60, json={
        "prompt": PROMPT, "max_tokens": 5, "temperature": 0}).json()
    assert completion["metadata"] == {"weight_version": "v2"}
    assert completion["choices"][0]["metadata"] == {
        "weight_version": "v2", "weight_versions": _spans(("v2", 0, 5))}
    chat = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
        "ignore_eos": True}).json()
    assert chat["metadata"] == {"weight_version": "v2"}
    assert chat["choices"][0]["metadata"]["weight_versions"] == _spans(("v2", 0, 3))


def test_rl_recipe_over_http(server, ckpt) -> None:
    """pause(in_place) -> update -> continue while a streamed request runs."""
    url = server.url
    # Long enough to still be running when the pause lands: the tiny model decodes ~3,000
    # tokens/s on 2 cores, so NUM_NEW or even 400 tokens can finish first.
    num_new = CONTEXT_LEN - 2 * len(PROMPT)
    body = {"input_ids": PROMPT, "sampling_params": _greedy_params(num_new), "stream": True}
    with httpx.stream("POST", url + "/generate", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        assert httpx.post(url + "/pause_generation", json={"mode": "in_place"}).status_code == 200
        r = httpx.post(url + "/update_weights_from_disk", timeout=60,
                       json={"model_path": str(ckpt["A"]), "weight_version": "http-A"})
        assert r.json()["success"] is True and r.json()["num_paused_requests"] == 1
        assert httpx.post(url + "/continue_generation").status_code == 200
        data = [line for line in lines if line.startswith("data: {")]
    final = json.loads(data[-1].removeprefix("data: "))
    spans = final["meta_info"]["weight_versions"]
    assert first and len(spans) == 2 and spans[1]["version"] == "http-A"
    assert spans[1]["end"] == num_new and spans[0]["end"] == spans[1]["start"] > 0
