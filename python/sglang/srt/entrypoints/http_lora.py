"""HTTP endpoints for LoRA adapters (docs/lora.md), upstream SGLang's names and reply shape.

| endpoint | body | reply |
|---|---|---|
| POST /load_lora_adapter | lora_name, lora_path, pinned?, weight_version? | {success, error_message, loaded_adapters}; 400 when refused |
| POST /unload_lora_adapter | lora_name | same |

Pause, continue and abort by adapter are the ``lora_name`` field of /pause_generation,
/continue_generation and /abort_request.
"""  # noqa: E501 - the table is documentation

from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from sglang.srt.entrypoints.openai.serving_base import error_body, json_response
from sglang.srt.managers.io_struct import (
    LoadLoRAAdapterReqInput,
    LoRAUpdateOutput,
    UnloadLoRAAdapterReqInput,
)
from sglang.srt.managers.tokenizer_manager_protocol import tokenizer_manager_of

router = APIRouter()


class LoadLoRAAdapterBody(BaseModel):
    model_config = ConfigDict(strict=True)

    lora_name: str
    lora_path: str
    pinned: bool = False
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


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterBody, request: Request) -> Response:
    """Unload an adapter; 400 while requests of it run or wait."""
    tm = tokenizer_manager_of(request)
    out = await tm.unload_lora_adapter(  # type: ignore[attr-defined]
        UnloadLoRAAdapterReqInput(body.lora_name)
    )
    return _reply(out)


def _reply(out: LoRAUpdateOutput) -> Response:
    reply = {k: v for k, v in asdict(out).items() if k != "req_id"}
    if out.success:
        return json_response(reply)
    return json_response({**reply, **error_body(out.error_message, 400)}, 400)
