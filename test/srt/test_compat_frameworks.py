"""The RL stack's own SGLang client code, installed from the package registry, against our
servers on CPU (docs/compatibility.md). Each test is skipped, with the reason, only when its
package is not installed (``make setup`` installs them)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from server_test_utils import ServerProcess, free_port, started_together

GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


def _wait_until_up(proc: subprocess.Popen, url: str, what: str, timeout: float = 120) -> None:
    """Poll ``url`` until it answers 200; fail with ``proc``'s output if it exits first."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        assert time.monotonic() < deadline, f"{what} did not come up"
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


@pytest.fixture(scope="module")
def two_workers(tiny_model_dir: Callable[..., Path]) -> Iterator[list[ServerProcess]]:
    model = tiny_model_dir("llama")
    servers = [ServerProcess(model, "--skip-server-warmup") for _ in range(2)]
    with started_together(*servers):
        yield servers


@pytest.fixture(scope="module")
def router_package() -> None:
    pytest.importorskip("sglang_router", reason="sglang-router is not installed")


@pytest.fixture(scope="module")
def areal_package() -> None:
    pytest.importorskip("areal.engine.sglang_remote", reason="areal is not installed")


# The package fixtures come first, so that no server starts for a client that is not installed.
@pytest.fixture(scope="module")
def router(router_package: None, two_workers: list[ServerProcess]) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
         "--port", str(port), "--policy", "power_of_two", "--worker-urls",
         *(w.url for w in two_workers)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_up(proc, f"{url}/v1/models", "the router")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_router_spreads_generate_over_our_workers(router: str,
                                                  two_workers: list[ServerProcess]) -> None:
    # power_of_two picks workers by the load that /get_load reports.
    direct = httpx.post(f"{two_workers[0].url}/generate", timeout=60,
                        json={"input_ids": [5, 6, 7, 8], "sampling_params": GREEDY}).json()
    for _ in range(4):
        out = httpx.post(f"{router}/generate", timeout=60,
                         json={"input_ids": [5, 6, 7, 8], "sampling_params": GREEDY})
        assert out.status_code == 200, out.text
        assert out.json()["output_ids"] == direct["output_ids"]
    chat = httpx.post(f"{router}/v1/completions", timeout=60, json={
        "model": "default", "prompt": "Once upon", "max_tokens": 4, "temperature": 0,
        "ignore_eos": True})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["finish_reason"] == "length"


def test_router_fans_out_flush_cache(router: str) -> None:
    out = httpx.post(f"{router}/flush_cache", timeout=60)
    assert out.status_code == 200, out.text


@pytest.fixture(scope="module")
def areal_engine(areal_package: None, two_workers: list[ServerProcess]) -> Iterator[object]:
    from areal.api.cli_args import InferenceEngineConfig
    from areal.engine import sglang_remote as remote

    engine = remote.RemoteSGLangEngine(
        InferenceEngineConfig(backend="sglang:d1", max_concurrent_rollouts=4))
    engine.initialize(addr=[two_workers[0].url.removeprefix("http://")])
    try:
        yield engine
    finally:
        engine.destroy()


def test_areal_remote_engine_generates_with_logprobs(areal_engine: object,
                                                     two_workers: list[ServerProcess]) -> None:
    import asyncio

    from areal.api.cli_args import GenerationHyperparameters
    from areal.api.io_struct import ModelRequest

    direct = httpx.post(f"{two_workers[0].url}/generate", timeout=60,
                        json={"input_ids": [5, 6, 7, 8], "sampling_params": GREEDY}).json()
    gconfig = GenerationHyperparameters(max_new_tokens=4, greedy=True, ignore_eos=True)
    resp = asyncio.run(areal_engine.agenerate(  # type: ignore[attr-defined]
        ModelRequest(input_ids=[5, 6, 7, 8], gconfig=gconfig)))
    assert list(resp.output_tokens) == direct["output_ids"]
    assert len(resp.output_logprobs) == 4 and all(lp <= 0 for lp in resp.output_logprobs)
    assert resp.stop_reason == "length"
    areal_engine.pause_generation()  # type: ignore[attr-defined]
    areal_engine.continue_generation()  # type: ignore[attr-defined]


