"""Validation of generate requests at the edge, before anything is tokenized or queued.

Two steps, both run by ``TokenizerManager.generate_request`` (so the native, OpenAI and Engine
APIs share them): :func:`check_generate_input` checks the type and range of every field of the
raw request and the work it asks for (batch size, prompt bytes, logprobs, stop strings) before
tokenization; :func:`validate_request` checks each tokenized request against the model.
Both raise :class:`~sglang.srt.managers.field_checks.InvalidRequestError` (a ValueError: a
400 over HTTP) naming the field and the rule.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sglang.srt.constrained.base_grammar_backend import GrammarBackend, create_grammar_backend
from sglang.srt.managers.field_checks import (
    InvalidRequestError,
    check_bool,
    check_choice,
    check_int,
    check_str,
    check_unicode,
    describe,
)
from sglang.srt.managers.io_struct import GenerateReqInput, TokenizedGenerateReqInput
from sglang.srt.managers.sampling_validation import (
    check_sampling_params,
    engine_sampling_params,
)
from sglang.srt.sampling.sampling_batch_info import ENTROPY_MODES
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

# Longest request id accepted (uuid4 hex ids have 32 characters).
MAX_RID_LEN = 512
# Texts longer than this in total (characters) are tokenized in a worker thread, so that the
# event loop keeps answering (/health within a second) while a big prompt is tokenized.
TOKENIZE_INLINE_MAX_CHARS = 16 * 1024


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against: the model, the scheduler's ready info, and the
    server's request limits (docs/security.md; the defaults are ServerArgs' defaults)."""

    vocab_size: int
    context_len: int
    max_req_input_len: int
    entropy_with_logprobs: bool  # --enable-entropy-with-logprobs
    max_request_batch_size: int = 8192  # --max-request-batch-size: prompts x n per call
    max_prompt_bytes: int = 8 * 1024 * 1024  # --max-prompt-bytes: UTF-8 bytes of one text
    max_top_logprobs_num: int = 128  # --max-top-logprobs-num
    max_stop_strings: int = 64  # --max-stop-strings
    max_stop_str_len: int = 512  # --max-stop-str-len (characters)
    routed_experts: bool = False  # --enable-return-routed-experts
    auto_truncate: bool = False  # --allow-auto-truncate
    # Checks grammars' syntax (--grammar-backend); None: constrained decoding is off.
    grammar_backend: GrammarBackend | None = None

    @classmethod
    def from_server_args(cls, server_args: ServerArgs, scheduler_info: dict) -> RequestLimits:
        """The limits of a server: the model's from ``scheduler_info``, the rest from flags."""
        return cls(
            vocab_size=scheduler_info["vocab_size"],
            context_len=scheduler_info["context_length"],
            max_req_input_len=scheduler_info["max_req_input_len"],
            entropy_with_logprobs=server_args.enable_entropy_with_logprobs,
            max_request_batch_size=server_args.max_request_batch_size,
            max_prompt_bytes=server_args.max_prompt_bytes,
            max_top_logprobs_num=server_args.max_top_logprobs_num,
            max_stop_strings=server_args.max_stop_strings,
            max_stop_str_len=server_args.max_stop_str_len,
            routed_experts=server_args.enable_return_routed_experts,
            auto_truncate=server_args.allow_auto_truncate,
            grammar_backend=None if server_args.skip_tokenizer_init else create_grammar_backend(
                server_args.grammar_backend,
                None,
                scheduler_info["vocab_size"],
                any_whitespace=not server_args.constrained_json_disable_any_whitespace,
            ),
        )


def _one(value: Any, name: str, kind: type | tuple[type, ...]) -> Any:
    """A single request's ``name`` (normalized: not a per-prompt list), checked to be ``kind``."""
    if not isinstance(value, kind):
        raise ValueError(f"{name}: expected one value for a single prompt, got {value!r}")
    return value


