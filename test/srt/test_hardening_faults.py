"""Issue 13, end to end: a detokenizer failure ends its request in the scheduler too, the
biggest logprob reply does not block ``/health``, and an Engine killed by SIGTERM leaves no IPC
directory and no child process.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
from engine_test_utils import MAX_NEW, assert_kv_all_back, engine_state, wait_for
from server_test_utils import REPO_ROOT, ServerProcess, process_alive

import sglang.srt.managers.tokenizer_manager as tm_module
from sglang.srt.managers.io_struct import BatchStrOutput, GenerateReqInput
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.managers.tokenizer_req_state import logprob_entries
from sglang.srt.server_args import PortArgs, ServerArgs
from sglang.srt.utils import dumps

# ---- a detokenizer failure ends the request in the scheduler -----------------------------------
_PICKY_TOKENIZER = '''
from transformers import PreTrainedTokenizerFast


class PickyTokenizerFast(PreTrainedTokenizerFast):
    """Fails to decode for a request with spaces_between_special_tokens=False (the poison)."""

    def batch_decode(self, sequences, **kwargs):
        if kwargs.get("spaces_between_special_tokens") is False:
            raise ValueError("poisoned request")
        return super().batch_decode(sequences, **kwargs)
'''


def _picky_model(model_dir: Path, dest: Path) -> Path:
    """A copy of ``model_dir`` whose tokenizer (remote code) raises for poisoned requests."""
    shutil.copytree(model_dir, dest)
    (dest / "tokenization_picky.py").write_text(_PICKY_TOKENIZER)
    config_path = dest / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "tokenization_picky.PickyTokenizerFast"]}
    config_path.write_text(json.dumps(config))
    return dest


def _gone(state: dict[str, Any], rid: str) -> bool:
    return rid not in state["running_batch_rids"] and rid not in state["waiting_queue_rids"]


def test_detokenizer_failure_aborts_the_request_in_the_scheduler(
    tiny_model_dir: Callable[..., Path], tmp_path: Path
) -> None:
    import sglang as sgl  # here: conftest sets TRITON_INTERPRET first

    model = _picky_model(tiny_model_dir("llama"), tmp_path / "picky")
    params: dict[str, Any] = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
    poisoned = {**params, "max_new_tokens": MAX_NEW + 100, "spaces_between_special_tokens": False}
    healthy_ids = [11, 20, 30, 41]
    with sgl.Engine(
        model_path=str(model),
        trust_remote_code=True,
        random_seed=0,
        enable_deterministic_inference=True,
    ) as engine:
        alone = engine.generate(input_ids=healthy_ids, sampling_params=params)
        with ThreadPoolExecutor(2) as pool:
            good = pool.submit(
                engine.generate, input_ids=healthy_ids, sampling_params=params, rid="healthy"
            )
            wait_for(lambda: "healthy" in engine_state(engine)["running_batch_rids"])
            chunks: list[dict] = []

            def poisoned_stream() -> None:
                for chunk in engine.generate(
                    input_ids=[10, 20, 30, 40],
                    rid="poisoned",
                    sampling_params=poisoned,
                    stream=True,
                ):
                    chunks.append(chunk)

            pool.submit(poisoned_stream).result(60)
            # The failed request leaves the scheduler at once (it would otherwise run longer than
            # the healthy one), its KV back in the pool.
            wait_for(lambda: _gone(engine_state(engine), "poisoned"), timeout=10)
            assert not good.done()
            out = good.result(120)
        state = engine_state(engine)
        assert_kv_all_back(state)
        assert _gone(state, "poisoned") and _gone(state, "healthy")
    # One terminal output for the failed request: the last one, an error naming the cause.
    finals = [c["meta_info"]["finish_reason"] for c in chunks if c["meta_info"]["finish_reason"]]
    assert len(finals) == 1 and chunks[-1]["meta_info"]["finish_reason"] == finals[0]
    assert finals[0]["type"] == "abort" and "poisoned request" in finals[0]["message"]
    assert out["output_ids"] == alone["output_ids"] and len(out["output_ids"]) == MAX_NEW
    assert out["meta_info"]["finish_reason"]["type"] == "length"


# ---- the biggest logprob reply does not block /health ------------------------------------------
LONG_CONTEXT = 4096


def test_health_answers_during_the_biggest_logprob_reply(
    tiny_model_dir: Callable[..., Path],
) -> None:
    # The worst single request: a context-length prompt, 128 top logprobs (the default
    # --max-top-logprobs-num) at every position, with their texts: 0.5 M rows to build.
    model = tiny_model_dir("llama", max_position_embeddings=LONG_CONTEXT)
    num_prompt = LONG_CONTEXT - 4
    body = {
        "input_ids": [5 + (7 * i) % 500 for i in range(num_prompt)],
        "return_logprob": True,
        "top_logprobs_num": 128,
        "logprob_start_len": 0,
        "return_text_in_logprobs": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True},
    }
    results: dict[str, httpx.Response] = {}
    done = threading.Event()
    args = ("--max-total-tokens", str(2 * LONG_CONTEXT), "--skip-server-warmup")
    with ServerProcess(model, *args) as server:

        def big_request() -> None:
            try:
                results["r"] = httpx.post(server.url + "/generate", json=body, timeout=300)
            finally:
                done.set()

        thread = threading.Thread(target=big_request)
        thread.start()
        worst = 0.0
        while not done.is_set():
            start = time.monotonic()
            assert httpx.get(server.url + "/health", timeout=60).status_code == 200
            worst = max(worst, time.monotonic() - start)
            time.sleep(0.05)
        thread.join()
        log = server.log_path.read_text(errors="replace")
    print(f"max /health latency during the reply: {worst:.3f} s")
    # Both processes took their start-up objects out of garbage collection, whose full
    # collections this reply would otherwise make walk them several times over.
    assert re.search(r"HTTP server: \d+ start-up objects frozen", log), log[-3000:]
    assert re.search(r"Scheduler[^\n]*: \d+ start-up objects frozen", log), log[-3000:]
    assert results["r"].status_code == 200, results["r"].text[:500]
    meta = results["r"].json()["meta_info"]
    top = meta["input_top_logprobs"]
    assert len(top) == num_prompt and top[0] is None
    assert all(len(pos) == 128 for pos in top[1:])
    assert all(isinstance(text, str) for _, _, text in top[-1])
    assert len(meta["output_top_logprobs"]) == 2
    assert worst < 1.0, f"/health took {worst:.2f} s while the reply was built"


# ---- an Engine's process ended by SIGTERM leaves nothing behind --------------------------------
_ENGINE_SCRIPT = """
import json, os, signal, sys, time
mode, model = sys.argv[1], sys.argv[2]
if mode == "own-handler":
    def handler(signum, frame):
        print("own handler", flush=True)
        sys.exit(3)
    signal.signal(signal.SIGTERM, handler)
