"""Per-request state (:class:`Req`) and the batch the scheduler runs (:class:`ScheduleBatch`).

Sequence bookkeeping of one request (``all_ids = origin_input_ids + output_ids``)::

    position   0 ........................ prompt_len-1 | prompt_len ........ len(all_ids)-1
    tokens     origin_input_ids                         | output_ids
    KV         [0, kv_len) computed; in DECODE kv_len == len(all_ids) - 1 (last token not fed yet)

A retracted request keeps ``output_ids``; re-admission prefills ``fill_ids = all_ids`` again.

Lifecycle (``Req.status``; only the Scheduler core's admit / retract / finish / pause methods
change it, and each releases what the request holds before it moves)::

    status        where it lives                     holds KV + a pool row
    WAITING       Scheduler.waiting_queue            no
    PREFILLING    Scheduler.chunked_req              yes (the chunks computed so far)
    RUNNING       the running batch (or the extend   yes
                  batch of the current step)
    PAUSED        as RUNNING / PREFILLING, while     yes (an in_place pause)
                  the engine is paused in place
    FINISHED      nowhere (its final output is sent) no

    WAITING ──admit──► PREFILLING ──last chunk──► RUNNING ──finish──► FINISHED
       ▲  └──admit (whole prompt)──────────────────►│  ▲
       └──────────── retract (KV released) ◄────────┘  └─ continue ◄── PAUSED (in_place)
    any state ──finish (stop, length, abort, rejection, error)──► FINISHED
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import Any

import torch

from sglang.srt.constrained.base_grammar_backend import GrammarMatcher
from sglang.srt.managers.req_kv import ReqKV
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.sampling.stop_regex import match_stop_regex, max_match_chars


class ReqStatus(enum.Enum):
    """Where a request is in its lifecycle (see the module docstring)."""

    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    PAUSED = "paused"
    FINISHED = "finished"


class Req:
    """One generation request inside the scheduler. Only the Scheduler mutates it."""

    def __init__(
        self,
        rid: str,
        origin_input_ids: list[int],
        sampling_params: SamplingParams,
        sampling_seed: int,
        eos_token_ids: set[int],
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        stream: bool = False,
        return_entropy: bool = False,
        entropy_mode: str | None = None,
        entropy_top_k: int | None = None,
        lora_name: str | None = None,
        return_routed_experts: bool = False,
        routed_experts_start_len: int = 0,
    ) -> None:
        self.rid = rid
        # The LoRA adapter (None: the base model), and the prefix-cache namespace of the
        # adapter weights its KV was computed with (set when it takes KV; 0 = base).
        self.lora_name = lora_name
        self.lora_uid = 0
        self.origin_input_ids = origin_input_ids
        self.sampling_params = sampling_params
        self.sampling_seed = sampling_seed
        self.eos_token_ids = eos_token_ids  # stop tokens (model EOS unless ignore_eos, + user's)
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len
        self.top_logprobs_num = top_logprobs_num
        self.stream = stream
        self.return_entropy = return_entropy
        # The request's entropy definition; None takes the server's --entropy-mode/-top-k.
        self.entropy_mode = entropy_mode
        self.entropy_top_k = entropy_top_k
        # MoE routing of positions [routed_experts_start_len, kv_len), read when it finishes:
        # base64 of int32 [rows, layers, top_k] (RoutedExpertsRecorder); None until then.
        self.return_routed_experts = return_routed_experts
        self.routed_experts_start_len = routed_experts_start_len
        self.routed_experts: str | None = None
        # Longest stop string: in bytes (an upper bound on its tokens, for the tail decoded by
        # check_finished) and in characters (what the detokenizer holds back while streaming).
        self.stop_str_max_tokens = max(
            (len(s.encode()) for s in sampling_params.stop_strs), default=0
        )
        self.stop_str_max_chars = max((len(s) for s in sampling_params.stop_strs), default=0)
        self.stop_regex_max_chars = max_match_chars(sampling_params.stop_regex_strs)
        # Constrained decoding (json_schema / regex / ebnf / structural_tag): the grammar's
        # state over output_ids, set by the Scheduler when it takes the request in.
        self.grammar: GrammarMatcher | None = None
        self.arrival_time = time.monotonic()

        self.status = ReqStatus.WAITING
        self.output_ids: list[int] = []
        # Why it ends (stop / length / abort), set by check_finished or the finish path;
        # ``status`` becomes FINISHED only once the Scheduler has released it.
        self.finished_reason: dict[str, Any] | None = None

        # KV state (see ReqKV)
        self.fill_ids: list[int] = []
        self.req_pool_idx: int | None = None
        self.cache_handle: Any = None
        self.prefix_indices: torch.Tensor | None = None
        self.prefix_len = 0
        self.kv_len = 0
        self.extend_len = 0  # tokens computed by the current extend step
        self.is_chunked = False  # True while a chunked prefill has more chunks to go
        self.kv_generation = 0  # weight generation under which the KV held now began
        # Slots reserved for its next decode tokens, the next one last (ReqKV.alloc_decode)
        self.decode_slots: list[int] = []

        # Accounting and output
        self.cached_tokens = 0
        self.num_retractions = 0
        self.num_sent_ids = 0  # output ids already sent to the detokenizer
        # [version, start, end) runs over output_ids: the weights that computed each token
        self.weight_version_spans: list[list] = []
        self.output_token_logprobs_val: list[float] = []
        self.output_token_logprobs_idx: list[int] = []
        self.output_top_logprobs_val: list[list[float]] = []
        self.output_top_logprobs_idx: list[list[int]] = []
        self.output_token_entropy_val: list[float] = []
        self.input_token_logprobs_val: list[float | None] = []
        self.input_token_logprobs_idx: list[int] = []
        self.input_top_logprobs_val: list[list[float]] = []
        self.input_top_logprobs_idx: list[list[int]] = []
        self.input_logprobs_done = False  # all prompt logprobs computed
        self.input_logprobs_sent = False

    # ---- derived ----------------------------------------------------------------------------
    @property
    def prompt_len(self) -> int:
        return len(self.origin_input_ids)

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def entropy_request(self) -> tuple[str | None, int | None] | None:
        """(mode, top_k) of the entropy this request wants per token, None when it wants none."""
        return (self.entropy_mode, self.entropy_top_k) if self.return_entropy else None

    @property
    def wants_input_logprobs(self) -> bool:
        """True while prompt logprobs are still to be computed (never again after a retract)."""
        return (
            self.return_logprob
            and 0 <= self.logprob_start_len < self.prompt_len
            and not self.input_logprobs_done
        )

    def init_fill_ids(self) -> None:
        """Before (re-)admission: the tokens whose KV must exist before the next sample."""
        self.fill_ids = self.origin_input_ids + self.output_ids

    def max_prefix_len(self) -> int:
        """How much of ``fill_ids`` may come from the cache.

        At least one token is always computed (its logits give the next token); prompt logprobs
        need the logits from position ``logprob_start_len`` on.
        """
        limit = len(self.fill_ids) - 1
        if self.wants_input_logprobs:
            limit = min(limit, self.logprob_start_len)
        return limit

    # ---- finishing --------------------------------------------------------------------------
    def check_finished(self, tokenizer: Any) -> None:
        """Set ``finished_reason`` if the last output token ends the request."""
        if self.finished:
            return
        sp = self.sampling_params
        num_out = len(self.output_ids)
        if num_out >= sp.max_new_tokens:
            self.finished_reason = {"type": "length", "length": sp.max_new_tokens}
            return
        last = self.output_ids[-1]
        if self.grammar is not None and self.grammar.is_terminated():
            self.finished_reason = {"type": "stop", "matched": last}
            return
        # min_new_tokens holds back token-based stops only (their logits are masked until
        # then; never for a request with a grammar); stop strings end a request at any
        # length, as upstream.
        held = num_out < sp.min_new_tokens and self.grammar is None
        if not held and last in self.eos_token_ids:
            self.finished_reason = {"type": "stop", "matched": last}
            return
        if sp.stop_strs and tokenizer is not None:
            tail = tokenizer.decode(self.output_ids[-(self.stop_str_max_tokens + 2) :])
            for stop in sp.stop_strs:
                if stop in tail:
                    self.finished_reason = {"type": "stop", "matched": stop}
                    return
        if sp.stop_regex_strs and tokenizer is not None:
            tail = tokenizer.decode(self.output_ids[-(self.stop_regex_max_chars + 1) :])
            matched = match_stop_regex(tail, sp.stop_regex_strs)
            if matched is not None:
                self.finished_reason = {"type": "stop", "matched": matched}

    def on_retract(self) -> None:
        """The request lost its KV: count it, and drop partial prompt logprobs (recomputed)."""
        self.num_retractions += 1
        self.is_chunked = False
        if not self.input_logprobs_done:
            self.input_token_logprobs_val.clear()
            self.input_token_logprobs_idx.clear()
            self.input_top_logprobs_val.clear()
            self.input_top_logprobs_idx.clear()

    def abort(self, message: str) -> None:
        """Set an abort reason (the Scheduler's ``finish`` moves the request out)."""
        self.finished_reason = {"type": "abort", "message": message}

    def __repr__(self) -> str:
        return f"Req(rid={self.rid!r}, prompt_len={self.prompt_len}, out={len(self.output_ids)})"


class ScheduleBatch:
    """A list of requests run together, and the ForwardBatch built for them.

    ``prepare_for_extend`` / ``prepare_for_decode`` allocate the KV slots of the step; the
    results are committed by the scheduler (``kv_len`` advances) after the forward pass.
    """

    def __init__(self, reqs: list[Req], kv: ReqKV, vocab_size: int, device: str) -> None:
        self.reqs = reqs
        self.kv = kv
        self.vocab_size = vocab_size
        self.device = device
        self.forward_mode = ForwardMode.DECODE
        self.forward_batch: ForwardBatch | None = None  # built by prepare_for_*
        self.input_logprob_counts: list[int] = []  # prompt-logprob rows per request (extend)
        self._sampling_info: SamplingBatchInfo | None = None

    def __len__(self) -> int:
        return len(self.reqs)

    def is_empty(self) -> bool:
        return not self.reqs

    @property
    def sampling_info(self) -> SamplingBatchInfo:
        """Built lazily and kept while the batch composition does not change."""
        if self._sampling_info is None:
            self._sampling_info = SamplingBatchInfo.from_reqs(
                self.reqs, self.vocab_size, self.device, [r.entropy_request for r in self.reqs]
            )
        return self._sampling_info

    @property
    def has_sampling_info(self) -> bool:
        """Whether :attr:`sampling_info` is built (and advanced on the device step by step)."""
        return self._sampling_info is not None

    @property
    def return_logprob(self) -> bool:
        return any(r.return_logprob for r in self.reqs)

    @property
    def top_logprobs_nums(self) -> list[int] | None:
        nums = [r.top_logprobs_num if r.return_logprob else 0 for r in self.reqs]
        return nums if any(nums) else None

    # ---- extend -----------------------------------------------------------------------------
    def prepare_for_extend(self) -> ForwardBatch | None:
        """Allocate rows and KV slots for each request's ``extend_len`` new tokens.

        Precondition: every request has ``fill_ids``, a locked prefix (``kv_len`` tokens of KV)
        and ``extend_len`` set; new requests have no pool row yet. Returns None (allocating
        nothing) when the pool is out of rows or slots.
        """
        self.forward_mode = ForwardMode.EXTEND
        pool = self.kv.req_to_token_pool
        new = [r for r in self.reqs if r.req_pool_idx is None]
        rows = pool.alloc(len(new))
        if rows is None:
            return None
        for r, row in zip(new, rows):
            r.req_pool_idx = row
            if r.prefix_len:
                assert r.prefix_indices is not None, "a matched prefix has its indices"
                pool.write(row, 0, r.prefix_indices)
        prefix_lens = [r.kv_len for r in self.reqs]
        seq_lens = [r.kv_len + r.extend_len for r in self.reqs]
        last_locs = self._last_locs(prefix_lens)
        out_cache_loc = self.kv.alloc_extend(prefix_lens, seq_lens, last_locs)
        if out_cache_loc is None:
            pool.free(rows)
            for r in new:
                r.req_pool_idx = None
            return None
        input_ids: list[int] = []
        positions: list[int] = []
        offset = 0
        for row, r, start, end in zip(self._rows(), self.reqs, prefix_lens, seq_lens):
            pool.write(row, start, out_cache_loc[offset : offset + end - start])
            offset += end - start
            input_ids.extend(r.fill_ids[start:end])
            positions.extend(range(start, end))
        rows_t, targets_t, top_k = self._input_logprob_rows(prefix_lens, seq_lens)
        self._sampling_info = None
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=len(self.reqs),
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            out_cache_loc=out_cache_loc,
            req_pool_indices=self._pool_indices(),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=self.device),
            seq_lens_cpu=seq_lens,
            extend_seq_lens_cpu=[e - s for s, e in zip(prefix_lens, seq_lens)],
            extend_prefix_lens_cpu=prefix_lens,
            req_to_token_pool=pool,
            input_logprob_rows=rows_t,
            input_logprob_targets=targets_t,
            input_top_logprobs_num=top_k,
            lora_names=self._lora_names(),
        )

    def _input_logprob_rows(
        self, prefix_lens: list[int], seq_lens: list[int]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
        """Rows whose logits give prompt logprobs: position p predicts token p + 1."""
        rows: list[int] = []
        targets: list[int] = []
        top_k = 0
        offset = 0
        self.input_logprob_counts = [0] * len(self.reqs)
        for i, (r, start, end) in enumerate(zip(self.reqs, prefix_lens, seq_lens)):
            if r.wants_input_logprobs:
                first = max(r.logprob_start_len, start)
                last = min(r.prompt_len - 2, end - 1)  # inclusive
                rows.extend(range(offset + first - start, offset + last - start + 1))
                targets.extend(r.fill_ids[first + 1 : last + 2])
                top_k = max(top_k, r.top_logprobs_num)
                self.input_logprob_counts[i] = max(last - first + 1, 0)
            offset += end - start
        if not rows and not any(r.wants_input_logprobs for r in self.reqs):
            return None, None, 0
        return (
            torch.tensor(rows, dtype=torch.int64, device=self.device),
            torch.tensor(targets, dtype=torch.int64, device=self.device),
            top_k,
        )

    # ---- decode -----------------------------------------------------------------------------
    def prepare_for_decode(self, ahead: torch.Tensor | None = None) -> ForwardBatch | None:
        """Allocate one slot per request for its last token; None if the pool is full.

        ``ahead`` (the overlap schedule): the sampled ids [B] of this batch's step still in
        flight, on the device. Each request is then one token further than its committed
        state (that token's K/V goes to the next slot, its id is read from ``ahead`` in stream
        order); the batch must be exactly the in-flight step's, in the same order.
        """
        self.forward_mode = ForwardMode.DECODE
        extra = 0 if ahead is None else 1
        seq_lens = [r.seq_len + extra for r in self.reqs]
        kv_lens = [s - 1 for s in seq_lens]
        # The step's three index vectors as views of one tensor: one host-to-device copy,
        # from pinned memory on CUDA so that it does not wait for the step in flight.
        n = len(self.reqs)
        last_ids = [0] * n if ahead is not None else [r.output_ids[-1] for r in self.reqs]
        inputs = _to_device([*last_ids, *kv_lens, *self._rows()], self.device)
        input_ids, positions, pool_indices = inputs[:n], inputs[n : 2 * n], inputs[2 * n :]
        # Paged pools continue each request's last page: its slot is read on the device (in
        # stream order, so also the slot a step in flight is filling), with no host sync.
        table = self.kv.req_to_token_pool.req_to_token
        last_locs = table[pool_indices, positions - 1] if self.kv.page_size > 1 else [-1] * n
        out_cache_loc = self.kv.alloc_decode(self.reqs, seq_lens, last_locs)
        if out_cache_loc is None:
            return None
        if ahead is not None:
            input_ids.copy_(ahead)
        table[pool_indices, positions] = out_cache_loc
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=n,
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=out_cache_loc,
            req_pool_indices=pool_indices,
            seq_lens=positions + 1,
            seq_lens_cpu=seq_lens,
            extend_seq_lens_cpu=[1] * len(self.reqs),
            extend_prefix_lens_cpu=kv_lens,
            req_to_token_pool=self.kv.req_to_token_pool,
            lora_names=self._lora_names(),
        )

    def decode_tokens_needed(self, reqs: list[Req] | None = None, ahead: bool = False) -> int:
        """Free slots the next decode step of ``reqs`` (default: all) needs; ``ahead``: the
        step after the one in flight (see :meth:`prepare_for_decode`)."""
        reqs = self.reqs if reqs is None else reqs
        return self.kv.decode_slots_needed(reqs, [r.seq_len + ahead for r in reqs])

    # ---- composition ------------------------------------------------------------------------
    def filter(self, keep: list[Req]) -> None:
        """Keep only ``keep`` (a sub-list of ``reqs`` in the same order)."""
        if len(keep) != len(self.reqs):
            self.reqs = keep
            self._sampling_info = None

    def merge(self, other: ScheduleBatch) -> None:
        self.reqs = self.reqs + other.reqs
        self._sampling_info = None

    def select_retractions(self, needed: int, retract: Callable[[Req], None]) -> list[Req]:
        """Retract the requests with the least progress until ``needed`` slots can be freed.

        ``retract`` is the Scheduler's lifecycle method (it releases the request's KV, so the
        next request's need is measured against what is really free). At least one request
        stays. Returns the retracted requests in their original order, removed from the batch;
        the caller puts them back at the front of the waiting queue.
        """
        order = sorted(
            range(len(self.reqs)),
            key=lambda i: (len(self.reqs[i].output_ids), -self.reqs[i].prompt_len),
        )
        retracted: set[int] = set()
        for i in order:
            if len(retracted) == len(self.reqs) - 1 or self.kv.available_tokens() >= needed:
                break
            retract(self.reqs[i])
            retracted.add(i)
            needed = self.decode_tokens_needed(
                [r for j, r in enumerate(self.reqs) if j not in retracted]
            )
        out = [r for i, r in enumerate(self.reqs) if i in retracted]
        self.filter([r for i, r in enumerate(self.reqs) if i not in retracted])
        return out

    # ---- helpers ----------------------------------------------------------------------------
    def _rows(self) -> list[int]:
        """Each request's ReqToTokenPool row (every request of a prepared batch has one)."""
        rows = []
        for r in self.reqs:
            assert r.req_pool_idx is not None, f"{r} in a prepared batch has no pool row"
            rows.append(r.req_pool_idx)
        return rows

    def _lora_names(self) -> list[str | None] | None:
        names = [r.lora_name for r in self.reqs]
        return names if any(n is not None for n in names) else None

    def _pool_indices(self) -> torch.Tensor:
        return torch.tensor(self._rows(), dtype=torch.int64, device=self.device)

    def _last_locs(self, kv_lens: list[int]) -> list[int]:
        """Slot of each request's token ``kv_lens[i] - 1`` (-1 if none); only paged pools."""
        if self.kv.page_size == 1:
            return [-1] * len(self.reqs)
        table = self.kv.req_to_token_pool.req_to_token
        return [
            int(table[r.req_pool_idx, n - 1]) if n > 0 else -1 for r, n in zip(self.reqs, kv_lens)
        ]


def _to_device(values: list[int], device: str) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``. On CUDA the copy is queued from pinned
    memory without a host sync (a plain copy would wait for every step queued before it)."""
    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=torch.int64, device=device)
    host = torch.tensor(values, dtype=torch.int64, pin_memory=True)
    return host.to(device, non_blocking=True)
