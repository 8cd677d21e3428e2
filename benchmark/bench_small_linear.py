"""The CPU small-batch linear kernel (layers/cpu_gemv.py) vs oneDNN's packed product, on
SmolLM2-135M's 121 layer matrices (30 x QKV, O, gate/up, down, and the LM head).

Each measurement runs every matrix once, as a decode step does, so the weights stream from
memory (they exceed the last-level cache). The two variants are interleaved in one process and
the medians compared, so the ratios hold on a shared host even when absolute times drift::

    python benchmark/bench_small_linear.py [--repeats 9] [--rows 1 2 3 4] [--threads 1 2]

Prints one line per (threads, dtype, rows): ms per step for each, the kernel's weight read
rate in GB/s, and packed / kernel.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from sglang.srt.layers import cpu_gemv
from sglang.srt.layers.cpu_prepack import packed_product

HIDDEN, INTERMEDIATE, QKV, VOCAB, LAYERS = 576, 1536, 960, 49152, 30
SHAPES = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]


def _median_ms(
    fn: Callable[[], None], other: Callable[[], None], repeats: int
) -> tuple[float, float]:
    """Medians of fn and other, interleaved, in ms."""
    fn(), other()  # warm-up
    first, second = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        first.append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        other()
        second.append((time.perf_counter() - start) * 1e3)
    return statistics.median(first), statistics.median(second)


def bench(
    weights: list[torch.Tensor],
    packed: list[torch.Tensor],
    inputs: dict[int, torch.Tensor],
    repeats: int,
) -> tuple[float, float]:
    """Median ms of (kernel, packed) over every matrix once, interleaved."""

    def run_kernel() -> None:
        for w in weights:
            cpu_gemv.small_linear(inputs[w.shape[1]], w, None)

    def run_packed() -> None:
        for p, w in zip(packed, weights):
            packed_product(inputs[w.shape[1]], p, None)

    return _median_ms(run_kernel, run_packed, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    if not cpu_gemv.load_kernel():
        raise SystemExit("the CPU small-batch linear kernel could not be built")
    torch.manual_seed(0)
    shapes = SHAPES * LAYERS + [(VOCAB, HIDDEN)]
    print(f"{'threads':>7} {'dtype':>8} {'rows':>4} {'kernel ms':>9} {'GB/s':>5} "
          f"{'packed ms':>9} {'packed/kernel':>13}")
    for dtype in (torch.float32, torch.bfloat16):
        weights = [(torch.randn(n, k) * 0.05).to(dtype) for n, k in shapes]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
        nbytes = sum(w.numel() for w in weights) * dtype.itemsize
        for threads in args.threads:
            torch.set_num_threads(threads)
            for rows in args.rows:
                inputs = {k: torch.randn(rows, k).to(dtype) for k in (HIDDEN, INTERMEDIATE)}
                kernel_ms, packed_ms = bench(weights, packed, inputs, args.repeats)
                name = str(dtype).removeprefix("torch.")
                print(f"{threads:>7} {name:>8} {rows:>4} {kernel_ms:>9.2f} "
                      f"{nbytes / kernel_ms / 1e6:>5.1f} {packed_ms:>9.2f} "
                      f"{packed_ms / kernel_ms:>12.2f}x", flush=True)


if __name__ == "__main__":
    main()