def test_skyrl_server_launcher_serves_token_in_token_out(
        tiny_model_dir: Callable[..., Path]) -> None:
    # skyrl-train declares Python >= 3.12 (make setup installs it with --ignore-requires-python);
    # its launcher module imports only sglang names.
    pytest.importorskip("skyrl_train", reason="skyrl-train is not installed")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "skyrl_train.inference_engines.sglang.sglang_server",
         "--model-path", str(tiny_model_dir("llama")), "--host", "127.0.0.1", "--port",
         str(port), "--skip-server-warmup", "--mm-attention-backend", "fa3"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_up(proc, f"{url}/health", "SkyRL's launcher")
        out = httpx.post(f"{url}/generate", timeout=60,
                         json={"input_ids": [5, 6, 7, 8], "sampling_params": GREEDY}).json()
        assert len(out["output_ids"]) == 4  # --skip-tokenizer-init: ids only
        assert httpx.post(f"{url}/flush_cache", timeout=60).status_code == 200
    finally:
        proc.terminate()
        assert proc.wait(30) is not None


def test_skyrl_inprocess_engine_generates_and_syncs_weights_by_broadcast(
        tiny_model_dir: Callable[..., Path]) -> None:
    """SkyRL's own in-process engine class (what its Ray actor wraps), driven directly: token
    in / token out generation, prefix-cache reset, and a broadcast weight sync from a trainer
    rank over gloo."""
    skyrl = pytest.importorskip("skyrl_train.inference_engines.sglang.sglang_engine",
                                reason="skyrl-train (and its ray pin) is not installed")
    import asyncio
    import threading
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from skyrl_train.weight_sync import BroadcastInitInfo, BroadcastWeightUpdateRequest
    from transformers import AutoTokenizer

    path = str(tiny_model_dir("llama"))
    engine = skyrl.SGLangInferenceEngine(
        model_path=path, tokenizer=AutoTokenizer.from_pretrained(path), random_seed=0,
        max_total_tokens=512, log_level="error")
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    port = free_port()
    trainer: list = []

    def join_as_trainer() -> None:  # rank 0 of the weight-sync group
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=True)
        # SkyRL's broadcast requests name no group: upstream's default group name it is. A
        # timeout, so that an engine that never joins the broadcast fails the test, not hangs it.
        trainer.append(dist.ProcessGroupGloo(dist.PrefixStore("weight_update_group/", store), 0,
                                             2, timedelta(seconds=60)))

    async def run() -> tuple[list, list]:
        batch = {"prompt_token_ids": [[5, 6, 7, 8], [9, 10]], "sampling_params": GREEDY}
        first = await engine.generate(batch)
        await engine.reset_prefix_cache()
        thread = threading.Thread(target=join_as_trainer)
        thread.start()
        await engine.init_weight_update_communicator(BroadcastInitInfo(
            override_existing_receiver=False, master_addr="127.0.0.1", master_port=port,
            rank_offset=1, world_size=2, group_name="weight_update_group", backend="gloo",
            model_dtype_str="float32"))
        thread.join(60)
        original = torch.tensor(engine.engine.get_weights_by_name(q_proj, truncate_size=10**6))
        new = torch.randn_like(original)
        shape = list(original.shape)
        request = BroadcastWeightUpdateRequest(names=[q_proj], dtypes=["float32"], shapes=[shape])
        receiving = asyncio.ensure_future(engine.update_named_weights(request))
        await asyncio.to_thread(lambda: trainer[0].broadcast(new.clone(), 0).wait())
        await receiving
        got = torch.tensor(engine.engine.get_weights_by_name(q_proj, truncate_size=10**6))
        assert torch.equal(got, new)
        second = await engine.generate(batch)
        return first["response_ids"], second["response_ids"]

    try:
        first, second = asyncio.run(run())
    finally:
        asyncio.run(engine.teardown())
    assert [len(ids) for ids in first] == [4, 4]
    assert first != second  # the new q_proj changed what the model generates
