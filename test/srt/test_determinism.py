"""--enable-deterministic-inference: the same tokens and bit-identical logprobs whatever the
batch, chunking, prefix cache, decode-vs-prefill, retraction or abort + resubmit."""

from __future__ import annotations

import random
from collections.abc import Iterator

import httpx
import pytest
from model_test_utils import TWO_ENGINE_KW
from server_test_utils import ServerProcess

import sglang as sgl

NUM_NEW = 24
PARAM_SETS = {
    "greedy": {"temperature": 0},
    "seeded": {"temperature": 1.0, "sampling_seed": 1234},
    "truncated": {
        "temperature": 1.0,
        "top_k": 20,
        "top_p": 0.9,
        "min_p": 0.05,
        "sampling_seed": 99,
    },
}


def _rand_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 450) for _ in range(n)]


def _params(name: str, max_new: int = NUM_NEW) -> dict:
    return {**PARAM_SETS[name], "max_new_tokens": max_new, "ignore_eos": True}


def _tokens_and_logprobs(out: dict) -> tuple[list[int], list[float]]:
    return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def _run(engine: sgl.Engine, prompts: list[list[int]], params: dict | list[dict]) -> list:
    outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    return [_tokens_and_logprobs(o) for o in outs]


def _engine(model_dir: object, **kw: object) -> sgl.Engine:
    return sgl.Engine(
        model_path=str(model_dir),
        enable_deterministic_inference=True,
        random_seed=0,
        **{**TWO_ENGINE_KW, **kw},
    )


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def arch_dir(request, tiny_model_dir):
    return tiny_model_dir(request.param)


@pytest.fixture(scope="module")
def engine(arch_dir) -> Iterator[sgl.Engine]:
    with _engine(arch_dir) as eng:
        yield eng


@pytest.mark.parametrize("name", list(PARAM_SETS))
def test_single_vs_any_batch(engine, name: str) -> None:
    rng = random.Random(1)
    target = _rand_prompt(rng, 37)
    others = [_rand_prompt(rng, rng.randint(5, 120)) for _ in range(7)]
    alone = _run(engine, [target], _params(name))[0]
    results = {tuple(map(tuple, alone))}
    for size in range(2, 9):
        batch = others[: size - 1]
        pos = rng.randrange(size)
        batch = batch[:pos] + [target] + batch[pos:]
        out = _run(engine, batch, _params(name))[pos]
        results.add(tuple(map(tuple, out)))
    assert len(results) == 1


def test_prefix_cache_hit_or_miss(engine, arch_dir) -> None:
    """Every sampling mode: cold cache == warm cache == no cache with 4-token chunks. One
    uncached engine serves all the modes (an engine start is most of this test's time)."""
    rng = random.Random(2)
    shared = _rand_prompt(rng, 70)
    prompts = [shared[:k] + _rand_prompt(rng, 9) for k in (10, 33, 64, 70)]
    runs: dict[str, list] = {}
    for name in PARAM_SETS:
        engine.flush_cache()
        cold = _run(engine, prompts, _params(name))
        warm = _run(engine, prompts, _params(name))  # prefixes now come from the cache
        assert cold == warm, name
        runs[name] = cold
    with _engine(arch_dir, disable_radix_cache=True, chunked_prefill_size=4) as other:
        for name in PARAM_SETS:
            assert _run(other, prompts, _params(name)) == runs[name], name


@pytest.mark.parametrize("chunk", [4, 16])
def test_chunked_prefill_sizes(engine, arch_dir, chunk: int) -> None:
    rng = random.Random(3)
    prompts = [_rand_prompt(rng, n) for n in (5, 31, 90)]
    params = [_params("greedy"), _params("seeded"), _params("truncated")]
    expected = _run(engine, prompts, params)
    with _engine(arch_dir, chunked_prefill_size=chunk, page_size=4) as other:
        assert _run(other, prompts, params) == expected


