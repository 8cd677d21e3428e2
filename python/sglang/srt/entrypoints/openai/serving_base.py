"""Pieces shared by the native and OpenAI endpoints: SSE framing, error bodies, streaming with
abort-on-disconnect, and the conversion of engine outputs to OpenAI fields."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable, Iterable
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from sglang.srt.entrypoints.openai.protocol import UsageInfo
from sglang.srt.entrypoints.openai.sampling_defaults import resolve_sampling_defaults
from sglang.srt.managers.field_checks import InvalidRequestError
from sglang.srt.managers.tokenizer_manager_protocol import TokenizerManagerProtocol

logger = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "method_not_allowed",
    413: "request_too_large",
    500: "internal_server_error",
    503: "service_unavailable",
}
_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}
_background_tasks: set[asyncio.Task] = set()


def sse_event(payload: Any) -> bytes:
    """One Server-Sent Event carrying ``payload`` as JSON: ``data: {...}\\n\\n``."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


# Upstream SGLang's top-level ``type`` of an OpenAI error by status; others: the status code as
# text, as upstream's HTTPException handler writes it.
_UPSTREAM_ERROR_TYPES = {400: "BadRequestError", 500: "InternalServerError"}


def is_openai_path(path: str | None) -> bool:
    """True for the paths of the OpenAI-compatible endpoints (``/v1/...``)."""
    return path is not None and path.startswith("/v1/")


def error_body(message: str, status: int, param: str | None = None,
               path: str | None = None) -> dict[str, Any]:
    """The JSON error body: ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's shape,
    which the ``openai`` client reads). For a /v1 ``path`` it also has upstream SGLang's
    top-level ``object: "error"``, ``message``, ``type``, ``param`` and ``code``, so clients
    written against either shape find their keys."""
    default_type = "server_error" if status >= 500 else "invalid_request_error"
    err_type = _ERROR_TYPES.get(status, default_type)
    body: dict[str, Any] = {
        "error": {"message": message, "type": err_type, "param": param, "code": status}
    }
    if is_openai_path(path):
        body.update(object="error", message=message,
                    type=_UPSTREAM_ERROR_TYPES.get(status, str(status)), param=param, code=status)
    return body


def json_response(payload: Any, status: int = 200,
                  headers: dict[str, str] | None = None) -> Response:
    """A JSON response; ``payload`` is plain data or a pydantic model."""
    if hasattr(payload, "model_dump"):
        payload = payload.model_dump()
    body = orjson.dumps(payload, default=str, option=orjson.OPT_NON_STR_KEYS)
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def error_response(message: str, status: int, param: str | None = None,
                   headers: dict[str, str] | None = None, path: str | None = None) -> Response:
    """:func:`error_body` as a JSON response; ``path``: the request's (shapes a /v1 body)."""
    return json_response(error_body(message, status, param, path), status, headers)


def status_of(exc: BaseException) -> int:
    """HTTP status for an exception raised while generating: bad input 400, dead engine 503."""
    if isinstance(exc, ValueError):
        return 400
    if isinstance(exc, RuntimeError):
        return 503
    return 500


def stream_response(
    first: Any,
    outputs: AsyncGenerator[Any, None],
    render: Callable[[Any], Iterable[bytes]],
    trailer: Callable[[], Iterable[bytes]] = lambda: (),
) -> StreamingResponse:
    """An SSE response: ``render(first)``, ``render(out)`` for each further output of
    ``outputs``, then ``trailer()`` and ``data: [DONE]``.

    An exception from the engine mid-stream becomes one ``data: {"error": ...}`` event before
    ``[DONE]``. However the stream ends (finished, failed, or cancelled because the client went
    away), ``outputs`` is closed, which aborts its unfinished requests (TokenizerManager
    contract). The close runs as its own task: a cancelled task cannot await.
    """

    async def body() -> AsyncGenerator[bytes, None]:
        try:
            for chunk in render(first):
                yield chunk
            async for out in outputs:
                for chunk in render(out):
                    yield chunk
            for chunk in trailer():
                yield chunk
        except (ValueError, RuntimeError) as e:
            yield sse_event(error_body(str(e), status_of(e)))
        finally:
            _close_in_background(outputs)
        yield SSE_DONE

    return StreamingResponse(body(), media_type="text/event-stream")


def _close_in_background(outputs: AsyncGenerator[Any, None]) -> None:
    task = asyncio.get_running_loop().create_task(outputs.aclose())
    # The loop keeps only weak references to tasks: hold this one until it is done.
    _background_tasks.add(task)
    task.add_done_callback(_background_tasks.discard)


