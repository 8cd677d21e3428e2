"""Unit tests for the prefix caches (RadixCache, NoPrefixCache) over a small fake KV pool."""

from __future__ import annotations

import random

import pytest
import torch

from sglang.srt.mem_cache import (
    NoPrefixCache,
    RadixCache,
    TokenToKVPoolAllocator,
    create_prefix_cache,
)
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache


def make(size: int = 64, page_size: int = 1) -> tuple[TokenToKVPoolAllocator, RadixCache]:
    alloc = TokenToKVPoolAllocator(size, page_size, "cpu", debug=True)
    return alloc, RadixCache(alloc, page_size)


def compute(alloc: TokenToKVPoolAllocator, num_tokens: int) -> torch.Tensor:
    """Fresh private slots for ``num_tokens`` tokens starting at position 0."""
    slots = alloc.alloc_extend([0], [num_tokens], [-1])
    assert slots is not None
    return slots


def cached_insert(alloc: TokenToKVPoolAllocator, cache: RadixCache, key: list[int]) -> torch.Tensor:
    """Compute ``key`` from scratch and insert it, freeing duplicates as the scheduler does."""
    kv = compute(alloc, len(key))
    n = cache.insert(key, kv)
    alloc.free(kv[:n])
    return kv


def test_empty_cache_matches_nothing() -> None:
    alloc, cache = make()
    m = cache.match_prefix([1, 2, 3])
    assert m.device_indices.numel() == 0 and m.device_indices.dtype == torch.int64
    cache.lock(m.handle)
    assert cache.protected_size() == 0
    cache.unlock(m.handle)
    assert cache.total_size() == 0
    cache.check_integrity()


@pytest.mark.parametrize("page_size", [1, 4])
def test_insert_then_match_returns_inserted_indices(page_size: int) -> None:
    alloc, cache = make(64, page_size)
    key = list(range(100, 108))
    kv = compute(alloc, 8)
    assert cache.insert(key, kv) == 0
    assert cache.total_size() == 8 and cache.evictable_size() == 8
    m = cache.match_prefix(key + [7, 7, 7, 7])
    assert m.device_indices.tolist() == kv.tolist()
    cache.check_integrity()


def test_insert_reports_already_cached_prefix_and_splits() -> None:
    alloc, cache = make()
    first = cached_insert(alloc, cache, [1, 2, 3, 4, 5, 6, 7, 8])
    kv = compute(alloc, 8)
    n = cache.insert([1, 2, 3, 4, 9, 9, 9, 9], kv)
    assert n == 4
    alloc.free(kv[:n])
    assert cache.total_size() == 12
    assert cache.match_prefix([1, 2, 3, 4, 5]).device_indices.tolist() == first[:5].tolist()
    both = cache.match_prefix([1, 2, 3, 4, 9, 9])
    assert both.device_indices.tolist() == first[:4].tolist() + kv[4:6].tolist()
    assert cache.insert([1, 2, 3], kv[:3]) == 3  # fully cached: nothing taken
    cache.check_integrity()


def test_match_ending_inside_node_splits_it() -> None:
    alloc, cache = make()
    kv = cached_insert(alloc, cache, [5, 6, 7, 8, 9, 10])
    m = cache.match_prefix([5, 6, 7, 0])
    assert m.device_indices.tolist() == kv[:3].tolist()
    cache.lock(m.handle)
    # Only the matched half is protected: the node was split at the match end.
    assert cache.protected_size() == 3 and cache.evictable_size() == 3
    assert cache.evict(100) == 3
    assert cache.match_prefix([5, 6, 7, 8, 9]).device_indices.tolist() == kv[:3].tolist()
    cache.unlock(m.handle)
    cache.check_integrity()