def validate_request(
    obj: GenerateReqInput, input_ids: list[int], limits: RequestLimits
) -> TokenizedGenerateReqInput:
    """One tokenized request, checked against ``limits``; raises ValueError naming the first
    problem. As upstream, an explicit ``max_new_tokens`` that does not fit the context with the
    prompt (``prompt + max_new_tokens >= context``) is refused; the default one is clamped.
    With ``limits.auto_truncate`` neither is refused: a prompt over ``max_req_input_len`` keeps
    its first ``max_req_input_len`` tokens, and any budget is clamped to what the context
    leaves (each logged as a warning)."""
    if not input_ids:
        raise ValueError("The input prompt is empty (0 tokens)")
    for token_id in input_ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            raise ValueError(f"input_ids must be integers, got {token_id!r}")
        if not 0 <= token_id < limits.vocab_size:
            raise ValueError(
                f"Token id {token_id} in input_ids is out of range [0, {limits.vocab_size})"
            )
    if limits.auto_truncate and len(input_ids) > limits.max_req_input_len:
        logger.warning(
            "The input (%d tokens) does not fit the context (%d tokens, at most %d of prompt): "
            "keeping its first %d tokens (--allow-auto-truncate)",
            len(input_ids), limits.context_len, limits.max_req_input_len,
            limits.max_req_input_len,
        )
        input_ids = input_ids[: limits.max_req_input_len]
    prompt_len = len(input_ids)
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
    raw_params = dict(_one(obj.sampling_params or {}, "sampling_params", dict))
    # None means "default" for every knob (OpenAI clients send explicit nulls), except that
    # max_new_tokens=None means: up to the context length.
    params = engine_sampling_params(raw_params)
    if "max_new_tokens" in raw_params and raw_params["max_new_tokens"] is None:
        params["max_new_tokens"] = limits.context_len - prompt_len
    sampling_params = SamplingParams.from_dict(params)
    sampling_params.verify(limits.vocab_size)
    sampling_params.normalize()
    explicit_budget = raw_params.get("max_new_tokens") is not None
    over_budget = prompt_len + sampling_params.max_new_tokens >= limits.context_len
    if explicit_budget and over_budget and not limits.auto_truncate:
        # As upstream: an explicit budget that does not fit the context is refused.
        raise ValueError(
            f"Requested token count exceeds the model's maximum context length of "
            f"{limits.context_len} tokens. You requested a total of "
            f"{prompt_len + sampling_params.max_new_tokens} tokens: {prompt_len} tokens from "
            f"the input messages and {sampling_params.max_new_tokens} tokens for the "
            "completion. Please reduce the number of tokens in the input messages or the "
            "completion to fit within the limit."
        )
    # The default budget (128) is clamped to what the context leaves, as upstream does; with
    # --allow-auto-truncate an explicit one too.
    room = limits.context_len - prompt_len
    if sampling_params.max_new_tokens > room:
        if explicit_budget:
            logger.warning(
                "max_new_tokens %d with a %d-token prompt does not fit the context (%d "
                "tokens): lowered to %d (--allow-auto-truncate)",
                sampling_params.max_new_tokens, prompt_len, limits.context_len, room,
            )
        sampling_params.max_new_tokens = room
        sampling_params.min_new_tokens = min(sampling_params.min_new_tokens, room)
    start_len = _one(obj.logprob_start_len, "logprob_start_len", int)
    top_num = _one(obj.top_logprobs_num, "top_logprobs_num", int)
    if obj.return_logprob:
        _check_logprob_args(start_len, top_num, prompt_len, limits.vocab_size)
    entropy_mode = _one(obj.entropy_mode, "entropy_mode", (str, type(None)))
    entropy_top_k = _one(obj.entropy_top_k, "entropy_top_k", (int, type(None)))
    _check_entropy_args(entropy_mode, entropy_top_k)
    return_routed_experts = _one(obj.return_routed_experts, "return_routed_experts", bool)
    routed_start = _one(obj.routed_experts_start_len, "routed_experts_start_len", int)
    if return_routed_experts:
        _check_routed_experts_args(routed_start, prompt_len, limits.routed_experts)
    return TokenizedGenerateReqInput(
        rid=_one(obj.rid, "rid", str),
        input_text=_one(obj.text, "text", (str, type(None))),
        input_ids=input_ids,
        sampling_params=sampling_params,
        return_logprob=bool(obj.return_logprob),
        logprob_start_len=start_len if obj.return_logprob else -1,
        top_logprobs_num=top_num if obj.return_logprob else 0,
        stream=obj.stream,
        return_entropy=bool(obj.return_entropy)
        or (limits.entropy_with_logprobs and bool(obj.return_logprob)),
        entropy_mode=entropy_mode,
        entropy_top_k=entropy_top_k,
        lora_path=_one(obj.lora_path, "lora_path", (str, type(None))),
        return_routed_experts=return_routed_experts,
        routed_experts_start_len=routed_start if return_routed_experts else 0,
    )


