"""LoRA delta of one decoder layer's projections: the segment-grouped Triton kernels
(sglang.srt.lora.triton_ops) against the torch path of sglang.srt.lora.layers, same process,
same inputs; ratios are torch time / kernel time (> 1: the kernels are faster).

    python benchmark/bench_lora_kernels.py                      # CUDA, SmolLM2-135M shapes
    python benchmark/bench_lora_kernels.py --hidden 4096 --intermediate 14336 --q-size 4096 \\
        --kv-size 1024 --rank 64 --max-rank 128

Per batch size B (rows of the step), two workloads: ``decode`` (B one-row requests, adapters in
turn, so no two neighbours share one) and ``prefill`` (B rows in one contiguous request per
adapter). Torch paths, as layers.py runs them: ``loop`` (per adapter: index_select, two matmuls,
index_add_) and ``bmm`` (groups padded to one [G, n_max] table: two bmm, one index_add_).
Per-batch setup (segments, row groups) is built once outside the timing, as the engine does once
per step. Needs CUDA: the Triton interpreter's times on CPU mean nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from sglang.srt.lora.triton_ops import (
    build_lora_segments,
    lora_expand,
    lora_shrink,
    triton_lora_available,
)


def timed(fns: list[Callable[[], object]], repeats: int, iters: int) -> list[float]:
    """Median seconds per call of each of ``fns``: each sample is ``iters`` back-to-back calls
    between two synchronizations (launch overhead included, as in an uncaptured step); the
    functions run interleaved, order rotating, after a warm-up round."""
    samples: list[list[float]] = [[] for _ in fns]
    for round_idx in range(repeats + 1):
        for j in range(len(fns)):
            i = (j + round_idx) % len(fns)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(iters):
                fns[i]()
            torch.cuda.synchronize()
            if round_idx > 0:
                samples[i].append((time.perf_counter() - start) / iters)
    return [statistics.median(s) for s in samples]


def requests_for(workload: str, num_rows: int, num_adapters: int) -> list[tuple[int, int, int]]:
    """(row_start, row_len, slot) of each request of the step."""
    if workload == "decode":
        return [(i, 1, i % num_adapters) for i in range(num_rows)]
    per = -(-num_rows // num_adapters)
    starts = range(0, num_rows, per)
    return [(s, min(per, num_rows - s), i) for i, s in enumerate(starts)]


Groups = list[tuple[int, torch.Tensor]]  # (slot, rows of x) per adapter of the step
Table = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def torch_loop(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, width: int, groups: Groups, out: torch.Tensor
) -> None:
    """layers.py's per-adapter path."""
    for slot, rows in groups:
        delta = (x.index_select(0, rows) @ a[slot, :width].T) @ b[slot, :, :width].T
        out.index_add_(0, rows, delta)


def padded_table(groups: Groups, device: str) -> Table:
    """layers.py's padded grouping: rows [G * n_max] (padding repeats a real row), mask, slots."""
    n_max = max(rows.numel() for _, rows in groups)
    rows = [torch.cat([r, r[:1].expand(n_max - r.numel())]) for _, r in groups]
    mask = [torch.arange(n_max, device=device) < r.numel() for _, r in groups]
    slots = torch.tensor([s for s, _ in groups], device=device)
    return torch.cat(rows), torch.cat(mask).unsqueeze(1), slots


def torch_bmm(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, width: int, table: Table, out: torch.Tensor
) -> None:
    """layers.py's padded path (``_apply_padded``)."""
    rows, mask, slots = table
    xs = x.index_select(0, rows).view(slots.numel(), -1, x.shape[1])
    a_g = a.index_select(0, slots)[:, :width]
    b_g = b.index_select(0, slots)[:, :, :width]
    delta = torch.bmm(torch.bmm(xs, a_g.transpose(1, 2)), b_g.transpose(1, 2))
    out.index_add_(0, rows, delta.view(-1, b.shape[1]) * mask)


