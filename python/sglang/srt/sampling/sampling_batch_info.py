"""Per-batch sampling state: parameters as tensors, penalty state, logits processors.

Built once per batch composition by :meth:`SamplingBatchInfo.from_reqs`; afterwards each step
runs ``apply_logits_processors(logits)`` -> ``Sampler.forward`` -> ``cumulate_output_tokens``.
When the batch changes (requests join, finish, are retracted), build a new one from the
requests: it re-derives positions and penalty counts from their ``output_ids``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from sgl_kernel.sampling_contract import (
    ENTROPY_MODE_CODES,
    ENTROPY_MODES,
    EntropyGroup,
    EntropyPlan,
)
from sglang.srt.constrained.base_grammar_backend import GrammarMatcher
from sglang.srt.constrained.grammar_batch import GrammarBatch
from sglang.srt.sampling.sampling_params import SamplingParams

_GREEDY_EPS = 1e-6
_SEED_MOD = 1 << 32

# What a request asks of entropy: (mode, top_k), each None for the server's default.
EntropyRequest = tuple[str | None, int | None]


class SamplingReq(Protocol):
    """What :meth:`SamplingBatchInfo.from_reqs` reads from a request."""

    sampling_params: SamplingParams
    sampling_seed: int  # resolved by the scheduler (user's or derive_seed); any Python int
    origin_input_ids: list[int]
    output_ids: list[int]
    eos_token_ids: set[int]  # tokens that end the request (model EOS unless ignore_eos, + stop ids)
    grammar: GrammarMatcher | None  # its constrained-decoding state (None: unconstrained)


@dataclass
class PenaltyState:
    """Output-token penalties of a batch; present only when some row uses one.

    ``repetition_scale`` and ``additive`` are dense per-step views of the counts, updated
    entry by entry in :meth:`record`, so applying them costs one or two passes. Their values
    depend only on the counts (``additive`` always comes from :func:`_additive_term`), so a
    batch rebuilt from its requests after a retraction holds bit-identical tensors. Rows that
    do not use a penalty hold its neutral value (scale 1, additive 0): their logits stay as is.
    """

    output_token_counts: torch.Tensor  # [B, V] float32: occurrences of v in the row's output
    repetition_penalties: torch.Tensor | None  # [B, 1] float32, None when all are 1
    frequency_penalties: torch.Tensor | None  # [B, 1] float32, None when all are 0
    presence_penalties: torch.Tensor | None  # [B, 1] float32, None when all are 0
    repetition_scale: torch.Tensor | None  # [B, V]: repetition_penalty where count > 0, else 1
    # Rows whose repetition_penalty is < 1 (they favour repeats), None when there are none.
    repetition_below_one_rows: torch.Tensor | None
    additive: torch.Tensor | None  # [B, V]: frequency * count + presence * (count > 0)

    def record(self, next_token_ids: torch.Tensor) -> None:
        """Count one token per row and refresh the B dense entries that changed."""
        rows = torch.arange(next_token_ids.shape[0], device=next_token_ids.device)
        counts = self.output_token_counts
        counts.index_put_((rows, next_token_ids), torch.ones_like(counts[:, 0]), accumulate=True)
        if self.repetition_scale is not None and self.repetition_penalties is not None:
            self.repetition_scale[rows, next_token_ids] = self.repetition_penalties[:, 0]
        if self.additive is not None:
            self.additive[rows, next_token_ids] = _additive_term(
                counts[rows, next_token_ids],
                _column_entries(self.frequency_penalties),
                _column_entries(self.presence_penalties),
            )


def _column_entries(column: torch.Tensor | None) -> torch.Tensor | None:
    return None if column is None else column[:, 0]


def _additive_term(
    counts: torch.Tensor, freq: torch.Tensor | None, pres: torch.Tensor | None
) -> torch.Tensor:
    """frequency * count + presence * (count > 0); the penalties broadcast against ``counts``.

    The single definition used for whole [B, V] tensors and for the entries of one step.
    """
    additive = torch.zeros_like(counts) if freq is None else counts * freq
    if pres is not None:
        additive = additive + (counts > 0).to(counts.dtype) * pres
    return additive


@dataclass
class MinNewTokensState:
    """EOS masking while a row has produced fewer than ``min_new_tokens`` tokens.

    (eos_rows[j], eos_ids[j]) enumerate every (row, stop token) pair of the rows with a minimum.
    """

    eos_rows: torch.Tensor  # [P] int64
    eos_ids: torch.Tensor  # [P] int64
    tokens_left: torch.Tensor  # [B] int64: tokens still to produce before EOS is allowed
    steps_left: int  # max of tokens_left, tracked on the host so the check needs no sync


@dataclass
class SamplingBatchInfo:
    """Sampling parameters of a batch as [B] tensors on ``device``, in batch order."""

    vocab_size: int
    device: torch.device
    temperatures: torch.Tensor  # [B] float32; temperature-0 rows hold 1.0 (logprob scale)
    top_ks: torch.Tensor  # [B] int64; disabled (-1 or >= V) stored as vocab_size
    top_ps: torch.Tensor  # [B] float32
    min_ps: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64 in [0, 2**32): sampling_seed mod 2**32
    positions: torch.Tensor  # [B] int64: absolute position of the token sampled next
    is_greedy: torch.Tensor  # [B] bool: temperature 0 or top_k 1
    sampled_rows: torch.Tensor | None  # [S] int64 non-greedy rows; None when all are sampled
    is_all_greedy: bool
    # Batch-level flags over the sampled rows, so the sampler skips unused work.
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    top_p_without_top_k: bool  # some sampled row uses top-p with top-k disabled
    max_top_k: int  # largest enabled top_k among sampled rows (0 when none)
    penalties: PenaltyState | None
    min_new_tokens: MinNewTokensState | None
    logit_bias: LogitBias | None = None
    grammars: GrammarBatch | None = None
    unit_temperature: bool = False  # every stored temperature is 1.0 (logits / T == logits)
    # Per row: None (no entropy) or the request's EntropyRequest; see entropy_plan().
    entropy_requests: tuple[EntropyRequest | None, ...] = ()
    _entropy_plan_memo: tuple[tuple[str, int], EntropyPlan | None] | None = field(
        default=None, repr=False
    )

    @property
    def batch_size(self) -> int:
        return int(self.temperatures.shape[0])

    @classmethod
    def from_reqs(
        cls,
        reqs: Sequence[SamplingReq],
        vocab_size: int,
        device: str | torch.device,
        entropy_requests: Sequence[EntropyRequest | None] | None = None,
    ) -> SamplingBatchInfo:
        """Build the state of ``reqs`` (in batch order). Reads, never mutates, the requests.

        ``entropy_requests``: one entry per request, None for requests that want no entropy
        (omitted: none does).
        """
        device = torch.device(device)
        params = [r.sampling_params for r in reqs]
        greedy = [p.temperature < _GREEDY_EPS or p.top_k == 1 for p in params]
        top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        sampled = [i for i, g in enumerate(greedy) if not g]
        uses_k = [top_ks[i] < vocab_size for i in sampled]
        uses_p = [params[i].top_p < 1.0 for i in sampled]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        temperatures = [1.0 if p.temperature < _GREEDY_EPS else p.temperature for p in params]
        return cls(
            vocab_size=vocab_size,
            device=device,
            temperatures=tensor(temperatures, torch.float32),
            top_ks=tensor(top_ks, torch.int64),
            top_ps=tensor([p.top_p for p in params], torch.float32),
            min_ps=tensor([p.min_p for p in params], torch.float32),
            seeds=tensor([r.sampling_seed % _SEED_MOD for r in reqs], torch.int64),
            positions=tensor(
                [len(r.origin_input_ids) + len(r.output_ids) for r in reqs], torch.int64
            ),
            is_greedy=tensor(greedy, torch.bool),
            sampled_rows=None if len(sampled) == len(reqs) else tensor(sampled, torch.int64),
            is_all_greedy=not sampled,
            need_top_k=any(uses_k),
            need_top_p=any(uses_p),
            need_min_p=any(params[i].min_p > 0 for i in sampled),
            top_p_without_top_k=any(p and not k for p, k in zip(uses_p, uses_k)),
            max_top_k=max((top_ks[i] for i in sampled if top_ks[i] < vocab_size), default=0),
            penalties=_build_penalties(reqs, vocab_size, device),
            min_new_tokens=_build_min_new_tokens(reqs, vocab_size, device),
            logit_bias=LogitBias.build(params, device),
            grammars=GrammarBatch.build([r.grammar for r in reqs], vocab_size, device),
            unit_temperature=all(t == 1.0 for t in temperatures),
            entropy_requests=tuple(entropy_requests or (None,) * len(reqs)),
        )

    def entropy_plan(self, default_mode: str, default_top_k: int) -> EntropyPlan | None:
        """Which rows want entropy and how, requests without a choice taking the defaults.

        None when no row wants entropy (then sampling runs exactly as without the feature).
        A top_k of 0 or >= vocab_size means the full vocabulary. Memoized per defaults: the
        plan is built once per batch composition, not per step.
        """
        key = (default_mode, default_top_k)
        if self._entropy_plan_memo is None or self._entropy_plan_memo[0] != key:
            self._entropy_plan_memo = (key, self._build_entropy_plan(*key))
        return self._entropy_plan_memo[1]

    def _build_entropy_plan(self, default_mode: str, default_top_k: int) -> EntropyPlan | None:
        specs: list[tuple[str, int] | None] = []
        for request in self.entropy_requests:
            if request is None:
                specs.append(None)
                continue
            mode = default_mode if request[0] is None else request[0]
            top_k = default_top_k if request[1] is None else request[1]
            if mode not in ENTROPY_MODES:
                raise ValueError(f"entropy mode must be one of {ENTROPY_MODES}, got {mode!r}")
            specs.append((mode, top_k if 0 < top_k < self.vocab_size else 0))
        if not any(specs):
            return None
        rows_by_spec: dict[tuple[str, int], list[int]] = {}
        for i, spec in enumerate(specs):
            if spec is not None:
                rows_by_spec.setdefault(spec, []).append(i)
        groups = tuple(
            EntropyGroup(mode, top_k, None if len(rows) == len(specs) else self._rows(rows))
            for (mode, top_k), rows in rows_by_spec.items()
        )
        codes = [0 if s is None else ENTROPY_MODE_CODES[s[0]] for s in specs]
        top_ks = [0 if s is None else s[1] for s in specs]
        return EntropyPlan(
            modes=torch.tensor(codes, dtype=torch.int32, device=self.device),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=self.device),
            groups=groups,
        )

    def _rows(self, rows: list[int]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.int64, device=self.device)

    def apply_logits_processors(self, logits: torch.Tensor) -> None:
        """Apply penalties, the min_new_tokens EOS mask, logit biases and grammars to
        ``logits`` [B, V] IN PLACE.

        Repetition (over output tokens; SGLang: logit > 0 divided by p, otherwise multiplied),
        then ``logits -= frequency * count + presence * (count > 0)``, then stop tokens of rows
        below min_new_tokens set to -inf, then each row's ``logit_bias`` added, then tokens
        that a row's grammar does not allow set to -inf. Returns at once when the batch uses
        none of these.
        """
        pen = self.penalties
        if pen is not None:
            if pen.repetition_scale is not None:
                _apply_repetition(logits, pen.repetition_scale, pen.repetition_below_one_rows)
            if pen.additive is not None:
                logits.sub_(pen.additive)
        mnt = self.min_new_tokens
        if mnt is not None and mnt.steps_left > 0:
            active = mnt.tokens_left[mnt.eos_rows] > 0
            current = logits[mnt.eos_rows, mnt.eos_ids]
            masked = torch.where(active, torch.full_like(current, float("-inf")), current)
            logits[mnt.eos_rows, mnt.eos_ids] = masked
        if self.logit_bias is not None:
            self.logit_bias.apply(logits)
        if self.grammars is not None:
            self.grammars.apply(logits)

    def cumulate_output_tokens(self, next_token_ids: torch.Tensor) -> None:
        """Record one sampled token per row (``next_token_ids`` [B] int64, batch order).

        Mutates: ``positions`` (+1), penalty counts, min_new_tokens countdown. Call exactly once
        per step, after sampling; vectorized, no host sync.
        """
        self.positions.add_(1)
        if self.penalties is not None:
            self.penalties.record(next_token_ids)
        mnt = self.min_new_tokens
        if mnt is not None and mnt.steps_left > 0:
            mnt.tokens_left.sub_(1).clamp_(min=0)
            mnt.steps_left -= 1


def _apply_repetition(
    logits: torch.Tensor, scale: torch.Tensor, below_one_rows: torch.Tensor | None
) -> None:
    """logit > 0 -> logit / s, otherwise logit * s, in place (s = 1 for unseen tokens).

    For s >= 1 that is exactly min(logit / s, logit * s), for s < 1 the max: a selection
    between the two rounded values, written with minimum/maximum because ``torch.where`` on a
    [B, V] bool mask is about 8x slower on CPU.
    """
    scale = scale.to(logits.dtype)
    divided, multiplied = logits / scale, logits * scale
    torch.minimum(divided, multiplied, out=logits)
    if below_one_rows is not None:
        rows = below_one_rows
        logits[rows] = torch.maximum(divided[rows], multiplied[rows])


def _build_penalties(
    reqs: Sequence[SamplingReq], vocab_size: int, device: torch.device
) -> PenaltyState | None:
    params = [r.sampling_params for r in reqs]
    rep = [p.repetition_penalty for p in params]
    freq = [p.frequency_penalty for p in params]
    pres = [p.presence_penalty for p in params]
    use_rep, use_freq, use_pres = any(v != 1.0 for v in rep), any(freq), any(pres)
    if not (use_rep or use_freq or use_pres):
        return None
    counts = torch.zeros(len(reqs), vocab_size, dtype=torch.float32, device=device)
    rows = torch.tensor(
        [i for i, r in enumerate(reqs) for _ in r.output_ids], dtype=torch.int64, device=device
    )
    toks = torch.tensor([t for r in reqs for t in r.output_ids], dtype=torch.int64, device=device)
    counts.index_put_((rows, toks), torch.ones_like(toks, dtype=torch.float32), accumulate=True)

    def column(values: list[float], used: bool) -> torch.Tensor | None:
        return torch.tensor(values, dtype=torch.float32, device=device)[:, None] if used else None

    rep_col, freq_col = column(rep, use_rep), column(freq, use_freq)
    pres_col = column(pres, use_pres)
    scale = None
    if rep_col is not None:
        # Written by scatter, as record() does: a [B, V] torch.where is slow on CPU.
        scale = torch.ones_like(counts)
        scale[rows, toks] = rep_col[rows, 0]
    return PenaltyState(
        output_token_counts=counts,
        repetition_penalties=rep_col,
        frequency_penalties=freq_col,
        presence_penalties=pres_col,
        repetition_scale=scale,
        repetition_below_one_rows=_rows_where([v < 1.0 for v in rep], device),
        additive=_additive_term(counts, freq_col, pres_col) if use_freq or use_pres else None,
    )


def _rows_where(flags: list[bool], device: torch.device) -> torch.Tensor | None:
    rows = [i for i, flag in enumerate(flags) if flag]
    return torch.tensor(rows, dtype=torch.int64, device=device) if rows else None


@dataclass
class LogitBias:
    """The batch's ``logit_bias`` entries: ``values[k]`` is added to logit ``cols[k]`` of row
    ``rows[k]``."""

    rows: torch.Tensor  # [N] int64
    cols: torch.Tensor  # [N] int64
    values: torch.Tensor  # [N] float32

    @classmethod
    def build(cls, params: Sequence[SamplingParams], device: torch.device) -> LogitBias | None:
        entries = [
            (i, int(token), float(bias))
            for i, p in enumerate(params)
            for token, bias in (p.logit_bias or {}).items()
        ]
        if not entries:
            return None
        rows, cols, values = zip(*entries)
        return cls(
            rows=torch.tensor(rows, dtype=torch.int64, device=device),
            cols=torch.tensor(cols, dtype=torch.int64, device=device),
            values=torch.tensor(values, dtype=torch.float32, device=device),
        )

    def apply(self, logits: torch.Tensor) -> None:
        logits.index_put_((self.rows, self.cols), self.values.to(logits.dtype), accumulate=True)


def _build_min_new_tokens(
    reqs: Sequence[SamplingReq], vocab_size: int, device: torch.device
) -> MinNewTokensState | None:
    # A request with a grammar is not held back: its grammar decides where its output may
    # end (masking the stop tokens too could leave it no token at all).
    left = [
        0 if r.grammar is not None else max(r.sampling_params.min_new_tokens - len(r.output_ids), 0)
        for r in reqs
    ]
    pairs = [
        (i, t)
        for i, r in enumerate(reqs)
        if left[i] > 0
        for t in sorted(r.eos_token_ids)
        if 0 <= t < vocab_size
    ]
    if not pairs:
        return None
    return MinNewTokensState(
        eos_rows=torch.tensor([i for i, _ in pairs], dtype=torch.int64, device=device),
        eos_ids=torch.tensor([t for _, t in pairs], dtype=torch.int64, device=device),
        tokens_left=torch.tensor(left, dtype=torch.int64, device=device),
        steps_left=max(left),
    )
