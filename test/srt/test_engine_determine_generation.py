"""Determinism across interruptions (deterministic mode): a run paused with retract or in_place
equals the uninterrupted run; after an abort, the partial output is a prefix of it and
resubmitting prompt + partial output with the remaining budget reproduces the rest."""

from __future__ import annotations

import pytest
from engine_test_utils import (
    CUDA_POOL,
    MAX_NEW,
    engine_state,
    ids_and_logprobs,
    request_pool,
    wait_for,
    wait_loop_turns,
    wait_running,
)

import sglang as sgl

PROMPTS = [[11, 12, 13, 14], [21, 22, 23], [31, 32, 33, 34, 35], [41, 42]]
PARAMS = {
    "greedy": {"temperature": 0},
    "seeded": {"temperature": 1.0, "sampling_seed": 2024},
}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """Overrides conftest's ``engine``: deterministic inference."""
    with sgl.Engine(
        model_path=str(tiny_model_dir("llama")),
        enable_deterministic_inference=True,
        random_seed=0,
        **CUDA_POOL,
    ) as eng:
        yield eng


def _params(name: str, max_new: int = MAX_NEW) -> dict:
    return {**PARAMS[name], "max_new_tokens": max_new, "ignore_eos": True}


def _wait_decoding(engine: sgl.Engine, n: int) -> None:
    """Wait until ``n`` requests run and some decode steps have happened."""
    wait_running(lambda: engine_state(engine), n)
    start = engine_state(engine)["forward_ct_decode"]
    wait_for(lambda: engine_state(engine)["forward_ct_decode"] > start + 5)


@pytest.fixture(scope="module")
def baselines(engine: sgl.Engine) -> dict[str, list[dict]]:
    """The uninterrupted run of all of PROMPTS per sampling mode, computed once: deterministic
    mode makes each request's output independent of its batch, so a test interrupting
    ``PROMPTS[:num]`` compares with the first ``num`` of these (1,500 tokens each; recomputing
    them per test was a third of this module's time)."""
    return {
        name: engine.generate(
            input_ids=PROMPTS, sampling_params=_params(name), return_logprob=True
        )
        for name in PARAMS
    }


def _interrupted(engine: sgl.Engine, prompts: list[list[int]], name: str, mode: str) -> list:
    engine.flush_cache()
    with request_pool(engine, 1) as pool:
        fut = pool.submit(
            engine.generate, input_ids=prompts, sampling_params=_params(name), return_logprob=True
        )
        _wait_decoding(engine, len(prompts))
        engine.pause_generation(mode=mode)
        wait_loop_turns(lambda: engine_state(engine), 10)  # stay paused for a few turns
        engine.continue_generation()
        return fut.result(timeout=120)


@pytest.mark.parametrize("name", list(PARAMS))
@pytest.mark.parametrize("mode", ["retract", "in_place"])
@pytest.mark.parametrize("num", [1, 4])
def test_pause_continue_equals_uninterrupted(
    engine, baselines, name: str, mode: str, num: int
) -> None:
    prompts = PROMPTS[:num]
    expected = baselines[name][:num]
    outs = _interrupted(engine, prompts, name, mode)
    for out, exp in zip(outs, expected):
        assert ids_and_logprobs(out) == ids_and_logprobs(exp)
        assert out["meta_info"]["total_retractions"] == (1 if mode == "retract" else 0)


@pytest.mark.parametrize("name", list(PARAMS))
@pytest.mark.parametrize("num", [1, 4])
def test_abort_then_resubmit_reproduces_the_rest(engine, baselines, name: str, num: int) -> None:
    prompts = PROMPTS[:num]
    expected = baselines[name][:num]
    partial = _interrupted(engine, prompts, name, "abort")
    resubmitted, params, rests = [], [], []
    for prompt, part, exp in zip(prompts, partial, expected):
        assert part["meta_info"]["finish_reason"]["type"] == "abort"
        got_ids, got_lps = ids_and_logprobs(part)
        exp_ids, exp_lps = ids_and_logprobs(exp)
        k = len(got_ids)
        assert 0 < k < MAX_NEW
        assert (got_ids, got_lps) == (exp_ids[:k], exp_lps[:k])
        resubmitted.append(prompt + got_ids)
        params.append(_params(name, MAX_NEW - k))
        rests.append((exp_ids[k:], exp_lps[k:]))
    # All the resubmissions in one batch: deterministic mode makes each one's output
    # independent of the others.
    outs = engine.generate(input_ids=resubmitted, sampling_params=params, return_logprob=True)
    assert [ids_and_logprobs(out) for out in outs] == rests


def test_stream_through_retract_concatenates_to_the_baseline(engine, baselines) -> None:
    prompt = PROMPTS[0]
    expected = baselines["seeded"][0]
    chunks: list[dict] = []
    with request_pool(engine, 1) as pool:
        fut = pool.submit(
            lambda: chunks.extend(
                engine.generate(
                    input_ids=prompt,
                    sampling_params=_params("seeded"),
                    stream=True,
                    return_logprob=True,
                )
            )
        )
        _wait_decoding(engine, 1)
        engine.pause_generation(mode="retract")
        engine.continue_generation()
        fut.result(timeout=120)
    for prev, cur in zip(chunks, chunks[1:]):  # cumulative: each chunk extends the previous
        assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": MAX_NEW}
    assert ids_and_logprobs(final) == ids_and_logprobs(expected)
    assert final["meta_info"]["completion_tokens"] == MAX_NEW
    assert final["meta_info"]["total_retractions"] == 1
