"""Read llama-architecture GGUF checkpoints as HF-named float tensors and an HF config.

llama.cpp's converter changes three things that we undo here:

* names: ``blk.N.attn_q.weight`` instead of ``model.layers.N.self_attn.q_proj.weight``;
* shape order: GGUF lists dimensions fastest-first (``[cols, rows]``), the reverse of torch;
* Q/K rows: for its rotary kernel it reorders the rows of each head from HF's "halves" layout
  ``[x0..x(d/2-1) | y0..y(d/2-1)]`` to interleaved pairs ``[x0 y0 x1 y1 ...]``.

Quantized tensors (Q4_1, Q8_0, ...) are dequantized with ``gguf.quants.dequantize`` to float32.

Tensor-parallel ranks read their shard lazily (:class:`GGUFWeight`): quantization blocks run
along a row, so a range of rows (column-parallel layers, the vocabulary) is dequantized alone,
and so is a range of columns (row-parallel layers) whose ends fall on block boundaries (32
values for the common types; every split of SmolLM2 does). A column range that cuts a block
is read by dequantizing the whole tensor and narrowing. Q/K rows are un-permuted per head,
which a row range of whole heads keeps intact (a range cutting a head dequantizes it all).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize
from tqdm import tqdm
from transformers import GenerationConfig, LlamaConfig

from sglang.srt.layers.linear import LazyWeight

logger = logging.getLogger(__name__)

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)

# Tokenizer arrays are large; the config never needs their contents.
_SKIPPED_METADATA = frozenset(
    {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
     "tokenizer.ggml.scores"}
)
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# llama3's rope_freqs holds per-frequency scale factors that HF derives from the config.
_IGNORED_TENSORS = frozenset({"rope_freqs.weight"})


def read_gguf_metadata(reader: GGUFReader) -> dict[str, Any]:
    """The scalar and small-array metadata of a GGUF file (tokenizer vocab arrays excluded)."""
    metadata: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name in _SKIPPED_METADATA:
            continue
        metadata[name] = field.contents()
    return metadata


def gguf_tensor_name_to_hf(name: str) -> str | None:
    """Map a llama-arch GGUF tensor name to its HF name; None for tensors that HF derives.

    Raises ``ValueError`` for a name this mapping does not know (better than silently
    dropping a weight).
    """
    if name in _IGNORED_TENSORS:
        return None
    parts = name.split(".")
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise ValueError(f"unknown GGUF tensor {name!r} for the llama architecture")


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: per head, interleaved pairs -> HF halves.

    ``weight`` is ``[num_heads * head_dim, ...]`` in GGUF row order; within a head, GGUF row
    ``2*j + i`` holds HF row ``i*head_dim/2 + j`` (i in {0, 1}). Returns a new tensor.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    rest = weight.shape[1:]
    return weight.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def permute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The permutation llama.cpp's converter applies to HF Q/K rows (inverse of the above)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    rest = weight.shape[1:]
    return weight.reshape(num_heads, 2, half, *rest).transpose(1, 2).reshape(rows, *rest)


def _open(path: str) -> GGUFReader:
    """A reader for ``path``, shared while the file is unchanged (parsing the metadata of a
    real model takes seconds; ModelConfig and the weight loader both need it)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    stat = os.stat(path)
    return _open_cached(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, mtime_ns: int, size: int) -> GGUFReader:
    reader = GGUFReader(path)
    arch_field = reader.fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else None
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)})"
        )
    return reader


def _torch_shape(tensor: Any) -> tuple[int, ...]:
    # GGUF stores dimensions fastest-varying first; torch wants the slowest first.
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def _f32_to_float(value: float) -> float:
    # GGUF stores float32: 1e-5 reads back as 9.99999974e-06. The shortest decimal that rounds
    # to the same float32 is what the original config said.
    return float(str(np.float32(value)))