def _check_routed_experts_args(start_len: int, prompt_len: int, enabled: bool) -> None:
    if not enabled:
        raise ValueError(
            "return_routed_experts needs a server started with --enable-return-routed-experts "
            "(on a mixture-of-experts model)"
        )
    if not 0 <= start_len <= prompt_len:  # its type was checked by check_generate_input
        raise ValueError(
            f"routed_experts_start_len must be in [0, {prompt_len}] (the prompt's length), "
            f"got {start_len!r}"
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
    if logprob_start_len > prompt_len:
        raise ValueError(
            f"logprob_start_len ({logprob_start_len}) must not exceed the number of input "
            f"tokens ({prompt_len})"
        )
    if not isinstance(top_logprobs_num, int) or not 0 <= top_logprobs_num <= vocab_size:
        raise ValueError(f"top_logprobs_num must be in [0, {vocab_size}], got {top_logprobs_num!r}")


_MAX_LORA_NAME_LEN = 256


def check_generate_input(obj: GenerateReqInput, limits: RequestLimits) -> None:
    """Check every field of a raw (not yet normalized) request against its type, range and
    ``limits``, cheaply and before tokenization. Raises InvalidRequestError naming the field.

    A batch (and ``n`` copies of each prompt) may create at most
    ``limits.max_request_batch_size`` engine requests; each text at most
    ``limits.max_prompt_bytes`` UTF-8 bytes; each token-id prompt at most the context length.
    """
    num_prompts = _check_prompts(obj, limits)
    is_batch = not obj.is_single
    params = obj.sampling_params
    if params is None:
        num_copies = num_prompts
    elif isinstance(params, list) and is_batch:
        _check_per_prompt("sampling_params", params, num_prompts)
        num_copies = sum(
            _sampling_n(limits, p, f"sampling_params[{i}]") for i, p in enumerate(params)
        )
    elif isinstance(params, list):  # a single prompt: a one-entry list is accepted
        _check_per_prompt("sampling_params", params, 1)
        num_copies = _sampling_n(limits, params[0], "sampling_params[0]")
    else:
        num_copies = num_prompts * _sampling_n(limits, params, "sampling_params")
    if num_copies > limits.max_request_batch_size:
        raise InvalidRequestError(
            "sampling_params.n" if num_prompts == 1 else "text" if obj.text is not None
            else "input_ids",
            f"the request asks for {num_copies} generations (prompts x n); the limit is "
            f"{limits.max_request_batch_size} (--max-request-batch-size)",
        )
    _check_rids(obj.rid, num_prompts, is_batch)
    top_max = min(limits.max_top_logprobs_num, limits.vocab_size)

    def start_len(param: str, value: Any) -> None:
        check_int(param, value, -1, limits.context_len)

    def top_num(param: str, value: Any) -> None:
        check_int(param, value, 0, top_max)

    def routed_start_len(param: str, value: Any) -> None:
        check_int(param, value, 0, limits.context_len)

    def entropy_mode(param: str, value: Any) -> None:
        if value is not None:
            check_choice(param, value, tuple(ENTROPY_MODES))

    def entropy_top_k(param: str, value: Any) -> None:
        if value is not None:
            check_int(param, value, 0, limits.vocab_size)

    def lora_path(param: str, value: Any) -> None:
        if value is not None:  # an adapter name (docs/lora.md)
            check_str(param, value, _MAX_LORA_NAME_LEN, 1)

    checks: tuple[tuple[str, Callable[[str, Any], None]], ...] = (
        ("return_logprob", check_bool), ("return_entropy", check_bool),
        ("logprob_start_len", start_len), ("top_logprobs_num", top_num),
        ("entropy_mode", entropy_mode), ("entropy_top_k", entropy_top_k),
        ("lora_path", lora_path), ("return_routed_experts", check_bool),
        ("routed_experts_start_len", routed_start_len),
    )
    for name, check in checks:
        _check_per_request(name, getattr(obj, name), num_prompts, is_batch, check)
    for name in ("return_text_in_logprobs", "stream", "log_metrics"):
        check_bool(name, getattr(obj, name))


def _sampling_n(limits: RequestLimits, params: Any, name: str) -> int:
    return check_sampling_params(
        params, name, limits.vocab_size, limits.max_request_batch_size,
        limits.max_stop_strings, limits.max_stop_str_len, limits.grammar_backend,
    )


def _check_prompts(obj: GenerateReqInput, limits: RequestLimits) -> int:
    """Check ``text`` or ``input_ids``; returns the number of prompts."""
    if obj.text is not None:
        texts = [obj.text] if isinstance(obj.text, str) else obj.text
        name = "text" if isinstance(obj.text, str) else "text[{}]"
        _check_batch_len("text", texts, limits)
        for i, text in enumerate(texts):
            _check_text(name.format(i), text, limits.max_prompt_bytes)
        return len(texts)
    ids = obj.input_ids
    if not isinstance(ids, list):
        raise InvalidRequestError("input_ids", f"must be a list of token ids or a list of such "
                                               f"lists, got {describe(ids)}")
    if not ids or not isinstance(ids[0], list):
        _check_ids("input_ids", ids, limits)
        return 1
    _check_batch_len("input_ids", ids, limits)
    for i, prompt in enumerate(ids):
        _check_ids(f"input_ids[{i}]", prompt, limits)
    return len(ids)


def _check_batch_len(name: str, prompts: Any, limits: RequestLimits) -> None:
    if not isinstance(prompts, list):
        raise InvalidRequestError(name, f"must be a string or a list of strings, got "
                                        f"{describe(prompts)}")
    if len(prompts) > limits.max_request_batch_size:
        raise InvalidRequestError(
            name, f"a batch of {len(prompts)} prompts is over the limit of "
                  f"{limits.max_request_batch_size} (--max-request-batch-size)",
        )


def _check_text(name: str, text: Any, max_bytes: int) -> None:
    if not isinstance(text, str):
        raise InvalidRequestError(name, f"must be a string, got {describe(text)}")
    # A character takes at least one byte: a huge text is refused before it is encoded.
    if len(text) > max_bytes or check_unicode(name, text) > max_bytes:
        raise InvalidRequestError(
            name, f"the prompt has more than {max_bytes} UTF-8 bytes (--max-prompt-bytes)"
        )


def _check_ids(name: str, ids: Any, limits: RequestLimits) -> None:
    """A list of token ids, no longer than the context, each in the vocabulary."""
    if not isinstance(ids, list):
        raise InvalidRequestError(name, f"must be a list of token ids, got {describe(ids)}")
    if len(ids) >= limits.context_len and not limits.auto_truncate:
        raise InvalidRequestError(
            name, f"the input ({len(ids)} tokens) is longer than the model's context length "
                  f"({limits.context_len} tokens)",
        )
    for i, token_id in enumerate(ids):
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            raise InvalidRequestError(
                f"{name}[{i}]", f"must be an integer token id, got {describe(token_id)}")
        if not 0 <= token_id < limits.vocab_size:
            raise InvalidRequestError(
                f"{name}[{i}]", f"token id {describe(token_id)} is out of range "
                                f"[0, {limits.vocab_size})")


def _check_rids(rid: Any, num_prompts: int, is_batch: bool) -> None:
    if rid is None:
        return
    if not isinstance(rid, list):
        # A batch's single id is numbered per prompt (``rid_0``, ``rid_1``, ...), as upstream;
        # the suffix must fit in the limit too.
        suffix = len(f"_{num_prompts - 1}") if is_batch else 0
        check_str("rid", rid, MAX_RID_LEN - suffix, min_len=1)
        return
    _check_per_prompt("rid", rid, num_prompts if is_batch else 1)
    for i, one in enumerate(rid):
        check_str(f"rid[{i}]", one, MAX_RID_LEN, min_len=1)


def _check_per_prompt(name: str, values: list, num_prompts: int) -> None:
    if len(values) != num_prompts:
        raise InvalidRequestError(
            name, f"'{name}' has {len(values)} entries for {num_prompts} prompt(s); give one "
                  "per prompt"
        )


def _check_per_request(
    name: str, value: Any, num_prompts: int, is_batch: bool,
    check: Callable[[str, Any], None],
) -> None:
    """A field given once or as a list with one entry per prompt; each entry is checked."""
    if isinstance(value, list):
        _check_per_prompt(name, value, num_prompts if is_batch else 1)
        for i, item in enumerate(value):
            check(f"{name}[{i}]", item)
    else:
        check(name, value)


async def tokenize_texts(tokenizer: Any, obj: GenerateReqInput) -> list[list[int]] | None:
    """Token ids of the texts of a normalized, checked request when they are long (see
    :func:`encode_texts`). None when there is no text, no tokenizer, or little text: the caller
    tokenizes inline then."""
    if obj.text is None or tokenizer is None:
        return None
    texts = [obj.text] if isinstance(obj.text, str) else list(obj.text)
    if not _long(texts):
        return None
    return await encode_texts(tokenizer, texts)


async def encode_texts(
    tokenizer: Any, texts: list[str], add_special_tokens: bool = True
) -> list[list[int]]:
    """The token ids of each text, by one batched tokenizer call as the generate path makes
    it; long texts in a worker thread (Hugging Face fast tokenizers release the GIL), so the
    calling event loop stays responsive."""
    if not texts:
        return []
    if _long(texts):
        return await asyncio.to_thread(_encode, tokenizer, texts, add_special_tokens)
    return _encode(tokenizer, texts, add_special_tokens)


def _long(texts: list[str]) -> bool:
    return sum(len(t) for t in texts) > TOKENIZE_INLINE_MAX_CHARS


def _encode(tokenizer: Any, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    encoded = tokenizer(texts, add_special_tokens=add_special_tokens)
    return [list(ids) for ids in encoded["input_ids"]]
