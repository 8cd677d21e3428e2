"""Drop-in compatibility with upstream SGLang's HTTP API: the shapes and refusals a user of
upstream SGLang relies on, checked against a real server on a tiny model."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_test_utils import ServerProcess

from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat

GREEDY = {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Callable[..., Path]) -> Iterator[ServerProcess]:
    # A 512-token context: the budget test below fills it with a short prompt.
    model = tiny_model_dir("llama", max_position_embeddings=512)
    with ServerProcess(model, "--skip-server-warmup") as srv:
        yield srv


def _post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def _error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    return response.json()["error"]["message"]


def test_single_prompt_with_per_prompt_lists(server: ServerProcess) -> None:
    # Upstream accepts one-entry lists for a single prompt; more entries are a 400, not a 500.
    out = _post(server, "/generate", {"text": "hi", "rid": ["only"], "sampling_params": [GREEDY]})
    assert out.status_code == 200, out.text
    assert out.json()["meta_info"]["id"] == "only"
    assert out.json()["meta_info"]["completion_tokens"] == 3
    assert "'rid' has 2 entries" in _error(
        _post(server, "/generate", {"text": "hi", "rid": ["a", "b"]}), 400)
    assert "'sampling_params' has 2 entries" in _error(
        _post(server, "/generate", {"text": "hi", "sampling_params": [GREEDY, GREEDY]}), 400)
    assert "sampling_params" in _error(
        _post(server, "/generate", {"text": ["a", "b"], "sampling_params": [GREEDY, 3]}), 400)
    # The server keeps serving.
    assert _post(server, "/generate", {"text": "hi", "sampling_params": GREEDY}).status_code == 200


def test_features_we_lack_are_refused_not_ignored(server: ServerProcess) -> None:
    body = {"text": "hi", "sampling_params": GREEDY, "token_ids_logprob": [1, 2]}
    assert "token_ids_logprob" in _error(_post(server, "/generate", body), 400)
    # Unset (null) upstream fields are accepted, as upstream clients send them.
    body = {"text": "hi", "sampling_params": GREEDY, "image_data": None, "lora_path": None,
            "return_hidden_states": False, "routed_dp_rank": 0, "priority": 1,
            "custom_labels": {"team": "rl"}}
    assert _post(server, "/generate", body).status_code == 200
    for field, value in [("image_data", "a.png"), ("return_hidden_states", True),
                         ("custom_logit_processor", "x"), ("return_bytes", True)]:
        assert field in _error(_post(server, "/generate", {**body, field: value}), 400)
    # Constrained decoding and logit bias: null accepted; a bad one is a 400 naming it.
    nulls = {k: None for k in ("json_schema", "regex", "ebnf", "structural_tag", "logit_bias")}
    ok = _post(server, "/generate", {"text": "hi", "sampling_params": {
        **GREEDY, **nulls, "custom_params": {"return_top_p_token_ids": True}}})
    assert ok.status_code == 200, ok.text
    for key, value in [("json_schema", '{"type": objec'), ("regex", "a+("),
                       ("ebnf", "root ::="), ("structural_tag", "[]"),
                       ("logit_bias", {"5": "x"}), ("logit_bias", {"999999": 1.0})]:
        body = {"text": "hi", "sampling_params": {**GREEDY, key: value}}
        assert key in _error(_post(server, "/generate", body), 400)
    body = {"text": "hi", "sampling_params": {**GREEDY, "custom_params": "x"}}
    assert "custom_params" in _error(_post(server, "/generate", body), 400)
    assert "bogus" in _error(_post(server, "/generate", {
        "text": "hi", "sampling_params": {**GREEDY, "bogus": None}}), 400)


def test_upstream_request_conveniences(server: ServerProcess) -> None:
    """Upstream's nullable fields take null as the default; a batch's single rid is numbered
    per prompt; PUT works as POST; stream_interval sets a stream's chunk size."""
    body = {"input_ids": [5, 6, 7], "sampling_params": GREEDY, "return_logprob": None,
            "logprob_start_len": None, "top_logprobs_num": None}
    out = _post(server, "/generate", body)
    assert out.status_code == 200 and "output_token_logprobs" not in out.json()["meta_info"]
    batch = _post(server, "/generate", {"text": ["a", "b", "c"], "rid": "job",
                                        "sampling_params": GREEDY}).json()
    assert [o["meta_info"]["id"] for o in batch] == ["job_0", "job_1", "job_2"]
    put = httpx.put(server.url + "/generate", json=body, timeout=60)
    assert put.status_code == 200 and put.json()["output_ids"] == out.json()["output_ids"]
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    for interval, sizes in [(2, [1, 3, 5, 6]), (3, [1, 4, 6])]:
        stream = _post(server, "/generate", {"input_ids": [5, 6, 7], "stream": True,
                                             "sampling_params": {**params,
                                                                 "stream_interval": interval}})
        events = [json.loads(line[6:]) for line in stream.text.splitlines()
                  if line.startswith("data: {")]
        counts = [len(e["output_ids"]) for e in events]
        # The scheduler sends at these counts; a slow reader may get several in one event.
        assert set(counts) <= set(sizes) and counts[-1] == 6 and counts == sorted(counts)


