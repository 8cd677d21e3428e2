"""Unit tests for the paged KV-slot allocator (small fake pools, CPU)."""

from __future__ import annotations

import random

import pytest
import torch

from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator


def make(size: int, page_size: int) -> TokenToKVPoolAllocator:
    return TokenToKVPoolAllocator(size, page_size, "cpu", debug=True)


@pytest.mark.parametrize("page_size", [1, 4])
def test_initial_capacity_and_reserved_page(page_size: int) -> None:
    alloc = make(32, page_size)
    assert alloc.size == 32
    assert alloc.available_size() == 32
    slots = alloc.alloc_extend([0], [32], [-1])
    assert slots is not None
    assert sorted(slots.tolist()) == list(range(page_size, 32 + page_size))
    assert alloc.available_size() == 0


def test_size_rounds_down_to_whole_pages() -> None:
    alloc = make(30, 4)
    assert alloc.size == 28
    assert alloc.num_pages == 7
    assert alloc.available_size() == 28


def test_page_size_one_extend_is_a_plain_take() -> None:
    alloc = make(16, 1)
    slots = alloc.alloc_extend([0, 3], [5, 6], [-1, 7])
    assert slots is not None and slots.dtype == torch.int64
    assert slots.numel() == 5 + 3
    assert len(set(slots.tolist())) == 8
    assert alloc.available_size() == 8


def test_extend_from_scratch_fills_whole_pages_in_order() -> None:
    alloc = make(64, 4)
    slots = alloc.alloc_extend([0, 0], [6, 3], [-1, -1])
    assert slots is not None
    a, b = slots[:6].tolist(), slots[6:].tolist()
    # Position p lives at offset p % 4 of its page; one page per 4 positions.
    assert [s % 4 for s in a] == [0, 1, 2, 3, 0, 1]
    assert a[1:4] == [a[0] + 1, a[0] + 2, a[0] + 3]
    assert a[5] == a[4] + 1
    assert a[4] // 4 != a[0] // 4
    assert [s % 4 for s in b] == [0, 1, 2]
    assert alloc.available_size() == 64 - 3 * 4


def test_extend_continues_partial_page() -> None:
    alloc = make(64, 4)
    first = alloc.alloc_extend([0], [6], [-1])
    assert first is not None
    last_loc = int(first[-1])  # slot of position 5, offset 1 in its page
    free_before = alloc.available_size()
    more = alloc.alloc_extend([6], [11], [last_loc])
    assert more is not None
    m = more.tolist()
    # positions 6, 7 finish the held page; 8, 9, 10 open exactly one new page.
    assert m[:2] == [last_loc + 1, last_loc + 2]
    assert [s % 4 for s in m[2:]] == [0, 1, 2]
    assert m[3:] == [m[2] + 1, m[2] + 2]
    assert alloc.available_size() == free_before - 4
    assert alloc.num_pages_needed_extend([6], [11]) == 1


def test_extend_within_partial_page_takes_no_page() -> None:
    alloc = make(16, 4)
    first = alloc.alloc_extend([0], [5], [-1])
    assert first is not None
    free_before = alloc.available_size()
    more = alloc.alloc_extend([5], [7], [int(first[-1])])
    assert more is not None
    assert more.tolist() == [int(first[-1]) + 1, int(first[-1]) + 2]
    assert alloc.available_size() == free_before


def test_extend_mixed_batch_order_and_tensor_last_locs() -> None:
    alloc = make(64, 4)
    base = alloc.alloc_extend([0], [3], [-1])
    assert base is not None
    last = torch.tensor([-1, int(base[-1]), -1])
    slots = alloc.alloc_extend([0, 3, 0], [2, 9, 4], last)
    assert slots is not None
    s = slots.tolist()
    assert len(s) == 2 + 6 + 4
    assert [x % 4 for x in s[:2]] == [0, 1]
    assert s[2] == int(base[-1]) + 1  # position 3 completes the held page
    assert [x % 4 for x in s[3:8]] == [0, 1, 2, 3, 0]
    assert [x % 4 for x in s[8:]] == [0, 1, 2, 3]
    assert len(set(s) | set(base.tolist())) == len(s) + 3


