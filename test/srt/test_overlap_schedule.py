"""The overlap schedule (docs/overlap.md) on CPU: the control flow it has on CUDA, forced on.

On CPU a step finishes at its launch, so the overlap schedule gains nothing there and is off in
the engine; forced on here, the scheduler still launches each steady decode step before it
commits the one in flight, which is what these tests check: the same tokens, logprobs and
entropies as committing every step first, requests that stop while the next step is in flight
(their row of that step dropped, its KV slot released), and nothing leaked. The randomized
interleavings with control calls run with it too (test_scheduler_random.py); the GPU run is in
test_cuda_graph_gpu.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from scheduler_test_utils import (
    OutputSink,
    assert_no_leak,
    expected_output,
    make_core,
    run_until_idle,
    submit,
)

from sglang.srt.managers.overlap import overlap_off_reason
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.scheduler_process import build_scheduler
from sglang.srt.server_args import ServerArgs

PROMPTS = [[30 + i, 41, 52 + 3 * i, *range(60, 60 + 2 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[..., Path]) -> str:
    return str(tiny_model_dir("llama"))


def _records(sink: OutputSink) -> dict[str, tuple[list[int], list[dict[str, Any]]]]:
    return {rid: (r.output_ids, r.finished_reasons) for rid, r in sink.by_rid.items()}


@pytest.mark.parametrize("page_size", [1, 4])
def test_requests_stopping_mid_flight_match_sync(model_dir: str, page_size: int) -> None:
    """Stop tokens end requests at different steps while the next step is in flight."""
    results = {}
    for overlap in (False, True):
        core, _, sink = make_core(model_dir, overlap, page_size=page_size, max_total_tokens=512)
        vocab = core.model_config.vocab_size
        for i, prompt in enumerate(PROMPTS):
            stop_at = expected_output(prompt, 30, vocab)[2 + 3 * i]  # stops at step 3 + 3i
            sampling = {"ignore_eos": False, "stop_token_ids": [stop_at]}
            submit(core, f"r{i}", prompt, 30, sampling=sampling, return_logprob=True)
        run_until_idle(core)
        assert_no_leak(core)
        assert (core.num_steps_ahead > 0) is overlap
        results[overlap] = _records(sink)
    assert results[True] == results[False]
    vocab = core.model_config.vocab_size
    for i, prompt in enumerate(PROMPTS):
        ids, reasons = results[True][f"r{i}"]
        expected = expected_output(prompt, 30, vocab)
        stop_at = expected[2 + 3 * i]
        assert ids == expected[: expected.index(stop_at) + 1]
        assert reasons == [{"type": "stop", "matched": stop_at}]


def test_stopped_request_caches_its_whole_sequence(model_dir: str) -> None:
    """A request that stopped while its next step was in flight gives that step's slot to the
    prefix cache with the rest: the same prompt + output is then matched in full."""
    core, _, sink = make_core(model_dir, True, max_total_tokens=256)
    prompt = PROMPTS[3]
    expected = expected_output(prompt, 20, core.model_config.vocab_size)
    sampling = {"ignore_eos": False, "stop_token_ids": [expected[5]]}
    submit(core, "a", prompt, 20, sampling=sampling)
    run_until_idle(core)
    assert core.num_steps_ahead > 0
    output = sink.by_rid["a"].output_ids
    assert output == expected[: expected.index(expected[5]) + 1]
    assert_no_leak(core)
    # Every token of prompt + output has K/V in the cache, the last one from the dropped step.
    assert core.tree_cache.total_size() == len(prompt) + len(output)


def _real_core(model_dir: str, overlap: bool) -> tuple[Scheduler, OutputSink]:
    sink = OutputSink()
    args = ServerArgs(
        model_path=model_dir, device="cpu", random_seed=0, max_total_tokens=2048, log_level="error"
    )
    core = build_scheduler(args, sink.on_output, sink.on_reply)
    assert core.overlap is False  # the engine's choice on CPU (overlap_off_reason)
    core.overlap = overlap
    return core, sink


def test_model_worker_overlap_equals_sync(model_dir: str) -> None:
    """The real model worker: sampled, penalized, min-length and stop-token requests, with
    logprobs and entropy, give the same bits with and without the overlap schedule."""
    runs = {}
    for overlap in (False, True):
        core, sink = _real_core(model_dir, overlap)
        for i, prompt in enumerate(PROMPTS):
            sampling: dict[str, Any] = {"max_new_tokens": 12 + 5 * i, "ignore_eos": i % 2 == 0}
            if i % 3 == 1:
                sampling.update(temperature=0.9, top_k=20, sampling_seed=7 + i)
            if i == 2:
                sampling.update(frequency_penalty=0.5, min_new_tokens=4, temperature=0.7)
            if i == 5:
                sampling.update(stop_token_ids=[7, 11, 23])
            submit(
                core,
                f"r{i}",
                prompt,
                sampling=sampling,
                return_logprob=True,
                top_logprobs_num=2,
                return_entropy=True,
            )
        run_until_idle(core)
        assert_no_leak(core)
        assert (core.num_steps_ahead > 0) is overlap
        runs[overlap] = {
            rid: (r.output_ids, r.logprobs, r.entropies, r.finished_reasons)
            for rid, r in sink.by_rid.items()
        }
    assert runs[True] == runs[False]
    assert all(len(out[0]) > 0 for out in runs[True].values())


class _AllowAll:
    """A grammar matcher that allows every token and records the ones it accepted."""

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = -1

    def accept(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return True

    def is_terminated(self) -> bool:
        return False


def test_grammar_requests_do_not_run_ahead(model_dir: str) -> None:
    """A decode step is never launched before the one in flight commits while a request of
    the batch has a grammar (its next mask needs the committed token); each matcher sees every
    committed token once, in order. Without a grammar the same batch runs ahead."""
    for grammar in (False, True):
        core, _, sink = make_core(model_dir, overlap=True, max_total_tokens=512)
        matchers: list[_AllowAll] = []
        core.grammar_backend = SimpleNamespace(  # type: ignore[assignment]
            matcher=lambda spec, stops, made=matchers: made.append(_AllowAll()) or made[-1]
        )
        for i, prompt in enumerate(PROMPTS[:3]):
            sampling = {"regex": "[a-z]+"} if grammar and i == 1 else {}
            submit(core, f"r{i}", prompt, 20, sampling=sampling)
        run_until_idle(core)
        assert_no_leak(core)
        assert (core.num_steps_ahead == 0) is grammar
        assert len(matchers) == int(grammar)
        if grammar:
            assert matchers[0].accepted == sink.by_rid["r1"].output_ids


def test_overlap_off_reasons() -> None:
    def args(**kw: Any) -> ServerArgs:
        return ServerArgs(model_path="m", **kw)

    assert overlap_off_reason(args(device="cuda")) is None
    assert "disable-overlap" in str(
        overlap_off_reason(args(device="cuda", disable_overlap_schedule=True))
    )
    assert "CUDA" in str(overlap_off_reason(args(device="cpu")))
    assert "tensor parallel" in str(overlap_off_reason(args(device="cuda", tp_size=2)))
    assert "LoRA" in str(overlap_off_reason(args(device="cuda", enable_lora=True)))
