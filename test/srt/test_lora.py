"""Multi-LoRA serving (docs/lora.md) against transformers + peft, on the tiny random Llama.

Adapters are random PEFT checkpoints written by ``peft.get_peft_model(...).save_pretrained``
with a non-zero B (PEFT initialises B to zero, which would make every adapter the base model).
The reference of adapter X is peft's model with X merged (``merge_and_unload``), greedy, fp32.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_test_utils import MAX_NEW as LONG  # still running when a test pauses it
from engine_test_utils import engine_state, request_pool, wait_for, wait_loop_turns
from model_test_utils import teacher_forced_logits

import sglang as sgl
from sglang.srt.lora.scheduling import admissible
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (seed, rank, target modules, use_rslora)
ADAPTERS: dict[str, tuple[int, int, list[str], bool]] = {
    "a": (1, 4, ALL, False),
    "b": (2, 8, ["q_proj", "v_proj"], False),
    "c": (3, 2, ["gate_proj", "up_proj", "down_proj", "o_proj"], True),
    "d": (4, 4, ALL, False),  # loaded at run time; also "a"'s updated weights
}
PROMPTS = [[5, 17, 33, 80, 120, 7], [9, 9, 41, 200, 3], [100, 101, 102, 103, 104, 105, 106]]
MAX_NEW = 8
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW}


def write_adapter(base: Path, path: Path, seed: int, rank: int, targets: list[str],
                  rslora: bool = False) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, use_rslora=rslora)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3)
    peft_model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def lora_dirs(tiny_model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
              ) -> dict[str, Path]:
    base = tiny_model_dir("llama")
    root = tmp_path_factory.mktemp("lora")
    dirs = {"base": base}
    for name, (seed, rank, targets, rslora) in ADAPTERS.items():
        dirs[name] = write_adapter(base, root / name, seed, rank, targets, rslora)
    return dirs


@pytest.fixture(scope="module")
def model_of(lora_dirs: dict[str, Path]) -> Callable[[str | None], Any]:
    """``model_of(adapter)`` -> transformers' model with the adapter merged (None: the base)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    models: dict[str | None, Any] = {}

    def load(name: str | None) -> Any:
        if name not in models:
            base = AutoModelForCausalLM.from_pretrained(lora_dirs["base"], dtype=torch.float32)
            if name is not None:
                base = PeftModel.from_pretrained(base, str(lora_dirs[name])).merge_and_unload()
            models[name] = base.eval()
        return models[name]

    return load


@pytest.fixture(scope="module")
def reference(model_of: Callable[[str | None], Any]) -> Callable[..., tuple]:
    """``reference(adapter, prompt, max_new)`` -> (greedy ids, their logprobs) of transformers
    with the adapter merged (None: the base model)."""
    cache: dict[tuple, tuple] = {}

    def run(name: str | None, prompt: list[int], max_new: int = MAX_NEW) -> tuple:
        key = (name, tuple(prompt), max_new)
        if key not in cache:
            out = model_of(name).generate(
                torch.tensor([prompt]), max_new_tokens=max_new, min_new_tokens=max_new,
                do_sample=False, output_logits=True, return_dict_in_generate=True,
            )
            ids = out.sequences[0, len(prompt):].tolist()
            lps = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, ids)]
            cache[key] = (ids, lps)
        return cache[key]

    return run


@pytest.fixture(scope="module")
def engine(lora_dirs: dict[str, Path]) -> Iterator[sgl.Engine]:
    paths = [f"{n}={lora_dirs[n]}" for n in ("a", "b", "c")]
    with sgl.Engine(
        model_path=str(lora_dirs["base"]), random_seed=0, lora_paths=paths,
        max_loras_per_batch=3, max_lora_rank=8, max_total_tokens=8192,
    ) as eng:
        yield eng


def gen(engine: sgl.Engine, prompt: list[int], lora: str | None, **params: Any) -> dict:
    return engine.generate(input_ids=prompt, sampling_params={**GREEDY, **params},
                           lora_path=lora, return_logprob=True)


def check_matches(out: dict, ref: tuple) -> None:
    ids, lps = ref
    assert out["output_ids"] == ids
    got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx(lps, abs=2e-5)


