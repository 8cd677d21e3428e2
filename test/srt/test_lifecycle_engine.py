"""Request exit paths through a real Engine: each ends with one final output, the KV comes back
without a flush, and the engine serves the next request at once."""

from __future__ import annotations

import pytest
from engine_test_utils import assert_kv_all_back, engine_state

import sglang as sgl

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def small_pool_engine(tiny_model_dir):
    # Deterministic mode: a request's tokens do not depend on its batch nor on a re-prefill
    # after retraction, so "together" can be compared with "alone" exactly.
    with sgl.Engine(
        model_path=str(tiny_model_dir("llama")),
        max_total_tokens=64,
        enable_deterministic_inference=True,
    ) as engine:
        yield engine


def _assert_nothing_held(engine: sgl.Engine) -> None:
    state = engine_state(engine)
    assert state["waiting_queue_size"] == 0 and state["max_total_num_tokens"] == 64
    assert_kv_all_back(state)


def test_request_outgrowing_the_pool_is_aborted_and_released(small_pool_engine) -> None:
    """The reproduction of the lifecycle issue: 10 prompt tokens, 200 new, a 64-token pool."""
    out = small_pool_engine.generate(
        input_ids=list(range(10, 20)), sampling_params={**GREEDY, "max_new_tokens": 200}
    )
    assert out["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "The KV cache is too small for this request",
    }
    assert len(out["output_ids"]) == out["meta_info"]["completion_tokens"] == 55
    _assert_nothing_held(small_pool_engine)  # no flush before this check
    nxt = small_pool_engine.generate(
        input_ids=list(range(30, 35)), sampling_params={**GREEDY, "max_new_tokens": 5}
    )
    assert nxt["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    _assert_nothing_held(small_pool_engine)


def test_request_that_can_never_fit_is_refused(small_pool_engine) -> None:
    out = small_pool_engine.generate(
        input_ids=list(range(10, 50)),
        sampling_params={**GREEDY, "max_new_tokens": 60, "min_new_tokens": 40},
    )
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "min_new_tokens" in reason["message"]
    assert out["output_ids"] == []
    _assert_nothing_held(small_pool_engine)


def test_pool_so_small_that_requests_retract_in_turn(small_pool_engine) -> None:
    """Four requests that fit one at a time: decode retracts and re-admits them until every
    one finishes with exactly the tokens it produces alone."""
    prompts = [list(range(20 + 10 * i, 28 + 10 * i)) for i in range(4)]
    params = {**GREEDY, "max_new_tokens": 40}
    alone = [small_pool_engine.generate(input_ids=p, sampling_params=params) for p in prompts]
    together = small_pool_engine.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in together] == [o["output_ids"] for o in alone]
    assert sum(o["meta_info"]["total_retractions"] for o in together) > 0
    _assert_nothing_held(small_pool_engine)
