"""Helpers for tests that drive a running engine, in process (``sglang.Engine``) or as a server
(:class:`server_test_utils.ServerProcess`): reading the scheduler's state, waiting on it, and
the long greedy requests the pause tests interrupt.

Waiting: a positive condition is polled until a deadline (:func:`wait_for`). A negative one
("nothing decoded while paused") is checked after the scheduler has run a given number of loop
turns (:func:`wait_loop_turns`), each of which could have scheduled a batch, never after a
sleep whose length says nothing about what the scheduler did meanwhile.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
from server_test_utils import CUDA_POOL_TOKENS, HTTP, ServerProcess

import sglang as sgl

POLL_S = 0.005
# The engines' fixed KV pool on a GPU (see server_test_utils.CUDA_POOL_TOKENS).
CUDA_POOL: dict[str, Any] = {"max_total_tokens": CUDA_POOL_TOKENS} if CUDA_POOL_TOKENS else {}
# The requests the pause tests interrupt. They must still be running when a test's control call
# lands, however loaded the host: four of them take ~1.3 s on the tiny model with 2 CPU cores
# (400 tokens, 0.2 s, once finished before a loaded CI host saw them all running).
NUM_REQS = 4
MAX_NEW = 1500

StateFn = Callable[[], dict[str, Any]]


def engine_state(engine: sgl.Engine) -> dict[str, Any]:
    """``internal_states[0]`` of the engine's scheduler (DESIGN §2 keys)."""
    return engine.get_server_info()["internal_states"][0]


def server_state(server: ServerProcess) -> dict[str, Any]:
    """``internal_states[0]`` from the server's /get_server_info."""
    info = HTTP.get(server.url + "/get_server_info", headers=server.headers, timeout=30).json()
    return info["internal_states"][0]


def post(server: ServerProcess, path: str, body: object = None, **kw: Any) -> httpx.Response:
    """POST ``body`` as JSON to ``path`` with the server's auth header (60 s timeout)."""
    return HTTP.post(server.url + path, json=body, headers=server.headers, timeout=60, **kw)


def wait_for(pred: Callable[[], object], timeout: float = 30.0) -> None:
    """Poll ``pred`` until it returns a truthy value; AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(POLL_S)


def wait_running(get_state: StateFn, n: int = NUM_REQS, timeout: float = 30.0) -> dict[str, Any]:
    """Wait until ``n`` requests are in the running batch; returns that state."""
    deadline = time.monotonic() + timeout
    while (state := get_state())["running_batch_size"] != n:
        assert time.monotonic() < deadline, f"never {n} running requests: {state}"
        time.sleep(POLL_S)
    return state


def wait_loop_turns(get_state: StateFn, n: int, timeout: float = 30.0) -> dict[str, Any]:
    """Wait until the scheduler has run ``n`` complete loop turns after the first state read;
    returns the last state.

    A state is read in the middle of a turn (``num_loop_turns`` is bumped at its start, the
    reply built before the turn schedules a batch), so a later read showing the counter
    ``n`` higher proves ``n`` full turns, each of which could have run a batch. The reads
    themselves wake an idle scheduler: waiting costs turns, not a fixed time.
    """
    start = get_state()["num_loop_turns"]
    deadline = time.monotonic() + timeout
    while (state := get_state())["num_loop_turns"] < start + n:
        assert time.monotonic() < deadline, f"the scheduler did not turn {n} times: {state}"
        time.sleep(POLL_S)
    return state


@contextmanager
def request_pool(
    engine: sgl.Engine, workers: int, lora_name: str | None = None
) -> Iterator[ThreadPoolExecutor]:
    """A thread pool for blocking ``engine.generate`` calls. When the block raises, the engine
    (and adapter ``lora_name``, if given) is continued and every request aborted before the
    pool shuts down: a check failing while paused would otherwise leave the pool waiting on
    its requests forever (a hung CI run instead of a failed test)."""
    pool = ThreadPoolExecutor(workers)
    try:
        yield pool
    except BaseException:
        engine.continue_generation()
        if lora_name is not None:
            engine.continue_generation(lora_name=lora_name)
        engine.abort_request(abort_all=True)
        raise
    finally:
        pool.shutdown(wait=True)


def submit_greedy(
    engine: sgl.Engine,
    pool: ThreadPoolExecutor,
    n: int = NUM_REQS,
    max_new: int = MAX_NEW,
    **kw: object,
) -> list[Future]:
    """``n`` greedy ``ignore_eos`` requests of ``max_new`` tokens with logprobs, run in
    ``pool``; request i's prompt is ``[10 + i, 20, 30, 40 + i]``."""
    params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    return [
        pool.submit(
            engine.generate,
            input_ids=[10 + i, 20, 30, 40 + i],
            sampling_params=params,
            return_logprob=True,
            **kw,
        )
        for i in range(n)
    ]


def check_complete(out: dict, max_new: int = MAX_NEW) -> None:
    """``out`` finished by length with ``max_new`` tokens, one logprob per token, aligned."""
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": max_new}
    assert len(out["output_ids"]) == meta["completion_tokens"] == max_new
    assert len(meta["output_token_logprobs"]) == max_new
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]


def ids_and_logprobs(out: dict) -> tuple[list[int], list[float]]:
    """The output token ids and their logprobs (what determinism tests compare)."""
    return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def assert_kv_all_back(state: dict[str, Any]) -> None:
    """Nothing admitted holds KV or a pool row, and every slot is free or evictable. Call it
    before any flush: a flush resets the allocator and would hide a leak."""
    assert state["running_batch_size"] == 0 and state["chunked_req_is_none"]
    assert state["req_to_token_pool_used"] == 0
    assert state["private_kv_tokens"] == 0
    assert state["available_kv_tokens"] == state["max_total_num_tokens"]


