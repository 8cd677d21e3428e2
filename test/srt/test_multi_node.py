"""Multi-node tensor parallelism, as two "nodes" on one machine: two ``python -m
sglang.launch_server --tp-size 2 --nnodes 2 --node-rank 0|1 --dist-init-addr 127.0.0.1:PORT``
commands on loopback. Node 0 serves HTTP with TP rank 0; node 1 runs TP rank 1 only."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from engine_test_utils import MAX_NEW, assert_kv_all_back, post, wait_for
from server_test_utils import REPO_ROOT, ServerProcess, free_port, process_alive

KV_TOKENS = "20000"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(REPO_ROOT / "python"), str(REPO_ROOT / "sgl-kernel" / "python")]
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    return env


def _node_args(model_path: str, node_rank: int, addr: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path,
            "--tp-size", "2", "--nnodes", "2", "--node-rank", str(node_rank),
            "--dist-init-addr", addr, "--max-total-tokens", KV_TOKENS, "--random-seed", "0",
            "--dist-timeout", "60", *extra]


class FollowerNode:
    """``--node-rank 1`` in a subprocess; its output is kept for the assertions."""

    def __init__(self, args: list[str]) -> None:
        self.log = Path(tempfile.mkdtemp(prefix="sglang-node1-")) / "node1.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=_env())

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def rank_processes(self) -> list[psutil.Process]:
        """The scheduler rank processes this launcher started (not multiprocessing's tracker)."""
        children = psutil.Process(self.proc.pid).children()
        return [c for c in children if "spawn_main" in " ".join(c.cmdline())]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def model_path(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))


@pytest.fixture
def addr() -> str:
    return f"127.0.0.1:{free_port()}"


@pytest.fixture
def follower(model_path: str, addr: str) -> Iterator[FollowerNode]:
    node = FollowerNode(_node_args(model_path, 1, addr))
    yield node
    node.stop()


def _states(server: ServerProcess) -> list[dict]:
    info = httpx.get(server.url + "/get_server_info", timeout=30).json()
    return info["internal_states"]


def _engine_children(server: ServerProcess) -> list[psutil.Process]:
    assert server.proc is not None
    children = psutil.Process(server.proc.pid).children()
    return [c for c in children if "spawn_main" in " ".join(c.cmdline())]


def test_two_nodes_serve_and_a_killed_rank_stops_both(
    model_path: str, addr: str, follower: FollowerNode
) -> None:
    with ServerProcess(model_path, *_node_args(model_path, 0, addr)[5:]) as server:
        body = {"input_ids": [5, 6, 7, 8], "return_logprob": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}
        r = post(server, "/generate", body)
        assert r.status_code == 200, r.text
        assert len(r.json()["output_ids"]) == 8
        [state] = _states(server)
        assert state["tp_size"] == 2 and [s["tp_rank"] for s in state["tp_ranks"]] == [0, 1]
        assert state["tp_ranks"][1]["forward_ct_decode"] == state["forward_ct_decode"] > 0
        reply = post(server, "/pause_generation", {"mode": "retract"}).json()
        assert reply["status"] == "ok"
        assert all(s["engine_paused"] for s in _states(server)[0]["tp_ranks"])
        assert post(server, "/continue_generation").json()["was_paused"]
        for rank in _states(server)[0]["tp_ranks"]:
            assert_kv_all_back(rank)

        # A long request is running when node 1's rank is killed.
        result: dict = {}
        long_body = {"input_ids": [1, 2, 3], "sampling_params": {
            "temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}}

        def generate() -> None:
            result["response"] = post(server, "/generate", long_body)
            result["at"] = time.monotonic()

        thread = threading.Thread(target=generate)
        thread.start()
        wait_for(lambda: _states(server)[0]["running_batch_size"] == 1)
        [rank1] = follower.rank_processes()
        engine_procs = _engine_children(server)
        killed_at = time.monotonic()
        rank1.send_signal(signal.SIGKILL)
        thread.join(30)
        response = result["response"]
        assert response.status_code >= 500, response.text
        assert "scheduler died" in response.json()["error"]["message"]
        assert result["at"] - killed_at < 5
        # Node 1's launcher exits non-zero; node 0's engine processes all stop.
        assert follower.proc.wait(15) != 0
        assert "TP rank 1 (exit code -9) exited" in follower.output()
        wait_for(lambda: not any(process_alive(p.pid) for p in engine_procs), timeout=15)
        r = httpx.get(server.url + "/health", timeout=10)
        assert r.status_code == 503
        r = post(server, "/generate", body)
        assert r.status_code >= 500 and "scheduler died" in r.json()["error"]["message"]


def test_a_rank_failing_at_start_up_is_named(model_path: str, addr: str, tmp_path: Path) -> None:
    broken = tmp_path / "broken-model"
    broken.mkdir()
    config = json.loads((Path(model_path) / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps(config))  # no weights
    follower = FollowerNode(_node_args(str(broken), 1, addr, "--tokenizer-path", model_path))
    leader = FollowerNode(_node_args(model_path, 0, addr, "--port", str(free_port())))
    try:
        assert follower.proc.wait(120) == 1
        assert "TP rank 1 failed to start:" in follower.output()
        # Node 0 notices that its peer is gone and exits too, naming the rank and its error
        # (left in the rendezvous store, which TP rank 0 hosts).
        assert leader.proc.wait(120) != 0
        out = leader.output()
        assert "The engine failed to start: TP rank 0 failed to start: TP rank 1 failed to " \
            "start: FileNotFoundError: no weight files" in out
    finally:
        for node in (follower, leader):
            node.stop()
        shutil.rmtree(broken, ignore_errors=True)
