"""KV memory: slot allocator, preallocated pools and the prefix cache."""

from __future__ import annotations

from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache, MatchResult
from sglang.srt.mem_cache.chunk_cache import NoPrefixCache
from sglang.srt.mem_cache.radix_cache import RadixCache

__all__ = [
    "BasePrefixCache",
    "MatchResult",
    "NoPrefixCache",
    "RadixCache",
    "TokenToKVPoolAllocator",
    "create_prefix_cache",
]


def create_prefix_cache(
    disable: bool, allocator: TokenToKVPoolAllocator, page_size: int
) -> BasePrefixCache:
    """NoPrefixCache when ``disable`` (``--disable-radix-cache``), else a RadixCache."""
    if disable:
        return NoPrefixCache(allocator, page_size)
    return RadixCache(allocator, page_size)