@pytest.fixture(scope="module")
def check_greedy(model_of: Callable[[str | None], Any]) -> Callable[..., None]:
    """``check_greedy(out, adapter, prompt, n=None)``: each of the first ``n`` (all) output
    tokens is the merged model's greedy choice after the prompt and the tokens before it (up to
    a near-tie), with its logprob. Teacher-forced, so it holds at any length; comparing with a
    greedy reference run of hundreds of tokens fails at the first near-tie either side breaks
    the other way."""

    def check(out: dict, name: str | None, prompt: list[int], n: int | None = None) -> None:
        ids = out["output_ids"][:n]
        assert ids
        logp = torch.log_softmax(teacher_forced_logits(model_of(name), prompt, ids), dim=-1)
        chosen = logp[torch.arange(len(ids)), torch.tensor(ids)]
        assert float((logp.max(dim=-1).values - chosen).max()) < 1e-4
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"][: len(ids)]]
        assert got == pytest.approx(chosen.tolist(), abs=1e-4)

    return check


# ---- correctness ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["a", "b", "c", None])
def test_each_adapter_matches_peft(engine: sgl.Engine, reference: Callable, name: str | None
                                   ) -> None:
    for prompt in PROMPTS:
        check_matches(gen(engine, prompt, name), reference(name, prompt))


def test_adapters_change_outputs(reference: Callable) -> None:
    """The fixture's adapters are not the base model in disguise."""
    outs = {n: reference(n, PROMPTS[0])[0] for n in ("a", "b", "c", None)}
    assert len({tuple(v) for v in outs.values()}) == 4


def test_mixed_batch_equals_each_alone(engine: sgl.Engine, reference: Callable) -> None:
    names: list[str | None] = ["a", "b", "c", None, "a", None]
    prompts = [PROMPTS[i % 3] for i in range(len(names))]
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=names,
                           return_logprob=True)
    for out, prompt, name in zip(outs, prompts, names):
        check_matches(out, reference(name, prompt))


def test_prefix_cache_is_per_adapter(engine: sgl.Engine, reference: Callable) -> None:
    prompt = list(range(200, 232))  # 32 tokens: a prefix worth caching
    first_a = gen(engine, prompt, "a")
    on_b = gen(engine, prompt, "b")
    on_base = gen(engine, prompt, None)
    again_a = gen(engine, prompt, "a")
    assert on_b["meta_info"]["cached_tokens"] == 0  # a's KV is not b's
    assert on_base["meta_info"]["cached_tokens"] == 0
    assert again_a["meta_info"]["cached_tokens"] >= len(prompt) - 1  # but a reuses its own
    for out, name in ((first_a, "a"), (on_b, "b"), (on_base, None), (again_a, "a")):
        check_matches(out, reference(name, prompt))


def test_server_info_lists_adapters(engine: sgl.Engine) -> None:
    state = engine_state(engine)
    loaded = {d["lora_name"]: d for d in state["lora_adapters"]}
    assert set(loaded) >= {"a", "b", "c"}
    assert loaded["b"]["rank"] == 8 and loaded["b"]["target_modules"] == ["q_proj", "v_proj"]
    assert state["paused_loras"] == {}


# ---- bad input --------------------------------------------------------------------------------
def test_unknown_adapter_is_refused(engine: sgl.Engine) -> None:
    with pytest.raises(ValueError, match="'nope' is not loaded"):
        gen(engine, PROMPTS[0], "nope")
    with pytest.raises(ValueError, match="not loaded"):
        engine.pause_generation(mode="abort", lora_name="nope")
    assert engine.unload_lora_adapter("nope").success is False


def test_bad_adapters_are_refused(engine: sgl.Engine, lora_dirs: dict[str, Path],
                                  tmp_path: Path, reference: Callable) -> None:
    base = lora_dirs["base"]
    big = write_adapter(base, tmp_path / "big", 5, 16, ["q_proj"])
    out = engine.load_lora_adapter("big", str(big))
    assert not out.success and "rank 16 > --max-lora-rank 8" in out.error_message
    from conftest import write_tiny_model

    other_base = write_tiny_model(tmp_path / "other", "llama", hidden_size=32,
                                  intermediate_size=64)
    wrong = write_adapter(other_base, tmp_path / "wrong", 6, 4, ALL)
    out = engine.load_lora_adapter("wrong", str(wrong))
    assert not out.success and "the base model needs" in out.error_message
    out = engine.load_lora_adapter("notpeft", str(base))  # a model, not an adapter
    assert not out.success and "not a PEFT LoRA checkpoint" in out.error_message
    out = engine.load_lora_adapter("missing", str(tmp_path / "does-not-exist"))
    assert not out.success and "not a PEFT LoRA checkpoint" in out.error_message
    names = {d["lora_name"] for d in engine_state(engine)["lora_adapters"]}
    assert not names & {"big", "wrong", "notpeft", "missing"}
    check_matches(gen(engine, PROMPTS[0], "a"), reference("a", PROMPTS[0]))  # still serving


