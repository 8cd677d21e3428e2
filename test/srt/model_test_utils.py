"""Helpers for model-level tests: real pools, hand-built ForwardBatches, HF reference runs.

``BatchBuilder`` plays the scheduler's role for a handful of requests: it owns one
ReqToTokenPool row per request id and hands out KV slots from a shuffled free list starting at
slot ``page_size`` = 1 (slot 0 is the pool's dummy), so attention must really follow
``req_to_token`` instead of assuming contiguous slots.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PretrainedConfig

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.attention import get_attention_backend_class
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.server_args import ServerArgs

PAGE_SIZE = 1
# KV pool of the model runners made by make_runner.
RUNNER_SLOTS = 1024
# Triton kernel tests run on the GPU when there is one, else in Triton's CPU interpreter.
TEST_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Engine kwargs for tests that hold two engines at once: on a GPU each takes 85% of the device by
# default, so the second would find no room for its KV cache.
TWO_ENGINE_KW: dict = {"mem_fraction_static": 0.4} if TEST_DEVICE == "cuda" else {}


class BatchBuilder:
    """Builds EXTEND/DECODE ForwardBatches for requests identified by ``rid``.

    ``extend``/``decode`` mutate the builder: they allocate rows/slots and record the new tokens'
    slots in ``req_to_token``; the returned batch is ready for ``run_forward``.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        dtype: torch.dtype = torch.float32,
        num_slots: int = 2048,
        max_reqs: int = 16,
        max_context_len: int = 512,
        seed: int = 0,
        backend_name: str = "torch_native",
        device: str = "cpu",
        num_kv_heads: int | None = None,
        cpu_attention_kernel: bool = True,
    ) -> None:
        """``num_kv_heads``: KV heads of the pool (a tensor-parallel rank's own), default the
        config's. ``cpu_attention_kernel``: on CPU the torch_native backend decodes with the C++
        kernel, as the model runner sets it up (False: SDPA)."""
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.device = device
        self.req_to_token_pool = ReqToTokenPool(max_reqs, max_context_len, device)
        self.kv_pool = MHATokenToKVPool(
            num_slots,
            PAGE_SIZE,
            dtype,
            num_kv_heads or config.num_key_value_heads,
            head_dim,
            config.num_hidden_layers,
            device,
        )
        gen = torch.Generator().manual_seed(seed)
        self._free_slots = (torch.randperm(num_slots, generator=gen) + PAGE_SIZE).tolist()
        self.rows: dict[str, int] = {}
        self.seq_lens: dict[str, int] = {}
        self.backend = get_attention_backend_class(backend_name)(device)
        if cpu_attention_kernel and backend_name == "torch_native" and device == "cpu":
            self.backend.enable_cpu_decode_kernel()  # SDPA where the kernel cannot be built

    def _alloc_slots(self, num_tokens: int) -> torch.Tensor:
        slots, self._free_slots = self._free_slots[:num_tokens], self._free_slots[num_tokens:]
        assert len(slots) == num_tokens, "test KV pool exhausted"
        return torch.tensor(slots, dtype=torch.int64, device=self.device)

    def _build(self, mode: ForwardMode, reqs: list[tuple[str, list[int]]]) -> ForwardBatch:
        input_ids, positions, out_cache_loc, rows = [], [], [], []
        prefix_lens, new_lens = [], []
        for rid, token_ids in reqs:
            if rid not in self.rows:
                self.rows[rid] = self.req_to_token_pool.alloc(1)[0]
                self.seq_lens[rid] = 0
            prefix_len = self.seq_lens[rid]
            slots = self._alloc_slots(len(token_ids))
            self.req_to_token_pool.write(self.rows[rid], prefix_len, slots)
            input_ids += token_ids
            positions += range(prefix_len, prefix_len + len(token_ids))
            out_cache_loc.append(slots)
            rows.append(self.rows[rid])
            prefix_lens.append(prefix_len)
            new_lens.append(len(token_ids))
            self.seq_lens[rid] = prefix_len + len(token_ids)
        seq_lens = [p + n for p, n in zip(prefix_lens, new_lens)]
        return ForwardBatch(
            forward_mode=mode,
            batch_size=len(reqs),
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            out_cache_loc=torch.cat(out_cache_loc),
            req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=self.device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=self.device),
            seq_lens_cpu=seq_lens,
            extend_seq_lens_cpu=new_lens,
            extend_prefix_lens_cpu=prefix_lens,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.kv_pool,
        )

    def extend(self, reqs: list[tuple[str, list[int]]]) -> ForwardBatch:
        """EXTEND batch appending each request's tokens after what it already has in the KV."""
        return self._build(ForwardMode.EXTEND, reqs)

    def decode(self, reqs: list[tuple[str, int]]) -> ForwardBatch:
        """DECODE batch with one new token per request."""
        return self._build(ForwardMode.DECODE, [(rid, [tok]) for rid, tok in reqs])

    def release(self, rid: str) -> None:
        """Forget ``rid``: free its row and put its slots first in line, so that the next
        request gets, token for token, the same slots (and the same row when no other row is
        free)."""
        row = self.rows.pop(rid)
        slots = self.req_to_token_pool.req_to_token[row, : self.seq_lens.pop(rid)].tolist()
        self.req_to_token_pool.free(row)
        self._free_slots = slots + self._free_slots

    def run(self, model: torch.nn.Module, batch: ForwardBatch) -> LogitsProcessorOutput:
        """Init attention metadata and run the model forward (no autograd)."""
        batch.attn_backend = self.backend
        self.backend.init_forward_metadata(batch)
        with torch.no_grad():
            return model(batch.input_ids, batch.positions, batch)


