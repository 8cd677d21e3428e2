"""The scheduler's weight-update handlers: updates from disk and from tensors, reading weights
back, and the weight version label (docs/weights.md).

Everything runs on the scheduler's loop between two forward passes, so a batch never sees a
half-updated model. Order of an update:

1. validate (model_loader.weight_update: on a meta twin; a refusal changes nothing at all);
2. abort every request if asked;
3. load in place; bump the *weight generation* (``WeightState.generation``);
4. relabel if a version is given (``WeightState.version``); every later token carries it;
5. make old-weight KV unmatchable: a full flush when asked and nothing holds KV, else
   ``tree_cache.invalidate()`` (requests paused in place keep their old-weight KV, which is
   never cached: see req_kv).

With tensor parallelism every rank runs the same handler in the same loop turn: each loads
its shard of the full tensors (weight loaders narrow them), the ranks agree on validation
(step 1 refused anywhere is refused on every rank, naming the rank, before any rank changes
anything) and ``get_weights_by_name`` gathers the full weight. Upstream's per-rank
``serialized_named_tensors`` list gives rank r entry r.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Protocol

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed.parallel_state import (
    get_tp_group,
    tensor_model_parallel_all_gather_object,
)
from sglang.srt.managers.control_hooks import SchedulerHooks
from sglang.srt.managers.control_validation import NOT_LOADABLE
from sglang.srt.managers.io_struct import (
    GetWeightsByNameReqInput,
    GetWeightsByNameReqOutput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightFromDiskReqOutput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightsFromTensorReqOutput,
    UpdateWeightVersionReqInput,
    UpdateWeightVersionReqOutput,
)
from sglang.srt.managers.memory_occupation import MemoryOccupation
from sglang.srt.managers.weight_state import WeightState
from sglang.srt.model_executor.model_runner import unwrap_local_serialized
from sglang.srt.model_loader import weight_update as wu
from sglang.srt.utils.multiprocessing_serializer import decode_named_tensors

if TYPE_CHECKING:
    from torch import nn

logger = logging.getLogger(__name__)

_ABORT_MESSAGE = "Aborted by a weight update"
_RELEASED = (
    "The weights are released (release_memory_occupation); call resume_memory_occupation "
    "with tags ['weights'] first"
)


class HasModel(Protocol):
    """The owner of the live model (the ModelRunner)."""

    model: nn.Module


class WeightUpdater:
    """Weight updates for one scheduler. The only writer of its :class:`WeightState` (label and
    generation).

    ``source`` is the checkpoint the live weights came from (None after a tensor update, whose
    source cannot be re-read); a load that fails after validation reloads it.
    """

    def __init__(
        self,
        runner: HasModel,
        model_config: ModelConfig,
        state: WeightState,
        memory: MemoryOccupation,
        hooks: SchedulerHooks,
        custom_weight_loader: list[str] | None = None,
    ) -> None:
        self.runner = runner
        self.model_config = model_config
        self.state = state
        self.memory = memory
        self.hooks = hooks
        self.source: ModelConfig | None = (
            None if model_config.load_format == "dummy" else model_config
        )
        self._meta_model: nn.Module | None = None
        # Import paths a tensor update may name as its load_format (--custom-weight-loader).
        self.custom_weight_loader = list(custom_weight_loader or [])

    @property
    def version(self) -> str:
        return self.state.version

    @property
    def model(self) -> nn.Module:
        return self.runner.model

    def meta_model(self) -> nn.Module:
        if self._meta_model is None:
            self._meta_model = wu.build_meta_model(self.model, self.model_config)
        return self._meta_model

    # ---- handlers ----------------------------------------------------------------------------
    def update_from_disk(self, recv: UpdateWeightFromDiskReqInput) -> UpdateWeightFromDiskReqOutput:
        """Validate, then swap in the checkpoint at ``recv.model_path``."""
        if self._released():
            return UpdateWeightFromDiskReqOutput(False, _RELEASED, req_id=recv.req_id)
        new_config: ModelConfig | None = None
        try:
            new_config = self._validate_disk(recv.model_path, recv.load_format)
            error = None
        except Exception as e:  # any refusal, including unreadable configs, changes nothing
            error = str(e)
        error = agree_on_refusal(error)
        if error is not None or new_config is None:
            logger.warning("Refused weight update from %s: %s", recv.model_path, error)
            return UpdateWeightFromDiskReqOutput(
                False, f"Update refused: {error}", req_id=recv.req_id
            )
        self._abort_all(recv.abort_all_requests)
        try:
            wu.load_checkpoint(self.model, new_config)
            self.source = new_config
            ok, message = True, f"Succeeded to update model weights from {recv.model_path}."
        except Exception as e:  # I/O errors after validation: reload the previous weights
            ok, message = False, self._recover(recv.model_path, e)
        self._commit(recv.weight_version if ok else None, recv.flush_cache)
        return UpdateWeightFromDiskReqOutput(
            ok, message, self.hooks.num_alive(), req_id=recv.req_id
        )

    def update_from_tensor(
        self, recv: UpdateWeightsFromTensorReqInput
    ) -> UpdateWeightsFromTensorReqOutput:
        """Validate every tensor first, then copy them all in. A custom loader
        (``load_format`` listed by --custom-weight-loader) is called instead."""
        if self._released():
            return UpdateWeightsFromTensorReqOutput(False, _RELEASED, req_id=recv.req_id)
        if recv.load_format not in wu.TENSOR_LOAD_FORMATS:
            return self._update_with_custom_loader(recv)
        named_tensors: list[tuple[str, Any]] = []
        try:
            named_tensors = rank_named_tensors(recv)
            wu.validate_tensors(self.meta_model(), named_tensors, recv.load_format)
            error = None
        except Exception as e:  # whatever the caller sent, a refusal changes nothing
            error = str(e)
        error = agree_on_refusal(error)
        if error is not None:
            logger.warning("Refused tensor weight update: %s", error)
            return UpdateWeightsFromTensorReqOutput(False, error, req_id=recv.req_id)
        self._abort_all(recv.abort_all_requests)
        try:
            wu.load_tensors(self.model, named_tensors, recv.load_format)
            ok, message = True, f"Succeeded to update {len(named_tensors)} tensor(s)."
        except Exception as e:  # not expected after validation; the copy may be partial
            logger.exception("Tensor weight update failed after validation")
            ok, message = False, f"Failed to copy the tensors: {e}; the model may be partial"
        self.source = None
        self._commit(recv.weight_version if ok else None, recv.flush_cache)
        return UpdateWeightsFromTensorReqOutput(
            ok, message, self.hooks.num_alive(), req_id=recv.req_id
        )

    def _update_with_custom_loader(
        self, recv: UpdateWeightsFromTensorReqInput
    ) -> UpdateWeightsFromTensorReqOutput:
        """Upstream's ``custom_loader(model, named_tensors)``. Only a loader that is not listed
        or does not import is refused unchanged; the loader itself is not dry-run, so one that
        raises may have changed part of the model."""
        assert recv.load_format is not None
        named_tensors: list[tuple[str, Any]] = []
        try:
            loader = wu.resolve_custom_loader(recv.load_format, self.custom_weight_loader)
            named_tensors = rank_named_tensors(recv)
            error = None
        except (wu.WeightUpdateError, ValueError) as e:
            error = str(e)
        error = agree_on_refusal(error)
        if error is not None:
            logger.warning("Refused tensor weight update: %s", error)
            return UpdateWeightsFromTensorReqOutput(False, error, req_id=recv.req_id)
        self._abort_all(recv.abort_all_requests)
        try:
            wu.load_with_custom_loader(self.model, loader, named_tensors)
            ok, message = True, f"Succeeded to update the weights with {recv.load_format}."
        except Exception as e:
            logger.exception("Custom weight loader %s failed", recv.load_format)
            ok = False
            message = (
                f"Custom weight loader {recv.load_format} failed: {e}; the model may be partial"
            )
        self.source = None
        self._commit(recv.weight_version if ok else None, recv.flush_cache)
        return UpdateWeightsFromTensorReqOutput(
            ok, message, self.hooks.num_alive(), req_id=recv.req_id
        )

    def get_weights_by_name(self, recv: GetWeightsByNameReqInput) -> GetWeightsByNameReqOutput:
        if self._released():
            return GetWeightsByNameReqOutput(None, _RELEASED, req_id=recv.req_id)
        try:
            values = wu.get_weights_by_name(self.model, recv.name, int(recv.truncate_size))
        except (wu.WeightUpdateError, TypeError, ValueError) as e:
            return GetWeightsByNameReqOutput(None, str(e), req_id=recv.req_id)
        return GetWeightsByNameReqOutput(values, req_id=recv.req_id)

    def update_weight_version(
        self, recv: UpdateWeightVersionReqInput
    ) -> UpdateWeightVersionReqOutput:
        """Relabel the current weights; tokens from now on carry ``recv.new_version``."""
        if not isinstance(recv.new_version, str) or not recv.new_version:
            return UpdateWeightVersionReqOutput(
                False, "new_version must be a non-empty string", self.version, req_id=recv.req_id
            )
        num_aborted = self._abort_all(recv.abort_all_requests)
        self.state.version = recv.new_version
        return UpdateWeightVersionReqOutput(
            True,
            f"Weight version updated to {recv.new_version}",
            recv.new_version,
            num_aborted,
            req_id=recv.req_id,
        )

    def restore_after_resume(self) -> str:
        """The weights were just re-allocated (zero-filled) by resume_memory_occupation: reload
        ``source`` if there is one, and treat it as a weight change. Returns a note for the
        caller."""
        if self.source is None:
            note = (
                "The weights were last set from tensors (or are dummy): they are zero until "
                "updated; push them with update_weights_from_tensor before generating."
            )
        else:
            wu.load_checkpoint(self.model, self.source)
            note = f"Weights reloaded from {self.source.model_path}."
        self._commit(None, flush=True)
        return note

    # ---- steps -------------------------------------------------------------------------------
    def _released(self) -> bool:
        return self.memory.weights_released()

    def _validate_disk(self, model_path: str, load_format: str | None) -> ModelConfig:
        if not isinstance(model_path, str) or not model_path:
            raise wu.WeightUpdateError("model_path must be a non-empty string")
        if not os.path.exists(os.path.expanduser(model_path)):
            # Same words as the edge check: say nothing about which paths exist on this host.
            raise wu.WeightUpdateError(f"model_path: {NOT_LOADABLE}")
        load_format = load_format or self.model_config.load_format
        if load_format == "dummy":
            raise wu.WeightUpdateError("load_format='dummy' has no weights to load")
        live = self.model_config
        new_config = ModelConfig(
            model_path,
            context_length=live.context_len,
            dtype=_dtype_name(live),
            trust_remote_code=live.trust_remote_code,
            device=live.device,
            load_format=load_format,
            model_override_args=live.model_override_args,
        )
        wu.check_config_compatible(live, new_config)
        wu.validate_checkpoint(self.meta_model(), new_config)
        return new_config

    def _recover(self, model_path: str, error: Exception) -> str:
        """After a failed load: reload ``source``; returns the failure message."""
        logger.error("Loading weights from %s failed after validation: %s", model_path, error)
        if self.source is None:
            return (
                f"Failed to load {model_path}: {error}. The previous weights came from tensors "
                "and cannot be restored: the model may be partially updated; load a full "
                "checkpoint before generating."
            )
        try:
            wu.load_checkpoint(self.model, self.source)
        except Exception as e:
            logger.exception("Restoring %s failed too", self.source.model_path)
            self.source = None
            return f"Failed to load {model_path}: {error}; restoring the old weights failed: {e}"
        return (
            f"Failed to load {model_path}: {error}; the previous weights were reloaded from "
            f"{self.source.model_path}."
        )

    def _abort_all(self, abort: bool) -> int:
        if not abort:
            return 0
        return self.hooks.abort_all(_ABORT_MESSAGE)

    def _commit(self, weight_version: str | None, flush: bool) -> None:
        """The weights changed: new generation, optional new label, no stale KV matchable."""
        self.state.generation += 1
        if weight_version is not None:
            self.state.version = weight_version
        if not (flush and self.hooks.num_kv_holders() == 0 and self.hooks.flush_cache()):
            self.hooks.invalidate_cache()


def rank_named_tensors(recv: UpdateWeightsFromTensorReqInput) -> list[tuple[str, Any]]:
    """The (name, full tensor) pairs this rank loads: entry ``tp_rank`` of upstream's
    per-rank ``serialized_named_tensors`` list (one entry per rank; with one rank, the first
    of any non-empty list), else ``named_tensors`` (the same for every rank). Either way a
    ``LocalSerializedTensor`` value becomes its payload for this rank. ValueError for a list
    of the wrong length or an entry that does not decode."""
    serialized = recv.serialized_named_tensors
    group = get_tp_group()
    if serialized is None:
        return unwrap_local_serialized(list(recv.named_tensors), group.rank)
    if not isinstance(serialized, list) or not serialized:
        raise ValueError("serialized_named_tensors must be a non-empty list")
    if group.world_size > 1 and len(serialized) != group.world_size:
        raise ValueError(
            f"serialized_named_tensors has {len(serialized)} entries; with --tp-size "
            f"{group.world_size} it needs one per tensor-parallel rank"
        )
    return decode_named_tensors(serialized, group.rank, recv.load_format)


def agree_on_refusal(error: str | None) -> str | None:
    """Every rank's verdict on a validation (None: accepted); returns None only when every
    rank accepted, else the refusals, each naming its rank (one rank: its own message). A
    collective: every rank calls it for the same request."""
    errors = tensor_model_parallel_all_gather_object(error)
    if len(errors) == 1:
        return error
    refusals = [f"rank {rank}: {e}" for rank, e in enumerate(errors) if e is not None]
    return "; ".join(refusals) if refusals else None


def _dtype_name(model_config: ModelConfig) -> str:
    """The ``--dtype`` value that resolves to ``model_config.dtype`` again."""
    return str(model_config.dtype).removeprefix("torch.")