def test_more_adapters_than_slots_wait_their_turn(engine: sgl.Engine, lora_dirs: dict[str, Path],
                                                  reference: Callable) -> None:
    """4 adapters in flight with 3 slots: the 4th waits for a slot; every output is right."""
    assert engine.load_lora_adapter("d", str(lora_dirs["d"])).success
    try:
        names = ["a", "b", "c", "d", "d", None]
        prompts = [PROMPTS[i % 3] for i in range(len(names))]
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=names,
                               return_logprob=True)
        for out, prompt, name in zip(outs, prompts, names):
            check_matches(out, reference(name, prompt))
    finally:
        assert engine.unload_lora_adapter("d").success


def test_unload_refused_while_in_use(engine: sgl.Engine, lora_dirs: dict[str, Path]) -> None:
    assert engine.load_lora_adapter("d", str(lora_dirs["d"])).success
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(gen, engine, PROMPTS[0], "d", max_new_tokens=LONG, ignore_eos=True)
        wait_for(lambda: engine_state(engine)["running_batch_size"] == 1)
        out = engine.unload_lora_adapter("d")
        assert not out.success and "1 request(s) running or waiting" in out.error_message
        assert engine.abort_request(lora_name="d") == 1
        assert fut.result(60)["meta_info"]["finish_reason"]["type"] == "abort"
    assert engine.unload_lora_adapter("d").success


def test_load_from_tensors(engine: sgl.Engine, lora_dirs: dict[str, Path],
                           reference: Callable) -> None:
    """An adapter pushed in-process (no checkpoint on disk) serves like the checkpoint."""
    import json

    from safetensors.torch import load_file

    tensors = load_file(str(lora_dirs["d"] / "adapter_model.safetensors"))
    config = json.loads((lora_dirs["d"] / "adapter_config.json").read_text())
    out = engine.load_lora_adapter_from_tensors("t", tensors, config, weight_version="t1")
    assert out.success, out.error_message
    try:
        res = gen(engine, PROMPTS[2], "t")
        check_matches(res, reference("d", PROMPTS[2]))
        assert res["meta_info"]["weight_version"] == "t1"
        bad = engine.load_lora_adapter_from_tensors("t2", tensors, {**config, "r": 64})
        assert not bad.success and "rank 64 > --max-lora-rank 8" in bad.error_message
    finally:
        assert engine.unload_lora_adapter("t").success


# ---- scoped pause -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place", "wait"])
def test_pause_one_adapter_while_another_runs(engine: sgl.Engine, reference: Callable,
                                              check_greedy: Callable, mode: str) -> None:
    long = {"max_new_tokens": LONG, "ignore_eos": True}
    with request_pool(engine, 3, lora_name="a") as pool:
        fut_a = pool.submit(gen, engine, PROMPTS[0], "a", **long)
        fut_b = pool.submit(gen, engine, PROMPTS[1], "b", **long)
        wait_for(lambda: engine_state(engine)["running_batch_size"] == 2)
        reply = engine.pause_generation(mode=mode, lora_name="a")
        assert reply["num_aborted"] == (1 if mode == "abort" else 0)
        assert reply["num_retracted"] == (1 if mode == "retract" else 0)
        # A request for the paused adapter waits, visibly; b runs to the end meanwhile.
        fut_a2 = pool.submit(gen, engine, PROMPTS[2], "a")
        wait_for(lambda: len(engine_state(engine)["waiting_queue_rids"]) >= 1)
        out_b = fut_b.result(60)
        state = wait_loop_turns(lambda: engine_state(engine), 5)
        assert state["paused_loras"] == {"a": mode}
        assert not fut_a2.done()
        if mode == "in_place":
            assert state["running_batch_size"] == 1  # a keeps its place (and KV)
        engine.continue_generation(lora_name="a")
        out_a = fut_a.result(60)
        check_matches(fut_a2.result(60), reference("a", PROMPTS[2]))
    assert len(out_b["output_ids"]) == LONG
    check_greedy(out_b, "b", PROMPTS[1])
    if mode == "abort":
        meta = out_a["meta_info"]
        assert meta["finish_reason"]["type"] == "abort"
        assert 0 < len(out_a["output_ids"]) < LONG
    else:
        assert len(out_a["output_ids"]) == LONG  # resumed seamlessly: nothing lost or repeated
    check_greedy(out_a, "a", PROMPTS[0])
    assert engine_state(engine)["paused_loras"] == {}


