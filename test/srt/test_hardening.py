"""Issue 13: no request can break the engine.

Every malformed request of the issue gets a clean 4xx with a JSON error naming the field, and
the engine keeps serving the same greedy tokens; big inputs do not block /health; control
routes refuse cross-site use; a weight path does not tell what exists; SIGTERM leaves no IPC
directory and answers in-flight requests with JSON. The Engine path is checked on a
TokenizerManager without processes (``Engine.generate`` builds the same request).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from engine_test_utils import MAX_NEW, REFERENCE_REQUEST, reference_ids
from server_test_utils import ServerProcess, free_port

from sglang.srt.entrypoints.engine import _make_request
from sglang.srt.managers.detokenizer_manager import DetokenizerManager
from sglang.srt.managers.io_struct import (
    AbortReq,
    BatchTokenIDOutput,
    PauseGenerationReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightVersionReqInput,
)
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.server_args import PortArgs, ServerArgs

GREEDY = REFERENCE_REQUEST
SURROGATE = '"\\ud800"'  # a JSON string holding a lone surrogate


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[..., Path]) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(model_dir, "--max-total-tokens", "4096", "--skip-server-warmup") as s:
        yield s


@pytest.fixture(scope="module")
def reference(server: ServerProcess) -> list[int]:
    return reference_ids(server)


def _raw(
    server: ServerProcess,
    path: str,
    body: str | bytes,
    headers: dict[str, str] | None = None,
    method: str = "POST",
) -> httpx.Response:
    data = body.encode() if isinstance(body, str) else body
    return httpx.request(
        method,
        server.url + path,
        content=data,
        timeout=60,
        headers={"Content-Type": "application/json", **(headers or {})},
    )


def _sp(fields: str) -> str:
    return '{"text": "hi", "sampling_params": {' + fields + "}}"


# (path, raw JSON body, text the error message must contain) for every example of the issue.
ISSUE_CASES = [
    ("/generate", _sp('"skip_special_tokens": "no"'), "skip_special_tokens"),
    ("/generate", _sp('"skip_special_tokens": 1'), "skip_special_tokens"),
    ("/generate", _sp('"skip_special_tokens": [true]'), "skip_special_tokens"),
    ("/generate", _sp('"skip_special_tokens": {}'), "skip_special_tokens"),
    ("/generate", _sp('"spaces_between_special_tokens": []'), "spaces_between_special_tokens"),
    ("/generate", _sp('"temperature": 1' + "0" * 400), "Malformed JSON"),
    ("/generate", '{"text": "hi", "rid": ' + SURROGATE + "}", "Malformed JSON"),
    ("/generate", _sp('"stop": ' + SURROGATE), "Malformed JSON"),
    ("/generate", _sp('"stop": ["a", ' + SURROGATE + "]"), "Malformed JSON"),
    ("/generate", _sp('"frequency_penalty": "1"'), "frequency_penalty"),
    ("/generate", _sp('"presence_penalty": [1]'), "presence_penalty"),
    ("/generate", _sp('"repetition_penalty": {"a": 1}'), "repetition_penalty"),
    ("/generate", _sp('"frequency_penalty": true'), "frequency_penalty"),
    ("/generate", '{"text": ' + SURROGATE + "}", "Malformed JSON"),
    ("/v1/completions", '{"prompt": ' + SURROGATE + "}", "Malformed JSON"),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": ' + SURROGATE + "}]}",
        "Malformed JSON",
    ),
    ("/generate", _sp('"temperature": NaN'), "Malformed JSON"),
    ("/generate", _sp('"temperature": Infinity'), "Malformed JSON"),
    ("/v1/completions", '{"prompt": "hi", "temperature": NaN}', "Malformed JSON"),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}',
        "Malformed JSON",
    ),
    ("/generate", _sp('"ignore_eos": "yes"'), "ignore_eos"),
    ("/generate", _sp('"ignore_eos": 1'), "ignore_eos"),
    ("/generate", _sp('"no_stop_trim": [1]'), "no_stop_trim"),
    ("/generate", '{"input_ids": [true, 1]}', "input_ids"),
    ("/v1/completions", '{"prompt": "hi", "ignore_eos": "true"}', "ignore_eos"),
    ("/v1/completions", '{"prompt": "hi", "repetition_penalty": false}', "repetition_penalty"),
    (
        "/generate",
        '{"text": "hi", "top_logprobs_num": 512, "return_logprob": true, "logprob_start_len": 0}',
        "top_logprobs_num",
    ),
    ("/generate", json.dumps({"text": ["a"] * 10_000}), "max-request-batch-size"),
    ("/generate", _sp('"n": 10000'), "n"),
    ("/generate", _sp('"stop": ' + json.dumps(["x"] * 65)), "stop"),
    ("/generate", _sp('"stop": ' + json.dumps("x" * 513)), "stop"),
    ("/generate", _sp('"temperature": 1e400'), "Malformed JSON"),
    ("/generate", _sp('"sampling_seed": 1' + "0" * 30), "sampling_seed"),
    ("/generate", _sp('"top_k": 1' + "0" * 30), "top_k"),
    ("/generate", '{"text": "hi", "rid": ""}', "rid"),
    ("/generate", '{"text": "hi", "stream": "yes"}', "stream"),
    ("/v1/completions", '{"prompt": "hi", "n": 2147483648}', "--max-request-batch-size"),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "hi"}], "n": 10000000}',
        "--max-request-batch-size",
    ),
    ("/update_weight_version", json.dumps({"new_version": "v" * (8 * 1024 * 1024)}), "new_version"),
    ("/pause_generation", '{"mode": "sideways"}', "mode"),
    ("/pause_generation", '{"mode": "abort", "timeout_s": 1e300}', "timeout_s"),
    ("/abort_request", '{"rid": ' + SURROGATE + "}", "Malformed JSON"),
    ("/update_weights_from_disk", '{"model_path": "/etc"}', "not a loadable checkpoint"),
]


@pytest.mark.parametrize(
    ("path", "body", "needle"), ISSUE_CASES, ids=[f"{i}-{c[0]}" for i, c in enumerate(ISSUE_CASES)]
)
def test_issue_examples_are_refused_and_the_engine_keeps_serving(
    server: ServerProcess, reference: list[int], path: str, body: str, needle: str
) -> None:
    r = _raw(server, path, body)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert needle in error["message"] and error["code"] == 400, error
    assert len(r.content) < 4096  # an error never echoes a huge input
    assert reference_ids(server) == reference
    assert httpx.get(server.url + "/health").status_code == 200


def test_errors_name_the_field_and_rule(server: ServerProcess) -> None:
    r = _raw(server, "/generate", _sp('"frequency_penalty": "1"'))
    error = r.json()["error"]
    assert error["param"] == "sampling_params.frequency_penalty"
    assert error["message"] == ("sampling_params.frequency_penalty: must be a number, got '1'")
    r = _raw(server, "/generate", '{"input_ids": [[1, 2], [3, 600]]}')
    assert r.json()["error"]["param"] == "input_ids[1][1]"


def test_bom_bodies_are_parsed(server: ServerProcess, reference: list[int]) -> None:
    bom = b"\xef\xbb\xbf"
    r = _raw(server, "/generate", bom + json.dumps(GREEDY).encode())
    assert r.status_code == 200 and r.json()["output_ids"] == reference
    start = time.monotonic()
    r = _raw(server, "/generate", bom + b'{"input_ids": [true, 1]}')
    assert r.status_code == 400 and "input_ids" in r.json()["error"]["message"]
    assert time.monotonic() - start < 5


def _max_health_latency(server: ServerProcess, until: threading.Event) -> float:
    worst = 0.0
    while not until.is_set():
        start = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        worst = max(worst, time.monotonic() - start)
        time.sleep(0.05)
    return worst


def test_health_answers_while_a_big_prompt_is_tokenized(server: ServerProcess) -> None:
    # Under --max-prompt-bytes: tokenized (in a worker thread), then refused as too long.
    results: dict[str, Any] = {}
    done = threading.Event()

    def big_request() -> None:
        results["r"] = _raw(server, "/generate", json.dumps({"text": "word " * 1_000_000}))
        done.set()

    thread = threading.Thread(target=big_request)
    thread.start()
    worst = _max_health_latency(server, done)
    thread.join(120)
    assert results["r"].status_code == 400 and "context length" in results["r"].text
    assert worst < 1.0
    # Over the limit (the issue's 25 MB prompt): refused before tokenizing.
    start = time.monotonic()
    r = _raw(server, "/generate", json.dumps({"text": "a" * (25 * 1024 * 1024)}))
    assert r.status_code == 400 and "--max-prompt-bytes" in r.json()["error"]["message"]
    assert time.monotonic() - start < 10


def test_control_routes_refuse_cross_site_use(server: ServerProcess) -> None:
    url = server.url
    for path in ("/flush_cache", "/release_memory_occupation", "/pause_generation"):
        r = httpx.get(url + path)
        assert r.status_code == 405 and r.headers["allow"] == "POST", path
    # An HTML form posts urlencoded (or text/plain) bodies: refused.
    r = httpx.post(url + "/pause_generation", data={"mode": "abort"})
    assert r.status_code == 415
    r = httpx.post(
        url + "/pause_generation",
        content=b'{"mode": "abort"}',
        headers={"Content-Type": "text/plain"},
    )
    assert r.status_code == 415
    # A script on another origin: refused, whatever the content type.
    r = httpx.post(url + "/pause_generation", json={}, headers={"Origin": "http://evil.example"})
    assert r.status_code == 403
    r = httpx.post(url + "/generate", json=GREEDY, headers={"Sec-Fetch-Site": "cross-site"})
    assert r.status_code == 403
    assert _state(server)["engine_paused"] is False
    # DNS rebinding: a foreign name in Host is refused; IP addresses and localhost are fine.
    r = httpx.get(url + "/get_model_info", headers={"Host": "evil.example"})
    assert r.status_code == 400 and "--allowed-hosts" in r.json()["error"]["message"]
    r = httpx.get(url + "/get_model_info", headers={"Host": f"localhost:{server.port}"})
    assert r.status_code == 200
    # Same origin, and clients that send no Origin (requests, curl), still work.
    same = {"Origin": url}
    assert httpx.post(url + "/flush_cache", headers=same).status_code == 200
    assert httpx.post(url + "/flush_cache").status_code == 200


def _state(server: ServerProcess) -> dict[str, Any]:
    return httpx.get(server.url + "/get_server_info", timeout=30).json()["internal_states"][0]


def test_weight_paths_do_not_reveal_what_exists(server: ServerProcess, tmp_path: Path) -> None:
    (tmp_path / "file.txt").write_text("x")
    messages = set()
    for path in ("/no/such/dir", "/etc", "/etc/passwd", str(tmp_path / "file.txt"), "~root"):
        r = httpx.post(
            server.url + "/update_weights_from_disk", json={"model_path": path}, timeout=60
        )
        assert r.status_code == 400 and r.json()["success"] is False
        messages.add(r.json()["message"])
    assert messages == {
        "Update refused: model_path: is not a loadable checkpoint (a directory with "
        "config.json, or a .gguf file)"
    }


def test_weight_version_is_bounded(server: ServerProcess, reference: list[int]) -> None:
    r = httpx.post(server.url + "/update_weight_version", json={"new_version": "x" * 257})
    assert r.status_code == 400 and r.json()["error"]["param"] == "new_version"
    out = httpx.post(server.url + "/generate", json=GREEDY, timeout=60)
    assert len(out.content) < 4096 and out.json()["output_ids"] == reference


# ---- the Engine path: the same checks before anything is sent --------------------------------
@pytest.fixture()
def tm(model_dir: Path) -> TokenizerManager:
    info = {"context_length": 512, "vocab_size": 512, "max_req_input_len": 500}
    return TokenizerManager(ServerArgs(model_path=str(model_dir)), PortArgs.init_new(), info)


ENGINE_CASES = [
    {"prompt": "hi", "sampling_params": {"skip_special_tokens": "no"}},
    {"prompt": "hi", "sampling_params": {"spaces_between_special_tokens": []}},
    {"prompt": "hi", "sampling_params": {"temperature": 10**400}},
    {"prompt": "hi", "sampling_params": {"temperature": float("nan")}},
    {"prompt": "hi", "sampling_params": {"temperature": float("inf")}},
    {"prompt": "hi", "rid": "\ud800"},
    {"prompt": "hi", "sampling_params": {"stop": "\ud800"}},
    {"prompt": "\ud800"},
    {"prompt": ["ok", "\udfff"]},
    {"prompt": "hi", "sampling_params": {"frequency_penalty": [1]}},
    {"prompt": "hi", "sampling_params": {"presence_penalty": True}},
    {"prompt": "hi", "sampling_params": {"ignore_eos": 1}},
    {"input_ids": [True, 1]},
    {"input_ids": [1.0, 2]},
    {"input_ids": "abc"},
    {"prompt": 5},
    {"prompt": "hi", "return_logprob": "yes"},
    {"prompt": "hi", "top_logprobs_num": 10**6, "return_logprob": True},
    {"prompt": "hi", "stream": 1},
    {"prompt": ["a"] * 10_000},
    {"prompt": "hi", "sampling_params": {"n": 10_000}},
    {"prompt": "hi", "sampling_params": [{"n": 2}, {}]},
    {"prompt": "hi", "sampling_params": "greedy"},
]


@pytest.mark.parametrize("kwargs", ENGINE_CASES, ids=[str(i) for i in range(len(ENGINE_CASES))])
def test_engine_requests_are_refused_before_sending(tm: TokenizerManager, kwargs: dict) -> None:
    args = {
        "prompt": None,
        "sampling_params": None,
        "input_ids": None,
        "return_logprob": False,
        "logprob_start_len": None,
        "top_logprobs_num": None,
        "stream": False,
        "rid": None,
        "return_entropy": False,
        "return_text_in_logprobs": False,
        "entropy_mode": None,
        "entropy_top_k": None,
        "return_routed_experts": False,
        "routed_experts_start_len": 0,
        "upstream_kwargs": {},
        **kwargs,
    }
    obj = _make_request(args)

    async def run() -> None:
        try:
            async for _ in tm.generate_request(obj):
                pass
        finally:
            await tm.close()

    with pytest.raises(ValueError):
        asyncio.run(run())
    assert not tm.rid_to_state  # nothing was queued


@pytest.mark.parametrize(
    "req",
    [
        PauseGenerationReqInput(mode=3),  # type: ignore[arg-type]
        PauseGenerationReqInput(mode="x" * 100),  # type: ignore[arg-type]
        PauseGenerationReqInput(mode="abort", timeout_s=float("nan")),
        PauseGenerationReqInput(mode="abort", clear_cache="yes"),  # type: ignore[arg-type]
        AbortReq(rid="\ud800"),
        UpdateWeightVersionReqInput(new_version="x" * 300),
        UpdateWeightVersionReqInput(new_version=""),
        UpdateWeightFromDiskReqInput(model_path="/etc", weight_version="v"),
    ],
)
def test_engine_control_requests_are_refused_before_sending(tm: TokenizerManager, req: Any) -> None:
    with pytest.raises(ValueError):
        asyncio.run(tm._control(req))


# ---- clean exit --------------------------------------------------------------------------------
def test_sigterm_answers_in_flight_requests_and_removes_the_ipc_dir(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    slow = {
        "input_ids": [5, 6, 7],
        "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True},
    }
    results: dict[str, Any] = {}

    def ipc_dirs() -> list[Path]:
        return [p for p in tmp_path.iterdir() if (p / "scheduler").exists()]

    with ServerProcess(model_dir, "--skip-server-warmup", "--max-total-tokens", "4096") as srv:
        assert len(ipc_dirs()) == 1

        def plain() -> None:
            results["plain"] = httpx.post(srv.url + "/generate", json=slow, timeout=60)

        def stream() -> None:
            with httpx.stream(
                "POST", srv.url + "/generate", json={**slow, "stream": True}, timeout=60
            ) as r:
                results["stream"] = b"".join(r.iter_bytes())

        threads = [threading.Thread(target=plain), threading.Thread(target=stream)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while _state(srv)["running_batch_size"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        os.kill(srv.proc.pid, signal.SIGTERM)
        for t in threads:
            t.join(30)
        srv.proc.wait(30)
    plain = results["plain"]
    assert plain.status_code == 503 and "shutting down" in plain.json()["error"]["message"]
    events = results["stream"].decode().strip().split("\n\n")
    assert events[-1] == "data: [DONE]"
    assert "shutting down" in json.loads(events[-2][len("data: ") :])["error"]["message"]
    assert ipc_dirs() == []


def test_sigterm_during_start_up_kills_the_children_and_removes_the_ipc_dir(
    model_dir: Path, tmp_path: Path
) -> None:
    """The launcher starts the engine's children before its own imports: a SIGTERM from then
    until the server runs still ends every child and removes the IPC directory."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir),
         "--port", str(free_port())], env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    def engine_children() -> list[psutil.Process]:  # not multiprocessing's resource tracker
        with contextlib.suppress(psutil.Error):
            return [p for p in psutil.Process(launcher.pid).children()
                    if "--multiprocessing-fork" in p.cmdline()]  # fmt: skip
        return []

    try:
        deadline = time.monotonic() + 60
        while len(children := engine_children()) < 2:  # the scheduler and the detokenizer
            assert time.monotonic() < deadline and launcher.poll() is None
            time.sleep(0.05)
        assert [p for p in tmp_path.iterdir() if p.name.startswith("sglang-")]
        os.kill(launcher.pid, signal.SIGTERM)
        # ended by the signal (or exit status 143 if it came while the children were spawned)
        assert launcher.wait(30) in (-signal.SIGTERM, 128 + signal.SIGTERM)
    finally:
        launcher.kill()
    _, alive = psutil.wait_procs(children, timeout=10)
    assert alive == []
    assert [p for p in tmp_path.iterdir() if p.name.startswith("sglang-")] == []