def _config_from_reader(reader: GGUFReader) -> LlamaConfig:
    meta = read_gguf_metadata(reader)
    arch = meta["general.architecture"]
    tensors = {t.name: t for t in reader.tensors}

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    hidden_size = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    vocab_size = key("vocab_size")
    if vocab_size is None:
        vocab_size = _torch_shape(tensors["token_embd.weight"])[0]
    rope_parameters: dict[str, Any] = {
        "rope_type": "default", "rope_theta": _f32_to_float(key("rope.freq_base", 10000.0)),
    }
    scaling_type = key("rope.scaling.type")
    if scaling_type not in (None, "none"):
        rope_parameters.update(rope_type=scaling_type, factor=float(key("rope.scaling.factor")))
        if key("rope.scaling.original_context_length") is not None:
            rope_parameters["original_max_position_embeddings"] = int(
                key("rope.scaling.original_context_length")
            )
    if "rope_freqs.weight" in tensors:
        logger.warning("GGUF has rope_freqs (llama3 rope scaling); it is ignored")
    config = LlamaConfig(
        vocab_size=int(vocab_size),
        hidden_size=hidden_size,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=int(key("attention.key_length", hidden_size // num_heads)),
        max_position_embeddings=int(key("context_length", 2048)),
        rms_norm_eps=_f32_to_float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_parameters=rope_parameters,
        # llama.cpp drops output.weight when the LM head shares the embedding matrix.
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        architectures=["LlamaForCausalLM"],
    )
    config.dtype = torch.float32  # dequantized weights are float32
    return config


def gguf_to_hf_config(path: str) -> LlamaConfig:
    """Build the HF ``LlamaConfig`` that matches a llama-arch GGUF file's metadata.

    Raises ``FileNotFoundError`` for a missing file, ``ValueError`` for another architecture.
    """
    return _config_from_reader(_open(path))


def _to_torch(array: np.ndarray) -> torch.Tensor:
    if not array.flags.writeable:  # memory-mapped F32/F16 data: torch wants a writable copy
        array = np.array(array)
    return torch.from_numpy(array).to(torch.float32)


class GGUFWeight(LazyWeight):
    """One GGUF tensor in HF shape and row order, dequantized on demand (float32, then cast
    to ``dtype``). ``num_heads``: the Q/K head count whose rows llama.cpp permuted, else None.
    """

    def __init__(self, tensor: Any, num_heads: int | None, dtype: torch.dtype | None) -> None:
        self._tensor = tensor
        self._num_heads = num_heads
        self._dtype = dtype
        self.shape = torch.Size(_torch_shape(tensor))

    def _finish(self, weight: torch.Tensor) -> torch.Tensor:
        return weight if self._dtype is None else weight.to(self._dtype)

    def _dequantize(self, data: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
        return _to_torch(dequantize(data, self._tensor.tensor_type).reshape(shape))

    def _read_all(self) -> torch.Tensor:
        weight = self._dequantize(self._tensor.data, tuple(self.shape))
        if self._num_heads is not None:
            weight = unpermute_rotary_rows(weight, self._num_heads)
        return weight

    def materialize(self) -> torch.Tensor:
        return self._finish(self._read_all())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        part = self._read_rows(start, length) if dim == 0 else None
        if dim == 1 and len(self.shape) == 2 and self._num_heads is None:
            part = self._read_columns(start, length)
        if part is None:  # no shortcut for this range: dequantize all, then narrow
            part = self._read_all().narrow(dim, start, length)
        return self._finish(part)

    def _read_rows(self, start: int, length: int) -> torch.Tensor | None:
        rest = tuple(self.shape[1:])
        if self._tensor.data.shape[0] != self.shape[0]:  # not stored row by row
            return None
        if self._num_heads is None:
            return self._dequantize(self._tensor.data[start : start + length], (length, *rest))
        head_rows = self.shape[0] // self._num_heads
        if start % head_rows or length % head_rows:
            return None
        data = self._tensor.data[start : start + length]
        weight = self._dequantize(data, (length, *rest))
        return unpermute_rotary_rows(weight, length // head_rows)

    def _read_columns(self, start: int, length: int) -> torch.Tensor | None:
        data_cols = self._tensor.data.shape[-1]
        if data_cols == self.shape[1]:  # one array element per value (F32, F16)
            block, block_bytes = 1, 1
        else:  # bytes of quantization blocks
            block, block_bytes = GGML_QUANT_SIZES[self._tensor.tensor_type]
            if data_cols != self.shape[1] // block * block_bytes:
                return None
        if start % block or length % block:
            return None
        first, last = start // block * block_bytes, (start + length) // block * block_bytes
        data = self._tensor.data[:, first:last]
        return self._dequantize(np.ascontiguousarray(data), (self.shape[0], length))


def _iterate_reader(
    reader: GGUFReader, config: LlamaConfig, lazy: bool = False, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor | GGUFWeight]]:
    heads_by_kind = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    for tensor in reader.tensors:
        hf_name = gguf_tensor_name_to_hf(tensor.name)
        if hf_name is None:
            continue
        weight = GGUFWeight(tensor, heads_by_kind.get(tensor.name.split(".")[-2]), dtype)
        yield hf_name, weight if lazy else weight.materialize()


def iterate_gguf_weights(
    path: str, progress: bool = False, lazy: bool = False, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor | GGUFWeight]]:
    """Yield ``(hf_name, float32 tensor)`` for every weight of a llama-arch GGUF file
    (``lazy``: a :class:`GGUFWeight` to narrow; ``dtype``: cast to it instead of float32).

    Tensors are dequantized one at a time (peak extra memory: one tensor), in HF shape and
    HF Q/K row order. Tied checkpoints yield no ``lm_head.weight``. ``progress`` shows a tqdm
    bar over the tensors.
    """
    reader = _open(path)
    weights = _iterate_reader(reader, _config_from_reader(reader), lazy, dtype)
    total = sum(1 for t in reader.tensors if t.name not in _IGNORED_TENSORS)
    yield from tqdm(weights, total=total, desc="Loading GGUF", unit="tensor", disable=not progress)


def _save_tokenizer(
    gguf_path: str, out_dir: str, chat_template: str | None, model_max_length: int
) -> None:
    # Imported here: hf_transformers_utils pulls in the tokenizer stack, not needed for weights.
    from sglang.srt.hf_transformers_utils import get_tokenizer

    tokenizer = get_tokenizer(gguf_path)
    tokenizer.padding_side = "right"  # the saved file keeps transformers' default
    tokenizer.model_max_length = model_max_length
    tokenizer.save_pretrained(out_dir)
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as f:
        tokenizer_config = json.load(f)
    if chat_template is not None:
        # transformers 5 writes the template to chat_template.jinja; readers that only look at
        # tokenizer_config.json (older transformers, other engines) need it there too.
        tokenizer_config["chat_template"] = chat_template
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(tokenizer_config, f, indent=2, ensure_ascii=False)


def _move_files(src_dir: str, dst_dir: str) -> None:
    """Move every file of ``src_dir`` into ``dst_dir``, config.json last, readable by all
    (some writers create 0600 files)."""
    umask = os.umask(0)
    os.umask(umask)
    for name in sorted(os.listdir(src_dir), key=lambda n: n == "config.json"):
        dst = os.path.join(dst_dir, name)
        os.replace(os.path.join(src_dir, name), dst)
        os.chmod(dst, 0o666 & ~umask)


def save_gguf_as_hf(gguf_path: str, out_dir: str, dtype: torch.dtype = torch.float32) -> None:
    """Convert a llama-arch GGUF file into an HF model directory at ``out_dir``.

    Writes config.json, generation_config.json, model.safetensors (all weights in ``dtype``;
    the whole state dict is held in memory) and the tokenizer files with the chat template.
    Files are first written to a temporary directory beside ``out_dir`` and moved in with
    config.json last, so a crash never leaves a directory that looks complete.
    """
    from safetensors.torch import save_file

    reader = _open(gguf_path)
    config = _config_from_reader(reader)
    config.dtype = dtype
    state_dict = {
        name: weight.to(dtype).contiguous()
        for name, weight in _iterate_reader(reader, config)
        if isinstance(weight, torch.Tensor)
    }
    chat_template = reader.fields.get("tokenizer.chat_template")
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(out_dir)) as tmp_dir:
        save_file(state_dict, os.path.join(tmp_dir, "model.safetensors"), {"format": "pt"})
        del state_dict
        GenerationConfig(
            bos_token_id=config.bos_token_id,
            eos_token_id=config.eos_token_id,
            pad_token_id=config.pad_token_id,
        ).save_pretrained(tmp_dir)
        _save_tokenizer(
            gguf_path, tmp_dir, chat_template.contents() if chat_template else None,
            config.max_position_embeddings,
        )
        config.save_pretrained(tmp_dir)
        _move_files(tmp_dir, out_dir)
    logger.info("converted %s -> %s (%d weights)", gguf_path, out_dir, len(reader.tensors))
