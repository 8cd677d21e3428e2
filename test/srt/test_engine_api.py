"""sglang.Engine's API end to end on a tiny random Llama: sync and async generate, batches,
streams, n > 1, logprob formats, thread safety, abort, a dead scheduler, and shutdown."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from engine_test_utils import MAX_NEW, engine_state, wait_for
from server_test_utils import process_alive

import sglang as sgl

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
LONG = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44], [100, 7]]


def _rids(engine: sgl.Engine, where: str = "running_batch_rids") -> list[str]:
    """The rids the scheduler holds in ``where`` (``running_batch_rids`` or
    ``waiting_queue_rids``)."""
    return engine_state(engine)[where]


def _child_pids() -> set[int]:
    """Live children of this process, minus multiprocessing's resource tracker."""
    pids = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(
                child.cmdline()
            ):
                pids.add(child.pid)
        except psutil.NoSuchProcess:
            continue
    return pids


def test_single_batch_and_text(engine: sgl.Engine) -> None:
    single = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, rid="one")
    assert len(single["output_ids"]) == 6
    meta = single["meta_info"]
    assert meta["id"] == "one" and meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 6
    assert meta["weight_version"] == "default" and meta["e2e_latency"] > 0
    assert single["text"] == engine.tokenizer.decode(single["output_ids"], skip_special_tokens=True)
    batch = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o["meta_info"]["prompt_tokens"] for o in batch] == [3, 5, 2]
    assert batch[0]["output_ids"] == single["output_ids"]  # greedy: same tokens in a batch
    by_text = engine.generate(prompt=["The quick brown fox", "Paris"], sampling_params=GREEDY)
    assert by_text[0]["meta_info"]["prompt_tokens"] == len(
        engine.tokenizer.encode("The quick brown fox"))


def test_stream_is_cumulative_and_matches_non_stream(engine: sgl.Engine) -> None:
    expected = engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY)
    chunks = list(engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY, stream=True))
    # Updates that arrive while the consumer is busy are merged into one chunk, so on a loaded
    # machine six tokens may come as one; a long generation always streams several.
    long_params = {**GREEDY, "max_new_tokens": 64}
    long_chunks = list(engine.generate(input_ids=PROMPTS[1], sampling_params=long_params,
                                       stream=True))
    assert len(long_chunks) > 1
    assert long_chunks[-1]["output_ids"][:6] == expected["output_ids"]
    for prev, nxt in zip(chunks, chunks[1:]):
        assert nxt["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
        assert prev["meta_info"]["finish_reason"] is None
    assert chunks[-1]["output_ids"] == expected["output_ids"]
    assert chunks[-1]["text"] == expected["text"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    batch_chunks = list(engine.generate(input_ids=PROMPTS[:2], sampling_params=GREEDY,
                                        stream=True))
    finals = {c["index"]: c for c in batch_chunks if c["meta_info"]["finish_reason"]}
    assert finals[1]["output_ids"] == expected["output_ids"] and set(finals) == {0, 1}


def test_parallel_sampling_n(engine: sgl.Engine) -> None:
    outs = engine.generate(input_ids=PROMPTS[0], rid="par",
                           sampling_params={**GREEDY, "n": 3, "temperature": 1.0})
    assert [o["meta_info"]["id"] for o in outs] == ["par_0", "par_1", "par_2"]
    assert all(len(o["output_ids"]) == 6 for o in outs)
    # A seeded group: n different samples (copy 0 is the n = 1 request), reproducible.
    seeded = {**GREEDY, "temperature": 1.0, "max_new_tokens": 12, "sampling_seed": 5}
    group = [o["output_ids"] for o in engine.generate(
        input_ids=PROMPTS[0], sampling_params={**seeded, "n": 3})]
    assert len({tuple(ids) for ids in group}) == 3
    assert group[0] == engine.generate(input_ids=PROMPTS[0], sampling_params=seeded)["output_ids"]
    assert group == [o["output_ids"] for o in engine.generate(
        input_ids=PROMPTS[0], sampling_params={**seeded, "n": 3})]


def test_logprob_formats(engine: sgl.Engine) -> None:
    out = engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY, return_logprob=True,
                          logprob_start_len=0, top_logprobs_num=2, return_text_in_logprobs=True)
    meta = out["meta_info"]
    rows = meta["output_token_logprobs"]
    assert [r[1] for r in rows] == out["output_ids"]
    assert all(r[0] <= 0 and r[2] == engine.tokenizer.decode([r[1]]) for r in rows)
    assert [r[1] for r in meta["input_token_logprobs"]] == PROMPTS[1]
    assert meta["input_token_logprobs"][0][0] is None
    assert all(len(top) == 2 and top[0][1] == r[1] for top, r in
               zip(meta["output_top_logprobs"], rows))  # greedy picks the top-1 token


def test_zero_new_tokens_gives_the_prompt_logprobs_only(engine: sgl.Engine) -> None:
    """``max_new_tokens=0`` (upstream's prompt-scoring request): a prefill and no output, with
    the prompt logprobs a generating request gets; the KV it used is given back."""
    kwargs = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}
    full = engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY, **kwargs)["meta_info"]
    used = engine_state(engine)["req_to_token_pool_used"]
    out = engine.generate(input_ids=PROMPTS[1], sampling_params={"max_new_tokens": 0}, **kwargs)
    meta = out["meta_info"]
    assert out["output_ids"] == [] and out["text"] == ""
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["completion_tokens"] == 0 and meta["prompt_tokens"] == len(PROMPTS[1])
    assert meta["output_token_logprobs"] == [] and meta["weight_versions"] == []
    assert [r[1] for r in meta["input_token_logprobs"]] == PROMPTS[1]
    got = [r[0] for r in meta["input_token_logprobs"][1:]]
    assert got == pytest.approx([r[0] for r in full["input_token_logprobs"][1:]], abs=1e-5)
    assert len(meta["input_top_logprobs"]) == len(PROMPTS[1])
    assert engine_state(engine)["req_to_token_pool_used"] == used
    stream = list(engine.generate(input_ids=PROMPTS[1], sampling_params={"max_new_tokens": 0},
                                  stream=True))
    assert stream[-1]["output_ids"] == [] and stream[-1]["meta_info"]["finish_reason"] == {
        "type": "length", "length": 0}