def test_page_aligned_matching_with_page_size_4() -> None:
    alloc, cache = make(64, 4)
    key = [1, 2, 3, 4, 5, 6, 7, 8]
    kv = cached_insert(alloc, cache, key)
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 0, 0]).device_indices.tolist() == kv[:4].tolist()
    assert cache.match_prefix(key[:7]).device_indices.tolist() == kv[:4].tolist()
    assert cache.match_prefix(key[:3]).device_indices.numel() == 0
    assert cache.match_prefix([1, 2, 3, 0, 5, 6, 7, 8]).device_indices.numel() == 0
    other = compute(alloc, 8)
    n = cache.insert([1, 2, 3, 4, 5, 6, 0, 0], other)  # shares 6 tokens = 1 whole page
    assert n == 4
    alloc.free(other[:n])
    assert cache.total_size() == 12
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 0, 0, 9])
    assert m.device_indices.tolist() == kv[:4].tolist() + other[4:].tolist()
    cache.check_integrity()


def test_insert_rejects_unaligned_key_and_short_indices() -> None:
    alloc, cache = make(64, 4)
    kv = compute(alloc, 8)
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3, 4, 5, 6], kv[:6])
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3, 4, 5, 6, 7, 8], kv[:4])
    assert cache.total_size() == 0


def test_insert_copies_indices() -> None:
    alloc, cache = make()
    row = torch.zeros(8, dtype=torch.int64)
    row[:4] = compute(alloc, 4)
    expected = row[:4].tolist()
    cache.insert([1, 2, 3, 4], row[:4])
    row.fill_(0)
    assert cache.match_prefix([1, 2, 3, 4]).device_indices.tolist() == expected


def test_evict_in_lru_order() -> None:
    alloc, cache = make()
    a = cached_insert(alloc, cache, [1, 1, 1])
    b = cached_insert(alloc, cache, [2, 2, 2])
    c = cached_insert(alloc, cache, [3, 3, 3])
    cache.match_prefix([1, 1, 1, 5])  # touching a makes b the least recently used
    free_before = alloc.available_size()
    assert cache.evict(2) == 3
    assert cache.match_prefix([2, 2, 2]).device_indices.numel() == 0
    assert set(b.tolist()) <= set(alloc.free_page_ids().tolist())
    assert cache.evict(1) == 3  # then c
    assert cache.match_prefix([3]).device_indices.numel() == 0
    assert cache.match_prefix([1, 1, 1]).device_indices.tolist() == a.tolist()
    assert not set(c.tolist()) & set(cache.match_prefix([1, 1, 1]).device_indices.tolist())
    assert alloc.available_size() == free_before + 6
    cache.check_integrity()


def test_untouched_tail_of_split_node_is_older() -> None:
    alloc, cache = make()
    cached_insert(alloc, cache, [1, 1, 1])
    cached_insert(alloc, cache, [2, 2, 2])
    cache.match_prefix([1, 1])  # splits [1,1,1]; the tail [1] keeps its old access time
    assert cache.evict(1) == 1
    assert cache.match_prefix([1, 1, 1]).device_indices.numel() == 2
    assert cache.match_prefix([2, 2, 2]).device_indices.numel() == 3
    cache.check_integrity()


def test_evict_respects_locks_and_nesting() -> None:
    alloc, cache = make()
    a = cached_insert(alloc, cache, [1, 2, 3, 4])
    cached_insert(alloc, cache, [7, 8])
    m = cache.match_prefix([1, 2, 3, 4])
    cache.lock(m.handle)
    cache.lock(m.handle)
    assert cache.protected_size() == 4 and cache.evictable_size() == 2
    assert cache.evict(100) == 2
    cache.unlock(m.handle)
    assert cache.evict(100) == 0  # still locked once
    assert cache.match_prefix([1, 2, 3, 4]).device_indices.tolist() == a.tolist()
    cache.unlock(m.handle)
    assert cache.evictable_size() == 4 and cache.protected_size() == 0
    assert cache.evict(1) == 4
    assert alloc.available_size() == alloc.size
    with pytest.raises(AssertionError):
        cache.unlock(m.handle)


def test_evicting_child_exposes_parent() -> None:
    alloc, cache = make()
    cached_insert(alloc, cache, [1, 2, 3, 4])
    cached_insert(alloc, cache, [1, 2, 3, 4, 5, 6])
    cache.match_prefix([1, 2, 3, 4])  # parent newer than the leaf: the leaf still goes first
    assert cache.evict(1) == 2
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).device_indices.numel() == 4
    assert cache.evict(1) == 4
    assert cache.total_size() == 0
    cache.check_integrity()


