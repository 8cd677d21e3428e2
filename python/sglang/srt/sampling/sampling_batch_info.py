"""Per-batch sampling state: parameters as tensors, penalty state, logits processors.

Built once per batch composition by :meth:`SamplingBatchInfo.from_reqs`; afterwards each step
runs ``apply_logits_processors(logits)`` -> ``Sampler.forward`` -> ``cumulate_output_tokens``.
When the batch changes (requests join, finish, are retracted), build a new one from the
requests: it re-derives positions and penalty counts from their ``output_ids``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from sglang.srt.sampling.sampling_params import SamplingParams

_GREEDY_EPS = 1e-6
_SEED_MOD = 1 << 32


class SamplingReq(Protocol):
    """What :meth:`SamplingBatchInfo.from_reqs` reads from a request."""

    sampling_params: SamplingParams
    sampling_seed: int  # resolved by the scheduler (user's or derive_seed); any Python int
    origin_input_ids: list[int]
    output_ids: list[int]
    eos_token_ids: set[int]  # tokens that end the request (model EOS unless ignore_eos, + stop ids)


@dataclass
class PenaltyState:
    """Output-token penalties of a batch; present only when some row uses one.

    Order of application (see docs/sampling.md): repetition, then frequency and presence.
    Rows that do not use a penalty hold its neutral value (1 or 0), which is exact.
    """

    output_token_counts: torch.Tensor  # [B, V] float32: occurrences of v in the row's output
    repetition_penalties: torch.Tensor | None  # [B, 1] float32, None when all are 1
    frequency_penalties: torch.Tensor | None  # [B, 1] float32, None when all are 0
    presence_penalties: torch.Tensor | None  # [B, 1] float32, None when all are 0


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

    @property
    def batch_size(self) -> int:
        return int(self.temperatures.shape[0])

    @classmethod
    def from_reqs(
        cls, reqs: Sequence[SamplingReq], vocab_size: int, device: str | torch.device
    ) -> SamplingBatchInfo:
        """Build the state of ``reqs`` (in batch order). Reads, never mutates, the requests."""
        device = torch.device(device)
        params = [r.sampling_params for r in reqs]
        greedy = [p.temperature < _GREEDY_EPS or p.top_k == 1 for p in params]
        top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        sampled = [i for i, g in enumerate(greedy) if not g]
        uses_k = [top_ks[i] < vocab_size for i in sampled]
        uses_p = [params[i].top_p < 1.0 for i in sampled]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            vocab_size=vocab_size,
            device=device,
            temperatures=tensor(
                [1.0 if p.temperature < _GREEDY_EPS else p.temperature for p in params],
                torch.float32,
            ),
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
        )

    def apply_logits_processors(self, logits: torch.Tensor) -> None:
        """Apply penalties and the min_new_tokens EOS mask to ``logits`` [B, V] IN PLACE.

        Repetition (over output tokens; SGLang: logit > 0 divided by p, otherwise multiplied),
        then ``logits -= frequency * count + presence * (count > 0)``, then stop tokens of rows
        below min_new_tokens set to -inf. Returns at once when the batch uses none of these.
        """
        pen = self.penalties
        if pen is not None:
            counts = pen.output_token_counts
            seen = counts > 0
            if pen.repetition_penalties is not None:
                rep = pen.repetition_penalties
                penalized = torch.where(logits > 0, logits / rep, logits * rep)
                logits.copy_(torch.where(seen, penalized, logits))
            if pen.frequency_penalties is not None:
                logits.sub_(counts * pen.frequency_penalties)
            if pen.presence_penalties is not None:
                logits.sub_(seen.to(logits.dtype) * pen.presence_penalties)
        mnt = self.min_new_tokens
        if mnt is not None and mnt.steps_left > 0:
            active = mnt.tokens_left[mnt.eos_rows] > 0
            current = logits[mnt.eos_rows, mnt.eos_ids]
            masked = torch.where(active, torch.full_like(current, float("-inf")), current)
            logits[mnt.eos_rows, mnt.eos_ids] = masked

    def cumulate_output_tokens(self, next_token_ids: torch.Tensor) -> None:
        """Record one sampled token per row (``next_token_ids`` [B] int64, batch order).

        Mutates: ``positions`` (+1), penalty counts, min_new_tokens countdown. Call exactly once
        per step, after sampling; vectorized, no host sync.
        """
        self.positions.add_(1)
        pen = self.penalties
        if pen is not None:
            rows = torch.arange(self.batch_size, device=self.device)
            ones = torch.ones_like(next_token_ids, dtype=pen.output_token_counts.dtype)
            pen.output_token_counts.index_put_((rows, next_token_ids), ones, accumulate=True)
        mnt = self.min_new_tokens
        if mnt is not None and mnt.steps_left > 0:
            mnt.tokens_left.sub_(1).clamp_(min=0)
            mnt.steps_left -= 1


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
    row_ids = [i for i, r in enumerate(reqs) for _ in r.output_ids]
    token_ids = [t for r in reqs for t in r.output_ids]
    if token_ids:
        rows = torch.tensor(row_ids, dtype=torch.int64, device=device)
        toks = torch.tensor(token_ids, dtype=torch.int64, device=device)
        counts.index_put_((rows, toks), torch.ones_like(toks, dtype=torch.float32), accumulate=True)

    def column(values: list[float], used: bool) -> torch.Tensor | None:
        return torch.tensor(values, dtype=torch.float32, device=device)[:, None] if used else None

    return PenaltyState(
        output_token_counts=counts,
        repetition_penalties=column(rep, use_rep),
        frequency_penalties=column(freq, use_freq),
        presence_penalties=column(pres, use_pres),
    )


def _build_min_new_tokens(
    reqs: Sequence[SamplingReq], vocab_size: int, device: torch.device
) -> MinNewTokensState | None:
    left = [max(r.sampling_params.min_new_tokens - len(r.output_ids), 0) for r in reqs]
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
