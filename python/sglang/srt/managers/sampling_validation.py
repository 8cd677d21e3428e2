"""Strict checks of a request's ``sampling_params`` dict, before anything is tokenized.

Every known key has one rule (type and range); an unknown key is refused by name. ``None`` means
"the default" for every key (OpenAI clients send explicit nulls). The ranges are SGLang's; on
top of them numbers must be finite and integers must fit where they go (int64 tensors).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang.srt.constrained.base_grammar_backend import (
    GRAMMAR_KEYS,
    GrammarBackend,
    InvalidGrammarError,
    grammar_spec,
)
from sglang.srt.managers.field_checks import (
    InvalidRequestError,
    check_bool,
    check_int,
    check_list,
    check_number,
    check_str,
    describe,
)
from sglang.srt.sampling.sampling_params import is_token_id_key
from sglang.srt.sampling.stop_regex import compile_stop_regexes

# An integer that goes into an int64 tensor stays below this in absolute value.
INT64_LIMIT = 2**63 - 1
# Largest temperature accepted (larger ones already give a uniform distribution).
MAX_TEMPERATURE = 1e6


def _number(lo: float, hi: float) -> Callable[[str, Any], None]:
    return lambda param, value: check_number(param, value, lo, hi)


def _int(lo: int, hi: int) -> Callable[[str, Any], None]:
    return lambda param, value: check_int(param, value, lo, hi)


def _check_repetition_penalty(param: str, value: Any) -> None:
    check_number(param, value, 0.0, 2.0)
    if value == 0:
        raise InvalidRequestError(param, "must be in (0, 2], got 0")


def _check_top_p(param: str, value: Any) -> None:
    check_number(param, value, 0.0, 1.0)
    if value == 0:
        raise InvalidRequestError(param, "must be in (0, 1], got 0")


def _check_dict(param: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise InvalidRequestError(param, f"must be a JSON object (a dict), got {describe(value)}")


def _check_top_k(param: str, value: Any) -> None:
    check_int(param, value, -1, INT64_LIMIT)
    if value == 0:
        raise InvalidRequestError(param, "must be -1 (disabled) or >= 1, got 0")


# Rules that need no limit of the server.
_RULES: dict[str, Callable[[str, Any], None]] = {
    "max_new_tokens": _int(0, INT64_LIMIT),
    "min_new_tokens": _int(0, INT64_LIMIT),
    "temperature": _number(0.0, MAX_TEMPERATURE),
    "top_p": _check_top_p,
    "top_k": _check_top_k,
    "min_p": _number(0.0, 1.0),
    "frequency_penalty": _number(-2.0, 2.0),
    "presence_penalty": _number(-2.0, 2.0),
    "repetition_penalty": _check_repetition_penalty,
    "ignore_eos": check_bool,
    "skip_special_tokens": check_bool,
    "spaces_between_special_tokens": check_bool,
    "no_stop_trim": check_bool,
    "sampling_seed": _int(-INT64_LIMIT, INT64_LIMIT),
    "stream_interval": _int(1, INT64_LIMIT),
    # Upstream reads it only for a custom logit processor (refused here): accepted, not used.
    "custom_params": _check_dict,
}
# Keys whose rule depends on the server's limits (checked below).
_LIMITED_KEYS = frozenset({"n", "stop", "stop_regex", "stop_token_ids", "logit_bias",
                           *GRAMMAR_KEYS})
KNOWN_KEYS = frozenset(_RULES) | _LIMITED_KEYS
# Longest grammar text (json_schema, regex, ebnf, structural_tag), in characters.
MAX_GRAMMAR_LEN = 1 << 20


# Keys whose empty value ("" or {}) means unset, as clients send them.
_EMPTY_IS_UNSET = frozenset({"logit_bias", *GRAMMAR_KEYS})


def engine_sampling_params(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` without the keys that change nothing: nulls (the default), ``custom_params``,
    and empty grammars and logit biases."""
    return {k: v for k, v in params.items() if v is not None and k != "custom_params"
            and not (k in _EMPTY_IS_UNSET and v in ("", {}))}


