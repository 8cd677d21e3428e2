"""The prefix-cache contract the scheduler programs against.

Ownership rules (the allocator owns free slots, the cache owns the slots it stores):

- Slots returned by ``match_prefix`` belong to the cache. They stay valid while the returned
  handle is locked; once unlocked they may be evicted (and reused) by any later ``evict``.
- ``insert`` takes ownership of the slots of the tokens it did not already hold; the caller keeps
  (and must free) the slots it passed for tokens the cache already had.
- Handles are opaque: pass them back to ``lock``/``unlock`` and nothing else. A handle is valid
  from its ``match_prefix`` until ``reset``; it is only safe to lock while its slots are known
  to be alive (i.e. right after the match, before anything can evict).

Typical scheduler use::

    m = cache.match_prefix(ids[:-1]); cache.lock(m.handle)       # admit
    slots = allocator.alloc_extend(...)  (after cache.evict(...) when short)
    n = cache.insert(ids[:p], kv[:p])              # extend done (p: its pages): share them
    allocator.free(kv[prefix_len:n]); m = cache.match_prefix(ids[:p])  # (kv[:p] = m's slots)
    cache.lock(m.handle); cache.unlock(old_handle); prefix_len = p
    n = cache.insert(ids[:aligned], kv[:aligned])                # finish / retract
    allocator.free(kv[prefix_len:n]); allocator.free(kv[aligned:]); cache.unlock(m.handle)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch


class MatchResult(NamedTuple):
    """Result of ``match_prefix``.

    ``device_indices``: int64 KV slots of the matched prefix (length a multiple of page_size),
    on the pool's device. ``handle``: opaque token for ``lock``/``unlock``.
    """

    device_indices: torch.Tensor
    handle: object


class BasePrefixCache(ABC):
    """A store of computed KV for token prefixes, keyed by token ids, page-aligned."""

    # Whether ``insert`` keeps what it takes (False: it frees it, see NoPrefixCache), so that
    # a running request's computed prompt can be handed over and shared (ReqKV.share_computed).
    keeps_inserted: bool = True

    @abstractmethod
    def match_prefix(self, key: list[int]) -> MatchResult:
        """Longest cached prefix of ``key`` whose length is a multiple of page_size.

        Mutates: refreshes the LRU time of the matched path and may split a node so that the
        match ends on a node boundary (sizes are unchanged). Does not lock: the indices stay
        valid only while ``handle`` is locked (lock it before anything can call ``evict``).
        """

    @abstractmethod
    def lock(self, handle: object) -> None:
        """Protect the matched path (root .. handle) from eviction. Mutates reference counts and
        moves the path's tokens from evictable to protected on the first lock. Locks nest."""

    @abstractmethod
    def unlock(self, handle: object) -> None:
        """Undo one ``lock(handle)``. Mutates reference counts; the path becomes evictable when
        its last lock is released. Precondition: ``handle`` is locked."""

    @abstractmethod
    def insert(self, key: list[int], indices: torch.Tensor) -> int:
        """Store ``key -> indices[:len(key)]``; ``len(key)`` must be a multiple of page_size.

        Returns how many leading tokens of ``key`` were already cached (page-aligned). Mutates:
        the cache takes ownership of ``indices[returned:len(key)]`` (copied, so ``indices`` may be
        a view of a row that is reused later); the caller keeps ownership of
        ``indices[:returned]`` and must free the ones it allocated itself (duplicates computed
        twice). Refreshes the LRU time of the path. Inserted tokens start unlocked (evictable).
        """

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots (if possible) from unlocked leaves, least recently
        used first, giving them to the allocator. Mutates the tree; returns the number freed."""

    @abstractmethod
    def evictable_size(self) -> int:
        """Tokens held by the cache that no lock protects (could be evicted). Does not mutate."""

    @abstractmethod
    def protected_size(self) -> int:
        """Tokens held by the cache on locked paths. Does not mutate."""

    def stale_size(self) -> int:
        """Tokens of entries invalidated by :meth:`invalidate` but still locked by a request
        (freed when their last lock goes). Does not mutate."""
        return 0

    def total_size(self) -> int:
        """All tokens held by the cache (evictable + protected + stale). Does not mutate."""
        return self.evictable_size() + self.protected_size() + self.stale_size()

    @abstractmethod
    def invalidate(self) -> int:
        """Make every current entry unmatchable, for good (the weights that computed its KV
        were replaced). Unlocked entries are freed to the allocator now; locked ones stay valid
        for their holders (their handles still unlock normally) and are freed when their last
        lock is released. Later matches and inserts see an empty cache. Returns the number of
        tokens freed now. Unlike ``reset`` it is safe while requests hold KV."""

    @abstractmethod
    def reset(self) -> None:
        """Drop every entry WITHOUT giving slots back: use it together with
        ``allocator.clear()`` (flush_cache). All handles and returned indices become invalid."""

    @abstractmethod
    def check_integrity(self, num_private: int = 0) -> None:
        """Assert ``free + evictable + protected + stale + num_private == allocator capacity``
        and that
        the cached sizes agree with a full walk. ``num_private`` = slots held by live requests
        outside the cache (their private pages, partial tail pages counted whole). Read-only;
        raises AssertionError on a violation."""

    def cached_slots(self) -> torch.Tensor:
        """Every slot the cache holds (evictable, protected and stale), in no order, as a fresh
        tensor. For ownership checks (the scheduler's invariants). Does not mutate."""
        return torch.empty(0, dtype=torch.int64)

    def pretty_print(self) -> str:
        """A human-readable dump of the cache (for debugging). Does not mutate."""
        return repr(self)
