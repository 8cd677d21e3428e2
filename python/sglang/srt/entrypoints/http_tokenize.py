"""Upstream SGLang's tokenizer endpoints: the server's own tokenizer, without generating.

| endpoint | body | reply |
|---|---|---|
| POST /tokenize, /v1/tokenize | ``prompt`` (a string or a list), ``add_special_tokens`` (true), ``model``? | ``{"tokens", "count", "max_model_len"}``: ids and count per prompt (lists for a list) |
| POST /detokenize, /v1/detokenize | ``tokens`` (ids or a list of id lists), ``skip_special_tokens`` (true), ``model``? | ``{"text"}`` (a list for a list) |

The ids are exactly what ``/generate`` gives the model for that text (the same call), so a
client can check a prompt against ``max_model_len`` before submitting it. Bad input is a 400:
an unknown field, an id outside the vocabulary, a text over ``--max-prompt-bytes``, or a
server started with ``--skip-tokenizer-init`` (no tokenizer to use).
"""  # noqa: E501 - the table is documentation

from __future__ import annotations

from typing import Any, cast

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from sglang.srt.entrypoints.openai.serving_base import json_response
from sglang.srt.managers.request_validation import encode_texts
from sglang.srt.managers.tokenizer_manager_protocol import (
    TokenizerManagerProtocol,
    tokenizer_manager_of,
)

router = APIRouter()


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str | list[str]
    add_special_tokens: bool = True
    model: str | None = None  # accepted for OpenAI-style clients; the served model answers


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = True
    model: str | None = None


def _tokenizer(tm: TokenizerManagerProtocol) -> Any:
    if tm.tokenizer is None:
        raise ValueError("this server runs with --skip-tokenizer-init: it has no tokenizer")
    return tm.tokenizer


@router.post("/tokenize")
@router.post("/v1/tokenize")
async def tokenize(body: TokenizeBody, request: Request) -> Response:
    """Token ids and their count for a prompt, or for each prompt of a list."""
    tm = tokenizer_manager_of(request)
    tokenizer = _tokenizer(tm)
    texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    max_bytes = tm.limits.max_prompt_bytes
    for i, text in enumerate(texts):
        if len(text.encode("utf-8", "surrogatepass")) > max_bytes:
            raise ValueError(f"prompt {i} is over --max-prompt-bytes ({max_bytes} bytes)")
    ids = await encode_texts(tokenizer, texts, body.add_special_tokens)
    if isinstance(body.prompt, str):
        return json_response(
            {"tokens": ids[0], "count": len(ids[0]), "max_model_len": tm.context_len}
        )
    return json_response({
        "tokens": ids, "count": [len(x) for x in ids], "max_model_len": tm.context_len,
    })


@router.post("/detokenize")
@router.post("/v1/detokenize")
async def detokenize(body: DetokenizeBody, request: Request) -> Response:
    """The text of a list of ids, or of each list of a list of lists."""
    tm = tokenizer_manager_of(request)
    tokenizer = _tokenizer(tm)
    single = all(isinstance(t, int) for t in body.tokens)  # validation: all ids or all lists
    seqs = [cast(list[int], body.tokens)] if single else cast(list[list[int]], body.tokens)
    vocab = tm.limits.vocab_size
    for seq in filter(None, seqs):
        low, high = min(seq), max(seq)
        if low < 0 or high >= vocab:
            raise ValueError(f"token id {low if low < 0 else high} is out of range [0, {vocab})")
    texts = tokenizer.batch_decode(seqs, skip_special_tokens=body.skip_special_tokens)
    return json_response({"text": texts[0] if single else list(texts)})
