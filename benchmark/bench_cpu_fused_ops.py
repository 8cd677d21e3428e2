"""The CPU fused elementwise kernels (layers/cpu_fused_ops.py) against the torch ops they
replace, per call, at SmolLM2-135M's widths, in one process (interleaved medians):

    python benchmark/bench_cpu_fused_ops.py [--threads 2] [--rows 1 64 2048]

Pieces: add + RMSNorm (hidden 576), SiLU-and-mul (intermediate 1536), RoPE on q and k side by
side (9 + 3 heads of 64, a slice of the qkv output), the K/V store into a pool of 20,000 slots
(3 KV heads of 64). Prints microseconds per call and torch / kernel.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from sglang.srt.layers import cpu_fused_ops
from sglang.srt.layers.layernorm import rms_norm
from sglang.srt.layers.rotary_embedding import RotaryEmbedding, _base_inv_freq

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, SLOTS = 576, 1536, 9, 3, 64, 20_000


def median_us(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def pieces(rows: int, dtype: torch.dtype) -> dict[str, tuple[Callable, Callable]]:
    """name -> (torch version, kernel version) on fresh operands of ``rows`` tokens."""
    x, residual = torch.randn(rows, HIDDEN).to(dtype), torch.randn(rows, HIDDEN).to(dtype)
    weight = torch.randn(HIDDEN).to(dtype)
    gate_up = torch.randn(rows, 2 * INTERMEDIATE).to(dtype)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(dtype)
    qk_width = (HEADS + KV_HEADS) * HEAD_DIM
    qk = qkv[:, :qk_width]
    rope = RotaryEmbedding(HEAD_DIM, HEAD_DIM, 8192, _base_inv_freq(10000.0, HEAD_DIM))
    positions = torch.randint(0, 8192, (rows,))
    k_cache = torch.zeros(SLOTS, KV_HEADS, HEAD_DIM, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    loc = torch.randperm(SLOTS)[:rows]
    k = qkv[:, HEADS * HEAD_DIM : qk_width].view(rows, KV_HEADS, HEAD_DIM)
    v = qkv[:, qk_width:].view(rows, KV_HEADS, HEAD_DIM)

    def torch_norm() -> object:
        summed = x + residual
        return rms_norm(summed, weight, 1e-5), summed

    def torch_rope() -> object:
        # the same positions tensor every call: its (cos, sin) gather is cached, as it is for
        # all layers but the first of a forward pass
        return rope.rotate(positions, qk)

    def torch_store() -> None:
        k_cache.index_copy_(0, loc, k)
        v_cache.index_copy_(0, loc, v)

    return {
        "add+RMSNorm": (torch_norm, lambda: cpu_fused_ops.add_rms_norm(x, residual, weight, 1e-5)),
        "SiLU*up": (
            lambda: F.silu(gate_up[:, :INTERMEDIATE]) * gate_up[:, INTERMEDIATE:],
            lambda: cpu_fused_ops.silu_and_mul(gate_up),
        ),
        "RoPE q+k": (
            torch_rope,
            lambda: cpu_fused_ops.rope(qk, positions, rope._cos_sin, HEAD_DIM, HEAD_DIM),
        ),
        "K/V store": (
            torch_store,
            lambda: cpu_fused_ops.store_kv(k_cache, v_cache, loc, k, v),
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].rstrip(":") + ".")
    parser.add_argument(
        "--threads", type=int, default=2, help="torch CPU threads (default: %(default)s)"
    )
    parser.add_argument(
        "--rows",
        type=int,
        nargs="+",
        default=[1, 64, 2048],
        help="token rows per call, space-separated (default: %(default)s)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_fused_ops.load_kernel():
        raise SystemExit("the fused kernels could not be built on this host")
    print(f"{'dtype':9} {'rows':>5} {'piece':12} {'torch us':>10} {'kernel us':>10} {'ratio':>6}")
    for dtype in (torch.float32, torch.bfloat16):
        for rows in args.rows:
            reps = 300 if rows <= 64 else 15
            for name, (base, fused) in pieces(rows, dtype).items():
                base(), fused()  # warm-up
                base_us, fused_us = [], []
                for _ in range(3):  # interleaved rounds, so drift hits both alike
                    base_us.append(median_us(base, reps))
                    fused_us.append(median_us(fused, reps))
                b, f = statistics.median(base_us), statistics.median(fused_us)
                label = str(dtype).removeprefix("torch.")
                print(f"{label:9} {rows:>5} {name:12} {b:>10.1f} {f:>10.1f} {b / f:>5.2f}x")


if __name__ == "__main__":
    main()
