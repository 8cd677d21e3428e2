"""Host and GPU cost per call of the fused Triton kernels of a CUDA decoder layer, against the
torch ops they replace, at SmolLM2-135M's shapes (bfloat16).

An eager step (prefill, or decode with ``--disable-cuda-graph``) pays each op's host launch
cost; a replayed CUDA graph pays only its GPU time. For each op and row count the script
prints both: ``host us`` (wall time of 300 back-to-back eager calls, divided by 300: the
launch cost when it exceeds the GPU time) and ``gpu us`` (the same 300 calls captured in one
CUDA graph and replayed).

    python benchmark/bench_cuda_launch.py [--rows 1 32 512]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from sgl_kernel import fused_elementwise as fe
from sgl_kernel.batch_invariant import paged_attention_per_query
from sgl_kernel.decode_attention import paged_decode_attention
from sglang.srt.layers.layernorm import rms_norm
from sglang.srt.layers.rotary_embedding import get_rope

CALLS = 300
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 576, 9, 3, 64, 1536


def per_call_us(fn: Callable[[], object]) -> tuple[float, float]:
    """(host us, gpu us) per call of ``fn``: eager wall time, then CUDA-graph replay time."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    torch.cuda.synchronize()
    host = (time.perf_counter() - start) / CALLS * 1e6
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(CALLS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    return host, (time.perf_counter() - start) / CALLS * 1e6


def cases(rows: int) -> dict[str, Callable[[], object]]:
    """Each op at ``rows`` tokens: the fused kernel and the torch ops (decode attention: the
    split kernel and the per-query kernel, both at 300 keys per token)."""
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(rows, HIDDEN, device=dev, dtype=dt)
    res = torch.randn_like(x)
    w = torch.randn(HIDDEN, device=dev, dtype=dt)
    qk = torch.randn(rows, (HEADS + KV_HEADS) * HEAD_DIM, device=dev, dtype=dt)
    pos = torch.full((rows,), 300, device=dev)  # each token the 301st of its request
    rope = get_rope(HEAD_DIM, 100000.0, 8192).to(dev)
    table = rope.cos_sin_table(qk.device)
    gate_up = torch.randn(rows, 2 * INTER, device=dev, dtype=dt)
    slots = 301 * rows + 64
    k_buf = torch.zeros(slots, KV_HEADS, HEAD_DIM, device=dev, dtype=dt)
    v_buf = torch.zeros_like(k_buf)
    kv = torch.randn(rows, KV_HEADS, HEAD_DIM, device=dev, dtype=dt)
    loc = torch.arange(rows, device=dev) * 301 + 300
    req_to_token = torch.arange(slots - 64, device=dev).view(rows, 301)
    q = torch.randn(rows, HEADS, HEAD_DIM, device=dev, dtype=dt)
    pool_rows = torch.arange(rows, device=dev)
    attn = (q, k_buf, v_buf, req_to_token, pool_rows, pos, 0.125)

    def torch_store() -> None:
        k_buf.index_copy_(0, loc, kv)
        v_buf.index_copy_(0, loc, kv)

    return {
        "add+rmsnorm fused": lambda: fe.add_rms_norm(x, res, w, 1e-5),
        "add+rmsnorm torch": lambda: rms_norm(x + res, w, 1e-5),
        "rope fused": lambda: fe.rope(qk, pos, table, HEAD_DIM, HEAD_DIM),
        "rope torch": lambda: rope._rotate(qk, *rope._cos_sin_at(pos)),
        "silu*mul fused": lambda: fe.silu_and_mul(gate_up),
        "silu*mul torch": lambda: F.silu(gate_up[:, :INTER]) * gate_up[:, INTER:],
        "store k/v fused": lambda: fe.store_kv(k_buf, v_buf, loc, kv, kv),
        "store k/v torch": torch_store,
        "decode attn split": lambda: paged_decode_attention(*attn),
        "decode attn per-query": lambda: paged_attention_per_query(*attn),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rows",
        type=int,
        nargs="+",
        default=[1, 32, 512],
        help="token rows per op call, space-separated (default: %(default)s)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_cuda_launch.py needs a CUDA device")
    print(f"{torch.cuda.get_device_name()}, bfloat16, SmolLM2-135M's shapes, {CALLS} calls")
    print(f"{'op':>22} {'rows':>5} {'host us':>8} {'gpu us':>7}")
    with torch.inference_mode():
        for rows in args.rows:
            for name, fn in cases(rows).items():
                host, gpu = per_call_us(fn)
                print(f"{name:>22} {rows:>5} {host:8.1f} {gpu:7.1f}")


if __name__ == "__main__":
    main()
