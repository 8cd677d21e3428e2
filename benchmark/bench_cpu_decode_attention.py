"""Per-layer decode attention on CPU: the C++ paged kernel (reading the pool) vs SDPA over the
decode mirror (what ``--disable-cpu-attention-kernel`` runs).

SmolLM2-135M's heads (9 query heads, 3 KV heads, head dim 64). Each request's keys sit in the
pool as a real decode leaves them: its prompt's slots consecutive, then the tokens it decoded
in runs of ``--decode-run`` consecutive slots (the engine's decode runs on CPU, 32 slots: see
``ReqKV.alloc_decode``), the runs of the requests interleaved as the steps take them;
``--decode-run 1`` interleaves the decoded tokens one slot per request per step, as a pool
without decode runs (a GPU's, or before them) leaves them. SDPA gets the same keys
as the mirror holds them (dense ``[rows, len_cap, KVH, D]`` buckets read as transposed
``[b, KVH, len, D]`` views, with the key mask). Row lengths are drawn from ``[0.8 len, len]``.
Each measurement cycles over enough layers that their K/V exceed the last-level cache (as in a
real step, where every layer's K/V is read once). The two variants are interleaved in one
process and the medians compared, so the ratios hold on a shared host even when absolute times
drift::

    python benchmark/bench_cpu_decode_attention.py [--repeats 15]

Prints one line per (threads, dtype, batch, len): SDPA and kernel ms per layer, the ratio, and
the kernel's K/V read rate in GB/s.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sglang.srt.layers.attention.decode_kv_mirror import length_class
from sglang.srt.layers.cpu_decode_attention import decode_attention, load_kernel

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64
_CACHE_EXCEEDING_BYTES = 256 << 20  # K/V bytes cycled over per measurement
_MAX_LAYERS = 30
_DECODED_FRACTION = 0.4  # of each request's keys, decoded (interleaved slots)


@dataclass
class Layer:
    q: torch.Tensor  # [b, H*D]
    k_cache: torch.Tensor  # pool [slots, KVH, D]
    v_cache: torch.Tensor
    dense_k: torch.Tensor  # the mirror's view [b, KVH, max_len, D]
    dense_v: torch.Tensor


def _slot_table(lens: torch.Tensor, decode_run: int) -> torch.Tensor:
    """[b, max_len] slots: each row's prompt consecutive, then its decoded tokens from runs of
    ``decode_run`` consecutive slots, a row taking a new run when its last one is used up, in
    step order (slot 0 is the pool's dummy)."""
    batch, max_len = lens.numel(), int(lens.max())
    table = torch.zeros(batch, max_len, dtype=torch.int64)
    prompts = [int(n * (1 - _DECODED_FRACTION)) for n in lens.tolist()]
    next_slot = 1
    for i, n in enumerate(prompts):
        table[i, :n] = torch.arange(next_slot, next_slot + n)
        next_slot += n
    run_next, run_end = [0] * batch, [0] * batch
    for pos in range(max_len):  # decode steps: one slot per request that still grows
        for i in range(batch):
            if prompts[i] <= pos < int(lens[i]):
                if run_next[i] == run_end[i]:
                    run_next[i], run_end[i] = next_slot, next_slot + decode_run
                    next_slot += decode_run
                table[i, pos] = run_next[i]
                run_next[i] += 1
    return table


def _layers(
    batch: int, max_len: int, dtype: torch.dtype, decode_run: int
) -> tuple[list[Layer], torch.Tensor, torch.Tensor]:
    """Per layer its operands; the slot table and the lens [b] (the same for every layer)."""
    len_cap = length_class(max_len)
    bytes_per_layer = 2 * batch * len_cap * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize
    num_layers = min(_MAX_LAYERS, max(2, -(-_CACHE_EXCEEDING_BYTES // bytes_per_layer)))
    lens = torch.randint(max(1, int(0.8 * max_len)), max_len + 1, (batch,))
    lens[0] = max_len
    table = _slot_table(lens, decode_run)
    num_slots = int(table.max()) + 1
    layers = []
    for _ in range(num_layers):
        k_cache = torch.randn(num_slots, NUM_KV_HEADS, HEAD_DIM).to(dtype)
        v_cache = torch.randn(num_slots, NUM_KV_HEADS, HEAD_DIM).to(dtype)
        dense_k = torch.zeros(batch, len_cap, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
        dense_v = torch.zeros_like(dense_k)
        for i, n in enumerate(lens.tolist()):
            dense_k[i, :n] = k_cache[table[i, :n]]
            dense_v[i, :n] = v_cache[table[i, :n]]
        window = (slice(None), slice(0, max_len))
        q = torch.randn(batch, NUM_HEADS * HEAD_DIM).to(dtype)
        dense_k = dense_k[window].transpose(1, 2)
        dense_v = dense_v[window].transpose(1, 2)
        layers.append(Layer(q, k_cache, v_cache, dense_k, dense_v))
    return layers, table, lens


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


def bench(
    batch: int, max_len: int, dtype: torch.dtype, repeats: int, decode_run: int
) -> tuple[float, float, int]:
    """Median ms per layer of (SDPA, kernel), interleaved, and the K/V bytes one layer reads."""
    layers, table, lens = _layers(batch, max_len, dtype, decode_run)
    mask = (torch.arange(max_len)[None, :] < lens[:, None])[:, None, None, :]
    rows = torch.arange(batch)

    def run_sdpa() -> None:
        for layer in layers:
            _sdpa(layer.q, layer.dense_k, layer.dense_v, mask)

    def run_kernel() -> None:
        for layer in layers:
            decode_attention(
                layer.q, layer.k_cache, layer.v_cache, table, rows, lens, HEAD_DIM**-0.5
            )

    run_sdpa(), run_kernel()  # warm-up
    sdpa_ms, kernel_ms = [], []
    for _ in range(repeats):
        sdpa_ms.append(_time_per_layer(run_sdpa, len(layers)))
        kernel_ms.append(_time_per_layer(run_kernel, len(layers)))
    kv_bytes = 2 * int(lens.sum()) * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize
    return statistics.median(sdpa_ms), statistics.median(kernel_ms), kv_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--repeats",
        type=int,
        default=15,
        help="timed rounds per variant and case; the medians are compared (default: %(default)s)",
    )
    parser.add_argument(
        "--batches",
        type=int,
        nargs="+",
        default=[1, 16, 64],
        help="batch sizes (requests per call), space-separated (default: %(default)s)",
    )
    parser.add_argument(
        "--lens",
        type=int,
        nargs="+",
        default=[128, 512],
        help="longest key count per request, space-separated; row lengths are drawn from "
        "[0.8 len, len] (default: %(default)s)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[1, 2],
        help="torch CPU thread counts to run at, space-separated (default: %(default)s)",
    )
    parser.add_argument(
        "--decode-run",
        type=int,
        default=32,
        help="consecutive slots per run of a request's decoded tokens (the engine's decode "
        "runs on CPU: 32; 1 = one slot per request per step, interleaved) "
        "(default: %(default)s)",
    )
    args = parser.parse_args()
    if args.decode_run < 1:
        parser.error("--decode-run must be >= 1")
    if not load_kernel():
        raise SystemExit("the CPU decode-attention kernel could not be built")
    torch.manual_seed(0)
    print(f"{'threads':>7} {'dtype':>8} {'batch':>5} {'len':>5} {'SDPA ms':>8} "
          f"{'kernel ms':>9} {'SDPA/kernel':>11} {'kernel GB/s':>11}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for dtype in (torch.float32, torch.bfloat16):
            for batch in args.batches:
                for max_len in args.lens:
                    sdpa_ms, kernel_ms, kv_bytes = bench(
                        batch, max_len, dtype, args.repeats, args.decode_run
                    )
                    name = str(dtype).removeprefix("torch.")
                    rate = kv_bytes / kernel_ms / 1e6
                    print(f"{threads:>7} {name:>8} {batch:>5} {max_len:>5} {sdpa_ms:>8.3f} "
                          f"{kernel_ms:>9.3f} {sdpa_ms / kernel_ms:>10.2f}x {rate:>11.1f}",
                          flush=True)


if __name__ == "__main__":
    main()
