"""Radix-tree prefix cache with page-aligned nodes, lock references and LRU eviction.

Every node (except the root) holds a run of token ids ``key`` and their KV slots ``value``; both
have a length that is a multiple of page_size, so a node always owns whole pages. A node's
children are keyed by the first page of their key (``key[0]`` when page_size == 1, else a tuple
of page_size ids), so siblings never share a first page and a lookup is one dict access per node.

``lock_ref`` counts the locks whose path passes through a node; a node with ``lock_ref > 0`` is
protected, else evictable. Only leaves with ``lock_ref == 0`` can be evicted; they are kept in a
set (``_evictable_leaves``) so ``evict`` heapifies them by last access without walking the tree.

``invalidate`` (after a weight update) frees every unlocked node and detaches the rest, whose
KV was computed with the old weights, under a *stale root*: nothing matches or inserts there
any more, and each stale node is freed as soon as the last lock through it is released. Stale
tokens are counted apart (``stale_size``) until then.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

import torch

from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache, MatchResult

# Key comparisons run on list slices of this many tokens (C speed) before a per-token scan.
_COMPARE_BLOCK = 64


class _Node:
    __slots__ = ("children", "key", "last_access", "lock_ref", "node_id", "parent", "value")

    def __init__(
        self, node_id: int, key: list[int], value: torch.Tensor, parent: _Node | None
    ) -> None:
        self.node_id = node_id
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[object, _Node] = {}
        self.lock_ref = 0
        self.last_access = 0

    def __repr__(self) -> str:
        return f"_Node(id={self.node_id}, len={len(self.key)}, lock_ref={self.lock_ref})"


def _common_prefix_len(key: list[int], offset: int, node_key: list[int]) -> int:
    """Length of the common prefix of ``key[offset:]`` and ``node_key``."""
    n = min(len(key) - offset, len(node_key))
    if key[offset : offset + n] == node_key[:n]:
        return n
    for lo in range(0, n, _COMPARE_BLOCK):
        hi = min(lo + _COMPARE_BLOCK, n)
        if key[offset + lo : offset + hi] != node_key[lo:hi]:
            for i in range(lo, hi):
                if key[offset + i] != node_key[i]:
                    return i
    return n


def _check(condition: bool, message: str) -> None:
    """An assertion that survives ``python -O`` (integrity checks are part of the contract)."""
    if not condition:
        raise AssertionError(message)


class RadixCache(BasePrefixCache):
    """Prefix cache over a :class:`TokenToKVPoolAllocator`; see :class:`BasePrefixCache`."""

    def __init__(self, allocator: TokenToKVPoolAllocator, page_size: int) -> None:
        if page_size != allocator.page_size:
            raise ValueError(f"page_size {page_size} != allocator.page_size {allocator.page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.device = allocator.device
        self._ids = itertools.count()
        self.reset()

    # ------------------------------------------------------------------ bookkeeping

    def reset(self) -> None:
        """Drop the tree without freeing slots (pair with ``allocator.clear()``)."""
        self._root = _Node(next(self._ids), [], self._empty(), None)
        self._root.lock_ref = 1  # the root is never evictable nor counted
        self._evictable_leaves: set[_Node] = set()
        self._evictable_size = 0
        self._protected_size = 0
        self._clock = 0
        self._stale_roots: list[_Node] = []  # detached by invalidate(); only locked nodes
        self._stale_size = 0

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def stale_size(self) -> int:
        return self._stale_size

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def _child_key(self, key: list[int], offset: int) -> object:
        if self.page_size == 1:
            return key[offset]
        return tuple(key[offset : offset + self.page_size])

    def _refresh_leaf_state(self, node: _Node) -> None:
        """Keep ``_evictable_leaves`` exact after ``node``'s children or lock_ref changed."""
        if node is not self._root and not node.children and node.lock_ref == 0:
            self._evictable_leaves.add(node)
        else:
            self._evictable_leaves.discard(node)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # ------------------------------------------------------------------ tree edits

    def _split(self, child: _Node, split_len: int) -> _Node:
        """Cut ``child`` after ``split_len`` tokens; return the new upper node.

        ``child`` keeps its identity (handles pointing at it stay valid) and becomes the lower
        part. The upper part inherits ``lock_ref``: every lock through ``child`` passes through it.
        """
        parent = child.parent
        assert parent is not None
        upper = _Node(next(self._ids), child.key[:split_len], child.value[:split_len], parent)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        child.key = child.key[split_len:]
        child.value = child.value[split_len:]
        child.parent = upper
        upper.children[self._child_key(child.key, 0)] = child
        parent.children[self._child_key(upper.key, 0)] = upper
        return upper

    def _walk(self, key: list[int]) -> tuple[_Node, int, list[torch.Tensor]]:
        """Follow ``key`` down the tree as far as whole pages match.

        Returns (last node reached, matched length, values along the path). Refreshes the LRU
        time of every node on the path and splits the last node when the match ends inside it,
        so the returned node covers exactly the matched prefix.
        """
        now = self._tick()
        node, pos, values = self._root, 0, []
        while len(key) - pos >= self.page_size:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            common = _common_prefix_len(key, pos, child.key)
            common -= common % self.page_size
            if common < len(child.key):
                # The next page of key (if any) differs from the lower part's first page, so the
                # loop stops at the upper part on its next iteration.
                child = self._split(child, common)
            child.last_access = now
            values.append(child.value)
            node, pos = child, pos + common
        return node, pos, values

    def match_prefix(self, key: list[int]) -> MatchResult:
        node, _, values = self._walk(key)
        indices = torch.cat(values) if values else self._empty()
        return MatchResult(device_indices=indices, handle=node)

    def insert(self, key: list[int], indices: torch.Tensor) -> int:
        if len(key) % self.page_size != 0:
            raise ValueError(f"insert key length {len(key)} is not a multiple of page_size")
        if indices.numel() < len(key):
            raise ValueError(f"{indices.numel()} indices for a key of {len(key)} tokens")
        node, pos, _ = self._walk(key)
        if pos == len(key):
            return pos
        value = indices[pos : len(key)].to(device=self.device, dtype=torch.int64, copy=True)
        leaf = _Node(next(self._ids), list(key[pos:]), value, node)
        leaf.last_access = self._clock
        node.children[self._child_key(leaf.key, 0)] = leaf
        self._evictable_size += len(leaf.key)
        self._refresh_leaf_state(node)
        self._refresh_leaf_state(leaf)
        return pos

    # ------------------------------------------------------------------ locking

    def lock(self, handle: object) -> None:
        node = self._as_node(handle)
        _check(self._root_of(node) is self._root, "lock of a handle invalidated since its match")
        for path_node in self._path_up(node):
            if path_node.lock_ref == 0:
                self._evictable_size -= len(path_node.key)
                self._protected_size += len(path_node.key)
            path_node.lock_ref += 1
            self._refresh_leaf_state(path_node)

    def unlock(self, handle: object) -> None:
        node = self._as_node(handle)
        if self._root_of(node) is not self._root:
            self._unlock_stale(node)
            return
        for path_node in self._path_up(node):
            _check(path_node.lock_ref > 0, f"unlock of an unlocked node {path_node}")
            path_node.lock_ref -= 1
            if path_node.lock_ref == 0:
                self._evictable_size += len(path_node.key)
                self._protected_size -= len(path_node.key)
            self._refresh_leaf_state(path_node)

    def _path_up(self, node: _Node) -> Iterator[_Node]:
        """``node``, its parent, ... up to the live root (excluded). Precondition: ``node`` is
        under the live root. Yields lazily: callers may mutate each node as it comes."""
        while node is not self._root:
            yield node
            parent = node.parent
            assert parent is not None, f"{node} is not under the live root"
            node = parent

    def _as_node(self, handle: object) -> _Node:
        if not isinstance(handle, _Node):
            raise TypeError(f"not a RadixCache handle: {handle!r}")
        return handle

    @staticmethod
    def _root_of(node: _Node) -> _Node:
        while node.parent is not None:
            node = node.parent
        return node

    # ------------------------------------------------------------------ invalidation

    def invalidate(self) -> int:
        evicted = self.evict(self._evictable_size)
        if self._root.children:
            self._stale_roots.append(self._root)
            self._stale_size += self._protected_size
            root = _Node(next(self._ids), [], self._empty(), None)
            root.lock_ref = 1
            self._root = root
            self._protected_size = 0
        return evicted

    def _unlock_stale(self, node: _Node) -> None:
        """Unlock a path of a stale tree, freeing the nodes no lock passes through any more."""
        freed = []
        while node.parent is not None:
            _check(node.lock_ref > 0, f"unlock of an unlocked stale node {node}")
            node.lock_ref -= 1
            parent = node.parent
            if node.lock_ref == 0:
                _check(not node.children, f"stale {node} freed before its children")
                del parent.children[self._child_key(node.key, 0)]
                self._stale_size -= len(node.key)
                freed.append(node.value)
            node = parent
        if freed:
            self.allocator.free(torch.cat(freed))
        if not node.children and node in self._stale_roots:
            self._stale_roots.remove(node)

    # ------------------------------------------------------------------ eviction

    def evict(self, num_tokens: int) -> int:
        if num_tokens <= 0:
            return 0
        heap = [(n.last_access, n.node_id, n) for n in self._evictable_leaves]
        heapq.heapify(heap)
        num_freed, freed_values = 0, []
        while num_freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[self._child_key(leaf.key, 0)]
            self._evictable_leaves.discard(leaf)
            self._evictable_size -= len(leaf.key)
            num_freed += len(leaf.key)
            freed_values.append(leaf.value)
            self._refresh_leaf_state(parent)
            if parent in self._evictable_leaves:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        if freed_values:
            self.allocator.free(torch.cat(freed_values))
        return num_freed

    # ------------------------------------------------------------------ checks and debugging

    def _nodes(self, root: _Node | None = None) -> list[_Node]:
        """Every non-root node under ``root`` (default: the live root), parents first."""
        root = self._root if root is None else root
        out, stack = [], list(root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def check_integrity(self, num_private: int = 0) -> None:
        nodes = self._nodes()
        evictable = protected = 0
        for node in nodes:
            self._check_node(node)
            if node.lock_ref > 0:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        _check(evictable == self._evictable_size, f"evictable {self._evictable_size}!={evictable}")
        _check(protected == self._protected_size, f"protected {self._protected_size}!={protected}")
        leaves = {n for n in nodes if not n.children and n.lock_ref == 0}
        _check(leaves == self._evictable_leaves, "evictable-leaf set out of date")
        stale_nodes = [n for root in self._stale_roots for n in self._nodes(root)]
        for node in stale_nodes:
            self._check_node(node)
            _check(node.lock_ref > 0, f"stale {node} is unlocked but not freed")
        stale = sum(len(n.key) for n in stale_nodes)
        _check(stale == self._stale_size, f"stale {self._stale_size}!={stale}")
        _check(all(r.children for r in self._stale_roots), "an empty stale root is kept")
        self._check_slots(nodes + stale_nodes)
        free = self.allocator.available_size()
        total = free + evictable + protected + stale + num_private
        _check(
            total == self.allocator.size,
            f"KV leak: free {free} + evictable {evictable} + protected {protected} + stale "
            f"{stale} + private {num_private} = {total} != capacity {self.allocator.size}",
        )

    def _check_node(self, node: _Node) -> None:
        parent = node.parent
        _check(parent is not None, f"{node} has no parent")
        assert parent is not None
        _check(len(node.key) > 0, f"{node} is empty")
        _check(len(node.key) % self.page_size == 0, f"{node} is not page-aligned")
        _check(node.value.numel() == len(node.key), f"{node} key/value lengths differ")
        _check(parent.children.get(self._child_key(node.key, 0)) is node, f"{node} misfiled")
        _check(node.lock_ref >= 0, f"{node} has a negative lock_ref")
        locks_below = sum(c.lock_ref for c in node.children.values())
        _check(node.lock_ref >= locks_below, f"{node} has fewer locks than its children")
        _check(all(c.parent is node for c in node.children.values()), f"{node} child misparented")

    def _check_slots(self, nodes: list[_Node]) -> None:
        """Cached slots are distinct, form whole pages, and none of those pages is free."""
        if not nodes:
            return
        slots = torch.cat([n.value for n in nodes]).cpu()
        _check(torch.unique(slots).numel() == slots.numel(), "a slot is cached twice")
        pages = slots.view(-1, self.page_size)
        offsets = pages - pages[:, :1]
        _check(bool((pages[:, 0] % self.page_size == 0).all()), "a node starts mid-page")
        _check(bool((offsets == torch.arange(self.page_size)).all()), "a page is not contiguous")
        page_ids = pages[:, 0] // self.page_size
        _check(bool((page_ids >= 1).all()), "the reserved page is cached")
        free_ids = self.allocator.free_page_ids().cpu()
        _check(not bool(torch.isin(page_ids, free_ids).any()), "a cached page is also free")

    def cached_slots(self) -> torch.Tensor:
        nodes = self._nodes() + [n for root in self._stale_roots for n in self._nodes(root)]
        if not nodes:
            return torch.empty(0, dtype=torch.int64)
        return torch.cat([n.value for n in nodes]).cpu()

    def pretty_print(self) -> str:
        lines = [repr(self)]
        stack = [(c, 1) for c in self._root.children.values()]
        while stack:
            node, depth = stack.pop()
            head = node.key[:8]
            lines.append(f"{'  ' * depth}{head}{'...' if len(node.key) > 8 else ''} {node}")
            stack.extend((c, depth + 1) for c in node.children.values())
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"RadixCache(page_size={self.page_size}, evictable={self._evictable_size}, "
            f"protected={self._protected_size}, stale={self._stale_size})"
        )
