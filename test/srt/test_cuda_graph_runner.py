"""The padded static-buffer decode path of the CUDA graph runner, run without capture on CPU:
padding a decode batch up to a captured size changes no token and no logprob, also when the
batch shrinks and grows between steps (stale rows of a larger step must not write K/V into a
live request's slots); short prefills through it, a row per new token, equal eager prefills,
also through the scheduler (chunks, a cached prefix, a retract). The captured path itself is
checked on a GPU (test_cuda_graph_gpu.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from model_test_utils import RUNNER_SLOTS, TEST_DEVICE, BatchBuilder, make_runner
from scheduler_test_utils import OutputSink, assert_no_leak, control, run_until_idle, submit

from sglang.srt.managers.io_struct import ContinueGenerationReqInput, PauseGenerationReqInput
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.scheduler_process import build_scheduler
from sglang.srt.model_executor.cuda_graph_runner import DecodeGraphRunner
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.server_args import ServerArgs

SIZES = [1, 2, 4, 8]
PROMPTS = [[5, 17, 99, 3], [42, 8], [7, 7, 7, 7, 7, 7], [300, 12, 64], [1, 2, 3, 4, 5, 6, 7, 8]]
# Which requests decode at each step (the others wait, their KV kept, as in an in-place pause):
# padded sizes that shrink, grow and repeat (a size's static batch runs again, its inputs
# changed in place).
STEPS = [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [0, 1, 2], [0, 1, 2, 3, 4], [3], [3], [1, 4], [0]]


class Lane:
    """One runner and its own slots, decoding the prompts greedily; ``padded`` routes its
    decode steps (and with ``prefill`` its prefills) through a DecodeGraphRunner without
    capture."""

    def __init__(
        self, runner: ModelRunner, padded: bool, prefill: bool = False, sizes: list[int] = SIZES
    ) -> None:
        self.runner = runner
        self.builder = BatchBuilder(
            runner.model.config, dtype=runner.dtype, num_slots=RUNNER_SLOTS - 1, max_reqs=8
        )
        self.graphs = (
            DecodeGraphRunner(
                runner._forward_eager,
                self.builder.req_to_token_pool,
                sizes,
                "cpu",
                capture=False,
                prefill=prefill,
            )
            if padded
            else None
        )
        self.last: list[int] = []

    def prefill(self, reqs: list[tuple[int, list[int]]] | None = None) -> torch.Tensor:
        """Prefill ``reqs`` (request index, new tokens; default: every prompt): after a
        cached prefix for a request prefilled before."""
        if reqs is None:
            reqs = list(enumerate(PROMPTS))
        batch = self.builder.extend([(f"r{i}", tokens) for i, tokens in reqs])
        if self.graphs is not None and self.graphs.prefill:
            assert self.graphs.can_run(batch)
            before = self.graphs.num_prefill_replays
            logits = self.graphs.run(batch).next_token_logits
            assert self.graphs.num_prefill_replays == before + 1
        else:
            logits = self.runner.forward(batch).next_token_logits
        assert logits.shape[0] == len(reqs)  # a row per request: its last new token's
        self.last += [0] * (len(PROMPTS) - len(self.last))
        for (i, _), token in zip(reqs, logits.argmax(-1).tolist()):
            self.last[i] = token
        return logits

    def decode(self, which: list[int]) -> torch.Tensor:
        batch = self.builder.decode([(f"r{i}", self.last[i]) for i in which])
        if self.graphs is None:
            logits = self.runner.forward(batch).next_token_logits
        else:
            assert self.graphs.can_run(batch)
            logits = self.graphs.run(batch).next_token_logits.clone()
            size = self.graphs.padded_size(len(which))
            # The padding rows wrote only to the reserved slot.
            assert self.graphs.out_cache_loc[len(which) : size].eq(0).all()
        for i, token in zip(which, logits.argmax(-1).tolist()):
            self.last[i] = token
        return logits


def _assert_same_steps(steps: list[tuple[torch.Tensor, torch.Tensor]], deterministic: bool) -> None:
    """Each step's (eager, padded) logits give the same tokens; in deterministic mode the same
    logprob bits (batch-invariant products and per-query attention, row by row: padding rows
    and prefill rows change nothing), else within 1e-5."""
    for want, got in steps:
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        want_lp, got_lp = want.log_softmax(-1), got.log_softmax(-1)
        if deterministic:
            assert torch.equal(got_lp, want_lp)
        else:
            torch.testing.assert_close(got_lp, want_lp, rtol=0, atol=1e-5)


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_padding_changes_no_token_and_no_logprob(
    tiny_model_dir: Callable[..., Path], deterministic: bool
) -> None:
    path = tiny_model_dir()
    # The torch ops, not the CPU fused kernels: what CUDA runs.
    kwargs: dict = {"disable_cpu_fused_ops": True}
    if deterministic:
        kwargs["enable_deterministic_inference"] = True
    eager = Lane(make_runner(path, **kwargs), padded=False)
    padded = Lane(make_runner(path, **kwargs), padded=True)
    steps = [(eager.prefill(), padded.prefill())]
    steps += [(eager.decode(which), padded.decode(which)) for which in STEPS]
    _assert_same_steps(steps, deterministic)


# CPU runners with the Triton attention backend: Triton's interpreter, which the test conftest
# switches on only without a GPU. On a GPU, test_cuda_graph_gpu checks prefill graphs.
needs_interpreter = pytest.mark.skipif(
    TEST_DEVICE != "cpu", reason="CPU runners with Triton's interpreter"
)


@needs_interpreter
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_short_prefills_through_the_graphs_equal_eager_prefills(
    tiny_model_dir: Callable[..., Path], deterministic: bool
) -> None:
    """Prefills replayed a row per new token (as on CUDA, with the Triton attention backend):
    four prompts (15 tokens, padded to 16 rows), then two requests going on after their cached
    prefixes (5 tokens, padded to 8), then decode steps reading the K/V those prefills stored.
    The same tokens as eager prefills, and in deterministic mode the same bits."""
    path = tiny_model_dir()
    kwargs: dict = {"disable_cpu_fused_ops": True, "attention_backend": "triton"}
    if deterministic:
        kwargs["enable_deterministic_inference"] = True
    sizes = [1, 2, 4, 8, 16]
    eager = Lane(make_runner(path, **kwargs), padded=False)
    padded = Lane(make_runner(path, **kwargs), padded=True, prefill=True, sizes=sizes)
    prompts = list(enumerate(PROMPTS[:4]))
    steps = [(eager.prefill(prompts), padded.prefill(prompts))]
    more = [(0, [11, 12, 13]), (3, [14, 15])]
    steps.append((eager.prefill(more), padded.prefill(more)))
    steps += [(eager.decode(which), padded.decode(which)) for which in ([0, 1, 2, 3], [3, 0])]
    assert padded.graphs is not None and padded.graphs.num_prefill_replays == 2
    _assert_same_steps(steps, deterministic)


def test_runner_takes_only_graph_batches(tiny_model_dir: Callable[..., Path]) -> None:
    lane = Lane(make_runner(tiny_model_dir()), padded=True)
    graphs = lane.graphs
    assert graphs is not None
    prefill = lane.builder.extend([("a", [1, 2, 3])])
    assert not graphs.can_run(prefill)  # prefill runs eagerly
    lane.runner.forward(prefill)
    assert graphs.can_run(lane.builder.decode([("a", 4)]))
    with_lora = lane.builder.decode([("a", 5)])
    with_lora.lora_names = ["adapter"]
    assert not graphs.can_run(with_lora)
    assert [graphs.padded_size(b) for b in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    with_prefill = DecodeGraphRunner(
        lane.runner._forward_eager, lane.builder.req_to_token_pool, SIZES, "cpu",
        capture=False, prefill=True,
    )  # fmt: skip
    assert with_prefill.can_run(lane.builder.extend([("c", [1, 2]), ("d", [3, 4, 5, 6, 7, 8])]))
    assert not with_prefill.can_run(lane.builder.extend([("e", list(range(1, 10)))]))  # 9 > 8
    with_prompt_logprobs = lane.builder.extend([("f", [1, 2, 3])])
    with_prompt_logprobs.input_logprob_rows = torch.tensor([0, 1])
    assert not with_prefill.can_run(with_prompt_logprobs)
    exact = DecodeGraphRunner(
        lane.runner._forward_eager, lane.builder.req_to_token_pool, [1, 4], "cpu",
        capture=False, pad=False,
    )  # fmt: skip
    assert exact.can_run(lane.builder.decode([("a", 6)]))
    lane.builder.extend([("b", [9])])
    assert not exact.can_run(lane.builder.decode([("a", 7), ("b", 8)]))  # 2 is not captured


def test_capture_sizes_from_server_args(tiny_model_dir: Callable[..., Path]) -> None:
    path = str(tiny_model_dir())
    assert ServerArgs(model_path=path).cuda_graph_batch_sizes(256)[:6] == [1, 2, 4, 8, 16, 24]
    assert ServerArgs(model_path=path).cuda_graph_batch_sizes(256)[-1] == 256
    assert ServerArgs(model_path=path).cuda_graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert ServerArgs(model_path=path, cuda_graph_max_bs=12).cuda_graph_batch_sizes(64) == [
        1, 2, 4, 8, 12,
    ]  # fmt: skip
    assert ServerArgs(model_path=path).cuda_graph_batch_sizes(3) == [1, 2, 3]
    args = ServerArgs(model_path=path, cuda_graph_bs=[16, 3, 3, 1])
    assert args.cuda_graph_bs == [1, 3, 16]
    assert args.cuda_graph_batch_sizes(8) == [1, 3]
    for bad in ({"cuda_graph_bs": [0, 2]}, {"cuda_graph_bs": [True]}, {"cuda_graph_max_bs": 0}):
        with pytest.raises(ValueError, match="cuda-graph"):
            ServerArgs(model_path=path, **bad)


def test_a_pass_reads_positions_changed_in_place(tiny_model_dir: Callable[..., Path]) -> None:
    """A replayed graph reads its static inputs afresh: no module may carry a result across
    forward passes keyed by the identity of an input tensor (RotaryEmbedding once reused its
    cos/sin gather when a pass had the same ``positions`` tensor as the pass before, so a
    capture recorded no gather). Here the same batch object runs twice, its positions
    changed in place in between, as a graph's static buffers are. The torch ops (not the CPU
    fused kernels) are the CUDA path."""
    lane = Lane(make_runner(tiny_model_dir(), disable_cpu_fused_ops=True), padded=False)
    lane.runner.forward(lane.builder.extend([("a", [5, 6, 7, 8, 9, 10, 11, 12])]))
    batch = lane.builder.decode([("a", 13)])
    real = batch.positions.clone()
    want = lane.runner.forward(replace(batch, positions=real)).next_token_logits.clone()
    batch.positions.zero_()
    lane.runner.forward(batch)  # a pass at position 0 (its K/V is rewritten below)
    batch.positions.copy_(real)
    assert torch.equal(lane.runner.forward(batch).next_token_logits, want)


def _scheduler(model_dir: Path, graphs: bool) -> tuple[Scheduler, OutputSink]:
    """A scheduler over the real model in deterministic mode with the Triton attention backend
    (the CUDA configuration), 8-token prefill chunks; ``graphs``: its model runner's steps go
    through a DecodeGraphRunner without capture, prefills included, as on CUDA."""
    sink = OutputSink()
    args = ServerArgs(
        model_path=str(model_dir), device="cpu", random_seed=0, max_total_tokens=1024,
        attention_backend="triton", enable_deterministic_inference=True,
        chunked_prefill_size=8, log_level="error",
    )  # fmt: skip
    core = build_scheduler(args, sink.on_output, sink.on_reply)
    runner = core.runner
    assert runner.graph_runner is None  # not on CPU: attached here
    if graphs:
        runner.graph_runner = DecodeGraphRunner(
            runner._forward_eager, runner.req_to_token_pool, [1, 2, 4, 8], "cpu",
            capture=False, prefill=True,
        )  # fmt: skip
    return core, sink


@needs_interpreter
def test_scheduler_with_prefill_graphs_gives_the_bits_of_eager_prefills(
    tiny_model_dir: Callable[..., Path],
) -> None:
    """Through the scheduler: prompts prefilled a row per token (short ones whole, a long one
    in 8-token chunks), a prompt matched in the prefix cache, and requests retracted and
    prefilled again with their outputs: the same tokens and logprobs, to the bit, as eager
    prefills, and nothing leaked."""
    path = tiny_model_dir()
    prompts = [[5, 17, 99], [42, 8, 7, 7, 7], list(range(30, 50)), [5, 17, 99, 4]]
    runs = {}
    for graphs in (False, True):
        core, sink = _scheduler(path, graphs)
        for i, prompt in enumerate(prompts[:3]):
            submit(core, f"r{i}", prompt, 10, return_logprob=True)
        for _ in range(4):
            core.run_step()
        reply = control(core, sink, PauseGenerationReqInput(mode="retract"))
        assert reply.num_retracted == 3
        control(core, sink, ContinueGenerationReqInput())
        run_until_idle(core)
        submit(core, "r3", prompts[3], 6, return_logprob=True)  # its first 3 tokens cached
        run_until_idle(core)
        assert_no_leak(core)
        graph_runner = core.runner.graph_runner
        if graph_runner is not None:
            # The retracted requests came back with prompt + output (at most 8 tokens each,
            # or in chunks), r3 after its cached prefix: all replayed.
            assert graph_runner.num_prefill_replays >= 4
        runs[graphs] = {rid: (r.output_ids, r.logprobs) for rid, r in sink.by_rid.items()}
    assert runs[True] == runs[False]
    assert all(len(ids) == n for (ids, _), n in zip(runs[True].values(), [10, 10, 10, 6]))
