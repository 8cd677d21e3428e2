"""Committing step results into requests, and streaming them to the detokenizer.

``commit_*`` append each request's new token (and logprobs) and check whether it finished; the
Scheduler then finishes those (``Scheduler.finish`` releases them and calls :meth:`stream`) and
streams what is due for the others. :meth:`stream` is the one place that builds a request's
output message, final or not. A request's messages are incremental: ids and logprobs from
``req.num_sent_ids`` on; prompt logprobs once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from sglang.srt.managers.io_struct import BatchTokenIDOutput
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.tp_worker import GenerationBatchResult
from sglang.srt.managers.weight_state import WeightState

T = TypeVar("T")


class OutputProcessor:
    def __init__(
        self,
        weights: WeightState,
        tokenizer: Any,
        send: Callable[[BatchTokenIDOutput], None],
        stream_interval: int,
        version_of: Callable[[Req], str | None] | None = None,
    ) -> None:
        self.weights = weights  # read only: the label of the weights computing each new token
        # A request's own weight label when it has one (a LoRA adapter's), else None.
        self.version_of = version_of
        self.tokenizer = tokenizer
        self.send = send
        self.stream_interval = stream_interval

    def commit_extend(self, batch: ScheduleBatch, result: GenerationBatchResult) -> list[Req]:
        """Commit a prefill step. Returns the requests whose prefill completed (finished or not);
        a request with chunks still to go only advances its ``kv_len``."""
        done = []
        offset = 0
        for i, req in enumerate(batch.reqs):
            req.kv_len += req.extend_len
            num_rows = batch.input_logprob_counts[i]
            if num_rows or req.wants_input_logprobs:
                self._add_input_logprobs(req, result, offset, num_rows)
                offset += num_rows
            if req.is_chunked:
                continue
            if req.wants_input_logprobs:
                req.input_logprobs_done = True
            if req.sampling_params.max_new_tokens == 0:
                # A prompt-only request (prompt logprobs, a cache warm-up): the prefill is all
                # it asked for, and the token sampled from its last position is dropped.
                req.finished_reason = {"type": "length", "length": 0}
            else:
                self._append_token(req, result, i)
            done.append(req)
        return done

    def commit_decode(self, reqs: list[Req], result: GenerationBatchResult) -> list[Req]:
        """Commit a decode step whose rows are ``reqs``; a request already finished (only in
        the overlap schedule: by the step before) is skipped. Returns the committed ones."""
        committed = []
        for i, req in enumerate(reqs):
            if req.finished:
                continue
            req.kv_len += 1
            self._append_token(req, result, i)
            committed.append(req)
        return committed

    def stream_due(self, reqs: list[Req]) -> None:
        """Stream the unfinished requests of ``reqs`` whose stream interval has come."""
        self.stream([r for r in reqs if not r.finished and self._due(r)])

    def _append_token(self, req: Req, result: GenerationBatchResult, i: int) -> None:
        token = result.next_token_ids[i]
        if req.grammar is not None and not req.grammar.accept(token):
            # Only a row its grammar left no token gets here: the token sampled from all -inf
            # logits is not output (nor its NaN logprob); the request ends with a message.
            req.abort(f"The grammar allows no token after {len(req.output_ids)} output tokens")
            return
        req.output_ids.append(token)
        own = self.version_of(req) if self.version_of is not None else None
        version = self.weights.version if own is None else own
        _extend_version_spans(req.weight_version_spans, version, len(req.output_ids))
        if req.return_logprob:
            req.output_token_logprobs_val.append(_asked(result.next_token_logprobs)[i])
            req.output_token_logprobs_idx.append(token)
            if req.top_logprobs_num:
                req.output_top_logprobs_val.append(
                    _asked(result.top_logprobs_val)[i][: req.top_logprobs_num]
                )
                req.output_top_logprobs_idx.append(
                    _asked(result.top_logprobs_idx)[i][: req.top_logprobs_num]
                )
        if req.return_entropy:
            # One value per output token, appended with it: a retracted request keeps its list
            # and continues it after the re-prefill, so ids, logprobs and entropy stay aligned.
            req.output_token_entropy_val.append(_asked(result.entropies)[i])
        req.check_finished(self.tokenizer)

    def _add_input_logprobs(
        self, req: Req, result: GenerationBatchResult, offset: int, num_rows: int
    ) -> None:
        if not req.input_token_logprobs_idx:  # first chunk carrying prompt logprobs
            # As upstream, the token at logprob_start_len has no logprob (None): the rows
            # start at its position, which predicts the next token.
            req.input_token_logprobs_val.append(None)
            req.input_token_logprobs_idx.append(req.origin_input_ids[req.logprob_start_len])
            if req.top_logprobs_num:
                req.input_top_logprobs_val.append([])
                req.input_top_logprobs_idx.append([])
        end = offset + num_rows
        req.input_token_logprobs_val.extend(_asked(result.input_token_logprobs)[offset:end])
        first_target = len(req.input_token_logprobs_idx) + req.logprob_start_len
        req.input_token_logprobs_idx.extend(
            req.origin_input_ids[first_target : first_target + num_rows]
        )
        if req.top_logprobs_num:
            k = req.top_logprobs_num
            req.input_top_logprobs_val.extend(
                v[:k] for v in _asked(result.input_top_logprobs_val)[offset:end]
            )
            req.input_top_logprobs_idx.extend(
                i[:k] for i in _asked(result.input_top_logprobs_idx)[offset:end]
            )

    def _due(self, req: Req) -> bool:
        if not req.stream:
            return False
        unsent = len(req.output_ids) - req.num_sent_ids
        interval = req.sampling_params.stream_interval or self.stream_interval
        return unsent >= interval or (req.num_sent_ids == 0 and unsent > 0)

    def stream(self, reqs: list[Req]) -> None:
        """Send the unsent part of each request's output in one BatchTokenIDOutput."""
        if not reqs:
            return
        any_logprob = any(r.return_logprob for r in reqs)
        any_entropy = any(r.return_entropy for r in reqs)
        msg = BatchTokenIDOutput(
            rids=[r.rid for r in reqs],
            finished_reasons=[r.finished_reason for r in reqs],
            decode_ids=[r.output_ids[r.num_sent_ids :] for r in reqs],
            skip_special_tokens=[r.sampling_params.skip_special_tokens for r in reqs],
            spaces_between_special_tokens=[
                r.sampling_params.spaces_between_special_tokens for r in reqs
            ],
            no_stop_trim=[r.sampling_params.no_stop_trim for r in reqs],
            stop_str_max_len=[r.stop_str_max_chars for r in reqs],
            prompt_tokens=[r.prompt_len for r in reqs],
            completion_tokens=[len(r.output_ids) for r in reqs],
            cached_tokens=[r.cached_tokens for r in reqs],
            retraction_counts=[r.num_retractions for r in reqs],
            weight_version_spans=[
                _spans_from(r.weight_version_spans, r.num_sent_ids) for r in reqs
            ],
            weight_version=self.weights.version,
        )
        if any_logprob:
            self._fill_logprobs(msg, reqs)
        if any_entropy:
            msg.output_token_entropy_val = [
                r.output_token_entropy_val[r.num_sent_ids :] for r in reqs
            ]
        if any(r.routed_experts is not None for r in reqs):
            msg.routed_experts = [r.routed_experts for r in reqs]
        for r in reqs:
            r.num_sent_ids = len(r.output_ids)
        self.send(msg)

    @staticmethod
    def _fill_logprobs(msg: BatchTokenIDOutput, reqs: list[Req]) -> None:
        msg.output_token_logprobs_val = [
            r.output_token_logprobs_val[r.num_sent_ids :] for r in reqs
        ]
        msg.output_token_logprobs_idx = [
            r.output_token_logprobs_idx[r.num_sent_ids :] for r in reqs
        ]
        msg.output_top_logprobs_val = [r.output_top_logprobs_val[r.num_sent_ids :] for r in reqs]
        msg.output_top_logprobs_idx = [r.output_top_logprobs_idx[r.num_sent_ids :] for r in reqs]
        first = [r.input_logprobs_done and not r.input_logprobs_sent for r in reqs]
        msg.input_token_logprobs_val = [
            r.input_token_logprobs_val if f else [] for r, f in zip(reqs, first)
        ]
        msg.input_token_logprobs_idx = [
            r.input_token_logprobs_idx if f else [] for r, f in zip(reqs, first)
        ]
        msg.input_top_logprobs_val = [
            r.input_top_logprobs_val if f else [] for r, f in zip(reqs, first)
        ]
        msg.input_top_logprobs_idx = [
            r.input_top_logprobs_idx if f else [] for r, f in zip(reqs, first)
        ]
        for r, f in zip(reqs, first):
            if f:
                r.input_logprobs_sent = True


def _asked(values: list[T] | None) -> list[T]:
    """A result list that a request of the batch asked for (the worker returns it then)."""
    if values is None:
        raise RuntimeError("the model worker did not return values a request asked for")
    return values


def _extend_version_spans(spans: list[list], version: str, num_tokens: int) -> None:
    """Attribute output token ``num_tokens - 1`` (just appended) to ``version``."""
    if spans and spans[-1][0] == version and spans[-1][2] == num_tokens - 1:
        spans[-1][2] = num_tokens
    else:
        spans.append([version, num_tokens - 1, num_tokens])


def _spans_from(spans: list[list], start: int) -> list[list]:
    """The part of ``spans`` covering output positions ``start`` onwards (copied)."""
    return [[v, max(s, start), e] for v, s, e in spans if e > start]