@pytest.mark.parametrize("start", [None, -1, 4])
def test_default_input_logprobs_are_empty_as_upstream(
    server: ServerProcess, start: int | None
) -> None:
    """Upstream 0.5.10: without logprob_start_len (or -1, or the prompt's length) a request
    gets no prompt entries, only output logprobs."""
    ids = [5, 6, 7, 8]
    body = {"input_ids": ids, "sampling_params": GREEDY, "return_logprob": True,
            "top_logprobs_num": 2, "return_text_in_logprobs": True}
    if start is not None:
        body["logprob_start_len"] = start
    out = _post(server, "/generate", body).json()["meta_info"]
    assert out["input_token_logprobs"] == [] and out["input_top_logprobs"] == []
    assert len(out["output_token_logprobs"]) == len(out["output_top_logprobs"]) == 3
    too_far = {**body, "logprob_start_len": len(ids) + 1}
    assert "logprob_start_len" in _error(_post(server, "/generate", too_far), 400)


@pytest.mark.parametrize("start", [0, 2, 3])
def test_first_prompt_position_has_none_top_logprobs(server: ServerProcess, start: int) -> None:
    """As upstream: one entry per prompt token from ``logprob_start_len``; the first one's
    logprob is not computed (None), whatever the start."""
    ids = [5, 6, 7, 8]
    out = _post(server, "/generate", {
        "input_ids": ids, "sampling_params": GREEDY, "return_logprob": True,
        "logprob_start_len": start, "top_logprobs_num": 2,
    }).json()["meta_info"]
    assert [tid for _, tid, _ in out["input_token_logprobs"]] == ids[start:]
    assert out["input_token_logprobs"][0][0] is None
    assert all(isinstance(lp, float) for lp, _, _ in out["input_token_logprobs"][1:])
    tops = out["input_top_logprobs"]
    assert len(tops) == len(ids) - start
    assert tops[0] is None  # upstream: None, not an empty list
    assert all(len(top) == 2 for top in tops[1:])


def test_completions_echo_with_logprobs(server: ServerProcess) -> None:
    body = {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 1,
            "ignore_eos": True}
    choice = _post(server, "/v1/completions", body).json()["choices"][0]
    logprobs = choice["logprobs"]
    # Prompt tokens first (the first has no logprob), then the two generated ones.
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 3 + 2
    assert logprobs["token_logprobs"][0] is None
    assert all(isinstance(lp, float) for lp in logprobs["token_logprobs"][1:])
    assert logprobs["top_logprobs"][0] is None
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
    # Streamed: the same entries, split over the chunks.
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    streamed: list[float | None] = []
    for event in events[:-1]:
        streamed += json.loads(event)["choices"][0]["logprobs"]["token_logprobs"]
    assert streamed == logprobs["token_logprobs"]


@pytest.mark.parametrize(("body", "needle"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "not among the tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
      "tool_choice": "required", "regex": "a+"}, "cannot be combined"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 5}}],
      "tool_choice": "required"}, "parameters must be a JSON Schema object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$defs": 5}}}],
      "tool_choice": "required"}, "$defs must be an object"),
    ({"regex": "[ab]+", "response_format": {"type": "json_object"}}, "at most one of"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
     "json_schema"),
])
def test_chat_structured_output_refusals(server: ServerProcess, body: dict,
                                         needle: str) -> None:
    request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body}
    assert needle in _error(_post(server, "/v1/chat/completions", request), 400)


