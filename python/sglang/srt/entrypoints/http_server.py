"""The HTTP server: SGLang's native endpoints and the OpenAI-compatible API (DESIGN §2).

``launch_server`` starts the engine processes, then serves :func:`create_app` with uvicorn
until interrupted, and kills the engine processes on exit. The app reads everything it needs
from ``app.state`` (set once by ``create_app``), so tests can build it around a fake
TokenizerManager. Endpoints are on the module's ``router``; the :class:`GuardMiddleware` (auth,
body limit) wraps all of them, including endpoints added later.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import fields
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict

import sglang
from sglang.srt.entrypoints import replies
from sglang.srt.entrypoints.engine_processes import (
    StartingChildren,
    exit_on_signal,
    kill_engine_processes,
)
from sglang.srt.entrypoints.http_compat import router as compat_router
from sglang.srt.entrypoints.http_guard import (
    GuardMiddleware,
    HostAllowList,
    add_error_handlers,
)
from sglang.srt.entrypoints.http_lora import router as lora_router
from sglang.srt.entrypoints.http_shutdown import GracefulServer
from sglang.srt.entrypoints.http_tokenize import router as tokenize_router
from sglang.srt.entrypoints.http_weights import router as weights_router
from sglang.srt.entrypoints.launch_compat import _GlobalState
from sglang.srt.entrypoints.launch_compat import _launch_subprocesses as _launch_subprocesses
from sglang.srt.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from sglang.srt.entrypoints.openai.serving_base import (
    error_response,
    first_output,
    json_response,
    sse_event,
    stream_response,
)
from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
from sglang.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion
from sglang.srt.managers.io_struct import (
    ContinueGenerationReqInput,
    GenerateReqInput,
    PauseGenerationReqInput,
)
from sglang.srt.managers.tokenizer_manager import ServerStatus
from sglang.srt.managers.tokenizer_manager_protocol import (
    TokenizerManagerProtocol,
    tokenizer_manager_of,
)
from sglang.srt.metrics import NoMetrics, ServerMetrics
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils import configure_logger
from sglang.srt.utils.gc_freeze import freeze_startup_heap, set_gc_threshold

logger = logging.getLogger(__name__)

# /health_generate answers 503 rather than waiting longer than this for its one token.
HEALTH_GENERATE_TIMEOUT_S = 20.0
WARMUP_TIMEOUT_S = 600.0
# How much of a prompt / output --log-requests shows.
_LOG_TEXT_CHARS = 200

router = APIRouter()


# ---------------------------------------------------------------------------------------------
# Request bodies of the native endpoints
# ---------------------------------------------------------------------------------------------
class GenerateRequest(BaseModel):
    """Body of POST /generate: the JSON form of ``GenerateReqInput``.

    Unknown keys are ignored, as SGLang does, except SGLang features we do not have
    (``io_struct.UNSUPPORTED_GENERATE_FIELDS``): those are refused when set, rather than
    silently giving a different result. Upstream's nullable fields take null as the default.
    """

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool | None] | None = False
    logprob_start_len: int | list[int | None] | None = -1
    top_logprobs_num: int | list[int | None] | None = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    return_entropy: bool | list[bool] = False
    lora_path: str | list[str | None] | None = None  # LoRA adapter name(s) (docs/lora.md)

    def to_req_input(self) -> GenerateReqInput:
        """The engine's request. Raises ValueError on an empty prompt, when not exactly one
        of text / input_ids is given, or for a set field of a feature this engine lacks."""
        names = {f.name for f in fields(GenerateReqInput)}
        obj = GenerateReqInput(**{k: v for k, v in self.model_dump().items() if k in names})
        given = obj.text if obj.text is not None else obj.input_ids
        prompts: list[Any] = [given] if obj.is_single else list(given or [])
        if not prompts or any(not p for p in prompts):
            raise ValueError("prompt is empty: give a non-empty 'text' or 'input_ids'")
        return obj


class AbortRequestBody(BaseModel):
    model_config = ConfigDict(strict=True)

    rid: str = ""
    abort_all: bool = False
    match_prefix: bool = False  # abort every rid that starts with ``rid``
    lora_name: str | None = None  # abort every request of this LoRA adapter


class PauseGenerationBody(BaseModel):
    """Body of /pause_generation (see io_struct.PauseGenerationReqInput)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)

    mode: str = "abort"
    clear_cache: bool = False
    timeout_s: float | None = None
    lora_name: str | None = None  # pause only this LoRA adapter (docs/lora.md)


