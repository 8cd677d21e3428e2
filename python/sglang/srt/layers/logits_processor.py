"""Hidden states -> next-token logits (last new token of each request) and prompt logprobs.

With tensor parallelism each rank multiplies by its vocabulary slice of the LM head
(layers/vocab_embedding.py) and the slices are all-gathered (a concatenation: exact) and the
padding cut, so every rank samples from the same full-vocabulary logits.

With ``--enable-fp32-lm-head`` (a :class:`Float32Head` set on the processor) a bfloat16 or
float16 model's head runs in float32: the hidden states and the head's weights are widened
(exactly) and the float32 product is never rounded to the model dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sglang.srt.distributed.parallel_state import get_tp_group
from sglang.srt.layers.linear import linear
from sglang.srt.layers.sampler import row_logsumexp
from sglang.srt.model_executor.forward_batch_info import ForwardBatch

# Prompt-logprob rows are processed in chunks so the float32 [rows, vocab] block stays below
# about 2**25 elements (128 MiB) whatever the prompt length.
_LOGPROB_CHUNK_ELEMENTS = 1 << 25


class Float32Head:
    """The float32 values of the LM head's weights, for ``--enable-fp32-lm-head``.

    With ``cache`` (CPU) one float32 copy is kept and made again when the weight's storage,
    shape or version changes (a weight update copies into the parameter in place, which bumps
    its version; a release swaps its storage), so the copy never outlives the values it was
    made from; the model's own weight stays in its dtype for loading and
    ``get_weights_by_name``. Without it (CUDA) the weight is widened at every call, which costs
    no memory between steps and stays inside a captured graph.
    """

    def __init__(self, cache: bool) -> None:
        self.cache = cache
        self._key: tuple[int, int, tuple[int, ...]] | None = None
        self._copy: torch.Tensor | None = None

    def weight(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` in float32 (itself when it already is)."""
        if weight.dtype == torch.float32:
            return weight
        # An inference tensor has no version counter to key a copy on: widen it each time.
        if not self.cache or weight.is_inference():
            return weight.float()
        key = (weight.data_ptr(), weight._version, tuple(weight.shape))
        if key == self._key and self._copy is not None:
            return self._copy
        # Not an inference tensor even when made inside a forward pass: the CPU's packed
        # product takes only weights with a version counter, and the copy must be multiplied
        # the same way whenever it was made.
        with torch.inference_mode(False), torch.no_grad():
            if self._copy is not None and self._copy.shape == weight.shape:
                # In place, which bumps the copy's version: a new tensor could land at the old
                # one's address with the same version 0, and a packed copy keyed on (address,
                # version) would then keep the old values.
                self._copy.copy_(weight)
            else:
                self._copy = None  # free the old copy before making the new one
                self._copy = weight.detach().float()
        self._key = key
        return self._copy

    def clear(self) -> None:
        """Drop the cached copy (made again by the next call)."""
        self._key, self._copy = None, None

    @property
    def nbytes(self) -> int:
        """Bytes held by the cached copy (0 when there is none)."""
        return 0 if self._copy is None else self._copy.numel() * 4


@dataclass
class LogitsProcessorOutput:
    """What one forward pass hands to the sampler."""

    next_token_logits: torch.Tensor  # [B, V] float32: logits after the last new token of each req
    input_token_logprobs: torch.Tensor | None = None  # [R] float32: logprob of each target
    input_top_logprobs_val: torch.Tensor | None = None  # [R, K] float32, descending
    input_top_logprobs_idx: torch.Tensor | None = None  # [R, K] int64 token ids


def _last_rows(forward_batch: ForwardBatch, device: torch.device) -> torch.Tensor:
    """``[B]`` int64: the row of each request's last new token among the batch's tokens."""
    ends = torch.tensor(forward_batch.extend_seq_lens_cpu, device=device)
    return ends.cumsum(0) - 1


def last_token_rows(forward_batch: ForwardBatch) -> torch.Tensor | None:
    """The rows of the batch's tokens whose final hidden states are all that the logits need
    (the last new token of each request), or None where every row is needed or kept anyway.

    A model may then run its last decoder layer past attention (which needs every token's K/V
    and queries) on these rows only, and pass ``rows_are_last=True`` to the logits processor.
    None in DECODE and wherever each request has one new token (every row is a last one), when
    prompt logprobs are asked (they need every row), and when a LoRA adapter serves the step
    (its row groups index all of the step's tokens), and when the step records routed experts
    (every token's routing in every layer is wanted). The kept rows' values are those of the
    full pass up to the rounding of the products (fewer rows may take another kernel, as in
    any smaller batch).
    """
    if forward_batch.is_decode or forward_batch.input_logprob_rows is not None:
        return None
    if forward_batch.records_routing:
        return None
    if forward_batch.batch_size == forward_batch.num_tokens:
        return None
    if any(name is not None for name in forward_batch.lora_names or ()):
        return None
    return _last_rows(forward_batch, forward_batch.input_ids.device)