def test_chat_plain_response_format_and_tools_are_served(server: ServerProcess) -> None:
    request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
               "ignore_eos": True, "response_format": {"type": "text"},
               "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}
    out = _post(server, "/v1/chat/completions", request)
    assert out.status_code == 200, out.text
    assert out.json()["usage"]["completion_tokens"] == 2


def test_constraints_and_logit_bias_are_served(server: ServerProcess) -> None:
    """Over HTTP on the tiny random model: each output is what its grammar allows, and a
    large logit_bias decides a greedy token, on /generate and both OpenAI endpoints."""
    for stream in (False, True):
        body = {"text": "hi", "stream": stream, "sampling_params": {
            "temperature": 1.0, "max_new_tokens": 12, "regex": "[ab]{3}-[0-9]{2}"}}
        r = _post(server, "/generate", body)
        assert r.status_code == 200, r.text
        last = json.loads(r.text.split("data: ")[-2]) if stream else r.json()
        assert re.fullmatch("[ab]{3}-[0-9]{2}", last["text"]), last["text"]
    body = {"prompt": "hi", "max_tokens": 6, "temperature": 1.0, "ebnf": 'root ::= "x" | "yy"'}
    for choice in _post(server, "/v1/completions", {**body, "n": 3}).json()["choices"]:
        assert choice["text"] in ("x", "yy") and choice["finish_reason"] == "stop"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
            "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {
                "name": "n", "schema": {"enum": [1, 22, 333]}}}}
    r = _post(server, "/v1/chat/completions", chat)
    assert r.status_code == 200, r.text
    assert json.loads(r.json()["choices"][0]["message"]["content"]) in (1, 22, 333)
    greedy = {"prompt": "hi", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    r = _post(server, "/generate", {"text": "hi", "sampling_params": {
        "temperature": 0, "max_new_tokens": 3, "ignore_eos": True, "logit_bias": {"77": 50}}})
    assert r.json()["output_ids"] == [77, 77, 77]
    r = _post(server, "/v1/completions", {**greedy, "logit_bias": {"77": 50}, "logprobs": 0})
    assert r.status_code == 200, r.text
    # An empty logit_bias (what some clients send) changes nothing and is accepted.
    assert _post(server, "/v1/completions", {**greedy, "logit_bias": {}}).status_code == 200


def test_tools_reach_the_chat_template() -> None:
    class RecordingTokenizer:
        kwargs: dict[str, Any] = {}

        def apply_chat_template(self, messages: list, **kwargs: Any) -> str:
            RecordingTokenizer.kwargs = kwargs
            return "prompt"

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [1, 2]

    class TM:
        tokenizer = RecordingTokenizer()
        model_path = "no-such-model"  # no generation_config.json: OpenAI's sampling defaults

    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    chat = OpenAIServingChat(TM(), None, None)
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=tools)
    assert chat.render_prompt(req) == [1, 2]
    assert RecordingTokenizer.kwargs["tools"] == tools
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=tools,
                                tool_choice="none")
    chat.render_prompt(req)
    assert "tools" not in RecordingTokenizer.kwargs


def test_budget_past_the_context_is_refused(server: ServerProcess) -> None:
    # Upstream refuses an explicit max_new_tokens that does not fit the context (512 here).
    body = {"input_ids": [5] * 10, "sampling_params": {"max_new_tokens": 600}}
    message = _error(_post(server, "/generate", body), 400)
    assert "exceeds the model's maximum context length of 512 tokens" in message
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 600}
    assert "maximum context length" in _error(_post(server, "/v1/chat/completions", chat), 400)
    # Without an explicit budget the default is used (clamped to the context when needed).
    out = _post(server, "/generate", {"input_ids": [5] * 500, "sampling_params": {
        "temperature": 0, "ignore_eos": True}})
    assert out.status_code == 200, out.text
    assert out.json()["meta_info"]["completion_tokens"] == 12


def test_removed_weight_version_routes_say_where_it_went(server: ServerProcess) -> None:
    for path in ("/get_weight_version", "/weight_version"):
        response = httpx.get(server.url + path, timeout=30)
        assert "/model_info" in _error(response, 404)


