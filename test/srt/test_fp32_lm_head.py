"""--enable-fp32-lm-head: a bfloat16 model's logits computed in float32 (upstream's flag).

The head's float32 copy must follow every change of the weights it was made from (weight
updates, release/resume), since a stale copy would silently sample from old weights.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from model_test_utils import BatchBuilder, make_runner, set_input_logprobs
from safetensors.torch import load_file, save_file

import sglang as sgl
from sglang.srt.layers.logits_processor import Float32Head

PROMPT = [5, 17, 300, 42, 9, 128, 77]
LM_HEAD = "lm_head.weight"


def _is_bf16(values: torch.Tensor) -> bool:
    """Whether every value is exactly a bfloat16 number."""
    return bool(torch.equal(values, values.bfloat16().float()))


@pytest.mark.parametrize("cache", [True, False])
def test_float32_head_follows_its_weight(cache: bool) -> None:
    head = Float32Head(cache)
    weight = torch.randn(8, 4).bfloat16()
    first = head.weight(weight)
    assert first.dtype == torch.float32 and torch.equal(first, weight.float())
    assert (head.weight(weight) is first) == cache  # cached: the same copy while unchanged
    assert head.nbytes == (8 * 4 * 4 if cache else 0)
    with torch.no_grad():
        weight.copy_(torch.randn(8, 4))  # an in-place update (bumps the version)
    assert torch.equal(head.weight(weight), weight.float())
    if cache:
        # The copy changes in place, so that what is keyed on its (address, version), as the
        # CPU's packed head is, sees the change: a new copy at the old one's address would
        # have the old version 0.
        key = (first.data_ptr(), first._version)
        with torch.no_grad():
            weight.copy_(torch.randn(8, 4))
        again = head.weight(weight)
        assert again is first and (again.data_ptr(), again._version) != key
    weight.data = torch.randn(8, 4).bfloat16()  # a new storage (release and resume)
    with torch.inference_mode():  # as in a forward pass
        copy = head.weight(weight)
    assert torch.equal(copy, weight.float())
    # A copy made in a forward pass is no inference tensor (the CPU packs only weights with
    # a version counter: otherwise the product would change with when the copy was made).
    assert not copy.is_inference() or not cache
    head.clear()
    assert head.nbytes == 0
    fp32 = torch.randn(8, 4)
    assert head.weight(fp32) is fp32
    with torch.inference_mode():
        frozen = torch.randn(8, 4).bfloat16()  # no version counter: widened at every call
    assert torch.equal(head.weight(frozen), frozen.float())


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("prepack", [True, False])
def test_runner_logits_are_not_rounded_to_bfloat16(
    tiny_model_dir: Callable[..., Path], tied: bool, prepack: bool
) -> None:
    """Prefill, decode and prompt-logprob logits of a bfloat16 model: bfloat16 numbers
    without the flag, the float32 product of the same hidden states and weights with it."""
    path = tiny_model_dir("llama", tie_word_embeddings=tied)
    extra = {} if prepack else {"disable_cpu_weight_prepack": True}
    plain = make_runner(path, "bfloat16", **extra)
    wide = make_runner(path, "bfloat16", enable_fp32_lm_head=True, **extra)
    assert plain.fp32_head is None and wide.fp32_head is not None
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # (hidden rows, head weight) per call
    wide.model.logits_processor.register_forward_pre_hook(
        lambda module, args: seen.append((args[0], args[1])))
    outputs = {}
    for name, runner in (("plain", plain), ("wide", wide)):
        builder = BatchBuilder(runner.model.config, dtype=torch.bfloat16, num_slots=255)
        batch = builder.extend([("a", PROMPT)])
        set_input_logprobs(batch, list(range(len(PROMPT) - 1)), PROMPT[1:], top_k=3)
        prefill = runner.forward(batch)
        token = int(prefill.next_token_logits.argmax())
        decode = runner.forward(builder.decode([("a", token)]))
        outputs[name] = (prefill, decode)
    for out in outputs["plain"]:
        assert _is_bf16(out.next_token_logits)
    for out in outputs["wide"]:
        assert not _is_bf16(out.next_token_logits)
    # The decode step's logits are the float32 product of its hidden state and the head.
    hidden, weight = seen[-1]
    assert hidden.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
    expected = hidden.float() @ weight.float().T
    torch.testing.assert_close(outputs["wide"][1].next_token_logits, expected,
                               rtol=1e-5, atol=1e-5)
    # Prompt logprobs come from the float32 head too: within float32 rounding of the
    # bfloat16 ones, not equal to them.
    plain_lp = outputs["plain"][0].input_token_logprobs
    wide_lp = outputs["wide"][0].input_token_logprobs
    assert wide_lp is not None and plain_lp is not None
    assert not torch.equal(wide_lp, plain_lp)
    torch.testing.assert_close(wide_lp, plain_lp, rtol=0, atol=0.05)
    # A float32 model is left as it is.
    assert make_runner(path, "float32", enable_fp32_lm_head=True).fp32_head is None


def _generate(engine: sgl.Engine) -> dict:
    return engine.generate(
        input_ids=PROMPT,
        sampling_params={"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
        return_logprob=True, logprob_start_len=0, return_entropy=True,
    )


def _values(out: dict) -> tuple[list[int], list[float], list[float], list[float]]:
    meta = out["meta_info"]
    return (
        out["output_ids"],
        [lp for lp, _, _ in meta["output_token_logprobs"]],
        [lp for lp, _, _ in meta["input_token_logprobs"][1:]],
        meta["output_token_entropy"],
    )


def test_weight_updates_reach_the_float32_head(
    tiny_model_dir: Callable[..., Path], tmp_path: Path
) -> None:
    """A new LM head pushed as tensors, or the weights released and loaded again from disk,
    give what a fresh engine on those weights gives: the float32 copy never goes stale."""
    a = tiny_model_dir("llama")
    b = tmp_path / "B"
    shutil.copytree(a, b)
    tensors = load_file(a / "model.safetensors")
    generator = torch.Generator().manual_seed(3)
    new_head = torch.randn(tensors[LM_HEAD].shape, generator=generator) * 0.2
    save_file({**tensors, LM_HEAD: new_head}, b / "model.safetensors", metadata={"format": "pt"})
    kwargs = {"dtype": "bfloat16", "enable_fp32_lm_head": True, "random_seed": 0,
              "skip_server_warmup": True}

    with sgl.Engine(model_path=str(b), **kwargs) as fresh:
        expected = _values(_generate(fresh))
    with sgl.Engine(model_path=str(b), **{**kwargs, "enable_fp32_lm_head": False}) as rounded:
        assert _values(_generate(rounded))[1] != expected[1]  # the flag changes the logprobs
    with sgl.Engine(model_path=str(a), **kwargs) as engine:
        before = _values(_generate(engine))
        assert before != expected
        ok, message = engine.update_weights_from_tensor([(LM_HEAD, new_head)])
        assert ok, message
        assert _values(_generate(engine)) == expected
        # Released and reloaded from A's checkpoint: A's outputs again.
        assert engine.release_memory_occupation()["success"]
        assert engine.resume_memory_occupation()["success"]
        ok, message, _ = engine.update_weights_from_disk(str(a))
        assert ok, message
        assert _values(_generate(engine)) == before
