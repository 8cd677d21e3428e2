"""Engine core end to end: greedy parity with transformers, logprobs, radix cache, paging,
chunked prefill, retraction under memory pressure, SmolLM2, and bad arguments."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

import sglang as sgl

NUM_NEW = 12


def _prompts(seed: int = 0, n: int = 6) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 460) for _ in range(24)]
    prompts = [[rng.randrange(3, 460) for _ in range(rng.randint(3, 70))] for _ in range(n)]
    # two prompts sharing a 24-token prefix exercise the radix cache inside one batch
    prompts += [shared + [5, 6, 7], shared + [rng.randrange(3, 460) for _ in range(30)]]
    return prompts


def hf_greedy(model_dir: Path, prompts: list[list[int]], num_new: int) -> list[dict]:
    """Plain argmax steps in transformers (full forward each step), with chosen logprobs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = list(prompt)
            logprobs = []
            prompt_logprobs = None
            for _ in range(num_new):
                logits = model(torch.tensor([ids])).logits[0].float()
                lp = torch.log_softmax(logits, dim=-1)
                if prompt_logprobs is None:
                    prompt_logprobs = [lp[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
                nxt = int(lp[-1].argmax())
                logprobs.append(lp[-1, nxt].item())
                ids.append(nxt)
            outs.append(
                {
                    "ids": ids[len(prompt) :],
                    "logprobs": logprobs,
                    "prompt_logprobs": prompt_logprobs,
                }
            )
    return outs


def _generate(engine: sgl.Engine, prompts: list[list[int]], **kw: object) -> list[dict]:
    return engine.generate(
        input_ids=prompts,
        sampling_params={"temperature": 0, "max_new_tokens": NUM_NEW, "ignore_eos": True},
        **kw,
    )


CONFIGS = {
    "radix-page1": {},
    "noradix-page4": {"disable_radix_cache": True, "page_size": 4},
    "radix-page4-chunk16": {"page_size": 4, "chunked_prefill_size": 16},
    "noradix-page1-chunk8": {"disable_radix_cache": True, "chunked_prefill_size": 8},
}
CASES = [("llama", name) for name in CONFIGS] + [
    ("qwen2", "radix-page1"),
    ("qwen2", "radix-page4-chunk16"),
    ("qwen3", "radix-page1"),
    ("qwen3", "noradix-page1-chunk8"),
]


@pytest.mark.parametrize(("arch", "config"), CASES)
def test_greedy_parity_with_transformers(tiny_model_dir, arch: str, config: str) -> None:
    model_dir = tiny_model_dir(arch)
    prompts = _prompts()
    expected = hf_greedy(model_dir, prompts, NUM_NEW)
    with sgl.Engine(model_path=str(model_dir), random_seed=0, **CONFIGS[config]) as engine:
        # a lone request on a fresh pool has consecutive KV slots (the zero-copy decode path)
        alone = _generate(engine, [prompts[-1]])[0]
        first = _generate(engine, prompts)
        again = _generate(engine, prompts)  # the second pass hits the prefix cache
        state = engine.get_server_info()["internal_states"][0]
    assert alone["output_ids"] == expected[-1]["ids"]
    for out, exp in zip(first, expected):
        assert out["output_ids"] == exp["ids"]
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": NUM_NEW}
        assert out["meta_info"]["completion_tokens"] == NUM_NEW
    assert [o["output_ids"] for o in again] == [e["ids"] for e in expected]
    if not CONFIGS[config].get("disable_radix_cache"):
        page = CONFIGS[config].get("page_size", 1)
        for out, prompt in zip(again, prompts):
            # at least one token is always recomputed; the cache holds whole pages only
            assert out["meta_info"]["cached_tokens"] == (len(prompt) - 1) // page * page
        assert state["tree_cache_size"] > 0
    assert state["running_batch_size"] == 0 and state["waiting_queue_size"] == 0


def test_logprobs_match_transformers(tiny_model_dir) -> None:
    model_dir = tiny_model_dir("llama")
    prompts = _prompts(seed=1, n=3)
    expected = hf_greedy(model_dir, prompts, NUM_NEW)
    with sgl.Engine(model_path=str(model_dir), chunked_prefill_size=8) as engine:
        outs = _generate(
            engine, prompts, return_logprob=True, logprob_start_len=0, top_logprobs_num=3
        )
        tail = _generate(engine, prompts, return_logprob=True, logprob_start_len=2)
    for out, exp, prompt in zip(outs, expected, prompts):
        meta = out["meta_info"]
        got = [lp for lp, _, _ in meta["output_token_logprobs"]]
        assert [t for _, t, _ in meta["output_token_logprobs"]] == exp["ids"]
        assert got == pytest.approx(exp["logprobs"], abs=1e-4)
        inp = meta["input_token_logprobs"]
        assert [t for _, t, _ in inp] == prompt
        assert inp[0][0] is None
        assert [lp for lp, _, _ in inp[1:]] == pytest.approx(exp["prompt_logprobs"], abs=1e-4)
        tops = meta["output_top_logprobs"]
        assert len(tops) == NUM_NEW and all(len(t) == 3 for t in tops)
        for top, chosen in zip(tops, meta["output_token_logprobs"]):
            assert top[0][1] == chosen[1]  # greedy: the chosen token is the most likely
            assert top[0][0] >= top[1][0] >= top[2][0]
    for out, exp, prompt in zip(tail, expected, prompts):
        inp = out["meta_info"]["input_token_logprobs"]
        assert [t for _, t, _ in inp] == prompt[2:]
        assert inp[0][0] is None  # as upstream: the entry at logprob_start_len has no logprob
        assert [lp for lp, _, _ in inp[1:]] == pytest.approx(exp["prompt_logprobs"][2:], abs=1e-4)


def test_retraction_under_memory_pressure(tiny_model_dir) -> None:
    model_dir = tiny_model_dir("llama")
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 460) for _ in range(20)] for _ in range(8)]
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    with sgl.Engine(model_path=str(model_dir)) as roomy:
        expected = roomy.generate(input_ids=prompts, sampling_params=params)
    # 8 x 60 tokens do not fit in 160 slots: decoding must retract and re-prefill requests.
    with sgl.Engine(
        model_path=str(model_dir), max_total_tokens=160, max_running_requests=8
    ) as tight:
        outs = tight.generate(input_ids=prompts, sampling_params=params)
        state = tight.get_server_info()["internal_states"][0]
    assert [o["output_ids"] for o in outs] == [e["output_ids"] for e in expected]
    assert sum(o["meta_info"]["total_retractions"] for o in outs) > 0
    assert all(len(o["output_ids"]) == 40 for o in outs)
    # nothing leaks: every slot is free or held by the (evictable) prefix cache
    assert state["available_kv_tokens"] == state["max_total_num_tokens"]


