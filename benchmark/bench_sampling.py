"""Per-step sampling cost: with vs without entropy, and the sampler vs a naive torch sequence.

For each batch size B (V = 151936 by default, random logits) it times one sampling step of the
engine's sampler (``Sampler.forward``: token + chosen logprob) without and with per-token
entropy, and the naive torch sequence a patched deployment runs (softmax, entropy, sort,
cumulative top-p mask, multinomial). Three workloads: ``plain`` (temperature 1, no
truncation, the usual RL rollout), ``trunc`` (temperature 0.7, top_k 50, top_p 0.9) and
``nucleus`` (temperature 1, top_p 0.95 without top-k: on these logits a nucleus of thousands
of tokens).

On CUDA the sampler is the fused Triton kernel (``--backend triton``, the default there); on
CPU it is the torch sampler (``pytorch``) with the C++ kernels the engine registers on CPU
(python/sglang/srt/layers/cpu_sampling.py: the Gumbel-max, the softmax statistics and the
top-p candidates), or with torch ops alone under ``--torch-ops``. Ratios compare timings of
the same run.

    python benchmark/bench_sampling.py                      # B in {1, 64, 256}
    python benchmark/bench_sampling.py --batch-sizes 1 8 --repeats 5
    python benchmark/bench_sampling.py --search-pivots 4 8 16   # tune the triton search
    python benchmark/bench_sampling.py --verify-compare         # verification on vs off

``--search-pivots`` (triton backend) instead times the ``trunc`` workload with each pivot count
per search launch (docs/sampling.md), interleaved, next to the naive sequence: the numbers
from which the kernel's GPU pivot count was chosen. The results do not depend on the count.
``--verify-compare`` (triton backend) times ``trunc`` with the kernel's verification of the
whole-row Gumbel-max (docs/sampling.md) on and off, interleaved, next to the naive sequence,
and prints the share of rows it settled (the kernel's default verifies only batches of more
than 4 rows on GPUs; this forces it on). The results are the same either way.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sglang.srt.layers.sampler import Sampler, use_cpu_kernels
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.sampling.sampling_params import SamplingParams

WORKLOADS = {
    "plain": {"temperature": 1.0},
    "trunc": {"temperature": 0.7, "top_k": 50, "top_p": 0.9},
    "nucleus": {"temperature": 1.0, "top_p": 0.95},
}


@dataclass
class _Req:
    sampling_params: SamplingParams
    sampling_seed: int
    origin_input_ids: range
    output_ids: list[int] = field(default_factory=list)
    eos_token_ids: set[int] = field(default_factory=set)
    grammar: None = None


def make_info(batch: int, vocab: int, params: dict, entropy: str | None, device: str):
    reqs = [_Req(SamplingParams(**params), i, range(100 + i)) for i in range(batch)]
    requests = None if entropy is None else [(entropy, None)] * batch
    return SamplingBatchInfo.from_reqs(reqs, vocab, device, requests)


def naive_step(logits: torch.Tensor, params: dict) -> torch.Tensor:
    """softmax -> entropy -> sort -> top-k/top-p mask -> renormalise -> multinomial."""
    probs = torch.softmax(logits.float() / params["temperature"], dim=-1)
    entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    keep = sorted_probs.cumsum(dim=-1) - sorted_probs < params.get("top_p", 1.0)
    if params.get("top_k", -1) > 0:
        keep[:, params["top_k"] :] = False
    sorted_probs = sorted_probs * keep
    choice = torch.multinomial(sorted_probs / sorted_probs.sum(-1, keepdim=True), 1)
    return order.gather(1, choice).squeeze(1) + 0 * entropy.long()


def timed(fns: list[Callable[[], object]], repeats: int, device: str) -> list[float]:
    """Median seconds of each of ``fns``, run interleaved (one round = each fn once, the order
    rotating from round to round) after a warm-up round, so that changes in machine load and
    cache state affect them alike."""
    times: list[list[float]] = [[] for _ in fns]
    for round_idx in range(repeats + 1):
        for k in range(len(fns)):
            i = (k + round_idx) % len(fns)
            fn, samples = fns[i], times[i]
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            if round_idx > 0:
                samples.append(time.perf_counter() - start)
    return [statistics.median(samples) for samples in times]


def random_logits(args: argparse.Namespace, batch: int) -> torch.Tensor:
    """[batch, vocab] logits of N(0, 9), seeded by the batch size, in ``args.dtype``."""
    gen = torch.Generator(device=args.device).manual_seed(batch)
    logits = torch.randn(batch, args.vocab, generator=gen, device=args.device) * 3
    return logits.to(getattr(torch, args.dtype))


def bench_one(args: argparse.Namespace, batch: int, name: str) -> str:
    params = WORKLOADS[name]
    logits = random_logits(args, batch)
    sampler = Sampler(args.backend)
    plain = make_info(batch, args.vocab, params, None, args.device)
    with_ent = make_info(batch, args.vocab, params, args.entropy_mode, args.device)
    t_plain, t_ent, t_naive = timed(
        [
            lambda: sampler.forward(logits, plain, True, None),
            lambda: sampler.forward(logits, with_ent, True, None),
            lambda: naive_step(logits, params),
        ],
        args.repeats * max(1, 16 // batch),  # small steps: more runs for a stable median
        args.device,
    )
    return (
        f"{batch:>5} {name:>7} {t_plain * 1e3:>11.2f} {t_ent * 1e3:>11.2f} "
        f"{t_ent / t_plain:>9.3f} {t_naive * 1e3:>11.2f} {t_naive / t_ent:>12.2f}"
    )


def bench_pivots(args: argparse.Namespace, batch: int) -> str:
    """``trunc`` at ``batch`` rows with each of ``args.search_pivots`` pivots per search launch,
    timed interleaved; one line of ms per count, then the naive sequence's."""
    from sgl_kernel import sampling as kernel

    params = WORKLOADS["trunc"]
    logits = random_logits(args, batch)
    info = make_info(batch, args.vocab, params, args.entropy_mode, args.device)
    sampler = Sampler("triton")
    default = kernel._tiling

    def with_pivots(num: int) -> Callable[[], object]:
        tiling = default(logits.device, args.vocab, batch)
        tiling = tiling._replace(num_pivots=num, searches=kernel._search_launches(num))

        def run() -> object:
            kernel._tiling = lambda device, vocab_size, num_rows: tiling
            try:
                return sampler.forward(logits, info, True, None)
            finally:
                kernel._tiling = default

        return run

    fns = [with_pivots(num) for num in args.search_pivots]
    fns.append(lambda: naive_step(logits, params))
    times = timed(fns, args.repeats * max(1, 16 // batch), args.device)
    cells = [f"{num}: {t * 1e3:.3f}" for num, t in zip(args.search_pivots, times)]
    cells.append(f"naive: {times[-1] * 1e3:.3f}")
    return f"{batch:>5}  trunc ms by pivots  " + "  ".join(cells)


def bench_verify(args: argparse.Namespace, batch: int) -> str:
    """``trunc`` at ``batch`` rows through the triton kernel with verification on and off,
    timed interleaved, then the naive sequence; and the share of rows verification settled."""
    from sgl_kernel import sampling as kernel

    params = WORKLOADS["trunc"]
    logits = random_logits(args, batch)
    info = make_info(batch, args.vocab, params, args.entropy_mode, args.device)
    plan = info.entropy_plan(args.entropy_mode, 0)
    on, off, naive = timed(
        [
            lambda: kernel.sample_triton(logits, info, True, None, plan, verify=True),
            lambda: kernel.sample_triton(logits, info, True, None, plan, verify=False),
            lambda: naive_step(logits, params),
        ],
        args.repeats * max(1, 16 // batch),
        args.device,
    )
    settled = kernel.settled_rows(logits, info, plan).float().mean().item()
    return (
        f"{batch:>5}  trunc ms  verify on {on * 1e3:.3f}  off {off * 1e3:.3f}  "
        f"naive {naive * 1e3:.3f}  (off/on {off / on:.2f}x, naive/on {naive / on:.2f}x; "
        f"{settled:.0%} of rows settled)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--batch-sizes",
        type=int,
        nargs="+",
        default=[1, 64, 256],
        help="rows (requests) per sampling step, space-separated (default: %(default)s)",
    )
    parser.add_argument(
        "--vocab",
        type=int,
        default=151936,
        help="vocabulary size: columns of the random logits (default: %(default)s)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="dtype of the logits (default: %(default)s)",
    )
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        choices=["cpu", "cuda"],
        help="device of the logits and the sampler (default: cuda when available, else cpu)",
    )
    parser.add_argument("--backend", default=None, help="pytorch or triton (default: by device)")
    parser.add_argument(
        "--entropy-mode",
        default="raw",
        choices=["raw", "scaled", "sampled"],
        help="entropy definition of the with-entropy runs: raw (softmax of the logits), "
        "scaled (after temperature) or sampled (over the truncated set) (default: %(default)s)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed rounds per variant, median reported; a batch of B < 16 rows gets 16 // B "
        "times as many (default: %(default)s)",
    )
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    parser.add_argument(
        "--torch-ops",
        action="store_true",
        help="CPU, pytorch backend: torch ops alone, without the C++ sampling kernels that the "
        "engine uses on CPU (as with its --disable-cpu-fused-ops)",
    )
    parser.add_argument(
        "--search-pivots",
        type=int,
        nargs="+",
        default=None,
        help="triton: time trunc with these pivot counts per search launch (powers of two)",
    )
    parser.add_argument(
        "--verify-compare",
        action="store_true",
        help="triton: time trunc with the kernel's verification on and off",
    )
    args = parser.parse_args()
    if args.backend is None:
        args.backend = "triton" if args.device == "cuda" else "pytorch"
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = "n/a"
    if args.device == "cpu" and args.backend == "pytorch":
        from sglang.srt.layers import cpu_sampling

        native = not args.torch_ops and cpu_sampling.load_kernel()
        use_cpu_kernels(cpu_sampling.KERNELS if native else None)
        kernels = "on" if native else "off"
    header = (
        f"backend={args.backend} device={args.device} cpu_kernels={kernels} V={args.vocab} "
        f"dtype={args.dtype} "
        f"entropy={args.entropy_mode} threads={torch.get_num_threads()} (median ms/step)\n"
        f"{'B':>5} {'work':>7} {'no entropy':>11} {'entropy':>11} {'ent/none':>9} "
        f"{'naive':>11} {'naive/ours':>12}"
    )
    if args.verify_compare:
        if args.backend != "triton":
            parser.error("--verify-compare needs the triton backend")
        print(header.splitlines()[0], flush=True)
        for batch in args.batch_sizes:
            print(bench_verify(args, batch), flush=True)
        return
    if args.search_pivots:
        if args.backend != "triton":
            parser.error("--search-pivots needs the triton backend")
        if any(n < 1 or n & (n - 1) for n in args.search_pivots):
            parser.error("--search-pivots takes powers of two")
        print(header.splitlines()[0], flush=True)
        for batch in args.batch_sizes:
            print(bench_pivots(args, batch), flush=True)
        return
    print(header, flush=True)
    for batch in args.batch_sizes:
        for name in WORKLOADS:
            print(bench_one(args, batch, name), flush=True)


if __name__ == "__main__":
    main()
