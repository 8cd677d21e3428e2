"""Merging the replies of every rank into the one reply the frontend awaits.

The DP controller fans a control request out to the ranks; each rank answers with the same
``req_id``. Once every targeted rank has answered, :func:`merge_replies` builds one reply of
the same type (pure: no sockets, unit-tested without processes). Tensor-parallel rank 0 merges
its group's replies the same way (:func:`merge_tp_replies`), except that TP ranks serve the
same requests, so their counts are not summed but rank 0's, and the state is rank 0's with a
summary of every rank's KV state (``tp_ranks``):

| field                                   | merged as                                          |
|-----------------------------------------|----------------------------------------------------|
| ``success``, ``flushed``                | true only when true on every rank                  |
| ``was_paused``                          | true when true on any rank                         |
| ``num_*``, ``flushed_items`` (ints)     | summed over DP ranks (TP: rank 0's)                |
| ``message`` / ``error_msg`` /           | on failure: ``"DP rank R: reason"`` per failed rank |
| ``error_message`` (LoRA)                | (``"TP rank R: reason"`` within a TP group; a LoRA |
|                                         | refusal the TP ranks agreed on: said once)         |
| ``released_tags``                       | union (released on some rank = not fully usable)   |
| ``loaded_adapters`` (LoRA)              | the adapters loaded on every rank (a request may   |
|                                         | go to any replica)                                 |
| ``internal_state``                      | one dict per rank in ``internal_states``, each     |
|                                         | with its ``dp_rank``                                |
| anything else (mode, new_version, ...)  | rank 0's (the lowest rank that answered)           |
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sglang.srt.managers.io_struct import GetInternalStateReqOutput, LoRAUpdateOutput

_ALL_FIELDS = frozenset({"success", "flushed"})
_ANY_FIELDS = frozenset({"was_paused"})
_MESSAGE_FIELDS = ("message", "error_msg", "error_message")


# The per-rank fields a TP group's state reports for each rank (``tp_ranks``): what proves
# that no rank leaked KV (engine_test_utils.assert_kv_all_back) and that the ranks agree.
TP_RANK_STATE_KEYS = (
    "running_batch_size", "waiting_queue_size", "chunked_req_is_none", "req_to_token_pool_used",
    "private_kv_tokens", "available_kv_tokens", "free_kv_tokens", "max_total_num_tokens",
    "tree_cache_size", "engine_paused", "weight_version", "num_loop_turns", "forward_ct_decode",
    # LoRA: every rank must hold the same adapters, in the same slots, paused alike.
    "lora_adapters", "paused_loras",
)


def merge_tp_replies(replies: dict[int, Any]) -> Any:
    """One reply standing for a tensor-parallel group's ``replies`` (TP rank -> reply)."""
    first = replies[min(replies)]
    if isinstance(first, GetInternalStateReqOutput):
        ranks = [
            {"tp_rank": r, **{k: replies[r].internal_state.get(k) for k in TP_RANK_STATE_KEYS}}
            for r in sorted(replies)
        ]
        state = {**first.internal_state, "tp_size": len(replies), "tp_ranks": ranks}
        return GetInternalStateReqOutput(state, req_id=first.req_id)
    merged = merge_replies(replies, label="TP rank", sum_counts=False)
    messages = {getattr(r, "error_message", None) for r in replies.values()}
    if isinstance(first, LoRAUpdateOutput) and len(messages) == 1:
        # The ranks agreed on the verdict (agree_on_refusal): the message names the refusing
        # ranks already; say it once, not once per rank.
        merged = dataclasses.replace(merged, error_message=first.error_message)
    return merged


def merge_replies(
    replies: dict[int, Any], label: str = "DP rank", sum_counts: bool = True
) -> Any:
    """One reply standing for ``replies`` (rank -> that rank's reply, all of one type).
    ``label`` names a failed rank in the message; without ``sum_counts`` counts are the
    lowest rank's."""
    ranks = sorted(replies)
    first = replies[ranks[0]]
    if isinstance(first, GetInternalStateReqOutput):
        states = [{**replies[r].internal_state, "dp_rank": r} for r in ranks]
        return GetInternalStateReqOutput(states[0], req_id=first.req_id, internal_states=states)
    if not dataclasses.is_dataclass(first) or isinstance(first, type):
        return first
    values: dict[str, Any] = {}
    for f in dataclasses.fields(first):
        per_rank = [getattr(replies[r], f.name) for r in ranks]
        if f.name in _ALL_FIELDS:
            values[f.name] = all(per_rank)
        elif f.name in _ANY_FIELDS:
            values[f.name] = any(per_rank)
        elif f.name == "released_tags":
            values[f.name] = sorted(set().union(*per_rank))
        elif f.name == "loaded_adapters":
            values[f.name] = {k: v for k, v in per_rank[0].items() if all(k in o for o in per_rank)}
        elif sum_counts and isinstance(per_rank[0], int) and not isinstance(per_rank[0], bool):
            values[f.name] = sum(per_rank)
        else:
            values[f.name] = per_rank[0]
    for name in _MESSAGE_FIELDS:
        if name in values:
            values[name] = _merged_message(replies, name, label)
    return dataclasses.replace(first, **values)


def _merged_message(replies: dict[int, Any], name: str, label: str) -> str:
    """Rank 0's message when every rank succeeded, else each failed rank's reason, named."""
    failed = [r for r in sorted(replies) if getattr(replies[r], "success", True) is False]
    if not failed:
        return getattr(replies[min(replies)], name)
    return "; ".join(f"{label} {r}: {getattr(replies[r], name)}" for r in failed)


def settle_lora_unload(name: str, replies: dict[int, LoRAUpdateOutput]) -> LoRAUpdateOutput:
    """The merged reply of unloading adapter ``name`` from every DP replica.

    A refusal can be local to a replica (requests of the adapter run there), so one call may
    unload it from some replicas only; the retry then finds it "not loaded" on those. The
    unload counts as done when this call unloaded it from some replica and no replica has it
    any more (the others unloaded it in an earlier call), so that a retry after aborting the
    requests succeeds instead of failing forever; otherwise the usual merge (failures
    named)."""
    merged = merge_replies(replies)
    gone = all(name not in out.loaded_adapters for out in replies.values())
    if not merged.success and gone and any(out.success for out in replies.values()):
        return dataclasses.replace(merged, success=True, error_message="")
    return merged
