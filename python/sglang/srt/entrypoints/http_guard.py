"""What stands between a client and every endpoint: the Host allow-list, API-key auth, the
cross-site request rules, the request-size limit, strict JSON, and the conversion of every
error into ``{"error": {"message", "type", "param", "code"}}`` (docs/security.md).

All the checks live in one ASGI middleware, so endpoints added to the app later are covered
without doing anything. In order, a request is refused with:

* 400 when its ``Host`` header is not allowed (against DNS rebinding; :class:`HostAllowList`);
* 401 without ``Authorization: Bearer <api_key>`` (when a key is set; /health is public);
* 403 when a browser marks it cross-site (an ``Origin`` other than the server itself, or
  ``Sec-Fetch-Site: cross-site``) and it is not a GET/HEAD;
* 405 when a state-changing endpoint (:data:`CONTROL_PATHS`) is called with another method
  than POST (a GET of :data:`GET_CONTROL_PATHS` with ``Content-Type: application/json``, or
  any GET of them with ``--allow-get-control-routes``, is served unless a browser marks it
  cross-site: 403), 415 when its body is sent with another content type than JSON;
* 413 for a body over the limit, 400 for a bad Content-Length;
* 400 when a JSON body is not strict JSON (NaN, Infinity, a number out of the float range, a
  lone surrogate escape); a leading UTF-8 byte order mark is dropped.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import re
import socket
from typing import Any
from urllib.parse import urlsplit

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sglang.srt.entrypoints.openai.serving_base import (
    ClientDisconnected,
    error_response,
    status_of,
)
from sglang.srt.managers.tokenizer_manager import EnginePausedError, QueueFullError

logger = logging.getLogger(__name__)

# Larger request bodies are refused with 413 (a long prompt as token ids is well below this).
MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024
# Retry-After (seconds) of a generate request refused while paused (--paused-admission reject).
PAUSED_RETRY_S = 1
# nginx's status for a client that closed its request before the answer: no one reads it.
CLIENT_CLOSED_REQUEST = 499
# Endpoints reachable without the API key.
_PUBLIC_PATHS = frozenset({"/health"})
# Endpoints that change the server's state: POST only, with a JSON body (or none).
CONTROL_PATHS = frozenset({
    "/flush_cache", "/pause_generation", "/continue_generation", "/abort_request",
    "/update_weights_from_disk", "/update_weights_from_tensor", "/update_weight_version",
    "/release_memory_occupation", "/resume_memory_occupation", "/start_profile",
    "/stop_profile",
})
# The control endpoints that upstream SGLang also answers on GET (--allow-get-control-routes).
GET_CONTROL_PATHS = frozenset({
    "/flush_cache", "/release_memory_occupation", "/resume_memory_occupation",
    "/start_profile", "/stop_profile",
})
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_UTF8_BOM = b"\xef\xbb\xbf"
_WILDCARD_BIND = frozenset({"0.0.0.0", "::", ""})
# How many validation problems one error message lists.
_MAX_LISTED_ERRORS = 3
# Location parts that pydantic adds for the member types of a union (not field names).
_UNION_TAG = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\])$")


class HostAllowList:
    """Which ``Host`` header names the server answers.

    ``spec`` is ``--allowed-hosts``: comma-separated names, ``*.example.com`` for subdomains,
    ``*`` for any. None: ``bind_host``, ``localhost`` and, when bound to every interface, this
    machine's host names. Any IP address is always allowed: DNS rebinding needs a name.
    """

    def __init__(self, spec: str | None, bind_host: str) -> None:
        if spec is not None:
            names = {n.strip().lower().rstrip(".") for n in spec.split(",") if n.strip()}
        else:
            names = {bind_host.lower(), "localhost"}
            if bind_host in _WILDCARD_BIND:
                names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
        self.any_host = "*" in names
        self.suffixes = tuple(n[1:] for n in names if n.startswith("*."))
        self.names = frozenset(n for n in names if not n.startswith("*"))

    def allows(self, host_header: str | None) -> bool:
        """Whether a request with this ``Host`` header (port included) is answered."""
        if self.any_host:
            return True
        if not host_header:
            return False
        name = _host_name(host_header)
        return _is_ip(name) or name in self.names or name.endswith(self.suffixes)


def _host_name(host_header: str) -> str:
    """``Host`` without the port, lower case: ``[::1]:80`` -> ``::1``, ``a.b:80`` -> ``a.b``."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0].rstrip(".") if ":" in host else host.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _is_json_type(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/")
                                           and media.endswith("+json"))


def _cross_site(method: str, headers: dict[str, str], control: bool = False) -> bool:
    """Whether a browser sent this state-changing request (any method but GET/HEAD/OPTIONS,
    or, with ``control``, any method) from another site's page."""
    if method in _SAFE_METHODS and not control:
        return False
    if headers.get("sec-fetch-site", "") in ("cross-site", "same-site"):
        return True
    origin = headers.get("origin")
    if origin is None:
        return False  # not sent by a browser (curl, requests, SDKs)
    return origin == "null" or urlsplit(origin).netloc.lower() != headers.get("host", "").lower()


