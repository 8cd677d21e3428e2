"""Throwaway work at start-up, so that the first requests do not pay one-time costs.

:func:`dummy_prefill` builds a prefill whose K/V all go to the pool's dummy slot (no request
owns it), for warm-up forward passes: the torch.compile warm-up (cpu_torch_compile.py) and
:func:`warm_up_cpu_memory`.

:func:`warm_up_cpu_memory` (CPU with the torch_native attention backend, outside
deterministic mode, unless ``--disable-cpu-malloc-tuning``) touches the memory a serving
process will write anyway, before the first request:

- the first slots of the KV pool (four prefill chunks' worth, 32,768 with the default
  ``--chunked-prefill-size``; the allocator hands out the lowest free slots first, and the
  radix cache keeps filling the pool until it is full, so every slot is written sooner or
  later);
- the heap's working size: a prefill of one chunk through the first three decoder layers only
  grows the heap to what a full prefill chunk needs (each layer allocates the same temporaries
  and frees them before the next one), and the heap keeps that memory for reuse
  (utils/cpu_malloc.py).

A page's first write costs a page fault in which the kernel zeroes the page; in a virtual
machine whose host backs the guest's memory lazily it costs ~2.8 s a GiB of memory the guest
never used before (measured on this project's 2-vCPU hosts, against ~0.2 s a GiB for memory
it had used). Paid inside the forward passes, that was ~4 s (float32) and ~2 s (bfloat16) of a
~23 s / ~14 s run of the offline benchmark (363,000 page faults in a float32 run; 15,000 after
the warm-up).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.utils.cpu_malloc import heap_bytes

logger = logging.getLogger(__name__)

# KV slot that warm-up steps write to: slot 0 is the pool's dummy (padding reads it, no
# request owns it), so warming up touches no request's K/V.
DUMMY_SLOT = 0
# Prompt length of each request of the memory warm-up's prefill: short, so that its attention
# costs little next to its linear layers.
_WARMUP_REQUEST_TOKENS = 256
# Decoder layers the memory warm-up's prefill runs through: the second one already sees the
# heap as every middle layer does (the first layer's outputs held as the residual stream); the
# last one runs past its attention on each request's last token only (models/llama.py), so it
# takes a third (two layers grew the heap by 306 MiB of the 402 a float32 SmolLM2 prefill of
# 8,192 tokens needs).
_WARMUP_LAYERS = 3
# KV slots faulted in at start-up, in prefill chunks.
_PREFAULT_CHUNKS = 4


def dummy_prefill(lengths: list[int], req_to_token_pool: ReqToTokenPool) -> ForwardBatch:
    """A prefill of ``len(lengths)`` requests of ``lengths[i]`` new tokens each (token id 0,
    positions from 0, no cached prefix), whose K/V all go to the dummy slot.

    Takes one row of ``req_to_token_pool`` per request (the caller frees
    ``batch.req_pool_indices`` after the forward). Raises RuntimeError when too few are free.
    """
    rows = req_to_token_pool.alloc(len(lengths))
    if rows is None:
        raise RuntimeError("warm-up needs free request rows")
    device = req_to_token_pool.req_to_token.device
    for row, n in zip(rows, lengths):
        req_to_token_pool.write(
            row, 0, torch.full((n,), DUMMY_SLOT, dtype=torch.int64, device=device)
        )
    num_tokens = sum(lengths)
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=len(lengths),
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        positions=torch.cat([torch.arange(n, dtype=torch.int64) for n in lengths]).to(device),
        out_cache_loc=torch.full((num_tokens,), DUMMY_SLOT, dtype=torch.int64, device=device),
        req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=device),
        seq_lens=torch.tensor(lengths, dtype=torch.int64, device=device),
        seq_lens_cpu=list(lengths),
        extend_seq_lens_cpu=list(lengths),
        extend_prefix_lens_cpu=[0] * len(lengths),
        req_to_token_pool=req_to_token_pool,
    )


def run_dummy_prefill(
    run_forward: Callable[[ForwardBatch], object],
    req_to_token_pool: ReqToTokenPool,
    lengths: list[int],
) -> None:
    """Run :func:`dummy_prefill` of ``lengths`` through ``run_forward`` (the model runner's
    forward) and give its request rows back."""
    batch = dummy_prefill(lengths, req_to_token_pool)
    try:
        run_forward(batch)
    finally:
        req_to_token_pool.free(batch.req_pool_indices.tolist())


@contextmanager
def first_decoder_layers(model: nn.Module, count: int) -> Iterator[None]:
    """Within the block, every ``nn.ModuleList`` attribute named ``layers`` of ``model`` (the
    decoder layers of every model in ``sglang.srt.models``) holds its first ``count`` layers
    only."""
    saved: list[tuple[nn.Module, nn.ModuleList]] = []
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, nn.ModuleList):
            saved.append((module, layers))
    try:
        for holder, layers in saved:
            holder.layers = nn.ModuleList(list(layers)[:count])
        yield
    finally:
        for holder, layers in saved:
            holder.layers = layers


def warmup_prefill_lengths(num_tokens: int, max_requests: int, context_len: int) -> list[int]:
    """Request lengths of a warm-up prefill of about ``num_tokens`` tokens: requests of
    ``_WARMUP_REQUEST_TOKENS`` tokens (or fewer, as many as ``max_requests`` allows, each at
    most ``context_len``)."""
    per_request = min(context_len, _WARMUP_REQUEST_TOKENS)
    count = max(1, min(max_requests, -(-num_tokens // per_request)))
    per_request = min(context_len, -(-num_tokens // count))
    return [per_request] * count


def warm_up_cpu_memory(
    model: nn.Module,
    run_forward: Callable[[ForwardBatch], object],
    req_to_token_pool: ReqToTokenPool,
    kv_pool: MHATokenToKVPool,
    prefill_tokens: int,
    context_len: int,
) -> None:
    """Touch the memory that serving will write (see the module docstring): a throwaway
    prefill of ``prefill_tokens`` tokens (the largest a step runs) through the first decoder
    layers of ``model``, then the pool's first ``_PREFAULT_CHUNKS * prefill_tokens`` slots
    (this also zeroes the dummy slot again). Logs what it did.

    Precondition: no request holds KV (start-up), and a request row is free.
    """
    start = time.perf_counter()
    heap_before = heap_bytes()
    lengths = warmup_prefill_lengths(
        prefill_tokens, req_to_token_pool.available_size(), context_len
    )
    with first_decoder_layers(model, _WARMUP_LAYERS):
        run_dummy_prefill(run_forward, req_to_token_pool, lengths)
    heap_grown = heap_bytes() - heap_before
    kv_bytes = kv_pool.prefault(_PREFAULT_CHUNKS * prefill_tokens)
    logger.info(
        "CPU memory warm-up: %.0f MiB of the heap (a %d-token prefill through %d layers) and "
        "%.0f MiB of the KV pool touched in %.1f s (--disable-cpu-malloc-tuning skips it)",
        heap_grown / 2**20,
        sum(lengths),
        _WARMUP_LAYERS,
        kv_bytes / 2**20,
        time.perf_counter() - start,
    )
