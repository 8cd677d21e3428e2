"""RL frameworks call an Engine's ``tokenizer_manager`` directly, from their own event loop and
with upstream's signatures (SkyRL, verl): the calls work there and do what they say."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import sglang as sgl
from sglang.srt.managers.tokenizer_manager import (
    InitWeightsUpdateGroupReqInput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
)
from sglang.srt.utils import MultiprocessingSerializer
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
PROMPT = [5, 6, 7, 8]
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
K_PROJ = "model.layers.0.self_attn.k_proj.weight"
# Custom loaders of test/srt/compat_weight_loaders.py (the spawned scheduler imports them).
DOUBLED = "compat_weight_loaders.load_doubled"
FAILING = "compat_weight_loaders.load_failing"


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Callable[..., Path]) -> Iterator[sgl.Engine]:
    # SkyRL's and verl's keywords that do not apply on this build are accepted.
    with sgl.Engine(
        model_path=str(tiny_model_dir("llama")), random_seed=0, mm_attention_backend="fa3",
        enable_memory_saver=True, custom_weight_loader=[DOUBLED, FAILING], base_gpu_id=0,
        dp_size=1, json_model_override_args="{}",
    ) as eng:
        yield eng


def test_upstream_engine_kwargs(tiny_model_dir: Callable[..., Path]) -> None:
    with pytest.raises(ValueError, match="quantization='fp8'"):
        sgl.Engine(model_path=str(tiny_model_dir("llama")), quantization="fp8")
    with pytest.raises(TypeError, match="no_such_option"):
        sgl.Engine(model_path=str(tiny_model_dir("llama")), no_such_option=1)


def test_control_calls_from_another_event_loop(engine: sgl.Engine) -> None:
    tm = engine.tokenizer_manager
    before = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]

    async def trainer_loop() -> None:
        assert (await tm.flush_cache()).success
        released = await tm.release_memory_occupation(
            ReleaseMemoryOccupationReqInput(tags=["kv_cache"]), None)
        assert released.success and released.released_tags == ["kv_cache"]
        resumed = await tm.resume_memory_occupation(ResumeMemoryOccupationReqInput(), None)
        assert resumed.success and resumed.released_tags == []

    asyncio.run(trainer_loop())  # a loop of its own, as a Ray actor's
    # And from another thread with its own loop.
    worker = threading.Thread(target=asyncio.run, args=(trainer_loop(),))
    worker.start()
    worker.join(120)
    assert engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"] == before


def test_update_weights_from_serialized_tensors(engine: sgl.Engine) -> None:
    original = torch.tensor(engine.get_weights_by_name(Q_PROJ, truncate_size=10**6))
    new = torch.randn_like(original)
    obj = UpdateWeightsFromTensorReqInput(
        serialized_named_tensors=[MultiprocessingSerializer.serialize([(Q_PROJ, new)])],
        flush_cache=False,
    )

    async def update() -> tuple[bool, str]:
        success, message = await engine.tokenizer_manager.update_weights_from_tensor(obj, None)
        return success, message

    success, message = asyncio.run(update())
    assert success, message
    got = torch.tensor(engine.get_weights_by_name(Q_PROJ, truncate_size=10**6))
    assert torch.equal(got, new)
    bad = UpdateWeightsFromTensorReqInput(serialized_named_tensors=["%%%"])
    success, message = asyncio.run(engine.tokenizer_manager.update_weights_from_tensor(bad))
    assert not success and "base64" in message
    engine.update_weights_from_tensor([(Q_PROJ, original)])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_update_weights_from_distributed_broadcast(engine: sgl.Engine) -> None:
    original = torch.tensor(engine.get_weights_by_name(Q_PROJ, truncate_size=10**6))
    new = torch.randn_like(original)
    port = _free_port()
    trainer_group: list = []

    def trainer() -> None:  # rank 0 of the group, as the framework's trainer side
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=True)
        trainer_group.append(dist.ProcessGroupGloo(dist.PrefixStore("sync/", store), 0, 2))

    thread = threading.Thread(target=trainer)
    thread.start()
    tm = engine.tokenizer_manager
    init = InitWeightsUpdateGroupReqInput("127.0.0.1", port, 1, 2, "sync", "gloo")
    assert asyncio.run(tm.init_weights_update_group(init, None))[0]
    thread.join(60)

    async def update() -> tuple[bool, str]:
        obj = UpdateWeightsFromDistributedReqInput(
            name=Q_PROJ, dtype="float32", shape=list(new.shape), group_name="sync")
        receiving = asyncio.ensure_future(tm.update_weights_from_distributed(obj, None))
        await asyncio.to_thread(lambda: trainer_group[0].broadcast(new.clone(), 0).wait())
        return await receiving

    success, message = asyncio.run(update())
    assert success, message
    assert torch.equal(torch.tensor(engine.get_weights_by_name(Q_PROJ, 10**6)), new)

    # miles' and slime's form: one broadcast of a whole FlattenedTensorBucket (mixed dtypes).
    k_new = torch.randn_like(_weight(engine, K_PROJ))
    bucket = FlattenedTensorBucket(named_tensors=[(Q_PROJ, original), (K_PROJ, k_new.double())])

    async def update_bucket() -> tuple[bool, str]:
        obj = UpdateWeightsFromDistributedReqInput(
            names=[Q_PROJ, K_PROJ], dtypes=["float32", "float64"],
            shapes=[list(original.shape), list(k_new.shape)], group_name="sync",
            load_format="flattened_bucket")
        receiving = asyncio.ensure_future(tm.update_weights_from_distributed(obj, None))
        flat = bucket.get_flattened_tensor()
        await asyncio.to_thread(lambda: trainer_group[0].broadcast(flat, 0).wait())
        return await receiving

    success, message = asyncio.run(update_bucket())
    assert success, message
    assert torch.equal(_weight(engine, Q_PROJ), original)
    torch.testing.assert_close(_weight(engine, K_PROJ), k_new)
    wrong = UpdateWeightsFromDistributedReqInput(name=Q_PROJ, dtype="float32", shape=[1],
                                                 group_name="sync", load_format="bogus")
    success, message = asyncio.run(tm.update_weights_from_distributed(wrong))
    assert not success and "bogus" in message
    missing = UpdateWeightsFromDistributedReqInput(name=Q_PROJ, dtype="float32", shape=[1],
                                                   group_name="nope")
    success, message = asyncio.run(tm.update_weights_from_distributed(missing))
    assert not success and "nope" in message
    engine.update_weights_from_tensor([(Q_PROJ, original)])


def test_abort_request_from_another_thread(engine: sgl.Engine) -> None:
    tm = engine.tokenizer_manager
    budget = tm.context_len - len(PROMPT) - 1
    long = {"temperature": 0, "max_new_tokens": budget, "ignore_eos": True}

    async def run() -> dict:
        task = asyncio.ensure_future(
            engine.async_generate(input_ids=PROMPT, sampling_params=long, rid="far"))
        while "far" not in tm.rid_to_state and not task.done():  # frontend state only
            await asyncio.sleep(0.02)
        await engine.async_pause_generation(mode="in_place")  # so it cannot finish first
        await asyncio.to_thread(tm.abort_request, "far")  # a thread without an event loop
        out = await task
        await engine.async_continue_generation()
        return out

    out = asyncio.run(run())
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["meta_info"]["completion_tokens"] < budget


def _weight(engine: sgl.Engine, name: str) -> torch.Tensor:
    return torch.tensor(engine.get_weights_by_name(name, truncate_size=10**6))


def test_custom_weight_loader(engine: sgl.Engine) -> None:
    original = _weight(engine, Q_PROJ)
    new = torch.randn_like(original)
    success, message = engine.update_weights_from_tensor([(Q_PROJ, new)], load_format=DOUBLED)
    assert success, message
    assert torch.equal(_weight(engine, Q_PROJ), new * 2)  # the loader's own logic ran
    # SkyRL's shape: a serialized payload through tokenizer_manager, load_format = the loader.
    obj = UpdateWeightsFromTensorReqInput(
        serialized_named_tensors=[MultiprocessingSerializer.serialize([(Q_PROJ, original)])],
        load_format=DOUBLED, flush_cache=False,
    )
    success, message = asyncio.run(engine.tokenizer_manager.update_weights_from_tensor(obj, None))
    assert success, message
    assert torch.equal(_weight(engine, Q_PROJ), original * 2)
    # A loader that is not listed is refused by name and changes nothing.
    success, message = engine.update_weights_from_tensor(
        [(Q_PROJ, new)], load_format="compat_weight_loaders.not_listed")
    assert not success
    assert "'compat_weight_loaders.not_listed' is not a registered custom weight loader" in message
    assert torch.equal(_weight(engine, Q_PROJ), original * 2)
    success, message = engine.update_weights_from_tensor([(Q_PROJ, new)], load_format=FAILING)
    assert not success and "this loader always fails" in message
    assert engine.update_weights_from_tensor([(Q_PROJ, original)])[0]
    assert engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]


def test_flattened_bucket_updates(engine: sgl.Engine) -> None:
    originals = [(Q_PROJ, _weight(engine, Q_PROJ)), (K_PROJ, _weight(engine, K_PROJ))]
    news = [(name, torch.randn_like(w)) for name, w in originals]
    bucket = FlattenedTensorBucket(named_tensors=news)
    data = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
    # The bucket itself, in-process.
    success, message = engine.update_weights_from_tensor(data, load_format="flattened_bucket")
    assert success, message
    for name, tensor in news:
        assert torch.equal(_weight(engine, name), tensor)
    # Upstream's Engine form: one serialized bucket per tensor-parallel rank.
    serialized = MultiprocessingSerializer.serialize(
        {"flattened_tensor": FlattenedTensorBucket(named_tensors=originals).flattened_tensor,
         "metadata": FlattenedTensorBucket(named_tensors=originals).metadata})
    success, message = engine.update_weights_from_tensor(
        [serialized], load_format="flattened_bucket", flush_cache=False)
    assert success, message
    for name, tensor in originals:
        assert torch.equal(_weight(engine, name), tensor)
    # slime's form, through tokenizer_manager with a weight version.
    obj = UpdateWeightsFromTensorReqInput(
        serialized_named_tensors=[MultiprocessingSerializer.serialize(data, output_str=True)],
        load_format="flattened_bucket", weight_version="bucket-1",
    )
    success, message = asyncio.run(engine.tokenizer_manager.update_weights_from_tensor(obj, None))
    assert success, message
    assert engine.get_model_info()["weight_version"] == "bucket-1"
    with pytest.raises(ValueError, match="load_format='flattened_bucket'"):
        engine.update_weights_from_tensor(data)  # a bucket without its load_format
    # Metadata that does not fit is refused with the reason; nothing changes.
    bad = [dataclasses.replace(m) for m in bucket.get_metadata()]
    bad[1].numel += 4
    with pytest.raises(ValueError, match=r"metadata\[1\].*end_idx - start_idx"):
        engine.update_weights_from_tensor(
            {"flattened_tensor": data["flattened_tensor"], "metadata": bad},
            load_format="flattened_bucket")
    bad_payload = MultiprocessingSerializer.serialize(
        {"flattened_tensor": data["flattened_tensor"], "metadata": bad})
    success, message = engine.update_weights_from_tensor(
        [bad_payload], load_format="flattened_bucket")
    assert not success and "numel" in message
    unknown = FlattenedTensorBucket(named_tensors=[("model.no_such.weight", torch.zeros(2))])
    success, message = engine.update_weights_from_tensor(
        {"flattened_tensor": unknown.flattened_tensor, "metadata": unknown.metadata},
        load_format="flattened_bucket")
    assert not success and "no_such" in message
    for name, tensor in news:
        assert torch.equal(_weight(engine, name), tensor)
    assert engine.update_weights_from_tensor(originals)[0]
