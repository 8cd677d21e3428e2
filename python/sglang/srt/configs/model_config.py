"""ModelConfig: what the engine needs to know about a checkpoint, resolved once at startup.

A model path is an HF directory (config.json + weights) or a llama-arch ``.gguf`` file, whose
HF config is rebuilt from the GGUF metadata. Whether the architecture is supported is decided
by the model registry, not here.
"""

from __future__ import annotations

import glob
import logging
import os
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

from sglang.srt.hf_transformers_utils import (
    as_token_id_set,
    get_generation_eos_token_ids,
    is_gguf_path,
)

logger = logging.getLogger(__name__)

_EXPLICIT_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}
# Config keys that name the longest sequence a model was trained for, most specific first.
_CONTEXT_LEN_KEYS = (
    "max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length",
)
_DEFAULT_CONTEXT_LEN = 2048


def _locate_gguf(model_path: str, load_format: str) -> str | None:
    """The GGUF file a model path designates, or None for an HF directory.

    A directory counts as GGUF when asked (load_format="gguf") or when it has no config.json
    but exactly one ``.gguf`` file.
    """
    if os.path.isfile(model_path):
        if not is_gguf_path(model_path):
            raise ValueError(
                f"model path {model_path!r} is a file but not a .gguf; pass an HF model "
                "directory (with config.json) or a .gguf file"
            )
        return model_path
    has_config = os.path.isfile(os.path.join(model_path, "config.json"))
    if has_config and load_format != "gguf":
        return None
    candidates = sorted(glob.glob(os.path.join(model_path, "*.gguf")))
    if len(candidates) == 1:
        return candidates[0]
    if load_format == "gguf":
        raise FileNotFoundError(
            f"load_format='gguf' needs exactly one .gguf file in {model_path!r}, "
            f"found {len(candidates)}"
        )
    raise FileNotFoundError(f"no config.json in {model_path!r}: not an HF model directory")


def resolve_dtype(dtype: str, hf_config: PretrainedConfig, device: str) -> torch.dtype:
    """Turn the ``--dtype`` option into a torch dtype.

    ``auto``: float32 on CPU (fast and exact there); elsewhere the checkpoint's dtype, with
    float32 (or none recorded) served as bfloat16. Explicit names are honoured as given.
    """
    if dtype in _EXPLICIT_DTYPES:
        return _EXPLICIT_DTYPES[dtype]
    if dtype != "auto":
        raise ValueError(f"unknown dtype {dtype!r}; choose auto or one of {list(_EXPLICIT_DTYPES)}")
    if not device.startswith("cuda"):
        return torch.float32
    config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = _EXPLICIT_DTYPES.get(config_dtype)
    if config_dtype in (torch.float16, torch.bfloat16):
        return config_dtype
    return torch.bfloat16


