"""The ``pytorch`` sampling backend: the tuned torch sampler the engine uses on CPU.

It implements the contract of :mod:`sgl_kernel.sampling_contract` (docs/sampling.md, the
entropy definitions of docs/entropy.md) and must choose the same tokens as its oracle
:func:`~sgl_kernel.sampling_contract.sample_contract`, tested in test/srt/test_sampler.py and
test/srt/test_entropy_kernel.py. What differs is cost: whole-batch tensor ops, noise drawn
only where it can matter, top-k prefixes instead of full sorts, and reductions in a fixed
order so that every value is bitwise independent of the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from sgl_kernel.sampling_contract import (
    HASH_MUL1,
    HASH_MUL2,
    UNIFORM_SCALE,
    UNIFORM_SHIFT,
    EntropyGroup,
    EntropyPlan,
    SampleOutput,
    SamplingRows,
    noise_row_keys,
)

_UNIFORM_BITS_MASK = 0x7FFFFF  # the 23 bits of u after the shift
# CPU: the noise is generated in row chunks of about this many elements to stay in L2 cache.
_CPU_CHUNK_ELEMS = 1 << 19
# Top-p rows without top-k first look for their nucleus among this many largest logits and
# fall back to a full sort only when the nucleus is larger (same result, much cheaper).
_TOP_P_PREFIX_LEN = 256
# The native nucleus candidates hold this much more than top_p of a row's mass, so that the
# float32 cumulative sum over them reaches top_p (a shortfall costs a fallback, not a token).
_NUCLEUS_MASS_MARGIN = 1e-4
# Row sums add chunks of this many columns: below ATen's parallel grain (32768), so each chunk
# is always reduced by a single thread in a fixed order.
_SUM_CHUNK = 4096
# Greedy argmax reduces chunks of this many columns with amax first (see _argmax).
_ARGMAX_CHUNK = 1024


class CpuSamplingKernels(NamedTuple):
    """Native replacements for three whole-``[B, V]`` pieces on float32 CPU rows (the engine
    registers its C++ kernels, sglang/srt/layers/cpu_sampling.py, with :func:`use_cpu_kernels`).

    ``gumbel_argmax(x, thr, row_keys)``: :func:`_gumbel_argmax_full`'s tokens bit for bit.
    ``softmax_stats(x, with_entropy)``: the (row_max, sum_exp, sum_exp_dev or None) of
    :class:`SoftmaxStats`, summed in an order of its own (fixed per row, so still independent
    of the batch): logprobs and entropies within float32 rounding of the torch ops'.
    ``nucleus_candidates(x, log_z, mass)``: per row, its largest values, sorted descending,
    holding at least ``mass`` of its softmax, every value left out at most every value kept
    (so, the row's sorted prefix): (values [b, W] padded with -inf, lengths [b] int64, 0 where
    it does not serve the row). It only saves work: the thresholds are computed and checked
    here, as from any sorted prefix.
    """

    gumbel_argmax: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor]
    softmax_stats: Callable[
        [torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
    ]
    nucleus_candidates: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
    ]


_cpu_kernels: CpuSamplingKernels | None = None


def use_cpu_kernels(kernels: CpuSamplingKernels | None) -> None:
    """Serve float32 CPU rows with ``kernels`` from now on, or with the torch ops (None).
    Process-wide; prompt and decode logprobs keep sharing one normaliser (both come from
    :func:`row_softmax_stats`)."""
    global _cpu_kernels
    _cpu_kernels = kernels


def cpu_kernels() -> CpuSamplingKernels | None:
    """The kernels :func:`use_cpu_kernels` registered last (None: the torch ops)."""
    return _cpu_kernels


def _native_for(x: torch.Tensor) -> CpuSamplingKernels | None:
    """The registered kernels when ``x`` [b, V] is a float32 CPU tensor with dense rows."""
    if _cpu_kernels is not None and x.is_cpu and x.dtype == torch.float32 and x.stride(1) == 1:
        return _cpu_kernels
    return None


# ---- the noise ----------------------------------------------------------------------------


def _to_int32_bits(x: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> int32 with the same 32-bit pattern."""
    return torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32)