def test_locked_descendant_protects_ancestors() -> None:
    alloc, cache = make()
    cached_insert(alloc, cache, [1, 2, 3, 4, 5, 6])
    cached_insert(alloc, cache, [1, 2, 9])
    m = cache.match_prefix([1, 2, 3, 4, 5, 6])
    cache.lock(m.handle)
    assert cache.evict(100) == 1  # only [9]
    assert cache.protected_size() == 6
    cache.unlock(m.handle)
    cache.check_integrity()


def test_duplicate_computation_ownership() -> None:
    """Two requests compute the same prefix concurrently; the second's copy is the caller's."""
    alloc, cache = make(64, 2)
    key = [4, 4, 5, 5, 6, 6]
    kv1, kv2 = compute(alloc, 7), compute(alloc, 7)
    n1 = cache.insert(key, kv1[:6])
    assert n1 == 0
    alloc.free(kv1[6:])  # partial tail page
    n2 = cache.insert(key, kv2[:6])
    assert n2 == 6
    cache.check_integrity(num_private=8)  # kv2 is still the caller's (4 pages)
    alloc.free(kv2[0:n2])
    alloc.free(kv2[6:])
    cache.check_integrity()
    assert cache.match_prefix(key).device_indices.tolist() == kv1[:6].tolist()
    assert alloc.available_size() + cache.evictable_size() == alloc.size


def test_check_integrity_detects_leak_and_bad_count() -> None:
    alloc, cache = make()
    cached_insert(alloc, cache, [1, 2, 3])
    cache.check_integrity()
    leaked = compute(alloc, 2)
    with pytest.raises(AssertionError, match="leak"):
        cache.check_integrity()
    cache.check_integrity(num_private=2)
    alloc.free(leaked)
    cache.check_integrity()


def test_reset_drops_tree() -> None:
    alloc, cache = make()
    cached_insert(alloc, cache, [1, 2, 3])
    cache.reset()
    alloc.clear()
    assert cache.total_size() == 0
    assert cache.match_prefix([1, 2, 3]).device_indices.numel() == 0
    cache.check_integrity()
    assert "RadixCache" in cache.pretty_print()


def test_no_prefix_cache_frees_everything() -> None:
    alloc = TokenToKVPoolAllocator(32, 4, "cpu", debug=True)
    cache = NoPrefixCache(alloc, 4)
    kv = compute(alloc, 10)
    m = cache.match_prefix([1, 2, 3, 4, 5])
    assert m.device_indices.numel() == 0
    cache.lock(m.handle)
    assert cache.insert(list(range(8)), kv[:8]) == 0
    assert alloc.available_size() == 32 - 4  # only the tail page is still held
    cache.check_integrity(num_private=4)
    alloc.free(kv[8:])
    cache.unlock(m.handle)
    assert cache.evict(10) == 0
    assert cache.total_size() == cache.evictable_size() == cache.protected_size() == 0
    cache.check_integrity()


def test_create_prefix_cache() -> None:
    alloc = TokenToKVPoolAllocator(16, 1, "cpu")
    assert isinstance(create_prefix_cache(True, alloc, 1), NoPrefixCache)
    assert isinstance(create_prefix_cache(False, alloc, 1), RadixCache)
    with pytest.raises(ValueError):
        create_prefix_cache(False, alloc, 2)


def test_long_keys_match_quickly() -> None:
    alloc, cache = make(20000, 1)
    rng = random.Random(0)
    key = [rng.randrange(1000) for _ in range(8000)]
    kv = cached_insert(alloc, cache, key)
    probe = key[:5000] + [-1] + key[5001:]
    assert cache.match_prefix(probe).device_indices.tolist() == kv[:5000].tolist()
    cache.check_integrity()


# ---------------------------------------------------------------------- randomized workload


class _Req:
    def __init__(self, ids: list[int], handle: object, prefix_len: int, kv: list[int]) -> None:
        self.ids = ids  # every token whose KV is in kv (prompt + generated so far)
        self.handle = handle
        self.prefix_len = prefix_len
        self.kv = kv


