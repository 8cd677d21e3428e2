"""Serve the real SmolLM2-135M-Instruct (prepared by `make model`) and chat with it through the
official openai client, with --enable-cache-report. Skipped when the model has not been
prepared."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from server_test_utils import ServerProcess

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
