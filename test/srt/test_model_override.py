"""--json-model-override-args (upstream's flag): config.json fields replaced before the model
is built, at start-up and for every checkpoint a weight update reads."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from model_test_utils import hf_greedy
from transformers import AutoConfig, AutoModelForCausalLM

import sglang as sgl
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.rotary_embedding import rope_params_from_config
from sglang.srt.model_loader.loader import iterate_weights
from sglang.srt.server_args import ServerArgs

OVERRIDE = {"num_hidden_layers": 1, "rope_theta": 500.0, "max_position_embeddings": 256}
PROMPTS = [[5, 17, 300, 42, 9], [7, 8, 9, 10]]


@pytest.mark.parametrize("value", ["{", "[1, 2]", "3", '"x"'])
def test_anything_but_a_json_object_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="--json-model-override-args must be a JSON object"):
        ServerArgs(model_path="m", device="cpu", json_model_override_args=value)


def test_no_override() -> None:
    for value in ("{}", None):
        args = ServerArgs(model_path="m", device="cpu", json_model_override_args=value)
        assert args.model_override_args() == {}


def test_config_and_weights_follow_the_override(tiny_model_dir: Callable[..., Path]) -> None:
    path = str(tiny_model_dir("llama"))
    plain = ModelConfig(path)
    config = ModelConfig(path, model_override_args=OVERRIDE)
    assert (plain.num_hidden_layers, plain.skip_layers_from) == (2, None)
    assert (config.num_hidden_layers, config.skip_layers_from) == (1, 1)
    assert config.context_len == 256
    # transformers 5 keeps the RoPE base in rope_parameters, which is what the model reads.
    assert rope_params_from_config(config.hf_config)[0] == 500.0
    assert rope_params_from_config(plain.hf_config)[0] == 10000.0
    names = [name for name, _ in iterate_weights(config, progress=False)]
    assert names and not any(".layers.1." in name for name in names)
    assert any(".layers.0." in name for name in names)
    all_names = [name for name, _ in iterate_weights(plain, progress=False)]
    assert len(all_names) > len(names)
    # More layers than the checkpoint has is not an override that drops anything.
    assert ModelConfig(path, model_override_args={"num_hidden_layers": 3}).skip_layers_from is None


def test_engine_serves_the_overridden_model(tiny_model_dir: Callable[..., Path]) -> None:
    """Greedy tokens equal transformers' on the same override (one layer, another RoPE base),
    before and after a weight update from the full checkpoint on disk."""
    path = tiny_model_dir("llama")
    hf_config = AutoConfig.from_pretrained(path)
    hf_config.update(OVERRIDE)
    hf_config.rope_parameters["rope_theta"] = OVERRIDE["rope_theta"]  # what transformers reads
    hf_model = AutoModelForCausalLM.from_pretrained(path, config=hf_config, dtype=torch.float32)
    expected = [hf_greedy(hf_model, prompt, 4)[0] for prompt in PROMPTS]
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    with sgl.Engine(model_path=str(path), json_model_override_args=json.dumps(OVERRIDE),
                    skip_server_warmup=True) as engine:
        assert [o["output_ids"] for o in engine.generate(input_ids=PROMPTS,
                                                         sampling_params=params)] == expected
        info = engine.get_server_info()
        assert json.loads(info["json_model_override_args"]) == OVERRIDE
        ok, message, _ = engine.update_weights_from_disk(str(path))
        assert ok, message
        assert [o["output_ids"] for o in engine.generate(input_ids=PROMPTS,
                                                         sampling_params=params)] == expected
        # The context is the overridden one.
        with pytest.raises(ValueError, match="context length"):
            engine.generate(input_ids=[5] * 300, sampling_params=params)