def bench_projection(
    args: argparse.Namespace, name: str, k: int, shards: list[int], num_rows: int, workload: str
) -> str:
    n, dev, dtype = len(shards), args.device, getattr(torch, args.dtype)
    num_out, width, w_max = sum(shards), n * args.rank, n * args.max_rank
    gen = torch.Generator(device=dev).manual_seed(num_rows)
    a = torch.randn(args.num_adapters, w_max, k, generator=gen, device=dev).to(dtype) / k**0.5
    b = torch.zeros(args.num_adapters, num_out, w_max, device=dev, dtype=dtype)
    offsets = [sum(shards[:s]) for s in range(n)]
    for s, (off, size) in enumerate(zip(offsets, shards)):  # layers.py's fused layout
        cols = slice(s * args.rank, (s + 1) * args.rank)
        b[:, off : off + size, cols] = torch.randn(
            args.num_adapters, size, args.rank, generator=gen, device=dev
        ).to(dtype)
    x = torch.randn(num_rows, k, generator=gen, device=dev).to(dtype)
    out = torch.zeros(num_rows, num_out, device=dev, dtype=dtype)
    widths = torch.full((args.num_adapters,), width, dtype=torch.int32, device=dev)

    requests = requests_for(workload, num_rows, args.num_adapters)
    segments = build_lora_segments(requests, dev)
    by_slot: dict[int, list[int]] = {}
    for start, length, slot in requests:
        by_slot.setdefault(slot, []).extend(range(start, start + length))
    groups = [(s, torch.tensor(r, device=dev)) for s, r in sorted(by_slot.items())]
    table = padded_table(groups, dev)

    def kernels(target: torch.Tensor) -> None:
        lora_expand(lora_shrink(x, a, widths, segments), b, widths, segments, target, offsets)

    # Same delta from every path before timing (they round differently: a loose bound).
    results = [torch.zeros_like(out) for _ in range(3)]
    kernels(results[0])
    torch_loop(x, a, b, width, groups, results[1])
    torch_bmm(x, a, b, width, table, results[2])
    for other in results[1:]:
        torch.testing.assert_close(results[0].float(), other.float(), atol=0.1, rtol=0.05)

    t_kernel, t_loop, t_bmm = timed(
        [
            lambda: kernels(out),
            lambda: torch_loop(x, a, b, width, groups, out),
            lambda: torch_bmm(x, a, b, width, table, out),
        ],
        args.repeats,
        args.iters,
    )
    return (
        f"{name:>8} {workload:>8} {num_rows:>5} {t_kernel * 1e6:>10.1f} {t_loop * 1e6:>10.1f} "
        f"{t_bmm * 1e6:>10.1f} {t_loop / t_kernel:>8.2f} {t_bmm / t_kernel:>8.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device",
        default="cuda",
        choices=["cuda"],
        help="device to run on (only cuda is supported)",
    )
    parser.add_argument(
        "--batch-sizes",
        type=int,
        nargs="+",
        default=[1, 64, 256],
        help="rows per step (B), space-separated (default: %(default)s)",
    )
    parser.add_argument(
        "--hidden",
        type=int,
        default=576,
        help="model hidden size (qkv and gate_up input, o and down output) (default: %(default)s)",
    )
    parser.add_argument(
        "--intermediate",
        type=int,
        default=1536,
        help="MLP intermediate size (gate and up output each, down input) (default: %(default)s)",
    )
    parser.add_argument("--q-size", type=int, default=576, help="heads * head_dim")
    parser.add_argument("--kv-size", type=int, default=192, help="kv heads * head_dim")
    parser.add_argument(
        "--rank",
        type=int,
        default=16,
        help="the adapters' LoRA rank, at most --max-rank (default: %(default)s)",
    )
    parser.add_argument("--max-rank", type=int, default=64, help="the slot pool's rank")
    parser.add_argument(
        "--num-adapters",
        type=int,
        default=4,
        help="adapters in the pool, shared out among the step's requests (default: %(default)s)",
    )
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["float32", "bfloat16"],
        help="dtype of the weights and activations (default: %(default)s)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=7,
        help="timing samples per path, after a warm-up round; the median is reported "
        "(default: %(default)s)",
    )
    parser.add_argument("--iters", type=int, default=20, help="calls per timing sample")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device on this machine")
    if not triton_lora_available(args.device):
        parser.error("triton is not installed")
    if not 0 < args.rank <= args.max_rank:
        parser.error("need 0 < --rank <= --max-rank")

    h, inter = args.hidden, args.intermediate
    projections = [
        ("qkv", h, [args.q_size, args.kv_size, args.kv_size]),
        ("o", args.q_size, [h]),
        ("gate_up", h, [inter, inter]),
        ("down", inter, [h]),
    ]
    print(f"{torch.cuda.get_device_name()}  {args.dtype}  rank {args.rank} in a rank-"
          f"{args.max_rank} pool, {args.num_adapters} adapters; times in us per call")  # fmt: skip
    print(f"{'proj':>8} {'workload':>8} {'B':>5} {'triton':>10} {'loop':>10} {'bmm':>10} "
          f"{'loop/tr':>8} {'bmm/tr':>8}")  # fmt: skip
    for workload in ("decode", "prefill"):
        for num_rows in args.batch_sizes:
            for name, k, shards in projections:
                print(bench_projection(args, name, k, shards, num_rows, workload), flush=True)


if __name__ == "__main__":
    main()
