"""Constrained decoding (json_schema, regex, ebnf, structural_tag) and logit_bias.

Unit tests of the bitmask, the batch's logits processors and the request checks; then the real
SmolLM2 (deterministic mode) end to end: outputs that parse and match, sampled or greedy, with
logprobs and entropy aligned; the grammar carried through a retract, an in-place pause and an
abort; logit_bias moving greedy tokens.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from engine_test_utils import assert_kv_all_back, engine_state, request_pool, wait_running
from model_test_utils import TWO_ENGINE_KW
from scheduler_test_utils import assert_no_leak, make_core, run_until_idle, submit
from transformers import AutoTokenizer

import sglang as sgl
from sglang.srt.constrained.base_grammar_backend import (
    ANY_JSON,
    InvalidGrammarError,
    create_grammar_backend,
    grammar_spec,
)
from sglang.srt.constrained.bitmask import apply_token_bitmask
from sglang.srt.managers.field_checks import InvalidRequestError
from sglang.srt.managers.sampling_validation import check_sampling_params
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.sampling.sampling_params import SamplingParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
# Long enough to be interrupted: 16 numbers of one or two digits.
NUMBERS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
           "minItems": 16, "maxItems": 16}


# ---- units ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [[1, 3, 4], [0, 1, 2, 3, 4]])
def test_bitmask_masks_exactly_the_cleared_bits(dtype: torch.dtype, rows: list[int]) -> None:
    gen = torch.Generator().manual_seed(0)
    vocab, batch = 100, 5
    logits = torch.randn(batch, vocab, generator=gen).to(dtype)
    bitmask = torch.randint(-(2**31), 2**31, (len(rows), 4), dtype=torch.int64, generator=gen)
    bitmask = bitmask.to(torch.int32)
    expected = logits.clone()
    for i, row in enumerate(rows):
        for t in range(vocab):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                expected[row, t] = float("-inf")
    apply_token_bitmask(logits, bitmask, torch.tensor(rows))
    assert torch.equal(logits, expected)
    assert torch.isinf(logits[rows]).any()
    assert not any(torch.isinf(logits[r]).any() for r in range(batch) if r not in rows)


class _Req(SimpleNamespace):
    """What SamplingBatchInfo.from_reqs reads."""


def _req(grammar: object = None, **params: object) -> _Req:
    sp = SamplingParams(**params)  # type: ignore[arg-type]
    sp.normalize()
    return _Req(sampling_params=sp, sampling_seed=1, origin_input_ids=[1, 2], output_ids=[],
                eos_token_ids={0}, grammar=grammar)


class _OnlyTokens:
    """A matcher that allows the given tokens."""

    def __init__(self, *tokens: int) -> None:
        self.tokens = tokens

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        for t in self.tokens:
            bitmask[row, t // 32] |= 1 << (t % 32)

    def accept(self, token_id: int) -> bool:
        return token_id in self.tokens

    def is_terminated(self) -> bool:
        return False


def test_logit_bias_then_grammar_in_the_batch() -> None:
    vocab = 70
    reqs = [_req(logit_bias={"5": 3.5, "64": -2}), _req(),
            _req(_OnlyTokens(2, 40, 69), logit_bias={"40": 1.0}, min_new_tokens=3)]
    info = SamplingBatchInfo.from_reqs(reqs, vocab, "cpu")
    assert info.min_new_tokens is None  # a grammar row is never held back
    logits = torch.zeros(3, vocab)
    info.apply_logits_processors(logits)
    assert logits[0, 5] == 3.5 and logits[0, 64] == -2 and logits[0].abs().sum() == 5.5
    assert not logits[1].any()
    allowed = torch.isfinite(logits[2]).nonzero().flatten().tolist()
    assert allowed == [2, 40, 69] and logits[2, 40] == 1.0 and logits[2, 2] == 0


def test_grammar_spec_and_backend_checks() -> None:
    assert grammar_spec({"regex": "", "ebnf": None}) is None
    assert grammar_spec({"json_schema": "{}"}) == ("json_schema", "{}")
    backend = create_grammar_backend("xgrammar", None, 1000)
    assert backend is not None and backend.bitmask_width == 32
    assert create_grammar_backend("none", None, 1000) is None
    for spec in [("json_schema", ANY_JSON), ("json_schema", json.dumps(PERSON)),
                 ("regex", PHONE), ("ebnf", 'root ::= "yes" | "no"'),
                 ("structural_tag", json.dumps({"structures": [
                     {"begin": "<f>", "schema": PERSON, "end": "</f>"}], "triggers": ["<f>"]}))]:
        backend.check(spec)
    for spec, needle in [(("json_schema", "{bad"), "JSON"), (("regex", "[ab"), "Unclosed"),
                         (("ebnf", "root ::= "), "ebnf"), (("structural_tag", "[1]"), "struct"),
                         (("structural_tag", "{nope"), "not JSON")]:
        with pytest.raises(InvalidGrammarError, match=needle):
            backend.check(spec)


def _check(params: dict, grammar: bool = True) -> int:
    backend = create_grammar_backend("xgrammar", None, 1000) if grammar else None
    return check_sampling_params(params, "sampling_params", 1000, 8, 4, 64, backend)


@pytest.mark.parametrize(("params", "needle"), [
    ({"regex": "a", "json_schema": "{}"}, "at most one of"),
    ({"regex": 5}, "sampling_params.regex: must be a string"),
    ({"ebnf": "root ::= ("}, "sampling_params.ebnf"),
    ({"logit_bias": {"1000": 1.0}}, "token ids in [0, 1000)"),
    ({"logit_bias": {"-1": 1.0}}, "keys must be token ids"),
    ({"logit_bias": {"1": "x"}}, "must be a number"),
    ({"logit_bias": [1]}, "must be a JSON object"),
])
def test_bad_constraints_are_refused(params: dict, needle: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        _check(params)
    assert needle in str(e.value)


def test_constraints_when_grammars_are_off() -> None:
    with pytest.raises(InvalidRequestError, match="constrained decoding is off"):
        _check({"regex": "a+"}, grammar=False)
    # Unset (null or empty) constraints are fine either way, as clients send them.
    assert _check({"regex": "", "json_schema": None, "logit_bias": {}}, grammar=False) == 1
    assert _check({"logit_bias": {"5": -100, 7: 2.5}}, grammar=False) == 1


def test_sampling_params_checks_the_engine_path() -> None:
    """SamplingParams.verify holds the same rules for callers that skip the frontend."""
    with pytest.raises(ValueError, match="at most one"):
        SamplingParams(regex="a", ebnf='root ::= "a"').verify()
    with pytest.raises(ValueError, match=r"in \[0, 10\)"):
        SamplingParams(logit_bias={"10": 1.0}).verify(10)
    with pytest.raises(ValueError, match="finite"):
        SamplingParams(logit_bias={"1": float("nan")}).verify(10)
    SamplingParams(logit_bias={"9": 1.0, 3: -1}).verify(10)


def test_matcher_follows_a_structural_tag(smollm2_dir: Path) -> None:
    """Free text until the trigger, then the schema, then free text again."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    backend = create_grammar_backend("xgrammar", tokenizer, 49152)
    assert backend is not None
    tag = {"structures": [{"begin": "<f>", "schema": {"type": "integer"}, "end": "</f>"}],
           "triggers": ["<f>"]}
    matcher = backend.matcher(("structural_tag", json.dumps(tag)), [tokenizer.eos_token_id])
    bitmask = torch.zeros(1, backend.bitmask_width, dtype=torch.int32)

    def allowed(token_id: int) -> bool:
        matcher.fill_bitmask(bitmask, 0)
        return bool((int(bitmask[0, token_id // 32]) >> (token_id % 32)) & 1)

    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    digit = tokenizer.encode("7", add_special_tokens=False)[0]
    assert allowed(letter)
    for t in tokenizer.encode("hello <f>", add_special_tokens=False):
        assert matcher.accept(t)
    assert not allowed(letter) and allowed(digit)
    assert not matcher.accept(letter)  # refused, and the state is unchanged
    for t in tokenizer.encode("42</f> bye", add_special_tokens=False):
        assert matcher.accept(t)
    assert allowed(letter)


def test_json_layout_without_free_whitespace(smollm2_dir: Path) -> None:
    """--constrained-json-disable-any-whitespace: no newline where JSON would allow one."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    newline = tokenizer.encode("\n", add_special_tokens=False)[0]
    obj = {"type": "object", "properties": {"a": {"type": "integer"}}}
    schema = ("json_schema", json.dumps(obj))
    bitmask = torch.zeros(1, 1536, dtype=torch.int32)
    for any_whitespace in (True, False):
        backend = create_grammar_backend("xgrammar", tokenizer, 49152, any_whitespace)
        assert backend is not None
        matcher = backend.matcher(schema, [tokenizer.eos_token_id])
        assert matcher.accept(tokenizer.encode("{", add_special_tokens=False)[0])
        matcher.fill_bitmask(bitmask, 0)
        assert bool((int(bitmask[0, newline // 32]) >> (newline % 32)) & 1) is any_whitespace


class _RefuseAfter:
    """A matcher that accepts ``n`` tokens, then none (a grammar that leaves no token)."""

    def __init__(self, n: int) -> None:
        self.left = n

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = -1 if self.left else 0

    def accept(self, token_id: int) -> bool:
        self.left -= 1
        return self.left >= 0

    def is_terminated(self) -> bool:
        return False


def test_a_grammar_left_without_tokens_ends_the_request(
    tiny_model_dir: Callable[..., Path],
) -> None:
    """The token drawn from an all -inf row is not output (nor its NaN logprob): the request
    ends with an abort that says why, its other tokens kept, nothing leaked."""
    core, _, sink = make_core(str(tiny_model_dir("llama")), max_total_tokens=512)
    core.grammar_backend = SimpleNamespace(  # type: ignore[assignment]
        matcher=lambda spec, stops: _RefuseAfter(3))
    submit(core, "g", [5, 6, 7], 20, sampling={"regex": "x"}, return_logprob=True)
    submit(core, "plain", [5, 6, 8], 20, return_logprob=True)
    run_until_idle(core)
    assert_no_leak(core)
    record = sink.by_rid["g"]
    assert len(record.output_ids) == 3 and len(record.logprobs) == 3
    assert record.finished_reasons[-1]["type"] == "abort"
    assert "allows no token" in record.finished_reasons[-1]["message"]
    assert len(sink.by_rid["plain"].output_ids) == 20


# ---- end to end on SmolLM2 --------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(smollm2_dir: Path) -> Iterator[sgl.Engine]:
    with sgl.Engine(model_path=str(smollm2_dir), enable_deterministic_inference=True,
                    random_seed=0, **TWO_ENGINE_KW) as eng:
        yield eng


def _check_person(value: object) -> None:
    assert isinstance(value, dict) and set(value) == {"name", "age", "tags"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 16
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 3
    assert set(value["tags"]) <= {"a", "b", "c"}


def _check_aligned(out: dict) -> None:
    """One finite logprob and one entropy per output token, the ids the logprobs name."""
    meta = out["meta_info"]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(lp > float("-inf") for lp, _, _ in meta["output_token_logprobs"])
    assert len(meta["output_token_entropy"]) == len(out["output_ids"])


def test_json_schema_outputs_parse_and_match(engine: sgl.Engine) -> None:
    prompts = ["Describe a person as JSON.", "Give me a JSON record of a cat owner."]
    params = [{"temperature": 0, "max_new_tokens": 96, "json_schema": json.dumps(PERSON)},
              {"temperature": 1.0, "max_new_tokens": 96, "json_schema": json.dumps(PERSON),
               "n": 3}]
    for p in params:
        outs = engine.generate(prompt=prompts, sampling_params=p, return_logprob=True,
                               return_entropy=True)
        for out in outs:
            assert out["meta_info"]["finish_reason"]["type"] == "stop", out
            _check_person(json.loads(out["text"]))
            _check_aligned(out)
    out = engine.generate(prompt="Any JSON value:", sampling_params={
        "temperature": 0, "max_new_tokens": 64, "json_schema": ANY_JSON})
    json.loads(out["text"])


def test_regex_and_ebnf_sampled(engine: sgl.Engine) -> None:
    outs = engine.generate(prompt=["Call me at"] * 4, sampling_params={
        "temperature": 1.0, "max_new_tokens": 32, "regex": PHONE})
    for out in outs:
        assert re.fullmatch(PHONE, out["text"]), out["text"]
    # The grammar wins over min_new_tokens and ignore_eos: the output ends where it is done.
    outs = engine.generate(prompt=["Yes or no?"] * 4, sampling_params={
        "temperature": 1.0, "max_new_tokens": 16, "ebnf": 'root ::= "yes" | "no"',
        "min_new_tokens": 8, "ignore_eos": True})
    for out in outs:
        assert out["text"] in ("yes", "no")
        assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_batch_neighbours_change_nothing(engine: sgl.Engine) -> None:
    """Deterministic mode: an unconstrained request and a sampled constrained one give the
    same bits alone as together (the masks touch their own rows only)."""
    plain = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    phone = {"temperature": 1.0, "max_new_tokens": 32, "regex": PHONE, "sampling_seed": 5}
    kw = {"return_logprob": True, "return_entropy": True}
    alone = [engine.generate(prompt="The sky is", sampling_params=plain, **kw),
             engine.generate(prompt="Call me at", sampling_params=phone, **kw)]
    together = engine.generate(prompt=["The sky is", "Call me at"],
                               sampling_params=[plain, phone], **kw)
    for a, b in zip(alone, together):
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]
        assert a["meta_info"]["output_token_entropy"] == b["meta_info"]["output_token_entropy"]
    assert re.fullmatch(PHONE, together[1]["text"])


def test_logit_bias_moves_greedy_tokens(engine: sgl.Engine) -> None:
    greedy = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    base = engine.generate(prompt="The capital of France is", sampling_params=greedy,
                           return_logprob=True)
    first = base["output_ids"][0]
    banned = engine.generate(prompt="The capital of France is", sampling_params={
        **greedy, "logit_bias": {str(first): -100.0}})
    assert first not in banned["output_ids"]
    forced = engine.generate(prompt="The capital of France is", sampling_params={
        **greedy, "logit_bias": {"1234": 100.0}}, return_logprob=True)
    assert forced["output_ids"] == [1234] * 6
    # Logprobs are those of the biased distribution (as upstream): the forced token is sure.
    assert all(lp > -1e-3 for lp, _, _ in forced["meta_info"]["output_token_logprobs"])


def _numbers_request(engine: sgl.Engine, seed: int) -> dict:
    return engine.generate(prompt="Sixteen numbers:", sampling_params={
        "temperature": 1.0, "max_new_tokens": 200, "json_schema": json.dumps(NUMBERS),
        "sampling_seed": seed}, return_logprob=True, return_entropy=True)


@pytest.fixture(scope="module")
def uninterrupted(engine: sgl.Engine) -> dict:
    out = _numbers_request(engine, 7)
    values = json.loads(out["text"])
    assert len(values) == 16 and all(0 <= v <= 99 for v in values)
    return out


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_keeps_the_grammar_and_the_tokens(
    engine: sgl.Engine, uninterrupted: dict, mode: str
) -> None:
    """A constrained request paused mid-way (its KV released and re-prefilled, or kept) ends
    with exactly the output of an uninterrupted run: the matcher is not rebuilt or replayed."""
    expected = uninterrupted
    with request_pool(engine, 1) as pool:
        future = pool.submit(_numbers_request, engine, 7)
        wait_running(lambda: engine_state(engine), 1)
        result = engine.pause_generation(mode=mode)
        state = engine_state(engine)
        assert state["engine_paused"]
        if mode == "retract":
            assert state["waiting_queue_size"] == 1 and state["running_batch_size"] == 0
        time.sleep(0.05)
        engine.continue_generation()
        out = future.result(timeout=120)
    assert result is not None
    if mode == "retract":
        assert out["meta_info"]["total_retractions"] >= 1
    assert out["output_ids"] == expected["output_ids"]
    assert out["meta_info"]["output_token_logprobs"] == expected["meta_info"][
        "output_token_logprobs"]
    assert out["meta_info"]["output_token_entropy"] == expected["meta_info"][
        "output_token_entropy"]
    assert_kv_all_back(engine_state(engine))


def test_abort_mid_grammar_then_serve_again(engine: sgl.Engine) -> None:
    with request_pool(engine, 1) as pool:
        future = pool.submit(_numbers_request, engine, 3)
        wait_running(lambda: engine_state(engine), 1)
        engine.pause_generation(mode="abort")
        engine.continue_generation()
        out = future.result(timeout=120)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["text"].startswith("[")
    assert_kv_all_back(engine_state(engine))
    again = engine.generate(prompt="Call me at", sampling_params={
        "temperature": 0, "max_new_tokens": 32, "regex": PHONE})
    assert re.fullmatch(PHONE, again["text"])


def test_many_different_grammars_at_once(engine: sgl.Engine) -> None:
    rng = random.Random(0)
    patterns = [f"[a-z]{{{n}}}-[0-9]{{{m}}}" for n, m in
                ((rng.randint(2, 6), rng.randint(1, 4)) for _ in range(8))]
    outs = engine.generate(prompt=["Code:"] * len(patterns), sampling_params=[
        {"temperature": 1.0, "max_new_tokens": 24, "regex": p} for p in patterns])
    for pattern, out in zip(patterns, outs):
        assert re.fullmatch(pattern, out["text"]), (pattern, out["text"])


def test_engine_refuses_bad_grammars(engine: sgl.Engine) -> None:
    with pytest.raises(ValueError, match="sampling_params.json_schema"):
        engine.generate(prompt="hi", sampling_params={"json_schema": "{bad"})
    with pytest.raises(ValueError, match="logit_bias"):
        engine.generate(prompt="hi", sampling_params={"logit_bias": {"49152": 1}})
