"""The one contract between the scheduler and the model runner: :class:`ForwardBatch`.

Token layout of one batch (EXTEND shown; in DECODE every request has exactly one new token)::

    request        r0                 r1          r2
    KV before      [p0 prefix toks]   [p1 ...]    [p2 ...]     extend_prefix_lens_cpu = [p0,p1,p2]
    new tokens     [e0 new tokens]    [e1 ...]    [e2 ...]     extend_seq_lens_cpu    = [e0,e1,e2]
    input_ids      |<---- e0 ---->|<--- e1 --->|<--- e2 --->|  flattened, num_tokens = e0+e1+e2
    seq_lens       p0+e0              p1+e1       p2+e2         KV length after this step

``req_to_token[req_pool_indices[i], :seq_lens[i]]`` are the KV slots of request i, the last
``extend_seq_lens_cpu[i]`` of which equal its slice of ``out_cache_loc``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool


class ForwardMode(IntEnum):
    EXTEND = 1  # prefill (possibly of a chunk, possibly after a cached prefix)
    DECODE = 2  # one new token per request


@dataclass
class ForwardBatch:
    """Everything one forward pass needs; built by ScheduleBatch, read by the model runner."""

    forward_mode: ForwardMode
    batch_size: int  # number of requests B
    input_ids: torch.Tensor  # [num_tokens] int64: the tokens computed this step, concatenated
    positions: torch.Tensor  # [num_tokens] int64: absolute position of each token in its sequence
    out_cache_loc: torch.Tensor  # [num_tokens] int64: KV slot that receives each token's K/V
    req_pool_indices: torch.Tensor  # [B] int64: row of each request in ReqToTokenPool
    seq_lens: torch.Tensor  # [B] int64: KV length of each request after this step
    seq_lens_cpu: list[int]  # same as seq_lens, on the host
    extend_seq_lens_cpu: list[int]  # [B] new tokens per request (all 1 in DECODE)
    extend_prefix_lens_cpu: list[int]  # [B] tokens already in the KV cache before this step
    req_to_token_pool: ReqToTokenPool  # request -> KV slot table
    # Input (prompt) logprobs: rows of the flattened tokens whose next-token logprob is wanted,
    # and that next token. None when no request of the batch asks for prompt logprobs.
    input_logprob_rows: torch.Tensor | None = None  # [R] int64 indices into input_ids
    input_logprob_targets: torch.Tensor | None = None  # [R] int64 token predicted at each row
    input_top_logprobs_num: int = 0  # max top_logprobs_num over requests with prompt logprobs
    # [B] the LoRA adapter of each request (None: the base model); None when no request of
    # the batch uses one. The LoRAManager maps them to slots (sglang.srt.lora).
    lora_names: list[str | None] | None = None
    # Set by the model runner when it records routed experts: every token runs every layer
    # (no last-layer shortcut, see logits_processor.last_token_rows).
    records_routing: bool = False
    # Set by the attention backend's init_forward_metadata(); opaque to everyone else.
    attn_metadata: Any = None
    attn_backend: AttentionBackend | None = None
    # The K/V tensors of every layer: the model runner's, set when it runs the batch.
    token_to_kv_pool: MHATokenToKVPool | None = None

    @property
    def kv_pool(self) -> MHATokenToKVPool:
        """The K/V tensors; only valid inside the model runner's forward."""
        if self.token_to_kv_pool is None:
            raise RuntimeError("the batch runs outside a model runner (no KV pool attached)")
        return self.token_to_kv_pool

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode(self) -> bool:
        return self.forward_mode == ForwardMode.DECODE