# A fixed greedy request: the same tokens before and after any malformed request proves the
# server is still serving correctly (hardening and fuzz tests).
REFERENCE_REQUEST = {
    "input_ids": [5, 6, 7, 8],
    "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
}


def reference_ids(server: ServerProcess) -> list[int]:
    """The output ids of :data:`REFERENCE_REQUEST` on ``server`` (asserting a 200)."""
    r = HTTP.post(server.url + "/generate", json=REFERENCE_REQUEST, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


_STORM_ACTIONS = ("retract", "in_place", "abort", "continue", "continue", "flush", "abort_one")


def control_storm(
    engine: sgl.Engine, rng: random.Random, rids: list[str], seconds: float, max_gap_s: float
) -> None:
    """For ``seconds``, random control calls on ``engine`` from one other thread: pause in every
    mode (each must answer "ok"), continue, flush, abort of one of ``rids``; a continue last.
    Re-raises, here, what failed in that thread."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def driver() -> None:
        try:
            while not stop.is_set():
                action = rng.choice(_STORM_ACTIONS)
                if action in ("retract", "in_place", "abort"):
                    reply = engine.pause_generation(mode=action)
                    assert reply["status"] == "ok", reply
                elif action == "continue":
                    engine.continue_generation()
                elif action == "flush":
                    engine.flush_cache()
                else:
                    engine.abort_request(rid=rng.choice(rids))
                time.sleep(rng.uniform(0, max_gap_s))
        except BaseException as exc:  # reported to the test below
            errors.append(exc)
        finally:
            engine.continue_generation()

    thread = threading.Thread(target=driver)
    thread.start()
    time.sleep(seconds)
    stop.set()
    thread.join()
    if errors:
        raise errors[0]


def storm_requests(
    engine: sgl.Engine, rng: random.Random, num: int, seconds: float, base_len: int, step: int
) -> None:
    """``num`` sampled requests (request i asks for ``base_len + step * i`` tokens) under a
    :func:`control_storm` of ``seconds``: each must end exactly once, as length or abort, with
    one logprob per token. The caller checks the KV afterwards (before any flush)."""
    ends: dict[str, int] = {}
    lock = threading.Lock()

    def run(i: int) -> dict:
        out = engine.generate(
            input_ids=[rng.randrange(3, 400) for _ in range(7)],
            sampling_params={"max_new_tokens": base_len + step * i, "ignore_eos": True,
                             "temperature": 1.0, "sampling_seed": i},
            rid=f"storm-{i}", return_logprob=True,
        )  # fmt: skip
        with lock:
            ends[out["meta_info"]["id"]] = ends.get(out["meta_info"]["id"], 0) + 1
        return out

    with ThreadPoolExecutor(num) as pool:
        futs = [pool.submit(run, i) for i in range(num)]
        control_storm(engine, rng, [f"storm-{i}" for i in range(num)], seconds, 0.03)
        outs = [f.result(timeout=120) for f in futs]
    assert ends == {f"storm-{i}": 1 for i in range(num)}
    for out in outs:
        meta = out["meta_info"]
        assert meta["finish_reason"]["type"] in ("length", "abort")
        assert len(out["output_ids"]) == meta["completion_tokens"]
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]


def broadcast_weight_sync(engine: sgl.Engine, ranks: int, group: str, tensor: Any) -> None:
    """Act as an RL trainer (rank 0 of a gloo weight group) broadcasting ``tensor`` as the
    engine's ``lm_head.weight`` with weight version "broadcast", through the frontend's
    ``init/update/destroy_weights_update_group`` in upstream's layout (the engine's ``ranks``
    scheduler ranks join as ranks 1..ranks). First checks that a group too small for every
    rank is refused before any rank joins; asserts every step succeeded."""
    import asyncio
    import socket

    import torch.distributed as dist

    from sglang.srt.managers.io_struct import (
        DestroyWeightsUpdateGroupReqInput,
        InitWeightsUpdateGroupReqInput,
        UpdateWeightsFromDistributedReqInput,
    )

    tm = engine.tokenizer_manager
    assert tm is not None
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    too_small = InitWeightsUpdateGroupReqInput("127.0.0.1", port, 1, ranks, group, "gloo")
    ok, message = asyncio.run(tm.init_weights_update_group(too_small, None))
    assert not ok and f"{ranks} scheduler ranks" in message and "world_size" in message, message

    trainer_group: list = []

    def trainer() -> None:
        store = dist.TCPStore("127.0.0.1", port, 1 + ranks, is_master=True)
        prefixed = dist.PrefixStore(f"{group}/", store)
        trainer_group.append(dist.ProcessGroupGloo(prefixed, 0, 1 + ranks))

    thread = threading.Thread(target=trainer)
    thread.start()
    init = InitWeightsUpdateGroupReqInput("127.0.0.1", port, 1, 1 + ranks, group, "gloo")
    ok, message = asyncio.run(tm.init_weights_update_group(init, None))
    assert ok, message
    thread.join(60)
    assert trainer_group, "the trainer met every rank"

    async def update() -> tuple[bool, str]:
        obj = UpdateWeightsFromDistributedReqInput(
            name="lm_head.weight", dtype=str(tensor.dtype).removeprefix("torch."),
            shape=list(tensor.shape), group_name=group, weight_version="broadcast")
        receiving = asyncio.ensure_future(tm.update_weights_from_distributed(obj, None))
        await asyncio.to_thread(lambda: trainer_group[0].broadcast(tensor, 0).wait())
        return await receiving

    ok, message = asyncio.run(update())
    assert ok, message
    destroy = DestroyWeightsUpdateGroupReqInput(group)
    assert asyncio.run(tm.destroy_weights_update_group(destroy, None))[0]