def _rope_scaling(config: PretrainedConfig) -> dict[str, Any] | None:
    """The rope scaling parameters of a config (transformers 5's rope_parameters or the older
    rope_scaling), or None when the model uses plain rotary embeddings."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return None
    if "rope_type" not in params and "type" not in params:
        # Per-layer-type parameters ({"full_attention": {...}, ...}): the largest factor rules.
        nested = [p for p in params.values() if isinstance(p, dict) and p.get("factor")]
        params = max(nested, key=lambda p: p["factor"], default=None)
        if params is None:
            return None
    rope_type = params.get("rope_type", params.get("type"))
    if rope_type in (None, "default") or not params.get("factor"):
        return None
    return params


def resolve_context_len(config: PretrainedConfig, context_length: int | None) -> int:
    """The maximum sequence length to serve.

    The user's value wins when it is within the model's limit. Beyond it, it is accepted (with
    a warning) only up to what the config's rope scaling extends the trained length to;
    otherwise ``ValueError``.
    """
    model_len = next(
        (int(getattr(config, k)) for k in _CONTEXT_LEN_KEYS if getattr(config, k, None)), None
    )
    if model_len is None:
        logger.warning("config names no context length; assuming %d", _DEFAULT_CONTEXT_LEN)
        model_len = _DEFAULT_CONTEXT_LEN
    if context_length is None or context_length <= model_len:
        return context_length or model_len
    scaling = _rope_scaling(config)
    if scaling is not None:
        trained_len = int(scaling.get("original_max_position_embeddings") or model_len)
        scaled_len = max(model_len, int(trained_len * float(scaling["factor"])))
        if context_length <= scaled_len:
            logger.warning(
                "context length %d exceeds the model's %d; accepted because rope scaling "
                "extends it to %d", context_length, model_len, scaled_len,
            )
            return context_length
    raise ValueError(
        f"context length {context_length} exceeds the model's maximum of {model_len} "
        "(max_position_embeddings) and its rope scaling does not allow it"
    )


# Legacy RoPE fields that transformers 5 keeps inside ``rope_parameters``, which is what
# models read when it is there (layers/rotary_embedding.py).
_ROPE_PARAMETER_KEYS = ("rope_theta", "partial_rotary_factor")


def _apply_overrides(config: PretrainedConfig, overrides: dict[str, Any]) -> None:
    """Replace ``config``'s fields by ``overrides`` (in place). A ``rope_theta`` or
    ``partial_rotary_factor`` is also written into a ``rope_parameters`` dict, where
    ``config.update`` alone would leave the old value that the model reads."""
    config.update(overrides)
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict):
        for key in _ROPE_PARAMETER_KEYS:
            if key in overrides:
                params[key] = overrides[key]


class ModelConfig:
    """The resolved description of a model: HF config, shapes, dtype, context length, EOS ids.

    Raises ``FileNotFoundError`` when the path or its config.json is missing and ``ValueError``
    for a path that is neither a directory nor a ``.gguf`` file, an unknown dtype or a context
    length the model cannot serve.
    """

    def __init__(
        self,
        model_path: str,
        context_length: int | None = None,
        dtype: str = "auto",
        trust_remote_code: bool = False,
        device: str = "cpu",
        load_format: str = "auto",
        model_override_args: dict[str, Any] | None = None,
    ) -> None:
        self.model_path = os.path.expanduser(model_path)
        # --json-model-override-args: config.json fields replaced before anything reads them.
        self.model_override_args: dict[str, Any] = dict(model_override_args or {})
        self.trust_remote_code = trust_remote_code
        self.device = device
        self.load_format = load_format
        if not os.path.exists(self.model_path):
            raise FileNotFoundError(f"model path {model_path!r} does not exist")
        self.gguf_file: str | None = _locate_gguf(self.model_path, load_format)
        self.is_gguf = self.gguf_file is not None
        self.hf_config: PretrainedConfig = self._load_hf_config()
        checkpoint_layers = self.hf_config.get_text_config().num_hidden_layers
        if self.model_override_args:
            _apply_overrides(self.hf_config, self.model_override_args)
        text_config = self.hf_config.get_text_config()

        self.architectures: list[str] = list(getattr(self.hf_config, "architectures", None) or [])
        self.vocab_size: int = text_config.vocab_size
        self.hidden_size: int = text_config.hidden_size
        self.num_attention_heads: int = text_config.num_attention_heads
        self.num_key_value_heads: int = (
            getattr(text_config, "num_key_value_heads", None) or self.num_attention_heads
        )
        self.head_dim: int = (
            getattr(text_config, "head_dim", None) or self.hidden_size // self.num_attention_heads
        )
        self.num_hidden_layers: int = text_config.num_hidden_layers
        # Checkpoint tensors of layers from this index on are skipped at load: the override
        # asked for fewer layers than the checkpoint has (None: every tensor is loaded).
        self.skip_layers_from: int | None = (
            self.num_hidden_layers if self.num_hidden_layers < checkpoint_layers else None
        )
        self.dtype: torch.dtype = resolve_dtype(dtype, self.hf_config, device)
        self.context_len: int = resolve_context_len(text_config, context_length)
        self.eos_token_ids: set[int] = as_token_id_set(getattr(text_config, "eos_token_id", None))
        if not self.is_gguf:
            self.eos_token_ids |= get_generation_eos_token_ids(self.model_path)

    def _load_hf_config(self) -> PretrainedConfig:
        if self.gguf_file is not None:
            from sglang.srt.model_loader.gguf_loader import gguf_to_hf_config

            return gguf_to_hf_config(self.gguf_file)
        return AutoConfig.from_pretrained(
            self.model_path, trust_remote_code=self.trust_remote_code
        )

    def get_num_kv_heads(self, tp_size: int) -> int:
        """KV heads held by one tensor-parallel rank (replicated when there are fewer than
        ranks)."""
        return max(1, self.num_key_value_heads // tp_size)

    def __repr__(self) -> str:
        return (
            f"ModelConfig(path={self.model_path!r}, arch={self.architectures}, "
            f"dtype={self.dtype}, context_len={self.context_len}, gguf={self.is_gguf})"
        )