def assert_prefill_logprobs_equal_decode(engine: sgl.Engine, prompt: list[int], params: dict):
    """Re-scoring prompt + generated tokens by a prefill gives the decode logprobs, bitwise."""
    ids, logprobs = _run(engine, [prompt], params)[0]
    out = engine.generate(
        input_ids=prompt + ids,
        sampling_params={"max_new_tokens": 1},
        return_logprob=True,
        logprob_start_len=len(prompt) - 1,  # its entry is None (as upstream); then the ids
    )
    first, *prefill = out["meta_info"]["input_token_logprobs"]
    assert first[0] is None and first[1] == prompt[-1]
    assert [t for _, t, _ in prefill] == ids
    assert [lp for lp, _, _ in prefill] == logprobs  # bitwise


@pytest.mark.parametrize("name", list(PARAM_SETS))
def test_prefill_logprobs_equal_decode_logprobs(engine, name: str) -> None:
    assert_prefill_logprobs_equal_decode(engine, _rand_prompt(random.Random(4), 50), _params(name))


def test_retraction_equals_roomy_run(engine, arch_dir) -> None:
    rng = random.Random(5)
    prompts = [_rand_prompt(rng, 20) for _ in range(6)]
    params = [_params(n, 40) for n in ("greedy", "seeded", "truncated") * 2]
    expected = _run(engine, prompts, params)
    with _engine(arch_dir, max_total_tokens=160, max_running_requests=6) as tight:
        outs = tight.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    assert sum(o["meta_info"]["total_retractions"] for o in outs) > 0
    assert [_tokens_and_logprobs(o) for o in outs] == expected


@pytest.mark.parametrize("name", list(PARAM_SETS))
def test_resubmit_prompt_plus_partial_output(engine, name: str) -> None:
    rng = random.Random(6)
    prompt = _rand_prompt(rng, 30)
    ids, logprobs = _run(engine, [prompt], _params(name))[0]
    for k in (1, 7, 16):
        rest = _run(engine, [prompt + ids[:k]], _params(name, NUM_NEW - k))[0]
        assert rest == (ids[k:], logprobs[k:])


def test_smollm2_batch_and_decode_consistency(smollm2_dir) -> None:
    rng = random.Random(7)
    target = _rand_prompt(rng, 40)
    with _engine(smollm2_dir) as eng:
        alone = _run(eng, [target], _params("seeded", 12))[0]
        batch = [_rand_prompt(rng, 60), target, _rand_prompt(rng, 9)]
        assert _run(eng, batch, _params("seeded", 12))[1] == alone
        out = eng.generate(
            input_ids=target + alone[0],
            sampling_params={"max_new_tokens": 1},
            return_logprob=True,
            logprob_start_len=len(target) - 1,
        )
        assert [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]] == alone[1]


def test_bfloat16_batch_invariance_and_decode_consistency(tiny_model_dir) -> None:
    rng = random.Random(8)
    target = _rand_prompt(rng, 37)
    others = [_rand_prompt(rng, rng.randint(5, 120)) for _ in range(5)]
    with _engine(tiny_model_dir("llama"), dtype="bfloat16") as eng:
        for name in ("greedy", "truncated"):
            alone = _run(eng, [target], _params(name, 12))[0]
            for pos in (0, 3, 5):
                batch = others[:pos] + [target] + others[pos:]
                assert _run(eng, batch, _params(name, 12))[pos] == alone, (name, pos)
            assert_prefill_logprobs_equal_decode(eng, target, _params(name, 12))


def test_http_server_in_deterministic_mode(tiny_model_dir) -> None:
    """Over HTTP: the flag is reported, and a seeded request gives the same tokens and logprobs
    alone and inside a batch."""
    rng = random.Random(9)
    target = _rand_prompt(rng, 30)
    batch = [_rand_prompt(rng, 50), target, _rand_prompt(rng, 7)]
    body = {"sampling_params": _params("truncated", 10), "return_logprob": True}
    with ServerProcess(tiny_model_dir("qwen3"), "--enable-deterministic-inference") as server:
        info = httpx.get(server.url + "/get_server_info", timeout=30).json()
        assert info["enable_deterministic_inference"] is True
        alone = httpx.post(server.url + "/generate", json={**body, "input_ids": target},
                           timeout=120).json()
        outs = httpx.post(server.url + "/generate", json={**body, "input_ids": batch},
                          timeout=120).json()
    assert _tokens_and_logprobs(outs[1]) == _tokens_and_logprobs(alone)
    assert len(alone["output_ids"]) == 10
