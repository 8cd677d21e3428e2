"""Reading and validating a PEFT LoRA checkpoint (``adapter_config.json`` +
``adapter_model.safetensors``), before anything of the running server changes.

PEFT stores, per adapted projection of each decoder layer::

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   [r, in_features]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight   [out_features, r]

and the merged weight is ``W + scaling * B @ A`` with ``scaling = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``). :class:`LoRAAdapter` keeps A and B per
(layer, projection), B already multiplied by ``scaling``, on the host.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

# PEFT's projection names -> (our fused module, shard index inside it).
PROJ_TO_MODULE: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
ALL_TARGET_MODULES = tuple(PROJ_TO_MODULE)
_WEIGHT_RE = re.compile(
    r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)


class LoRAError(ValueError):
    """An adapter that cannot be served (the message says why); nothing was changed."""


@dataclass
class LoRAAdapter:
    """One adapter's weights on the host: ``weights[(layer, proj)] = (A, scaled B)``."""

    name: str
    path: str
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)


def normalize_target_modules(value: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """``"all"`` or a list of PEFT projection names -> the sorted tuple of names."""
    if value is None:
        return ALL_TARGET_MODULES
    names = [value] if isinstance(value, str) else list(value)
    if "all" in names or "all-linear" in names:
        return ALL_TARGET_MODULES
    unknown = sorted(set(names) - set(ALL_TARGET_MODULES))
    if unknown:
        raise LoRAError(
            f"unsupported LoRA target module(s) {unknown}; supported: "
            f"{', '.join(ALL_TARGET_MODULES)} or 'all'"
        )
    return tuple(n for n in ALL_TARGET_MODULES if n in names)


def read_adapter_config(path: Path) -> dict:
    config_file = path / "adapter_config.json"
    if not path.is_dir() or not config_file.is_file():
        raise LoRAError(f"{str(path)!r} is not a PEFT LoRA checkpoint (no adapter_config.json)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAError(f"cannot read {config_file}: {e}") from e
    return check_adapter_config(config, str(path))


def check_adapter_config(config: object, path: str) -> dict:
    """LoRAError unless ``config`` (adapter_config.json's content) describes a LoRA adapter
    this server can apply; returns it."""
    if not isinstance(config, dict):
        raise LoRAError(f"{path!r}: the adapter config is not a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAError(f"{path!r} is a {peft_type} adapter; only LoRA is supported")
    for key, why in (
        ("rank_pattern", "per-module ranks"),
        ("alpha_pattern", "per-module alphas"),
        ("modules_to_save", "fully trained extra modules"),
    ):
        if config.get(key):
            raise LoRAError(f"{path!r} uses {key} ({why}), which is not supported")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"{path!r} trains biases (bias={config['bias']!r}); not supported")
    if config.get("use_dora"):
        raise LoRAError(f"{path!r} is a DoRA adapter; not supported")
    return config


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    st = path / "adapter_model.safetensors"
    if st.is_file():
        from safetensors.torch import load_file

        return load_file(str(st), device="cpu")
    binary = path / "adapter_model.bin"
    if binary.is_file():
        loaded = torch.load(str(binary), map_location="cpu", weights_only=True)
        if isinstance(loaded, dict):
            return loaded
    raise LoRAError(f"{str(path)!r} has no adapter_model.safetensors (or adapter_model.bin)")


def load_adapter(name: str, path: str, max_rank: int, allowed: tuple[str, ...]) -> LoRAAdapter:
    """Read and check the adapter at ``path`` (shapes against the base come later, in the
    pool's :meth:`check`). Raises :class:`LoRAError`."""
    root = Path(path)
    config = read_adapter_config(root)
    return build_adapter(name, path, config, _read_tensors(root), max_rank, allowed)


def build_adapter(
    name: str,
    path: str,
    config: dict,
    tensors: dict[str, torch.Tensor],
    max_rank: int,
    allowed: tuple[str, ...],
) -> LoRAAdapter:
    """The adapter of a checked ``config`` and PEFT-named ``tensors`` (from a checkpoint, or
    pushed in-process); ``path`` only labels it. Raises :class:`LoRAError`."""
    rank = config.get("r")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(rank, int) or rank <= 0:
        raise LoRAError(f"{path!r}: adapter_config.json has no positive integer 'r'")
    if rank > max_rank:
        raise LoRAError(
            f"adapter {name!r} has rank {rank} > --max-lora-rank {max_rank}; restart with a "
            "larger --max-lora-rank"
        )
    if not isinstance(alpha, (int, float)):
        raise LoRAError(f"{path!r}: adapter_config.json has a non-numeric 'lora_alpha'")
    scaling = float(alpha) / (math.sqrt(rank) if config.get("use_rslora") else rank)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise LoRAError(f"adapter {name!r}: {key!r} is not a tensor")
        m = _WEIGHT_RE.search(key)
        if m is None:
            raise LoRAError(f"adapter {name!r}: unsupported tensor {key!r} (not a decoder-layer "
                            "projection's lora_A / lora_B)")
        layer, proj, which = int(m.group(1)), m.group(2), m.group(3)
        if proj not in PROJ_TO_MODULE:
            raise LoRAError(f"adapter {name!r}: unsupported target module {proj!r}")
        if proj not in allowed:
            raise LoRAError(
                f"adapter {name!r} adapts {proj!r}, outside --lora-target-modules "
                f"({', '.join(allowed)})"
            )
        pairs.setdefault((layer, proj), {})[which] = tensor
    if not pairs:
        raise LoRAError(f"adapter {name!r} at {path!r} holds no LoRA weights")
    weights = {}
    for (layer, proj), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"adapter {name!r}: layer {layer} {proj} lacks lora_A or lora_B")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise LoRAError(
                f"adapter {name!r}: layer {layer} {proj} has A {tuple(a.shape)} and B "
                f"{tuple(b.shape)}, not of rank r={rank}"
            )
        weights[(layer, proj)] = (a.float(), b.float() * scaling)
    targets = tuple(sorted({proj for _, proj in weights}))
    return LoRAAdapter(name, path, rank, scaling, targets, weights)
