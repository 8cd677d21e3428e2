"""The CPU decode loop (models/llama_cpu_decode.py) against the module path, in one process.

A Scheduler in this process prefills ``--num-requests`` random prompts of ``--min-input`` to
``--max-input`` tokens, then times decode steps in rounds that alternate the loop and the
module path (the model runner's ``cpu_decode_loop`` set and cleared), so both see the same
machine and the same, slowly growing, sequences. Prints each round and the ratio of the
medians (module path time / loop time: above 1, the loop is faster)::

    python benchmark/bench_cpu_decode_loop.py --model-path models/SmolLM2-135M-Instruct \\
        [--dtype bfloat16] [--num-requests 1 16 48]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
from bench_step_breakdown import submit

from sglang.srt.managers.schedule_batch import ForwardMode
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.scheduler_process import build_scheduler
from sglang.srt.server_args import ServerArgs


def step_times(
    core: Scheduler, num_requests: int, steps: int, rounds: int
) -> dict[bool, list[float]]:
    """Seconds a decode step, per round, with the loop (True) and without it (False)."""
    runner = core.worker.model_runner
    loop = runner.cpu_decode_loop
    if loop is None:
        raise SystemExit("the model runner did not build the CPU decode loop (see its log)")
    while not (
        core.last_batch is not None
        and core.last_batch.forward_mode == ForwardMode.DECODE
        and len(core.last_batch.reqs) == num_requests
    ):
        core.run_step()
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(rounds):
        use_loop = i % 2 == 0
        runner.cpu_decode_loop = loop if use_loop else None
        core.run_step()  # the switch's first step, untimed
        start = time.perf_counter()
        for _ in range(steps):
            core.run_step()
        times[use_loop].append((time.perf_counter() - start) / steps)
    runner.cpu_decode_loop = loop
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", required=True, help="model directory (Hugging Face layout)")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="model dtype (default: %(default)s)",
    )
    parser.add_argument(
        "--threads", type=int, default=2, help="torch CPU threads (default: %(default)s)"
    )
    parser.add_argument(
        "--num-requests",
        type=int,
        nargs="+",
        default=[1, 16, 48],
        help="requests decoding together, space-separated; a fresh scheduler for each "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--min-input",
        type=int,
        default=250,
        help="shortest random prompt, tokens (default: %(default)s)",
    )
    parser.add_argument(
        "--max-input",
        type=int,
        default=450,
        help="longest random prompt, tokens (default: %(default)s)",
    )
    parser.add_argument("--steps", type=int, default=30, help="decode steps a round")
    parser.add_argument("--rounds", type=int, default=8, help="rounds, alternating the paths")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    server_args = ServerArgs(
        model_path=args.model_path, dtype=args.dtype, device="cpu", random_seed=0
    )
    generator = torch.Generator().manual_seed(0)
    for num_requests in args.num_requests:
        core = build_scheduler(server_args, lambda msg: None, lambda msg: None)
        for i in range(num_requests):
            length = int(
                torch.randint(args.min_input, args.max_input + 1, (1,), generator=generator)
            )
            ids = torch.randint(100, 10_000, (length,), generator=generator).tolist()
            # Enough new tokens for every round; the requests are dropped with the scheduler.
            submit(core, f"r{i}", ids, 4 * args.steps * args.rounds)
        times = step_times(core, num_requests, args.steps, args.rounds)
        looped, modules = statistics.median(times[True]), statistics.median(times[False])
        rounds = " ".join(f"{t * 1e3:.1f}/{m * 1e3:.1f}" for t, m in zip(times[True], times[False]))
        print(
            f"{args.dtype}, {num_requests} requests: loop/modules ms a step by round {rounds}; "
            f"medians {looped * 1e3:.2f} vs {modules * 1e3:.2f} ms: {modules / looped:.3f}x",
            flush=True,
        )
        del core
        gc.collect()  # the next scheduler's KV pool is sized from the free memory


if __name__ == "__main__":
    main()
