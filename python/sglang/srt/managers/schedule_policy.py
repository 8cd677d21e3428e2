"""Which waiting requests to prefill next: queue order and the token budget of one prefill."""

from __future__ import annotations

from dataclasses import dataclass

from sglang.srt.managers.req_kv import ReqKV, cache_key
from sglang.srt.managers.schedule_batch import Req

# Output tokens a running request is assumed to still need at most, when reserving KV for it.
_MAX_RESERVED_NEW_TOKENS = 4096
# New tokens a request must compute in a prefill batch before identical waiting requests wait
# a round for them (SharedPrompts): below that, computing them twice costs less than the wait.
_SHARED_PROMPT_MIN_TOKENS = 32


def sort_waiting_queue(queue: list[Req], policy: str, kv: ReqKV) -> None:
    """Order ``queue`` in place: fcfs keeps arrival order, lpm puts long cached prefixes first.

    lpm only peeks at the cache (match without locking); the match is redone at admission.
    """
    if policy == "fcfs" or len(queue) < 2:
        return
    lengths = {}
    for r in queue:
        ids = cache_key(r.origin_input_ids + r.output_ids, kv.lora_uid(r.lora_name))
        lengths[id(r)] = int(kv.tree_cache.match_prefix(ids[: len(ids) - 1]).device_indices.numel())
    queue.sort(key=lambda r: -lengths[id(r)])


def reserved_decode_tokens(running: list[Req], new_token_ratio: float) -> int:
    """KV to keep for requests already running: their remaining budget times the ratio."""
    return int(
        sum(
            min(r.sampling_params.max_new_tokens - len(r.output_ids), _MAX_RESERVED_NEW_TOKENS)
            for r in running
        )
        * new_token_ratio
    )


@dataclass
class PrefillAdder:
    """Admits requests into one prefill batch within its budgets.

    * ``rem_total_tokens``: KV tokens available (free + evictable) minus what running requests
      are expected to need;
    * ``rem_input_tokens``: ``--max-prefill-tokens`` for this forward pass;
    * ``rem_chunk_tokens``: ``--chunked-prefill-size`` (None: no chunking). A request longer
      than what is left is cut, and becomes the batch's (single) chunked request;
    * ``max_requests``: ``--prefill-max-requests`` (None: no limit), the continuing chunked
      request counted.
    """

    kv: ReqKV
    rem_total_tokens: int
    rem_input_tokens: int
    rem_chunk_tokens: int | None
    new_token_ratio: float
    page_size: int
    max_requests: int | None = None

    def __post_init__(self) -> None:
        self.can_run: list[Req] = []
        self.new_chunked_req: Req | None = None

    def add_chunked_req(self, req: Req) -> None:
        """Continue a chunked prefill: it goes first and is never refused."""
        req.extend_len = self._chunk_len(len(req.fill_ids) - req.kv_len)
        req.is_chunked = req.kv_len + req.extend_len < len(req.fill_ids)
        self._take(req, req.extend_len)
        self.can_run.append(req)
        if req.is_chunked:
            self.new_chunked_req = req

    def add_one_req(self, req: Req) -> bool:
        """Try to admit ``req`` (its prefix is matched and locked here). False: stop adding."""
        if self.new_chunked_req is not None or not self.budget_left():
            return False
        req.init_fill_ids()
        available = self.kv.available_tokens()
        self.kv.match_and_lock(req, req.max_prefix_len())
        # Locking the match made those cached tokens unevictable: they leave the budget.
        locked = available - self.kv.available_tokens()
        self.rem_total_tokens -= locked
        extend_len = len(req.fill_ids) - req.kv_len
        take = self._chunk_len(extend_len)
        if take > self.rem_input_tokens:
            take = self._page_floor(self.rem_input_tokens)
        if take < extend_len and (self.rem_chunk_tokens is None or take == 0):
            if self.can_run or self.rem_chunk_tokens is not None:
                self._refuse(req, locked)
                return False
            take = extend_len  # chunking is off: a lone prompt over the budget still runs
        reserve = min(
            req.sampling_params.max_new_tokens - len(req.output_ids), _MAX_RESERVED_NEW_TOKENS
        )
        need = take + self.page_size
        if take == extend_len:
            need += int(reserve * self.new_token_ratio)
        alone_fits = not self.can_run and take + self.page_size <= self.rem_total_tokens
        if need > self.rem_total_tokens and not alone_fits:
            self._refuse(req, locked)
            return False
        req.cached_tokens = max(req.cached_tokens, req.prefix_len)
        req.extend_len = take
        req.is_chunked = take < extend_len
        self._take(req, need)
        self.can_run.append(req)
        if req.is_chunked:
            self.new_chunked_req = req
        return True

    def _refuse(self, req: Req, locked: int) -> None:
        self.kv.unlock_unadmitted(req)
        self.rem_total_tokens += locked

    def budget_left(self) -> bool:
        if self.max_requests is not None and len(self.can_run) >= self.max_requests:
            return False
        return self.rem_input_tokens > 0 and (
            self.rem_chunk_tokens is None or self.rem_chunk_tokens > 0
        )

    def _chunk_len(self, extend_len: int) -> int:
        if self.rem_chunk_tokens is None or extend_len <= self.rem_chunk_tokens:
            return extend_len
        return self._page_floor(self.rem_chunk_tokens)

    def _page_floor(self, num_tokens: int) -> int:
        # Cut on a page boundary so the cached part of a chunked request stays page-aligned.
        return max(num_tokens, 0) // self.page_size * self.page_size

    def _take(self, req: Req, total: int) -> None:
        self.rem_total_tokens -= total
        self.rem_input_tokens -= req.extend_len
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= req.extend_len


