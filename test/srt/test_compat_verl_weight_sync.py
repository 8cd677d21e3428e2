"""verl's SGLang weight sync against this package: ``EngineBase``, ``LocalSerializedTensor``
(one payload per TP rank), ``weight_sync.utils.update_weights`` over a torch.distributed
group (gloo, CPU), and ``monkey_patch_torch_reductions`` (docs/weights.md, "Trainer ranks").

The tiny random Llama's LM head, negated, turns every greedy argmax into an argmin: an update
that landed is visible in the tokens, one that did not leaves them as they were.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import os
import pickle
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import sglang as sgl
from sglang.srt.entrypoints.engine import Engine
from sglang.srt.entrypoints.EngineBase import EngineBase
from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
from sglang.srt.model_executor.model_runner import LocalSerializedTensor
from sglang.srt.utils import MultiprocessingSerializer, patch_torch
from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
from sglang.srt.weight_sync.utils import _preprocess_tensor_for_update_weights, update_weights

HEAD = "lm_head.weight"
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
PROMPT = [10, 20, 30, 40]
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
TP = 2


def _weight(engine: sgl.Engine, name: str) -> torch.Tensor:
    return torch.tensor(engine.get_weights_by_name(name, truncate_size=10_000))


def _greedy(engine: sgl.Engine) -> tuple[list[int], list[float]]:
    out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True)
    return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


@pytest.fixture
def restore(engine: sgl.Engine) -> Iterator[dict[str, torch.Tensor]]:
    """The engine's LM head and q_proj before the test; put back after it."""
    saved = {HEAD: _weight(engine, HEAD), Q_PROJ: _weight(engine, Q_PROJ)}
    yield saved
    ok, message = engine.update_weights_from_tensor(list(saved.items()))
    assert ok, message


class _Disallowed:
    """Unpickles as a call of os.getpid (harmless if it ever ran): not on the allowlist."""

    def __reduce__(self) -> tuple[Any, tuple]:
        return os.getpid, ()


class _RequestEngine(EngineBase):
    """An engine reached the way verl's HTTP adapters are: ``update_weights_from_tensor``
    takes one ``UpdateWeightsFromTensorReqInput`` (awaited); here it goes to the in-process
    engine's TokenizerManager, the path ``POST /update_weights_from_tensor`` takes."""

    def __init__(self, engine: sgl.Engine) -> None:
        self.engine = engine
        self.requests: list[UpdateWeightsFromTensorReqInput] = []

    def generate(self, prompt: Any = None, sampling_params: Any = None,
                 input_ids: Any = None, **kwargs: Any) -> Any:
        return self.engine.generate(prompt, sampling_params, input_ids, **kwargs)

    def flush_cache(self) -> Any:
        return self.engine.flush_cache()

    async def update_weights_from_tensor(self, req: Any) -> dict[str, Any]:  # type: ignore[override]
        self.requests.append(req)
        assert self.engine.tokenizer_manager is not None
        out = await self.engine.tokenizer_manager.update_weights_from_tensor(req)
        return {"success": out.success, "message": out.message}

    def release_memory_occupation(self) -> Any:
        return self.engine.release_memory_occupation()

    def resume_memory_occupation(self) -> Any:
        return self.engine.resume_memory_occupation()

    def shutdown(self) -> None:
        self.engine.shutdown()


