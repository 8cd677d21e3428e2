"""The CPU linear kernels vs oneDNN's packed product, on SmolLM2-135M's 121 layer matrices
(30 x QKV, O, gate/up, down, and the LM head): the brgemm kernel (layers/cpu_brgemm.py) at
every row count, the small-batch kernel (layers/cpu_gemv.py) at the rows it takes (1-4; on AVX2
hosts without AVX-512, 1-16).

Each measurement runs every matrix once, as a decode step does, so the weights stream from
memory (they exceed the last-level cache). The variants are interleaved in one process and the
medians compared, so the ratios hold on a shared host even when absolute times drift::

    python benchmark/bench_small_linear.py [--repeats 9] [--rows 1 2 4 16 64] [--threads 1 2]

Prints one line per (threads, dtype, rows): ms per step for each variant (``-`` where it does
not apply: the small-batch kernel above the rows it takes, bfloat16 brgemm blocks on a CPU without
AVX512-BF16 or with AMX), the weight read rate of the fastest in GB/s, and packed / variant.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from sglang.srt.layers import cpu_brgemm, cpu_gemv
from sglang.srt.layers.cpu_prepack import native_bf16_supported, packed_product

HIDDEN, INTERMEDIATE, QKV, VOCAB, LAYERS = 576, 1536, 960, 49152, 30
SHAPES = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]


def _medians_ms(fns: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median ms of each function, run interleaved."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up (the brgemm kernels are generated per shape)
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def _step(product: Callable[..., torch.Tensor], operands: list, inputs: dict) -> Callable:
    """Every matrix once: ``product(x, operand, None)`` with x of the matrix's in_features."""

    def run() -> None:
        for operand, k in operands:
            product(inputs[k], operand, None)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--repeats",
        type=int,
        default=9,
        help="timed rounds per variant (each one step over every matrix); medians compared "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--rows",
        type=int,
        nargs="+",
        default=[1, 2, 3, 4, 16, 64, 128],
        help="rows (tokens) of the input, space-separated (default: %(default)s)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[1, 2],
        help="torch CPU thread counts to run at, space-separated (default: %(default)s)",
    )
    args = parser.parse_args()
    has_gemv, has_brgemm = cpu_gemv.load_kernel(), cpu_brgemm.load_kernel()
    torch.manual_seed(0)
    shapes = SHAPES * LAYERS + [(VOCAB, HIDDEN)]
    print(
        f"{'threads':>7} {'dtype':>8} {'rows':>4} {'packed ms':>9} {'brgemm ms':>9} "
        f"{'gemv ms':>7} {'GB/s':>5} {'packed/brgemm':>13} {'packed/gemv':>11}"
    )
    for dtype in (torch.float32, torch.bfloat16):
        weights = [(torch.randn(n, k) * 0.05).to(dtype) for n, k in shapes]
        nbytes = sum(w.numel() for w in weights) * dtype.itemsize
        # Without native bfloat16 (an AVX2 host) the engine packs a float32 copy (upcast_bf16).
        upcast = dtype == torch.bfloat16 and not native_bf16_supported()
        packed = [
            (torch.ops.mkldnn._reorder_linear_weight(w.float() if upcast else w, 64), w.shape[1])
            for w in weights
        ]
        for threads in args.threads:
            torch.set_num_threads(threads)
            widths = [cpu_brgemm.blockable(w, threads) if has_brgemm else None for w in weights]
            blocks = []
            if all(widths):
                blocks = [
                    (cpu_brgemm.block_weight(w, nb), w.shape[1])
                    for w, nb in zip(weights, widths)
                    if nb is not None
                ]
            for rows in args.rows:
                inputs = {k: torch.randn(rows, k).to(dtype) for k in (HIDDEN, INTERMEDIATE)}
                fns = {"packed": _step(packed_product, packed, inputs)}
                if blocks:
                    fns["brgemm"] = _step(cpu_brgemm.blocked_linear, blocks, inputs)
                if has_gemv and rows <= cpu_gemv.max_rows():
                    plain = [(w, w.shape[1]) for w in weights]
                    fns["gemv"] = _step(cpu_gemv.small_linear, plain, inputs)
                ms = _medians_ms(fns, args.repeats)
                name = str(dtype).removeprefix("torch.")
                cols = [f"{ms[v]:>9.2f}" if v in ms else f"{'-':>9}" for v in ("packed", "brgemm")]
                cols.append(f"{ms['gemv']:>7.2f}" if "gemv" in ms else f"{'-':>7}")
                cols.append(f"{nbytes / min(ms.values()) / 1e6:>5.1f}")
                for v, width in (("brgemm", 12), ("gemv", 10)):
                    ratio = f"{ms['packed'] / ms[v]:.2f}x" if v in ms else "-"
                    cols.append(f"{ratio:>{width + 1}}")
                print(f"{threads:>7} {name:>8} {rows:>4} " + " ".join(cols), flush=True)


if __name__ == "__main__":
    main()
