"""Decode steps replayed from CUDA graphs (docs/cuda_graph.md).

A decode step of ``B`` requests is padded up to the nearest captured batch size ``P >= B``:
its inputs are copied into static buffers (rows ``B..P-1`` are padding rows), the graph
captured for ``P`` is replayed, and rows ``0..B-1`` of its logits are the step's logits.
Capturing records every kernel of the forward pass once, so a replay costs one launch instead
of hundreds of Python-issued ones.

Padding rows are harmless by construction: each is a request of one token at position 0 in
the pool's reserved ``padding_row``, whose K/V goes to KV slot 0, the slot the allocator
reserves for padding and never hands out; it attends over that slot only and its logits are
dropped. Every kernel of the forward pass computes each row independently of the others (the
linear products, norms and activations are row-wise; the Triton attention is per query), so
real rows get the same tokens with padding as without; in deterministic mode, whose products
are batch-invariant, the same bits.

The graphs point at the static buffers, the weights and the KV pool: weight updates copy into
the parameters in place and stay valid; releasing the weights or the KV cache (which frees
those tensors) must :meth:`release` the graphs first and :meth:`capture` them again after.

A short prefill (at most the largest captured size in new tokens) replays the same graphs with
one row per new token: the decode graphs compute each row as a query at its own position over
its request's keys, which is what a prefill token is once every new token's K/V is stored
(each layer stores the step's K/V before its attention reads them). The logits of each
request's last new token are the step's. An eager prefill costs ~20-30 ms of host time on a GPU
(hundreds of launches); a replay about one decode step.

``capture=False`` runs the same padded path eagerly (any device, no graph): how CPU CI checks
that padding changes no token and no logprob.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch
from torch import nn
from tqdm import tqdm

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.layers.moe import has_sparse_moe
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

# Padding rows: position 0 of the pool's padding row, K/V written to the reserved slot 0.
_PAD_POSITION, _PAD_SLOT = 0, 0
# Memory the graphs take beyond their activations, held back from the KV pool with the
# activation estimate: a fixed part (cuBLAS workspaces, kernel modules) and a part per graph
# and decoder layer (the graphs' nodes). Measured on an H100 with SmolLM2-135M (30 layers, 35
# batch sizes): 1,090 MiB in all, about 1 MiB per graph and layer.
_FIXED_RESERVE = 256 << 20
_RESERVE_PER_GRAPH_LAYER = 1 << 20


def cuda_graph_off_reason(args: ServerArgs, tp_size: int, model: nn.Module) -> str | None:
    """Why decode of ``model`` runs eagerly under ``args``; None when it replays CUDA graphs."""
    if torch.device(args.device).type != "cuda":
        return "not a CUDA device"
    if args.disable_cuda_graph:
        return "--disable-cuda-graph"
    if has_sparse_moe(model):
        return "the MoE blocks' routing is data-dependent (read back to the host every step)"
    if args.attention_backend != "triton":
        # Its decode reads host-side lengths, which a replay cannot change.
        return f"the {args.attention_backend} attention backend is not graph-safe (use triton)"
    if tp_size > 1:
        return "tensor parallelism (its all-reduces are not captured)"
    return None


def cuda_graph_reserve_bytes(
    args: ServerArgs, model_config: ModelConfig, default_max_running_requests: int
) -> int:
    """An upper estimate of the graphs' memory, taken before the KV pool is sized (so before
    the number of request rows is known): the activations and logits of the largest captured
    batch, the graphs themselves and a fixed margin."""
    cfg = model_config
    sizes = args.cuda_graph_batch_sizes(args.max_running_requests or default_max_running_requests)
    elt = torch.tensor([], dtype=cfg.dtype).element_size()
    intermediate = getattr(
        cfg.hf_config.get_text_config(), "intermediate_size", 4 * cfg.hidden_size
    )
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    per_row = cfg.vocab_size * (elt + 4) + (3 * intermediate + 8 * cfg.hidden_size + qkv) * elt
    per_graph = cfg.num_hidden_layers * _RESERVE_PER_GRAPH_LAYER
    return sizes[-1] * per_row + len(sizes) * per_graph + _FIXED_RESERVE


ForwardFn = Callable[[ForwardBatch], LogitsProcessorOutput]


class DecodeGraphRunner:
    """Owns the static decode buffers and one graph per batch size of ``batch_sizes``.

    ``forward`` is the model runner's eager forward (it attaches the KV pool and attention
    backend and runs the model). ``pad`` False replays a graph only for a batch of exactly a
    captured size. ``prefill``: short prefills replay the graphs too, a row per new token; the
    attention backend must then read each row's key count from its position on the device
    (the Triton backends do), since several rows share a request.
    """

    def __init__(
        self,
        forward: ForwardFn,
        req_to_token_pool: ReqToTokenPool,
        batch_sizes: list[int],
        device: str,
        *,
        capture: bool = True,
        pad: bool = True,
        prefill: bool = False,
    ) -> None:
        if not batch_sizes:
            raise ValueError("no batch size to capture")
        self._forward = forward
        self._pool = req_to_token_pool
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_bs = self.batch_sizes[-1]
        self.use_graphs = capture
        self.pad = pad
        self.prefill = prefill
        self.graph_memory_bytes = 0  # measured at the last capture
        self.num_replays = 0  # decode steps run through the padded path
        self.num_prefill_replays = 0  # prefill steps run through it
        # Static inputs, padding values in every row until a step writes its own.
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.positions = torch.full((self.max_bs,), _PAD_POSITION, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.full((self.max_bs,), _PAD_SLOT, dtype=torch.int64, device=device)
        self._pad_row = req_to_token_pool.padding_row
        self.req_pool_indices = torch.full(
            (self.max_bs,), self._pad_row, dtype=torch.int64, device=device
        )
        self.seq_lens = self.positions + 1
        self._batches: dict[int, ForwardBatch] = {}  # see _static_batch
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}  # the logits each graph writes
        self._mempool: tuple | None = None

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def _rows(self, batch: ForwardBatch) -> int | None:
        """The rows ``batch`` takes in a graph (a request per row in decode, a new token per
        row in a prefill), or None when it is not a kind the runner takes."""
        if batch.lora_names is not None or batch.input_logprob_rows is not None:
            return None
        if batch.forward_mode == ForwardMode.DECODE:
            return batch.batch_size
        return batch.num_tokens if self.prefill else None

    def can_run(self, batch: ForwardBatch) -> bool:
        """Whether ``batch`` takes the padded path: a decode step of at most ``max_bs``
        requests, or with ``prefill`` a prefill of at most ``max_bs`` new tokens (exactly a
        captured size without padding), without LoRA adapters or prompt logprobs, and with the
        graphs captured (when they are used)."""
        rows = self._rows(batch)
        if rows is None or rows > self.max_bs:
            return False
        if not self.pad and rows not in self.batch_sizes:
            return False
        return self.captured or not self.use_graphs

    def padded_size(self, batch_size: int) -> int:
        """The smallest captured size that holds ``batch_size`` requests."""
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, batch_size)]

    def run(self, batch: ForwardBatch) -> LogitsProcessorOutput:
        """The logits of ``batch`` (precondition: :meth:`can_run`), a row per request in batch
        order. The returned tensor of a decode step is overwritten by the next step."""
        last_rows = None
        if batch.forward_mode == ForwardMode.DECODE:
            rows, pool_rows = batch.batch_size, batch.req_pool_indices
        else:
            rows = batch.num_tokens
            repeats = torch.tensor(batch.extend_seq_lens_cpu, device=batch.req_pool_indices.device)
            pool_rows = batch.req_pool_indices.repeat_interleave(repeats, output_size=rows)
            last_rows = torch.cumsum(repeats, 0) - 1  # each request's last new token
        size = self.padded_size(rows)
        self.input_ids[:rows].copy_(batch.input_ids)
        self.positions[:rows].copy_(batch.positions)
        self.out_cache_loc[:rows].copy_(batch.out_cache_loc)
        self.req_pool_indices[:rows].copy_(pool_rows)
        if size > rows:
            # A larger step earlier left live slots in these rows.
            self._pad_rows(rows, size)
        torch.add(self.positions[:size], 1, out=self.seq_lens[:size])
        if self.use_graphs:
            self._graphs[size].replay()
            logits = self._outputs[size]
        else:
            logits = self._forward(self._static_batch(size, _row_kv_lens(batch))).next_token_logits
        if last_rows is None:
            self.num_replays += 1
            return LogitsProcessorOutput(next_token_logits=logits[:rows])
        self.num_prefill_replays += 1
        return LogitsProcessorOutput(next_token_logits=logits.index_select(0, last_rows))

    def capture(self) -> None:
        """Capture one graph per batch size, largest first (they share one memory pool, sized
        by the largest), with a progress bar; records :attr:`graph_memory_bytes`."""
        if not self.use_graphs or self.captured:
            return
        start = time.perf_counter()
        # The warm-up passes write K/V: only to the reserved slot, not to the slots (maybe
        # the prefix cache's now) of the last step before a release.
        self._pad_rows(0, self.max_bs)
        free_before = torch.cuda.mem_get_info()[0]
        self._mempool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        sizes = sorted(self.batch_sizes, reverse=True)
        for size in tqdm(sizes, desc="Capturing CUDA graphs", unit="graph", leave=False):
            batch = self._static_batch(size)
            # Warm-up on the capture stream: Triton compiles, cuBLAS picks its kernels.
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(batch)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._mempool, stream=stream):
                out = self._forward(batch).next_token_logits
            self._graphs[size] = graph
            self._outputs[size] = out
        torch.cuda.synchronize()
        self.graph_memory_bytes = max(0, free_before - torch.cuda.mem_get_info()[0])
        logger.info(
            "CUDA graphs: captured %d decode batch sizes (%s) in %.1f s, %.1f MiB",
            len(sizes),
            _size_ranges(self.batch_sizes),
            time.perf_counter() - start,
            self.graph_memory_bytes / 2**20,
        )

    def release(self) -> None:
        """Drop the graphs and their memory pool (before the tensors they read are freed)."""
        if not self._graphs:
            return
        torch.cuda.synchronize()
        self._graphs.clear()
        self._outputs.clear()
        self._mempool = None
        torch.cuda.empty_cache()
        logger.info("CUDA graphs: released")

    def _pad_rows(self, start: int, end: int) -> None:
        """Make rows ``start..end-1`` of the static inputs padding rows: they write their K/V
        only to the reserved slot."""
        self.input_ids[start:end].zero_()
        self.positions[start:end].fill_(_PAD_POSITION)
        self.out_cache_loc[start:end].fill_(_PAD_SLOT)
        self.req_pool_indices[start:end].fill_(self._pad_row)
        torch.add(self.positions[start:end], 1, out=self.seq_lens[start:end])

    def _static_batch(self, size: int, kv_lens: list[int] | None = None) -> ForwardBatch:
        """The decode batch of ``size`` rows over views of the static buffers, one object per
        size for the runner's life (as a graph sees it: the same tensors, their contents
        changed in place). Its host-side lengths are ``kv_lens`` (the keys before each real
        row's token) then the padding rows'; without them (a capture) the padding rows' only:
        a graph-safe backend reads lengths on the device only."""
        static = self._batches.get(size)
        if static is None:
            static = ForwardBatch(
                forward_mode=ForwardMode.DECODE,
                batch_size=size,
                input_ids=self.input_ids[:size],
                positions=self.positions[:size],
                out_cache_loc=self.out_cache_loc[:size],
                req_pool_indices=self.req_pool_indices[:size],
                seq_lens=self.seq_lens[:size],
                seq_lens_cpu=[],
                extend_seq_lens_cpu=[1] * size,
                extend_prefix_lens_cpu=[],
                req_to_token_pool=self._pool,
            )
            self._batches[size] = static
        kv_lens = list(kv_lens or [])
        kv_lens += [0] * (size - len(kv_lens))
        static.extend_prefix_lens_cpu = kv_lens
        static.seq_lens_cpu = [n + 1 for n in kv_lens]
        return static


def _row_kv_lens(batch: ForwardBatch) -> list[int]:
    """The keys before each graph row's token, for the host-side lengths of an eager pass: a
    request's in decode, each new token's in a prefill."""
    if batch.forward_mode == ForwardMode.DECODE:
        return batch.extend_prefix_lens_cpu
    return [
        prefix + j
        for prefix, n in zip(batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu)
        for j in range(n)
    ]


def _size_ranges(sizes: list[int]) -> str:
    return ", ".join(map(str, sizes)) if len(sizes) <= 6 else f"{sizes[0]}..{sizes[-1]}"
