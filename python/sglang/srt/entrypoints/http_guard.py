"""What stands between a client and every endpoint: API-key auth, the request-size limit, and
the conversion of every error into ``{"error": {"message", "type", "param", "code"}}``.

Auth and the size limit live in one ASGI middleware, so endpoints added to the app later are
covered without doing anything.
"""

from __future__ import annotations

import hmac
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sglang.srt.entrypoints.openai.serving_base import error_response, status_of
from sglang.srt.managers.tokenizer_manager import EnginePausedError

logger = logging.getLogger(__name__)

# Larger request bodies are refused with 413 (a long prompt as token ids is well below this).
MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024
# Retry-After (seconds) of a generate request refused while paused (--paused-admission reject).
PAUSED_RETRY_S = 1
# Endpoints reachable without the API key.
_PUBLIC_PATHS = frozenset({"/health"})
# How many validation problems one error message lists.
_MAX_LISTED_ERRORS = 3
# Location parts that pydantic adds for the member types of a union (not field names).
_UNION_TAG = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\])$")


class GuardMiddleware:
    """ASGI middleware: 401 without ``Authorization: Bearer <api_key>`` (when a key is set, on
    every path but /health), 413 for a body over ``max_body_bytes``, 400 for a bad
    Content-Length. A chunked body is buffered (up to the limit) before the app sees it."""

    def __init__(self, app: ASGIApp, api_key: str | None,
                 max_body_bytes: int = MAX_REQUEST_BODY_BYTES) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key and scope["path"] not in _PUBLIC_PATHS and not self._authorized(headers):
            await error_response("Invalid or missing API key", 401)(scope, receive, send)
            return
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                await error_response("Invalid Content-Length header", 400)(scope, receive, send)
            elif int(length) > self.max_body_bytes:
                await self._too_large(scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        buffered = await self._read_body(receive)
        if buffered is None:
            await self._too_large(scope, receive, send)
            return

        async def replay() -> Message:
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)

    def _authorized(self, headers: dict[str, str]) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), self.api_key.encode()
        )

    async def _read_body(self, receive: Receive) -> list[Message] | None:
        """The body messages of a request without Content-Length; None when over the limit."""
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                return None
            if not message.get("more_body", False):
                return messages

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(
            f"Request body too large: the limit is {self.max_body_bytes} bytes", 413
        )
        await response(scope, receive, send)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, param) for a request that failed validation; names the offending fields.

    Errors of the alternatives of one union field (pydantic tags them with the member type,
    e.g. ``text.str`` and ``text.list[str]``) are merged into one entry for the field.
    """
    errors = exc.errors()
    if errors and errors[0].get("type") == "json_invalid":
        detail = errors[0].get("ctx", {}).get("error", "")
        return f"Malformed JSON body: {detail}".rstrip(": "), None
    by_param: dict[str, list[str]] = {}
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = ".".join(part for part in loc if not _UNION_TAG.match(part))
        messages = by_param.setdefault(param, [])
        if err.get("msg") not in messages:
            messages.append(err.get("msg", "invalid value"))
    parts = [
        f"{param}: {' or '.join(msgs)}" if param else "the request body must be a JSON object "
        "(sent with Content-Type: application/json)"
        for param, msgs in list(by_param.items())[:_MAX_LISTED_ERRORS]
    ]
    first_param = next(iter(by_param), None) or None
    return "Invalid request: " + "; ".join(parts), first_param


def add_error_handlers(app: FastAPI) -> None:
    """Every error as JSON: validation 400 (field named), HTTP errors with their status,
    ValueError 400, RuntimeError (engine died) 503, anything else 500."""

    async def on_validation(request: Request, exc: Exception) -> Response:
        message, param = validation_message(exc)
        return error_response(message, 400, param)

    async def on_http(request: Request, exc: Exception) -> Response:
        return error_response(str(exc.detail), exc.status_code)

    async def on_engine_error(request: Request, exc: Exception) -> Response:
        status = status_of(exc)
        if isinstance(exc, EnginePausedError):
            # --paused-admission reject: the client should come back after continue.
            return error_response(str(exc), 503, headers={"Retry-After": str(PAUSED_RETRY_S)})
        if status >= 500:
            logger.error("Request to %s failed: %s", request.url.path, exc)
        return error_response(str(exc) or type(exc).__name__, status)

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("Unexpected error in %s", request.url.path, exc_info=exc)
        return error_response(f"Internal server error: {exc!r}", 500)

    handlers: list[tuple[Any, Any]] = [
        (RequestValidationError, on_validation),
        (StarletteHTTPException, on_http),
        (ValueError, on_engine_error),
        (RuntimeError, on_engine_error),
        (Exception, on_unexpected),
    ]
    for exc_type, handler in handlers:
        app.add_exception_handler(exc_type, handler)
