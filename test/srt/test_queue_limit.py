"""--max-queued-requests (upstream's flag): a request that arrives when that many wait is
refused with 503; requests already admitted, and those a retract moves back, are never lost."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from engine_test_utils import (
    assert_kv_all_back,
    check_complete,
    engine_state,
    request_pool,
    submit_greedy,
    wait_for,
    wait_running,
)
from server_test_utils import ServerProcess

import sglang as sgl
from sglang.srt.managers.tokenizer_manager import QueueFullError
from sglang.srt.server_args import ServerArgs


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_bad_limits_are_refused(value: object) -> None:
    with pytest.raises(ValueError, match="--max-queued-requests must be an integer >= 1"):
        ServerArgs(model_path="m", device="cpu", max_queued_requests=value)


def test_engine_refuses_past_the_limit_and_keeps_retracted_requests(
    tiny_model_dir: Callable[..., Path],
) -> None:
    engine = sgl.Engine(model_path=str(tiny_model_dir("llama")), max_queued_requests=2,
                        skip_server_warmup=True, random_seed=0)
    try:
        with request_pool(engine, 6) as pool:
            # Four running requests, sent one by one (four at once would meet the limit of two
            # in the waiting queue): a retract puts all four back in the waiting queue, over
            # the limit, and none of them is dropped.
            running = []
            for i in range(4):
                running += submit_greedy(engine, pool, n=1)
                wait_running(lambda: engine_state(engine), i + 1)
            assert engine.pause_generation(mode="retract")["num_retracted"] == 4
            assert engine_state(engine)["waiting_queue_size"] == 4
            with pytest.raises(QueueFullError, match="The request queue is full"):
                engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
            engine.continue_generation()
            for future in running:
                check_complete(future.result(timeout=120))
            # Paused with an empty queue: two requests wait, the third is refused.
            engine.pause_generation(mode="abort")
            params = {"max_new_tokens": 3, "ignore_eos": True}
            queued = [pool.submit(engine.generate, input_ids=[5, 6 + i], sampling_params=params)
                      for i in range(2)]
            wait_for(lambda: engine_state(engine)["waiting_queue_size"] == 2)
            with pytest.raises(QueueFullError):
                engine.generate(input_ids=[7, 8], sampling_params=params)
            assert engine_state(engine)["waiting_queue_size"] == 2
            engine.continue_generation()
            for future in queued:
                assert future.result(timeout=60)["meta_info"]["completion_tokens"] == 3
        assert_kv_all_back(engine_state(engine))
        assert engine.flush_cache().success
    finally:
        engine.shutdown()


def test_http_answers_503_with_retry_after(tiny_model_dir: Callable[..., Path]) -> None:
    with ServerProcess(tiny_model_dir("llama"), "--skip-server-warmup",
                       "--max-queued-requests", "1") as server:
        url = server.url
        assert httpx.post(url + "/pause_generation", json={"mode": "abort"},
                          timeout=30).status_code == 200
        body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}
        with httpx.Client(timeout=60) as client, ThreadPoolExecutor(1) as pool:
            first = pool.submit(client.post, url + "/generate", json=body)
            wait_for(lambda: httpx.get(url + "/get_server_info", timeout=30).json()[
                "internal_states"][0]["waiting_queue_size"] == 1)
            for path, payload in (("/generate", body), ("/generate", {**body, "stream": True}),
                                  ("/v1/completions", {"prompt": [5, 6], "max_tokens": 2})):
                refused = httpx.post(url + path, json=payload, timeout=30)
                assert refused.status_code == 503, (path, refused.text)
                assert "The request queue is full" in refused.json()["error"]["message"]
            assert refused.headers.get("retry-after")
            assert httpx.post(url + "/continue_generation", timeout=30).status_code == 200
            assert first.result(timeout=60).status_code == 200
        # The limit counts waiting requests only: with none waiting, requests run again.
        assert httpx.post(url + "/generate", json=body, timeout=60).status_code == 200

