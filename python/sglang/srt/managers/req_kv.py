"""Request-level KV operations: the only code that moves KV between a request, the prefix cache
and the allocator.

A request holds, while admitted:
  * one row of the ReqToTokenPool (``req.req_pool_idx``),
  * a locked prefix-cache match (``req.cache_handle``; slots ``[0, req.prefix_len)``): what
    it matched when admitted, and from the end of each of its extend steps what it computed
    itself (:meth:`ReqKV.share_computed` hands it to the cache, for others to share),
  * private slots ``[req.prefix_len, req.kv_len)`` it allocated itself (plus the slots of the
    tokens being computed in the current step),
  * on CPU with ``page_size`` 1, a run of slots reserved for its next decode tokens
    (``req.decode_slots``; see :meth:`ReqKV.alloc_decode`).

:meth:`ReqKV.release` gives all of it back (caching what is worth caching); it is called by the
finish, abort and retract paths alike, so none of them can leak.

Weight updates bump ``weights.generation`` (a shared :class:`WeightState`). A request remembers
the generation under which its KV started (``req.kv_generation``, set when it is admitted); KV
that began under older weights is never inserted into the prefix cache, so no later request can
match it.

LoRA: the cache never shares KV across adapters. A request's key is its token ids shifted into
the namespace of the adapter weights it runs with (``lora_uid``, fresh per adapter load; 0 =
the base model, whose keys are the plain ids)::

    key[i] = token_ids[i] + lora_uid * 2**32

so keys of different adapters (or of one adapter before and after a reload) differ from their
first token on and never meet in the tree; the stale ones age out by LRU eviction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sglang.srt.managers.weight_state import WeightState
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req


@dataclass
class ReqKV:
    req_to_token_pool: ReqToTokenPool
    allocator: TokenToKVPoolAllocator
    tree_cache: BasePrefixCache
    page_size: int
    weights: WeightState = field(default_factory=WeightState)  # shared with the WeightUpdater
    # LoRA adapter name -> prefix-cache namespace of its current weights (see module docstring)
    lora_uid: Callable[[str | None], int] = lambda name: 0
    # Slots a decode run reserves (alloc_decode); 1: none. See decode_run_length.
    decode_run: int = 1
    reserved_slots: int = 0  # reserved by runs and not used yet, over all requests

    def __post_init__(self) -> None:
        if self.decode_run > 1 and self.page_size != 1:
            raise ValueError("decode runs need page_size 1")

    def available_tokens(self) -> int:
        """Tokens that can be allocated now, counting what eviction would free."""
        return self.allocator.available_size() + self.tree_cache.evictable_size()

    def match_and_lock(self, req: Req, max_prefix_len: int) -> None:
        """Match ``req.fill_ids[:max_prefix_len]`` in the cache and lock the match.

        Precondition: the request holds no KV (fresh or released). Sets ``prefix_indices``,
        ``prefix_len``, ``kv_len`` and ``cache_handle``.
        """
        req.lora_uid = self.lora_uid(req.lora_name)
        key = cache_key(req.fill_ids[:max_prefix_len], req.lora_uid)
        match = self.tree_cache.match_prefix(key)
        self.tree_cache.lock(match.handle)
        req.cache_handle = match.handle
        req.prefix_indices = match.device_indices
        req.prefix_len = int(match.device_indices.numel())
        req.kv_len = req.prefix_len
        req.kv_generation = self.weights.generation

    def share_computed(self, req: Req) -> None:
        """Hand the KV ``req`` has computed so far (whole pages) to the prefix cache, locked by
        ``req``, so that requests admitted while it still runs share it (n samples of one
        prompt, a group of identical prompts, a common system prompt) instead of computing it
        again; :meth:`release` then finds it cached.

        Precondition: ``req`` is admitted and the first ``req.kv_len`` tokens of prompt +
        output have KV in its row (its extend step is done). Afterwards ``req.prefix_len`` is
        that page-aligned length and its row holds the cache's slots there: where another
        request cached the same tokens first, ``req``'s own copies are freed and its row points
        at the cached ones. KV begun under older weights is not shared (see the module
        docstring), and nothing is with a cache that keeps nothing (``keeps_inserted``).
        """
        aligned = req.kv_len // self.page_size * self.page_size
        if (
            req.req_pool_idx is None  # released meanwhile (aborted while its step ran)
            or not self.tree_cache.keeps_inserted
            or req.kv_generation != self.weights.generation
            or aligned <= req.prefix_len
        ):
            return
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        key, num_cached = self._insert(req, row, aligned)
        match = self.tree_cache.match_prefix(key)
        self.tree_cache.lock(match.handle)
        self.tree_cache.unlock(req.cache_handle)
        if num_cached > req.prefix_len:  # its own copies were freed: point at the cached ones
            self.req_to_token_pool.write(req.req_pool_idx, 0, match.device_indices)
        req.cache_handle = match.handle
        req.prefix_indices = match.device_indices
        req.prefix_len = aligned

    def _insert(self, req: Req, kv: torch.Tensor, aligned: int) -> tuple[list[int], int]:
        """Insert the first ``aligned`` tokens of ``req`` (their slots ``kv[:aligned]``) into
        the cache; returns their key and how many of them it held already, whose slots of
        ``req``'s own (past its ``prefix_len``) are freed here."""
        key = cache_key((req.origin_input_ids + req.output_ids)[:aligned], req.lora_uid)
        num_cached = self.tree_cache.insert(key, kv[:aligned])
        if num_cached > req.prefix_len:  # computed twice: another request cached them first
            self.allocator.free(kv[req.prefix_len : num_cached])
        return key, num_cached

    def unlock_unadmitted(self, req: Req) -> None:
        """Undo :meth:`match_and_lock` for a request that was not admitted after all."""
        self.tree_cache.unlock(req.cache_handle)
        req.cache_handle = None
        req.prefix_len = req.kv_len = 0

    def ensure_free(self, num_tokens: int) -> bool:
        """Evict from the cache until ``num_tokens`` slots are free; False if impossible."""
        short = num_tokens - self.allocator.available_size()
        if short > 0:
            self.tree_cache.evict(short)
        return self.allocator.available_size() >= num_tokens

    def alloc_extend(
        self, prefix_lens: list[int], seq_lens: list[int], last_locs: list[int]
    ) -> torch.Tensor | None:
        """Slots for tokens ``prefix_lens[i]..seq_lens[i]-1`` of each request (evicting first)."""
        pages = self.allocator.num_pages_needed_extend(prefix_lens, seq_lens)
        self.ensure_free(pages * self.page_size)
        return self.allocator.alloc_extend(prefix_lens, seq_lens, last_locs)

    def alloc_decode(
        self, reqs: list[Req], seq_lens: list[int], last_locs: list[int] | torch.Tensor
    ) -> torch.Tensor | None:
        """One slot per request of ``reqs`` for its token at position ``seq_lens[i] - 1``
        (``last_locs`` may be a device tensor: no host sync then). None, taking nothing, when
        the pool cannot hold the step even after eviction.

        With decode runs (``decode_run`` > 1, page_size 1) a request takes its slot from the
        run it holds, and one that holds none first reserves ``decode_run`` consecutive free
        slots (or a single slot while the pool is short, see :meth:`_run_length`): its decoded
        tokens then lie side by side in the pool instead of interleaved with the batch's, which
        the CPU decode-attention kernel streams from memory 1.1-1.2x faster. Reserved slots are
        the request's private slots until it uses or releases them.
        """
        if self.decode_run == 1:
            self.ensure_free(self.allocator.num_pages_needed_decode(seq_lens) * self.page_size)
            return self.allocator.alloc_decode(seq_lens, last_locs)
        starting = [r for r in reqs if not r.decode_slots]
        if starting:
            self.ensure_free(len(starting))  # eviction frees room for single slots only
            run = self._run_length(len(starting))
            taken = self.allocator.alloc_slots(len(starting) * run)
            if taken is None:
                return None
            for r, slots in zip(starting, taken.view(len(starting), run).tolist()):
                r.decode_slots = slots[::-1]
            self.reserved_slots += len(starting) * run
        self.reserved_slots -= len(reqs)
        slots = [r.decode_slots.pop() for r in reqs]
        return torch.tensor(slots, dtype=torch.int64, device=self.allocator.device)

    def _run_length(self, num_runs: int) -> int:
        """Slots each of ``num_runs`` new runs reserves: ``decode_run`` while the reserved
        slots stay within 1/8 of the pool and a quarter of it stays free after, else 1 (a
        full pool is not made fuller by reservations, nor retracts requests for them)."""
        size, taken = self.allocator.size, num_runs * self.decode_run
        if self.reserved_slots + taken <= size // 8 and (
            self.allocator.available_size() - taken >= size // 4
        ):
            return self.decode_run
        return 1

    def decode_slots_needed(self, reqs: list[Req], seq_lens: list[int]) -> int:
        """Free slots the next decode step of ``reqs`` (new positions ``seq_lens[i] - 1``)
        takes from the pool at least: a slot per request without a reserved one (with decode
        runs), else the pages that start there."""
        if self.decode_run > 1:
            return sum(1 for r in reqs if not r.decode_slots)
        return self.allocator.num_pages_needed_decode(seq_lens) * self.page_size

    def num_private_slots(self, req: Req, in_flight: bool = False) -> int:
        """Slots ``req`` holds outside the prefix cache: the pages of ``[prefix_len, kv_len)``
        (one slot further when a decode step of it is ``in_flight``), a partly filled last
        page counted whole (the prefix is page-aligned), and its reserved decode slots."""
        if req.req_pool_idx is None:
            return 0
        end = req.kv_len + int(in_flight)
        pages = -(-end // self.page_size) - req.prefix_len // self.page_size
        return pages * self.page_size + len(req.decode_slots)

    def private_slots(self, req: Req, in_flight: bool = False) -> torch.Tensor:
        """The slots of ``[prefix_len, kv_len)`` of ``req``'s row (one further when a decode
        step of it is ``in_flight``) and its reserved decode slots (a copy; empty if none)."""
        if req.req_pool_idx is None:
            return torch.empty(0, dtype=torch.int64)
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        held = row[req.prefix_len : req.kv_len + int(in_flight)]
        reserved = torch.tensor(req.decode_slots, dtype=torch.int64, device=held.device)
        return torch.cat([held, reserved])

    def computed_slots(self, req: Req) -> torch.Tensor:
        """The slots of ``req``'s first ``kv_len`` tokens (prompt + output with KV), in order
        (a copy; empty when it holds no row)."""
        if req.req_pool_idx is None:
            return torch.empty(0, dtype=torch.int64)
        return self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_len].clone()

    def release(self, req: Req) -> None:
        """Give back everything ``req`` holds; its computed KV goes to the prefix cache.

        Precondition: the first ``req.kv_len`` tokens of prompt + output have KV in its row.
        Afterwards the request holds nothing and may be re-admitted (re-prefilled) later. KV
        that began under older weights (see the module docstring) is freed, not cached.
        """
        if req.req_pool_idx is None:
            return
        kv = self.computed_slots(req)
        if req.kv_generation != self.weights.generation:
            self.allocator.free(kv[req.prefix_len :])
        else:
            aligned = req.kv_len // self.page_size * self.page_size
            self._insert(req, kv, aligned)
            if aligned < req.kv_len:
                self.allocator.free(kv[aligned:])
        if req.decode_slots:
            self.allocator.free(torch.tensor(req.decode_slots, dtype=torch.int64))
            self.reserved_slots -= len(req.decode_slots)
            req.decode_slots = []
        self.tree_cache.unlock(req.cache_handle)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.cache_handle = None
        req.prefix_indices = None
        req.prefix_len = req.kv_len = 0


