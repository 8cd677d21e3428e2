"""Where a step's time goes: the offline workload of bench_offline_throughput.py run through a
Scheduler in this process (no frontend), each step timed whole and its forward + sampling
launch (``launch_batch_generation``) apart, grouped by kind and batch size. The rest of a step
is the scheduler's own work: batch selection, KV bookkeeping, waiting for and committing the
sampled tokens and building the output message. With the overlap schedule (CUDA, unless
``--disable-overlap-schedule``) a decode step's launch returns before its GPU work is done and
the step commits the one before it.

    python benchmark/bench_step_breakdown.py --model-path models/SmolLM2-135M-Instruct \\
        [--dtype bfloat16] [--profile-step 40]

``--profile-step N`` (repeatable) also prints torch.profiler's op table for step N (ops' own CPU
time). ``--num-prompts``, ``--min-input``/``--max-input`` and ``--min-output``/``--max-output``
shape the workload as in bench_offline_throughput.py (same defaults). ``--host-profile`` prints
where batch-1 decode's host time goes (cProfile, the functions with the most own time).

On CUDA (``--device cuda``, the default when there is a GPU) it also times batch-1 decode
alone: each step's host time with the overlap schedule on and off (interleaved rounds in this
process) and, from a torch.profiler trace of ``--idle-steps`` steps, the time the GPU ran
kernels and the gaps in between (launch overhead, host work, syncs), and the kernels that took
the most GPU time.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import pstats
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_offline_throughput import add_workload_shape_args, flush_prefix_cache, make_workload

from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.managers.schedule_batch import ForwardMode
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.scheduler_process import build_scheduler
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.gc_freeze import freeze_startup_heap


def submit(core: Scheduler, rid: str, ids: list[int], max_new_tokens: int) -> None:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)
    params.normalize()
    core.process_input_requests([TokenizedGenerateReqInput(rid, "", ids, params)])


def batch_class(size: int) -> str:
    if size > 64:
        return "65+"
    return "1" if size == 1 else "2-8" if size <= 8 else "9-32" if size <= 32 else "33-64"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", required=True, help="model directory (Hugging Face layout)")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["float32", "bfloat16"],
        help="model dtype (default: %(default)s)",
    )
    parser.add_argument(
        "--threads", type=int, default=2, help="torch CPU threads (default: %(default)s)"
    )
    add_workload_shape_args(parser)
    parser.add_argument(
        "--profile-step",
        type=int,
        action="append",
        default=[],
        help="also print torch.profiler's op table for this step of the workload (0-based, "
        "warm-up not counted); repeatable",
    )
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        choices=["cpu", "cuda"],
        help="the engine's device (default: cuda when available, else cpu); cuda adds the batch-1 "
        "decode timing",
    )
    parser.add_argument(
        "--idle-steps", type=int, default=50, help="CUDA: batch-1 decode steps traced for gaps"
    )
    parser.add_argument(
        "--disable-cuda-graph", action="store_true", help="the engine's flag (CUDA)"
    )
    parser.add_argument(
        "--disable-overlap-schedule", action="store_true", help="the engine's flag (CUDA)"
    )
    parser.add_argument(
        "--host-profile",
        action="store_true",
        help="CUDA: cProfile batch-1 decode steps, print the top functions by own time",
    )
    parser.add_argument(
        "--chunked-prefill-size", type=int, default=None, help="the engine's flag (default 8192)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    work_args = argparse.Namespace(
        seed=0,
        num_prompts=args.num_prompts,
        min_input=args.min_input,
        max_input=args.max_input,
        min_output=args.min_output,
        max_output=args.max_output,
        group_size=args.group_size,
        shared_prefix=args.shared_prefix,
    )
    server_args = ServerArgs(
        model_path=args.model_path,
        dtype=args.dtype,
        device=args.device,
        disable_cuda_graph=args.disable_cuda_graph,
        disable_overlap_schedule=args.disable_overlap_schedule,
        random_seed=0,
        log_level="warning",
        chunked_prefill_size=args.chunked_prefill_size,
    )
    core = build_scheduler(server_args, lambda msg: None, lambda msg: None)
    # As the scheduler process does once started: without it, Python's full collections walk
    # every start-up object in this process (3.6% of the main thread's samples over decode
    # steps in a perf profile, bfloat16, 33-64 requests).
    freeze_startup_heap("bench_step_breakdown")
    work = make_workload(work_args, core.model_config.vocab_size)
    submit(core, "warm-up", work[0][0], 8)
    while core.has_runnable_work():
        core.run_step()
    flush_prefix_cache(core)  # the timed run is not served from the cache (as the engine's)

    forward_s: dict[str, float] = {}
    run_forward = core.worker.launch_batch_generation

    def timed_forward(*a: Any, **kw: Any) -> Any:
        start = time.perf_counter()
        out = run_forward(*a, **kw)
        forward_s["last"] = time.perf_counter() - start
        return out

    core.worker.launch_batch_generation = timed_forward  # type: ignore[method-assign]
    for i, (ids, n) in enumerate(work):
        submit(core, f"r{i}", ids, n)
    steps: collections.Counter[tuple[str, str]] = collections.Counter()
    step_s: collections.Counter[tuple[str, str]] = collections.Counter()
    fwd_s: collections.Counter[tuple[str, str]] = collections.Counter()
    start = time.perf_counter()
    while core.has_runnable_work():
        t0 = time.perf_counter()
        if sum(steps.values()) in args.profile_step:
            with torch.profiler.profile() as prof:
                ran = core.run_step()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        else:
            ran = core.run_step()
        elapsed = time.perf_counter() - t0
        if not ran:
            continue
        batch = core.last_batch
        kind = "prefill" if batch.forward_mode == ForwardMode.EXTEND else "decode"
        key = (kind, batch_class(len(batch.reqs)))
        steps[key] += 1
        step_s[key] += elapsed
        fwd_s[key] += forward_s["last"]
    total = time.perf_counter() - start
    out_tokens = sum(n for _, n in work)
    print(f"{total:.1f} s, {out_tokens / total:.1f} output tokens/s (in process, no frontend)")
    print(
        f"{'kind':>8} {'batch':>5} {'steps':>5} {'total s':>8} {'ms/step':>8} "
        f"{'launch ms':>17} {'scheduler ms':>12}"
    )
    for key in sorted(steps):
        n = steps[key]
        print(
            f"{key[0]:>8} {key[1]:>5} {n:>5} {step_s[key]:>8.2f} {1e3 * step_s[key] / n:>8.1f} "
            f"{1e3 * fwd_s[key] / n:>17.1f} {1e3 * (step_s[key] - fwd_s[key]) / n:>12.2f}"
        )
    if args.device == "cuda":
        gpu_gaps(core, args.idle_steps, args.host_profile)


def gpu_gaps(core: Scheduler, num_steps: int, host_profile: bool) -> None:
    """Batch-1 decode on CUDA: host time per step (untraced), GPU kernel time vs gaps and the
    costliest kernels over ``num_steps`` traced steps; with ``host_profile`` also a cProfile
    of ``num_steps`` more steps."""
    submit(core, "gaps", [11, 22, 33, 44], 9 * num_steps + 40)
    for _ in range(20):  # prefill and warm-up decode steps
        core.run_step()
    overlap = core.overlap
    walls: dict[bool, list[float]] = {True: [], False: []}
    for mode in (True, False) * 3 if overlap else (False,):
        core.overlap = mode
        core.run_step()  # the first step of a mode may commit the step the last one left
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(num_steps):
            core.run_step()
        walls[mode].append((time.perf_counter() - start) / num_steps)
    core.overlap = overlap
    for mode, times in walls.items():
        if times:
            ms = 1e3 * min(times)
            label = "overlap on " if mode else "overlap off"
            print(f"cuda batch-1 decode, {label}: {ms:.3f} ms/step ({1e3 / ms:.0f} tok/s), best "
                  f"of {len(times)} rounds of {num_steps}, untraced")
    wall = min(walls[overlap])
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(num_steps):
            core.run_step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels)
    print(f"cuda batch-1 decode traced with the overlap schedule {'on' if overlap else 'off'}"
          f" ({1e3 * wall:.3f} ms/step untraced)")
    if spans:
        busy, end = 0.0, float("-inf")
        for s0, s1 in spans:  # the union of kernel intervals (us)
            busy += max(0.0, s1 - max(s0, end))
            end = max(end, s1)
        span = max(s1 for _, s1 in spans) - spans[0][0]
        print(
            f"cuda batch-1 decode traced: {len(spans) / num_steps:.0f} kernels/step, GPU busy "
            f"{busy / 1e3 / num_steps:.3f} ms/step, idle {100 * (1 - busy / span):.0f}% of "
            f"{span / 1e3 / num_steps:.3f} ms/step"
        )
        per_name: collections.Counter[str] = collections.Counter()
        calls: collections.Counter[str] = collections.Counter()
        for e in kernels:
            per_name[e["name"][:90]] += e["dur"]
            calls[e["name"][:90]] += 1
        print(f"{'us/step':>8} {'calls/step':>10}  kernel")
        for name, dur in per_name.most_common(15):
            print(f"{dur / num_steps:8.1f} {calls[name] / num_steps:10.1f}  {name}")
    if host_profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(num_steps):
            core.run_step()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    while core.has_runnable_work():
        core.run_step()


if __name__ == "__main__":
    main()
