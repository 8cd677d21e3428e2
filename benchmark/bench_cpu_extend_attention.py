"""Per-layer prefill (EXTEND) attention on CPU: the C++ kernel vs the backend's SDPA loop, and
in bfloat16 on an AMX host its brgemm (tile) path vs its ``vdpbf16ps`` path.

Each batch is laid out as the engine lays it out: one layer's K/V pool ``[S, KVH, D]`` with
SmolLM2-135M's heads (9 query heads, 3 KV heads, head dim 64), every request's tokens in
scattered slots named by a request-to-token table, the new tokens' K/V already stored. The
SDPA loop is ``TorchNativeAttnBackend.forward_extend``'s fallback: per request one SDPA call,
``is_causal`` over the new K/V without a prefix, else the request's whole K/V gathered with
``index_select`` and an explicit bottom-right causal mask (built once per batch, as the
backend's metadata does). The kernel is one call for the batch. Each measurement cycles over a
few layers; the two variants are interleaved in one process and the medians compared, so the
ratios hold on a shared host even when absolute times drift::

    python benchmark/bench_cpu_extend_attention.py [--repeats 9]

Prints one line per (threads, dtype, batch): SDPA and kernel ms per layer and the ratio (the
kernel as the engine runs it: the tile path where :func:`tiles_supported`); where the tile path
runs, also the ``vdpbf16ps`` path's ms and its time over the tile path's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sglang.srt.layers.cpu_extend_attention import extend_attention, load_kernel, tiles_supported

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64
SCALE = HEAD_DIM**-0.5
_NUM_LAYERS = 4


@dataclass
class Batch:
    """One batch's operands for every layer (the table and lengths are shared)."""

    name: str
    prefix_lens: list[int]
    extend_lens: list[int]
    req_to_token: torch.Tensor  # [B, max_ctx]
    layers: list[tuple[torch.Tensor, ...]]  # per layer: q, k_new, v_new, k_cache, v_cache
    masks: list[torch.Tensor | None]  # per request: bottom-right causal mask with a prefix


def make_batch(
    name: str, prefix_lens: list[int], extend_lens: list[int], dtype: torch.dtype
) -> Batch:
    """Random operands in scattered pool slots; the new tokens' K/V stored in the pool."""
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    size = sum(seq_lens) + 1
    slots = torch.randperm(size - 1) + 1
    table = torch.zeros(len(seq_lens), max(seq_lens), dtype=torch.int64)
    start = 0
    for row, seq_len in enumerate(seq_lens):
        table[row, :seq_len] = slots[start : start + seq_len]
        start += seq_len
    new_slots = torch.cat([table[i, p:s] for i, (p, s) in enumerate(zip(prefix_lens, seq_lens))])
    layers = []
    for _ in range(_NUM_LAYERS):
        k_cache = torch.randn(size, NUM_KV_HEADS, HEAD_DIM).to(dtype)
        v_cache = torch.randn(size, NUM_KV_HEADS, HEAD_DIM).to(dtype)
        q = torch.randn(len(new_slots), NUM_HEADS * HEAD_DIM).to(dtype)
        layers.append((q, k_cache[new_slots], v_cache[new_slots], k_cache, v_cache))
    masks: list[torch.Tensor | None] = []
    for prefix, seq_len in zip(prefix_lens, seq_lens):
        if prefix == 0:
            masks.append(None)
        else:
            masks.append(torch.arange(seq_len)[None, :] <= torch.arange(prefix, seq_len)[:, None])
    return Batch(name, prefix_lens, extend_lens, table, layers, masks)