_NAMESPACE_STRIDE = 1 << 32  # above any vocabulary size

# Decoded tokens per run on CPU. Measured with benchmark/bench_cpu_decode_attention.py's layout
# (64 requests of ~350 keys, 40% decoded; bfloat16 and float32): runs of 8, 16, 32 and 64
# slots gave the kernel 1.14-1.16x, 1.09-1.21x, 1.17-1.19x and 1.15-1.16x over interleaved
# slots.
_CPU_DECODE_RUN = 32


def decode_run_length(device: str, page_size: int, pool_size: int) -> int:
    """The ``decode_run`` of a pool: on CPU with page_size 1, 32 slots (at most 1/64 of the
    pool; none below 2); elsewhere 1 (none: GPU kernels gain nothing from it, and paged pools
    keep a request's tokens in its pages anyway)."""
    if torch.device(device).type != "cpu" or page_size != 1:
        return 1
    run = min(_CPU_DECODE_RUN, pool_size // 64)
    return run if run >= 2 else 1


def cache_key(token_ids: list[int], lora_uid: int) -> list[int]:
    """The prefix-cache key of ``token_ids`` under adapter namespace ``lora_uid``."""
    if not lora_uid:
        return token_ids
    shift = lora_uid * _NAMESPACE_STRIDE
    return [t + shift for t in token_ids]