class ClientDisconnected(Exception):
    """The client went away before the first output of its request: there is no one to answer.
    The HTTP error handlers answer it quietly (no traceback, status 499 that no one reads)."""


async def first_output(outputs: AsyncGenerator[Any, None], stream: bool) -> Any:
    """The first output of a generation (the only one unless streaming).

    Errors in the request (ValueError) surface here, before any response header is sent, so
    they become a proper 4xx. A non-stream generator is closed so its cleanup runs now. Raises
    :class:`ClientDisconnected` when the generator ends without an output (the TokenizerManager
    aborted the request because its client disconnected).
    """
    try:
        first = await outputs.__anext__()
    except StopAsyncIteration:
        raise ClientDisconnected("the client disconnected before the first output") from None
    if not stream:
        await outputs.aclose()
    return first


def map_finish_reason(meta_info: dict[str, Any]) -> tuple[str | None, int | str | None]:
    """(OpenAI finish_reason, matched stop token or string) from an output's meta_info."""
    reason = meta_info.get("finish_reason")
    if not reason:
        return None, None
    kind = reason.get("type")
    return _FINISH_REASONS.get(kind, kind), reason.get("matched")


class OpenAIServingBase:
    """Common state of the OpenAI handlers: the TokenizerManager and the metrics hooks.

    Each request is expanded to a batch of ``num_prompts * n`` engine requests; choice ``i``
    belongs to prompt ``i // n``.
    """

    def __init__(self, tokenizer_manager: TokenizerManagerProtocol, metrics: Any) -> None:
        self.tm = tokenizer_manager
        self.metrics = metrics
        # None with a frontend that has no ServerArgs (tests' fakes): every option at its default.
        self.server_args = getattr(tokenizer_manager, "server_args", None)
        self.enable_cache_report = bool(getattr(self.server_args, "enable_cache_report", False))
        self.default_include_usage = bool(
            getattr(self.server_args, "stream_response_default_include_usage", False)
        )

    @property
    def model_name(self) -> str:
        return self.tm.served_model_name

    def check_num_choices(self, n: int, num_prompts: int) -> None:
        """Refuse ``n`` < 1 and ``num_prompts * n`` over --max-request-batch-size, before the
        request is expanded to one engine request per choice."""
        limit = self.tm.limits.max_request_batch_size
        if n < 1 or num_prompts * n > limit:
            raise InvalidRequestError(
                "n", f"must be >= 1 and at most {limit} choices in all (prompts x n, "
                     f"--max-request-batch-size), got n={n} for {num_prompts} prompt(s)")

    def sampling_params(
        self, req: Any, max_new_tokens: int | None, stop: str | list[str] | None,
        model_defaults: dict[str, Any],
    ) -> dict[str, Any]:
        """The engine's ``sampling_params`` dict for an OpenAI request (validated later).
        ``temperature``, ``top_p``, ``top_k``, ``min_p`` and ``repetition_penalty`` left None by
        the request take ``model_defaults``' value, else OpenAI's (sampling_defaults.py)."""
        params: dict[str, Any] = {
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "min_p": req.min_p,
            "repetition_penalty": req.repetition_penalty,
            "stop": stop,
            # None: as many tokens as the context leaves (TokenizerManager contract).
            "max_new_tokens": max_new_tokens,
            "presence_penalty": req.presence_penalty,
            "frequency_penalty": req.frequency_penalty,
            **req.extra_sampling_params(),
        }
        resolve_sampling_defaults(params, model_defaults)
        return params

    def per_choice_params(self, params: dict[str, Any], seed: int | None, n: int,
                          num_prompts: int) -> list[dict[str, Any]]:
        """One params dict per choice. With a seed, copy ``j`` of a prompt samples with
        ``seed + j``, so the ``n`` choices differ but each is reproducible."""
        out = []
        for _ in range(num_prompts):
            for j in range(n):
                p = dict(params)
                if seed is not None:
                    p["sampling_seed"] = seed + j
                out.append(p)
        return out

    @staticmethod
    def lora_path(model: str | None, lora_path: str | None) -> str | None:
        """The LoRA adapter of a request: the part after the first ':' of ``model`` (upstream's
        ``"base-model:adapter"``), else its ``lora_path`` field, else None (the base model)."""
        if isinstance(model, str) and ":" in model:
            return model.split(":", 1)[1] or None
        return lora_path

    @staticmethod
    def rids(rid: str | list[str] | None, num_prompts: int, n: int) -> list[str] | None:
        """Request ids of the ``num_prompts * n`` engine requests, or None (the engine's own).

        A string names the whole request: its engine requests are ``rid`` when there is one,
        else ``rid-0``, ``rid-1``, ... A list (upstream's form) has one id per prompt
        (InvalidRequestError otherwise), each suffixed ``-j`` per choice when ``n > 1``. Either
        way ``/abort_request`` with ``match_prefix`` reaches every choice of an id.
        """
        if rid is None:
            return None
        if isinstance(rid, str):
            count = num_prompts * n
            return [rid] if count == 1 else [f"{rid}-{i}" for i in range(count)]
        if len(rid) != num_prompts:
            raise InvalidRequestError(
                "rid", f"a list of request ids needs one per prompt: got {len(rid)} ids for "
                       f"{num_prompts} prompt(s)")
        return list(rid) if n == 1 else [f"{r}-{j}" for r in rid for j in range(n)]

    def token_text(self, token_id: int, text: str | None) -> str:
        """The text of one token for logprob entries (decoded if the engine did not send it)."""
        if text is not None:
            return text
        if self.tm.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tm.tokenizer.decode([token_id])

    def stream_includes_usage(self, stream_options: Any) -> bool:
        """Whether a stream ends with the usage chunk: the request's
        ``stream_options.include_usage``, or always with --stream-response-default-include-usage."""
        return self.default_include_usage or bool(
            stream_options is not None and stream_options.include_usage
        )

    def usage(self, outputs: list[dict[str, Any]], n: int) -> UsageInfo:
        """Usage of a batch: each prompt counted once (not once per choice), its cached tokens
        too (the first choice's) with --enable-cache-report."""
        firsts = [o["meta_info"] for i, o in enumerate(outputs) if i % n == 0]
        prompt = sum(m["prompt_tokens"] for m in firsts)
        completion = sum(o["meta_info"]["completion_tokens"] for o in outputs)
        cached = sum(m.get("cached_tokens", 0) for m in firsts) if self.enable_cache_report else 0
        return UsageInfo(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
            prompt_tokens_details={"cached_tokens": cached} if cached else None,
        )

    @staticmethod
    def choice_usage(meta_info: dict[str, Any]) -> UsageInfo:
        """Usage of one choice so far, from one of its (cumulative) stream outputs: what
        ``stream_options.continuous_usage_stats`` puts on each of its content chunks."""
        prompt = meta_info.get("prompt_tokens", 0)
        completion = meta_info.get("completion_tokens", 0)
        return UsageInfo(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )

    @staticmethod
    def entropy_slice(meta_info: dict[str, Any], start: int, wanted: bool) -> list[float] | None:
        if not wanted:
            return None
        return list(meta_info.get("output_token_entropy") or [])[start:]

    @staticmethod
    def weight_metadata(meta_info: dict[str, Any]) -> dict[str, Any]:
        """A choice's ``metadata``: the weight version of its last token and the spans."""
        return {
            "weight_version": meta_info.get("weight_version"),
            "weight_versions": meta_info.get("weight_versions", []),
        }

    def generate(self, obj: Any, raw_request: Request) -> AsyncGenerator[Any, None]:
        return self.tm.generate_request(obj, raw_request)


