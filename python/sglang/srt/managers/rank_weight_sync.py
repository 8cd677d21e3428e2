"""Broadcast weight sync with several scheduler ranks (``--tp-size``/``--dp-size`` > 1),
upstream's layout: every rank of the engine joins the trainer's group itself.

The trainer sizes the group as upstream does, ``world_size = 1 + engines * ranks`` (``ranks =
dp_size * tp_size``), and gives engine ``i`` ``rank_offset = 1 + i * ranks``; TP rank ``r`` of
DP replica ``d`` joins as ``rank_offset + d * tp_size + r``. Each rank receives every
broadcast tensor whole and loads its own part through the tensor-update path
(``WeightUpdater.update_from_tensor``), so a broadcast reaches each rank without a copy
through the frontend. With a single scheduler rank
the frontend joins for it (managers/weights_update_group.py, the same group layout); the
frontend also refuses a ``rank_offset``/``world_size`` that cannot hold every rank, before any
rank joins.

The three requests are control requests: the DP controller sends them to every replica, TP
rank 0 hands them to every rank of its replica in the same loop turn (tp_group_io), the ranks
of a replica agree on a refusal before any joins or loads, and one merged reply goes back.
Joining blocks the loop until the trainer and every rank have met, as upstream's scheduler
does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang.srt.managers.io_struct import (
    DestroyWeightsUpdateGroupReqInput,
    InitWeightsUpdateGroupReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightsFromTensorReqOutput,
    WeightsUpdateGroupReqOutput,
)
from sglang.srt.managers.weight_updater import WeightUpdater, agree_on_refusal
from sglang.srt.managers.weights_update_group import WeightsUpdateGroups


class RankWeightSync:
    """This rank's membership of trainers' weight-broadcast groups, by group name."""

    def __init__(self, updater: WeightUpdater, rank_in_engine: int) -> None:
        """``rank_in_engine``: ``dp_rank * tp_size + tp_rank``, added to the trainer's
        ``rank_offset``."""
        self.updater = updater
        self.rank_in_engine = rank_in_engine
        self.groups = WeightsUpdateGroups()

    def handlers(self) -> list[tuple[type, Callable[[Any], Any]]]:
        """(request type, handler) pairs for the scheduler's dispatcher."""
        return [
            (InitWeightsUpdateGroupReqInput, self.init_group),
            (UpdateWeightsFromDistributedReqInput, self.update),
            (DestroyWeightsUpdateGroupReqInput, self.destroy),
        ]

    def init_group(self, obj: InitWeightsUpdateGroupReqInput) -> WeightsUpdateGroupReqOutput:
        """Join the group once every rank has accepted the arguments (none joins otherwise)."""
        try:
            self.groups.check_init(obj, self.rank_in_engine)
            error = None
        except ValueError as e:
            error = str(e)
        error = agree_on_refusal(error)
        if error is None:
            try:
                self.groups.init_group(obj, self.rank_in_engine)
            except (ValueError, RuntimeError) as e:
                error = str(e)
            error = agree_on_refusal(error)
        if error is not None:
            return WeightsUpdateGroupReqOutput(
                False, f"Failed to initialize the weights update group: {error}", obj.req_id
            )
        return WeightsUpdateGroupReqOutput(
            True, "Succeeded to initialize the weights update group.", obj.req_id
        )

    def update(self, obj: UpdateWeightsFromDistributedReqInput) -> UpdateWeightsFromTensorReqOutput:
        """Receive the broadcast tensors, then load them as a tensor update (validated on every
        rank before any changes)."""
        named: list[tuple[str, Any]] = []
        try:
            named = self.groups.receive(obj)
            error = None
        except (ValueError, RuntimeError) as e:
            error = str(e)
        error = agree_on_refusal(error)
        if error is not None:
            return UpdateWeightsFromTensorReqOutput(
                False, f"Failed to receive the weights: {error}", req_id=obj.req_id
            )
        return self.updater.update_from_tensor(
            UpdateWeightsFromTensorReqInput(
                named,
                obj.load_format,
                obj.flush_cache,
                obj.abort_all_requests,
                obj.weight_version,
                req_id=obj.req_id,
            )
        )

    def destroy(self, obj: DestroyWeightsUpdateGroupReqInput) -> WeightsUpdateGroupReqOutput:
        """Leave the group on every rank (a name no rank joined is refused)."""
        try:
            self.groups.destroy(obj.group_name)
            error = None
        except ValueError as e:
            error = str(e)
        error = agree_on_refusal(error)
        if error is not None:
            return WeightsUpdateGroupReqOutput(False, error, obj.req_id)
        return WeightsUpdateGroupReqOutput(
            True, "Succeeded to destroy the weights update group.", obj.req_id
        )
