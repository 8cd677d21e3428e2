"""--reasoning-parser and --tool-call-parser: the parsers alone, and the chat API's
``reasoning_content`` / ``tool_calls`` (whole and streamed) read by the real OpenAI client from
a server whose model output is scripted."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import uvicorn
from test_http_app import FakeTokenizerManager, _free_port

from sglang.srt.entrypoints.http_server import create_app
from sglang.srt.entrypoints.openai.chat_parsing import ChatOutputParser
from sglang.srt.entrypoints.openai.protocol import Function, Tool
from sglang.srt.function_call.function_call_parser import FunctionCallParser, ToolCallItem
from sglang.srt.parser.reasoning_parser import ReasoningParser
from sglang.srt.server_args import ServerArgs

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
QWEN_OUTPUT = ["<th", "ink>The user", " wants weather.</th", "ink>\n\n", "Let me check.",
               "<tool_", "call>\n{\"name\": \"get_weather\", ", "\"arguments\": {\"city\": ",
               "\"Paris\"}}\n</tool_call>"]


def test_reasoning_parser_whole_and_streamed() -> None:
    assert ReasoningParser("qwen3").parse_non_stream("<think>a b</think>\n\nAnswer") == (
        "a b", "Answer")
    assert ReasoningParser("qwen3").parse_non_stream("No thinking") == (None, "No thinking")
    assert ReasoningParser("deepseek-r1").parse_non_stream("a</think>b") == ("a", "b")
    parser = ReasoningParser("qwen3")
    assert parser.detector.think_start_token == "<think>"
    pieces = [parser.parse_stream_chunk(c) for c in ["<th", "ink>x", "y</thi", "nk>z"]]
    assert pieces == [("", ""), ("x", ""), ("y", ""), ("", "z")]
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ReasoningParser("nope")


def test_function_call_parser_formats() -> None:
    tools = [Tool(function=Function(name="get_weather", parameters={}))]
    qwen = FunctionCallParser(tools, "qwen25")
    text = 'Hi<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert qwen.has_tool_call(text)
    content, calls = qwen.parse_non_stream(text)
    assert content == "Hi" and [(c.name, json.loads(c.parameters)) for c in calls] == [
        ("get_weather", {"city": "Paris"})]
    llama = FunctionCallParser([WEATHER], "llama3")
    content, calls = llama.parse_non_stream(
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
        '{"name": "other", "parameters": {}}')
    assert content == "" and [c.name for c in calls] == ["get_weather"]  # unknown tool dropped
    content, calls = llama.parse_non_stream("{not json")
    assert (content, calls) == ("{not json", [])


def _stream(parser: FunctionCallParser, text: str, step: int) -> tuple[str, list[ToolCallItem]]:
    """Feed ``text`` ``step`` characters at a time; the content and every item returned."""
    pieces = [text[i: i + step] for i in range(0, len(text), step)] or [""]
    content, items = "", []
    for i, piece in enumerate(pieces):
        more, new = parser.parse_stream_chunk(piece, final=i == len(pieces) - 1)
        content += more
        items += new
    return content, items


def _calls(items: list[ToolCallItem]) -> list[tuple[str, str]]:
    """``(name, concatenated arguments)`` per call, checking upstream's item order: a call's
    first item has its name and empty arguments, the others no name."""
    calls: dict[int, list[str]] = {}
    for item in items:
        if item.tool_index not in calls:
            assert item.name is not None and item.parameters == ""
            calls[item.tool_index] = [item.name, ""]
        else:
            assert item.name is None
            calls[item.tool_index][1] += item.parameters
    assert list(calls) == list(range(len(calls)))
    return [(name, args) for name, args in calls.values()]


QWEN_TEXT = (
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\\u00eds \\"x\\"",'
    ' "days": [1, 2.50, -3e2, true, null], "opts": {}, "emoji": "\\ud83d\\ude00"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Oslo"}}\n</tool_call>'
)
LLAMA_TEXT = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "n": 10}}; '
              '{"name": "get_weather", "parameters": {}}')


@pytest.mark.parametrize(("fmt", "text"), [("qwen25", QWEN_TEXT), ("llama3", LLAMA_TEXT)])
@pytest.mark.parametrize("step", [1, 2, 5, 13, 10_000])
def test_streamed_calls_match_the_whole_parse(fmt: str, text: str, step: int) -> None:
    content, whole = FunctionCallParser([WEATHER], fmt).parse_non_stream(text)
    assert len(whole) == 2 and all(json.loads(c.parameters) is not None for c in whole)
    streamed_content, items = _stream(FunctionCallParser([WEATHER], fmt), text, step)
    assert streamed_content == content
    assert _calls(items) == [(c.name, c.parameters) for c in whole]


def test_arguments_stream_before_the_call_ends() -> None:
    parser = FunctionCallParser([WEATHER], "qwen25")
    seen: list[tuple[str, list[ToolCallItem]]] = []
    for piece in ["Hi<tool_call>{\"name\": \"get_", "weather\", \"arguments\": ",
                  "{\"city\": \"Pa", "ris\", \"days\": 3", "}}", "</tool_call>"]:
        seen.append(parser.parse_stream_chunk(piece))
    assert seen[0] == ("Hi", [])
    assert seen[1] == ("", [ToolCallItem(0, "get_weather", "")])  # the name, at once
    assert seen[2] == ("", [ToolCallItem(0, None, '{"city": "Pa')])  # then the arguments
    assert seen[3] == ("", [ToolCallItem(0, None, 'ris", "days": ')])
    assert seen[4] == ("", [ToolCallItem(0, None, "3}")])  # a number once delimited
    assert seen[5] == ("", [])  # the end marker adds nothing


def test_forced_calls_are_parsed_from_the_json_array() -> None:
    """tool_choice "required"/named: the answer (after the reasoning) is a JSON array of
    calls, whole or streamed (held until the end); an answer cut short stays content."""
    answer = '[{"name": "f", "parameters": {"x": 1, "s": "é"}}, {"name": "g", "parameters": {}}]'
    text = "<think>hmm</think>" + answer
    whole = ChatOutputParser("qwen3", None, None, forced_calls=True).parse_whole(text)
    assert whole.reasoning == "hmm" and whole.content == ""
    assert [(c.index, c.function.name, json.loads(c.function.arguments))
            for c in whole.tool_calls] == [(0, "f", {"x": 1, "s": "é"}), (1, "g", {})]
    assert whole.tool_calls[0].id != whole.tool_calls[1].id
    streamed = ChatOutputParser("qwen3", "qwen25", None, forced_calls=True)
    pieces = [streamed.feed(text[i:i + 7], final=i + 7 >= len(text))
              for i in range(0, len(text), 7)]
    assert all(not p.tool_calls and not p.content for p in pieces[:-1])
    assert "".join(p.reasoning for p in pieces) == "hmm"
    assert [c.function.name for c in pieces[-1].tool_calls] == ["f", "g"]
    assert streamed.num_tool_calls == 2
    cut = ChatOutputParser(None, None, None, forced_calls=True).parse_whole('[{"name": "f", "par')
    assert cut.content == '[{"name": "f", "par' and not cut.tool_calls


def test_streaming_edge_cases() -> None:
    # Not a call after all: the text comes back as content.
    assert _stream(FunctionCallParser([WEATHER], "qwen25"), "a <tool_call>nope</tool_call> b",
                   1) == ("a <tool_call>nope</tool_call> b", [])
    assert _stream(FunctionCallParser([WEATHER], "llama3"), "{not json} ok", 3) == (
        "{not json} ok", [])
    # A bare "{" is a llama3 call only at the start of the output.
    assert _stream(FunctionCallParser([WEATHER], "llama3"), "Use {x}.", 1) == ("Use {x}.", [])
    # Calls to functions that are not among the tools are dropped, the others numbered on.
    text = ('<tool_call>{"name": "other", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"a": 1}}</tool_call>')
    _, items = _stream(FunctionCallParser([WEATHER], "qwen25"), text, 4)
    assert _calls(items) == [("get_weather", '{"a": 1}')]
    # Keys in another order: the call is sent whole once complete, in the same two steps.
    text = '<tool_call>{"arguments": {"a": 1}, "name": "get_weather"}</tool_call>'
    _, items = _stream(FunctionCallParser([WEATHER], "qwen25"), text, 1)
    assert items == [ToolCallItem(0, "get_weather", ""), ToolCallItem(0, None, '{"a": 1}')]


class _ScriptedTM(FakeTokenizerManager):
    """Writes the pieces of ``script`` as its output tokens, then stops."""

    def __init__(self, script: list[str], **parsers: str) -> None:
        super().__init__()
        self.script = script
        self.server_args = ServerArgs(model_path="/models/fake", device="cpu", **parsers)

    def _step(self, single: Any, ids: list[int], params: Any, out: dict[str, Any]) -> None:
        meta = out["meta_info"]
        k = meta["completion_tokens"]
        out["output_ids"].append(10 + k)
        out["text"] += self.script[k]
        meta["completion_tokens"] += 1
        if k + 1 == len(self.script):
            meta["finish_reason"] = {"type": "stop", "matched": 2}
            self.active.pop(single.rid, None)


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    tm = _ScriptedTM(QWEN_OUTPUT, reasoning_parser="qwen3", tool_call_parser="qwen25")
    port = _free_port()
    app = create_app(tm, ServerArgs(model_path="/models/fake", device="cpu", port=port))
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started:
        assert time.time() < deadline
        time.sleep(0.01)
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    server.should_exit = True
    thread.join(10)


def test_chat_message_has_reasoning_and_tool_calls(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER])
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == "The user wants weather."
    assert choice.message.content == "\n\nLet me check."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # Without tools in the request, the call stays text.
    plain = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "weather?"}])
    assert plain.choices[0].message.tool_calls is None
    assert "<tool_call>" in plain.choices[0].message.content


def test_chat_stream_has_reasoning_and_tool_call_deltas(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER])
    stream = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER],
        stream=True)
    reasoning, content, calls, finish = "", "", [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += delta.reasoning_content or ""
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert reasoning == "The user wants weather."
    assert content == "\n\nLet me check."
    # Incremental, as upstream's: first the id, type and name, then argument fragments.
    first, *rest = calls
    assert first.id and first.id.startswith("call_") and first.type == "function"
    assert first.index == 0 and first.function.name == "get_weather"
    assert first.function.arguments == ""
    # The arguments came in pieces, as the scripted model wrote them.
    assert [c.function.arguments for c in rest] == ['{"city": ', '"Paris"}']
    assert all(c.index == 0 and c.function.name is None and not c.id for c in rest)
    arguments = "".join(c.function.arguments for c in rest)
    (whole_call,) = whole.choices[0].message.tool_calls
    assert arguments == whole_call.function.arguments == '{"city": "Paris"}'
    assert finish == "tool_calls"