class _Workload:
    """Drives a cache exactly as the scheduler does, checking what matched slots contain.

    ``content[slot]`` records the token prefix whose KV was computed into ``slot``; every match
    must return slots whose content is exactly the matched prefix.
    """

    def __init__(self, cache: BasePrefixCache, alloc: TokenToKVPoolAllocator, seed: int) -> None:
        self.cache, self.alloc, self.rng = cache, alloc, random.Random(seed)
        self.ps = alloc.page_size
        self.running: list[_Req] = []
        self.content: dict[int, tuple[int, ...]] = {}
        self.stems = [[self.rng.randrange(4) for _ in range(24)] for _ in range(3)]

    def num_private(self) -> int:
        ps = self.ps
        return sum(-(-(len(r.kv) - r.prefix_len) // ps) * ps for r in self.running)

    def _ensure(self, num_tokens: int) -> None:
        if self.alloc.available_size() < num_tokens:
            self.cache.evict(num_tokens - self.alloc.available_size())

    def admit(self) -> None:
        stem = self.rng.choice(self.stems)
        ids = stem[: self.rng.randint(1, 24)] + [self.rng.randrange(4) for _ in range(3)]
        m = self.cache.match_prefix(ids[:-1])
        prefix = m.device_indices.tolist()
        assert len(prefix) % self.ps == 0
        for i, slot in enumerate(prefix):
            assert self.content[slot] == tuple(ids[: i + 1])
        self.cache.lock(m.handle)
        self._ensure(self.alloc.num_pages_needed_extend([len(prefix)], [len(ids)]) * self.ps)
        new = self.alloc.alloc_extend([len(prefix)], [len(ids)], [prefix[-1] if prefix else -1])
        if new is None:
            self.cache.unlock(m.handle)
            return
        for pos, slot in enumerate(new.tolist(), start=len(prefix)):
            self.content[slot] = tuple(ids[: pos + 1])
        self.running.append(_Req(ids, m.handle, len(prefix), prefix + new.tolist()))

    def decode(self) -> None:
        if not self.running:
            return
        for req in self.running:
            req.ids.append(self.rng.randrange(4))
        seq_lens = [len(r.ids) for r in self.running]
        self._ensure(self.alloc.num_pages_needed_decode(seq_lens) * self.ps)
        out = self.alloc.alloc_decode(seq_lens, [r.kv[-1] for r in self.running])
        if out is None:  # out of memory: retract the newest request, the rest retry next step
            for req in self.running:
                req.ids.pop()
            self.finish(self.running[-1])
            return
        for req, slot in zip(self.running, out.tolist()):
            req.kv.append(slot)
            self.content[slot] = tuple(req.ids)

    def finish(self, req: _Req) -> None:
        kv = torch.tensor(req.kv, dtype=torch.int64)
        aligned = len(req.kv) // self.ps * self.ps
        n = self.cache.insert(req.ids[:aligned], kv[:aligned])
        assert n >= req.prefix_len
        if n > req.prefix_len:
            self.alloc.free(kv[req.prefix_len : n])
        self.alloc.free(kv[aligned:])
        self.cache.unlock(req.handle)
        self.running.remove(req)

    def step(self) -> None:
        roll = self.rng.random()
        if roll < 0.35:
            self.admit()
        elif roll < 0.55 and self.running:
            self.finish(self.rng.choice(self.running))
        elif roll < 0.6:
            self.cache.evict(self.rng.randint(1, 16))
        else:
            self.decode()
        self.cache.check_integrity(self.num_private())


@pytest.mark.parametrize("disable", [False, True])
@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_random_workload_keeps_integrity(page_size: int, disable: bool) -> None:
    alloc = TokenToKVPoolAllocator(160, page_size, "cpu", debug=True)
    cache = create_prefix_cache(disable, alloc, page_size)
    work = _Workload(cache, alloc, seed=page_size)
    for _ in range(600):
        work.step()
    if not disable:
        assert cache.total_size() > 0
    while work.running:
        work.finish(work.running[0])
    cache.check_integrity()
    assert cache.protected_size() == 0
    assert alloc.available_size() + cache.evictable_size() == alloc.size
    cache.evict(alloc.size)
    assert cache.total_size() == 0
    assert alloc.available_size() == alloc.size