class SharedPrompts:
    """The prompt prefixes one prefill batch computes (per adapter), so that waiting requests
    that begin with one of them (``n`` samples of a prompt, a group of the same prompt from an
    RL trainer, questions behind one system prompt) wait one round and then take those tokens
    from the prefix cache, where the computing request's KV is handed once its step is done
    (ReqKV.share_computed), instead of computing them a second time in the same batch.

    A request is deferred only when the batch computes at least ``_SHARED_PROMPT_MIN_TOKENS``
    (rounded up to whole pages, as only whole pages are cached) of the tokens it begins with,
    and it could take them from the cache (no prompt logprobs wanted from before them); with a
    cache that keeps nothing (``--disable-radix-cache``) none is.
    """

    def __init__(self, enabled: bool, page_size: int) -> None:
        self.enabled = enabled
        self._min_shared = -(-_SHARED_PROMPT_MIN_TOKENS // page_size) * page_size
        # For each computing request with at least _min_shared new tokens, keyed by (adapter,
        # start, its first _min_shared new tokens): its tokens. A window is checked first, the
        # tokens before it only on a hit, so a waiting request costs one short tuple per start.
        self._windows: dict[tuple[str | None, int, tuple[int, ...]], list[list[int]]] = {}
        self._starts: set[int] = set()

    def add(self, req: Req) -> None:
        """``req`` was admitted (or continues its chunked prefill) in the batch: it computes
        ``req.extend_len`` tokens of ``req.fill_ids`` from ``req.kv_len`` on."""
        # A request wanting prompt logprobs may recompute cached tokens: nothing new to share.
        if not self.enabled or req.extend_len < self._min_shared or req.wants_input_logprobs:
            return
        start = req.kv_len
        window = tuple(req.fill_ids[start : start + self._min_shared])
        self._starts.add(start)
        self._windows.setdefault((req.lora_name, start, window), []).append(req.fill_ids)

    def defers(self, req: Req) -> bool:
        """Whether ``req`` should wait for the batch's copy of the tokens it begins with."""
        if not self._windows:
            return False
        ids = req.origin_input_ids + req.output_ids if req.output_ids else req.origin_input_ids
        usable = len(ids) - 1  # as Req.max_prefix_len: the last token is always computed
        if req.wants_input_logprobs:
            usable = min(usable, req.logprob_start_len)
        for start in self._starts:
            end = start + self._min_shared
            if end > usable:
                continue
            computing = self._windows.get((req.lora_name, start, tuple(ids[start:end])))
            if computing and any(other[:start] == ids[:start] for other in computing):
                return True
        return False
