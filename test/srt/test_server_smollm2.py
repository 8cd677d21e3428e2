"""Serve the real SmolLM2-135M-Instruct (prepared by `make model`) and chat with it through the
official openai client. Skipped when the model has not been prepared."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from server_test_utils import ServerProcess

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(smollm2_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(smollm2_dir, "--max-total-tokens", "4096") as s:
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
