"""Shared fixtures: tiny random-weight checkpoints (with a real tokenizer) written offline.

``tiny_model_dir(arch)`` returns a directory that both transformers and sglang load: a random
Llama / Qwen2 / Qwen3 (or Mixtral / Qwen2-MoE / Qwen3-MoE) saved with ``save_pretrained`` next
to a small byte-level BPE tokenizer trained here on a fixed corpus (no hub access).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's CPU interpreter. It must be switched on before
# anything imports triton: triton.language builds its own helpers at import time.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpret_device_calls_without_repatching() -> None:
    """Triton's interpreter patches the triton.language modules a kernel sees before it runs a
    launch's programs, and restores them after. It patches them again, never restoring, at
    every call of a ``@triton.jit`` device function inside (~1.6 ms each: thousands per
    sampling step). Patch each module once per launch instead: same results, faster tests."""
    import triton.language as tl
    from triton.runtime import interpreter

    function = getattr(interpreter, "InterpretedFunction", None)
    scope = getattr(interpreter, "_LangPatchScope", None)
    if function is None or scope is None or not hasattr(interpreter, "_patch_lang"):
        return  # another Triton: leave its interpreter as it is
    patched: set[int] = set()  # modules patched since the launch began
    patch_call, restore = function.__call__, scope.restore

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        langs = {id(v) for v in self.fn.__globals__.values() if v is tl or v is tl.core}
        if langs <= patched:
            try:
                return self.rewrite()(*args, **kwargs)
            except Exception as e:
                raise interpreter.InterpreterError(repr(e)) from e
        patched.update(langs)
        return patch_call(self, *args, **kwargs)

    def restore_all(self: Any) -> None:  # a launch ends: its patches are undone
        patched.clear()
        restore(self)

    function.__call__ = call
    scope.restore = restore_all


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpret_device_calls_without_repatching()

REPO_ROOT = Path(__file__).resolve().parents[2]
SMOLLM2_DIR = REPO_ROOT / "models" / "SmolLM2-135M-Instruct"

TINY_VOCAB = 512
# Room for the long requests the pause tests interrupt (engine_test_utils.MAX_NEW).
TINY_CONTEXT = 4096
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Reinforcement learning trains a policy from rewards; rollouts are paused to sync weights.",
    "Once upon a time there was a tiny language model that liked to count: 1 2 3 4 5 6 7 8 9 10.",
    'def add(a, b):\n    return a + b\n# Python code, JSON {"key": [1, 2, 3]} and ünïcödé 你好.',
] * 20


def _write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def write_tiny_model(path: Path, arch: str = "llama", **overrides: object) -> Path:
    """Save a tiny random ``arch`` model + tokenizer at ``path``; returns ``path``."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        LlamaConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    path.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(path)
    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=TINY_CONTEXT,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
    )
    common.update(overrides)
    config_cls = {
        "llama": LlamaConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "mixtral": MixtralConfig,
        "qwen2_moe": Qwen2MoeConfig,
        "qwen3_moe": Qwen3MoeConfig,
    }[arch]
    if arch in ("qwen3", "qwen3_moe"):
        common.setdefault("head_dim", 16)
    if arch in ("qwen2_moe", "qwen3_moe"):
        # Experts 48 wide, 3 of 8 per token; Qwen2-MoE's shared expert 96 wide.
        moe = dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48)
        moe.update(shared_expert_intermediate_size=96, norm_topk_prob=arch == "qwen3_moe")
        for key, value in moe.items():
            common.setdefault(key, value)
    if arch == "mixtral":
        common.setdefault("num_local_experts", 4)
    config = config_cls(**common)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: ``tiny_model_dir("qwen3")`` -> a cached directory for that architecture."""
    cache: dict[tuple, Path] = {}

    def make(arch: str = "llama", **overrides: object) -> Path:
        key = (arch, repr(sorted(overrides.items())))  # repr: list values are unhashable
        if key not in cache:
            cache[key] = write_tiny_model(
                tmp_path_factory.mktemp(f"tiny-{arch}"), arch, **overrides
            )
        return cache[key]

    return make


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Callable[..., Path]) -> Iterator[Any]:
    """An ``sglang.Engine`` on the tiny random Llama (``random_seed=0``), one per test module.
    A module that needs other engine arguments defines its own ``engine`` fixture instead."""
    from engine_test_utils import CUDA_POOL

    import sglang as sgl  # here, not at the top: TRITON_INTERPRET must be set first

    with sgl.Engine(model_path=str(tiny_model_dir("llama")), random_seed=0, **CUDA_POOL) as eng:
        yield eng


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct, prepared by `make model` (skip when it is absent)."""
    if not (SMOLLM2_DIR / "config.json").exists():
        pytest.skip("SmolLM2 not prepared; run `make model`")
    return SMOLLM2_DIR


@pytest.fixture
def spy_rows(monkeypatch: pytest.MonkeyPatch) -> Callable[[Any, str], list[int]]:
    """``spy_rows(module, name)`` -> a list that collects the row count of the first argument
    of every later call of ``module.name`` (which still runs)."""

    def spy(module: Any, name: str) -> list[int]:
        calls: list[int] = []
        real = getattr(module, name)

        def counting(*args: Any, **kwargs: Any) -> Any:
            calls.append(args[0].shape[0])
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, counting)
        return calls

    return spy
