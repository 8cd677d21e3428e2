"""Validation of generate requests, before anything is sent to the scheduler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang.srt.managers.io_struct import GenerateReqInput, TokenizedGenerateReqInput
from sglang.srt.sampling.sampling_batch_info import ENTROPY_MODES
from sglang.srt.sampling.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against (from the model and the scheduler's ready info)."""

    vocab_size: int
    context_len: int
    max_req_input_len: int
    entropy_with_logprobs: bool  # --enable-entropy-with-logprobs


def validate_request(
    obj: GenerateReqInput, input_ids: list[int], limits: RequestLimits
) -> TokenizedGenerateReqInput:
    """One tokenized request, checked against ``limits``; raises ValueError naming the first
    problem. As upstream, an explicit ``max_new_tokens`` that does not fit the context with the
    prompt (``prompt + max_new_tokens >= context``) is refused; the default one is clamped."""
    prompt_len = len(input_ids)
    if prompt_len == 0:
        raise ValueError("The input prompt is empty (0 tokens)")
    for token_id in input_ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            raise ValueError(f"input_ids must be integers, got {token_id!r}")
        if not 0 <= token_id < limits.vocab_size:
            raise ValueError(
                f"Token id {token_id} in input_ids is out of range [0, {limits.vocab_size})"
            )
    if prompt_len >= limits.context_len:
        raise ValueError(
            f"The input ({prompt_len} tokens) is longer than the model's context length "
            f"({limits.context_len} tokens)"
        )
    if prompt_len > limits.max_req_input_len:
        raise ValueError(
            f"The input ({prompt_len} tokens) is longer than the maximum request input "
            f"length ({limits.max_req_input_len} tokens)"
        )
    raw_params = dict(obj.sampling_params or {})
    # None means "default" for every knob (OpenAI clients send explicit nulls), except that
    # max_new_tokens=None means: up to the context length.
    params = {k: v for k, v in raw_params.items() if v is not None}
    if "max_new_tokens" in raw_params and raw_params["max_new_tokens"] is None:
        params["max_new_tokens"] = limits.context_len - prompt_len
    sampling_params = SamplingParams.from_dict(params)
    sampling_params.verify(limits.vocab_size)
    sampling_params.normalize()
    explicit_budget = raw_params.get("max_new_tokens") is not None
    if explicit_budget and prompt_len + sampling_params.max_new_tokens >= limits.context_len:
        # As upstream: an explicit budget that does not fit the context is refused.
        raise ValueError(
            f"Requested token count exceeds the model's maximum context length of "
            f"{limits.context_len} tokens. You requested a total of "
            f"{prompt_len + sampling_params.max_new_tokens} tokens: {prompt_len} tokens from "
            f"the input messages and {sampling_params.max_new_tokens} tokens for the "
            "completion. Please reduce the number of tokens in the input messages or the "
            "completion to fit within the limit."
        )
    # The default budget (128) is clamped to what the context leaves, as upstream does.
    room = limits.context_len - prompt_len
    if sampling_params.max_new_tokens > room:
        sampling_params.max_new_tokens = room
        sampling_params.min_new_tokens = min(sampling_params.min_new_tokens, room)
    if obj.return_logprob:
        _check_logprob_args(
            obj.logprob_start_len, obj.top_logprobs_num, prompt_len, limits.vocab_size
        )
    _check_entropy_args(obj.entropy_mode, obj.entropy_top_k)
    return TokenizedGenerateReqInput(
        rid=obj.rid,
        input_text=obj.text,
        input_ids=input_ids,
        sampling_params=sampling_params,
        return_logprob=bool(obj.return_logprob),
        logprob_start_len=obj.logprob_start_len if obj.return_logprob else -1,
        top_logprobs_num=obj.top_logprobs_num if obj.return_logprob else 0,
        stream=obj.stream,
        return_entropy=bool(obj.return_entropy)
        or (limits.entropy_with_logprobs and bool(obj.return_logprob)),
        entropy_mode=obj.entropy_mode,
        entropy_top_k=obj.entropy_top_k,
    )


def _check_entropy_args(mode: Any, top_k: Any) -> None:
    """A request's entropy override: a mode name and a K >= 0 (None: the server's)."""
    if mode is not None and mode not in ENTROPY_MODES:
        raise ValueError(f"entropy_mode must be one of {list(ENTROPY_MODES)}, got {mode!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise ValueError(f"entropy_top_k must be an integer >= 0, got {top_k!r}")


def _check_logprob_args(
    logprob_start_len: int, top_logprobs_num: int, prompt_len: int, vocab_size: int
) -> None:
    if not isinstance(logprob_start_len, int) or logprob_start_len < -1:
        raise ValueError(f"logprob_start_len must be -1 or >= 0, got {logprob_start_len!r}")
    if logprob_start_len >= prompt_len:
        raise ValueError(
            f"logprob_start_len ({logprob_start_len}) must be smaller than the number of input "
            f"tokens ({prompt_len})"
        )
    if not isinstance(top_logprobs_num, int) or not 0 <= top_logprobs_num <= vocab_size:
        raise ValueError(f"top_logprobs_num must be in [0, {vocab_size}], got {top_logprobs_num!r}")