def test_update_paused_adapter(engine: sgl.Engine, lora_dirs: dict[str, Path],
                               reference: Callable, check_greedy: Callable) -> None:
    """Pause a (in place), load d's weights over it, continue: the running request's spans
    name both versions; new requests on a match d and reuse no KV of a's old weights; b is
    untouched."""
    prompt = list(range(300, 324))
    assert gen(engine, prompt, "a")["output_ids"] == reference("a", prompt)[0]  # cache a's KV
    long = {"max_new_tokens": LONG, "ignore_eos": True}
    try:
        with request_pool(engine, 2, lora_name="a") as pool:
            fut = pool.submit(gen, engine, PROMPTS[0], "a", **long)
            wait_for(lambda: engine_state(engine)["running_batch_size"] == 1)
            engine.pause_generation(mode="in_place", lora_name="a")
            # Refused while a is running and not paused is covered by the load check below.
            out = engine.load_lora_adapter("a", str(lora_dirs["d"]), weight_version="a-v2")
            assert out.success, out.error_message
            check_matches(gen(engine, PROMPTS[1], "b"), reference("b", PROMPTS[1]))
            engine.continue_generation(lora_name="a")
            res = fut.result(60)
        spans = res["meta_info"]["weight_versions"]
        assert [s["version"] for s in spans] == ["1", "a-v2"]
        assert spans[0]["start"] == 0 and spans[-1]["end"] == LONG
        assert spans[0]["end"] == spans[1]["start"]
        n_old = spans[0]["end"]
        check_greedy(res, "a", PROMPTS[0], n_old)  # the tokens of a's old weights
        new = gen(engine, prompt, "a")
        assert new["meta_info"]["cached_tokens"] == 0  # no stale KV of the old weights
        assert new["meta_info"]["weight_version"] == "a-v2"
        check_matches(new, reference("d", prompt))
        # While a request of the adapter runs and it is not paused, a reload is refused.
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(gen, engine, PROMPTS[0], "a", **long)
            wait_for(lambda: engine_state(engine)["running_batch_size"] == 1)
            out = engine.load_lora_adapter("a", str(lora_dirs["a"]))
            assert not out.success and "pause it first" in out.error_message
            engine.abort_request(lora_name="a")
            fut.result(60)
    finally:
        assert engine.load_lora_adapter("a", str(lora_dirs["a"])).success


def test_deterministic_mode_isolates_adapters(lora_dirs: dict[str, Path],
                                              reference: Callable) -> None:
    """--enable-deterministic-inference: b's tokens and logprobs are bitwise the same alone
    and batched with other adapters (so pausing / updating them cannot touch b)."""
    paths = [f"{n}={lora_dirs[n]}" for n in ("a", "b")]
    with sgl.Engine(model_path=str(lora_dirs["base"]), random_seed=0, lora_paths=paths,
                    max_total_tokens=4096, enable_deterministic_inference=True) as eng:
        alone = gen(eng, PROMPTS[1], "b")
        names: list[str | None] = ["a", "b", None, "a"]
        prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[2]]
        mixed = eng.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=names,
                             return_logprob=True)
    assert mixed[1]["output_ids"] == alone["output_ids"]
    assert (mixed[1]["meta_info"]["output_token_logprobs"]
            == alone["meta_info"]["output_token_logprobs"])
    check_matches(alone, reference("b", PROMPTS[1]))
    check_matches(mixed[0], reference("a", PROMPTS[0]))


# ---- units ------------------------------------------------------------------------------------
def _req(rid: str, lora: str | None) -> Req:
    req = Req(rid, [1, 2], SamplingParams(), 0, set())
    req.lora_name = lora
    return req


def test_admission_respects_slots_and_paused_adapters() -> None:
    running = [_req("r1", "a"), _req("r2", None)]
    waiting = [_req("w1", "b"), _req("w2", "c"), _req("w3", None), _req("w4", "a"),
               _req("w5", "p")]
    got = admissible(waiting, running, paused={"p"}, max_loras=2)
    assert [r.rid for r in got] == ["w1", "w3", "w4"]  # c would be a 3rd adapter; p is paused
    got = admissible(waiting, running, paused=set(), max_loras=8)
    assert [r.rid for r in got] == ["w1", "w2", "w3", "w4", "w5"]