@pytest.fixture
def tp_group(tmp_path: Path) -> Iterator[Any]:
    """A one-rank gloo group (FileStore rendezvous) and its 1-D ``infer_tp`` DeviceMesh."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("infer_tp",))
    finally:
        dist.destroy_process_group()


# ---- (a) EngineBase -------------------------------------------------------------------------
def test_engine_is_an_engine_base_with_upstreams_abstract_methods(engine: sgl.Engine) -> None:
    assert sgl.Engine is Engine and issubclass(Engine, EngineBase)
    assert isinstance(engine, EngineBase)
    assert EngineBase.__abstractmethods__ == {
        "generate", "flush_cache", "update_weights_from_tensor",
        "release_memory_occupation", "resume_memory_occupation", "shutdown",
    }
    assert not Engine.__abstractmethods__
    with pytest.raises(TypeError, match="abstract"):
        EngineBase()  # type: ignore[abstract]

    class Partial(EngineBase):
        def flush_cache(self) -> None:
            pass

    with pytest.raises(TypeError, match="shutdown"):
        Partial()  # type: ignore[abstract]
    # Upstream's call shapes bind to this Engine's methods.
    sig = inspect.signature
    sig(Engine.update_weights_from_tensor).bind(engine, [], None, True)
    sig(Engine.generate).bind(engine, "hi", {}, None, image_data=None, return_logprob=False,
                              stream=False, rid=None)
    for name in ("flush_cache", "release_memory_occupation", "resume_memory_occupation",
                 "shutdown"):
        sig(getattr(Engine, name)).bind(engine)


# ---- (b) LocalSerializedTensor through update_weights_from_tensor ---------------------------
def test_local_serialized_tensor_loads_like_the_tensor_itself(
    engine: sgl.Engine, restore: dict[str, torch.Tensor]
) -> None:
    before = _greedy(engine)
    new_head = -restore[HEAD]
    new_q = restore[Q_PROJ] * 0.5
    ok, message = engine.update_weights_from_tensor([(HEAD, new_head), (Q_PROJ, new_q)])
    assert ok, message
    direct = _greedy(engine)
    assert direct[0] != before[0]
    assert engine.update_weights_from_tensor(list(restore.items()))[0]
    assert _greedy(engine) == before

    # Engine: a (name, LocalSerializedTensor) pair, bytes and base64 payloads.
    ok, message = engine.update_weights_from_tensor([
        (HEAD, LocalSerializedTensor(values=[MultiprocessingSerializer.serialize(new_head)])),
        (Q_PROJ, LocalSerializedTensor(
            values=[MultiprocessingSerializer.serialize(new_q, output_str=True)])),
    ])
    assert ok, message
    assert torch.equal(_weight(engine, HEAD), new_head)
    assert torch.equal(_weight(engine, Q_PROJ), new_q)
    assert _greedy(engine) == direct

    # Upstream's serialized form (what POST /update_weights_from_tensor carries).
    assert engine.update_weights_from_tensor(list(restore.items()))[0]
    named = [(HEAD, LocalSerializedTensor(values=[MultiprocessingSerializer.serialize(new_head)]))]
    obj = UpdateWeightsFromTensorReqInput(
        serialized_named_tensors=[MultiprocessingSerializer.serialize(named, output_str=True)]
    )
    assert engine.tokenizer_manager is not None
    out = engine._run(engine.tokenizer_manager.update_weights_from_tensor(obj))
    assert out.success, out.message
    assert torch.equal(_weight(engine, HEAD), new_head)


# ---- (c) weight_sync.utils.update_weights ---------------------------------------------------
def test_update_weights_over_a_device_mesh_with_a_dtensor(
    engine: sgl.Engine, restore: dict[str, torch.Tensor], tp_group: Any
) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    before = _greedy(engine)
    new_head = -restore[HEAD]
    sharded = distribute_tensor(new_head, tp_group, [Shard(0)])  # as FSDP2 holds it
    assert _preprocess_tensor_for_update_weights(sharded).__class__ is torch.Tensor
    new_q = restore[Q_PROJ] + 0.25
    result = asyncio.run(update_weights(
        engine=engine,
        params_batch=[(HEAD, sharded), (Q_PROJ, new_q.requires_grad_())],
        device_mesh_key="infer_tp",
        device_mesh=tp_group,
    ))
    success, message = result
    assert success, message
    assert torch.equal(_weight(engine, HEAD), new_head)
    assert torch.equal(_weight(engine, Q_PROJ), new_q.detach())
    assert _greedy(engine)[0] != before[0]


def test_update_weights_sends_other_engines_one_request(
    engine: sgl.Engine, restore: dict[str, torch.Tensor], tp_group: Any
) -> None:
    adapter = _RequestEngine(engine)
    new_head = restore[HEAD] * 2

    async def push() -> Any:
        return await update_weights(adapter, [(HEAD, new_head)], "infer_tp", tp_group)

    reply = asyncio.run(push())
    assert reply["success"], reply["message"]
    [req] = adapter.requests
    assert req.load_format is None and req.flush_cache is True
    [payload] = req.serialized_named_tensors  # one per TP rank: one
    assert isinstance(payload, bytes)
    [(name, local)] = MultiprocessingSerializer.deserialize(payload)
    assert name == HEAD and isinstance(local, LocalSerializedTensor)
    assert torch.equal(local.get(0), new_head)
    assert torch.equal(_weight(engine, HEAD), new_head)


# ---- (d) refusals ---------------------------------------------------------------------------
def test_a_disallowed_object_inside_a_payload_is_refused(
    engine: sgl.Engine, restore: dict[str, torch.Tensor]
) -> None:
    before = _greedy(engine)
    refused = "payload refers to posix.getpid, which is not allowed"
    # Today's refusal of the object as a plain payload...
    with pytest.raises(pickle.UnpicklingError, match=refused):
        MultiprocessingSerializer.deserialize(MultiprocessingSerializer.serialize(_Disallowed()))
    # ...is the refusal inside a LocalSerializedTensor, on both paths, with nothing applied.
    bad = LocalSerializedTensor(values=[MultiprocessingSerializer.serialize(_Disallowed())])
    ok, message = engine.update_weights_from_tensor([(Q_PROJ, -restore[Q_PROJ]), (HEAD, bad)])
    assert not ok and refused in message and repr(HEAD) in message
    obj = UpdateWeightsFromTensorReqInput(
        serialized_named_tensors=[MultiprocessingSerializer.serialize([(HEAD, bad)])]
    )
    assert engine.tokenizer_manager is not None
    out = engine._run(engine.tokenizer_manager.update_weights_from_tensor(obj))
    assert not out.success and refused in out.message
    assert torch.equal(_weight(engine, Q_PROJ), restore[Q_PROJ])
    assert _greedy(engine) == before


def test_local_serialized_tensor_carries_only_payloads() -> None:
    with pytest.raises(TypeError, match="list of bytes or str"):
        LocalSerializedTensor(values=[torch.zeros(2)])  # type: ignore[list-item]
    # A forged pickle whose state holds anything but payloads is refused at load.
    forged = LocalSerializedTensor(values=[])
    forged.__dict__["values"] = [torch.zeros(2)]
    with pytest.raises(pickle.UnpicklingError, match="list of bytes or str"):
        MultiprocessingSerializer.deserialize(MultiprocessingSerializer.serialize(forged))
    extra = LocalSerializedTensor(values=[])
    extra.__dict__["hook"] = 1
    with pytest.raises(pickle.UnpicklingError, match="state"):
        MultiprocessingSerializer.deserialize(MultiprocessingSerializer.serialize(extra))
    # A payload that is not a tensor, or no payload for the rank.
    local = LocalSerializedTensor(values=[MultiprocessingSerializer.serialize(5)])
    with pytest.raises(ValueError, match="holds a int, not a tensor"):
        local.get(0)
    with pytest.raises(ValueError, match="rank 1 needs one"):
        local.get(1)
    # Round trip keeps the payloads, and repr does not print them.
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    local = LocalSerializedTensor(values=[MultiprocessingSerializer.serialize(t)])
    back = MultiprocessingSerializer.deserialize(MultiprocessingSerializer.serialize(local))
    assert back == local and torch.equal(back.get(0), t)
    assert repr(local) == "LocalSerializedTensor(<1 payload(s)>)"
    assert dataclasses.fields(LocalSerializedTensor)[0].name == "values"


# ---- (e) monkey_patch_torch_reductions ------------------------------------------------------
def test_monkey_patch_torch_reductions_is_idempotent_and_keeps_cpu_tensors_working() -> None:
    from torch.multiprocessing import reductions

    monkey_patch_torch_reductions()
    assert reductions.reduce_tensor is patch_torch._reduce_tensor_modified
    assert ForkingPickler._extra_reducers[torch.Tensor] is patch_torch._reduce_tensor_modified
    original = getattr(reductions, patch_torch._ORIGINAL_REDUCE_ATTR)
    assert original is not patch_torch._reduce_tensor_modified
    monkey_patch_torch_reductions()  # a second call wraps nothing twice
    assert getattr(reductions, patch_torch._ORIGINAL_REDUCE_ATTR) is original
    assert reductions.reduce_tensor is patch_torch._reduce_tensor_modified

    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    for t in (base, base.t(), base[1:3, ::2], base.to(torch.bfloat16), torch.tensor([1, 2])):
        back = MultiprocessingSerializer.deserialize(MultiprocessingSerializer.serialize(t))
        assert back.dtype == t.dtype and torch.equal(back, t)
    # torch's own shared-memory path for CPU tensors goes through the patched reducer as is.
    fn, _ = patch_torch._reduce_tensor_modified(base)
    assert fn is not patch_torch._rebuild_cuda_tensor_modified
    assert torch.equal(pickle.loads(ForkingPickler.dumps(base)), base)
    # The engine's unpickler admits the rebuild function patched payloads name; it keeps an
    # index and maps only a UUID a visible GPU has.
    assert patch_torch._device_index(3) == 3
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no visible CUDA device has UUID GPU-x"):
            patch_torch._device_index("GPU-x")
    from sglang.srt.utils.multiprocessing_serializer import _ALLOWED

    assert "_rebuild_cuda_tensor_modified" in _ALLOWED["sglang.srt.utils.patch_torch"]


# ---- TP > 1: rank r loads values[r] -----------------------------------------------------------
@pytest.mark.slow  # starts a TP=2 engine of its own
def test_each_tp_rank_loads_its_own_payload(tiny_model_dir: Any) -> None:
    with sgl.Engine(model_path=str(tiny_model_dir("llama")), random_seed=0, tp_size=TP,
                    max_total_tokens=2000) as tp_engine:
        head = _weight(tp_engine, HEAD)
        half = head.shape[0] // TP

        def rank0_negated(got: torch.Tensor) -> bool:
            return torch.equal(got[:half], -head[:half]) and torch.equal(got[half:], head[half:])

        per_rank = LocalSerializedTensor(
            values=[MultiprocessingSerializer.serialize(t) for t in (-head, head)]
        )
        ok, message = tp_engine.update_weights_from_tensor([(HEAD, per_rank)])
        assert ok, message
        assert rank0_negated(_weight(tp_engine, HEAD))
        assert tp_engine.update_weights_from_tensor([(HEAD, head)])[0]
        payload = MultiprocessingSerializer.serialize([(HEAD, per_rank)])
        obj = UpdateWeightsFromTensorReqInput(serialized_named_tensors=[payload] * TP)
        assert tp_engine.tokenizer_manager is not None
        out = tp_engine._run(tp_engine.tokenizer_manager.update_weights_from_tensor(obj))
        assert out.success, out.message
        assert rank0_negated(_weight(tp_engine, HEAD))
        # One payload for two ranks: refused on rank 1, nothing applied anywhere.
        assert tp_engine.update_weights_from_tensor([(HEAD, head)])[0]
        short = LocalSerializedTensor(values=per_rank.values[:1])
        ok, message = tp_engine.update_weights_from_tensor([(HEAD, short)])
        assert not ok and "rank 1 needs one" in message
        assert torch.equal(_weight(tp_engine, HEAD), head)