def check_sampling_params(
    params: Any,
    param: str,
    vocab_size: int,
    max_n: int,
    max_stop_strings: int,
    max_stop_str_len: int,
    grammar_backend: GrammarBackend | None = None,
) -> int:
    """Check one ``sampling_params`` dict (``param`` is its name in messages); returns its
    ``n`` (1 by default). ``max_n`` bounds ``n``; the stop limits bound ``stop``;
    ``grammar_backend`` checks a grammar's syntax (None: constrained decoding is off, and a
    grammar is refused)."""
    if not isinstance(params, dict):
        raise InvalidRequestError(param, f"must be a JSON object (a dict), got {describe(params)}")
    unknown = sorted(str(k) for k in params if k not in KNOWN_KEYS)
    if unknown:
        raise InvalidRequestError(param, f"unknown sampling parameter(s): {', '.join(unknown)}")
    _check_grammar(params, param, grammar_backend)
    if params.get("logit_bias") is not None:
        _check_logit_bias(f"{param}.logit_bias", params["logit_bias"], vocab_size)
    for key, value in params.items():
        if value is not None and key in _RULES:
            _RULES[key](f"{param}.{key}", value)
    min_new, max_new = params.get("min_new_tokens"), params.get("max_new_tokens")
    if min_new is not None and max_new is not None and min_new > max_new:
        raise InvalidRequestError(f"{param}.min_new_tokens", f"must be <= max_new_tokens "
                                                            f"({max_new}), got {min_new}")
    if params.get("stop") is not None:
        _check_stop(f"{param}.stop", params["stop"], max_stop_strings, max_stop_str_len)
    if params.get("stop_regex") is not None:
        name = f"{param}.stop_regex"
        _check_stop(name, params["stop_regex"], max_stop_strings, max_stop_str_len)
        try:
            compile_stop_regexes(params["stop_regex"])
        except ValueError as e:
            raise InvalidRequestError(name, str(e)) from None
    if params.get("stop_token_ids") is not None:
        ids = params["stop_token_ids"]
        check_list(f"{param}.stop_token_ids", ids, vocab_size)
        for i, token_id in enumerate(ids):
            check_int(f"{param}.stop_token_ids[{i}]", token_id, 0, vocab_size - 1)
    n = params.get("n")
    if n is None:
        return 1
    check_int(f"{param}.n", n, 1, max_n)
    return n


def _check_grammar(params: dict[str, Any], param: str, backend: GrammarBackend | None) -> None:
    """At most one grammar, a string that ``backend`` parses."""
    for key in GRAMMAR_KEYS:
        if params.get(key) is not None:
            check_str(f"{param}.{key}", params[key], MAX_GRAMMAR_LEN)
    set_keys = [k for k in GRAMMAR_KEYS if params.get(k)]
    if len(set_keys) > 1:
        raise InvalidRequestError(param, f"at most one of {', '.join(GRAMMAR_KEYS)} may be "
                                         f"set, got {', '.join(set_keys)}")
    spec = grammar_spec(params)
    if spec is None:
        return
    name = f"{param}.{spec[0]}"
    if backend is None:
        raise InvalidRequestError(name, "constrained decoding is off on this server "
                                        "(--grammar-backend none, or no tokenizer)")
    try:
        backend.check(spec)
    except InvalidGrammarError as e:
        raise InvalidRequestError(name, str(e)) from None


def _check_logit_bias(param: str, bias: Any, vocab_size: int) -> None:
    """Token ids in [0, vocab_size) (decimal strings, or ints from Python) to finite numbers."""
    if not isinstance(bias, dict):
        raise InvalidRequestError(param, f"must be a JSON object (a dict), got {describe(bias)}")
    check_list(param, list(bias), vocab_size)
    for token, value in bias.items():
        if not is_token_id_key(token):
            raise InvalidRequestError(param, f"keys must be token ids, got {token!r}")
        if int(token) >= vocab_size:
            raise InvalidRequestError(param, f"keys must be token ids in [0, {vocab_size}), "
                                             f"got {token!r}")
        check_number(f"{param}[{token!r}]", value, -INT64_LIMIT, INT64_LIMIT)


def _check_stop(param: str, stop: Any, max_strings: int, max_len: int) -> None:
    """``stop`` is a string or a list of at most ``max_strings`` strings of at most
    ``max_len`` characters each."""
    if isinstance(stop, str):
        check_str(param, stop, max_len)
        return
    if not isinstance(stop, list):
        raise InvalidRequestError(param, f"must be a string or a list of strings, got "
                                         f"{describe(stop)}")
    check_list(param, stop, max_strings)
    for i, item in enumerate(stop):
        check_str(f"{param}[{i}]", item, max_len)
