"""Randomized interleavings of requests, steps and control calls through the Scheduler core.

Each seed draws a pool configuration (size, page size, prefix cache on/off, chunk size, running
limit) and a sequence of actions: submit, step, pause in every mode (with clear_cache and
leases), continue, flush, abort by rid / prefix / all, weight updates from disk and tensors
(some refused), relabels, release / resume memory. The invariants are checked after every
action, without any flush (with the overlap schedule, a decode step may be in flight then);
at the end every request has ended exactly once with an exact prefix of its uninterrupted
tokens (all of them unless aborted), and nothing leaked. Every seed runs with the overlap
schedule off and on.
"""

from __future__ import annotations

import random

import pytest
import torch
from scheduler_test_utils import (
    FAKE_ENTROPY,
    assert_no_leak,
    control,
    expected_output,
    make_core,
    run_until_idle,
    submit,
)

from sglang.srt.managers.io_struct import (
    AbortReq,
    ContinueGenerationReqInput,
    FlushCacheReqInput,
    PauseGenerationReqInput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightVersionReqInput,
)

NUM_SEEDS = 160  # x ACTIONS_PER_SEED interleaved actions in all (about 6,400)
ACTIONS_PER_SEED = 40
SEEDS_PER_CASE = 20
_ACTIONS = [
    ("submit", 6),
    ("step", 8),
    ("pause", 3),
    ("continue", 3),
    ("flush", 1),
    ("abort", 2),
    ("weights", 1),
    ("memory", 1),
]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))


class Episode:
    """One seed's core, the requests it was sent, and the action that changes it."""

    def __init__(self, seed: int, model_dir: str, overlap: bool) -> None:
        self.rng = random.Random(seed)
        self.model_dir = model_dir
        rng = self.rng
        self.core, _, self.sink = make_core(
            model_dir,
            overlap,
            max_total_tokens=rng.choice([64, 128, 512]),
            page_size=rng.choice([1, 4]),
            disable_radix_cache=rng.random() < 0.3,
            chunked_prefill_size=rng.choice([8, 16, 64]),
            max_running_requests=rng.choice([2, 8]),
        )
        self.requests: dict[str, tuple[list[int], int]] = {}

    def act(self, name: str) -> None:
        getattr(self, f"_{name}")()
        self.core.check_invariants()

    def _submit(self) -> None:
        rng = self.rng
        rid = f"r{len(self.requests)}"
        # Prompts share prefixes often, so the prefix cache matches, splits and evicts.
        prefix = rng.choice([[], list(range(30, 38)), list(range(30, 46))])
        prompt = prefix + [rng.randrange(10, 400) for _ in range(rng.randint(1, 24))]
        max_new = rng.randint(1, 20)
        self.requests[rid] = (prompt, max_new)
        submit(
            self.core,
            rid,
            prompt,
            max_new,
            stream=rng.random() < 0.5,
            return_logprob=rng.random() < 0.5,
            return_entropy=rng.random() < 0.5,
        )

    def _step(self) -> None:
        for _ in range(self.rng.randint(1, 4)):
            self.core.run_step()

    def _pause(self) -> None:
        mode = self.rng.choice(["abort", "retract", "in_place", "wait", "keep"])
        clear = mode != "in_place" and self.rng.random() < 0.3
        timeout = self.rng.choice([None, None, 1e-6])
        control(self.core, self.sink, PauseGenerationReqInput(mode, clear, timeout))

    def _continue(self) -> None:
        control(self.core, self.sink, ContinueGenerationReqInput())

    def _flush(self) -> None:
        control(self.core, self.sink, FlushCacheReqInput())

    def _abort(self) -> None:
        rid = f"r{self.rng.randrange(len(self.requests) + 1)}"
        kind = self.rng.choice(["rid", "prefix", "all"])
        msg = AbortReq(rid=rid, abort_all=kind == "all", match_prefix=kind == "prefix")
        control(self.core, self.sink, msg)

    def _weights(self) -> None:
        rng, core = self.rng, self.core
        kind = rng.choice(["disk", "disk_refused", "tensor", "tensor_refused", "relabel"])
        version = f"v{rng.randrange(100)}"
        if kind.startswith("disk"):
            path = self.model_dir if kind == "disk" else "/no/such/checkpoint"
            msg: object = UpdateWeightFromDiskReqInput(path, weight_version=version)
        elif kind.startswith("tensor"):
            shape = core.weights.model.model.norm.weight.shape
            shape = shape if kind == "tensor" else (shape[0] + 1,)
            msg = UpdateWeightsFromTensorReqInput(
                [("model.norm.weight", torch.ones(shape))],
                flush_cache=rng.random() < 0.5,
                abort_all_requests=rng.random() < 0.2,
                weight_version=version,
            )
        else:
            msg = UpdateWeightVersionReqInput(version, abort_all_requests=rng.random() < 0.2)
        released = core.memory.weights_released() and kind != "relabel"
        reply = control(core, self.sink, msg)
        assert reply.success == (not kind.endswith("refused") and not released), reply

    def _memory(self) -> None:
        tags = self.rng.choice([None, ["kv_cache"], ["weights"]])
        if self.rng.random() < 0.5:
            control(self.core, self.sink, ReleaseMemoryOccupationReqInput(tags))
        else:
            control(self.core, self.sink, ResumeMemoryOccupationReqInput(tags))

    def finish_and_check(self) -> None:
        core, sink = self.core, self.sink
        control(core, sink, ResumeMemoryOccupationReqInput())
        control(core, sink, ContinueGenerationReqInput())
        run_until_idle(core)
        vocab = core.model_config.vocab_size
        for rid, (prompt, max_new) in self.requests.items():
            rec = sink.by_rid[rid]
            assert len(rec.finished_reasons) == 1, (rid, rec.finished_reasons)
            assert rec.messages_after_final == 0
            expected = expected_output(prompt, max_new, vocab)
            if rec.finished_reasons[0]["type"] == "abort":
                assert rec.output_ids == expected[: len(rec.output_ids)], rid
            else:
                assert rec.finished_reasons[0] == {"type": "length", "length": max_new}
                assert rec.output_ids == expected, rid
            if rec.entropies:
                assert rec.entropies == [FAKE_ENTROPY] * len(rec.output_ids)
            if rec.logprobs:
                assert len(rec.logprobs) == len(rec.output_ids)
        assert_no_leak(core)


def _run_seed(seed: int, model_dir: str, overlap: bool) -> tuple[int, int]:
    """(requests sent, decode steps launched ahead of a step in flight)."""
    episode = Episode(seed, model_dir, overlap)
    names = [n for n, _ in _ACTIONS]
    weights = [w for _, w in _ACTIONS]
    for _ in range(ACTIONS_PER_SEED):
        episode.act(episode.rng.choices(names, weights)[0])
    episode.finish_and_check()
    return len(episode.requests), episode.core.num_steps_ahead


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("first_seed", range(0, NUM_SEEDS, SEEDS_PER_CASE))
def test_random_interleavings_keep_invariants(
    model_dir: str, first_seed: int, overlap: bool
) -> None:
    seeds = range(first_seed, first_seed + SEEDS_PER_CASE)
    counts = [_run_seed(seed, model_dir, overlap) for seed in seeds]
    assert sum(n for n, _ in counts) > SEEDS_PER_CASE  # the episodes did submit work
    steps_ahead = sum(n for _, n in counts)
    assert steps_ahead > 0 if overlap else steps_ahead == 0
