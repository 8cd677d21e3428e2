"""``stop_regex`` (upstream's sampling parameter): a request stops once the tail of its output
matches one of its regular expressions; ``finished_reason`` is then
``{"type": "stop", "matched": <the pattern>}`` (upstream's shape; the text is not trimmed).

Only the tail of the output is searched: as many tokens as the longest possible match has
characters (each token decodes to at least one character), plus one for a match that started in
the previous token. A pattern with unbounded repetition (``a+``) is searched over the last
:data:`UNBOUNDED_TAIL_CHARS` characters' worth of tokens.
"""

from __future__ import annotations

import importlib
import re
import sys
from typing import Any

# The regex parser of the standard library (``re._parser``; ``sre_parse`` before 3.11), which
# knows the widest match of a pattern.
_PARSER_MODULE = "re._parser" if sys.version_info >= (3, 11) else "sre_parse"
sre_parse: Any = importlib.import_module(_PARSER_MODULE)

# Tail searched for patterns whose longest match is unbounded.
UNBOUNDED_TAIL_CHARS = 256


def compile_stop_regexes(stop_regex: str | list[str] | None) -> list[str]:
    """The patterns of ``stop_regex`` as a list (empty strings dropped). ValueError naming the
    first one that is not a string or does not compile."""
    if stop_regex is None:
        return []
    patterns = [stop_regex] if isinstance(stop_regex, str) else stop_regex
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise ValueError("stop_regex must be a string or a list of strings")
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(
                f"stop_regex {pattern!r} is not a valid regular expression: {e}"
            ) from None
    return [p for p in patterns if p]


def max_match_chars(patterns: list[str]) -> int:
    """The most characters any of ``patterns`` can match (capped at UNBOUNDED_TAIL_CHARS)."""
    longest = 0
    for pattern in patterns:
        width = sre_parse.parse(pattern).getwidth()[1]
        longest = max(longest, min(width, UNBOUNDED_TAIL_CHARS))
    return longest


def match_stop_regex(tail: str, patterns: list[str]) -> str | None:
    """The first pattern that matches somewhere in ``tail``, or None."""
    for pattern in patterns:
        if re.search(pattern, tail):
            return pattern
    return None