class GuardMiddleware:
    """ASGI middleware applying the rules of the module docstring, in that order. Every body
    is buffered (up to ``max_body_bytes``) before the app sees it."""

    def __init__(self, app: ASGIApp, api_key: str | None,
                 max_body_bytes: int = MAX_REQUEST_BODY_BYTES,
                 allowed_hosts: HostAllowList | None = None,
                 allow_get_control_routes: bool = False) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.allowed_hosts = allowed_hosts or HostAllowList("*", "")
        self.get_control_paths = GET_CONTROL_PATHS if allow_get_control_routes else frozenset()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = self._refusal(scope, headers)
        if refusal is None:
            buffered, refusal = await self._read_body(headers, receive)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        refusal = _body_refusal(scope["path"], headers, buffered)
        if refusal is not None:
            await refusal(scope, receive, send)
            return

        async def replay() -> Message:
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)

    def _refusal(self, scope: Scope, headers: dict[str, str]) -> Response | None:
        """The response refusing a request by its headers, or None."""
        path, method = scope["path"], scope["method"]
        if not self.allowed_hosts.allows(headers.get("host")):
            return error_response(
                f"Host {headers.get('host')!r} is not allowed; start the server with "
                "--allowed-hosts to answer it", 400)
        if self.api_key and path not in _PUBLIC_PATHS and not self._authorized(headers):
            return error_response("Invalid or missing API key", 401)
        # A GET that declares a JSON body type is served too (slime and miles poll
        # GET /flush_cache so, as upstream answers it): no web page can send that header
        # cross-site without a CORS preflight, which this server never approves.
        get_control = method == "GET" and (
            path in self.get_control_paths
            or (path in GET_CONTROL_PATHS and _is_json_type(headers.get("content-type", "")))
        )
        if _cross_site(method, headers, control=get_control):
            return error_response("Cross-site requests are refused", 403)
        if path in CONTROL_PATHS and method != "POST" and not get_control:
            hint = (" (a GET with Content-Type: application/json is answered too, and any GET "
                    "with --allow-get-control-routes, as upstream SGLang does)"
                    if method == "GET" and path in GET_CONTROL_PATHS else "")
            return error_response(
                f"Method {method} not allowed: {path} changes the server's state and accepts "
                f"only POST{hint}", 405, headers={"Allow": "POST"})
        length = headers.get("content-length")
        if length is not None and not length.isdigit():
            return error_response("Invalid Content-Length header", 400)
        if length is not None and int(length) > self.max_body_bytes:
            return self._too_large()
        return None

    def _authorized(self, headers: dict[str, str]) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), (self.api_key or "").encode()
        )

    async def _read_body(
        self, headers: dict[str, str], receive: Receive
    ) -> tuple[list[Message], Response | None]:
        """The whole body as one message (a leading UTF-8 BOM dropped), or a 413 refusal when
        it grows over the limit. A disconnect while reading is passed on as it came."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return [message], None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return [], self._too_large()
            if not message.get("more_body", False):
                break
        body = b"".join(chunks).removeprefix(_UTF8_BOM)
        return [{"type": "http.request", "body": body, "more_body": False}], None

    def _too_large(self) -> Response:
        return error_response(
            f"Request body too large: the limit is {self.max_body_bytes} bytes", 413
        )


def _body_refusal(path: str, headers: dict[str, str], messages: list[Message]) -> Response | None:
    """415 for a control request whose body is sent with another content type than JSON (a
    form, text/plain); 400 for a JSON body (a JSON content type, or none: parsed as JSON by
    the app) that is not strict JSON."""
    body = messages[0].get("body", b"") if messages else b""
    content_type = headers.get("content-type")
    is_json = content_type is None or _is_json_type(content_type)
    if path in CONTROL_PATHS and body and not is_json:
        return error_response(
            f"{path} takes a JSON body: send it with Content-Type: application/json", 415)
    if not body or not is_json:
        return None
    try:
        orjson.loads(body)
    except orjson.JSONDecodeError as e:
        return error_response(f"Malformed JSON body: {e}", 400, path=path)
    return None


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
    ValueError 400, RuntimeError (engine died) 503, anything else 500; on /v1 paths with
    upstream's top-level keys too (``error_body``). A client that went away before its first
    output gets an empty 499, logged without a traceback."""

    async def on_validation(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        message, param = validation_message(exc)
        return error_response(message, 400, param, path=request.url.path)

    async def on_http(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        return error_response(str(exc.detail), exc.status_code, path=request.url.path)

    async def on_engine_error(request: Request, exc: Exception) -> Response:
        status = status_of(exc)
        if isinstance(exc, (EnginePausedError, QueueFullError)):
            # --paused-admission reject or --max-queued-requests: the client should come back.
            return error_response(str(exc), 503, headers={"Retry-After": str(PAUSED_RETRY_S)},
                                  path=request.url.path)
        if status >= 500:
            logger.error("Request to %s failed: %s", request.url.path, exc)
        return error_response(str(exc) or type(exc).__name__, status,
                              getattr(exc, "param", None), path=request.url.path)

    async def on_disconnect(request: Request, exc: Exception) -> Response:
        logger.info("Client of %s disconnected before its first output", request.url.path)
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("Unexpected error in %s", request.url.path, exc_info=exc)
        return error_response(f"Internal server error: {exc!r}", 500, path=request.url.path)

    handlers: list[tuple[Any, Any]] = [
        (ClientDisconnected, on_disconnect),
        (RequestValidationError, on_validation),
        (StarletteHTTPException, on_http),
        (ValueError, on_engine_error),
        (RuntimeError, on_engine_error),
        (Exception, on_unexpected),
    ]
    for exc_type, handler in handlers:
        app.add_exception_handler(exc_type, handler)
