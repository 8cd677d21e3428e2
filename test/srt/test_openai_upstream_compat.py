"""The OpenAI endpoints behave as upstream SGLang 0.5.10.post1's where the audit found they did
not: response_format on completions, chat sampling defaults from generation_config.json (and
null sampling fields), the error body's top-level keys, continuous usage stats, upstream extras
refused by name, separate/stream_reasoning, roles and tools validation, rid lists, echo of
token prompts, and a client gone before the first output.

The server is the real app (create_app) on a fake TokenizerManager that records the requests it
receives, so each test sees exactly what the OpenAI layer sends the engine.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from conftest import write_tiny_model
from test_compat_chat_parsers import QWEN_OUTPUT, _ScriptedTM
from test_http_app import FakeTokenizer, FakeTokenizerManager, _free_port

from sglang.srt.entrypoints.http_server import create_app
from sglang.srt.entrypoints.openai.sampling_defaults import load_model_sampling_defaults
from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.server_args import ServerArgs

MODEL_DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05,
                  "repetition_penalty": 1.1}
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                   "repetition_penalty": 1.0}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
COMPLETION = {"model": "m", "prompt": "ab", "max_tokens": 3}


class _RecordingTokenizer(FakeTokenizer):
    def __init__(self) -> None:
        self.template_kwargs: dict[str, Any] = {}

    def apply_chat_template(
        self, messages: list[dict], tokenize: bool, add_generation_prompt: bool, **kwargs: Any
    ) -> str:
        self.template_kwargs = kwargs
        return super().apply_chat_template(messages, tokenize, add_generation_prompt, **kwargs)


class _RecordingTM(FakeTokenizerManager):
    """Records every GenerateReqInput; ``silent`` ends without an output, as the real manager
    does when the client disconnected before the first one."""

    def __init__(self, model_path: str = "/models/fake") -> None:
        super().__init__()
        self.model_path = model_path
        self.tokenizer = _RecordingTokenizer()
        self.seen: list[GenerateReqInput] = []
        self.silent = False

    async def generate_request(
        self, obj: GenerateReqInput, request: Any = None
    ) -> AsyncIterator[Any]:
        self.seen.append(obj)
        if self.silent:
            return
        async for out in super().generate_request(obj, request):
            yield out


@contextmanager
def _serve(tm: FakeTokenizerManager) -> Iterator[httpx.Client]:
    port = _free_port()
    app = create_app(tm, ServerArgs(model_path="/models/fake", device="cpu", port=port))
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started:
        assert time.time() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            yield client
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama whose generation_config.json recommends MODEL_DEFAULTS."""
    path = write_tiny_model(tmp_path_factory.mktemp("gen-config-model"))
    config_path = path / "generation_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config_path.write_text(json.dumps({**config, **MODEL_DEFAULTS}))
    return path


@pytest.fixture(scope="module")
def tm(model_dir: Path) -> _RecordingTM:
    return _RecordingTM(str(model_dir))


@pytest.fixture(scope="module")
def http(tm: _RecordingTM) -> Iterator[httpx.Client]:
    with _serve(tm) as client:
        yield client


def _sent_params(tm: _RecordingTM) -> dict[str, Any]:
    params = tm.seen[-1].sampling_params
    first = params[0] if isinstance(params, list) else params
    assert isinstance(first, dict)
    return {name: first[name] for name in OPENAI_DEFAULTS}


def _events(r: httpx.Response) -> list[dict[str, Any]]:
    assert r.status_code == 200, r.text
    payloads = [line[len("data: "):] for line in r.text.split("\n\n") if line]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


# ---- 1. response_format on /v1/completions and chat -------------------------------------------
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TAG = {"type": "structural_tag", "structures": [
    {"begin": "<f>", "schema": SCHEMA, "end": "</f>"}], "triggers": ["<f>"]}


@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION),
                                        ("/v1/chat/completions", CHAT)])
@pytest.mark.parametrize("response_format, grammar", [
    ({"type": "text"}, {}),
    ({"type": "json_object"}, {"json_schema": {"type": "object"}}),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}},
     {"json_schema": SCHEMA}),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, {"json_schema": {"type": "object"}}),
    (TAG, {"structural_tag": TAG}),
])
def test_response_format_becomes_the_grammar(
    http: httpx.Client, tm: _RecordingTM, path: str, body: dict[str, Any],
    response_format: dict[str, Any], grammar: dict[str, Any],
) -> None:
    """As upstream: json_object is any JSON object, json_schema its schema, a structural tag
    the whole object; each reaches the engine as the sampling parameter of that name."""
    r = http.post(path, json={**body, "response_format": response_format})
    assert r.status_code == 200, r.text
    params = tm.seen[-1].sampling_params
    sent = params[0] if isinstance(params, list) else params
    keys = ("json_schema", "regex", "ebnf", "structural_tag")
    assert {k: json.loads(sent[k]) for k in keys if sent.get(k)} == grammar


