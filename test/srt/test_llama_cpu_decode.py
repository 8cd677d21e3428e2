"""The flat CPU decode loop (models/llama_cpu_decode.py): bitwise the module path's logits and
K/V for every Llama-family variant (Qwen2's biases, Qwen3's q/k norms) in float32 and
bfloat16 at batch sizes on both sides of the small-batch kernel's row limit; on where the
model runner can use it, off where it cannot (the reason logged); and end to end through the
Engine, the same tokens and logprobs as with --disable-cpu-decode-loop."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from model_test_utils import RUNNER_SLOTS, BatchBuilder, make_runner

from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.models.llama_cpu_decode import LlamaCpuDecodeLoop

# 20 prompts of 3-22 tokens; decode steps over subsets of them (20 rows: past the small-batch
# kernel's 16, so the packed products serve; 1 and 5 rows: the small-batch kernel).
PROMPTS = [[(7 * i + 3 * j) % 500 + 3 for j in range(3 + i)] for i in range(20)]
STEPS = [list(range(20)), [4], list(range(20)), [0, 3, 8, 13, 19], [11], list(range(20))]


def _runner(path: Path, dtype: str, **kwargs: object) -> ModelRunner:
    runner = make_runner(path, dtype, **kwargs)
    if not getattr(runner.attn_backend, "uses_cpu_kernel", False):
        pytest.skip("the CPU decode-attention kernel is not built on this host")
    return runner


def _written_kv(runner: ModelRunner, loc: torch.Tensor) -> list[torch.Tensor]:
    pool = runner.token_to_kv_pool
    return [buf[loc].clone() for buf in pool.k_buffer + pool.v_buffer]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_loop_is_bitwise_the_module_path(
    tiny_model_dir: Callable[..., Path], arch: str, dtype: str
) -> None:
    """Each decode step through the loop, then the same batch again through the model's
    forward: the same logits and the same K/V in the pool, bit for bit."""
    overrides = {"attention_bias": True} if arch == "llama" else {}
    runner = _runner(tiny_model_dir(arch, **overrides), dtype)
    loop = runner.cpu_decode_loop
    assert loop is not None
    builder = BatchBuilder(
        runner.model.config, dtype=runner.dtype, num_slots=RUNNER_SLOTS - 1, max_reqs=len(PROMPTS)
    )
    rids = [f"r{i}" for i in range(len(PROMPTS))]
    prefill = builder.extend(list(zip(rids, PROMPTS)))
    assert not loop.applies(prefill)
    last = runner.forward(prefill).next_token_logits.argmax(-1).tolist()
    for which in STEPS:
        batch = builder.decode([(rids[i], last[i]) for i in which])
        looped = runner.forward(batch).next_token_logits
        assert loop.applies(batch)  # forward() set the paged decode metadata
        kv_looped = _written_kv(runner, batch.out_cache_loc)
        with torch.inference_mode():
            modules = runner.model(batch.input_ids, batch.positions, batch).next_token_logits
        assert torch.equal(looped, modules)
        assert all(map(torch.equal, kv_looped, _written_kv(runner, batch.out_cache_loc)))
        for i, token in zip(which, looped.argmax(-1).tolist()):
            last[i] = token


def test_loop_runs_for_decode_steps(
    tiny_model_dir: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runner's decode steps go through the loop and not through the decoder layers;
    prefills through the layers."""
    from sglang.srt.models.llama import LlamaDecoderLayer

    runner = _runner(tiny_model_dir("qwen3"), "float32")
    calls = {"layer": 0, "loop": 0}
    layer_forward, loop_forward = LlamaDecoderLayer.forward, LlamaCpuDecodeLoop.forward

    def counted_layer(self, *args):  # type: ignore[no-untyped-def]
        calls["layer"] += 1
        return layer_forward(self, *args)

    def counted_loop(self, *args):  # type: ignore[no-untyped-def]
        calls["loop"] += 1
        return loop_forward(self, *args)

    monkeypatch.setattr(LlamaDecoderLayer, "forward", counted_layer)
    monkeypatch.setattr(LlamaCpuDecodeLoop, "forward", counted_loop)
    builder = BatchBuilder(runner.model.config, num_slots=RUNNER_SLOTS - 1)
    runner.forward(builder.extend([("a", [5, 6, 7]), ("b", [9, 10])]))
    layers = runner.model.config.num_hidden_layers
    assert calls == {"layer": layers, "loop": 0}
    runner.forward(builder.decode([("a", 11), ("b", 12)]))
    assert calls == {"layer": layers, "loop": 1}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"disable_cpu_decode_loop": True},
        {"disable_cpu_fused_ops": True},
        {"disable_cpu_attention_kernel": True},
        {"enable_deterministic_inference": True},
        {"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ["q_proj"]},
    ],
    ids=["flag", "no-fused-ops", "no-attention-kernel", "deterministic", "lora"],
)
def test_runner_leaves_the_loop_off(tiny_model_dir: Callable[..., Path], kwargs: dict) -> None:
    """Off (the module path serves decode) where it would not compute the same thing or its
    kernels are not there; on by default (test above)."""
    runner = make_runner(tiny_model_dir("llama"), **kwargs)
    assert runner.cpu_decode_loop is None