def test_start_and_stop_profile(server: ServerProcess, tmp_path: Path) -> None:
    """Upstream's profiling endpoints: a profile of N steps stops by itself and writes one
    trace per rank; stop writes a running one; refusals are 400s naming the reason."""
    json_get = {"Content-Type": "application/json"}
    gen = {"input_ids": [5, 6, 7], "sampling_params": {**GREEDY, "max_new_tokens": 4}}
    auto = tmp_path / "auto"
    r = _post(server, "/start_profile", {"output_dir": str(auto), "num_steps": 2})
    assert r.status_code == 200 and r.text == "Start profiling.\n"
    assert _post(server, "/generate", gen).status_code == 200
    assert len(list(auto.glob("*.trace.json.gz"))) == 1  # written after its 2 steps
    assert "not in progress" in _error(_post(server, "/stop_profile", {}), 400)
    manual = tmp_path / "manual"
    assert _post(server, "/start_profile", {"output_dir": str(manual),
                                            "activities": ["CPU"]}).status_code == 200
    assert "already in progress" in _error(_post(server, "/start_profile", {}), 400)
    assert _post(server, "/generate", gen).status_code == 200
    r = httpx.get(server.url + "/stop_profile", headers=json_get, timeout=60)
    assert r.status_code == 200 and str(manual) in r.text
    assert len(list(manual.glob("*.trace.json.gz"))) == 1
    for body, reason in [({"profile_by_stage": True}, "profile_by_stage"),
                         ({"activities": ["MEM"]}, "activities"), ({"num_steps": 0}, "num_steps")]:
        assert reason in _error(_post(server, "/start_profile", body), 400)
    assert httpx.get(server.url + "/start_profile", timeout=30).status_code == 405


@pytest.fixture(scope="module")
def truncating_server(tiny_model_dir: Callable[..., Path]) -> Iterator[ServerProcess]:
    model = tiny_model_dir("llama", max_position_embeddings=512)
    with ServerProcess(model, "--skip-server-warmup", "--allow-auto-truncate") as srv:
        yield srv


def test_auto_truncate_cuts_the_prompt_and_the_budget(
    server: ServerProcess, truncating_server: ServerProcess
) -> None:
    """--allow-auto-truncate (upstream's): what the strict server refuses is served, the prompt
    cut to its first tokens and the budget to what the 512-token context leaves."""
    ids = [5 + i % 300 for i in range(700)]
    long_body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
    assert "longer than the model's context length" in _error(
        _post(server, "/generate", long_body), 400)
    out = _post(truncating_server, "/generate", long_body)
    assert out.status_code == 200, out.text
    meta = out.json()["meta_info"]
    # 511 prompt tokens (the longest prompt that leaves room for a token), then 1 new one.
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (511, 1)
    assert meta["finish_reason"] == {"type": "length", "length": 1}
    # The same as the prompt's first 511 tokens (whose default budget is clamped to 1).
    head = _post(server, "/generate",
                 {"input_ids": ids[:511], "sampling_params": {"temperature": 0}})
    assert head.json()["meta_info"]["completion_tokens"] == 1
    assert out.json()["output_ids"] == head.json()["output_ids"]
    # An explicit budget past the context is lowered, not refused.
    body = {"input_ids": ids[:500], "sampling_params": {**GREEDY, "max_new_tokens": 600}}
    assert "maximum context length" in _error(_post(server, "/generate", body), 400)
    out = _post(truncating_server, "/generate", body)
    assert out.status_code == 200, out.text
    assert out.json()["meta_info"]["completion_tokens"] == 12
    # The OpenAI endpoints take the same rule.
    completion = _post(truncating_server, "/v1/completions",
                       {"prompt": ids, "max_tokens": 600, "temperature": 0})
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["prompt_tokens"] == 511
    assert completion.json()["usage"]["completion_tokens"] == 1
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 600}
    assert _post(truncating_server, "/v1/chat/completions", chat).status_code == 200
    info = httpx.get(truncating_server.url + "/get_server_info", timeout=30).json()
    assert info["allow_auto_truncate"] is True
    # Everything else is checked as before: a bad token id is still a 400.
    assert "out of range" in _error(_post(truncating_server, "/generate", {
        "input_ids": [10**6] * 600, "sampling_params": GREEDY}), 400)
