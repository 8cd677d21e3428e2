"""Per-layer decode attention on CPU: the C++ kernel vs SDPA, both reading the decode mirror.

The K/V of each layer are laid out like a decode-mirror bucket (``[rows, len_cap, KVH, D]``,
read as transposed ``[b, KVH, len, D]`` views) with SmolLM2-135M's heads (9 query heads, 3 KV
heads, head dim 64). Row lengths are drawn from ``[0.8 len, len]``, so SDPA gets the key mask
that the backend gives it. Each measurement cycles over enough layers that their K/V exceed
the last-level cache (as in a real step, where every layer's K/V is read once). The two
variants are interleaved in one process and the medians compared, so the ratios hold on a
shared host even when absolute times drift::

    python benchmark/bench_cpu_decode_attention.py [--repeats 15]

Prints one line per (threads, dtype, batch, len): SDPA and kernel ms per layer and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from sglang.srt.layers.attention.decode_kv_mirror import length_class
from sglang.srt.layers.cpu_decode_attention import decode_attention, load_kernel

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64
_CACHE_EXCEEDING_BYTES = 256 << 20  # K/V bytes cycled over per measurement
_MAX_LAYERS = 30


def _layers(batch: int, max_len: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
    """Per layer: q [b, H*D], keys/values mirror views [b, KVH, max_len, D], lens, mask."""
    len_cap = length_class(max_len)
    bytes_per_layer = 2 * batch * len_cap * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize
    num_layers = min(_MAX_LAYERS, max(2, -(-_CACHE_EXCEEDING_BYTES // bytes_per_layer)))
    lens = torch.randint(max(1, int(0.8 * max_len)), max_len + 1, (batch,))
    lens[0] = max_len
    mask = (torch.arange(max_len)[None, :] < lens[:, None])[:, None, None, :]
    layers = []
    for _ in range(num_layers):
        k = torch.randn(batch, len_cap, NUM_KV_HEADS, HEAD_DIM).to(dtype)
        v = torch.randn(batch, len_cap, NUM_KV_HEADS, HEAD_DIM).to(dtype)
        q = torch.randn(batch, NUM_HEADS * HEAD_DIM).to(dtype)
        window = (slice(None), slice(0, max_len))
        layers.append((q, k[window].transpose(1, 2), v[window].transpose(1, 2), lens, mask))
    return layers


def _sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> None:
    """The backend's SDPA call (``_sdpa_decode``)."""
    batch = q.shape[0]
    F.scaled_dot_product_attention(
        q.reshape(batch, NUM_KV_HEADS, -1, HEAD_DIM),
        keys.to(q.dtype),
        values.to(q.dtype),
        attn_mask=mask,
        scale=HEAD_DIM**-0.5,
    )


def _time_per_layer(fn: Callable[[], None], num_layers: int) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) / num_layers * 1e3


def bench(batch: int, max_len: int, dtype: torch.dtype, repeats: int) -> tuple[float, float]:
    """Median ms per layer of (SDPA, kernel), interleaved."""
    layers = _layers(batch, max_len, dtype)

    def run_sdpa() -> None:
        for q, keys, values, _, mask in layers:
            _sdpa(q, keys, values, mask)

    def run_kernel() -> None:
        for q, keys, values, lens, _ in layers:
            decode_attention(q, keys, values, lens, HEAD_DIM**-0.5)

    run_sdpa(), run_kernel()  # warm-up
    sdpa_ms, kernel_ms = [], []
    for _ in range(repeats):
        sdpa_ms.append(_time_per_layer(run_sdpa, len(layers)))
        kernel_ms.append(_time_per_layer(run_kernel, len(layers)))
    return statistics.median(sdpa_ms), statistics.median(kernel_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--lens", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    if not load_kernel():
        raise SystemExit("the CPU decode-attention kernel could not be built")
    torch.manual_seed(0)
    print(f"{'threads':>7} {'dtype':>8} {'batch':>5} {'len':>5} {'SDPA ms':>8} "
          f"{'kernel ms':>9} {'SDPA/kernel':>11}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for dtype in (torch.float32, torch.bfloat16):
            for batch in args.batches:
                for max_len in args.lens:
                    sdpa_ms, kernel_ms = bench(batch, max_len, dtype, args.repeats)
                    name = str(dtype).removeprefix("torch.")
                    print(f"{threads:>7} {name:>8} {batch:>5} {max_len:>5} {sdpa_ms:>8.3f} "
                          f"{kernel_ms:>9.3f} {sdpa_ms / kernel_ms:>10.2f}x", flush=True)


if __name__ == "__main__":
    main()
