"""The scheduler's invariants: every KV slot and pool row has exactly one owner.

Owners of the ``allocator.size`` usable KV slots (whole pages), at every loop-turn boundary::

    free list  +  prefix cache (evictable + protected + stale)  +  admitted requests' private
    pages ([prefix_len, kv_len), a partial last page counted whole, and the decode slots it
    reserved)  ==  allocator.size

(a request in the decode step in flight, in the overlap schedule, also holds that step's slot:
``[prefix_len, kv_len + 1)``)

and each ReqToTokenPool row in use belongs to exactly one admitted request. Requests in the
waiting queue hold nothing. Beyond the counts: the radix tree's own integrity and page-level
ownership (no page both free and held, none held twice).

Called whenever the scheduler goes idle, before every flush (a leak must show before a reset
hides it), every idle turn in debug mode, and after every step in the in-process tests.
"""

from __future__ import annotations

import torch

from sglang.srt.managers.req_kv import ReqKV
from sglang.srt.managers.schedule_batch import Req, ReqStatus, ScheduleBatch

_HOLDING = (ReqStatus.RUNNING, ReqStatus.PREFILLING, ReqStatus.PAUSED)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(f"Scheduler invariant violated: {message}")


def check_invariants(
    kv: ReqKV,
    waiting_queue: list[Req],
    chunked_req: Req | None,
    running_batch: ScheduleBatch,
    in_flight: list[Req] | None = None,
) -> None:
    """Raise AssertionError naming the first violated invariant. Read-only. ``in_flight``:
    the requests of the decode step launched and not committed yet."""
    holders = running_batch.reqs + ([] if chunked_req is None else [chunked_req])
    ahead = {id(r) for r in in_flight or [] if not r.finished}
    _check(ahead <= {id(r) for r in running_batch.reqs}, "a step in flight outside the batch")
    for req in waiting_queue:
        _check(req.status is ReqStatus.WAITING, f"{req} queued with status {req.status}")
        _check(req.req_pool_idx is None and req.cache_handle is None, f"queued {req} holds KV")
        _check(not req.decode_slots, f"queued {req} holds reserved decode slots")
    for req in holders:
        _check(req.status in _HOLDING, f"admitted {req} has status {req.status}")
        _check(req.req_pool_idx is not None, f"admitted {req} has no pool row")
    if chunked_req is not None:
        left = len(chunked_req.fill_ids) - chunked_req.kv_len
        _check(left > 0, f"chunked {chunked_req} has no chunk left")
    ids = [id(r) for r in waiting_queue + holders]
    _check(len(ids) == len(set(ids)), "a request is in two places")

    pool = kv.req_to_token_pool
    rows = [r.req_pool_idx for r in holders]
    _check(len(rows) == len(set(rows)), f"a pool row is shared: {rows}")
    rows_used = pool.size - pool.available_size()
    _check(rows_used == len(holders), f"{rows_used} pool rows in use, {len(holders)} holders")

    reserved = sum(len(r.decode_slots) for r in holders)
    _check(
        reserved == kv.reserved_slots,
        f"{reserved} decode slots reserved, {kv.reserved_slots} counted",
    )
    cache = kv.tree_cache
    private = sum(kv.num_private_slots(r, id(r) in ahead) for r in holders)
    free = kv.allocator.available_size()
    total = free + cache.total_size() + private
    _check(
        total == kv.allocator.size,
        f"KV slots: free {free} + cached {cache.total_size()} + private {private} = {total} "
        f"!= pool {kv.allocator.size}",
    )
    cache.check_integrity(num_private=private)
    _check_slot_owners(kv, holders, ahead)


def _check_slot_owners(kv: ReqKV, holders: list[Req], ahead: set[int]) -> None:
    """No page is held by two owners (a request, the cache, the free list).

    One linear count over the pool's page ids (``bincount``), not a sort: on CPU the free list
    holds millions of pages, and this runs before every flush and whenever the scheduler goes
    idle (so before pause replies); sorting them took most of a second.
    """
    page_size = kv.page_size
    owned = [
        torch.unique(kv.private_slots(r, id(r) in ahead) // page_size).cpu() for r in holders
    ]
    owned.append(torch.unique(kv.tree_cache.cached_slots() // page_size).cpu())
    owned.append(kv.allocator.free_page_ids().cpu())
    pages = torch.cat(owned)
    if pages.numel() == 0:
        return
    _check(bool((pages >= 1).all()), "the reserved padding page is owned")
    pages_in_pool = kv.allocator.num_pages + 1
    _check(bool((pages < pages_in_pool).all()), "a page id is outside the pool")
    owners = torch.bincount(pages, minlength=pages_in_pool)
    _check(int(owners.max()) <= 1, "a KV page has two owners")