def test_forced_tool_choice_sends_the_calls_schema(http: httpx.Client, tm: _RecordingTM) -> None:
    """tool_choice "required": an array of one or more calls of any tool; a named function:
    exactly one call of it. Each call is {"name", "parameters"}; the tools' $defs move to the
    root, where their references resolve. "auto" and "none" constrain nothing."""
    point = {"type": "object", "properties": {"x": {"type": "number"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
                 "type": "object", "properties": {"p": {"$ref": "#/$defs/Point"}},
                 "$defs": {"Point": point}}}},
             {"type": "function", "function": {"name": "g"}}]

    def sent_schema(tool_choice: Any) -> Any:
        r = http.post("/v1/chat/completions", json={**CHAT, "tools": tools,
                                                    "tool_choice": tool_choice})
        assert r.status_code == 200, r.text
        text = tm.seen[-1].sampling_params[0].get("json_schema")
        return None if text is None else json.loads(text)

    def call(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
        return {"type": "object", "required": ["name", "parameters"], "properties": {
            "name": {"type": "string", "enum": [name]}, "parameters": parameters}}

    f_params = tools[0]["function"]["parameters"]
    empty = {"type": "object", "properties": {}}
    assert sent_schema("required") == {
        "type": "array", "minItems": 1, "$defs": {"Point": point},
        "items": {"anyOf": [call("f", f_params), call("g", empty)]}}
    assert sent_schema({"type": "function", "function": {"name": "g"}}) == {
        "type": "array", "minItems": 1, "maxItems": 1, "items": call("g", empty)}
    assert sent_schema("auto") is None and sent_schema("none") is None


@pytest.mark.parametrize("response_format", [
    {"type": "xml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": 5},
    {"type": "json_schema", "json_schema": {"schema": [1]}}, {},
])
def test_bad_response_format_is_a_400(http: httpx.Client, response_format: Any) -> None:
    r = http.post("/v1/chat/completions", json={**CHAT, "response_format": response_format})
    assert r.status_code == 400 and "response_format" in r.text, r.text


# ---- 2, 3. sampling defaults from generation_config.json; null accepted on chat ---------------
def test_chat_takes_the_model_sampling_defaults(http: httpx.Client, tm: _RecordingTM) -> None:
    assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert _sent_params(tm) == MODEL_DEFAULTS
    nulls = {name: None for name in MODEL_DEFAULTS}
    assert http.post("/v1/chat/completions", json={**CHAT, **nulls}).status_code == 200
    assert _sent_params(tm) == MODEL_DEFAULTS
    explicit = {"temperature": 0.2, "top_k": 5}
    assert http.post("/v1/chat/completions", json={**CHAT, **explicit}).status_code == 200
    assert _sent_params(tm) == {**MODEL_DEFAULTS, **explicit}


def test_completions_keep_openai_defaults(http: httpx.Client, tm: _RecordingTM) -> None:
    assert http.post("/v1/completions", json=COMPLETION).status_code == 200
    assert _sent_params(tm) == OPENAI_DEFAULTS
    # As upstream, completions' sampling fields are plain numbers: null is a 400.
    r = http.post("/v1/completions", json={**COMPLETION, "temperature": None})
    assert r.status_code == 400 and r.json()["param"] == "temperature"


def test_sampling_defaults_openai_mode_and_bad_files(tmp_path: Path, model_dir: Path) -> None:
    tm = _RecordingTM(str(model_dir))
    tm.server_args = ServerArgs(  # type: ignore[attr-defined]
        model_path=str(model_dir), sampling_defaults="openai")
    assert OpenAIServingChat(tm, None, None).model_sampling_defaults == {}
    tm.server_args = ServerArgs(model_path=str(model_dir))  # type: ignore[attr-defined]
    assert OpenAIServingChat(tm, None, None).model_sampling_defaults == MODEL_DEFAULTS
    with pytest.raises(ValueError, match="sampling.defaults"):
        ServerArgs(model_path=str(model_dir), sampling_defaults="vllm")
    assert load_model_sampling_defaults(str(model_dir)) == MODEL_DEFAULTS
    assert load_model_sampling_defaults(str(tmp_path)) == {}  # no file
    assert load_model_sampling_defaults(str(tmp_path / "model.gguf")) == {}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert load_model_sampling_defaults(str(tmp_path)) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": True, "top_p": "0.9", "top_k": 40.0, "min_p": 0.1, "eos_token_id": 2}))
    assert load_model_sampling_defaults(str(tmp_path)) == {"top_k": 40, "min_p": 0.1}


# ---- 4. error bodies ---------------------------------------------------------------------------
def test_v1_errors_have_upstream_top_level_keys(http: httpx.Client) -> None:
    engine = http.post("/v1/completions", json={**COMPLETION, "prompt": ["a", "b"], "rid": ["x"]})
    validation = http.post("/v1/chat/completions", json={**CHAT, "temperature": "hot"})
    for r, param in ((engine, "rid"), (validation, "temperature")):
        body = r.json()
        assert r.status_code == 400 and body["object"] == "error"
        assert body["type"] == "BadRequestError" and body["code"] == 400
        assert body["param"] == param and body["message"] == body["error"]["message"]
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == 400
    native = http.post("/generate", json={"text": "a", "sampling_params": {"temperature": -1}})
    assert native.status_code == 400 and set(native.json()) == {"error"}


# ---- 5. continuous usage stats -----------------------------------------------------------------
@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION),
                                        ("/v1/chat/completions", CHAT)])
