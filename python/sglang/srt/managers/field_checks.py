"""Strict checks of single request fields, shared by every validator at the edge.

Each check returns nothing and raises :class:`InvalidRequestError` (a ValueError, so every
entrypoint turns it into a 400) whose message names the field and the rule it broke, e.g.
``sampling_params.temperature: must be a finite number, got nan``. The rules are strict on
purpose: a boolean is not a number, a number is finite, an integer is not a float, a string is
valid Unicode (a lone surrogate can be neither encoded to UTF-8 nor sent to a tokenizer).
"""

from __future__ import annotations

import math
from typing import Any


class InvalidRequestError(ValueError):
    """A request field breaks a rule; ``param`` names the field (dotted path)."""

    def __init__(self, param: str, rule: str) -> None:
        super().__init__(f"{param}: {rule}")
        self.param = param


def describe(value: Any) -> str:
    """A short repr of ``value`` for error messages (long values are cut)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_bool(param: str, value: Any) -> None:
    """``value`` is True or False (not 0/1, not a string)."""
    if not isinstance(value, bool):
        raise InvalidRequestError(param, f"must be a boolean, got {describe(value)}")


def check_int(param: str, value: Any, lo: int | None = None, hi: int | None = None) -> None:
    """``value`` is an int (not a bool, not a float) in ``[lo, hi]`` (None: unbounded)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(param, f"must be an integer, got {describe(value)}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        low = "-inf" if lo is None else str(lo)
        high = "inf" if hi is None else str(hi)
        raise InvalidRequestError(param, f"must be in [{low}, {high}], got {describe(value)}")


def check_number(param: str, value: Any, lo: float, hi: float) -> None:
    """``value`` is an int or float (not a bool), finite once converted to float, in
    ``[lo, hi]``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(param, f"must be a number, got {describe(value)}")
    try:
        as_float = float(value)
    except OverflowError:
        as_float = math.inf
    if not math.isfinite(as_float):
        raise InvalidRequestError(param, f"must be a finite number, got {describe(value)}")
    if not lo <= as_float <= hi:
        raise InvalidRequestError(param, f"must be in [{lo:g}, {hi:g}], got {as_float:g}")


def check_str(param: str, value: Any, max_len: int, min_len: int = 0) -> None:
    """``value`` is a str of ``min_len`` to ``max_len`` characters, valid Unicode."""
    if not isinstance(value, str):
        raise InvalidRequestError(param, f"must be a string, got {describe(value)}")
    if not min_len <= len(value) <= max_len:
        size = f"a non-empty string of at most {max_len}" if min_len == 1 else (
            f"a string of {min_len} to {max_len}")
        raise InvalidRequestError(param, f"must be {size} characters, got {len(value)}")
    check_unicode(param, value)


def check_unicode(param: str, value: str) -> int:
    """The UTF-8 size of ``value`` in bytes; InvalidRequestError when it holds a lone
    surrogate (which JSON's ``\\ud800`` escape or a Python str can carry)."""
    try:
        return len(value.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise InvalidRequestError(
            param, f"is not valid Unicode (lone surrogate at character {e.start})"
        ) from None


def check_list(param: str, value: Any, max_len: int, min_len: int = 0) -> None:
    """``value`` is a list of ``min_len`` to ``max_len`` entries."""
    if not isinstance(value, list):
        raise InvalidRequestError(param, f"must be a list, got {describe(value)}")
    if not min_len <= len(value) <= max_len:
        raise InvalidRequestError(
            param, f"must have {min_len} to {max_len} entries, got {len(value)}"
        )


def check_choice(param: str, value: Any, choices: tuple[str, ...]) -> None:
    """``value`` is one of the strings ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise InvalidRequestError(param, f"must be one of {list(choices)}, got {describe(value)}")