def test_unsupported_reason(tiny_model_dir: Callable[..., Path]) -> None:
    """A forward hook anywhere in the model (what LoRA adds), a module left on the torch ops,
    or another pool dtype: not served, with the reason named."""
    runner = _runner(tiny_model_dir("llama"), "float32")
    model, pool = runner.model, runner.token_to_kv_pool
    assert LlamaCpuDecodeLoop.unsupported_reason(model, pool) is None
    o_proj = model.model.layers[1].self_attn.o_proj
    handle = o_proj.register_forward_hook(lambda module, args, out: out)
    try:
        assert "model.layers.1.self_attn.o_proj has forward hooks" in str(
            LlamaCpuDecodeLoop.unsupported_reason(model, pool)
        )
        with pytest.raises(ValueError, match="forward hooks"):
            LlamaCpuDecodeLoop(model, pool)
    finally:
        handle.remove()
    norm = model.model.layers[0].post_attention_layernorm
    norm.use_cpu_fused_ops = False
    try:
        assert "fused CPU kernels" in str(LlamaCpuDecodeLoop.unsupported_reason(model, pool))
    finally:
        norm.use_cpu_fused_ops = True
    pool.dtype = torch.bfloat16
    try:
        assert "KV pool" in str(LlamaCpuDecodeLoop.unsupported_reason(model, pool))
    finally:
        pool.dtype = torch.float32
    assert LlamaCpuDecodeLoop.unsupported_reason(torch.nn.Linear(2, 2), pool) is not None


def test_global_hook_sends_steps_back_to_the_modules(tiny_model_dir: Callable[..., Path]) -> None:
    """A module hook registered for every module after the loop was built: decode steps take
    the module path, which runs it."""
    runner = _runner(tiny_model_dir("llama"), "float32")
    loop = runner.cpu_decode_loop
    assert loop is not None
    builder = BatchBuilder(runner.model.config, num_slots=RUNNER_SLOTS - 1)
    runner.forward(builder.extend([("a", [5, 6, 7])]))
    batch = builder.decode([("a", 8)])
    seen: list[str] = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, out: seen.append(type(module).__name__)
    )
    try:
        runner.forward(batch)
        assert not loop.applies(batch)
    finally:
        handle.remove()
    assert "LlamaDecoderLayer" in seen
    assert loop.applies(batch)


def test_engine_same_tokens_and_logprobs_as_the_modules(
    tiny_model_dir: Callable[..., Path],
) -> None:
    """Greedy generation through the Engine, a lone request and a batch: the same tokens and
    logprobs with the loop as with --disable-cpu-decode-loop. (Not bit for bit here: two
    engine processes' prefills already differ in the last bits, oneDNN's products depending
    on the operands' alignment; the test above compares the two paths on the same runner.)"""
    import sglang as sgl

    prompts = [[5, 17, 3, 99, 250, 8, 41], list(range(30, 90)), [7] * 3]
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    results = []
    for disabled in (False, True):
        with sgl.Engine(
            model_path=str(tiny_model_dir("qwen3")),
            random_seed=0,
            disable_cpu_decode_loop=disabled,
        ) as engine:
            outs = engine.generate(
                input_ids=[prompts[0]], sampling_params=params, return_logprob=True
            )
            outs += engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        results.append(outs)
    for looped, modules in zip(*results):
        assert looped["output_ids"] == modules["output_ids"]
        got = [lp for lp, _, _ in looped["meta_info"]["output_token_logprobs"]]
        ref = [lp for lp, _, _ in modules["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(ref, abs=1e-5)
