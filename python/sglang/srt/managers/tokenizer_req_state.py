"""Frontend state of one rid: the caller's view assembled from incremental outputs.

Owned by the TokenizerManager (one asyncio loop, not thread-safe). Each ``BatchStrOutput``
carries one increment per rid; :meth:`ReqState.apply` adds it to the totals and
:meth:`ReqState.to_output` builds the dict that callers receive (SGLang's output format).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from sglang.srt.managers.io_struct import (
    DEFAULT_WEIGHT_VERSION,
    BatchStrOutput,
    TokenizedGenerateReqInput,
)

_LOGPROB_KEYS = (
    "output_token_logprobs",
    "input_token_logprobs",
    "output_top_logprobs",
    "input_top_logprobs",
)


class ReqState:
    """Accumulated output of one rid: the totals of the incremental messages received so far.

    Owned by the TokenizerManager's loop. ``notify`` is shared by the rids of one call and set
    whenever one of them changes; ``dirty`` marks changes not yet yielded to a stream.
    ``decode_texts`` maps token ids to their texts for logprob entries (None: texts are None).
    """

    def __init__(
        self,
        req: TokenizedGenerateReqInput,
        notify: asyncio.Event,
        parent_rid: str | None,
        decode_texts: Callable[[list[int]], list[str]] | None,
        has_text: bool,
        think_end_id: int | None = None,
    ) -> None:
        self.rid = req.rid
        self.parent_rid = parent_rid
        self.notify = notify
        self.return_logprob = req.return_logprob
        self.top_logprobs_num = req.top_logprobs_num
        self.return_entropy = req.return_entropy
        self.routed_experts_start_len = req.routed_experts_start_len
        self.routed_experts: str | None = None  # from the final message, when asked
        self.decode_texts = decode_texts
        self.has_text = has_text
        self.think_end_id = think_end_id
        self.created_time = time.perf_counter()
        self.finished_time: float | None = None
        self.finished_reason: dict[str, Any] | None = None
        self.text = ""
        self.output_ids: list[int] = []
        self.prompt_tokens = len(req.input_ids)
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.retractions = 0
        self.logprobs: dict[str, list] = {key: [] for key in _LOGPROB_KEYS}
        self.entropy: list[float] = []
        # {"version", "start", "end"} runs over the output tokens, merged as increments arrive.
        self.weight_spans: list[dict[str, Any]] = []
        self.weight_version = DEFAULT_WEIGHT_VERSION  # scheduler's label at the last message
        self.dirty = False
        self.error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def apply(self, msg: BatchStrOutput, i: int, rows: dict[str, list] | None = None) -> None:
        """Add entry ``i`` of ``msg`` (this rid's increment) to the totals. ``rows``: its
        :meth:`logprob_rows`, when already built (in slices, for a big payload)."""
        if rows is None:
            rows = self.logprob_rows(msg, i)
        self.text += msg.output_strs[i]
        self.output_ids.extend(msg.output_ids[i])
        self.prompt_tokens = msg.prompt_tokens[i]
        self.completion_tokens = msg.completion_tokens[i]
        self.cached_tokens = msg.cached_tokens[i]
        self.retractions = msg.retraction_counts[i]
        for key, new_rows in rows.items():
            self.logprobs[key].extend(new_rows)
        if self.return_entropy and msg.output_token_entropy_val is not None:
            self.entropy.extend(msg.output_token_entropy_val[i])
        if msg.routed_experts is not None and msg.routed_experts[i] is not None:
            self.routed_experts = msg.routed_experts[i]
        self._add_weight_spans(msg, i)
        reason = msg.finished_reasons[i]
        if reason is not None:
            self.finish_locally(reason)
        self.dirty = True

    def _add_weight_spans(self, msg: BatchStrOutput, i: int) -> None:
        """Merge the message's version spans; a message without them (older senders) puts its
        new tokens under the scheduler's current label."""
        if msg.weight_version is not None:
            self.weight_version = msg.weight_version
        if msg.weight_version_spans is not None:
            spans = msg.weight_version_spans[i]
        else:
            start = self.weight_spans[-1]["end"] if self.weight_spans else 0
            spans = [[self.weight_version, start, self.completion_tokens]]
        for version, start, end in spans:
            if end <= start:
                continue
            last = self.weight_spans[-1] if self.weight_spans else None
            if last is not None and last["version"] == version and last["end"] == start:
                last["end"] = end
            else:
                self.weight_spans.append({"version": version, "start": start, "end": end})

    def finish_locally(self, reason: dict[str, Any]) -> None:
        """Mark the request finished with ``reason`` (also used when no message will come)."""
        self.finished_reason = reason
        self.finished_time = time.perf_counter()
        self.dirty = True

    def logprob_rows(self, msg: BatchStrOutput, i: int) -> dict[str, list]:
        """The logprob rows of entry ``i`` of ``msg``, by output key (see :meth:`rows`)."""
        return {key: self.rows(key, vals, idxs) for key, vals, idxs in self.logprob_parts(msg, i)}

    def logprob_parts(self, msg: BatchStrOutput, i: int) -> list[tuple[str, list, list]]:
        """``(key, values, ids)`` of each logprob list of entry ``i`` of ``msg`` that this
        request asked for and that has positions; :meth:`rows` turns them into rows."""
        if not self.return_logprob:
            return []
        parts = []
        for key in _LOGPROB_KEYS:
            if key.endswith("top_logprobs") and self.top_logprobs_num <= 0:
                continue
            vals, idxs = getattr(msg, key + "_val"), getattr(msg, key + "_idx")
            if vals is not None and vals[i]:
                parts.append((key, vals[i], idxs[i]))
        return parts

    def rows(self, key: str, vals: list, idxs: list) -> list:
        """``[[logprob, id, text], ...]`` rows, or for top logprobs one list of rows per
        position (a position without entries, such as the first prompt token, stays None).

        Reads only its arguments and settings fixed at creation: the rows of a slice of
        positions are that slice of the rows, so a caller may build a long list in parts.
        """
        if not key.endswith("top_logprobs"):
            return list(map(list, zip(vals, idxs, self._texts(idxs))))
        flat_ids = [t for pos_idxs in idxs if pos_idxs for t in pos_idxs]
        texts = iter(self._texts(flat_ids))
        rows: list = []
        for pos_vals, pos_idxs in zip(vals, idxs):
            if not pos_vals:  # no entries at this position (the first prompt token): None
                rows.append(None)
                continue
            rows.append([[v, t, next(texts)] for v, t in zip(pos_vals, pos_idxs)])
        return rows

    def _texts(self, ids: list[int]) -> list[str | None]:
        if self.decode_texts is None or not ids:
            return [None] * len(ids)
        return list(self.decode_texts(ids))

    def _reasoning_tokens(self) -> int:
        """Output tokens up to and including the first reasoning-end token (all of them while
        it has not come); 0 without a reasoning parser."""
        if self.think_end_id is None:
            return 0
        try:
            return self.output_ids.index(self.think_end_id) + 1
        except ValueError:
            return len(self.output_ids)

    def to_output(self) -> dict[str, Any]:
        """The caller's view: cumulative text/ids and meta_info (lists are copies)."""
        end_time = self.finished_time
        if end_time is None:
            end_time = time.perf_counter()
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finished_reason,
            "prompt_tokens": self.prompt_tokens,
            "reasoning_tokens": self._reasoning_tokens(),
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "e2e_latency": end_time - self.created_time,
            "weight_version": (
                self.weight_spans[-1]["version"] if self.weight_spans else self.weight_version
            ),
            "weight_versions": [dict(span) for span in self.weight_spans],
            "total_retractions": self.retractions,
        }
        if self.return_logprob:
            for key in _LOGPROB_KEYS:
                if not key.endswith("top_logprobs") or self.top_logprobs_num > 0:
                    meta[key] = list(self.logprobs[key])
            meta["output_token_logprobs_length"] = len(self.logprobs["output_token_logprobs"])
        if self.return_entropy:
            meta["output_token_entropy"] = list(self.entropy)
        if self.routed_experts is not None:
            meta["routed_experts"] = self.routed_experts
            meta["routed_experts_start_len"] = self.routed_experts_start_len
        out: dict[str, Any] = {"text": self.text} if self.has_text else {}
        out["output_ids"] = list(self.output_ids)
        out["meta_info"] = meta
        return out


