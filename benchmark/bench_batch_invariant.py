"""Cost of the batch-invariant Triton kernels (deterministic mode on CUDA) against torch's own
ops, same process and shapes, as ratios (kernel time / torch time; > 1 means slower).

    python benchmark/bench_batch_invariant.py                # CUDA, SmolLM2-135M shapes
    python benchmark/bench_batch_invariant.py --hidden 4096 --heads 32 --kv-heads 8 --dtype bfloat16

Rows: every linear of one decoder layer plus the LM head at decode batch sizes and a prefill;
RMSNorm; per-query paged attention against SDPA over the same (contiguous) keys. On CPU it runs
under TRITON_INTERPRET=1 with small shapes only (a smoke test: interpreter times mean nothing).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable


def _time(fn: Callable[[], object], repeat: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--hidden",
        type=int,
        default=576,
        help="model hidden size: the linears' and RMSNorm's width; ignored on CPU "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--intermediate",
        type=int,
        default=1536,
        help="MLP intermediate size (gate/up output, down input); ignored on CPU "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--heads",
        type=int,
        default=9,
        help="query heads; head dim = hidden / heads (default: %(default)s)",
    )
    parser.add_argument(
        "--kv-heads",
        type=int,
        default=3,
        help="key/value heads (grouped-query attention; also sizes the QKV linear) "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--vocab",
        type=int,
        default=49152,
        help="vocabulary size: the LM head's output rows; ignored on CPU (default: %(default)s)",
    )
    parser.add_argument("--context", type=int, default=1024, help="keys per request (attention)")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["float32", "bfloat16"],
        help="dtype of every operand (default: %(default)s)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=20,
        help="timed calls per measurement, after one warm-up call; 1 on CPU (default: %(default)s)",
    )
    args = parser.parse_args()
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # before sgl_kernel is imported
        args.hidden, args.intermediate, args.vocab, args.context, args.repeat = 64, 128, 256, 40, 1
    import torch.nn.functional as F

    from sgl_kernel.batch_invariant import matmul_batch_invariant, rms_norm_batch_invariant

    device, dtype = ("cuda" if cuda else "cpu"), getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    head_dim = args.hidden // args.heads
    qkv = (args.heads + 2 * args.kv_heads) * head_dim
    shapes = [(qkv, args.hidden), (args.hidden, args.hidden), (2 * args.intermediate, args.hidden),
              (args.hidden, args.intermediate), (args.vocab, args.hidden)]  # fmt: skip
    print(f"device {device}, dtype {args.dtype}; ratio = batch-invariant kernel / torch")
    for rows in (1, 8, 64, 512):
        total_bi = total_ref = 0.0
        for out_features, in_features in shapes:
            x = torch.randn(rows, in_features, device=device, dtype=dtype)
            w = torch.randn(out_features, in_features, device=device, dtype=dtype)
            total_bi += _time(lambda x=x, w=w: matmul_batch_invariant(x, w), args.repeat, sync)
            total_ref += _time(lambda x=x, w=w: F.linear(x, w), args.repeat, sync)
        print(f"linears of a layer + lm_head, {rows:4d} rows: {total_bi / total_ref:6.2f}x")

    x = torch.randn(512, args.hidden, device=device, dtype=dtype)
    w = torch.ones(args.hidden, device=device, dtype=dtype)
    bi = _time(lambda: rms_norm_batch_invariant(x, w, 1e-6), args.repeat, sync)
    ref = _time(lambda: F.rms_norm(x, (args.hidden,), w, 1e-6), args.repeat, sync)
    print(f"rms_norm, 512 rows: {bi / ref:6.2f}x")

    for batch in (1, 32):
        ratio = _attention_ratio(args, batch, head_dim, device, dtype, sync)
        print(f"decode attention, batch {batch:3d} x {args.context} keys: {ratio:6.2f}x")


def _attention_ratio(
    args: argparse.Namespace,
    batch: int,
    head_dim: int,
    device: str,
    dtype: object,
    sync: Callable[[], None],
) -> float:
    """Per-query paged kernel vs SDPA for ``batch`` decode queries over ``args.context`` keys."""
    import torch
    import torch.nn.functional as F

    from sgl_kernel.batch_invariant import paged_attention_per_query

    slots = batch * args.context
    k = torch.randn(slots, args.kv_heads, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    table = torch.arange(slots, device=device).view(batch, args.context)
    q = torch.randn(batch, args.heads, head_dim, device=device, dtype=dtype)
    rows = torch.arange(batch, device=device)
    positions = torch.full((batch,), args.context - 1, device=device)
    scale = head_dim**-0.5
    kernel = _time(
        lambda: paged_attention_per_query(q, k, v, table, rows, positions, scale), args.repeat, sync
    )
    keys = k.view(batch, args.context, args.kv_heads, head_dim).transpose(1, 2)
    values = v.view(batch, args.context, args.kv_heads, head_dim).transpose(1, 2)
    query = q.view(batch, args.heads, 1, head_dim)
    reference = _time(
        lambda: F.scaled_dot_product_attention(query, keys, values, scale=scale, enable_gqa=True),
        args.repeat,
        sync,
    )
    return kernel / reference

if __name__ == "__main__":
    main()
