"""Fuzz test of issue 13: generated malformed requests never break the engine.

Hypothesis builds native (/generate), OpenAI (/v1/completions, /v1/chat/completions) and control
requests from a valid base request with one to three fields replaced by nasty values (wrong
types, NaN, Infinity, huge numbers, lone surrogates, long strings, nesting), plus raw bodies
(truncated JSON, a byte order mark, deep nesting, non-objects). Each goes to one running server;
the answer must be a 4xx with a JSON error, or a correct 200, never a 5xx, and a fixed greedy
request must still return the same tokens afterwards. The Engine path is fuzzed on a
TokenizerManager without processes: only ValueError may come out of its validation.

CI runs ``SGLANG_FUZZ_EXAMPLES`` (default 150) examples per test; set it higher for a longer
run. The counts are printed at the end (``-s``).
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from engine_test_utils import REFERENCE_REQUEST, reference_ids
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_test_utils import HTTP, ServerProcess

from sglang.srt.entrypoints.engine import _make_request
from sglang.srt.managers.request_validation import check_generate_input
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.server_args import PortArgs, ServerArgs

NUM_EXAMPLES = int(os.environ.get("SGLANG_FUZZ_EXAMPLES", "150"))
FUZZ_SETTINGS = settings(
    max_examples=NUM_EXAMPLES, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
GREEDY = REFERENCE_REQUEST
COUNTS: Counter[str] = Counter()

NASTY = st.sampled_from([
    None, True, False, 0, 1, -1, 3, 2**31, 2**63, -(2**63) - 1, 10**30, 10**400, 0.5, -0.0,
    1e308, 1e-320, math.nan, math.inf, -math.inf, "", "no", "true", "1", "\ud800", "a\udfffb",
    "x" * 600, "😀", [], [1], [True, 1], ["\ud800"], [[]], {}, {"a": 1}, {"\ud800": 1},
    [1.5], ["a"] * 70, [[[[[[1]]]]]],
])
SAMPLING_KEYS = ["max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p",
                 "frequency_penalty", "presence_penalty", "repetition_penalty", "ignore_eos",
                 "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stop",
                 "stop_token_ids", "sampling_seed", "n", "json_schema", "regex", "ebnf",
                 "structural_tag", "logit_bias", "bogus"]
GENERATE_KEYS = ["text", "input_ids", "rid", "return_logprob", "logprob_start_len",
                 "top_logprobs_num", "return_text_in_logprobs", "stream", "return_entropy",
                 "entropy_mode", "entropy_top_k", "sampling_params", "lora_path"]
OPENAI_KEYS = ["prompt", "max_tokens", "temperature", "top_p", "n", "logprobs", "echo", "stop",
               "presence_penalty", "frequency_penalty", "seed", "top_k", "min_p", "ignore_eos",
               "repetition_penalty", "stop_token_ids", "rid", "return_entropy", "stream",
               "stream_options", "suffix", "logit_bias", "regex", "json_schema",
               "response_format"]
CHAT_KEYS = ["messages", "max_tokens", "max_completion_tokens", "temperature", "logprobs",
             "top_logprobs", "stop", "n", "seed", "chat_template_kwargs", "response_format",
             "tools", "tool_choice", "continue_final_message", "skip_special_tokens"]
# Control endpoints with a valid body and the keys to spoil. After each, the engine is put back
# into its serving state (continued, memory resumed).
CONTROL = {
    "/pause_generation": ({"mode": "in_place"}, ["mode", "clear_cache", "timeout_s"]),
    "/abort_request": ({"rid": "nobody"}, ["rid", "abort_all", "match_prefix"]),
    "/flush_cache": ({}, ["x"]),
    "/update_weight_version": ({"new_version": "fuzz"}, ["new_version", "abort_all_requests"]),
    "/update_weights_from_disk": ({"model_path": "/tmp"},
                                  ["model_path", "load_format", "weight_version", "flush_cache"]),
    "/release_memory_occupation": ({"tags": ["kv_cache"]}, ["tags"]),
    "/get_weights_by_name": ({"name": "lm_head.weight", "truncate_size": 1},
                             ["name", "truncate_size"]),
}
RAW_BODIES = [b'{"text": "hi"', b"\xef\xbb\xbf" + json.dumps(GREEDY).encode(), b"[1, 2]",
              b'"text"', b"null", b"", b"\xff\xfe", b"[" * 5000 + b"]" * 5000,
              b'{"text": "hi", "text": 5}', b'{"input_ids": [1e400]}']


def _encode(body: Any) -> bytes:
    """JSON as a careless client writes it: NaN / Infinity literals, \\ud800 escapes."""
    return json.dumps(body, allow_nan=True).encode()


@st.composite
def spoiled(draw: st.DrawFn, base: dict[str, Any], keys: list[str],
            nested: str | None = None) -> dict[str, Any]:
    """``base`` with one to three of ``keys`` set to nasty values (or deleted)."""
    body = json.loads(json.dumps(base))
    for key in draw(st.lists(st.sampled_from(keys), min_size=1, max_size=3, unique=True)):
        target = body
        if nested is not None and key in SAMPLING_KEYS and key != "n":
            target = body.setdefault(nested, {})
            if not isinstance(target, dict):
                continue
        if draw(st.booleans()) and key in target:
            del target[key]
        else:
            target[key] = draw(NASTY)
    return body


GENERATE = spoiled({"text": "Hello", "sampling_params": {"max_new_tokens": 3}},
                   GENERATE_KEYS + SAMPLING_KEYS, nested="sampling_params")
COMPLETIONS = spoiled({"prompt": "Hello", "max_tokens": 3}, OPENAI_KEYS)
CHAT = spoiled({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}, CHAT_KEYS)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Callable[..., Path]) -> Iterator[ServerProcess]:
    with ServerProcess(tiny_model_dir("llama"), "--max-total-tokens", "8192",
                       "--skip-server-warmup", "--max-request-batch-size", "64") as s:
        yield s


@pytest.fixture(scope="module", autouse=True)
def report_counts() -> Iterator[None]:
    yield
    print(f"\nfuzz counts: {dict(COUNTS)}")


@pytest.fixture(scope="module")
def reference(server: ServerProcess) -> list[int]:
    return reference_ids(server)


def _check_answer(r: httpx.Response) -> None:
    """A 4xx with a JSON error, or a 200 that is a complete answer; counted."""
    COUNTS["requests"] += 1
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        COUNTS["4xx"] += 1
        error = r.json()["error"]
        assert error["code"] == r.status_code and error["message"]
        return
    COUNTS["2xx"] += 1
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        assert r.text.endswith("data: [DONE]\n\n") and '"code": 5' not in r.text, r.text[-500:]


def _send(server: ServerProcess, path: str, body: bytes) -> None:
    r = HTTP.post(server.url + path, content=body, timeout=120,
                  headers={"Content-Type": "application/json"})
    _check_answer(r)


def _still_serving(server: ServerProcess, reference: list[int]) -> None:
    assert reference_ids(server) == reference
    assert HTTP.get(server.url + "/health", timeout=30).status_code == 200


@FUZZ_SETTINGS
@given(body=GENERATE)
def test_fuzz_generate(server: ServerProcess, reference: list[int], body: dict) -> None:
    _send(server, "/generate", _encode(body))
    _still_serving(server, reference)


@FUZZ_SETTINGS
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), data=st.data())
def test_fuzz_openai(server: ServerProcess, reference: list[int], path: str,
                     data: st.DataObject) -> None:
    body = data.draw(COMPLETIONS if path == "/v1/completions" else CHAT)
    _send(server, path, _encode(body))
    _still_serving(server, reference)


@FUZZ_SETTINGS
@given(path=st.sampled_from(sorted(CONTROL)), data=st.data())
def test_fuzz_control(server: ServerProcess, reference: list[int], path: str,
                      data: st.DataObject) -> None:
    base, keys = CONTROL[path]
    _send(server, path, _encode(data.draw(spoiled(base, keys))))
    for restore in ("/continue_generation", "/resume_memory_occupation"):
        assert HTTP.post(server.url + restore, json={}, timeout=60).status_code == 200
    _still_serving(server, reference)


@pytest.mark.parametrize("raw", RAW_BODIES, ids=[str(i) for i in range(len(RAW_BODIES))])
@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/pause_generation"])
def test_fuzz_raw_bodies(server: ServerProcess, reference: list[int], path: str,
                         raw: bytes) -> None:
    _send(server, path, raw)
    HTTP.post(server.url + "/continue_generation", timeout=60)
    _still_serving(server, reference)


# ---- the Engine path ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tm(tiny_model_dir: Callable[..., Path]) -> TokenizerManager:
    info = {"context_length": 512, "vocab_size": 512, "max_req_input_len": 500}
    args = ServerArgs(model_path=str(tiny_model_dir("llama")), max_request_batch_size=64)
    return TokenizerManager(args, PortArgs.init_new(), info)


ENGINE_KEYS = ["prompt", "input_ids", "rid", "return_logprob", "logprob_start_len",
               "top_logprobs_num", "stream", "return_entropy", "entropy_mode", "entropy_top_k",
               "sampling_params", "lora_path", "return_routed_experts", "routed_experts_start_len"]


@FUZZ_SETTINGS
@given(kwargs=spoiled({"prompt": "Hello", "sampling_params": {"max_new_tokens": 3}},
                      ENGINE_KEYS + SAMPLING_KEYS, nested="sampling_params"))
def test_fuzz_engine_validation(tm: TokenizerManager, kwargs: dict) -> None:
    """Engine.generate's request goes through the checks the TokenizerManager runs before
    sending; whatever the arguments, only ValueError comes out."""
    args = {"prompt": None, "sampling_params": None, "input_ids": None, "return_logprob": False,
            "logprob_start_len": None, "top_logprobs_num": None, "stream": False, "rid": None,
            "return_entropy": False, "return_text_in_logprobs": False, "entropy_mode": None,
            "entropy_top_k": None, "lora_path": None, "return_routed_experts": False,
            "routed_experts_start_len": 0, "upstream_kwargs": {}, **kwargs}
    COUNTS["engine_calls"] += 1
    try:
        obj = _make_request(args)
        check_generate_input(obj, tm.limits)
        obj.normalize_batch_and_arguments()
        reqs, _ = tm._tokenize_and_validate(obj)
    except ValueError:
        COUNTS["engine_refused"] += 1
        return
    COUNTS["engine_accepted"] += 1
    assert reqs and all(r.input_ids for r in reqs)