def logprob_entries(msg: BatchStrOutput) -> int:
    """How many logprob entries ``msg`` carries over all its rids: a measure of the work of
    building their rows (each top-logprob candidate counts as one entry)."""
    total = 0
    for key in _LOGPROB_KEYS:
        vals = getattr(msg, key + "_val")
        if vals is None:
            continue
        for per_rid in vals:
            if not per_rid:
                continue
            if key.endswith("top_logprobs"):
                total += sum(len(pos) for pos in per_rid if pos)
            else:
                total += len(per_rid)
    return total


async def logprob_rows_in_slices(
    state: ReqState, msg: BatchStrOutput, i: int, slice_entries: int
) -> dict[str, list]:
    """``state.logprob_rows(msg, i)``, built about ``slice_entries`` logprob entries at a time
    with a return to the event loop after each slice, so that the loop's other work (such as
    ``/health``) waits for one slice, not for the whole build."""
    rows: dict[str, list] = {}
    for key, vals, idxs in state.logprob_parts(msg, i):
        per_position = max(1, state.top_logprobs_num) if key.endswith("top_logprobs") else 1
        step = max(1, slice_entries // per_position)
        built: list = []
        for start in range(0, len(vals), step):
            built += state.rows(key, vals[start : start + step], idxs[start : start + step])
            await asyncio.sleep(0)
        rows[key] = built
    return rows
