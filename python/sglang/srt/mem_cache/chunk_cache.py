"""The prefix cache used with ``--disable-radix-cache``: it caches nothing.

It keeps the scheduler's code path identical with and without a prefix cache: matches are empty,
and ``insert`` gives every slot it receives straight back to the allocator.
"""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache, MatchResult


class NoPrefixCache(BasePrefixCache):
    """A :class:`BasePrefixCache` that holds nothing; every size is 0."""

    keeps_inserted = False

    def __init__(self, allocator: TokenToKVPoolAllocator, page_size: int) -> None:
        if page_size != allocator.page_size:
            raise ValueError(f"page_size {page_size} != allocator.page_size {allocator.page_size}")
        self.allocator = allocator
        self.page_size = page_size

    def match_prefix(self, key: list[int]) -> MatchResult:
        """Always an empty match (handle None). Does not mutate."""
        empty = torch.empty(0, dtype=torch.int64, device=self.allocator.device)
        return MatchResult(device_indices=empty, handle=None)

    def lock(self, handle: object) -> None:
        """No-op: nothing is cached, so nothing needs protecting."""

    def unlock(self, handle: object) -> None:
        """No-op, see ``lock``."""

    def insert(self, key: list[int], indices: torch.Tensor) -> int:
        """Free ``indices[:len(key)]`` through the allocator and return 0 (nothing was cached).

        Mutates the allocator only: the caller must not free those slots again.
        """
        if len(key) % self.page_size != 0:
            raise ValueError(f"insert key length {len(key)} is not a multiple of page_size")
        self.allocator.free(indices[: len(key)])
        return 0

    def evict(self, num_tokens: int) -> int:
        """Nothing to evict: returns 0."""
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def reset(self) -> None:
        """Nothing to drop."""

    def invalidate(self) -> int:
        """Nothing is cached, so nothing can be stale: returns 0."""
        return 0

    def check_integrity(self, num_private: int = 0) -> None:
        free = self.allocator.available_size()
        if free + num_private != self.allocator.size:
            raise AssertionError(
                f"KV leak: free {free} + private {num_private} != capacity {self.allocator.size}"
            )

    def __repr__(self) -> str:
        return f"NoPrefixCache(page_size={self.page_size})"
