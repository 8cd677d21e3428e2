"""The start-up memory warm-up on CPU (model_executor/warmup.py): a throwaway prefill through
the first decoder layers grows the heap, the KV pool's first slots are written; no request row
or slot stays taken, results do not change, and --disable-cpu-malloc-tuning skips it."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from model_test_utils import RUNNER_SLOTS, greedy, make_runner
from torch import nn

from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.model_executor import model_runner
from sglang.srt.model_executor.warmup import (
    DUMMY_SLOT,
    dummy_prefill,
    first_decoder_layers,
    warm_up_cpu_memory,
    warmup_prefill_lengths,
)

PROMPTS = [[5, 17, 3, 99, 250, 8, 41], list(range(30, 43)), [200, 7, 7]]


@pytest.mark.parametrize(
    ("tokens", "rows", "context", "expected"),
    [
        (8192, 256, 8192, [256] * 32),  # requests of 256 tokens
        (8192, 4, 8192, [2048] * 4),  # few rows: longer requests
        (8192, 4, 1024, [1024] * 4),  # ... never past the context length
        (100, 10, 64, [50, 50]),  # a short context: requests of at most 64
        (10, 10, 8192, [10]),
    ],
)
def test_warmup_prefill_lengths(tokens: int, rows: int, context: int, expected: list[int]) -> None:
    assert warmup_prefill_lengths(tokens, rows, context) == expected


def test_dummy_prefill_of_several_requests() -> None:
    pool = ReqToTokenPool(4, 16, "cpu")
    pool.req_to_token.fill_(7)
    batch = dummy_prefill([3, 5], pool)
    assert pool.available_size() == 2
    assert batch.batch_size == 2 and batch.num_tokens == 8
    assert batch.positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert batch.out_cache_loc.tolist() == [DUMMY_SLOT] * 8
    assert batch.seq_lens_cpu == batch.extend_seq_lens_cpu == [3, 5]
    assert batch.extend_prefix_lens_cpu == [0, 0]
    rows = batch.req_pool_indices.tolist()
    assert pool.req_to_token[rows[0], :3].tolist() == [DUMMY_SLOT] * 3
    assert pool.req_to_token[rows[1], :5].tolist() == [DUMMY_SLOT] * 5
    with pytest.raises(RuntimeError, match="free request rows"):
        dummy_prefill([1, 1, 1], pool)


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Module()
        self.inner.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(5))


def test_first_decoder_layers_restores_the_layers() -> None:
    model = _Stack()
    original = model.inner.layers
    with first_decoder_layers(model, 2):
        assert list(model.inner.layers) == list(original)[:2]
    assert model.inner.layers is original
    with pytest.raises(ValueError, match="boom"), first_decoder_layers(model, 1):
        assert len(model.inner.layers) == 1
        raise ValueError("boom")
    assert model.inner.layers is original and len(original) == 5


def test_runner_warms_up_memory_and_gives_the_same_tokens(
    tiny_model_dir: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_model_dir("llama")
    prefill_sizes: list[int] = []

    def spy(*args: Any, **kwargs: Any) -> None:
        bound = inspect.signature(warm_up_cpu_memory).bind(*args, **kwargs)
        prefill_sizes.append(bound.arguments["prefill_tokens"])
        warm_up_cpu_memory(*args, **kwargs)

    monkeypatch.setattr(model_runner, "warm_up_cpu_memory", spy)
    warmed = make_runner(path)
    assert len(prefill_sizes) == 1 and prefill_sizes[0] > 0
    # Every request row is free again and the pool's slots written so far hold zeros (the
    # dummy slot included, which the warm-up prefill wrote into).
    assert warmed.req_to_token_pool.available_size() == warmed.req_to_token_pool.size
    pool = warmed.token_to_kv_pool
    for buf in pool.k_buffer + pool.v_buffer:
        assert buf.shape[0] == RUNNER_SLOTS + 1
        assert not buf.any()
    plain = make_runner(path, disable_cpu_malloc_tuning=True)
    assert len(prefill_sizes) == 1  # the flag skips it
    assert greedy(warmed, PROMPTS, 6) == greedy(plain, PROMPTS, 6)
    assert len(warmed.model.model.layers) == warmed.model.config.num_hidden_layers


def test_bfloat16_runner_warms_up(tiny_model_dir: Callable[..., Path]) -> None:
    runner = make_runner(tiny_model_dir("qwen3"), "bfloat16")
    assert runner.token_to_kv_pool.k_buffer[0].dtype == torch.bfloat16
    assert greedy(runner, PROMPTS, 3) == greedy(
        make_runner(tiny_model_dir("qwen3"), "bfloat16", disable_cpu_malloc_tuning=True),
        PROMPTS,
        3,
    )