def test_min_new_tokens_holds_back_stop_tokens_not_stop_strings(engine: sgl.Engine) -> None:
    """As upstream: min_new_tokens masks the stop tokens only; a stop string ends the request
    whenever it appears, and ignore_eos turns off stop_token_ids as well as the model's EOS."""
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    ids = engine.generate(input_ids=PROMPTS[1], sampling_params=params)["output_ids"]
    decode = engine.tokenizer.decode
    k = next(i for i in range(2, 10) if decode(ids[i : i + 1]).strip())
    stop = decode(ids[k : k + 1]).strip()
    first = next(n for n in range(1, 13) if stop in decode(ids[:n]))
    out = engine.generate(input_ids=PROMPTS[1],
                          sampling_params={**params, "min_new_tokens": 12, "stop": [stop]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == ids[:first] and first < 12
    held = engine.generate(input_ids=PROMPTS[1], sampling_params={
        **params, "stop_token_ids": [ids[k]]})
    assert held["output_ids"] == ids and held["meta_info"]["finish_reason"]["type"] == "length"


def test_validation_errors_reach_the_caller(engine: sgl.Engine) -> None:
    with pytest.raises(ValueError, match="out of range"):
        engine.generate(input_ids=[5, 10_000], sampling_params=GREEDY)
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(input_ids=[5], sampling_params={"top_p": 2.0})
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate(input_ids=[5], sampling_params={"max_new_tokens": -1})
    with pytest.raises(ValueError):
        engine.generate()  # neither prompt nor input_ids
    assert len(engine.generate(input_ids=[5], sampling_params=GREEDY)["output_ids"]) == 6


def test_async_generate_runs_side_by_side(engine: sgl.Engine) -> None:
    expected = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)

    async def main() -> None:
        outs = await asyncio.gather(
            *(engine.async_generate(input_ids=p, sampling_params=GREEDY) for p in PROMPTS))
        assert [o["output_ids"] for o in outs] == [e["output_ids"] for e in expected]
        long_task = asyncio.ensure_future(engine.async_generate(
            input_ids=PROMPTS[0], sampling_params={**LONG, "max_new_tokens": 60}))
        short = await engine.async_generate(input_ids=PROMPTS[1], sampling_params=GREEDY)
        assert not long_task.done() and len(short["output_ids"]) == 6
        stream = await engine.async_generate(input_ids=PROMPTS[2], sampling_params=GREEDY,
                                             stream=True)
        chunks = [c async for c in stream]
        assert chunks[-1]["output_ids"] == expected[2]["output_ids"]
        assert len((await long_task)["output_ids"]) == 60

    asyncio.run(main())


def test_blocking_generate_does_not_block_other_threads(engine: sgl.Engine) -> None:
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(engine.generate(
        input_ids=PROMPTS[0], sampling_params=LONG, rid="long")))
    worker.start()
    wait_for(lambda: "long" in _rids(engine))
    refused = engine.flush_cache()
    assert refused.success is False and refused.error_msg
    assert worker.is_alive()
    assert engine.abort_request("long") == 1
    worker.join(30)
    assert result["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < result["meta_info"]["completion_tokens"] < LONG["max_new_tokens"]
    assert engine.flush_cache().success is True


def test_leaving_a_stream_early_aborts_it(engine: sgl.Engine) -> None:
    stream = engine.generate(input_ids=PROMPTS[1], sampling_params=LONG, rid="left", stream=True)
    next(stream)
    stream.close()
    assert "left" not in engine.tokenizer_manager.rid_to_state
    wait_for(lambda: "left" not in _rids(engine), timeout=5)


def test_dead_scheduler_and_shutdown(tiny_model_dir) -> None:
    before = _child_pids()
    eng = sgl.Engine(model_path=str(tiny_model_dir("llama")))
    pids = [p.pid for p in eng._procs]
    assert set(pids) <= _child_pids()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            eng.generate(input_ids=PROMPTS[0], sampling_params=LONG, rid="doomed")
        except BaseException as e:
            errors.append(e)

    worker = threading.Thread(target=run)
    try:
        # Paused, the request waits in the scheduler's queue: it cannot finish before the kill
        # however fast this host decodes.
        eng.pause_generation(mode="in_place")
        worker.start()
        wait_for(lambda: errors or "doomed" in _rids(eng, "waiting_queue_rids"))
        assert not errors, errors
        os.kill(pids[0], signal.SIGKILL)
        worker.join(10)
        assert not worker.is_alive()
        assert isinstance(errors[0], RuntimeError) and "scheduler died" in str(errors[0])
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="scheduler died"):
            eng.generate(input_ids=[5], sampling_params=GREEDY)
        assert time.monotonic() - start < 1
    finally:
        eng.shutdown()
    assert not any(map(process_alive, pids))
    assert _child_pids() <= before
    with pytest.raises(RuntimeError, match="shut down"):
        eng.get_server_info()


def test_unknown_model_path_raises_and_leaves_no_process(tmp_path: Path) -> None:
    before = _child_pids()
    with pytest.raises(RuntimeError, match="missing-model"):
        sgl.Engine(model_path=str(tmp_path / "missing-model"))
    assert _child_pids() <= before
    with pytest.raises(TypeError, match="no_such_option"):
        sgl.Engine(model_path=str(tmp_path), no_such_option=1)


_LAUNCHER = """
import sys, time
import sglang as sgl
engine = sgl.Engine(model_path=sys.argv[1])
print(*(p.pid for p in engine._procs), flush=True)
time.sleep(300)
"""


def test_children_exit_when_the_launcher_is_killed(tiny_model_dir) -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, str(tiny_model_dir("llama"))],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in sys.path if p)},
    )
    try:
        pids = [int(pid) for pid in launcher.stdout.readline().split()]
        assert len(pids) == 2 and all(psutil.pid_exists(pid) for pid in pids)
    finally:
        launcher.kill()  # SIGKILL: no atexit, no shutdown()
        launcher.wait(10)
    wait_for(lambda: not any(map(process_alive, pids)), timeout=10)