def test_lora_paths_forms(tmp_path: Path, tiny_model_dir: Callable[..., Path]) -> None:
    model = str(tiny_model_dir("llama"))
    args = ServerArgs(model_path=model, lora_paths=["x=/p/x", "/p/y"])
    assert args.enable_lora and args.lora_path_dict() == {"x": "/p/x", "/p/y": "/p/y"}
    args = ServerArgs(model_path=model, lora_paths={"x": "/p/x"})  # type: ignore[arg-type]
    assert args.lora_path_dict() == {"x": "/p/x"}
    args = ServerArgs(model_path=model,
                      lora_paths=[{"lora_name": "x", "lora_path": "/p/x"}])  # type: ignore[list-item]
    assert args.lora_path_dict() == {"x": "/p/x"}
    args = ServerArgs(model_path=model, lora_paths=['{"lora_name": "x", "lora_path": "/p/x"}'])
    assert args.lora_path_dict() == {"x": "/p/x"}
    with pytest.raises(ValueError, match="twice"):
        ServerArgs(model_path=model, lora_paths=["x=/a", "x=/b"])
    with pytest.raises(ValueError, match="unsupported LoRA target"):
        ServerArgs(model_path=model, enable_lora=True, lora_target_modules=["lm_head"])
    with pytest.raises(ValueError, match="max-loras-per-batch"):
        ServerArgs(model_path=model, enable_lora=True, max_loras_per_batch=0)





# ---- HTTP -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(lora_dirs: dict[str, Path]) -> Iterator[Any]:
    from server_test_utils import ServerProcess

    with ServerProcess(
        lora_dirs["base"], "--skip-server-warmup", "--lora-paths", f"a={lora_dirs['a']}",
        "--max-loras-per-batch", "2", "--max-lora-rank", "8", "--max-total-tokens", "4096",
        "--paused-admission", "reject",
    ) as s:
        yield s


def test_http_api(server: Any, lora_dirs: dict[str, Path], reference: Callable) -> None:
    from engine_test_utils import post

    body = {"input_ids": PROMPTS[0], "sampling_params": GREEDY, "lora_path": "a"}
    r = post(server, "/generate", body)
    assert r.status_code == 200 and r.json()["output_ids"] == reference("a", PROMPTS[0])[0]
    r = post(server, "/generate", {**body, "lora_path": "b"})
    assert r.status_code == 400 and "'b' is not loaded" in r.json()["error"]["message"]
    r = post(server, "/load_lora_adapter", {"lora_name": "b", "lora_path": str(lora_dirs["b"])})
    assert r.status_code == 200, r.text
    assert r.json()["success"] and set(r.json()["loaded_adapters"]) == {"a", "b"}
    r = post(server, "/load_lora_adapter", {"lora_name": "x", "lora_path": "/nonexistent"})
    assert r.status_code == 400 and not r.json()["success"]
    assert "not a PEFT LoRA checkpoint" in r.json()["error"]["message"]
    batch = {"input_ids": PROMPTS[:3], "sampling_params": GREEDY, "lora_path": ["a", "b", None]}
    r = post(server, "/generate", batch)
    assert [o["output_ids"] for o in r.json()] == [
        reference(n, p)[0] for n, p in zip(["a", "b", None], PROMPTS)
    ]
    r = post(server, "/v1/completions", {"model": "tiny:b", "prompt": PROMPTS[1],
                                          "max_tokens": MAX_NEW, "temperature": 0})
    assert r.status_code == 200, r.text
    want = reference("b", PROMPTS[1])[0]
    assert r.json()["choices"][0]["text"] == server_tokenizer(lora_dirs).decode(want)
    r = post(server, "/pause_generation", {"mode": "retract", "lora_name": "b"})
    assert r.status_code == 200 and r.json()["mode"] == "retract"
    r = post(server, "/generate", {**body, "lora_path": "a"})  # a is not paused
    assert r.json()["output_ids"] == reference("a", PROMPTS[0])[0]
    r = post(server, "/generate", {**body, "lora_path": "b"})  # --paused-admission reject
    assert r.status_code == 503 and "'b' is paused" in r.json()["error"]["message"]
    r = post(server, "/continue_generation", {"lora_name": "b"})
    assert r.status_code == 200 and r.json()["was_paused"]
    r = post(server, "/abort_request", {"lora_name": "b"})
    assert r.status_code == 200 and r.json()["num_aborted"] == 0
    r = post(server, "/unload_lora_adapter", {"lora_name": "b"})
    assert r.status_code == 200 and set(r.json()["loaded_adapters"]) == {"a"}
    r = post(server, "/unload_lora_adapter", {"lora_name": "b"})
    assert r.status_code == 400 and "not loaded" in r.json()["error_message"]


