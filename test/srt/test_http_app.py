"""The HTTP layer against a fake TokenizerManager, served by a real uvicorn in a thread.

These tests pin the behaviour of http_server / http_guard / the OpenAI handlers (framing,
errors, auth, disconnects, metrics) independently of the engine; test_http_server.py repeats
the user-visible checks against the real engine.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from sglang.srt.entrypoints.http_server import create_app
from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
from sglang.srt.managers.io_struct import (
    ContinueGenerationReqInput,
    ContinueGenerationReqOutput,
    DestroyWeightsUpdateGroupReqInput,
    FlushCacheReqOutput,
    GenerateReqInput,
    GetWeightsByNameReqInput,
    GetWeightsByNameReqOutput,
    InitWeightsUpdateGroupReqInput,
    PauseGenerationReqInput,
    PauseGenerationReqOutput,
    ProfileReqOutput,
    ReleaseMemoryOccupationReqInput,
    ReleaseMemoryOccupationReqOutput,
    ResumeMemoryOccupationReqInput,
    ResumeMemoryOccupationReqOutput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightFromDiskReqOutput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightsFromTensorReqOutput,
    UpdateWeightVersionReqInput,
    UpdateWeightVersionReqOutput,
)
from sglang.srt.managers.request_validation import RequestLimits
from sglang.srt.managers.tokenizer_manager import EnginePausedError, TokenizerManager
from sglang.srt.managers.tokenizer_manager_protocol import TokenizerManagerProtocol
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import PortArgs, ServerArgs

VOCAB = 100
KV_TOKENS = 1000


class FakeTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % VOCAB for c in text]

    # Token 0 is the one special token (a BOS).
    SPECIAL_IDS = frozenset({0})

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(f"w{i} " for i in ids if not (skip_special_tokens and i in self.SPECIAL_IDS))

    def apply_chat_template(
        self, messages: list[dict], tokenize: bool, add_generation_prompt: bool, **kwargs: Any
    ) -> str:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant:" if add_generation_prompt else "")


class FakeTokenizerManager:
    """Generates token ``10 + (prompt_len + k) % 50`` at step k; text "w<id> " per token.

    Implements TokenizerManagerProtocol: pause and continue only flip ``is_paused``; weight and
    memory requests are refused (there are no weights), as a scheduler refuses them.
    """

    NO_WEIGHTS = "the fake tokenizer manager serves no weights"

    def __init__(self) -> None:
        self.tokenizer = FakeTokenizer()
        self.served_model_name = "fake-model"
        self.model_path = "/models/fake"
        self.context_len = 64
        self.vocab_size = VOCAB
        self.step_s = 0.001
        self.active: dict[str, int] = {}  # rid -> KV tokens held
        self.aborted: set[str] = set()
        self.closed_unfinished: list[str] = []
        self.fail_with: Exception | None = None
        self.is_paused = False
        self.memory_released = False
        self.limits = RequestLimits(vocab_size=VOCAB, context_len=64, max_req_input_len=63,
                                    entropy_with_logprobs=False)

    def start(self) -> None:
        """Nothing to start: no sockets."""

    def watch_processes(self, procs: list[Any]) -> None:
        """Nothing to watch."""

    async def close(self, reason: str = "") -> None:
        """Nothing to close."""

    async def generate_request(
        self, obj: GenerateReqInput, request: Any = None
    ) -> AsyncIterator[Any]:
        if self.fail_with is not None:
            raise self.fail_with
        obj.normalize_batch_and_arguments()
        singles = [obj] if obj.is_single else [obj[i] for i in range(obj.batch_size)]
        jobs = [self._validate(s) for s in singles]
        outs = [self._new_output(s, ids) for s, ids, _ in jobs]
        try:
            while True:
                await asyncio.sleep(self.step_s)
                for i, (single, ids, params) in enumerate(jobs):
                    if outs[i]["meta_info"]["finish_reason"] is None:
                        self._step(single, ids, params, outs[i])
                        if obj.stream:
                            yield {**outs[i], "index": i} if not obj.is_single else outs[i]
                if all(o["meta_info"]["finish_reason"] for o in outs):
                    break
            if not obj.stream:
                yield outs[0] if obj.is_single else outs
        finally:
            for single in singles:
                if self.active.pop(single.rid, None) is not None:
                    self.closed_unfinished.append(single.rid)

    def _validate(self, single: GenerateReqInput) -> tuple[GenerateReqInput, list[int], Any]:
        ids = self.tokenizer.encode(single.text) if single.text is not None else single.input_ids
        if not ids:
            raise ValueError("The input prompt is empty (0 tokens)")
        if any(not 0 <= t < VOCAB for t in ids):
            raise ValueError(f"Token id out of range [0, {VOCAB})")
        raw = {k: v for k, v in (single.sampling_params or {}).items() if v is not None}
        raw.setdefault("max_new_tokens", 8)
        params = SamplingParams.from_dict(raw)
        if single.rid in self.active:
            raise ValueError(f"Duplicate request id {single.rid!r}")
        self.active[single.rid] = len(ids)
        return single, list(ids), params

    def _new_output(self, single: GenerateReqInput, ids: list[int]) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": single.rid,
            "finish_reason": None,
            "prompt_tokens": len(ids),
            "completion_tokens": 0,
            "cached_tokens": 0,
            "weight_version": "default",
        }
        if single.return_logprob:
            meta["output_token_logprobs"] = []
            if single.top_logprobs_num:
                meta["output_top_logprobs"] = []
        if single.return_entropy:
            meta["output_token_entropy"] = []
        return {"text": "", "output_ids": [], "meta_info": meta}

    def _step(
        self, single: GenerateReqInput, ids: list[int], params: SamplingParams, out: dict[str, Any]
    ) -> None:
        meta = out["meta_info"]
        if single.rid in self.aborted:
            meta["finish_reason"] = {"type": "abort", "message": "Aborted"}
            self.active.pop(single.rid, None)
            return
        token = 10 + (len(ids) + meta["completion_tokens"]) % 50
        text = single.return_text_in_logprobs
        out["output_ids"].append(token)
        out["text"] += self.tokenizer.decode([token])
        meta["completion_tokens"] += 1
        self.active[single.rid] += 1
        if "output_token_logprobs" in meta:
            meta["output_token_logprobs"].append([-0.5, token, f"w{token} " if text else None])
        if "output_top_logprobs" in meta:
            top = [[-0.5, token, f"w{token} "], [-1.5, token + 1, f"w{token + 1} "]]
            meta["output_top_logprobs"].append(top[: single.top_logprobs_num])
        if "output_token_entropy" in meta:
            meta["output_token_entropy"].append(0.25)
        if meta["completion_tokens"] >= params.max_new_tokens:
            meta["finish_reason"] = {"type": "length", "length": params.max_new_tokens}
            self.active.pop(single.rid, None)

    def abort_request(
        self, rid: str = "", abort_all: bool = False, match_prefix: bool = False
    ) -> None:
        self.aborted.update(self.active if abort_all else [rid])

    async def abort_request_async(
        self, rid: str = "", abort_all: bool = False, match_prefix: bool = False
    ) -> int:
        matches = (lambda r: r.startswith(rid)) if match_prefix else (lambda r: r == rid)
        targets = list(self.active) if abort_all else [r for r in self.active if matches(r)]
        self.aborted.update(targets)
        while any(r in self.active for r in targets):
            await asyncio.sleep(0.001)
        return len(targets)

    async def flush_cache(self) -> FlushCacheReqOutput:
        if self.active:
            return FlushCacheReqOutput(success=False, error_msg="requests are running")
        return FlushCacheReqOutput(success=True)

    async def pause_generation(self, obj: PauseGenerationReqInput) -> PauseGenerationReqOutput:
        if obj.mode not in ("abort", "retract", "in_place"):
            return PauseGenerationReqOutput(success=False, message=f"unknown mode {obj.mode!r}")
        self.is_paused = True
        return PauseGenerationReqOutput(success=True, mode=obj.mode, num_running=len(self.active))

    async def continue_generation(
        self, obj: ContinueGenerationReqInput | None = None
    ) -> ContinueGenerationReqOutput:
        was_paused, self.is_paused = self.is_paused, False
        return ContinueGenerationReqOutput(success=True, was_paused=was_paused)

    async def update_weights_from_disk(
        self, obj: UpdateWeightFromDiskReqInput
    ) -> UpdateWeightFromDiskReqOutput:
        return UpdateWeightFromDiskReqOutput(success=False, message=self.NO_WEIGHTS)

    async def update_weights_from_tensor(
        self, obj: UpdateWeightsFromTensorReqInput, request: object = None
    ) -> UpdateWeightsFromTensorReqOutput:
        return UpdateWeightsFromTensorReqOutput(success=False, message=self.NO_WEIGHTS)

    async def init_weights_update_group(
        self, obj: InitWeightsUpdateGroupReqInput, request: object = None
    ) -> tuple[bool, str]:
        return False, self.NO_WEIGHTS

    async def update_weights_from_distributed(
        self, obj: UpdateWeightsFromDistributedReqInput, request: object = None
    ) -> tuple[bool, str]:
        return False, self.NO_WEIGHTS

    async def destroy_weights_update_group(
        self, obj: DestroyWeightsUpdateGroupReqInput, request: object = None
    ) -> tuple[bool, str]:
        return False, self.NO_WEIGHTS

    async def get_weights_by_name(self, obj: GetWeightsByNameReqInput) -> GetWeightsByNameReqOutput:
        return GetWeightsByNameReqOutput(parameter=None, message=self.NO_WEIGHTS)

    async def update_weight_version(
        self, obj: UpdateWeightVersionReqInput
    ) -> UpdateWeightVersionReqOutput:
        return UpdateWeightVersionReqOutput(success=False, message=self.NO_WEIGHTS)

    async def start_profile(self, **kwargs: Any) -> ProfileReqOutput:
        raise RuntimeError(self.NO_WEIGHTS)

    async def stop_profile(self) -> ProfileReqOutput:
        raise RuntimeError(self.NO_WEIGHTS)

    async def release_memory_occupation(
        self, obj: ReleaseMemoryOccupationReqInput
    ) -> ReleaseMemoryOccupationReqOutput:
        return ReleaseMemoryOccupationReqOutput(success=False, message=self.NO_WEIGHTS)

    async def resume_memory_occupation(
        self, obj: ResumeMemoryOccupationReqInput
    ) -> ResumeMemoryOccupationReqOutput:
        return ResumeMemoryOccupationReqOutput(success=False, message=self.NO_WEIGHTS)

    async def get_internal_state(self) -> list[dict[str, Any]]:
        return [
            {
                "available_kv_tokens": KV_TOKENS - sum(self.active.values()),
                "max_total_num_tokens": KV_TOKENS,
                "running_batch_size": len(self.active),
                "waiting_queue_size": 0,
                "weight_version": "default",
            }
        ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    def __init__(self, **args: Any) -> None:
        self.tm = FakeTokenizerManager()
        port = _free_port()
        self.server_args = ServerArgs(
            model_path="/models/fake", port=port, device="cpu", enable_metrics=True, **args
        )
        self.app = create_app(self.tm, self.server_args)
        self.uvicorn = uvicorn.Server(uvicorn.Config(self.app, port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> _Server:
        self.thread.start()
        deadline = time.time() + 10
        while not self.uvicorn.started:
            assert time.time() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def server() -> Iterator[_Server]:
    with _Server() as s:
        yield s


@pytest.fixture(scope="module")
def auth_server() -> Iterator[_Server]:
    with _Server(api_key="sekret") as s:
        yield s


def _sse_events(raw: bytes) -> list[str]:
    """The payloads of an SSE body; asserts the framing (every event is ``data: ...\\n\\n``)."""
    assert raw.endswith(b"\n\n")
    events = raw.decode().split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e[len("data: ") :] for e in events]


# ---- native endpoints --------------------------------------------------------------------------
def test_fake_and_real_managers_implement_the_protocol() -> None:
    assert isinstance(FakeTokenizerManager(), TokenizerManagerProtocol)
    args = ServerArgs(model_path="m", device="cpu", skip_tokenizer_init=True)
    info = {"context_length": 64, "vocab_size": VOCAB, "max_req_input_len": 60}
    real = TokenizerManager(args, PortArgs.init_new(), info)  # not started: no sockets
    assert isinstance(real, TokenizerManagerProtocol)
    assert not isinstance(object(), TokenizerManagerProtocol)


def test_pause_and_continue_endpoints(server: _Server) -> None:
    r = httpx.post(server.url + "/pause_generation", json={"mode": "in_place"})
    assert r.status_code == 200
    assert r.json()["mode"] == "in_place" and r.json()["status"] == "ok"
    assert server.tm.is_paused
    assert httpx.get(server.url + "/health_generate").status_code == 200  # no generation
    r = httpx.post(server.url + "/continue_generation")
    assert r.json() == {
        "message": "Generation continued successfully.", "status": "ok", "was_paused": True,
    }  # fmt: skip
    assert not server.tm.is_paused
    r = httpx.post(server.url + "/pause_generation", json={"mode": "sideways"})
    assert r.status_code == 400 and "unknown mode" in r.json()["error"]["message"]
    assert not server.tm.is_paused


def test_refused_weight_and_memory_requests_are_400(server: _Server) -> None:
    for path, body in [
        ("/update_weights_from_disk", {"model_path": "/elsewhere"}),
        ("/get_weights_by_name", {"name": "lm_head.weight"}),
        ("/update_weight_version", {"new_version": "v2"}),
        ("/release_memory_occupation", {}),
        ("/resume_memory_occupation", {}),
    ]:
        r = httpx.post(server.url + path, json=body)
        assert r.status_code == 400, path
        assert FakeTokenizerManager.NO_WEIGHTS in r.json()["error"]["message"], path
    assert httpx.get(server.url + "/get_model_info").json()["model_path"] == "/models/fake"


def test_health_and_info(server: _Server) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    info = httpx.get(server.url + "/get_model_info").json()
    assert info == {
        "model_path": "/models/fake",
        "tokenizer_path": "/models/fake",
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": None,  # the fake engine sent no ready info
        "architectures": None,
    }
    server_info = httpx.get(server.url + "/get_server_info").json()
    assert server_info["port"] == server.server_args.port
    assert server_info["internal_states"][0]["available_kv_tokens"] == KV_TOKENS
    assert server_info["version"]
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["fake-model"]


def test_health_generate(server: _Server) -> None:
    assert httpx.get(server.url + "/health_generate").status_code == 200
    server.tm.fail_with = RuntimeError("scheduler died: boom")
    try:
        r = httpx.get(server.url + "/health_generate")
        assert r.status_code == 503 and "scheduler died" in r.json()["error"]["message"]
        server.tm.is_paused = True  # paused: a scheduler round trip instead of a generation
        assert httpx.get(server.url + "/health_generate").status_code == 200
    finally:
        server.tm.fail_with = None
        server.tm.is_paused = False


def test_generate_single_and_batch(server: _Server) -> None:
    r = httpx.post(
        server.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3}}
    )
    assert r.status_code == 200
    out = r.json()
    assert out["output_ids"] == [12, 13, 14]
    assert out["text"] == "w12 w13 w14 "
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    r = httpx.post(
        server.url + "/generate",
        json={"input_ids": [[1], [1, 2]], "sampling_params": {"max_new_tokens": 2}},
    )
    assert [o["output_ids"] for o in r.json()] == [[11, 12], [12, 13]]


def test_generate_stream_framing(server: _Server) -> None:
    r = httpx.post(
        server.url + "/generate",
        json={"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 4}},
    )
    assert r.headers["content-type"].startswith("text/event-stream")
    events = _sse_events(r.content)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4]  # cumulative
    assert [c["meta_info"]["finish_reason"] is None for c in chunks] == [True] * 3 + [False]


def test_stream_disconnect_aborts(server: _Server) -> None:
    server.tm.step_s = 0.01
    try:
        body = {
            "text": "hi",
            "stream": True,
            "rid": "gone",
            "sampling_params": {"max_new_tokens": 10_000},
        }
        with httpx.stream("POST", server.url + "/generate", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
        deadline = time.time() + 5
        while "gone" in server.tm.active:
            assert time.time() < deadline, "the request kept running after the disconnect"
            time.sleep(0.01)
        assert "gone" in server.tm.closed_unfinished
    finally:
        server.tm.step_s = 0.001


def test_abort_request_endpoint(server: _Server) -> None:
    server.tm.step_s = 0.01

    def long_request() -> dict:
        return httpx.post(
            server.url + "/generate",
            timeout=30,
            json={"text": "hi", "rid": "victim", "sampling_params": {"max_new_tokens": 10_000}},
        ).json()

    try:
        result: dict = {}
        thread = threading.Thread(target=lambda: result.update(long_request()))
        thread.start()
        while "victim" not in server.tm.active:
            time.sleep(0.01)
        r = httpx.post(server.url + "/abort_request", json={"rid": "victim"})
        assert r.json() == {"success": True, "num_aborted": 1}
        thread.join(10)
        assert result["meta_info"]["finish_reason"]["type"] == "abort"
        # No rid and no abort_all: nothing to abort (upstream answers 200 too; verl sends
        # {"rid": "", "abort_all": false} by default). An empty prefix does not match all.
        for body in ({}, {"rid": "", "abort_all": False}, {"rid": "", "match_prefix": True}):
            r = httpx.post(server.url + "/abort_request", json=body)
            assert r.json() == {"success": True, "num_aborted": 0}
    finally:
        server.tm.step_s = 0.001


def test_flush_cache(server: _Server) -> None:
    r = httpx.post(server.url + "/flush_cache")
    assert r.status_code == 200 and "flushed" in r.text
    # State-changing: GET (an <img> tag on any web page) is refused.
    r = httpx.get(server.url + "/flush_cache")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    server.tm.active["busy"] = 1
    try:
        r = httpx.post(server.url + "/flush_cache")
        assert r.status_code == 400
        assert "requests are running" in r.json()["error"]["message"]
    finally:
        del server.tm.active["busy"]


def test_metrics(server: _Server) -> None:
    httpx.post(server.url + "/generate", json={"text": "hi", "stream": True})
    text = httpx.get(server.url + "/metrics").text
    values = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert values["sglang:num_requests_total"] >= 1
    assert values["sglang:generation_tokens_total"] >= 8
    assert values["sglang:time_to_first_token_seconds_count"] >= 1
    assert values["sglang:inter_token_latency_seconds_count"] >= 1
    assert values["sglang:available_kv_tokens"] == KV_TOKENS


# ---- errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body, status, needle",
    [
        (b'{"text": "hi"', 400, "Malformed JSON"),
        (b'["text"]', 400, "JSON object"),
        (json.dumps({"text": 123}).encode(), 400, "text"),
        (json.dumps({"input_ids": ["a"]}).encode(), 400, "input_ids"),
        (json.dumps({"sampling_params": {}}).encode(), 400, "text"),
        (json.dumps({"text": ""}).encode(), 400, "empty"),
        (json.dumps({"input_ids": []}).encode(), 400, "empty"),
        (
            json.dumps({"text": "a", "sampling_params": {"max_new_tokens": -1}}).encode(),
            400,
            "max_new_tokens",
        ),
        (
            json.dumps({"text": "a", "sampling_params": {"temperature": -1}}).encode(),
            400,
            "temperature",
        ),
        (json.dumps({"text": "a", "sampling_params": {"top_p": 1.5}}).encode(), 400, "top_p"),
        (json.dumps({"text": "a", "sampling_params": {"top_k": 0}}).encode(), 400, "top_k"),
        (json.dumps({"text": "a", "sampling_params": {"bogus": 1}}).encode(), 400, "bogus"),
        (json.dumps({"input_ids": [1, 1000]}).encode(), 400, "out of range"),
        (json.dumps({"text": "a", "lora_id": "x"}).encode(), 400, "lora_id"),
    ],
)
def test_bad_generate_requests(server: _Server, body: bytes, status: int, needle: str) -> None:
    r = httpx.post(
        server.url + "/generate", content=body, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert needle in error["message"] and error["code"] == status
    ok = httpx.post(server.url + "/generate", json={"text": "ok"})
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 8


def test_oversized_bodies(server: _Server) -> None:
    big = b'{"text": "' + b"a" * (33 * 1024 * 1024) + b'"}'
    r = httpx.post(server.url + "/generate", content=big)
    assert r.status_code == 413 and "too large" in r.json()["error"]["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: chunked transfer encoding
        for _ in range(40):
            yield b"a" * (1024 * 1024)

    r = httpx.post(server.url + "/generate", content=chunks())
    assert r.status_code == 413
    assert httpx.post(server.url + "/generate", json={"text": "ok"}).status_code == 200


def test_json_without_content_type_and_unknown_routes(server: _Server) -> None:
    r = httpx.post(server.url + "/generate", content=b'{"text": "hi"}')
    assert r.status_code == 200
    r = httpx.post(
        server.url + "/generate",
        json={"text": "hi", "unknown_key": 1, "return_hidden_states": False},
    )
    assert r.status_code == 200
    r = httpx.get(server.url + "/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    assert httpx.get(server.url + "/generate").status_code == 405


def test_engine_errors_map_to_status(server: _Server) -> None:
    server.tm.fail_with = RuntimeError("scheduler died: boom")
    try:
        r = httpx.post(server.url + "/generate", json={"text": "hi"})
        assert r.status_code == 503 and "scheduler died" in r.json()["error"]["message"]
        r = httpx.post(server.url + "/generate", json={"text": "hi", "stream": True})
        assert r.status_code == 503
        server.tm.fail_with = EnginePausedError("Generation is paused")
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
    finally:
        server.tm.fail_with = None


# ---- auth ----------------------------------------------------------------------------------------
def test_auth(auth_server: _Server) -> None:
    url = auth_server.url
    assert httpx.get(url + "/health").status_code == 200
    for path in ("/get_model_info", "/v1/models", "/metrics", "/flush_cache"):
        r = httpx.get(url + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
    r = httpx.post(
        url + "/generate", json={"text": "hi"}, headers={"Authorization": "Bearer wrong"}
    )
    assert r.status_code == 401
    r = httpx.post(
        url + "/generate", json={"text": "hi"}, headers={"Authorization": "Bearer sekret"}
    )
    assert r.status_code == 200
    assert (
        httpx.get(url + "/get_server_info", headers={"Authorization": "Bearer sekret"}).json()[
            "api_key"
        ]
        != "sekret"
    )
    client = openai.OpenAI(base_url=url + "/v1", api_key="sekret")
    assert client.completions.create(model="m", prompt="x", max_tokens=2).choices[0].text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="bad").models.list()


# ---- OpenAI API ----------------------------------------------------------------------------------
@pytest.fixture
def client(server: _Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none")


def test_openai_completions(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model="fake-model", prompt=["ab", "abc"], max_tokens=3, n=2, logprobs=2, seed=5
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == ["w12 w13 w14 "] * 2 + ["w13 w14 w15 "] * 2
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 12
    lp = r.choices[0].logprobs
    assert lp.tokens == ["w12 ", "w13 ", "w14 "] and lp.token_logprobs == [-0.5] * 3
    assert lp.text_offset == [0, 4, 8]
    assert lp.top_logprobs[0] == {"w12 ": -0.5, "w13 ": -1.5}
    echo = client.completions.create(model="m", prompt=[1, 2], max_tokens=1, echo=True)
    assert echo.choices[0].text == "w1 w2 w12 "


def test_openai_completions_stream(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model="m", prompt="ab", max_tokens=3, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "w12 w13 w14 "
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


def test_openai_chat(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(
        model="m", messages=messages, max_tokens=2, logprobs=True, top_logprobs=1
    )
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert [t.token for t in choice.logprobs.content] == ["w29 ", "w30 "]
    assert [len(t.top_logprobs) for t in choice.logprobs.content] == [1, 1]
    assert r.usage.prompt_tokens == len("user: hi\nassistant:")
    r = client.chat.completions.create(
        model="m", messages=messages, max_completion_tokens=1, n=3, temperature=0
    )
    assert [c.message.content for c in r.choices] == ["w29 "] * 3


def test_openai_chat_stream(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "w29 w30 w31 "
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == len("user: hi\nassistant:") + 3


def test_openai_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], temperature=-1
        )
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="m", messages=[])
    with pytest.raises(openai.BadRequestError, match="empty"):
        client.completions.create(model="m", prompt="")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    assert client.models.retrieve("fake-model").id == "fake-model"


def test_chat_template_rendering(tmp_path: Path, tiny_model_dir: Callable[..., Path]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir("llama"))
    tm = FakeTokenizerManager()
    tm.tokenizer = tokenizer
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    own = create_app(tm, ServerArgs(model_path="m", device="cpu")).state.serving_chat
    assert tokenizer.decode(own.render_prompt(request)) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    template = tmp_path / "template.jinja"
    template.write_text(
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    args = ServerArgs(model_path="m", device="cpu", chat_template=str(template))
    custom = create_app(tm, args).state.serving_chat
    assert tokenizer.decode(custom.render_prompt(request)) == "[user]hi[assistant]"


def test_tokenizer_endpoints_refuse_what_they_cannot_serve(server: _Server) -> None:
    """A text over --max-prompt-bytes and a server without a tokenizer are 400s."""
    limits = server.tm.limits
    r = httpx.post(server.url + "/tokenize",
                   json={"prompt": ["ok", "x" * (limits.max_prompt_bytes + 1)]})
    assert r.status_code == 400 and "prompt 1 is over" in r.json()["error"]["message"]
    tokenizer, server.tm.tokenizer = server.tm.tokenizer, None
    try:
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
            r = httpx.post(server.url + path, json=body)
            assert r.status_code == 400 and "skip-tokenizer-init" in r.json()["error"]["message"]
    finally:
        server.tm.tokenizer = tokenizer


def test_get_control_routes_are_opt_in_and_never_cross_site(server: _Server) -> None:
    r = httpx.get(server.url + "/flush_cache")
    assert r.status_code == 405 and "--allow-get-control-routes" in r.json()["error"]["message"]
    # slime's and miles' start-up poll: a GET declaring a JSON body type, which no web page
    # can send cross-site without a preflight. Served by default; a browser's mark still 403s.
    as_slime = {"Content-Type": "application/json; charset=utf-8"}
    r = httpx.get(server.url + "/flush_cache", headers=as_slime)
    assert r.status_code == 200 and "flushed" in r.text
    r = httpx.get(server.url + "/flush_cache", headers={**as_slime, "Sec-Fetch-Site": "cross-site"})
    assert r.status_code == 403
    assert httpx.get(server.url + "/pause_generation", headers=as_slime).status_code == 405
    assert httpx.get(server.url + "/flush_cache",
                     headers={"Content-Type": "text/plain"}).status_code == 405
    with _Server(allow_get_control_routes=True) as legacy:
        r = httpx.get(legacy.url + "/flush_cache")
        assert r.status_code == 200 and "flushed" in r.text  # slime's flush_cache sends GET
        for path in ("/release_memory_occupation", "/resume_memory_occupation"):
            r = httpx.get(legacy.url + path)  # served: the fake manager refuses, with a 400
            assert r.status_code == 400 and r.json()["message"] == legacy.tm.NO_WEIGHTS, path
        # What an <img> tag on another site sends, old browsers (Origin) and new (Fetch
        # metadata): refused before the endpoint runs.
        legacy.tm.active["busy"] = 1  # a flush that ran would be a 400, not a 403
        try:
            for headers in ({"Sec-Fetch-Site": "cross-site"}, {"Origin": "http://evil.example"}):
                assert httpx.get(legacy.url + "/flush_cache", headers=headers).status_code == 403
        finally:
            del legacy.tm.active["busy"]
        r = httpx.get(legacy.url + "/pause_generation")  # upstream answers it on POST only
        assert r.status_code == 405 and "--allow" not in r.json()["error"]["message"]
        assert not legacy.tm.is_paused
