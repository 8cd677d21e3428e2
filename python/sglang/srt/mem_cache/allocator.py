"""The paged KV-slot allocator: the one owner of which KV-pool slots are free.

Slot layout (``ps`` = page_size, ``P`` = number of usable pages = size // ps)::

    slot:  0 .. ps-1        | ps .. 2ps-1 | ... | P*ps .. (P+1)*ps-1
    page:  0 (reserved pad) | 1           | ... | P

Page 0 is never handed out: padded index tensors point at it. The KV pool therefore has
``size + page_size`` rows. Pages are the unit of ownership; slots are handed out so that the token
at position ``p`` of a request always lives at a slot ``s`` with ``s % ps == p % ps`` and all of a
request's tokens in one page share that page. This is what lets the prefix cache store page-aligned
runs and free whole pages.

The free list is a tensor of page ids on the pool's device. Pages given back are queued in
``_released`` and merged (sorted, for locality) only when an allocation needs them, so ``free`` is
O(pages freed). Every allocation path is vectorized over the batch: no per-token Python loops.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

IntSeq = Sequence[int] | torch.Tensor


def _cpu_long(values: IntSeq) -> torch.Tensor:
    """A 1-D int64 CPU tensor from a list of ints or a tensor (a device tensor is copied back)."""
    if isinstance(values, torch.Tensor):
        return values.to(device="cpu", dtype=torch.int64).reshape(-1)
    return torch.tensor(values, dtype=torch.int64).reshape(-1)


def _count(values: IntSeq) -> int:
    """How many ints ``values`` holds (a list or a tensor), without building a tensor."""
    return values.numel() if isinstance(values, torch.Tensor) else len(values)


def _segment_ids(lengths: torch.Tensor) -> torch.Tensor:
    """``[0]*lengths[0] + [1]*lengths[1] + ...`` (a CPU repeat_interleave that stays cheap)."""
    total = int(lengths.sum())
    marks = torch.zeros(total + 1, dtype=torch.int64)
    starts = torch.cumsum(lengths, 0)[:-1]  # where requests 1.. begin (empty ones included)
    marks.index_add_(0, starts, torch.ones_like(starts))
    return torch.cumsum(marks[:total], 0)


class TokenToKVPoolAllocator:
    """Hands out and takes back KV slots, one page at a time.

    ``size`` is the number of usable token slots (rounded down to whole pages). With
    ``debug=True`` every page's free/used state is tracked and misuse (double free, freeing the
    reserved page, handing out a used page) raises AssertionError; this costs a device sync per
    call, so leave it off in production.
    """

    def __init__(self, size: int, page_size: int, device: str, debug: bool = False) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if size < page_size:
            raise ValueError(f"size ({size}) must hold at least one page of {page_size} tokens")
        self.page_size = page_size
        self.num_pages = size // page_size
        self.size = self.num_pages * page_size
        self.device = device
        self.debug = debug
        self.clear()

    # ------------------------------------------------------------------ state

    def clear(self) -> None:
        """Mark every usable page free. Any slot held by anyone becomes invalid (flush/reset)."""
        self._free_pages = torch.arange(
            1, self.num_pages + 1, dtype=torch.int64, device=self.device
        )
        self._released: list[torch.Tensor] = []
        self._num_released = 0
        if self.debug:
            self._page_is_free = torch.ones(self.num_pages + 1, dtype=torch.bool)
            self._page_is_free[0] = False

    def available_size(self) -> int:
        """Number of free token slots (free pages * page_size). Does not mutate."""
        return (self._free_pages.numel() + self._num_released) * self.page_size

    def num_free_pages(self) -> int:
        return self._free_pages.numel() + self._num_released

    def free_page_ids(self) -> torch.Tensor:
        """Ids of every free page (a fresh tensor, unordered). For integrity checks and tests."""
        return torch.cat([self._free_pages, *self._released])

    # ------------------------------------------------------------------ sizing helpers

    def num_pages_needed_extend(self, prefix_lens: IntSeq, seq_lens: IntSeq) -> int:
        """Pages ``alloc_extend(prefix_lens, seq_lens, ...)`` would take. Does not mutate."""
        prefix, seq = _cpu_long(prefix_lens), _cpu_long(seq_lens)
        ps = self.page_size
        return int(((seq + ps - 1) // ps - (prefix + ps - 1) // ps).sum())

    def num_pages_needed_decode(self, seq_lens: IntSeq) -> int:
        """Pages ``alloc_decode(seq_lens, ...)`` would take. Does not mutate."""
        ps = self.page_size
        if ps == 1:
            return _count(seq_lens)
        if isinstance(seq_lens, torch.Tensor):
            return int(((_cpu_long(seq_lens) - 1) % ps == 0).sum())
        # A batch's list: a loop costs less than building a tensor (called every decode step).
        return sum(1 for n in seq_lens if (n - 1) % ps == 0)

    # ------------------------------------------------------------------ allocation

    def _take_pages(self, num_pages: int) -> torch.Tensor | None:
        """Remove ``num_pages`` page ids from the free list, or return None and take nothing."""
        if num_pages > self.num_free_pages():
            return None
        if num_pages > self._free_pages.numel():
            merged = torch.cat([self._free_pages, *self._released])
            self._free_pages = torch.sort(merged).values
            self._released = []
            self._num_released = 0
        pages = self._free_pages[:num_pages]
        self._free_pages = self._free_pages[num_pages:]
        if self.debug:
            cpu_pages = pages.cpu()
            assert bool(self._page_is_free[cpu_pages].all()), "allocator handed out a used page"
            self._page_is_free[cpu_pages] = False
        return pages

    def alloc_extend(
        self, prefix_lens: IntSeq, seq_lens: IntSeq, last_locs: IntSeq
    ) -> torch.Tensor | None:
        """Slots for tokens ``prefix_lens[i] .. seq_lens[i]-1`` of every request, concatenated.

        ``last_locs[i]`` is the slot of token ``prefix_lens[i]-1`` (-1 when the prefix is empty):
        when the prefix ends inside a page, the request's next tokens continue that page and only
        the rest gets new pages. Returns an int64 tensor on the pool's device, or None, taking
        nothing, when too few pages are free (the caller evicts and retries).

        Interval table for one request (``ps`` = page_size, ``a = ceil(prefix/ps) * ps``)::

            positions prefix .. a-1   -> last_loc + 1 .. (the tail of the page already held)
            positions a .. seq-1      -> new pages, page k of them covering a + k*ps .. +ps-1
        """
        prefix, seq = _cpu_long(prefix_lens), _cpu_long(seq_lens)
        ps = self.page_size
        num_tokens = seq - prefix
        if ps == 1:
            return self._take_pages(int(num_tokens.sum()))
        first_new_page = (prefix + ps - 1) // ps
        new_pages = (seq + ps - 1) // ps - first_new_page
        pages = self._take_pages(int(new_pages.sum()))
        if pages is None:
            return None
        if self.debug:
            self._check_partial_pages(prefix, _cpu_long(last_locs))
        # Per new token: its request, its offset k among the request's new tokens, and its offset
        # j from the request's first new page (j < 0 while it continues the held page).
        # index_select rather than advanced indexing: far cheaper on CPU for these sizes.
        req = _segment_ids(num_tokens)
        token_start = torch.cumsum(num_tokens, 0) - num_tokens
        k = torch.arange(req.numel()) - token_start.index_select(0, req)
        j = k - (first_new_page * ps - prefix).index_select(0, req)
        page_start = torch.cumsum(new_pages, 0) - new_pages
        page_idx = page_start.index_select(0, req) + torch.div(j, ps, rounding_mode="floor")
        req_d, k_d, j_d = (t.to(self.device) for t in (req, k, j))
        partial_slots = self._on_device(last_locs).index_select(0, req_d) + 1 + k_d
        if pages.numel() == 0:
            return partial_slots
        new_slots = pages.index_select(0, page_idx.clamp(min=0).to(self.device)) * ps + j_d % ps
        return torch.where(j_d < 0, partial_slots, new_slots)

    def alloc_slots(self, num_slots: int) -> torch.Tensor | None:
        """``num_slots`` slots of a pool with page_size 1, from the front of the free list
        (kept sorted, so mostly consecutive); None, taking nothing, when too few are free."""
        if self.page_size != 1:
            raise ValueError("alloc_slots needs page_size 1")
        return self._take_pages(num_slots)

    def alloc_decode(self, seq_lens: IntSeq, last_locs: IntSeq) -> torch.Tensor | None:
        """One slot per request for its new token at position ``seq_lens[i]-1``.

        ``last_locs[i]`` is the slot of position ``seq_lens[i]-2``. A new page is taken only when
        the new position starts a page; otherwise the slot is ``last_locs[i] + 1``. ``last_locs``
        may be a device tensor (no host sync then). Returns None, taking nothing, when short.
        """
        ps = self.page_size
        if ps == 1:
            return self._take_pages(_count(seq_lens))
        seq = _cpu_long(seq_lens)
        needs_page = (seq - 1) % ps == 0
        pages = self._take_pages(int(needs_page.sum()))
        if pages is None:
            return None
        last = self._on_device(last_locs)
        if pages.numel() == 0:
            return last + 1
        page_idx = (torch.cumsum(needs_page, 0) - 1).clamp(min=0).to(self.device)
        new_slots = pages.index_select(0, page_idx) * ps
        return torch.where(needs_page.to(self.device), new_slots, last + 1)

    def free(self, slots: torch.Tensor) -> None:
        """Give back the pages holding ``slots``; they are available immediately.

        Precondition: no live token shares a page with these slots (pass every slot a request
        holds in its private pages; a partially filled page counts once). Slots are copied, so
        the caller may pass a view of ``req_to_token`` and reuse the row right after.
        """
        if slots.numel() == 0:
            return
        slots = slots.reshape(-1).to(device=self.device, dtype=torch.int64)
        if self.page_size == 1:
            pages = slots.clone()
        else:
            pages = torch.unique(slots // self.page_size)
        if self.debug:
            self._check_free(slots, pages)
        self._released.append(pages)
        self._num_released += pages.numel()

    # ------------------------------------------------------------------ helpers

    def _on_device(self, values: IntSeq) -> torch.Tensor:
        if isinstance(values, torch.Tensor):
            return values.reshape(-1).to(device=self.device, dtype=torch.int64)
        return torch.tensor(values, dtype=torch.int64).to(self.device)

    def _check_free(self, slots: torch.Tensor, pages: torch.Tensor) -> None:
        cpu_slots, cpu_pages = slots.cpu(), pages.cpu()
        assert torch.unique(cpu_slots).numel() == cpu_slots.numel(), "slot freed twice in one call"
        assert bool((cpu_pages >= 1).all()), "freeing the reserved padding page"
        assert bool((cpu_pages <= self.num_pages).all()), "freeing a slot outside the pool"
        assert not bool(self._page_is_free[cpu_pages].any()), "double free of a KV page"
        self._page_is_free[cpu_pages] = True

    def _check_partial_pages(self, prefix: torch.Tensor, last: torch.Tensor) -> None:
        partial = prefix % self.page_size != 0
        assert bool((last[partial] >= self.page_size).all()), "partial prefix without last_loc"
        assert bool(
            (last[partial] % self.page_size == (prefix[partial] - 1) % self.page_size).all()
        ), "last_loc does not sit at the prefix's offset within its page"