def test_continuous_usage_stats(http: httpx.Client, path: str, body: dict[str, Any]) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = _events(http.post(path, json={**body, "stream": True, "stream_options": options}))
    content = [e for e in events if e["choices"] and (
        e["choices"][0].get("text") or e["choices"][0].get("delta", {}).get("content"))]
    assert [e["usage"]["completion_tokens"] for e in content] == [1, 2, 3]
    prompt = content[0]["usage"]["prompt_tokens"]
    assert prompt > 0 and all(e["usage"]["total_tokens"] == prompt + e["usage"][
        "completion_tokens"] for e in content)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
    plain = _events(http.post(path, json={**body, "stream": True}))
    assert all(e["usage"] is None for e in plain)


@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION),
                                        ("/v1/chat/completions", CHAT)])
def test_stream_response_default_include_usage(path: str, body: dict[str, Any]) -> None:
    """--stream-response-default-include-usage: every stream ends with the usage chunk, asked
    for or not."""
    tm = _RecordingTM()
    tm.server_args = ServerArgs(  # type: ignore[attr-defined]
        model_path="m", device="cpu", stream_response_default_include_usage=True)
    with _serve(tm) as http:
        for extra in ({}, {"stream_options": {"include_usage": False}}):
            events = _events(http.post(path, json={**body, "stream": True, **extra}))
            assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
            assert all(e["usage"] is None for e in events[:-1])


@pytest.mark.parametrize("enabled", [False, True])
def test_cache_report_in_usage(enabled: bool) -> None:
    """--enable-cache-report: usage.prompt_tokens_details.cached_tokens sums the first choice
    of each prompt, as prompt_tokens does; absent without the flag or when nothing was cached."""
    tm = _RecordingTM()
    tm.server_args = ServerArgs(model_path="m", device="cpu", enable_cache_report=enabled)
    chat = OpenAIServingChat(tm, None, None)

    def out(prompt: int, cached: int) -> dict[str, Any]:
        return {"meta_info": {"prompt_tokens": prompt, "completion_tokens": 2,
                              "cached_tokens": cached}}

    usage = chat.usage([out(10, 4), out(10, 9), out(7, 6), out(7, 6)], n=2)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (17, 8, 25)
    assert usage.prompt_tokens_details == ({"cached_tokens": 10} if enabled else None)
    assert chat.usage([out(10, 0), out(10, 9)], n=2).prompt_tokens_details is None


# ---- 6. upstream extras ------------------------------------------------------------------------
REFUSED = [("return_hidden_states", True), ("return_routed_experts", True),
           ("return_cached_tokens_details", True), ("custom_logit_processor", "{}"),
           ("session_params", {"id": "s"}), ("bootstrap_host", "h"), ("bootstrap_room", 3)]
ACCEPTED = {"return_hidden_states": False, "custom_logit_processor": None,
            "session_params": {}, "custom_params": {"k": 1}, "return_routed_experts": False}


@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION),
                                        ("/v1/chat/completions", CHAT)])
def test_upstream_extras_are_refused_when_set(http: httpx.Client, path: str,
                                              body: dict[str, Any]) -> None:
    for name, value in REFUSED:
        r = http.post(path, json={**body, name: value})
        assert r.status_code == 400 and name in r.json()["message"], (name, r.text)
    assert http.post(path, json={**body, **ACCEPTED}).status_code == 200


def test_reasoning_effort_none_turns_thinking_off(http: httpx.Client, tm: _RecordingTM) -> None:
    assert http.post("/v1/chat/completions",
                     json={**CHAT, "reasoning_effort": "none"}).status_code == 200
    assert tm.tokenizer.template_kwargs == {
        "chat_template": None, "continue_final_message": False, "reasoning_effort": "none",
        "thinking": False, "enable_thinking": False}


