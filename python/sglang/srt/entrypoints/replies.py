"""The reply payloads that ``sglang.Engine`` returns and the HTTP server sends: built here once,
so the two front ends cannot drift apart (each adds only its transport: a status code, or a
ValueError for a refusal)."""

from __future__ import annotations

from typing import Any

from sglang.srt.managers.io_struct import (
    ContinueGenerationReqOutput,
    PauseGenerationReqOutput,
    ReleaseMemoryOccupationReqOutput,
    ResumeMemoryOccupationReqOutput,
    UpdateWeightFromDiskReqOutput,
    UpdateWeightVersionReqOutput,
)
from sglang.srt.managers.tokenizer_manager_protocol import TokenizerManagerProtocol

PAUSED_MESSAGE = "Generation paused successfully."
CONTINUED_MESSAGE = "Generation continued successfully."


def server_info(
    server_args: dict[str, Any],
    scheduler_info: dict[str, Any],
    internal_states: list[dict[str, Any]],
) -> dict[str, Any]:
    """``get_server_info``: the server arguments (API key redacted), the scheduler's ready
    info, one internal state per scheduler, and the package version. ``weight_version`` is
    the current one (as upstream, whose updates rewrite that server argument)."""
    from sglang import __version__

    args = dict(server_args)
    if args.get("api_key"):
        args["api_key"] = "<redacted>"
    if internal_states and internal_states[0].get("weight_version") is not None:
        args["weight_version"] = internal_states[0]["weight_version"]
    return {
        **args,
        **scheduler_info,
        "internal_states": internal_states,
        "version": __version__,
    }


async def model_info(
    tm: TokenizerManagerProtocol, tokenizer_path: str | None, scheduler_info: dict[str, Any]
) -> dict[str, Any]:
    """``get_model_info``: the checkpoint served now (a disk update changes it), the current
    weight version, and upstream's other keys: the config's ``model_type`` and
    ``architectures`` (from the scheduler's ready info; a disk update keeps them), and what
    this build has not (no preferred sampling params, no image or audio input)."""
    states = await tm.get_internal_state()
    return {
        "model_path": tm.model_path,
        "tokenizer_path": tokenizer_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": states[0].get("weight_version") if states else None,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": scheduler_info.get("model_type"),
        "architectures": scheduler_info.get("architectures"),
    }


def pause_reply(out: PauseGenerationReqOutput) -> dict[str, Any]:
    """A pause that took effect, with what it did."""
    return {
        "message": PAUSED_MESSAGE,
        "status": "ok",
        "mode": out.mode,
        "num_running": out.num_running,
        "num_retracted": out.num_retracted,
        "num_aborted": out.num_aborted,
        "num_waiting": out.num_waiting,
        "flushed": out.flushed,
    }


def continue_reply(out: ContinueGenerationReqOutput) -> dict[str, Any]:
    return {"message": CONTINUED_MESSAGE, "status": "ok", "was_paused": out.was_paused}


def is_paused_reply(states: list[dict[str, Any]]) -> dict[str, Any]:
    """``/is_paused`` from the schedulers' internal states (one per DP rank): paused only when
    every rank is; the mode and time of rank 0 (the latest ``paused_since`` of all ranks)."""
    paused = all(state["engine_paused"] for state in states)
    since = [state["paused_since"] for state in states if state["paused_since"] is not None]
    return {
        "is_paused": paused,
        "pause_mode": states[0]["pause_mode"] if paused else None,
        "paused_since": max(since) if paused and since else None,
    }


def abort_reply(num_aborted: int) -> dict[str, Any]:
    return {"success": True, "num_aborted": num_aborted}


def memory_reply(
    out: ReleaseMemoryOccupationReqOutput | ResumeMemoryOccupationReqOutput,
) -> dict[str, Any]:
    """release / resume_memory_occupation: the tags still released after the call."""
    return {"success": out.success, "message": out.message, "released_tags": out.released_tags}


def disk_update_reply(out: UpdateWeightFromDiskReqOutput) -> dict[str, Any]:
    return {
        "success": out.success,
        "message": out.message,
        "num_paused_requests": out.num_paused_requests,
    }


def weight_version_reply(out: UpdateWeightVersionReqOutput) -> dict[str, Any]:
    return {
        "success": True,
        "message": out.message,
        "new_version": out.new_version,
        "num_aborted": out.num_aborted,
    }
