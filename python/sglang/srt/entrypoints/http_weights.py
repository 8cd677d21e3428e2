"""HTTP endpoints for weight updates (docs/weights.md) and for releasing / resuming memory
(docs/memory.md), on their own router.

``create_app`` includes :data:`router`; the app's guard middleware (auth, body limit) and
error handlers cover these endpoints like every other.

| endpoint | body | reply |
|---|---|---|
| POST /update_weights_from_disk | model_path, load_format?, weight_version?, flush_cache, abort_all_requests | {success, message, num_paused_requests}; 400 when refused |
| GET/POST /get_weights_by_name | name, truncate_size | nested float lists; 400 when unknown |
| POST /update_weight_version | new_version, abort_all_requests (false) | {success, message, new_version, num_aborted} |
| POST /release_memory_occupation | tags? (null = all) | {success, message, released_tags}; 400 when refused |
| POST /resume_memory_occupation | tags? (null = all) | {success, message, released_tags} |
"""  # noqa: E501 - the table is documentation

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from sglang.srt.entrypoints import replies
from sglang.srt.entrypoints.openai.serving_base import error_body, json_response
from sglang.srt.managers.io_struct import (
    GetWeightsByNameReqInput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightVersionReqInput,
)
from sglang.srt.managers.tokenizer_manager_protocol import (
    tokenizer_manager_of,
)

router = APIRouter()


class UpdateWeightsFromDiskBody(BaseModel):
    model_config = ConfigDict(strict=True)

    model_path: str
    load_format: str | None = None
    weight_version: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False


class GetWeightsByNameBody(BaseModel):
    model_config = ConfigDict(strict=True)

    name: str
    truncate_size: int = 100


class UpdateWeightVersionBody(BaseModel):
    model_config = ConfigDict(strict=True)

    new_version: str
    abort_all_requests: bool = False  # upstream defaults to true; relabelling alone aborts nothing


class MemoryOccupationBody(BaseModel):
    model_config = ConfigDict(strict=True)

    tags: list[str] | None = None  # "kv_cache", "weights", "cuda_graph"; null = all


_tm = tokenizer_manager_of


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(body: UpdateWeightsFromDiskBody, request: Request) -> Response:
    """Swap in the checkpoint at ``model_path``; a refusal (400) leaves the weights as they were.
    The body always has SGLang's keys; a failure adds the usual ``error`` object."""
    out = await _tm(request).update_weights_from_disk(UpdateWeightFromDiskReqInput(
        body.model_path, body.load_format, body.abort_all_requests, body.weight_version,
        body.flush_cache,
    ))
    reply = replies.disk_update_reply(out)
    if out.success:
        return json_response(reply)
    return json_response({**reply, **error_body(out.message, 400)}, 400)


@router.api_route("/get_weights_by_name", methods=["GET", "POST"])
async def get_weights_by_name(body: GetWeightsByNameBody, request: Request) -> Response:
    """The weight's values (first dimension cut to ``truncate_size``); 400 for an unknown name."""
    out = await _tm(request).get_weights_by_name(
        GetWeightsByNameReqInput(body.name, body.truncate_size)
    )
    if out.parameter is None:
        raise ValueError(out.message)
    return json_response(out.parameter)


@router.post("/update_weight_version")
async def update_weight_version(body: UpdateWeightVersionBody, request: Request) -> Response:
    """Relabel the current weights; aborts every request only when ``abort_all_requests``."""
    out = await _tm(request).update_weight_version(
        UpdateWeightVersionReqInput(body.new_version, body.abort_all_requests)
    )
    if not out.success:
        raise ValueError(out.message)
    return json_response(replies.weight_version_reply(out))


@router.api_route("/release_memory_occupation", methods=["GET", "POST"])  # GET: see http_guard
async def release_memory_occupation(
    request: Request, body: MemoryOccupationBody | None = None
) -> Response:
    """Free the KV cache and/or weights until resumed; 400 for an unknown tag or while a
    request holds KV."""
    tags = (body or MemoryOccupationBody()).tags  # a bad tag: ValueError -> 400
    out = await _tm(request).release_memory_occupation(ReleaseMemoryOccupationReqInput(tags))
    return _memory_reply(out)


@router.api_route("/resume_memory_occupation", methods=["GET", "POST"])  # GET: see http_guard
async def resume_memory_occupation(
    request: Request, body: MemoryOccupationBody | None = None
) -> Response:
    """Allocate the released memory of ``tags`` again (weights reloaded from their checkpoint)."""
    tags = (body or MemoryOccupationBody()).tags
    out = await _tm(request).resume_memory_occupation(ResumeMemoryOccupationReqInput(tags))
    return _memory_reply(out)


def _memory_reply(out: Any) -> Response:
    reply = replies.memory_reply(out)
    if out.success:
        return json_response(reply)
    return json_response({**reply, **error_body(out.message, 400)}, 400)