@pytest.fixture(scope="module")
def reasoning_http() -> Iterator[httpx.Client]:
    with _serve(_ScriptedTM(QWEN_OUTPUT[:5], reasoning_parser="qwen3")) as client:
        yield client


def test_separate_reasoning_false_leaves_it_in_content(reasoning_http: httpx.Client) -> None:
    whole = "".join(QWEN_OUTPUT[:5])
    body = {**CHAT, "max_tokens": None, "separate_reasoning": False}
    message = reasoning_http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert message["message"]["content"] == whole
    assert message["message"]["reasoning_content"] is None
    events = _events(reasoning_http.post("/v1/chat/completions", json={**body, "stream": True}))
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("content") or "" for d in deltas) == whole
    assert not any(d.get("reasoning_content") for d in deltas)


def test_stream_reasoning_false_sends_it_whole(reasoning_http: httpx.Client) -> None:
    body = {**CHAT, "max_tokens": None, "stream": True}
    streamed = _events(reasoning_http.post("/v1/chat/completions", json=body))
    assert len([e for e in streamed if e["choices"][0]["delta"].get("reasoning_content")]) > 1
    events = _events(reasoning_http.post("/v1/chat/completions",
                                         json={**body, "stream_reasoning": False}))
    deltas = [e["choices"][0]["delta"] for e in events]
    reasoning = [d["reasoning_content"] for d in deltas if d.get("reasoning_content")]
    assert reasoning == ["The user wants weather."]
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert deltas[first_content]["reasoning_content"] == "The user wants weather."
    assert "".join(d.get("content") or "" for d in deltas) == "\n\nLet me check."


# ---- 7. roles, tools, rid ----------------------------------------------------------------------
def test_message_roles_and_tools_are_validated(http: httpx.Client) -> None:
    roles = ["system", "developer", "user", "assistant", "tool", "function"]
    messages = [{"role": role, "content": "x"} for role in roles]
    assert http.post("/v1/chat/completions", json={**CHAT, "messages": messages}).status_code == 200
    r = http.post("/v1/chat/completions",
                  json={**CHAT, "messages": [{"role": "robot", "content": "x"}]})
    assert r.status_code == 400 and r.json()["param"] == "messages.0.role"
    for tool in ({"type": "function"}, {"type": "function", "function": {"description": "d"}}):
        r = http.post("/v1/chat/completions", json={**CHAT, "tools": [tool]})
        assert r.status_code == 400 and r.json()["param"] == "tools", r.text
    tool = {"type": "function", "function": {"name": "f"}}
    assert http.post("/v1/chat/completions", json={**CHAT, "tools": [tool]}).status_code == 200


def test_rid_string_or_one_per_prompt(http: httpx.Client, tm: _RecordingTM) -> None:
    body = {**COMPLETION, "prompt": ["ab", "cd"], "max_tokens": 1}
    assert http.post("/v1/completions", json={**body, "rid": ["r1", "r2"]}).status_code == 200
    assert tm.seen[-1].rid == ["r1", "r2"]
    r = http.post("/v1/completions", json={**body, "rid": ["u1", "u2"], "n": 2})
    assert r.status_code == 200 and tm.seen[-1].rid == ["u1-0", "u1-1", "u2-0", "u2-1"]
    r = http.post("/v1/completions", json={**body, "rid": ["only-one"]})
    assert r.status_code == 400 and r.json()["param"] == "rid"
    assert http.post("/v1/chat/completions", json={**CHAT, "rid": ["c1"]}).status_code == 200
    assert tm.seen[-1].rid == ["c1"]
    assert http.post("/v1/chat/completions", json={**CHAT, "rid": "c2"}).status_code == 200
    assert tm.seen[-1].rid == ["c2"]


# ---- 8. echo, disconnects ----------------------------------------------------------------------
def test_echo_of_token_prompts_skips_special_tokens(http: httpx.Client) -> None:
    body = {**COMPLETION, "prompt": [0, 1, 2], "max_tokens": 1, "echo": True}
    text = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert text.startswith("w1 w2 ") and not text.startswith("w0")
    events = _events(http.post("/v1/completions", json={**body, "stream": True}))
    assert events[0]["choices"][0]["text"].startswith("w1 w2 ")


def test_disconnect_before_first_output_is_quiet(caplog: pytest.LogCaptureFixture) -> None:
    tm = _RecordingTM()
    tm.silent = True
    with _serve(tm) as client, caplog.at_level(logging.INFO):
        for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT),
                           ("/generate", {"text": "ab"})):
            assert client.post(path, json=body).status_code == 499
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert any("disconnected" in r.getMessage() for r in caplog.records)
