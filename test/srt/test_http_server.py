"""End to end: ``python -m sglang.launch_server`` on a tiny random Llama, over real HTTP.

One server per module (plus one with --api-key for the auth test). Covers every endpoint of
issue 4, the official ``openai`` client (stream and not), SSE framing, KV freed after a client
disconnect, and every bad-input class followed by a normal request.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
from engine_test_utils import post, server_state, wait_for
from server_test_utils import ServerProcess

CONTEXT_LEN = 4096
GREEDY = {"temperature": 0.0, "max_new_tokens": 8}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[..., Path]) -> Path:
    return tiny_model_dir("llama", max_position_embeddings=CONTEXT_LEN)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(model_dir, "--max-total-tokens", "8192", "--enable-metrics",
                       "--served-model-name", "tiny", "--gc-threshold", "5000", "20") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def _sse_payloads(raw: bytes) -> list[str]:
    assert raw.endswith(b"\n\n")
    events = raw.decode().split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e[len("data: "):] for e in events]


def _assert_still_serving(server: ServerProcess) -> None:
    r = post(server, "/generate", {"text": "Hello", "sampling_params": GREEDY})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 8


# ---- native endpoints ----------------------------------------------------------------------------
def test_health_and_info_endpoints(server: ServerProcess, model_dir: Path) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/health_generate", timeout=60).status_code == 200
    info = httpx.get(server.url + "/get_model_info").json()
    assert info["model_path"] == str(model_dir) and info["is_generation"] is True
    assert info["model_type"] == "llama" and info["architectures"] == ["LlamaForCausalLM"]
    assert httpx.get(server.url + "/model_info").json() == info
    assert "weight_version" in info
    server_info = httpx.get(server.url + "/get_server_info").json()
    assert server_info["port"] == server.port and server_info["version"]
    state = server_info["internal_states"][0]
    for key in ("engine_paused", "waiting_queue_size", "running_batch_size", "running_batch_rids",
                "waiting_queue_rids", "cur_batch_is_none", "last_batch_is_none",
                "chunked_req_is_none", "tree_cache_size", "req_to_token_pool_used",
                "available_kv_tokens", "forward_ct_decode", "new_token_ratio",
                "init_new_token_ratio", "weight_version"):
        assert key in state, key
    assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == ["tiny"]


def test_generate_text_ids_batch_logprobs(server: ServerProcess) -> None:
    one = post(server, "/generate", {"text": "The capital of France is",
                                      "sampling_params": GREEDY}).json()
    assert len(one["output_ids"]) == 8
    assert one["meta_info"]["finish_reason"]["type"] in ("length", "stop")
    batch = post(server, "/generate", {
        "text": ["The capital of France is", "Once upon a time"], "sampling_params": GREEDY,
        "return_logprob": True, "top_logprobs_num": 2,
    }).json()
    assert isinstance(batch, list) and len(batch) == 2
    assert batch[0]["output_ids"] == one["output_ids"]  # greedy: same tokens in a batch
    meta = batch[1]["meta_info"]
    assert [e[1] for e in meta["output_token_logprobs"]] == batch[1]["output_ids"]
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    ids = post(server, "/generate", {"input_ids": [5, 6, 7], "rid": "my-rid",
                                      "sampling_params": GREEDY}).json()
    assert ids["meta_info"]["id"] == "my-rid" and ids["meta_info"]["prompt_tokens"] == 3


def test_zero_new_tokens_over_http(server: ServerProcess) -> None:
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True, "logprob_start_len": 0}
    out = post(server, "/generate", body).json()
    assert out["output_ids"] == [] and out["meta_info"]["completion_tokens"] == 0
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    logprobs = out["meta_info"]["input_token_logprobs"]
    assert len(logprobs) == out["meta_info"]["prompt_tokens"] and logprobs[0][0] is None
    chunks = _sse_payloads(post(server, "/generate", {**body, "stream": True}).content)
    assert chunks[-1] == "[DONE]" and json.loads(chunks[-2])["output_ids"] == []


def test_tokenize_and_detokenize(server: ServerProcess) -> None:
    prompt = "The capital of France is"
    for path in ("/tokenize", "/v1/tokenize"):
        one = post(server, path, {"prompt": prompt}).json()
        assert one["count"] == len(one["tokens"]) > 0 and one["max_model_len"] == CONTEXT_LEN
    by_text = post(server, "/generate", {"text": prompt, "sampling_params": GREEDY}).json()
    by_ids = post(server, "/generate", {"input_ids": one["tokens"],
                                         "sampling_params": GREEDY}).json()
    assert by_text["meta_info"]["prompt_tokens"] == one["count"]
    assert by_ids["output_ids"] == by_text["output_ids"]  # the ids /generate itself uses
    many = post(server, "/tokenize", {"prompt": [prompt, "Hi", ""], "model": "tiny"}).json()
    assert many["tokens"][0] == one["tokens"] and many["tokens"][2] == []
    assert many["count"] == [len(t) for t in many["tokens"]]

    text = post(server, "/detokenize", {"tokens": one["tokens"]}).json()["text"]
    assert text == post(server, "/v1/detokenize", {"tokens": one["tokens"]}).json()["text"]
    assert post(server, "/tokenize", {"prompt": text}).json()["tokens"] == one["tokens"]
    texts = post(server, "/detokenize", {"tokens": [one["tokens"], [], by_text["output_ids"]],
                                         "skip_special_tokens": False}).json()["text"]
    assert texts == [text, "", by_text["text"]]

    for path, body, needle in (
        ("/tokenize", {"prompt": prompt, "add_special_token": True}, "add_special_token"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/detokenize", {"tokens": [1, 10**9]}, "out of range"),
        ("/detokenize", {"tokens": [[1], [-1]]}, "out of range"),
        ("/detokenize", {"tokens": ["a"]}, "tokens"),
    ):
        r = post(server, path, body)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], (body, r.text)
    _assert_still_serving(server)


def test_generate_stream_sse(server: ServerProcess) -> None:
    body = {"text": "Once upon a time", "stream": True, "sampling_params": GREEDY}
    r = post(server, "/generate", body)
    assert r.headers["content-type"].startswith("text/event-stream")
    payloads = _sse_payloads(r.content)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    final = post(server, "/generate", {**body, "stream": False}).json()
    assert chunks[-1]["output_ids"] == final["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] is not None
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(lengths) and lengths[-1] == 8  # cumulative


def _metric_values(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return {line.split(" ")[0]: float(line.split(" ")[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def test_flush_cache_and_metrics(server: ServerProcess) -> None:
    r = httpx.post(server.url + "/flush_cache", timeout=30)
    assert r.status_code == 200, r.text
    assert httpx.get(server.url + "/flush_cache", timeout=30).status_code == 405  # POST only
    before = _metric_values(server)
    body = {"text": "Hi", "stream": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 64, "ignore_eos": True}}
    chunks = [json.loads(p) for p in _sse_payloads(post(server, "/generate", body).content)[:-1]]
    values = _metric_values(server)
    assert values["sglang:num_requests_total"] >= 1
    assert values["sglang:generation_tokens_total"] >= 64
    assert values["sglang:time_to_first_token_seconds_count"] >= 1
    # One inter-token latency per streamed chunk after the first (a slow reader may get
    # several tokens in one chunk, so the count follows the chunks, not the tokens).
    assert len(chunks) > 1
    itl = "sglang:inter_token_latency_seconds_count"
    assert values[itl] - before.get(itl, 0.0) == len(chunks) - 1
    assert values["sglang:num_running_reqs"] == 0


def _long_request(rid: str) -> dict[str, Any]:
    return {"text": "Count:", "rid": rid, "sampling_params": {
        "max_new_tokens": CONTEXT_LEN - 16, "ignore_eos": True, "temperature": 0.0}}


def _wait_running(server: ServerProcess, rid: str) -> None:
    wait_for(lambda: rid in server_state(server)["running_batch_rids"])


def test_abort_request(server: ServerProcess) -> None:
    result: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: result.update(post(server, "/generate", _long_request("victim")).json()))
    thread.start()
    _wait_running(server, "victim")
    r = post(server, "/abort_request", {"rid": "victim"})
    assert r.json() == {"success": True, "num_aborted": 1}
    thread.join(30)
    assert result["meta_info"]["finish_reason"]["type"] == "abort"
    assert result["meta_info"]["completion_tokens"] < CONTEXT_LEN - 16


def _wait_kv_freed(server: ServerProcess, initial: int) -> dict[str, Any]:
    """Wait until nothing runs and ``initial`` KV tokens are free again; returns that state."""
    deadline = time.monotonic() + 10
    while (state := server_state(server))["running_batch_size"] or (
        state["available_kv_tokens"] != initial
    ):
        assert time.monotonic() < deadline, f"KV not freed after the disconnect: {state}"
        time.sleep(0.1)
    return state


def test_stream_disconnect_frees_kv(server: ServerProcess) -> None:
    initial = server_state(server)["available_kv_tokens"]
    with httpx.stream("POST", server.url + "/generate", timeout=60,
                      json={**_long_request("dropped"), "stream": True}) as r:
        lines = r.iter_lines()
        for _ in range(3):
            assert next(lines).startswith("data: ")
            next(lines)  # the blank line ending the event
        assert server_state(server)["available_kv_tokens"] < initial  # it holds KV while streaming
    state = _wait_kv_freed(server, initial)
    assert "dropped" not in state["running_batch_rids"]


def test_non_stream_disconnect_frees_kv(server: ServerProcess) -> None:
    initial = server_state(server)["available_kv_tokens"]
    errors: list[Exception] = []

    def give_up() -> None:  # the client gives up and closes the connection
        try:
            httpx.post(server.url + "/generate", json=_long_request("impatient"), timeout=2)
        except httpx.ReadTimeout as e:
            errors.append(e)

    client = threading.Thread(target=give_up)
    client.start()
    _wait_running(server, "impatient")
    # Paused in place, the request keeps its KV and makes no progress: it cannot finish
    # before the client gives up, however fast the model is.
    assert post(server, "/pause_generation", {"mode": "in_place"}).status_code == 200
    try:
        client.join(30)
        assert len(errors) == 1
        state = _wait_kv_freed(server, initial)  # freed while still paused: by the disconnect
        assert state["engine_paused"]
    finally:
        post(server, "/continue_generation", {})
    _assert_still_serving(server)


# ---- bad input -----------------------------------------------------------------------------------
_BAD_GENERATE = [
    pytest.param(b'{"text": "hi"', "Malformed JSON", id="malformed-json"),
    pytest.param({"text": 5}, "text", id="wrong-type-text"),
    pytest.param({"text": "a", "sampling_params": {"max_new_tokens": "many"}}, "max_new_tokens",
                 id="wrong-type-param"),
    pytest.param({"sampling_params": GREEDY}, "text", id="missing-prompt"),
    pytest.param({"text": ""}, "empty", id="empty-text"),
    pytest.param({"input_ids": []}, "empty", id="empty-ids"),
    pytest.param({"text": "a", "sampling_params": {"max_new_tokens": -3}}, "max_new_tokens",
                 id="negative-max-new-tokens"),
    pytest.param({"text": "a", "sampling_params": {"temperature": -0.5}}, "temperature",
                 id="negative-temperature"),
    pytest.param({"text": "a", "sampling_params": {"top_p": 0}}, "top_p", id="top-p-zero"),
    pytest.param({"text": "a", "sampling_params": {"top_p": 1.5}}, "top_p", id="top-p-big"),
    pytest.param({"text": "a", "sampling_params": {"top_k": 0}}, "top_k", id="top-k-zero"),
    pytest.param({"text": "a", "sampling_params": {"top_k": -2}}, "top_k", id="top-k-negative"),
    pytest.param({"input_ids": [1, 10**6]}, "out of range", id="token-id-outside-vocab"),
    pytest.param({"input_ids": [-1]}, "out of range", id="negative-token-id"),
    pytest.param({"input_ids": [5] * (CONTEXT_LEN + 10)}, "context length", id="too-long"),
]


@pytest.mark.parametrize("body, needle", _BAD_GENERATE)
def test_bad_input_is_400(server: ServerProcess, body: Any, needle: str) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + "/generate", content=content, timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    _assert_still_serving(server)


def test_oversized_body_is_413(server: ServerProcess) -> None:
    big = b'{"text": "' + b"a" * (33 * 1024 * 1024) + b'"}'
    r = httpx.post(server.url + "/generate", content=big, timeout=60)
    assert r.status_code == 413 and "too large" in r.json()["error"]["message"]
    _assert_still_serving(server)


def test_openai_bad_input(client: openai.OpenAI, server: ServerProcess) -> None:
    chat = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="tiny", messages=chat, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model="tiny", prompt="hi", top_p=2)
    with pytest.raises(openai.BadRequestError, match="empty"):
        client.completions.create(model="tiny", prompt="")
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="x", max_tokens="ten")
    with pytest.raises(openai.BadRequestError, match="max_tokens"):  # 0 only natively
        client.completions.create(model="tiny", prompt="x", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="max_completion_tokens"):
        client.chat.completions.create(model="tiny", messages=chat, max_completion_tokens=0)
    _assert_still_serving(server)


# ---- OpenAI API ----------------------------------------------------------------------------------
def test_openai_completions(client: openai.OpenAI, server: ServerProcess) -> None:
    native = post(server, "/generate", {"text": "Once upon a time",
                                         "sampling_params": GREEDY}).json()
    r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8,
                                  temperature=0, logprobs=1)
    choice = r.choices[0]
    assert choice.text == native["text"]
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 0
    assert len(choice.logprobs.tokens) == 8 and len(choice.logprobs.top_logprobs) == 8
    r = client.completions.create(model="tiny", prompt=["a b", "c d"], max_tokens=4, n=2,
                                  temperature=1.0, seed=1)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    stream = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == native["text"]
    assert chunks[-1].usage.completion_tokens == 8


def test_openai_chat(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=2)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("length", "stop")
    assert len(choice.logprobs.content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_gc_threshold_is_set_in_the_servers_processes(server: ServerProcess) -> None:
    """--gc-threshold 5000 20: generations 0 and 1 set, generation 2 keeps Python's 10."""
    log = server.log_path.read_text(errors="replace")
    for process in ("Scheduler", "Detokenizer", "HTTP server"):
        assert f"{process}: garbage-collection thresholds (5000, 20, 10)" in log, process


# ---- auth ----------------------------------------------------------------------------------------
def test_auth_and_shutdown(model_dir: Path) -> None:
    with ServerProcess(model_dir, "--skip-server-warmup", api_key="k3y") as s:
        engine_procs = psutil.Process(s.proc.pid).children(recursive=True)
        assert engine_procs
        assert httpx.get(s.url + "/health").status_code == 200
        for path in ("/get_model_info", "/get_server_info", "/flush_cache", "/v1/models"):
            assert httpx.get(s.url + path).status_code == 401, path
        r = httpx.post(s.url + "/generate", json={"text": "hi"},
                       headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
        assert httpx.post(s.url + "/abort_request", json={"abort_all": True}).status_code == 401
        r = httpx.post(s.url + "/generate", json={"text": "hi", "sampling_params": GREEDY},
                       headers=s.headers, timeout=60)
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 8
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="nope").models.list()
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="k3y")
        assert good.completions.create(model="m", prompt="hi", max_tokens=2).usage.total_tokens
    # Leaving the block sent SIGTERM: the server took its engine processes down with it.
    _, alive = psutil.wait_procs(engine_procs, timeout=10)
    assert alive == []
