"""Drop-in compatibility of ``sglang.Engine`` with upstream SGLang's signatures: the keyword
arguments RL frameworks pass unset, positional arguments in upstream's order, and the model
info method."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import sglang as sgl

GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[..., Path]) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[sgl.Engine]:
    with sgl.Engine(model_path=str(model_dir), random_seed=0) as eng:
        yield eng


def test_upstream_keyword_arguments_left_unset_are_accepted(engine: sgl.Engine) -> None:
    # verl passes image_data=None; other frameworks pass upstream's defaults explicitly.
    baseline = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
    out = engine.generate(
        input_ids=PROMPT, sampling_params=GREEDY, image_data=None, audio_data=None,
        video_data=None, lora_path=None, custom_logit_processor=None,
        return_hidden_states=False, token_ids_logprob=None, data_parallel_rank=None,
    )
    assert out["output_ids"] == baseline["output_ids"]
    # Routing and priority hints change nothing here (one replica, no priority scheduling).
    hinted = engine.generate(input_ids=PROMPT, sampling_params=GREEDY, data_parallel_rank=0,
                             routed_dp_rank=0, priority=0, external_trace_header={"x": "1"})
    assert hinted["output_ids"] == baseline["output_ids"]
    batch = engine.generate(input_ids=[PROMPT, PROMPT], sampling_params=GREEDY,
                            image_data=[None, None], lora_path=[None, None])
    assert [o["output_ids"] for o in batch] == [baseline["output_ids"]] * 2

    async def run() -> dict:
        return await engine.async_generate(input_ids=PROMPT, sampling_params=GREEDY,
                                           image_data=None, return_hidden_states=False)

    assert asyncio.run(run())["output_ids"] == baseline["output_ids"]


def test_upstream_features_we_lack_are_refused(engine: sgl.Engine) -> None:
    with pytest.raises(ValueError, match="image_data"):
        engine.generate(input_ids=PROMPT, sampling_params=GREEDY, image_data="cat.png")
    with pytest.raises(ValueError, match="lora_path"):
        engine.generate(input_ids=PROMPT, sampling_params=GREEDY, lora_path=["adapter"])
    with pytest.raises(ValueError, match="return_hidden_states"):
        engine.generate(input_ids=PROMPT, sampling_params=GREEDY, return_hidden_states=True)
    with pytest.raises(TypeError, match="no_such_argument"):
        engine.generate(input_ids=PROMPT, sampling_params=GREEDY, no_such_argument=1)

    async def run() -> None:
        await engine.async_generate(input_ids=PROMPT, sampling_params=GREEDY,
                                    token_ids_logprob=[1, 2])

    with pytest.raises(ValueError, match="token_ids_logprob"):
        asyncio.run(run())
    # Still serving.
    assert engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["meta_info"][
        "completion_tokens"] == 4


def test_update_weights_from_disk_takes_load_format_second(engine: sgl.Engine,
                                                           model_dir: Path) -> None:
    # Upstream: update_weights_from_disk(model_path, load_format=None).
    success, message, num_paused = engine.update_weights_from_disk(str(model_dir), "auto")
    assert success, message
    assert num_paused == 0


def test_get_model_info(engine: sgl.Engine, model_dir: Path) -> None:
    engine.update_weight_version("step-7")
    try:
        info = engine.get_model_info()
        assert info["model_path"] == str(model_dir)
        assert info["is_generation"] is True
        assert info["weight_version"] == "step-7"
        assert info["model_type"] == "llama" and info["architectures"] == ["LlamaForCausalLM"]
        assert info["preferred_sampling_params"] is None
        assert engine.get_server_info()["weight_version"] == "step-7"  # as upstream: current

        async def run() -> dict:
            return await engine.async_get_model_info()

        assert asyncio.run(run()) == info
    finally:
        engine.update_weight_version("default")


def test_default_prompt_logprobs_match_upstream(engine: sgl.Engine) -> None:
    out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True,
                          top_logprobs_num=1)["meta_info"]
    assert out["input_token_logprobs"] == [] and out["input_top_logprobs"] == []
    assert len(out["output_token_logprobs"]) == 4


def test_engine_from_server_args(model_dir: Path) -> None:
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path=str(model_dir), random_seed=0, max_running_requests=3)
    with pytest.raises(TypeError, match="server_args"):
        sgl.Engine(server_args=args, dtype="float32")
    with sgl.Engine(server_args=args) as eng:
        assert eng.get_server_info()["max_running_requests"] == 3
        out = eng.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert out["meta_info"]["completion_tokens"] == 4


def test_engine_profile_methods(engine: sgl.Engine, tmp_path: Path) -> None:
    engine.start_profile(output_dir=str(tmp_path), num_steps=1, activities=["CPU"])
    engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
    assert len(list(tmp_path.glob("*.trace.json.gz"))) == 1
    with pytest.raises(RuntimeError, match="not in progress"):
        engine.stop_profile()
    with pytest.raises(ValueError, match="merge_profiles"):
        engine.start_profile(merge_profiles=True)
