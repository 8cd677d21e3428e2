"""Endpoints that upstream SGLang's clients (sglang-router, verl, slime, SkyRL) call beside the
native ones (docs/compatibility.md), on their own router included by ``create_app``.

| endpoint | body | reply |
|---|---|---|
| GET /get_load | - | ``[{"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens", "ts_tic"}]`` |
| GET /v1/loads | include?, dp_rank? | ``{"version", "timestamp", "dp_rank_count", "loads": [{"dp_rank", "num_running_reqs", "num_waiting_reqs", "num_total_reqs", "num_used_tokens", "max_total_num_tokens", "token_usage", "max_running_requests"}], "aggregate"}`` |
| GET /server_info, /model_info | - | as /get_server_info, /get_model_info (upstream's new names) |
| POST /update_weights_from_tensor | serialized_named_tensors (base64, one per TP rank), load_format?, flush_cache, abort_all_requests, weight_version? | {success, message}; 400 when refused |
| POST /init_weights_update_group | master_address, master_port, rank_offset, world_size, group_name, backend | {success, message}; 400 when it fails |
| POST /update_weights_from_distributed | name/dtype/shape or names/dtypes/shapes, group_name, flush_cache, ... | {success, message} |
| POST /destroy_weights_update_group | group_name | {success, message} |

Bodies are strict: a field this build does not know is a 400 naming it.
"""  # noqa: E501 - the table is documentation

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from sglang.srt.entrypoints.openai.serving_base import error_body, json_response
from sglang.srt.managers.io_struct import (
    DestroyWeightsUpdateGroupReqInput,
    InitWeightsUpdateGroupReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
)
from sglang.srt.managers.tokenizer_manager_protocol import (
    tokenizer_manager_of,
)

router = APIRouter()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class UpdateWeightsFromTensorBody(_Strict):
    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class InitWeightsUpdateGroupBody(_Strict):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class UpdateWeightsFromDistributedBody(_Strict):
    name: str | None = None
    dtype: str | None = None
    shape: list[int] | None = None
    names: list[str] | None = None
    dtypes: list[str] | None = None
    shapes: list[list[int]] | None = None
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None


class DestroyWeightsUpdateGroupBody(_Strict):
    group_name: str = "weight_update_group"


_tm = tokenizer_manager_of


@router.get("/get_load")
async def get_load(request: Request) -> Response:
    """The load of each scheduler as sglang-router reads it: requests running and waiting, and
    ``num_tokens``, the KV-cache tokens in use (held by requests or cached prefixes)."""
    loads = []
    for dp_rank, state in enumerate(await _tm(request).get_internal_state()):
        running, waiting = state["running_batch_size"], state["waiting_queue_size"]
        loads.append({
            "dp_rank": dp_rank,
            "num_reqs": running + waiting,
            "num_waiting_reqs": waiting,
            "num_tokens": state["max_total_num_tokens"] - state["available_kv_tokens"],
            "ts_tic": time.time(),
        })
    return json_response(loads)


@router.get("/v1/loads")
async def loads(request: Request, include: str = "core", dp_rank: int | None = None) -> Response:
    """Each scheduler's load in upstream's ``/v1/loads`` shape (slime's and sglang-router's
    idle checks read it): the ``core`` section per rank and an aggregate. Sections this build
    does not track (``disagg``, ``queues``, ``memory``, ``spec``) are left out whatever
    ``include`` asks; ``dp_rank`` keeps one rank."""
    from sglang import __version__

    states = await _tm(request).get_internal_state()
    rows = []
    for rank, state in enumerate(states):
        if dp_rank is not None and rank != dp_rank:
            continue
        running, waiting = state["running_batch_size"], state["waiting_queue_size"]
        capacity = state["max_total_num_tokens"]
        used = capacity - state["available_kv_tokens"]
        rows.append({
            "dp_rank": rank,
            "num_running_reqs": running,
            "num_waiting_reqs": waiting,
            "num_total_reqs": running + waiting,
            "num_used_tokens": used,
            "max_total_num_tokens": capacity,
            "token_usage": used / capacity if capacity else 0.0,
            "max_running_requests": state["max_running_requests"],
        })
    aggregate = {
        "total_running_reqs": sum(r["num_running_reqs"] for r in rows),
        "total_waiting_reqs": sum(r["num_waiting_reqs"] for r in rows),
        "total_reqs": sum(r["num_total_reqs"] for r in rows),
        "avg_token_usage": sum(r["token_usage"] for r in rows) / len(rows) if rows else 0.0,
    }
    return json_response({"version": __version__, "timestamp": time.time(),
                          "dp_rank_count": len(states), "loads": rows, "aggregate": aggregate})


@router.get("/server_info")
async def server_info(request: Request) -> Response:
    """Upstream's new name of ``/get_server_info`` (same reply)."""
    from sglang.srt.entrypoints.http_server import get_server_info

    return await get_server_info(request)


@router.get("/model_info")
async def model_info(request: Request) -> Response:
    """Upstream's new name of ``/get_model_info`` (same reply)."""
    from sglang.srt.entrypoints.http_server import get_model_info

    return await get_model_info(request)


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(
    body: UpdateWeightsFromTensorBody, request: Request
) -> Response:
    """Load the tensors of upstream's serialized payload (``MultiprocessingSerializer``,
    base64); 400 when the payload does not decode or the scheduler refuses the update.
    The payload is unpickled with an allowlist (tensors and plain data only)."""
    obj = UpdateWeightsFromTensorReqInput(
        load_format=body.load_format, flush_cache=body.flush_cache,
        abort_all_requests=body.abort_all_requests, weight_version=body.weight_version,
        serialized_named_tensors=list(body.serialized_named_tensors),
    )
    success, message = await _tm(request).update_weights_from_tensor(obj, request)
    return _reply(success, message)


@router.post("/init_weights_update_group")
async def init_weights_update_group(
    body: InitWeightsUpdateGroupBody, request: Request
) -> Response:
    """Join the trainer's weight-broadcast group (blocks until every rank joined)."""
    obj = InitWeightsUpdateGroupReqInput(**body.model_dump())
    return _reply(*await _tm(request).init_weights_update_group(obj, request))


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(
    body: UpdateWeightsFromDistributedBody, request: Request
) -> Response:
    """Receive the tensors that rank 0 broadcasts in the group, then load them."""
    obj = UpdateWeightsFromDistributedReqInput(**body.model_dump())
    return _reply(*await _tm(request).update_weights_from_distributed(obj, request))


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(
    body: DestroyWeightsUpdateGroupBody, request: Request
) -> Response:
    obj = DestroyWeightsUpdateGroupReqInput(body.group_name)
    return _reply(*await _tm(request).destroy_weights_update_group(obj, request))


def _reply(success: bool, message: str) -> Response:
    reply = {"success": success, "message": message}
    if success:
        return json_response(reply)
    return json_response({**reply, **error_body(message, 400)}, 400)