class ContinueGenerationBody(BaseModel):
    model_config = ConfigDict(strict=True)

    lora_name: str | None = None  # continue only this LoRA adapter


# ---------------------------------------------------------------------------------------------
# Request observation: metrics and --log-requests
# ---------------------------------------------------------------------------------------------
class _Tracker:
    def __init__(self, inner: Any, log: bool) -> None:
        self._inner = inner
        self._log = log

    def observe(self, out: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._inner.observe(out)
        if not self._log:
            return
        for item in out if isinstance(out, list) else [out]:
            meta = item.get("meta_info", {})
            if meta.get("finish_reason"):
                logger.info(
                    "Finish: rid=%s finish_reason=%s prompt_tokens=%s completion_tokens=%s "
                    "text=%r", meta.get("id"), meta.get("finish_reason"),
                    meta.get("prompt_tokens"), meta.get("completion_tokens"),
                    item.get("text", "")[:_LOG_TEXT_CHARS],
                )


class RequestObserver:
    """Hands out one tracker per HTTP request; feeds metrics and, with --log-requests, logs."""

    def __init__(self, metrics: ServerMetrics | NoMetrics, log_requests: bool) -> None:
        self.metrics = metrics
        self.log_requests = log_requests

    def log_request(self, endpoint: str, body: Any) -> None:
        if self.log_requests:
            logger.info("Receive %s: %s", endpoint, repr(body)[: 4 * _LOG_TEXT_CHARS])

    def new_request(self, stream: bool) -> _Tracker:
        return _Tracker(self.metrics.new_request(stream), self.log_requests)


# ---------------------------------------------------------------------------------------------
# Native endpoints
# ---------------------------------------------------------------------------------------------
_tm = tokenizer_manager_of


@router.get("/health")
async def health(request: Request) -> Response:
    """200 once the server is warmed up and every engine process is alive; 503 otherwise."""
    state = request.app.state
    if not state.ready:
        return error_response("The server is starting up", 503)
    dead = [p.pid for p in state.processes if not p.is_alive()]
    if dead:
        return error_response(f"Engine process(es) {dead} died", 503)
    if getattr(state.tokenizer_manager, "server_status", None) is ServerStatus.UnHealthy:
        return error_response("The server is marked unhealthy", 503)
    return Response(status_code=200)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """Generate one token end to end; 503 if that fails or takes too long.

    While generation is paused or memory is released nothing would decode, so the check is
    then a round trip to the scheduler (it still serves control requests).
    """
    tm = _tm(request)
    probe: Awaitable[object]
    if tm.is_paused or tm.memory_released:
        probe = tm.get_internal_state()
    else:
        probe = _drain(tm.generate_request(_probe_request(tm, f"HEALTH_CHECK_{uuid.uuid4().hex}")))
    try:
        # On timeout the generation is cancelled, which aborts its request (TM contract).
        await asyncio.wait_for(probe, HEALTH_GENERATE_TIMEOUT_S)
    except asyncio.TimeoutError:
        return error_response("Health check timed out", 503)
    except (ValueError, RuntimeError) as e:
        return error_response(f"Health check failed: {e}", 503)
    return Response(status_code=200)


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(body: GenerateRequest, request: Request) -> Response:
    """Generate for one prompt or a batch; SSE stream of cumulative outputs with ``stream``.
    POST or PUT, as upstream."""
    state = request.app.state
    obj = body.to_req_input()
    state.observer.log_request("/generate", obj)
    tracker = state.observer.new_request(obj.stream)
    outputs = _tm(request).generate_request(obj, request)
    first = await first_output(outputs, obj.stream)
    if not obj.stream:
        tracker.observe(first)
        return json_response(first)

    def render(out: dict[str, Any]) -> list[bytes]:
        tracker.observe(out)
        return [sse_event(out)]

    return stream_response(first, outputs, render)


@router.get("/get_model_info")
async def get_model_info(request: Request) -> Response:
    state = request.app.state
    tokenizer_path = state.server_args.tokenizer_path
    return json_response(
        await replies.model_info(_tm(request), tokenizer_path, state.scheduler_info)
    )


@router.get("/get_weight_version")
@router.get("/weight_version")
async def weight_version() -> Response:
    """Removed upstream before 0.5.10: a 404 that says where the version is now, as upstream."""
    return error_response("Endpoint '/get_weight_version' or '/weight_version' is deprecated. "
                          "Please use '/model_info' instead.", 404)


@router.get("/get_server_info")
async def get_server_info(request: Request) -> Response:
    """Server args (API key redacted), scheduler info, the schedulers' internal states."""
    state = request.app.state
    internal_states = await _tm(request).get_internal_state()
    return json_response(
        replies.server_info(state.server_args.to_dict(), state.scheduler_info, internal_states)
    )


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    """200 with a text body when the cache was flushed, 400 with the reason when refused.
    POST only unless --allow-get-control-routes: a GET could be sent by any web page (the
    guard refuses it; docs/security.md)."""
    result = await _tm(request).flush_cache()
    if result.success:
        return PlainTextResponse("Cache flushed.\n")
    return error_response(f"Cache not flushed: {result.error_msg}", 400)


@router.post("/abort_request")
async def abort_request(body: AbortRequestBody, request: Request) -> Response:
    """Abort ``rid`` (exact match) or everything; replies once the abort took effect."""
    if body.lora_name is not None:
        num = await _tm(request).abort_lora_requests(body.lora_name)  # type: ignore[attr-defined]
        return json_response(replies.abort_reply(num))
    if not body.rid and not body.abort_all:
        return json_response(replies.abort_reply(0))  # nothing named: a no-op, as upstream
    num_aborted = await _tm(request).abort_request_async(
        body.rid, body.abort_all, body.match_prefix
    )
    return json_response(replies.abort_reply(num_aborted))


class StartProfileBody(BaseModel):
    """Body of /start_profile (upstream's ``ProfileReqInput``)."""

    model_config = ConfigDict(strict=True)

    output_dir: str | None = None
    start_step: int | None = None
    num_steps: int | None = None
    activities: list[str] | None = None
    with_stack: bool | None = None
    record_shapes: bool | None = None
    profile_by_stage: bool = False
    merge_profiles: bool = False
    profile_prefix: str | None = None
    profile_stages: list[str] | None = None


@router.api_route("/start_profile", methods=["GET", "POST"])
async def start_profile(request: Request, body: StartProfileBody | None = None) -> Response:
    """Start the torch profiler in every scheduler rank; 400 with the reason when refused.
    POST (a GET only as docs/security.md allows for control routes)."""
    try:
        await _tm(request).start_profile(**(body or StartProfileBody()).model_dump())
    except RuntimeError as e:
        return error_response(str(e), 400)
    return PlainTextResponse("Start profiling.\n")


@router.api_route("/stop_profile", methods=["GET", "POST"])
async def stop_profile(request: Request) -> Response:
    """Stop the profiler and write the traces; 400 when none runs."""
    try:
        out = await _tm(request).stop_profile()
    except RuntimeError as e:
        return error_response(str(e), 400)
    return PlainTextResponse(f"Stop profiling. {out.message}\n")


@router.post("/pause_generation")
async def pause_generation(request: Request, body: PauseGenerationBody | None = None) -> Response:
    """Pause (abort | retract | in_place, or vLLM's keep | wait); 400 for an unknown mode."""
    body = body or PauseGenerationBody()
    out = await _tm(request).pause_generation(PauseGenerationReqInput(**body.model_dump()))
    if not out.success:
        raise ValueError(out.message)
    return json_response(replies.pause_reply(out))


@router.post("/continue_generation")
async def continue_generation(
    request: Request, body: ContinueGenerationBody | None = None
) -> Response:
    lora_name = body.lora_name if body is not None else None
    out = await _tm(request).continue_generation(ContinueGenerationReqInput(lora_name=lora_name))
    return json_response(replies.continue_reply(out))


@router.get("/is_paused")
async def is_paused(request: Request) -> Response:
    return json_response(replies.is_paused_reply(await _tm(request).get_internal_state()))


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = request.app.state
    if not isinstance(state.metrics, ServerMetrics):
        return error_response("Metrics are disabled; start the server with --enable-metrics", 404)
    await state.metrics.refresh(_tm(request), state.scheduler_info.get("max_total_num_tokens"))
    body, content_type = state.metrics.render()
    return Response(body, media_type=content_type)


# ---------------------------------------------------------------------------------------------
# OpenAI-compatible endpoints
# ---------------------------------------------------------------------------------------------
@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    """The served model, then each loaded LoRA adapter (as upstream lists them)."""
    tm = _tm(request)
    return json_response(ModelList(data=[_model_card(tm), *_lora_cards(tm)]))


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> Response:
    card = _model_card(_tm(request))
    if model_id != card.id:
        return error_response(f"The model '{model_id}' does not exist", 404, "model")
    return json_response(card)


@router.post("/v1/completions")
async def openai_completions(body: CompletionRequest, request: Request) -> Response:
    request.app.state.observer.log_request("/v1/completions", body)
    return await request.app.state.serving_completion.handle(body, request)


@router.post("/v1/chat/completions")
async def openai_chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    request.app.state.observer.log_request("/v1/chat/completions", body)
    return await request.app.state.serving_chat.handle(body, request)


def _model_card(tm: TokenizerManagerProtocol) -> ModelCard:
    return ModelCard(id=tm.served_model_name, root=tm.model_path, max_model_len=tm.context_len)


def _lora_cards(tm: TokenizerManagerProtocol) -> list[ModelCard]:
    """A card per loaded LoRA adapter, in load order. The frontend's mirror of the loaded
    adapters (updated by every load / unload reply) is not part of the protocol: frontends
    without LoRA (the test fakes) have none."""
    adapters: dict[str, str] = getattr(tm, "lora_adapters", None) or {}
    return [
        ModelCard(id=name, root=path, parent=tm.served_model_name, max_model_len=None)
        for name, path in adapters.items()
    ]


def _probe_request(tm: TokenizerManagerProtocol, rid: str) -> GenerateReqInput:
    """A one-token greedy request (health check and warm-up); token ids if no tokenizer."""
    params = {"max_new_tokens": 1, "temperature": 0.0}
    if tm.tokenizer is None:
        return GenerateReqInput(input_ids=[0, 1, 2], sampling_params=params, rid=rid,
                                log_metrics=False)
    return GenerateReqInput(text="The capital city of France is", sampling_params=params,
                            rid=rid, log_metrics=False)


# ---------------------------------------------------------------------------------------------
# App and server
# ---------------------------------------------------------------------------------------------
@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Start the TokenizerManager inside uvicorn's loop; announce readiness in the background."""
    state = app.state
    if getattr(state, "tokenizer_manager", None) is None:
        raise RuntimeError("this app serves no engine: call set_global_state() before serving it")
    state.tokenizer_manager.start()
    state.tokenizer_manager.watch_processes(list(state.processes))
    task = None
    if state.uvicorn_server is not None:
        task = asyncio.create_task(_announce_when_ready(app))
    yield
    if task is not None:
        task.cancel()
    await state.tokenizer_manager.close()


async def _announce_when_ready(app: FastAPI) -> None:
    """Wait for the socket to be bound, warm up (unless skipped), then mark the server ready."""
    state = app.state
    server = state.uvicorn_server
    while not server.started:
        await asyncio.sleep(0.05)
    if not state.server_args.skip_server_warmup:
        try:
            await asyncio.wait_for(_warmup(state.tokenizer_manager), WARMUP_TIMEOUT_S)
        except Exception:
            logger.exception("Warm-up generation failed; shutting the server down")
            state.failed = True
            server.should_exit = True
            return
    freeze_startup_heap("HTTP server")
    set_gc_threshold(state.server_args.gc_threshold, "HTTP server")
    state.ready = True
    logger.info("The server is ready at %s", state.server_args.url())


async def _warmup(tokenizer_manager: TokenizerManagerProtocol) -> None:
    await _drain(tokenizer_manager.generate_request(
        _probe_request(tokenizer_manager, f"WARMUP_{uuid.uuid4().hex}")))


async def _drain(outputs: AsyncIterator[Any]) -> None:
    async for _ in outputs:
        pass


def _read_chat_template(path: str | None) -> str | None:
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()


def _fastapi_kwargs() -> dict[str, Any]:
    # Parse JSON bodies sent without a Content-Type (as SGLang always has); only FastAPI
    # versions that check the content type strictly know this option.
    if "strict_content_type" in inspect.signature(FastAPI.__init__).parameters:
        return {"strict_content_type": False}
    return {}


def _new_app() -> FastAPI:
    """An app with every route and error handler, serving no engine yet (see :func:`_attach`)."""
    app = FastAPI(title="SGLang", version=sglang.__version__, lifespan=_lifespan,
                  **_fastapi_kwargs())
    app.include_router(router)
    app.include_router(weights_router)
    app.include_router(lora_router)
    app.include_router(compat_router)
    app.include_router(tokenize_router)
    add_error_handlers(app)
    return app


def _attach(
    app: FastAPI,
    tokenizer_manager: TokenizerManagerProtocol,
    server_args: ServerArgs,
    processes: list[Any] | None,
    scheduler_info: dict[str, Any] | None,
    ready: bool,
) -> FastAPI:
    """Make ``app`` serve ``tokenizer_manager`` (its state and the guard middleware)."""
    metrics = ServerMetrics() if server_args.enable_metrics else NoMetrics()
    observer = RequestObserver(metrics, server_args.log_requests)
    state = app.state
    state.tokenizer_manager = tokenizer_manager
    state.server_args = server_args
    state.processes = list(processes or [])
    state.scheduler_info = dict(scheduler_info or {})
    state.metrics = metrics
    state.observer = observer
    state.ready = ready
    state.failed = False
    state.uvicorn_server = None
    state.serving_completion = OpenAIServingCompletion(tokenizer_manager, observer)
    state.serving_chat = OpenAIServingChat(
        tokenizer_manager, observer, _read_chat_template(server_args.chat_template)
    )
    app.add_middleware(GuardMiddleware, api_key=server_args.api_key,
                       allowed_hosts=HostAllowList(server_args.allowed_hosts, server_args.host),
                       allow_get_control_routes=server_args.allow_get_control_routes)
    return app


def create_app(
    tokenizer_manager: TokenizerManagerProtocol,
    server_args: ServerArgs,
    processes: list[Any] | None = None,
    scheduler_info: dict[str, Any] | None = None,
    ready: bool = True,
) -> FastAPI:
    """The FastAPI app serving ``tokenizer_manager``.

    ``processes`` (objects with ``pid`` and ``is_alive()``) are watched by /health. With
    ``ready=False``, /health answers 503 until the warm-up run by ``launch_server`` is done.
    """
    return _attach(_new_app(), tokenizer_manager, server_args, processes, scheduler_info, ready)


def __getattr__(name: str) -> Any:
    """``Engine``, which upstream 0.5.10's module exports (verl imports it from here), resolved
    on first use."""
    if name == "Engine":
        from sglang.srt.entrypoints.engine import Engine

        return Engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Upstream's module-level app, for launchers that serve it themselves (verl's server mode):
