"""Serve the real SmolLM2-135M-Instruct (prepared by `make model`) and chat with it through the
official openai client, with --enable-cache-report. Skipped when the model has not been
prepared."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from server_test_utils import ServerProcess
from transformers import AutoTokenizer

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(smollm2_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(smollm2_dir, "--max-total-tokens", "4096", "--enable-cache-report") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def test_chat_knows_the_capital_of_france(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0,
                                       max_tokens=48)
    answer = r.choices[0].message.content
    assert "Paris" in answer, answer
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 5


def test_streamed_chat_matches(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0,
                                          max_tokens=48).choices[0].message.content
    stream = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0,
                                            max_tokens=48, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == full


def test_cache_report_counts_cached_prompt_tokens(client: openai.OpenAI) -> None:
    """usage.prompt_tokens_details.cached_tokens: at most the chat template's opening for a
    question not asked before, all but the last prompt token when it is asked again (the last
    one is always computed), absent for a completion prompt not seen before, and once per
    prompt with n choices, as prompt_tokens (the first choice's count)."""
    messages = [{"role": "user", "content": "Name three colours of the rainbow, please."}]
    first = client.chat.completions.create(model="smollm2", messages=messages, temperature=0,
                                           max_tokens=4)
    details = first.usage.prompt_tokens_details
    assert details is None or 0 < details.cached_tokens < first.usage.prompt_tokens - 8
    again = client.chat.completions.create(model="smollm2", messages=messages, temperature=0,
                                           max_tokens=4, stream=True,
                                           stream_options={"include_usage": True})
    usage = [c.usage for c in again if c.usage is not None][-1]
    assert usage.prompt_tokens == first.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    prompt = "A list of large rivers of Europe, from the longest to the shortest:"
    fresh = client.completions.create(model="smollm2", prompt=prompt, max_tokens=4, n=3,
                                      temperature=1.0)
    assert len(fresh.choices) == 3 and fresh.usage.prompt_tokens_details is None
    both = client.completions.create(model="smollm2", prompt=[prompt, prompt + " Volga"],
                                     max_tokens=4, n=2, temperature=1.0)
    single = fresh.usage.prompt_tokens
    assert both.usage.prompt_tokens > 2 * single
    # the first prompt is cached up to its last token, the second up to the first's end
    assert both.usage.prompt_tokens_details.cached_tokens >= 2 * (single - 1)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_call(call: object, names: set[str]) -> dict:
    function = call.function  # type: ignore[attr-defined]
    assert function.name in names and call.id and call.type == "function"  # type: ignore[attr-defined]
    arguments = json.loads(function.arguments)
    required = {"get_weather": {"city", "unit"}, "get_time": {"tz"}}[function.name]
    assert set(arguments) >= required
    return arguments


def test_required_tool_choice_returns_calls(client: openai.OpenAI) -> None:
    """tool_choice "required": the output is constrained to calls of the given tools, parsed
    into message.tool_calls (no --tool-call-parser needed); streamed, the same calls."""
    kw = {"model": "smollm2", "messages": ASK_WEATHER, "temperature": 0, "max_tokens": 96,
          "tools": [WEATHER, CLOCK], "tool_choice": "required"}
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    whole = [_check_call(c, {"get_weather", "get_time"}) for c in choice.message.tool_calls]
    streamed = [c.choices[0].delta.tool_calls for c in client.chat.completions.create(
        **kw, stream=True) if c.choices and c.choices[0].delta.tool_calls]
    calls = [call for delta in streamed for call in delta]
    assert [json.loads(c.function.arguments) for c in calls] == whole


def test_named_tool_choice_calls_that_tool(client: openai.OpenAI) -> None:
    # Greedy: a sampled answer may ramble inside a string past max_tokens (then it is content).
    r = client.chat.completions.create(
        model="smollm2", messages=ASK_WEATHER, temperature=0, max_tokens=96,
        tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_time"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    _check_call(choice.message.tool_calls[0], {"get_time"})
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(
            model="smollm2", messages=ASK_WEATHER, max_tokens=8, tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_time"}})


def test_response_format_json_schema_through_the_client(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"},
                                               "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Describe Paris in JSON."}],
        temperature=0, max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"city", "population"} and isinstance(value["population"], int)


def test_logit_bias_through_the_client(client: openai.OpenAI, smollm2_dir: Path) -> None:
    paris = AutoTokenizer.from_pretrained(smollm2_dir).encode(" Paris")[0]
    kw = {"model": "smollm2", "prompt": "The capital of France is", "temperature": 0,
          "max_tokens": 4}
    assert client.completions.create(**kw).choices[0].text.startswith(" Paris")
    banned = client.completions.create(**kw, logit_bias={str(paris): -100})
    assert "Paris" not in banned.choices[0].text
