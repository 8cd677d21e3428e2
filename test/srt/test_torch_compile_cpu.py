"""--enable-torch-compile on CPU (model_executor/cpu_torch_compile.py): the compiled decoder
layers give eager's tokens, compile once at start-up (no recompilation over batch sizes), pick
up weight updates, and stay off in deterministic mode.

Compiling is slow on a small CI machine (inductor builds C++), so each model is compiled once
per module (module-scoped runners) and the tests drive the model runner directly, without an
engine's processes. The compiled graphs depend only on the model's shapes and dtype: inductor's
on-disk cache makes later runs cheaper.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from model_test_utils import greedy, make_runner

from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.server_args import ServerArgs, prepare_server_args

PROMPTS = [[5, 17, 3, 99, 250, 8, 41], list(range(30, 43)), [200, 7, 7]]


def num_graphs() -> int:
    """Graphs dynamo traced in this process."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def compiled_runner(path: Path, dtype: str = "float32", **kwargs: object) -> ModelRunner:
    """A runner with compiled layers, its graphs all traced at start-up: the 6 of the warm-up
    (asserted, so that no test passes on a silent fallback to eager).

    Dynamo caches graphs per Python function across runners, and a cache entry per shape set:
    several models in one process would pile up entries until its recompile limit sends the
    layers back to eager, so the cache is emptied first (a server holds one model).
    """
    torch._dynamo.reset()
    before = num_graphs()
    runner = make_runner(path, dtype, enable_torch_compile=True, **kwargs)
    assert runner.compiled_layers is not None
    assert num_graphs() - before == 6
    return runner


@pytest.fixture(scope="module")
def llama_runners(
    tiny_model_dir: Callable[..., Path],
) -> Iterator[tuple[ModelRunner, ModelRunner]]:
    """(eager, compiled) runners on the tiny random Llama, float32."""
    path = tiny_model_dir("llama")
    yield make_runner(path), compiled_runner(path)


def test_compiled_tokens_equal_eager(llama_runners: tuple[ModelRunner, ModelRunner]) -> None:
    eager, compiled = llama_runners
    assert compiled.compiled_layers is not None and eager.compiled_layers is None
    assert greedy(compiled, PROMPTS, 8) == greedy(eager, PROMPTS, 8)


def test_no_recompilation_over_batch_sizes(
    llama_runners: tuple[ModelRunner, ModelRunner],
) -> None:
    """The start-up warm-up compiled every graph: prefills and decode batches of other sizes
    (1 to 5 requests, 1 to 21 prompt tokens) trace nothing new."""
    _, compiled = llama_runners
    before = num_graphs()
    for num_prompts in (1, 2, 5):
        prompts = [list(range(7 + i, 7 + i + 4 * num_prompts + i)) for i in range(num_prompts)]
        greedy(compiled, prompts, 3)
    assert num_graphs() == before


def test_compiled_layers_see_weight_updates(
    llama_runners: tuple[ModelRunner, ModelRunner],
) -> None:
    """A weight changed in place (what every update path does) is repacked before the next
    compiled step: the tokens follow the new weights, as eager's do."""
    eager, compiled = llama_runners
    before = greedy(compiled, PROMPTS, 4)
    for runner in (eager, compiled):
        with torch.no_grad():
            runner.model.model.layers[0].mlp.down_proj.weight.mul_(-3.0)
    try:
        after = greedy(compiled, PROMPTS, 4)
        assert after != before  # the update changes the tokens: a stale packed copy shows
        assert after == greedy(eager, PROMPTS, 4)
    finally:
        for runner in (eager, compiled):
            with torch.no_grad():
                runner.model.model.layers[0].mlp.down_proj.weight.div_(-3.0)


def test_qwen3_bfloat16_agrees_with_eager(tiny_model_dir: Callable[..., Path]) -> None:
    """Qwen3 (q/k norms inside the compiled graph) in bfloat16: the fused kernels round
    differently from eager's op-by-op ones, so the tokens are held to the agreement the
    bfloat16 model tests ask of eager vs transformers (test_models.py)."""
    path = tiny_model_dir("qwen3")
    got = greedy(compiled_runner(path, "bfloat16"), PROMPTS, 5)
    expected = greedy(make_runner(path, "bfloat16"), PROMPTS, 5)
    first_agree = sum(t[0] == e[0] for t, e in zip(got, expected))
    total_agree = sum(a == b for t, e in zip(got, expected) for a, b in zip(t, e))
    assert first_agree >= 2 and total_agree >= 10, (got, expected)


def test_decode_batches_above_max_bs_run_eagerly(tiny_model_dir: Callable[..., Path]) -> None:
    """--torch-compile-max-bs 0: every decode step takes the eager layers (prefill stays
    compiled), with the same tokens."""
    path = tiny_model_dir("llama")
    runner = compiled_runner(path, torch_compile_max_bs=0)
    tokens = greedy(runner, PROMPTS, 3)
    assert not runner.compiled_layers.active  # the last step was a decode
    assert tokens == greedy(make_runner(path), PROMPTS, 3)


def test_deterministic_mode_keeps_its_own_path(tiny_model_dir: Callable[..., Path]) -> None:
    """Deterministic mode ignores the flag: no compiled layers, its batch-invariant products
    stay in place (and so do its tokens)."""
    runner = make_runner(
        tiny_model_dir("llama"), enable_torch_compile=True, enable_deterministic_inference=True
    )
    assert runner.compiled_layers is None
    layer = runner.model.model.layers[0]
    assert "pre_attention" not in vars(layer) and "post_attention" not in vars(layer)


def test_server_args_flags() -> None:
    args = prepare_server_args(
        ["--model-path", "m", "--enable-torch-compile", "--torch-compile-max-bs", "8"]
    )
    assert args.enable_torch_compile and args.torch_compile_max_bs == 8
    with pytest.raises(ValueError, match="torch-compile-max-bs"):
        ServerArgs(model_path="m", torch_compile_max_bs=-1)


@pytest.mark.slow
def test_smollm2_compiled_tokens_equal_eager(smollm2_dir: Path) -> None:
    """The real model, float32: the compiled layers give eager's greedy tokens."""
    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(1000, 1040)), [9, 8, 7, 6]]
    got = greedy(compiled_runner(smollm2_dir), prompts, 12)
    assert got == greedy(make_runner(smollm2_dir), prompts, 12)