def test_extend_skips_requests_with_nothing_new() -> None:
    alloc = make(64, 4)
    held = alloc.alloc_extend([0], [6], [-1])
    assert held is not None
    last = int(held[-1])
    # Requests 0 and 2 have nothing new; request 2 even ends mid-page.
    slots = alloc.alloc_extend([6, 0, 6, 0], [6, 2, 6, 5], [last, -1, last, -1])
    assert slots is not None and slots.numel() == 2 + 5
    s = slots.tolist()
    assert [x % 4 for x in s] == [0, 1, 0, 1, 2, 3, 0]
    assert s[1] == s[0] + 1 and s[3:6] == [s[2] + 1, s[2] + 2, s[2] + 3]
    assert not {x // 4 for x in s} & {int(h) // 4 for h in held}
    empty = alloc.alloc_extend([6], [6], [last])
    assert empty is not None and empty.numel() == 0


def test_decode_crosses_page_boundary() -> None:
    alloc = make(16, 4)
    slots = alloc.alloc_extend([0], [4], [-1])
    assert slots is not None
    free_before = alloc.available_size()
    s4 = alloc.alloc_decode([5], [int(slots[-1])])  # position 4 starts a new page
    assert s4 is not None and int(s4) % 4 == 0
    assert int(s4) // 4 != int(slots[-1]) // 4
    assert alloc.available_size() == free_before - 4
    s5 = alloc.alloc_decode([6], torch.tensor([int(s4)]))  # position 5 stays in that page
    assert s5 is not None and int(s5) == int(s4) + 1
    assert alloc.available_size() == free_before - 4


def test_decode_batch_vectorized() -> None:
    alloc = make(64, 4)
    pre = alloc.alloc_extend([0, 0, 0], [4, 6, 1], [-1, -1, -1])
    assert pre is not None
    last = [int(pre[3]), int(pre[9]), int(pre[10])]
    assert alloc.num_pages_needed_decode([5, 7, 2]) == 1
    assert alloc.num_pages_needed_decode(torch.tensor([5, 7, 2])) == 1
    assert alloc.num_pages_needed_decode([1, 5, 9, 2, 4]) == 3  # positions 0, 4, 8
    out = alloc.alloc_decode([5, 7, 2], last)
    assert out is not None
    o = out.tolist()
    assert o[0] % 4 == 0 and o[0] not in pre.tolist()
    assert o[1:] == [last[1] + 1, last[2] + 1]


def test_page_size_one_decode() -> None:
    alloc = make(8, 1)
    assert alloc.num_pages_needed_decode([3, 9, 2]) == 3
    assert alloc.num_pages_needed_decode(torch.tensor([3, 9, 2])) == 3
    out = alloc.alloc_decode([3, 9, 2], [1, 2, 3])
    assert out is not None and len(set(out.tolist())) == 3
    assert alloc.available_size() == 5


@pytest.mark.parametrize("page_size", [1, 4])
def test_exhaustion_returns_none_without_side_effect(page_size: int) -> None:
    alloc = make(16, page_size)
    held = alloc.alloc_extend([0], [13], [-1])
    assert held is not None
    free_before = alloc.available_size()
    ids_before = sorted(alloc.free_page_ids().tolist())
    assert alloc.alloc_extend([0], [free_before + 1], [-1]) is None
    num_reqs = free_before // page_size + 1
    assert alloc.alloc_decode([1] * num_reqs, [-1] * num_reqs) is None
    assert alloc.available_size() == free_before
    assert sorted(alloc.free_page_ids().tolist()) == ids_before
    # Exactly what is free can still be taken.
    assert alloc.alloc_extend([0], [free_before], [-1]) is not None
    assert alloc.available_size() == 0


def test_free_partial_tail_page_returns_whole_page() -> None:
    alloc = make(16, 4)
    slots = alloc.alloc_extend([0], [6], [-1])
    assert slots is not None
    alloc.free(slots[4:])  # 2 tokens in a 4-slot page
    assert alloc.available_size() == 16 - 4
    alloc.free(slots[:4])
    assert alloc.available_size() == 16


def test_freed_pages_are_reused() -> None:
    alloc = make(8, 4)
    a = alloc.alloc_extend([0], [8], [-1])
    assert a is not None and alloc.alloc_extend([0], [1], [-1]) is None
    alloc.free(a[:4])
    b = alloc.alloc_extend([0], [3], [-1])
    assert b is not None and b.tolist() == a[:3].tolist()


def test_free_copies_view() -> None:
    alloc = make(8, 1)
    row = torch.zeros(8, dtype=torch.int64)
    got = alloc.alloc_extend([0], [4], [-1])
    assert got is not None
    row[:4] = got
    alloc.free(row[:4])
    row.fill_(0)  # reusing the row must not corrupt the free list
    again = alloc.alloc_extend([0], [8], [-1])
    assert again is not None and sorted(again.tolist()) == list(range(1, 9))


@pytest.mark.parametrize("page_size", [1, 4])
def test_debug_detects_double_free_and_reserved_page(page_size: int) -> None:
    alloc = make(16, page_size)
    slots = alloc.alloc_extend([0], [page_size * 2], [-1])
    assert slots is not None
    alloc.free(slots)
    with pytest.raises(AssertionError, match="double free"):
        alloc.free(slots[:1])
    with pytest.raises(AssertionError, match="reserved"):
        alloc.free(torch.tensor([0]))
    with pytest.raises(AssertionError, match="twice in one call"):
        alloc.free(torch.tensor([page_size * 3, page_size * 3]))


def test_debug_detects_bad_last_loc() -> None:
    alloc = make(16, 4)
    slots = alloc.alloc_extend([0], [6], [-1])
    assert slots is not None
    with pytest.raises(AssertionError, match="offset"):
        alloc.alloc_extend([6], [8], [int(slots[-1]) + 1])


def test_clear_restores_everything() -> None:
    alloc = make(16, 4)
    assert alloc.alloc_extend([0], [10], [-1]) is not None
    alloc.clear()
    assert alloc.available_size() == 16
    assert sorted(alloc.free_page_ids().tolist()) == [1, 2, 3, 4]


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_random_requests_keep_paging_invariants(page_size: int) -> None:
    """Simulated requests: extend in chunks, decode, finish; slots never shared, nothing leaks."""
    rng = random.Random(page_size)
    alloc = make(256, page_size)
    live: dict[int, list[int]] = {}
    for step in range(400):
        if live and rng.random() < 0.25:
            rid = rng.choice(sorted(live))
            alloc.free(torch.tensor(live.pop(rid)))
        elif live and rng.random() < 0.5:
            rids = sorted(live)
            out = alloc.alloc_decode([len(live[r]) + 1 for r in rids], [live[r][-1] for r in rids])
            if out is not None:
                for r, s in zip(rids, out.tolist()):
                    live[r].append(s)
        else:
            rid, old = (step, []) if rng.random() < 0.5 or not live else _pick(rng, live)
            n = rng.randint(1, 20)
            out = alloc.alloc_extend([len(old)], [len(old) + n], [old[-1] if old else -1])
            if out is not None:
                live[rid] = old + out.tolist()
        used = [s for slots in live.values() for s in slots]
        assert len(used) == len(set(used))
        for slots in live.values():
            assert all(s % page_size == p % page_size for p, s in enumerate(slots))
            assert all(s >= page_size for s in slots)
        pages_held = sum(-(-len(s) // page_size) for s in live.values())
        assert alloc.available_size() == 256 - pages_held * page_size
    for slots in live.values():
        alloc.free(torch.tensor(slots))
    assert alloc.available_size() == 256


def _pick(rng: random.Random, live: dict[int, list[int]]) -> tuple[int, list[int]]:
    rid = rng.choice(sorted(live))
    return rid, live[rid]