def _neg_gumbel_from_keys(row_keys: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """-g = log(-log(u)) for ``bits = hash32(row_key ^ v)``, float32 (callers subtract it:
    ``x - (-g)`` is bitwise ``x + g`` and saves a pass).

    ``row_keys``: [b] int64 from :func:`noise_row_keys`; ``vocab_ids``: [V] or [b, K] int64.
    Returns [b, V] or [b, K]. Computes the contract's ``hash32`` on int32 bit patterns, whose
    multiplication wraps mod 2**32 (half the memory traffic of int64, about 1.3x faster on
    CPU); ``>>`` on int32 is arithmetic, so shifted values are masked into logical shifts.
    """
    # The first xorshift is linear over xor: (k ^ v) ^ ((k ^ v) >> 16) equals
    # (k ^ (k >> 16)) ^ (v ^ (v >> 16)), so it is applied to the [b] keys and the ids.
    keys = _to_int32_bits(row_keys ^ (row_keys >> 16))[:, None]
    ids = _to_int32_bits(vocab_ids ^ (vocab_ids >> 16))
    bits = keys ^ (ids[None, :] if ids.dim() == 1 else ids)
    shifted = torch.empty_like(bits)
    bits.mul_(HASH_MUL1)
    bits.bitwise_xor_(torch.bitwise_right_shift(bits, 15, out=shifted).bitwise_and_(0x1FFFF))
    bits.mul_(HASH_MUL2)
    bits.bitwise_xor_(torch.bitwise_right_shift(bits, 15, out=shifted).bitwise_and_(0x1FFFF))
    bits.bitwise_right_shift_(UNIFORM_SHIFT).bitwise_and_(_UNIFORM_BITS_MASK)
    u = bits.to(torch.float32)
    u.add_(0.5).mul_(UNIFORM_SCALE)
    return u.log_().neg_().log_()


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """:func:`sgl_kernel.sampling_contract.gumbel_noise` bit for bit, in the int32 form:
    [B, vocab_size] float32. ``seeds``/``positions``: [B] int64 on the target device."""
    vocab_ids = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    return _neg_gumbel_from_keys(noise_row_keys(seeds, positions), vocab_ids).neg_()


# ---- the sampler ----------------------------------------------------------------------------


def sample_torch(
    logits: torch.Tensor,
    info: SamplingRows,
    return_logprob: bool,
    top_logprobs_nums: list[int] | None,
    entropy: EntropyPlan | None = None,
) -> SampleOutput:
    """Pick one token per row of ``logits`` [B, V] (float32; bfloat16/float16 are upcast).

    Greedy rows take the argmax, the others truncated Gumbel-max with counter-based noise;
    entropy for the rows ``entropy`` names (None: no row). Precondition: the logits processors
    (penalties, masks) have run. Mutates neither ``logits`` nor ``info``.
    """
    if logits.shape[-1] != info.vocab_size:
        raise ValueError(f"logits have {logits.shape[-1]} columns, expected {info.vocab_size}")
    if logits.dtype != torch.float32:
        logits = logits.float()
    groups = entropy.groups if entropy is not None else ()
    need_scaled = return_logprob or any(g.mode != "raw" for g in groups)
    scaled, stats, thr = None, None, None
    if info.is_all_greedy:
        next_ids = _argmax(logits)
    else:
        scaled = _scale(logits, info)
        if return_logprob or info.need_top_p:
            stats = row_softmax_stats(scaled, _whole_batch_needs_scaled_entropy(groups, info))
        next_ids, thr = _sample(logits, scaled, None if stats is None else _log_z(stats), info)
    if scaled is None and need_scaled:
        # Greedy rows: temperature 0 is stored as 1 (x / 1 == x); top_k = 1 keeps its T.
        scaled = _scale(logits, info)
    entropies = None
    if groups:
        entropies = _entropies(logits, scaled, stats, thr, info, groups)
    if not return_logprob:
        return SampleOutput(next_ids, None, None, None, entropies)
    assert scaled is not None
    log_z = row_logsumexp(scaled) if stats is None else _log_z(stats)
    # log_softmax(scaled) = scaled - logsumexp(scaled), evaluated only where it is read.
    chosen = scaled.gather(1, next_ids[:, None]).squeeze(1) - log_z
    num_top = max(top_logprobs_nums) if top_logprobs_nums else 0
    if num_top <= 0:
        return SampleOutput(next_ids, chosen, None, None, entropies)
    top = scaled.topk(min(num_top, logits.shape[1]), dim=-1)
    return SampleOutput(next_ids, chosen, top.values - log_z[:, None], top.indices, entropies)


def _scale(logits: torch.Tensor, info: SamplingRows) -> torch.Tensor:
    """``logits / T`` per row; ``logits`` itself when every T is 1 (x / 1 == x bit for bit,
    and a pass over [B, V] saved: the usual RL rollout samples at 1). Never written to."""
    if info.unit_temperature:
        return logits
    return logits / info.temperatures[:, None]


class SoftmaxStats(NamedTuple):
    """Per-row softmax statistics of x [b, V] relative to its max m: the normaliser is
    ``m + log(sum_exp)`` and the entropy ``log(sum_exp) - sum_exp_dev / sum_exp``."""

    row_max: torch.Tensor  # [b]
    sum_exp: torch.Tensor  # [b]: sum exp(x - m)
    sum_exp_dev: torch.Tensor | None  # [b]: sum exp(x - m) * (x - m), -inf entries count 0


def row_softmax_stats(x: torch.Tensor, with_entropy: bool) -> SoftmaxStats:
    """:class:`SoftmaxStats` of ``x`` [b, V], bitwise independent of b (see row_logsumexp);
    ``sum_exp_dev`` only when ``with_entropy``. Float32 CPU rows go to the registered kernels
    (:func:`use_cpu_kernels`) when there are any; otherwise, on CPU, rows are processed in
    chunks of about ``_CPU_CHUNK_ELEMS`` elements: the temporaries stay in cache (same values
    per row)."""
    native = _native_for(x)
    if native is not None and x.shape[1] > 0:
        return SoftmaxStats(*native.softmax_stats(x, with_entropy))
    num_rows, vocab_size = x.shape
    step = max(_CPU_CHUNK_ELEMS // vocab_size, 1)
    if x.device.type != "cpu" or num_rows <= step:
        return _softmax_stats(x, with_entropy)
    parts = [_softmax_stats(x[i : i + step], with_entropy) for i in range(0, num_rows, step)]
    devs = [p.sum_exp_dev for p in parts if p.sum_exp_dev is not None]
    return SoftmaxStats(
        torch.cat([p.row_max for p in parts]),
        torch.cat([p.sum_exp for p in parts]),
        torch.cat(devs) if with_entropy else None,
    )


def _softmax_stats(x: torch.Tensor, with_entropy: bool) -> SoftmaxStats:
    row_max = x.amax(dim=-1, keepdim=True)
    dev = x - row_max
    if with_entropy:
        # exp(-inf) = 0 = exp(-FLT_MAX), and 0 * -FLT_MAX = 0 where 0 * -inf would be NaN.
        dev.clamp_(min=torch.finfo(torch.float32).min)
    exps = torch.exp(dev)
    sum_exp = _row_sum(exps)
    sum_exp_dev = _row_sum(exps.mul_(dev)) if with_entropy else None
    return SoftmaxStats(row_max.squeeze(1), sum_exp, sum_exp_dev)


def row_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dim of ``x`` [b, V], bitwise independent of b.

    ``torch.logsumexp`` splits a row longer than ATen's parallel grain (32768) across threads
    only when there are few rows, so a row's result changed with the batch size. Summing
    fixed chunks of 4096 (each always reduced by one thread) and then the chunk sums keeps
    the order of additions a function of V alone. Returns [b] float32.
    """
    return _log_z(row_softmax_stats(x, with_entropy=False))


def _log_z(stats: SoftmaxStats) -> torch.Tensor:
    return stats.row_max + torch.log(stats.sum_exp)


def _chunk_reduce(
    x: torch.Tensor, chunk: int, reduce: Callable[..., torch.Tensor]
) -> torch.Tensor:
    """``reduce`` (``torch.sum``, ``torch.amax``: ``(input, dim, keepdim)``) of each
    ``chunk``-column chunk of ``x`` [b, V], the last chunk possibly shorter. Returns
    [b, ceil(V / chunk)]."""
    num_rows, vocab_size = x.shape
    main_len = vocab_size - vocab_size % chunk
    per_chunk = reduce(x[:, :main_len].reshape(num_rows, -1, chunk), dim=-1)
    if main_len < vocab_size:
        per_chunk = torch.cat([per_chunk, reduce(x[:, main_len:], dim=-1, keepdim=True)], 1)
    return per_chunk


def _row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim of ``x`` [b, V] in fixed 4096-column chunks. Returns [b]."""
    return _chunk_reduce(x, _SUM_CHUNK, torch.sum).sum(dim=-1)


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise index of the maximum, the first one on ties (as argmax; a row holding NaN gives
    its first NaN, as ``max(dim)`` does). The tie rule is pinned by the tests.

    ``max(dim)`` with indices reads a 49k-column row at ~5 GB/s on CPU, ``amax`` at ~100: so the
    maxima of column chunks come first (``amax``), then ``max(dim)`` runs only on the first
    chunk holding the row's maximum (5x faster for 60 rows of 49,152 on 2 cores).
    """
    vocab_size = x.shape[1]
    if vocab_size < 2 * _ARGMAX_CHUNK:
        return x.max(dim=-1).indices
    chunk_max = _chunk_reduce(x, _ARGMAX_CHUNK, torch.amax)
    start = chunk_max.max(dim=-1).indices * _ARGMAX_CHUNK  # the first chunk holding the max
    # The last chunk may be short: its window repeats the last column, after the real ones.
    cols = (start[:, None] + torch.arange(_ARGMAX_CHUNK, device=x.device)).clamp_(
        max=vocab_size - 1
    )
    return start + x.gather(1, cols).max(dim=-1).indices


def _sample(
    logits: torch.Tensor,
    scaled: torch.Tensor,
    log_z: torch.Tensor | None,
    info: SamplingRows,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Greedy rows: argmax of the raw logits; the others: :func:`_sample_rows` on ``scaled``.

    ``log_z`` [B]: row_logsumexp of ``scaled``, required when ``info.need_top_p``. Returns
    (token ids [B], truncation thresholds [B] with -inf in greedy rows, or None when no row
    truncates).
    """
    rows = info.sampled_rows
    if rows is None:
        return _sample_rows(scaled, log_z, info, slice(None))
    next_ids = _argmax(logits)
    rows_log_z = None if log_z is None else log_z[rows]
    next_ids[rows], rows_thr = _sample_rows(scaled[rows], rows_log_z, info, rows)
    if rows_thr is None:
        return next_ids, None
    thr = torch.full_like(info.temperatures, float("-inf"))
    thr[rows] = rows_thr
    return next_ids, thr


def _sample_rows(
    x: torch.Tensor,
    log_z: torch.Tensor | None,
    info: SamplingRows,
    rows: torch.Tensor | slice,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Seeded truncated Gumbel-max for the non-greedy rows ``rows`` of the batch.

    ``x``: [b, V] float32 logits / temperature, already restricted to ``rows``; ``log_z``: [b]
    its row_logsumexp (None unless top-p is used). Returns ([b] int64 token ids, [b] the
    threshold of each row's allowed set {x >= t}, or None when no row truncates).
    """
    row_keys = noise_row_keys(info.seeds[rows], info.positions[rows])
    if not (info.need_top_k or info.need_top_p or info.need_min_p):
        return _gumbel_argmax_full(x, None, row_keys), None
    params = (info.top_ks[rows], info.top_ps[rows], info.min_ps[rows])
    thr, prefix = _truncation_thresholds(x, log_z, params, info)
    if prefix is not None:
        vals, idx = prefix
        # The allowed set {x >= thr} lies inside the prefix when thr beats its last value. A
        # NaN row (topk puts NaN first) takes the whole-row pass, which picks its first NaN.
        inside = idx.shape[1] == x.shape[1] or bool((thr > vals[:, -1]).all())
        if inside and not bool(vals[:, 0].isnan().any()):
            return _gumbel_argmax_prefix(vals, idx, thr, row_keys, x.shape[1]), thr
    return _gumbel_argmax_full(x, thr, row_keys), thr


def _gumbel_argmax_full(
    x: torch.Tensor, thr: torch.Tensor | None, row_keys: torch.Tensor
) -> torch.Tensor:
    """argmax over v with x[v] >= thr of x[v] + g[v] (first index on ties), whole vocab."""
    native = _native_for(x)
    if native is not None:
        return native.gumbel_argmax(x, thr, row_keys)
    num_rows, vocab_size = x.shape
    vocab_ids = torch.arange(vocab_size, dtype=torch.int64, device=x.device)
    out = torch.empty(num_rows, dtype=torch.int64, device=x.device)
    step = _CPU_CHUNK_ELEMS // vocab_size if x.device.type == "cpu" else num_rows
    step = max(step, 1)
    for start in range(0, num_rows, step):
        end = start + step
        scores = _neg_gumbel_from_keys(row_keys[start:end], vocab_ids)
        torch.sub(x[start:end], scores, out=scores)
        if thr is not None:
            mask_below_(scores, x[start:end], thr[start:end, None])
        out[start:end] = _argmax(scores)
    return out


def mask_below_(scores: torch.Tensor, x: torch.Tensor, thr: torch.Tensor) -> None:
    """scores[x < thr] = -inf in place, without a bool mask (``masked_fill_`` and
    ``torch.where`` are ~8x slower on CPU): 1/[x >= thr] - 1 is 0 (kept) or +inf."""
    blocked = torch.ge(x, thr, out=torch.empty_like(scores))
    scores.sub_(blocked.reciprocal_().sub_(1.0))


def _gumbel_argmax_prefix(
    vals: torch.Tensor,
    idx: torch.Tensor,
    thr: torch.Tensor,
    row_keys: torch.Tensor,
    vocab_size: int,
) -> torch.Tensor:
    """Same choice as :func:`_gumbel_argmax_full` when every allowed token is in the
    descending prefix (``vals``, ``idx``) [b, K]: noise only for those K tokens."""
    scores = _neg_gumbel_from_keys(row_keys, idx)
    torch.sub(vals, scores, out=scores)
    mask_below_(scores, vals, thr[:, None])
    best = scores.max(dim=-1, keepdim=True).values
    # Tie-break on the smallest vocab id, as argmax over the whole vocab does.
    return torch.where(scores == best, idx, vocab_size).min(dim=-1).values


def _truncation_thresholds(
    x: torch.Tensor,
    log_z: torch.Tensor | None,
    params: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    info: SamplingRows,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Per-row threshold t: the allowed set is {v : x[v] >= t} (x = logits / T).

    t = max(k-th largest x, x of the token whose cumulative prob first reaches top_p,
    max x + log(min_p)); a disabled criterion contributes -inf. ``params``: the rows'
    (top_ks, top_ps, min_ps). Returns (t [b], a descending prefix (values, indices) of every
    row holding its allowed set when t beats the prefix's last value, or None).
    """
    if not (info.need_top_k or info.need_top_p):
        row_max = x.max(dim=-1, keepdim=True).values
        return _thresholds_from_sorted(row_max, None, params, info)[0], None
    native = _native_for(x) if info.top_p_without_top_k else None
    if native is not None:
        return _thresholds_from_candidates(x, log_z, params, info, native), None
    return _thresholds_from_topk(x, log_z, params, info)


def _thresholds_from_topk(
    x: torch.Tensor,
    log_z: torch.Tensor | None,
    params: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    info: SamplingRows,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """:func:`_truncation_thresholds` from a ``topk`` prefix (max top_k + 1 values, at least
    :data:`_TOP_P_PREFIX_LEN` for top-p rows without top-k); rows whose nucleus is longer take
    a full sort. Returns (t, the prefix)."""
    prefix_len = min(x.shape[1], info.max_top_k + 1)
    if info.top_p_without_top_k:
        prefix_len = min(x.shape[1], max(prefix_len, _TOP_P_PREFIX_LEN))
    vals, idx = x.topk(prefix_len, dim=-1)
    thr, unresolved = _thresholds_from_sorted(vals, log_z, params, info)
    # Some nucleus is larger than the prefix: redo those rows on a full sort. The prefix of the
    # sort has the same values, so cumulative sums and thresholds agree.
    _redo_rows(
        thr, unresolved, x, log_z, params,
        lambda xr, zr, pr: _thresholds_from_sorted(_sorted_descending(xr), zr, pr, info)[0],
    )  # fmt: skip
    return thr, (vals, idx)


def _thresholds_from_candidates(
    x: torch.Tensor,
    log_z: torch.Tensor | None,
    params: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    info: SamplingRows,
    native: CpuSamplingKernels,
) -> torch.Tensor:
    """:func:`_truncation_thresholds` from the native kernel's candidates: per row, its largest
    values holding its top-p mass with a margin. Sorted, they are the row's sorted prefix, so
    the thresholds are those of a full sort; rows they do not settle (a top-k beyond them that
    top-p and min-p do not dominate, the float32 cumulative sum short of top_p, NaN or
    infinite rows) take :func:`_thresholds_from_topk`. Costs about two passes over a row and a
    sort of its candidates, where a nucleus of thousands of tokens would sort the whole row.
    Returns t [b]."""
    assert log_z is not None, "top-p needs the row log-normaliser"
    top_ps = params[1]
    mass = torch.where(top_ps < 1.0, (top_ps + _NUCLEUS_MASS_MARGIN).clamp_(max=1.0), 0.0)
    cands, lengths = native.nucleus_candidates(x, log_z, mass)
    thr, unresolved = _thresholds_from_sorted(cands, log_z, params, info, lengths)
    _redo_rows(
        thr, unresolved, x, log_z, params,
        lambda xr, zr, pr: _thresholds_from_topk(xr, zr, pr, info)[0],
    )  # fmt: skip
    return thr


_Params = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _redo_rows(
    thr: torch.Tensor,
    unresolved: torch.Tensor,
    x: torch.Tensor,
    log_z: torch.Tensor | None,
    params: _Params,
    thresholds: Callable[[torch.Tensor, torch.Tensor, _Params], torch.Tensor],
) -> None:
    """``thr[r] = thresholds(x[r], log_z[r], params of r)`` for the ``unresolved`` rows r, in
    place (every row at once, without copying ``x``, when all are)."""
    if not bool(unresolved.any()):
        return
    assert log_z is not None, "rows are left unresolved by top-p batches only"
    if bool(unresolved.all()):
        thr.copy_(thresholds(x, log_z, params))
        return
    rows = unresolved.nonzero().squeeze(1)
    row_params = (params[0][rows], params[1][rows], params[2][rows])
    thr[rows] = thresholds(x[rows], log_z[rows], row_params)


def _sorted_descending(x: torch.Tensor) -> torch.Tensor:
    """Values of each row of ``x`` [b, V] in descending order. On CPU numpy's value-only sort
    is about 20x faster than ``torch.sort`` (which also builds indices); same values."""
    if x.device.type != "cpu":
        return x.sort(dim=-1, descending=True).values
    return torch.from_numpy(-np.sort(-x.detach().numpy(), axis=-1))


def _thresholds_from_sorted(
    vals: torch.Tensor,
    log_z: torch.Tensor | None,
    params: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    info: SamplingRows,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Thresholds from the K largest values ``vals`` [b, K] (descending; K = V is a full sort).

    ``log_z`` [b]: row_logsumexp of the whole row (needed for top-p). ``lengths`` [b]: each
    row's own prefix length when they differ (``vals`` padded with -inf after it; 0: no prefix),
    None when every row has K. Returns (thr [b], the rows that need more than their prefix: a
    top-p crossing beyond it that the other criteria do not dominate, a top-k beyond it, or no
    prefix).
    """
    top_ks, top_ps, min_ps = params
    num_rows, prefix_len = vals.shape
    neg_inf = torch.full((num_rows,), float("-inf"), device=vals.device)
    if lengths is None:
        ends = torch.full((num_rows,), prefix_len, dtype=torch.int64, device=vals.device)
        no_prefix = torch.zeros(num_rows, dtype=torch.bool, device=vals.device)
    else:
        ends = lengths.clamp(min=1)
        no_prefix = lengths == 0
    # A full sort (a prefix of V) leaves nothing beyond it.
    partial = (ends if lengths is None else lengths) < info.vocab_size
    last = vals.gather(1, (ends - 1)[:, None]).squeeze(1)
    # thr: the criteria read off the prefix; a criterion that lies beyond it is at most its
    # last value, so it matters only where thr is below that (then the row is unresolved).
    thr = neg_inf
    beyond = torch.zeros_like(no_prefix)
    if info.need_min_p:
        thr = torch.where(min_ps > 0, vals[:, 0] + torch.log(min_ps), neg_inf)
    if info.need_top_k:
        uses_top_k = top_ks < info.vocab_size
        k_beyond = uses_top_k & (top_ks > ends) & partial
        kth = vals.gather(1, (torch.minimum(top_ks, ends) - 1)[:, None]).squeeze(1)
        thr = torch.maximum(thr, torch.where(uses_top_k & ~k_beyond, kth, neg_inf))
        beyond |= k_beyond
    if info.need_top_p:
        assert log_z is not None, "top-p needs the row log-normaliser"
        cum_probs = torch.exp(vals - log_z[:, None]).cumsum(dim=-1)
        # Tokens before the crossing one have cumulative prob < top_p; the crossing one is kept.
        num_before = (cum_probs < top_ps[:, None]).sum(dim=-1)
        crossing = vals.gather(1, torch.minimum(num_before, ends - 1)[:, None]).squeeze(1)
        uses_top_p = top_ps < 1.0
        p_beyond = uses_top_p & (num_before >= ends) & partial
        thr = torch.maximum(thr, torch.where(uses_top_p & ~p_beyond, crossing, neg_inf))
        beyond |= p_beyond
    return thr, no_prefix | (beyond & (thr < last))


# ---- entropy --------------------------------------------------------------------------------


def _whole_batch_needs_scaled_entropy(
    groups: tuple[EntropyGroup, ...], info: SamplingRows
) -> bool:
    """Whether the softmax statistics of the whole scaled batch also serve an entropy group
    (then they are computed once, with the logprob normaliser)."""
    return any(
        g.rows is None and g.top_k == 0 and (g.mode != "raw" or info.unit_temperature)
        for g in groups
    )


def entropy_of_rows(v: torch.Tensor) -> torch.Tensor:
    """H(softmax(v)) per row of ``v`` [b, n] float32 (-inf entries have probability 0), as
    ``log S - sum(e * d) / S`` with d = v - max v, e = exp(d), S = sum e. Returns [b]."""
    return _entropy_from_stats(row_softmax_stats(v, with_entropy=True))


def _entropy_from_stats(stats: SoftmaxStats) -> torch.Tensor:
    assert stats.sum_exp_dev is not None
    return torch.log(stats.sum_exp) - stats.sum_exp_dev / stats.sum_exp


def _entropies(
    logits: torch.Tensor,
    scaled: torch.Tensor | None,
    stats: SoftmaxStats | None,
    thr: torch.Tensor | None,
    info: SamplingRows,
    groups: tuple[EntropyGroup, ...],
) -> torch.Tensor:
    """Entropy [B] of each row under its group's definition (docs/entropy.md); 0 elsewhere.

    ``scaled``: logits / T (present whenever a group is not raw); ``stats``: its whole-batch
    statistics if already computed; ``thr``: the truncation thresholds of :func:`_sample`.
    """
    out = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
    whole = stats if stats is not None and stats.sum_exp_dev is not None else None
    for group in groups:
        rows = slice(None) if group.rows is None else group.rows
        # With unit temperatures ``scaled`` is bitwise ``logits`` (x / 1.0 == x).
        wants_raw = group.mode == "raw" and not info.unit_temperature
        source = logits if scaled is None or wants_raw else scaled
        group_thr = thr if group.mode == "sampled" else None
        if group.top_k == 0 and group_thr is None and source is scaled and whole is not None:
            ent = _entropy_from_stats(whole)[rows]
        else:
            values = source[rows]
            if group_thr is not None:
                values = values.clone()
                mask_below_(values, values, group_thr[rows][:, None])
            if group.top_k > 0:
                values = values.topk(group.top_k, dim=-1).values
            ent = entropy_of_rows(values)
        if group.mode == "sampled":
            # The sampled distribution of a greedy row is a point mass.
            ent = torch.where(info.is_greedy[rows], 0.0, ent)
        out[rows] = ent
    return out