def set_input_logprobs(
    batch: ForwardBatch, rows: list[int], targets: list[int], top_k: int = 0
) -> None:
    """Ask ``batch`` for prompt logprobs at flattened ``rows`` predicting ``targets`` (mutates)."""
    batch.input_logprob_rows = torch.tensor(rows, dtype=torch.int64)
    batch.input_logprob_targets = torch.tensor(targets, dtype=torch.int64)
    batch.input_top_logprobs_num = top_k


def hf_logits(hf_model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """Float32 logits ``[len(token_ids), V]`` of a transformers model on one sequence."""
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def hf_greedy(
    hf_model: torch.nn.Module, prompt_ids: list[int], num_steps: int
) -> tuple[list[int], list[torch.Tensor]]:
    """Plain argmax decoding (no EOS handling): ``(new token ids, logits before each)``."""
    ids = list(prompt_ids)
    new_ids, step_logits = [], []
    for _ in range(num_steps):
        logits = hf_logits(hf_model, ids)[-1]
        step_logits.append(logits)
        new_ids.append(int(logits.argmax()))
        ids.append(new_ids[-1])
    return new_ids, step_logits


def load_from_hf(model_cls: type, hf_model: torch.nn.Module) -> torch.nn.Module:
    """Our ``model_cls`` built from ``hf_model.config`` and loaded from its state dict."""
    model = model_cls(hf_model.config)
    model.load_weights(hf_model.state_dict().items())
    return model.eval()


def make_runner(path: Path, dtype: str = "float32", **kwargs: object) -> ModelRunner:
    """A CPU ModelRunner of the model at ``path`` with a pool of RUNNER_SLOTS tokens;
    ``kwargs``: more ServerArgs."""
    args = ServerArgs(
        model_path=str(path), device="cpu", dtype=dtype, max_total_tokens=RUNNER_SLOTS, **kwargs
    )
    return ModelRunner(args, ModelConfig(str(path), dtype=dtype, device="cpu"))


def greedy(runner: ModelRunner, prompts: list[list[int]], num_steps: int) -> list[list[int]]:
    """Greedy tokens of ``prompts`` as one batch: a prefill, then ``num_steps - 1`` decode
    steps, through the runner's forward (a runner from :func:`make_runner`)."""
    builder = BatchBuilder(
        runner.model.config, dtype=runner.dtype, num_slots=RUNNER_SLOTS - 1, max_reqs=8
    )
    rids = [f"r{i}" for i in range(len(prompts))]
    out = runner.forward(builder.extend(list(zip(rids, prompts))))
    tokens = [[int(t)] for t in out.next_token_logits.argmax(-1)]
    for _ in range(num_steps - 1):
        out = runner.forward(builder.decode([(r, t[-1]) for r, t in zip(rids, tokens)]))
        for row, logits in zip(tokens, out.next_token_logits):
            row.append(int(logits.argmax()))
    return tokens


def teacher_forced_logits(
    hf_model: torch.nn.Module, prompt: list[int], output_ids: list[int]
) -> torch.Tensor:
    """[len(output_ids), V] float64: the logits each output token was sampled from."""
    ids = torch.tensor([prompt + output_ids])
    with torch.no_grad():
        logits = hf_model(ids).logits[0].double()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(output_ids)]
