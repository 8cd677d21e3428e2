"""CUDA graphs end to end on a GPU (skipped without one): graphs on == graphs off, in
deterministic mode to the bit; batches that shrink and grow between padded sizes; short
prefills through the graphs == eager prefills, to the bit; pause in every mode, weight updates
(from disk and from tensors) and memory release/resume with graphs on; the overlap schedule (on
by default) == --disable-overlap-schedule, to the bit.

The other engine tests (test_engine_pause.py, test_memory_occupation.py, ...) also run with
graphs on when a GPU is present: on CUDA they are the default."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_test_utils import (
    NUM_REQS,
    check_complete,
    engine_state,
    ids_and_logprobs,
    request_pool,
    submit_greedy,
    wait_running,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Prompts of different lengths with different output lengths: the batch shrinks from 6 to 1
# through the padded sizes 8, 4, 2, 1 as requests finish.
PROMPTS = [[10 + i, 20, 30 + i, *range(40, 40 + 3 * i)] for i in range(6)]
OUT_LENS = [40, 7, 90, 23, 64, 3]
LONG = 600


def _engine(path: Path, **kw: Any) -> Any:
    import sglang as sgl

    return sgl.Engine(
        model_path=str(path),
        random_seed=0,
        # A fixed pool instead of a share of free memory: two engines are alive at once.
        max_total_tokens=16384,
        cuda_graph_max_bs=16,
        log_level="warning",
        **kw,
    )


def _generate_all(engine: Any, **kw: Any) -> list[dict]:
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in OUT_LENS]
    return engine.generate(input_ids=PROMPTS, sampling_params=params, return_logprob=True, **kw)


def _replays(engine: Any) -> int:
    return engine_state(engine)["cuda_graph"]["replays"]


@pytest.fixture(scope="module")
def model_a(tiny_model_dir: Callable[..., Path]) -> Path:
    return tiny_model_dir()


@pytest.fixture(scope="module")
def model_b(tiny_model_dir: Callable[..., Path]) -> Path:
    """Same shapes as model_a, other weights (another initializer range)."""
    return tiny_model_dir(initializer_range=0.3)


@pytest.fixture(scope="module")
def graph_engine(model_a: Path) -> Iterator[Any]:
    with _engine(model_a) as eng:
        yield eng


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_on_equal_graphs_off(model_a: Path, dtype: str) -> None:
    outs = {}
    for disable in (False, True):
        with _engine(model_a, dtype=dtype, disable_cuda_graph=disable) as eng:
            state = engine_state(eng)["cuda_graph"]
            assert state["enabled"] is not disable
            assert bool(state["captured_batch_sizes"]) is not disable
            outs[disable] = _generate_all(eng)
            assert (_replays(eng) > 0) is not disable
    for on, off in zip(outs[False], outs[True]):
        check_complete(on, len(on["output_ids"]))
        assert on["output_ids"] == off["output_ids"]
        on_lp, off_lp = ids_and_logprobs(on)[1], ids_and_logprobs(off)[1]
        # Outside deterministic mode cuBLAS may round a padded product differently: a bfloat16
        # logit by up to an ulp (~1%), a float32 one by float rounding.
        torch.testing.assert_close(
            on_lp, off_lp, rtol=0, atol=5e-2 if dtype == "bfloat16" else 1e-4
        )


def test_deterministic_logprobs_and_entropy_bitwise_with_graphs(model_a: Path) -> None:
    outs = {}
    for disable in (False, True):
        with _engine(
            model_a, enable_deterministic_inference=True, disable_cuda_graph=disable
        ) as eng:
            outs[disable] = _generate_all(eng, return_entropy=True)
            # One request alone (batch 1) gives the same bits as inside the padded batches.
            alone = eng.generate(
                input_ids=PROMPTS[2],
                sampling_params={
                    "temperature": 0,
                    "max_new_tokens": OUT_LENS[2],
                    "ignore_eos": True,
                },
                return_logprob=True,
            )
            assert ids_and_logprobs(alone) == ids_and_logprobs(outs[disable][2])
    for on, off in zip(outs[False], outs[True]):
        assert ids_and_logprobs(on) == ids_and_logprobs(off)
        assert on["meta_info"]["output_token_entropy"] == off["meta_info"]["output_token_entropy"]


def test_overlap_schedule_equals_sync_bitwise(model_a: Path) -> None:
    """Greedy and seeded sampling, stop tokens met while the next step is in flight, logprobs
    and entropy: the same bits with the overlap schedule as committing every step first."""
    params: list[dict[str, Any]] = [
        {"max_new_tokens": n, "ignore_eos": True, "temperature": 0.8 * (i % 2), "sampling_seed": i}
        for i, n in enumerate(OUT_LENS)
    ]
    outs: dict[bool, list[dict]] = {}
    for disable in (True, False):
        with _engine(
            model_a, enable_deterministic_inference=True, disable_overlap_schedule=disable
        ) as eng:
            if disable:  # stop each request at a token it meets halfway
                first = eng.generate(input_ids=PROMPTS, sampling_params=params)
                for p, o in zip(params, first):
                    p["stop_token_ids"] = [o["output_ids"][len(o["output_ids"]) // 2]]
                    p["ignore_eos"] = False
            outs[disable] = eng.generate(
                input_ids=PROMPTS, sampling_params=params, return_logprob=True, return_entropy=True
            )
            state = engine_state(eng)
            assert state["overlap_schedule"] is not disable
            assert (state["num_steps_ahead"] > 0) is not disable
            assert state["private_kv_tokens"] == 0 and state["req_to_token_pool_used"] == 0
    for on, off in zip(outs[False], outs[True]):
        assert on["meta_info"]["finish_reason"]["type"] == "stop"
        assert ids_and_logprobs(on) == ids_and_logprobs(off)
        assert on["meta_info"]["output_token_entropy"] == off["meta_info"]["output_token_entropy"]


def test_short_prefills_through_the_graphs_equal_eager_prefills_bitwise(model_a: Path) -> None:
    """Each prompt alone: those of at most cuda_graph_max_bs tokens (all but the 18-token one)
    prefill through the decode graphs, a row per token, and give the bits of eager prefills
    (--disable-cuda-graph-prefill) in deterministic mode, entropies included. A request for
    prompt logprobs prefills eagerly."""
    outs: dict[bool, list[dict]] = {}
    for disable in (True, False):
        with _engine(
            model_a, enable_deterministic_inference=True, disable_cuda_graph_prefill=disable
        ) as eng:
            outs[disable] = [
                eng.generate(
                    input_ids=prompt,
                    sampling_params={"temperature": 0, "max_new_tokens": n, "ignore_eos": True},
                    return_logprob=True,
                    return_entropy=True,
                )
                for prompt, n in zip(PROMPTS, OUT_LENS)
            ]
            prefills = engine_state(eng)["cuda_graph"]["prefill_replays"]
            short = sum(len(p) <= 16 for p in PROMPTS)
            assert prefills == 0 if disable else prefills >= short
            eng.generate(
                input_ids=PROMPTS[0],
                sampling_params={"temperature": 0, "max_new_tokens": 2},
                return_logprob=True,
                logprob_start_len=0,
            )
            assert engine_state(eng)["cuda_graph"]["prefill_replays"] == prefills
    for graphs, eager in zip(outs[False], outs[True]):
        assert ids_and_logprobs(graphs) == ids_and_logprobs(eager)
        assert (
            graphs["meta_info"]["output_token_entropy"]
            == eager["meta_info"]["output_token_entropy"]
        )


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_pause_modes_with_graphs(graph_engine: Any, mode: str) -> None:
    expected = _generate_all(graph_engine)
    with request_pool(graph_engine, NUM_REQS) as pool:
        futs = submit_greedy(graph_engine, pool, max_new=LONG)
        wait_running(lambda: engine_state(graph_engine))
        graph_engine.pause_generation(mode=mode)
        graph_engine.continue_generation()
        outs = [f.result(timeout=120) for f in futs]
    for out in outs:
        if mode == "abort":
            assert out["meta_info"]["finish_reason"]["type"] == "abort"
        else:
            check_complete(out, LONG)
    # Nothing the interrupted batch did through the graphs touched other KV: one batch of
    # the same requests gives the same tokens as before.
    after = _generate_all(graph_engine)
    assert [o["output_ids"] for o in after] == [o["output_ids"] for o in expected]
    assert engine_state(graph_engine)["cuda_graph"]["captured_batch_sizes"]


def test_weight_updates_with_graphs_equal_a_fresh_engine(
    graph_engine: Any, model_a: Path, model_b: Path
) -> None:
    with _engine(model_b) as fresh:
        want = [o["output_ids"] for o in _generate_all(fresh)]
    assert want != [o["output_ids"] for o in _generate_all(graph_engine)]  # B is not A
    before = _replays(graph_engine)
    graph_engine.pause_generation(mode="retract")
    assert graph_engine.update_weights_from_disk(str(model_b))[0]
    graph_engine.continue_generation()
    assert [o["output_ids"] for o in _generate_all(graph_engine)] == want
    assert _replays(graph_engine) > before  # the new weights ran through the graphs
    # From tensors: back to A, then B again, copied in place under the captured graphs.
    from safetensors.torch import load_file

    tensors_b = list(load_file(str(model_b / "model.safetensors")).items())
    assert graph_engine.update_weights_from_disk(str(model_a))[0]
    assert graph_engine.update_weights_from_tensor(tensors_b)[0]
    assert [o["output_ids"] for o in _generate_all(graph_engine)] == want
    assert graph_engine.update_weights_from_disk(str(model_a))[0]


def test_release_and_resume_memory_recaptures_graphs(graph_engine: Any) -> None:
    expected = [o["output_ids"] for o in _generate_all(graph_engine)]
    sizes = engine_state(graph_engine)["cuda_graph"]["captured_batch_sizes"]
    assert sizes
    graph_engine.release_memory_occupation(tags=["kv_cache"])
    assert engine_state(graph_engine)["cuda_graph"]["captured_batch_sizes"] == []
    graph_engine.resume_memory_occupation(tags=["kv_cache"])
    assert engine_state(graph_engine)["cuda_graph"]["captured_batch_sizes"] == sizes
    graph_engine.release_memory_occupation()
    graph_engine.resume_memory_occupation(tags=["weights"])  # reloaded from disk
    assert engine_state(graph_engine)["cuda_graph"]["captured_batch_sizes"] == []
    graph_engine.resume_memory_occupation()
    assert engine_state(graph_engine)["cuda_graph"]["captured_batch_sizes"] == sizes
    before = _replays(graph_engine)
    assert [o["output_ids"] for o in _generate_all(graph_engine)] == expected
    assert _replays(graph_engine) > before
    # Only the graphs released: decode runs eagerly, with the same tokens.
    graph_engine.release_memory_occupation(tags=["cuda_graph"])
    before = _replays(graph_engine)
    assert [o["output_ids"] for o in _generate_all(graph_engine)] == expected
    assert _replays(graph_engine) == before
    graph_engine.resume_memory_occupation(tags=["cuda_graph"])
    assert engine_state(graph_engine)["cuda_graph"]["captured_batch_sizes"] == sizes