import sglang as sgl
engine = sgl.Engine(model_path=model, random_seed=0)
out = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})
ipc = os.path.dirname(engine.tokenizer_manager.port_args.tokenizer_ipc_name[len("ipc://"):])
print(json.dumps({"ipc": ipc, "children": [p.pid for p in engine._procs],
                  "tokens": len(out["output_ids"])}), flush=True)
if mode != "exit":
    time.sleep(300)
"""


@pytest.mark.parametrize("mode", ["sigterm", "own-handler", "exit"])
def test_engine_process_leaves_no_ipc_dir_nor_children(
    tiny_model_dir: Callable[..., Path], tmp_path: Path, mode: str
) -> None:
    env = dict(
        os.environ,
        TMPDIR=str(tmp_path),
        TRITON_INTERPRET="1",
        PYTHONPATH=os.pathsep.join(
            [str(REPO_ROOT / "python"), str(REPO_ROOT / "sgl-kernel" / "python")]
        ),
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", _ENGINE_SCRIPT, mode, str(tiny_model_dir("llama"))],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
    )
    try:
        lines = []
        while not lines or not lines[-1].startswith("{"):
            line = proc.stdout.readline() if proc.stdout else ""
            assert line, "the engine script ended early:\n" + "".join(lines)
            lines.append(line)
        info = json.loads(lines[-1])
        assert info["tokens"] == 2 and Path(info["ipc"]).is_dir()
        assert Path(info["ipc"]).parent == tmp_path and len(info["children"]) == 2
        if mode != "exit":
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        rest = proc.stdout.read() if proc.stdout else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    expected = {"sigterm": -signal.SIGTERM, "own-handler": 3, "exit": 0}[mode]
    assert code == expected, rest
    assert ("own handler" in rest) == (mode == "own-handler")
    assert not Path(info["ipc"]).exists()
    assert [p for p in tmp_path.iterdir() if p.name.startswith("sglang-")] == []
    deadline = time.monotonic() + 10
    while any(process_alive(pid) for pid in info["children"]):  # reaped by init after the parent
        assert time.monotonic() < deadline, "a child process outlived the engine"
        time.sleep(0.1)


def test_big_logprob_outputs_keep_their_order_and_the_loop_free(
    tiny_model_dir: Callable[..., Path],
) -> None:
    # Without processes: outputs pushed straight to the TokenizerManager's socket. A big one
    # (its rows built a slice at a time) and the small final one behind it are applied in
    # order, and the loop keeps turning meanwhile.
    model = tiny_model_dir("llama", max_position_embeddings=LONG_CONTEXT)
    info = {"context_length": LONG_CONTEXT, "vocab_size": 512, "max_req_input_len": 4000}
    server_args = ServerArgs(model_path=str(model))
    tm = TokenizerManager(server_args, PortArgs.init_new(), info)
    num_prompt = 3000
    rng = random.Random(0)

    def top(n: int) -> tuple[list, list]:
        vals = [[-1.0 - rng.random() for _ in range(128)] for _ in range(n)]
        return vals, [[rng.randrange(512) for _ in range(128)] for _ in range(n)]

    in_vals, in_idxs = top(num_prompt - 1)
    out_vals, out_idxs = top(2)

    def output(i: int, final: bool, **logprobs: Any) -> BatchStrOutput:
        return BatchStrOutput(
            rids=["big"],
            finished_reasons=[{"type": "length", "length": 2} if final else None],
            output_strs=["x"],
            output_ids=[[7 + i]],
            prompt_tokens=[num_prompt],
            completion_tokens=[i + 1],
            cached_tokens=[0],
            retraction_counts=[0],
            output_token_logprobs_val=[[-1.0 - i]],
            output_token_logprobs_idx=[[7 + i]],
            output_top_logprobs_val=[[out_vals[i]]],
            output_top_logprobs_idx=[[out_idxs[i]]],
            **logprobs,
        )

    first = output(
        0,
        False,
        input_token_logprobs_val=[[None] + [-1.0] * (num_prompt - 1)],
        input_token_logprobs_idx=[[5] * num_prompt],
        input_top_logprobs_val=[[[], *in_vals]],
        input_top_logprobs_idx=[[[], *in_idxs]],
    )
    assert logprob_entries(first) > tm_module._OFFLOAD_LOGPROB_ENTRIES

    async def run() -> tuple[dict, float]:
        tm.start()
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(tm.port_args.tokenizer_ipc_name)
        obj = GenerateReqInput(
            input_ids=[5] * num_prompt,
            rid="big",
            return_logprob=True,
            top_logprobs_num=128,
            logprob_start_len=0,
            return_text_in_logprobs=True,
            sampling_params={"max_new_tokens": 2},
        )
        outputs = tm.generate_request(obj)
        task = asyncio.ensure_future(outputs.__anext__())
        while "big" not in tm.rid_to_state:
            await asyncio.sleep(0.01)
        push.send(dumps(first))
        push.send(dumps(output(1, True)))
        worst, last = 0.0, time.monotonic()
        while not task.done():
            await asyncio.sleep(0.005)
            worst = max(worst, time.monotonic() - last)
            last = time.monotonic()
        out = task.result()
        await outputs.aclose()
        push.close(linger=0)
        await tm.close()
        return out, worst

    out, worst = asyncio.run(run())
    meta = out["meta_info"]
    assert out["output_ids"] == [7, 8] and meta["finish_reason"]["type"] == "length"
    assert [row[1] for row in meta["output_token_logprobs"]] == [7, 8]
    tops = meta["output_top_logprobs"]
    assert [[t for _, t, _ in pos] for pos in tops] == out_idxs
    decode = tm.tokenizer.decode
    assert all(text == decode([t]) for _, t, text in tops[1][:20])
    # The slices join up: every position's rows, in order, the first prompt token's None.
    input_top = meta["input_top_logprobs"]
    assert len(input_top) == num_prompt and input_top[0] is None
    assert [[t for _, t, _ in pos] for pos in input_top[1:]] == in_idxs
    assert [[v for v, _, _ in pos] for pos in input_top[1:]] == in_vals
    assert all(text == decode([t]) for _, t, text in input_top[-1])
    input_rows = meta["input_token_logprobs"]
    assert len(input_rows) == num_prompt and input_rows[0][0] is None
    assert worst < 1.0, f"the loop stalled {worst:.2f} s"
