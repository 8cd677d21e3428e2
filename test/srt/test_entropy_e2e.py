"""Per-token entropy through Engine: equal to the entropy of transformers' teacher-forced logits
for each definition, aligned with the output tokens, identical streamed and not, and aligned
after a retract pause and after an abort."""

from __future__ import annotations

import inspect
import math
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch
from engine_test_utils import MAX_NEW, engine_state, request_pool, wait_for
from model_test_utils import teacher_forced_logits

import sglang as sgl

PROMPT = [11, 42, 7, 99, 250, 3]
SAMPLED = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.02, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def engine(model_dir):
    """Overrides conftest's ``engine``: a small KV pool and entropy with every logprob."""
    with sgl.Engine(
        model_path=str(model_dir),
        dtype="float32",  # transformers' float32 logits are the reference (auto is bf16 on CUDA)
        random_seed=0,
        max_total_tokens=8192,
        enable_entropy_with_logprobs=True,
    ) as eng:
        yield eng


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def entropy64(values: torch.Tensor) -> float:
    logp = torch.log_softmax(values, dim=-1)
    return float(-(logp.exp() * logp).sum())


def allowed_values(x: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The values of x = logits / T that top-k/top-p/min-p keep (docs/sampling.md)."""
    vals = x.sort(descending=True).values
    probs = torch.softmax(vals, dim=-1)
    keep = (probs.cumsum(0) - probs < top_p) & (torch.arange(len(vals)) < top_k)
    return vals[keep & (probs >= min_p * probs[0])]


def expected_entropy(logits: torch.Tensor, mode: str, top_k: int) -> list[float]:
    """Each definition of docs/entropy.md for the SAMPLED parameters, in float64."""
    temp = SAMPLED["temperature"]
    out = []
    for row in logits:
        if mode == "raw":
            values = row
        elif mode == "scaled":
            values = row / temp
        else:
            top_k_s, top_p, min_p = SAMPLED["top_k"], SAMPLED["top_p"], SAMPLED["min_p"]
            values = allowed_values(row / temp, top_k_s, top_p, min_p)
        out.append(entropy64(values.topk(min(top_k, len(values))).values if top_k else values))
    return out


def check_aligned(out: dict) -> list[float]:
    meta = out["meta_info"]
    entropy = meta["output_token_entropy"]
    assert len(entropy) == len(out["output_ids"]) == meta["completion_tokens"]
    assert len(meta["output_token_logprobs"]) == len(entropy)
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    return entropy


def test_raw_entropy_matches_transformers(engine, hf_model) -> None:
    out = engine.generate(
        input_ids=PROMPT,
        sampling_params={**SAMPLED, "max_new_tokens": 16, "sampling_seed": 5},
        return_logprob=True,
        return_entropy=True,
    )
    got = check_aligned(out)
    logits = teacher_forced_logits(hf_model, PROMPT, out["output_ids"])
    assert got == pytest.approx(expected_entropy(logits, "raw", 0), abs=1e-4, rel=1e-4)
    # The first value comes from the prefill logits, the rest from decode steps.
    assert all(0.0 <= h <= math.log(logits.shape[1]) for h in got)


def _overrides_reach_the_sampler(engine) -> bool:
    """Sampled entropy of a greedy row is 0 by definition; raw entropy is not."""
    out = engine.generate(
        input_ids=PROMPT,
        sampling_params={"temperature": 0, "max_new_tokens": 1},
        return_entropy=True,
        entropy_mode="sampled",
    )
    return out["meta_info"]["output_token_entropy"] == [0.0]


@pytest.mark.parametrize(
    "mode, top_k", [("scaled", 0), ("sampled", 0), ("raw", 20), ("sampled", 5)]
)
def test_each_definition_matches_transformers(engine, hf_model, mode: str, top_k: int) -> None:
    if "entropy_mode" not in inspect.signature(sgl.Engine.generate).parameters:
        pytest.skip("Engine.generate does not take entropy_mode/entropy_top_k yet")
    if not _overrides_reach_the_sampler(engine):
        pytest.skip("the scheduler does not pass entropy_mode/entropy_top_k to Req yet")
    out = engine.generate(
        input_ids=PROMPT,
        sampling_params={**SAMPLED, "max_new_tokens": 12, "sampling_seed": 9},
        return_logprob=True,
        return_entropy=True,
        entropy_mode=mode,
        entropy_top_k=top_k,
    )
    got = check_aligned(out)
    logits = teacher_forced_logits(hf_model, PROMPT, out["output_ids"])
    assert got == pytest.approx(expected_entropy(logits, mode, top_k), abs=1e-4, rel=1e-4)
    if top_k:
        assert max(got) <= math.log(top_k) + 1e-6


def test_flag_adds_entropy_to_logprob_requests_only(engine) -> None:
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    with_logprobs = engine.generate(input_ids=PROMPT, sampling_params=params, return_logprob=True)
    assert len(check_aligned(with_logprobs)) == 4
    plain = engine.generate(input_ids=PROMPT, sampling_params=params)
    assert "output_token_entropy" not in plain["meta_info"]


def test_stream_equals_non_stream(engine) -> None:
    params = {**SAMPLED, "max_new_tokens": 20, "sampling_seed": 21}
    kwargs = {"input_ids": PROMPT, "sampling_params": params, "return_entropy": True}
    whole = engine.generate(**kwargs, return_logprob=True)
    chunks = list(engine.generate(**kwargs, return_logprob=True, stream=True))
    assert len(chunks) > 1
    for chunk in chunks:
        check_aligned(chunk)  # every streamed state is aligned, not only the last
    assert chunks[-1]["output_ids"] == whole["output_ids"]
    assert chunks[-1]["meta_info"]["output_token_entropy"] == pytest.approx(
        check_aligned(whole), abs=1e-6
    )
    without_logprobs = engine.generate(**kwargs)
    assert without_logprobs["meta_info"]["output_token_entropy"] == pytest.approx(
        check_aligned(whole), abs=1e-6
    )


def _submit(engine, pool: ThreadPoolExecutor, rids: list[str], max_new: int) -> list[Future]:
    params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    return [
        pool.submit(engine.generate, input_ids=[20 + i, *PROMPT], sampling_params=params,
                    rid=rid, return_logprob=True, return_entropy=True)
        for i, rid in enumerate(rids)
    ]  # fmt: skip


def test_entropy_stays_aligned_after_retract(engine, hf_model) -> None:
    rids = [f"retract-{i}" for i in range(3)]
    with request_pool(engine, len(rids)) as pool:
        futures = _submit(engine, pool, rids, max_new=MAX_NEW)
        wait_for(lambda: engine_state(engine)["running_batch_size"] == len(rids))
        try:
            assert engine.pause_generation(mode="retract")["num_retracted"] == len(rids)
        finally:
            engine.continue_generation()
        outs = [f.result(timeout=60) for f in futures]
    for i, out in enumerate(outs):
        assert out["meta_info"]["total_retractions"] >= 1
        assert out["meta_info"]["completion_tokens"] == MAX_NEW
        got = check_aligned(out)
        prompt = [20 + i, *PROMPT]
        logits = teacher_forced_logits(hf_model, prompt, out["output_ids"])
        # A duplicated or dropped value would shift every later one against the tokens.
        assert got == pytest.approx([entropy64(r) for r in logits], abs=1e-4, rel=1e-4)


def test_entropy_stays_aligned_after_abort(engine, hf_model) -> None:
    done = threading.Event()
    with request_pool(engine, 1) as pool:
        (future,) = _submit(engine, pool, ["abort-me"], max_new=MAX_NEW)
        future.add_done_callback(lambda _: done.set())
        start = engine_state(engine)["forward_ct_decode"]
        wait_for(lambda: engine_state(engine)["forward_ct_decode"] >= start + 5 or done.is_set())
        assert engine.abort_request(rid="abort-me") == 1
        out = future.result(timeout=60)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    got = check_aligned(out)
    assert 0 < len(got) < MAX_NEW
    logits = teacher_forced_logits(hf_model, [20, *PROMPT], out["output_ids"])
    assert got == pytest.approx([entropy64(r) for r in logits], abs=1e-4, rel=1e-4)