# ---- fault isolation in the detokenizer ---------------------------------------------------------
class _PickyTokenizer:
    """Decodes ids as "<id>"; any sequence holding id 13 raises (a poisoned request)."""

    def batch_decode(
        self, seqs: list[list[int]], skip_special_tokens: bool, spaces_between_special_tokens: bool
    ) -> list[str]:
        if any(13 in seq for seq in seqs):
            raise ValueError("cannot decode 13")
        return ["".join(f"<{i}>" for i in seq) for seq in seqs]


def _token_msg(
    rids: list[str], ids: list[list[int]], reasons: list[dict | None]
) -> BatchTokenIDOutput:
    n = len(rids)
    return BatchTokenIDOutput(
        rids=rids,
        finished_reasons=reasons,
        decode_ids=ids,
        skip_special_tokens=[True] * n,
        spaces_between_special_tokens=[True] * n,
        no_stop_trim=[False] * n,
        stop_str_max_len=[0] * n,
        prompt_tokens=[1] * n,
        completion_tokens=[len(i) for i in ids],
        cached_tokens=[0] * n,
        retraction_counts=[0] * n,
        output_token_entropy_val=[[0.5] * len(i) for i in ids],
    )


def test_detokenizer_fails_only_the_poisoned_request() -> None:
    detok = DetokenizerManager(_PickyTokenizer())
    out = detok.handle_batch_token_id_output(
        _token_msg(["a", "bad", "c"], [[1], [13], [3]], [None, None, None])
    )
    assert out.rids == ["a", "bad", "c"] and out.output_strs == ["<1>", "", "<3>"]
    assert out.finished_reasons[0] is None and out.finished_reasons[2] is None
    assert out.finished_reasons[1]["type"] == "abort"
    assert "cannot decode 13" in out.finished_reasons[1]["message"]
    assert out.output_token_entropy_val == [[0.5], [0.5], [0.5]]
    # The scheduler still runs "bad": it is aborted there (once), freeing its KV at once.
    aborts = detok.take_aborts()
    assert [(a.rid, a.abort_all, a.match_prefix) for a in aborts] == [("bad", False, False)]
    assert detok.take_aborts() == []
    # The others go on exactly where they were (no id decoded twice); the failed rid's later
    # ids are dropped until the scheduler's final message for it.
    out = detok.handle_batch_token_id_output(
        _token_msg(["a", "bad", "c"], [[2], [5], [4]], [None, None, None])
    )
    assert out.rids == ["a", "c"] and out.output_strs == ["<2>", "<4>"]
    out = detok.handle_batch_token_id_output(
        _token_msg(["bad", "a"], [[6], [7]], [{"type": "length", "length": 3}, None])
    )
    assert out.rids == ["a"] and out.output_strs == ["<7>"] and not detok.failed_rids
    assert detok.states["a"].ids == [1, 2, 7]
    # A failure on a rid's final message: nothing left to abort or to wait for.
    out = detok.handle_batch_token_id_output(
        _token_msg(["a", "z"], [[8], [13]], [None, {"type": "length", "length": 1}])
    )
    assert out.rids == ["a", "z"] and out.finished_reasons[1]["type"] == "abort"
    assert detok.take_aborts() == [] and not detok.failed_rids