def test_http_load_from_tensors(server: Any, lora_dirs: dict[str, Path],
                                reference: Callable) -> None:
    """/load_lora_adapter_from_tensors: serialized PEFT tensors + config serve like the
    checkpoint; a payload that is not named tensors is a 400 and nothing is loaded."""
    import json

    from engine_test_utils import post
    from safetensors.torch import load_file

    from sglang.srt.utils import MultiprocessingSerializer

    tensors = load_file(str(lora_dirs["d"] / "adapter_model.safetensors"))
    config = json.loads((lora_dirs["d"] / "adapter_config.json").read_text())
    payload = MultiprocessingSerializer.serialize(list(tensors.items()), output_str=True)
    body = {"lora_name": "td", "serialized_tensors": payload, "config_dict": config}
    for bad, reason in (({"serialized_tensors": "%%"}, "base64"),
                        ({"serialized_tensors": MultiprocessingSerializer.serialize(
                            [1, 2], output_str=True)}, "serialized_tensors"),
                        ({"load_format": "flattened_bucket"}, "load_format")):
        r = post(server, "/load_lora_adapter_from_tensors", {**body, **bad})
        assert r.status_code == 400 and reason in r.json()["error"]["message"], r.text
    r = post(server, "/load_lora_adapter_from_tensors", body)
    assert r.status_code == 200 and "td" in r.json()["loaded_adapters"], r.text
    r = post(server, "/generate", {"input_ids": PROMPTS[2], "sampling_params": GREEDY,
                                   "lora_path": "td"})
    assert r.json()["output_ids"] == reference("d", PROMPTS[2])[0]
    assert post(server, "/unload_lora_adapter", {"lora_name": "td"}).status_code == 200


def server_tokenizer(lora_dirs: dict[str, Path]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(lora_dirs["base"])


def test_padded_and_grouped_paths_agree() -> None:
    """The one-bmm form of a multi-adapter step and the Triton kernels' segments equal one
    pass per adapter."""
    from sglang.srt.layers.linear import QKVParallelLinear
    from sglang.srt.lora.adapter import LoRAAdapter
    from sglang.srt.lora.layers import LoRABatchInfo, LoRATarget
    from sglang.srt.lora.lora_manager import _padded
    from sglang.srt.lora.triton_ops import build_lora_segments

    torch.manual_seed(0)
    layer = QKVParallelLinear(32, 8, 4, 2)
    torch.nn.init.normal_(layer.weight)
    batch: list[LoRABatchInfo | None] = [None]
    target = LoRATarget(layer, 0, "qkv_proj", 3, 8, lambda: batch[0])
    for slot, rank in ((0, 2), (1, 8), (2, 4)):
        weights = {(0, p): (torch.randn(rank, 32), torch.randn(n, rank))
                   for p, n in (("q_proj", 32), ("k_proj", 16), ("v_proj", 16))}
        target.write_slot(slot, LoRAAdapter(f"x{slot}", "", rank, 1.0, (), weights))
    x = torch.randn(7, 32)
    slots = torch.tensor([0, 1, -1, 2, 1, 0, 2])
    groups: list[tuple[int, torch.Tensor | None]] = [
        (s, torch.nonzero(slots == s).squeeze(1)) for s in (0, 1, 2)
    ]
    padded = _padded(groups, x.device, x.dtype)
    assert padded is not None
    batch[0] = LoRABatchInfo(groups)
    grouped = layer(x)
    batch[0] = LoRABatchInfo(groups, padded)
    assert torch.allclose(layer(x), grouped, atol=1e-5)
    # The Triton kernels' path (CUDA in serving; Triton's interpreter here), as the manager
    # builds it: one segment per request row, base rows in none.
    segments = build_lora_segments([(i, 1, int(s)) for i, s in enumerate(slots)], x.device)
    batch[0] = LoRABatchInfo([], segments=segments)
    assert torch.allclose(layer(x), grouped, atol=1e-4)
    batch[0] = None
    base = layer(x)
    assert torch.equal(grouped[2], base[2]) and not torch.allclose(grouped[0], base[0])