class LogitsProcessor(nn.Module):
    """Computes logits only where they are needed.

    ``config`` is the HF config; its optional ``final_logit_softcapping`` (Gemma-style
    ``cap * tanh(logits / cap)``) is applied to every logit this module returns.
    """

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        # The full vocabulary: the gathered logits of the ranks lose their padding beyond it.
        self.vocab_size: int | None = getattr(config, "vocab_size", None)
        # The product used for logits; deterministic mode swaps in a batch-invariant one.
        self.linear_fn = linear
        # log Z of prompt-logprob rows: the model runner sets the sampling backend's own
        # (get_logsumexp), so that prompt logprobs equal decode logprobs bit for bit.
        self.logsumexp_fn: Callable[[torch.Tensor], torch.Tensor] = row_logsumexp
        # --enable-fp32-lm-head: the head's product in float32 (None: in the model dtype).
        self.fp32_head: Float32Head | None = None

    def _logits(self, hidden_states: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        # The matmul runs in the model dtype (as HF does) unless the head is float32; sampling
        # math is float32 from here on.
        if self.fp32_head is not None:
            hidden_states = hidden_states.float()
            lm_head_weight = self.fp32_head.weight(lm_head_weight)
        logits = self.linear_fn(hidden_states, lm_head_weight)
        group = get_tp_group()
        if group.world_size > 1:  # each rank has a vocabulary slice: gather, drop the padding
            logits = group.all_gather(logits, dim=-1)[:, : self.vocab_size].contiguous()
        logits = logits.float()
        if self.final_logit_softcapping:
            cap = float(self.final_logit_softcapping)
            logits = torch.tanh(logits / cap) * cap
        return logits

    def forward(
        self,
        hidden_states: torch.Tensor,
        lm_head_weight: torch.Tensor,
        forward_batch: ForwardBatch,
        rows_are_last: bool = False,
    ) -> LogitsProcessorOutput:
        """Logits of the last new token of every request, plus prompt logprobs if asked.

        ``hidden_states`` is ``[num_tokens, H]`` (final norm applied), or with
        ``rows_are_last`` ``[B, H]``: the rows of :func:`last_token_rows` only. In DECODE every
        row is a last token; in EXTEND the last token of request i is row
        ``sum(extend_seq_lens_cpu[: i + 1]) - 1``. Nothing is mutated.
        """
        if forward_batch.is_decode or rows_are_last:
            last_hidden = hidden_states
        else:
            last_hidden = hidden_states.index_select(
                0, _last_rows(forward_batch, hidden_states.device)
            )
        output = LogitsProcessorOutput(next_token_logits=self._logits(last_hidden, lm_head_weight))
        if forward_batch.input_logprob_rows is not None:
            self._fill_input_logprobs(output, hidden_states, lm_head_weight, forward_batch)
        return output

    def _fill_input_logprobs(
        self,
        output: LogitsProcessorOutput,
        hidden_states: torch.Tensor,
        lm_head_weight: torch.Tensor,
        forward_batch: ForwardBatch,
    ) -> None:
        """Set ``output.input_*`` from ``forward_batch.input_logprob_rows/targets`` (in place)."""
        rows = forward_batch.input_logprob_rows
        targets = forward_batch.input_logprob_targets
        if rows is None or targets is None or targets.shape != rows.shape:
            raise ValueError("input_logprob_targets must be given with the same shape as rows")
        vocab_size = self.vocab_size or lm_head_weight.shape[0]
        top_k = min(forward_batch.input_top_logprobs_num, vocab_size)
        chunk = max(1, _LOGPROB_CHUNK_ELEMENTS // vocab_size)
        token_logprobs, top_vals, top_idx = [], [], []
        for start in range(0, rows.numel(), chunk):
            chunk_rows = rows[start : start + chunk]
            logits = self._logits(hidden_states.index_select(0, chunk_rows), lm_head_weight)
            logprobs = logits - self.logsumexp_fn(logits).unsqueeze(1)
            chunk_targets = targets[start : start + chunk].unsqueeze(1)
            token_logprobs.append(logprobs.gather(1, chunk_targets).squeeze(1))
            if top_k > 0:
                vals, idx = logprobs.topk(top_k, dim=-1)
                top_vals.append(vals)
                top_idx.append(idx)
        device = hidden_states.device
        output.input_token_logprobs = (
            torch.cat(token_logprobs)
            if token_logprobs
            else torch.empty(0, dtype=torch.float32, device=device)
        )
        if top_k > 0:
            empty_idx = torch.empty(0, top_k, dtype=torch.int64, device=device)
            output.input_top_logprobs_val = (
                torch.cat(top_vals)
                if top_vals
                else torch.empty(0, top_k, dtype=torch.float32, device=device)
            )
            output.input_top_logprobs_idx = torch.cat(top_idx) if top_idx else empty_idx
