"""HTTP endpoints for LoRA adapters (docs/lora.md), upstream SGLang's names and reply shape.

| endpoint | body | reply |
|---|---|---|
| POST /load_lora_adapter | lora_name, lora_path, pinned?, weight_version? | {success, error_message, loaded_adapters}; 400 when refused |
| POST /load_lora_adapter_from_tensors | lora_name, serialized_tensors, config_dict, load_format?, weight_version? | same |
| POST /unload_lora_adapter | lora_name | same |

Pause, continue and abort by adapter are the ``lora_name`` field of /pause_generation,
/continue_generation and /abort_request.
"""  # noqa: E501 - the table is documentation

from __future__ import annotations

import pickle
from dataclasses import asdict
from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from sglang.srt.entrypoints.openai.serving_base import error_body, json_response
from sglang.srt.managers.io_struct import (
    LoadLoRAAdapterFromTensorsReqInput,
    LoadLoRAAdapterReqInput,
    LoRAUpdateOutput,
    UnloadLoRAAdapterReqInput,
)
from sglang.srt.managers.tokenizer_manager_protocol import tokenizer_manager_of
from sglang.srt.utils.multiprocessing_serializer import MultiprocessingSerializer

router = APIRouter()


class LoadLoRAAdapterBody(BaseModel):
    model_config = ConfigDict(strict=True)

    lora_name: str
    lora_path: str
    pinned: bool = False
    weight_version: str | None = None


class LoadLoRAAdapterFromTensorsBody(BaseModel):
    model_config = ConfigDict(strict=True)

    lora_name: str
    # MultiprocessingSerializer.serialize(tensors, output_str=True): PEFT-named tensors, as a
    # dict {name: tensor} or a list of (name, tensor) pairs.
    serialized_tensors: str
    config_dict: dict[str, Any]  # adapter_config.json's content
    load_format: str | None = None
    weight_version: str | None = None


class UnloadLoRAAdapterBody(BaseModel):
    model_config = ConfigDict(strict=True)

    lora_name: str


@router.post("/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterBody, request: Request) -> Response:
    """Load an adapter (or update a paused one's weights); 400 with the reason when refused,
    nothing changed."""
    tm = tokenizer_manager_of(request)
    out = await tm.load_lora_adapter(  # type: ignore[attr-defined]
        LoadLoRAAdapterReqInput(
            body.lora_name, body.lora_path, body.pinned, weight_version=body.weight_version
        )
    )
    return _reply(out)


@router.post("/load_lora_adapter_from_tensors")
async def load_lora_adapter_from_tensors(
    body: LoadLoRAAdapterFromTensorsBody, request: Request
) -> Response:
    """Load (or update a paused) adapter from serialized tensors, without a checkpoint on
    disk; 400 for a payload that does not decode to named tensors, or when refused."""
    if body.load_format is not None:
        return _refused(f"load_format {body.load_format!r} is not supported for LoRA tensors")
    try:
        tensors = dict(MultiprocessingSerializer.deserialize(body.serialized_tensors))
    except (ValueError, TypeError, pickle.UnpicklingError) as e:
        return _refused(f"serialized_tensors: {e}")
    if not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()):
        return _refused("serialized_tensors must hold (name, tensor) pairs")
    tm = tokenizer_manager_of(request)
    out = await tm.load_lora_adapter_from_tensors(  # type: ignore[attr-defined]
        LoadLoRAAdapterFromTensorsReqInput(
            body.lora_name, tensors, body.config_dict, body.weight_version
        )
    )
    return _reply(out)


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterBody, request: Request) -> Response:
    """Unload an adapter; 400 while requests of it run or wait."""
    tm = tokenizer_manager_of(request)
    out = await tm.unload_lora_adapter(  # type: ignore[attr-defined]
        UnloadLoRAAdapterReqInput(body.lora_name)
    )
    return _reply(out)


def _refused(message: str) -> Response:
    return _reply(LoRAUpdateOutput(False, message))


def _reply(out: LoRAUpdateOutput) -> Response:
    reply = {k: v for k, v in asdict(out).items() if k != "req_id"}
    if out.success:
        return json_response(reply)
    return json_response({**reply, **error_body(out.error_message, 400)}, 400)