# ``_launch_subprocesses`` starts an engine, ``set_global_state`` attaches it here, and the
# caller runs uvicorn on ``app``. launch_server builds its own app with create_app.
app = _new_app()


def set_global_state(global_state: _GlobalState) -> None:
    """Attach the engine launched by ``_launch_subprocesses`` to the module-level ``app``
    (upstream's name). RuntimeError when an engine is attached already."""
    if getattr(app.state, "tokenizer_manager", None) is not None:
        raise RuntimeError("set_global_state: the module-level app already serves an engine")
    tokenizer_manager = global_state.tokenizer_manager
    _attach(app, tokenizer_manager, tokenizer_manager.server_args,
            tokenizer_manager.watched_processes, global_state.scheduler_info, ready=True)


def launch_server(server_args: ServerArgs, starting: StartingChildren | None = None) -> None:
    """Start the engine processes and serve HTTP until interrupted (blocks).

    ``starting``: the engine's children, already started for ``server_args`` by
    :func:`~sglang.srt.entrypoints.engine_processes.start_engine_children` (None: start them
    here). The engine processes are killed on exit, however the server stops. Raises
    SystemExit(1), after logging why, when the engine fails to start or the warm-up generation
    fails.
    """
    import uvicorn

    from sglang.srt.entrypoints.engine import launch_engine_processes

    configure_logger(server_args.log_level)
    try:
        tokenizer_manager, scheduler_info, processes = launch_engine_processes(
            server_args, starting
        )
    except RuntimeError as e:
        logger.error("The engine failed to start: %s", e)
        raise SystemExit(1) from None
    try:
        app = create_app(tokenizer_manager, server_args, processes, scheduler_info, ready=False)
        config = uvicorn.Config(
            app, host=server_args.host, port=server_args.port,
            log_level=server_args.log_level, access_log=False, timeout_keep_alive=5,
            timeout_graceful_shutdown=5,
        )
        server = GracefulServer(config, tokenizer_manager)
        app.state.uvicorn_server = server
        # uvicorn shuts down gracefully on SIGTERM, then re-raises it under the previous
        # handler; the default one would end the process before the engine is killed below.
        signal.signal(signal.SIGTERM, exit_on_signal)
        server.run()
    finally:
        kill_engine_processes(processes, tokenizer_manager.port_args)
    if app.state.failed:
        raise SystemExit(1)