def test_smollm2_answers_paris(smollm2_dir) -> None:
    with sgl.Engine(model_path=str(smollm2_dir)) as engine:
        chat = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}],
            add_generation_prompt=True,
            tokenize=False,
        )
        out = engine.generate(chat, {"temperature": 0, "max_new_tokens": 32})
    assert "Paris" in out["text"]


def test_bad_arguments_raise_clear_errors(tiny_model_dir, tmp_path: Path) -> None:
    with pytest.raises(Exception, match="does not exist|not found|No such"):
        sgl.Engine(model_path=str(tmp_path / "missing"))
    # a child that fails on its own (here the detokenizer's tokenizer) reports its cause, not
    # merely that it exited, whichever child process dies first
    with pytest.raises(RuntimeError, match="tokenizer path .*missing_tok.* does not exist"):
        sgl.Engine(
            model_path=str(tiny_model_dir("llama")), tokenizer_path=str(tmp_path / "missing_tok")
        )
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    config["architectures"] = ["FooForCausalLM"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="FooForCausalLM"):
        sgl.Engine(model_path=str(bad), skip_tokenizer_init=True, load_format="dummy")
    with pytest.raises(TypeError, match="no_such_option"):
        sgl.Engine(model_path=str(tiny_model_dir("llama")), no_such_option=1)
    with sgl.Engine(model_path=str(tiny_model_dir("llama")), context_length=64) as engine:
        with pytest.raises(ValueError, match="context|long"):
            engine.generate(input_ids=list(range(3, 100)), sampling_params={"max_new_tokens": 4})
        # the engine still serves after the rejection
        out = engine.generate(
            input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3, "ignore_eos": True}
        )
        assert len(out["output_ids"]) == 3
