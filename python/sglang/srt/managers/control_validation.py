"""Strict checks of control requests (pause, abort, weights, memory), before they are sent.

:func:`check_control_request` is called by the TokenizerManager for every control request, so
the HTTP and Engine APIs share it. Labels and paths are bounded in length and valid Unicode;
modes are from their fixed set; numbers are finite. A disk checkpoint path must name a
loadable checkpoint (a directory with ``config.json`` or a ``.gguf`` file), and the message is
the same whatever else the path is, so a caller learns nothing about other files.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from sglang.srt.managers.field_checks import (
    InvalidRequestError,
    check_bool,
    check_choice,
    check_int,
    check_list,
    check_number,
    check_str,
)
from sglang.srt.managers.io_struct import (
    MAX_VERSION_LEN,
    AbortReq,
    GetWeightsByNameReqInput,
    PauseGenerationReqInput,
    ProfileReq,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightVersionReqInput,
)

# Longest label (weight versions, memory tags).
MAX_LABEL_LEN = MAX_VERSION_LEN
# Longest checkpoint path, in characters (Linux's PATH_MAX).
MAX_PATH_LEN = 4096
# Longest rid prefix an abort may name, and the longest weight name.
MAX_NAME_LEN = 1024
# Longest pause mode name (the modes and their aliases are short words).
MAX_MODE_LEN = 32
# Longest pause lease: one week.
MAX_PAUSE_TIMEOUT_S = 7 * 24 * 3600.0
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy", "direct")
# Tensor updates: HF names (None/"auto"), parameter names ("direct"), a flattened bucket, or
# the import path of a custom loader listed by --custom-weight-loader (the scheduler checks).
TENSOR_LOAD_FORMATS = (None, "auto", "direct", "flattened_bucket")
MEMORY_TAGS_MAX = 8
NOT_LOADABLE = "is not a loadable checkpoint (a directory with config.json, or a .gguf file)"


def _check_optional_label(param: str, value: Any) -> None:
    if value is not None:
        check_str(param, value, MAX_LABEL_LEN, min_len=1)


def _check_load_format(value: Any) -> None:
    if value is not None:
        check_choice("load_format", value, LOAD_FORMATS)


def check_checkpoint_path(path: Any) -> None:
    """``path`` names a checkpoint this engine can load; one message for every other case
    (missing, unreadable, a plain file, ...), so the reply does not tell what exists."""
    check_str("model_path", path, MAX_PATH_LEN, min_len=1)
    if "\x00" in path:
        raise InvalidRequestError("model_path", NOT_LOADABLE)
    full = os.path.expanduser(path)
    is_dir = os.path.isdir(full) and os.access(os.path.join(full, "config.json"), os.R_OK)
    is_gguf = full.endswith(".gguf") and os.path.isfile(full) and os.access(full, os.R_OK)
    if not (is_dir or is_gguf):
        raise InvalidRequestError("model_path", NOT_LOADABLE)


def _check_pause(req: PauseGenerationReqInput) -> None:
    # The scheduler resolves the mode (aliases included) and refuses unknown ones by name.
    check_str("mode", req.mode, MAX_MODE_LEN, min_len=1)
    check_bool("clear_cache", req.clear_cache)
    if req.timeout_s is not None:
        check_number("timeout_s", req.timeout_s, 0.0, MAX_PAUSE_TIMEOUT_S)


def _check_abort(req: AbortReq) -> None:
    check_str("rid", req.rid, MAX_NAME_LEN)
    check_bool("abort_all", req.abort_all)
    check_bool("match_prefix", req.match_prefix)


def _check_disk_update(req: UpdateWeightFromDiskReqInput) -> None:
    _check_load_format(req.load_format)
    _check_optional_label("weight_version", req.weight_version)
    check_bool("flush_cache", req.flush_cache)
    check_bool("abort_all_requests", req.abort_all_requests)
    check_checkpoint_path(req.model_path)


def _check_tensor_update(req: UpdateWeightsFromTensorReqInput) -> None:
    if req.load_format not in TENSOR_LOAD_FORMATS:
        check_str("load_format", req.load_format, MAX_NAME_LEN, min_len=1)
        if "." not in req.load_format:
            raise InvalidRequestError(
                "load_format",
                f"{req.load_format!r} is not a tensor load format: use None, "
                "'direct', 'flattened_bucket' or a custom loader listed by "
                "--custom-weight-loader ('pkg.module.func')",
            )
    _check_optional_label("weight_version", req.weight_version)
    check_bool("flush_cache", req.flush_cache)
    check_bool("abort_all_requests", req.abort_all_requests)
    check_list("named_tensors", req.named_tensors, 1 << 20)
    for i, item in enumerate(req.named_tensors):
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise InvalidRequestError(f"named_tensors[{i}]", "must be a (name, tensor) pair")
        check_str(f"named_tensors[{i}].name", item[0], MAX_NAME_LEN, min_len=1)


def _check_version(req: UpdateWeightVersionReqInput) -> None:
    check_str("new_version", req.new_version, MAX_LABEL_LEN, min_len=1)
    check_bool("abort_all_requests", req.abort_all_requests)


def _check_get_weights(req: GetWeightsByNameReqInput) -> None:
    check_str("name", req.name, MAX_NAME_LEN, min_len=1)
    check_int("truncate_size", req.truncate_size, 0, 2**31 - 1)


def _check_profile(req: ProfileReq) -> None:
    check_choice("action", req.action, ("start", "stop"))
    if req.output_dir is not None:
        check_str("output_dir", req.output_dir, MAX_PATH_LEN, min_len=1)
    for name in ("start_step", "num_steps"):
        if getattr(req, name) is not None:
            check_int(name, getattr(req, name), 0 if name == "start_step" else 1, 2**31 - 1)
    if req.activities is not None:
        check_list("activities", req.activities, 4)
        for i, activity in enumerate(req.activities):
            check_choice(f"activities[{i}]", activity, ("CPU", "GPU"))
    check_bool("with_stack", req.with_stack)
    check_bool("record_shapes", req.record_shapes)
    if req.profile_prefix is not None:
        check_str("profile_prefix", req.profile_prefix, MAX_LABEL_LEN)
        if os.sep in req.profile_prefix:
            raise InvalidRequestError("profile_prefix", "must be a file name prefix, not a path")


def _check_memory(req: ReleaseMemoryOccupationReqInput | ResumeMemoryOccupationReqInput) -> None:
    if req.tags is None:
        return
    check_list("tags", req.tags, MEMORY_TAGS_MAX)
    for i, tag in enumerate(req.tags):
        check_str(f"tags[{i}]", tag, MAX_LABEL_LEN)


_CHECKS: dict[type, Callable[[Any], None]] = {
    PauseGenerationReqInput: _check_pause,
    AbortReq: _check_abort,
    UpdateWeightFromDiskReqInput: _check_disk_update,
    UpdateWeightsFromTensorReqInput: _check_tensor_update,
    UpdateWeightVersionReqInput: _check_version,
    GetWeightsByNameReqInput: _check_get_weights,
    ReleaseMemoryOccupationReqInput: _check_memory,
    ResumeMemoryOccupationReqInput: _check_memory,
    ProfileReq: _check_profile,
}


def check_control_request(req: Any) -> None:
    """Check ``req`` by its type; types without fields to check (flush, continue, internal
    state) pass. Raises InvalidRequestError naming the field and the rule."""
    check = _CHECKS.get(type(req))
    if check is not None:
        check(req)
