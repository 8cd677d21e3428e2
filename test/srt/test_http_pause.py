"""Pause / continue / flush / abort over HTTP, including auth and paused admission."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from engine_test_utils import MAX_NEW, post, server_state, wait_for, wait_running
from server_test_utils import ServerProcess


@pytest.fixture(scope="module")
def server(tiny_model_dir) -> Iterator[ServerProcess]:
    with ServerProcess(tiny_model_dir("llama"), "--skip-server-warmup", api_key="secret") as s:
        yield s


def _generate(server: ServerProcess, i: int, max_new: int = MAX_NEW) -> dict:
    body = {
        "input_ids": [11 + i, 12, 13],
        "return_logprob": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True},
    }
    r = post(server, "/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def test_control_endpoints_need_the_key(server: ServerProcess) -> None:
    for path in ("/pause_generation", "/continue_generation", "/abort_request", "/flush_cache"):
        assert httpx.post(server.url + path, json={}, timeout=10).status_code == 401
    assert httpx.get(server.url + "/is_paused", timeout=10).status_code == 401


def test_retract_pause_and_continue_over_http(server: ServerProcess) -> None:
    with ThreadPoolExecutor(3) as pool:
        futs = [pool.submit(_generate, server, i) for i in range(3)]
        wait_running(lambda: server_state(server), 3)
        r = post(server, "/pause_generation", {"mode": "retract"})
        assert r.status_code == 200
        reply = r.json()
        assert reply["message"] == "Generation paused successfully."
        assert reply["status"] == "ok" and reply["num_retracted"] == 3
        paused = httpx.get(server.url + "/is_paused", headers=server.headers, timeout=10).json()
        assert paused["is_paused"] and paused["pause_mode"] == "retract"
        assert post(server, "/flush_cache").status_code == 200  # nothing holds KV now
        r = post(server, "/continue_generation")
        assert r.json() == {
            "message": "Generation continued successfully.",
            "status": "ok",
            "was_paused": True,
        }
        outs = [f.result(timeout=60) for f in futs]
    for out in outs:
        meta = out["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": MAX_NEW}
        assert len(out["output_ids"]) == meta["completion_tokens"] == MAX_NEW
        assert len(meta["output_token_logprobs"]) == MAX_NEW
        assert meta["total_retractions"] == 1


def test_in_place_flush_refused_and_abort_mode(server: ServerProcess) -> None:
    with ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(_generate, server, i) for i in range(2)]
        wait_running(lambda: server_state(server), 2)
        assert post(server, "/pause_generation", {"mode": "in_place"}).json()["num_running"] == 2
        refused = post(server, "/flush_cache")
        assert refused.status_code == 400 and "hold KV" in refused.text
        reply = post(server, "/pause_generation", {"mode": "abort"}).json()
        assert reply["num_aborted"] == 2
        outs = [f.result(timeout=30) for f in futs]
        post(server, "/continue_generation")
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)


def test_bad_pause_bodies_are_400_and_state_unchanged(server: ServerProcess) -> None:
    r = post(server, "/pause_generation", {"mode": "sideways"})
    assert r.status_code == 400 and "sideways" in r.json()["error"]["message"]
    assert post(server, "/pause_generation", {"mode": 3}).status_code == 400
    assert (
        post(server, "/pause_generation", {"mode": "in_place", "clear_cache": True}).status_code
        == 400
    )
    assert (
        post(
            server,
            "/pause_generation",
            content=b"{not json",
        ).status_code
        == 400
    )
    assert not server_state(server)["engine_paused"]
    # continue without a pause is fine, and the server still generates
    assert post(server, "/continue_generation").json()["was_paused"] is False
    assert len(_generate(server, 0, max_new=4)["output_ids"]) == 4


def test_paused_admission_reject(tiny_model_dir: object) -> None:
    model: Path = tiny_model_dir("llama")
    with ServerProcess(model, "--skip-server-warmup", "--paused-admission", "reject") as s:
        assert (
            httpx.post(
                s.url + "/pause_generation", json={"mode": "in_place"}, timeout=30
            ).status_code
            == 200
        )
        r = httpx.post(s.url + "/generate", json={"input_ids": [1, 2, 3]}, timeout=30)
        assert r.status_code == 503 and r.headers.get("retry-after")
        httpx.post(s.url + "/continue_generation", timeout=30)
        r = httpx.post(
            s.url + "/generate",
            json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}},
            timeout=30,
        )
        assert r.status_code == 200
        # A leased pause ends in the scheduler; the frontend follows what it reports (no
        # clock of its own): admission reopens without any continue call.
        pause = {"mode": "in_place", "timeout_s": 1.0}
        assert httpx.post(s.url + "/pause_generation", json=pause, timeout=30).status_code == 200
        r = httpx.post(s.url + "/generate", json={"input_ids": [1, 2, 3]}, timeout=30)
        assert r.status_code == 503
        wait_for(lambda: not httpx.get(s.url + "/is_paused", timeout=30).json()["is_paused"])
        r = httpx.post(
            s.url + "/generate",
            json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}},
            timeout=30,
        )
        assert r.status_code == 200