class StreamDelta:
    """What one cumulative stream output adds to its choice."""

    __slots__ = ("index", "text", "token_start", "finish_reason", "matched_stop", "meta_info")

    def __init__(self, index: int, text: str, token_start: int, finish_reason: str | None,
                 matched_stop: int | str | None, meta_info: dict[str, Any]) -> None:
        self.index = index
        self.text = text
        self.token_start = token_start  # first output-token index not yet sent for this choice
        self.finish_reason = finish_reason
        self.matched_stop = matched_stop
        self.meta_info = meta_info


class StreamState:
    """Per-choice progress of a streamed batch whose outputs are cumulative.

    ``advance`` turns each output into the delta since the previous output of its choice and
    records finished choices (``finished``, ``finals``) for abort-on-close and usage.
    """

    def __init__(self, num_choices: int) -> None:
        self.text_len = [0] * num_choices
        self.num_tokens = [0] * num_choices
        self.finals: dict[int, dict[str, Any]] = {}

    def advance(self, out: dict[str, Any]) -> StreamDelta:
        i = out.get("index", 0)
        meta = out["meta_info"]
        full_text = out.get("text", "")
        text = full_text[self.text_len[i]:]
        self.text_len[i] = len(full_text)
        start = self.num_tokens[i]
        self.num_tokens[i] = meta.get("completion_tokens", len(out.get("output_ids", [])))
        finish_reason, matched = map_finish_reason(meta)
        if finish_reason is not None:
            self.finals[i] = out
        return StreamDelta(i, text, start, finish_reason, matched, meta)

    def final_outputs(self) -> list[dict[str, Any]]:
        return [self.finals[i] for i in sorted(self.finals)]