def sdpa_loop(batch: Batch, layer: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The backend's fallback: one SDPA call per request."""
    q_all, k_new, v_new, k_cache, v_cache = layer
    q_all = q_all.view(-1, NUM_HEADS, HEAD_DIM)
    out = torch.empty_like(q_all)
    start = 0
    for row, (prefix, new_len) in enumerate(zip(batch.prefix_lens, batch.extend_lens)):
        end = start + new_len
        mask = batch.masks[row]
        if mask is None:
            keys, values = k_new[start:end], v_new[start:end]
        else:
            slot_ids = batch.req_to_token[row, : prefix + new_len]
            keys = k_cache.index_select(0, slot_ids)
            values = v_cache.index_select(0, slot_ids)
        seg = F.scaled_dot_product_attention(
            q_all[start:end].transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=SCALE,
            enable_gqa=True,
        )
        out[start:end] = seg.squeeze(0).transpose(0, 1)
        start = end
    return out.view(-1, NUM_HEADS * HEAD_DIM)


def _time_per_layer(fn: Callable[[], None], num_layers: int) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) / num_layers * 1e3


def bench(batch: Batch, repeats: int) -> tuple[float, float, float | None]:
    """Median ms per layer of (SDPA loop, kernel, the kernel's vdpbf16ps path where the tile
    path is the default, else None), interleaved."""
    rows = torch.arange(len(batch.extend_lens))
    prefix_lens, extend_lens = torch.tensor(batch.prefix_lens), torch.tensor(batch.extend_lens)

    def run_sdpa() -> None:
        for layer in batch.layers:
            sdpa_loop(batch, layer)

    def run_kernel(tiles: bool | None = None) -> None:
        for q, _, _, k_cache, v_cache in batch.layers:
            extend_attention(
                q, k_cache, v_cache, batch.req_to_token, rows, prefix_lens, extend_lens, SCALE,
                tiles,
            )

    with_dot = batch.layers[0][0].dtype == torch.bfloat16 and tiles_supported()
    run_sdpa(), run_kernel(), with_dot and run_kernel(False)  # warm-up
    sdpa_ms, kernel_ms, dot_ms = [], [], []
    for _ in range(repeats):
        sdpa_ms.append(_time_per_layer(run_sdpa, len(batch.layers)))
        kernel_ms.append(_time_per_layer(run_kernel, len(batch.layers)))
        if with_dot:
            dot_ms.append(_time_per_layer(lambda: run_kernel(False), len(batch.layers)))
    dot = statistics.median(dot_ms) if dot_ms else None
    return statistics.median(sdpa_ms), statistics.median(kernel_ms), dot


def workloads() -> list[tuple[str, list[int], list[int]]]:
    """(name, prefix lens, extend lens) of the measured batches."""
    mixed = torch.randint(150, 251, (24,)).tolist()
    return [
        ("8 x 400", [0] * 8, [400] * 8),
        ("24 x ~200", [0] * 24, mixed),
        ("1 x 2000", [0], [2000]),
        ("4 x 100 after 300", [300] * 4, [100] * 4),
        ("40 x 20-400", [0] * 40, torch.randint(20, 401, (40,)).tolist()),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--repeats",
        type=int,
        default=9,
        help="timed rounds per variant and batch; the medians are compared (default: %(default)s)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[1, 2],
        help="torch CPU thread counts to run at, space-separated (default: %(default)s)",
    )
    args = parser.parse_args()
    if not load_kernel():
        raise SystemExit("the CPU prefill-attention kernel could not be built")
    torch.manual_seed(0)
    cases = workloads()
    print(f"{'threads':>7} {'dtype':>8} {'batch':>18} {'SDPA ms':>8} {'kernel ms':>9} "
          f"{'SDPA/kernel':>11} {'dot ms':>8} {'dot/kernel':>7}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for dtype in (torch.float32, torch.bfloat16):
            for name, prefix_lens, extend_lens in cases:
                batch = make_batch(name, prefix_lens, extend_lens, dtype)
                sdpa_ms, kernel_ms, dot_ms = bench(batch, args.repeats)
                dtype_name = str(dtype).removeprefix("torch.")
                dot = "" if dot_ms is None else f" {dot_ms:>8.2f} {dot_ms / kernel_ms:>6.2f}x"
                print(f"{threads:>7} {dtype_name:>8} {name:>18} {sdpa_ms:>8.2f} "
                      f"{kernel_ms:>9.2f} {sdpa_ms / kernel_ms:>10.2f}x{dot}", flush=True)


if __name__ == "__main__":
    main()
