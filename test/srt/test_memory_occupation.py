"""release_memory_occupation / resume_memory_occupation through Engine and HTTP: the RL
colocation cycle (pause, release, resume weights, push weights, resume KV, continue), refusals,
nothing scheduled while released, and no KV leaked."""

from __future__ import annotations

import pytest
import requests
import torch
from engine_test_utils import (
    check_complete,
    engine_state,
    request_pool,
    submit_greedy,
    wait_for,
    wait_loop_turns,
    wait_running,
)
from server_test_utils import ServerProcess

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
PROMPT = [11, 22, 33, 44, 55]


@pytest.fixture(autouse=True)
def _resume_everything(engine):
    yield
    engine.resume_memory_occupation()
    engine.continue_generation()
    engine.abort_request(abort_all=True)


def test_release_all_then_resume_all_gives_the_same_outputs(engine) -> None:
    expected = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]
    initial_kv = engine_state(engine)["available_kv_tokens"]
    out = engine.release_memory_occupation()
    assert out["success"] and out["released_tags"] == ["kv_cache", "weights", "cuda_graph"]
    assert engine_state(engine)["memory_released_tags"] == ["cuda_graph", "kv_cache", "weights"]
    assert engine_state(engine)["tree_cache_size"] == 0  # releasing the KV cache flushed it
    # Idempotent: a second release changes nothing.
    assert engine.release_memory_occupation()["message"] == "Already released."
    out = engine.resume_memory_occupation()
    assert out["released_tags"] == [] and "reloaded" in out["message"]
    assert engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"] == expected
    assert engine_state(engine)["available_kv_tokens"] == initial_kv


def test_nothing_runs_while_released_and_queued_requests_finish_after(engine) -> None:
    expected = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]
    engine.release_memory_occupation(tags=["kv_cache"])
    with request_pool(engine, 1) as pool:
        fut = pool.submit(engine.generate, input_ids=PROMPT, sampling_params=GREEDY)
        wait_for(lambda: engine_state(engine)["waiting_queue_size"] == 1)
        state = wait_loop_turns(lambda: engine_state(engine), 20)
        assert not fut.done() and state["running_batch_size"] == 0
        assert state["waiting_queue_size"] == 1
        engine.resume_memory_occupation(tags=["kv_cache"])
        assert fut.result(timeout=60)["output_ids"] == expected


def test_release_is_refused_while_requests_hold_kv(engine) -> None:
    with request_pool(engine, 4) as pool:
        futs = submit_greedy(engine, pool)
        wait_running(lambda: engine_state(engine))
        engine.pause_generation(mode="in_place")
        with pytest.raises(RuntimeError, match="hold KV cache"):
            engine.release_memory_occupation()
        assert engine_state(engine)["memory_released_tags"] == []
        engine.continue_generation()
        for fut in futs:
            check_complete(fut.result(timeout=120))


def test_rl_cycle_retract_release_push_weights_resume_continue(engine) -> None:
    """Retracted requests survive the release and finish with exact token accounting; weights
    pushed between the two resumes are the ones used afterwards."""
    original = torch.tensor(engine.get_weights_by_name("lm_head.weight", truncate_size=10**6))
    with request_pool(engine, 4) as pool:
        futs = submit_greedy(engine, pool)
        wait_running(lambda: engine_state(engine))
        engine.pause_generation(mode="retract")
        engine.release_memory_occupation()
        assert engine_state(engine)["waiting_queue_size"] == 4
        with pytest.raises(ValueError, match="released"):
            engine.get_weights_by_name("lm_head.weight")
        engine.resume_memory_occupation(tags=["weights"])
        ok, message = engine.update_weights_from_tensor(
            [("lm_head.weight", original)], weight_version="v2"
        )
        assert ok, message
        engine.resume_memory_occupation(tags=["kv_cache"])
        engine.continue_generation()
        for fut in futs:
            out = fut.result(timeout=120)
            check_complete(out)
            assert out["meta_info"]["weight_versions"][-1]["version"] == "v2"


def test_weight_updates_are_refused_while_weights_are_released(engine, tiny_model_dir) -> None:
    engine.release_memory_occupation(tags=["weights"])
    ok, message, _ = engine.update_weights_from_disk(str(tiny_model_dir("llama")))
    assert not ok and "resume_memory_occupation" in message
    engine.resume_memory_occupation(tags=["weights"])
    ok, message, _ = engine.update_weights_from_disk(str(tiny_model_dir("llama")))
    assert ok, message


def test_unknown_tag_is_a_value_error(engine) -> None:
    with pytest.raises(ValueError, match="unknown memory tag"):
        engine.release_memory_occupation(tags=["gpu"])
    with pytest.raises(ValueError, match="tags must be a list"):
        engine.resume_memory_occupation(tags="weights")
    assert engine_state(engine)["memory_released_tags"] == []


def test_http_endpoints(tiny_model_dir) -> None:
    with ServerProcess(tiny_model_dir("llama")) as server:
        url = server.url
        bad = requests.post(f"{url}/release_memory_occupation", json={"tags": ["nope"]})
        assert bad.status_code == 400 and "unknown memory tag" in bad.json()["error"]["message"]
        released = requests.post(f"{url}/release_memory_occupation", json={"tags": ["kv_cache"]})
        assert released.status_code == 200
        assert released.json()["released_tags"] == ["kv_cache"]
        # Liveness holds while released (nothing could decode: a scheduler round trip instead).
        assert requests.get(f"{url}/health_generate", timeout=10).status_code == 200
        resumed = requests.post(f"{url}/resume_memory_occupation")  # no body: every tag
        assert resumed.status_code == 200 and resumed.json()["released_tags"] == []
        body = {"input_ids": PROMPT, "sampling_params": GREEDY}
        out = requests.post(f"{url}/generate", json=body)
        assert out.status_code == 200 and len(out.json()["output_ids"]) == 12
