"""The grammar backend over the ``xgrammar`` library (SGLang's default backend).

``xgrammar`` is imported on first use: it takes about two seconds to import, which a server
that never sees a grammar does not pay.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from typing import Any

import torch

from sglang.srt.constrained.base_grammar_backend import (
    ANY_JSON,
    GrammarBackend,
    GrammarMatcher,
    GrammarSpec,
    InvalidGrammarError,
)

logger = logging.getLogger(__name__)

# Compiled grammars kept per backend (xgrammar's cache, least recently used out first).
_CACHE_LIMIT_BYTES = 256 * 1024 * 1024
# xgrammar prefixes its messages with a time and a C++ source location; users need neither.
_NOISE = re.compile(r"\[[0-9:]+\] \S+:\d+: |Check failed: \(.*?\) is false: ")


def _xgr() -> Any:
    import xgrammar

    return xgrammar


def _clean(error: Exception) -> str:
    return _NOISE.sub("", str(error)).strip().splitlines()[0] if str(error).strip() else repr(error)


class XGrammarMatcher(GrammarMatcher):
    """One request's ``xgrammar.GrammarMatcher``."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


class XGrammarBackend(GrammarBackend):
    """xgrammar over one tokenizer and vocabulary size (the model's, padded ids included: ids
    the tokenizer does not have are never allowed). ``tokenizer`` None: :meth:`check` only
    (the frontend's syntax check). ``any_whitespace`` False: JSON outputs take xgrammar's
    fixed layout, a space after each colon and comma and no other whitespace
    (--constrained-json-disable-any-whitespace)."""

    def __init__(self, tokenizer: Any, vocab_size: int, any_whitespace: bool = True) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._any_whitespace = any_whitespace
        self._compiler: Any = None

    @property
    def bitmask_width(self) -> int:
        return (self._vocab_size + 31) // 32

    def check(self, spec: GrammarSpec) -> None:
        self._grammar(_xgr(), spec)

    def matcher(self, spec: GrammarSpec, stop_token_ids: list[int]) -> GrammarMatcher:
        xgr = _xgr()
        compiled = self._get_compiler(xgr).compile_grammar(self._grammar(xgr, spec))
        stops = stop_token_ids or None  # None: the tokenizer's (TokenizerInfo's) stop tokens
        return XGrammarMatcher(xgr.GrammarMatcher(compiled, override_stop_tokens=stops))

    def _grammar(self, xgr: Any, spec: GrammarSpec) -> Any:
        """``spec`` parsed into an ``xgrammar.Grammar`` (the compiler caches what it compiled
        from it); InvalidGrammarError when it does not parse."""
        key, text = spec
        try:
            if key == "json_schema":
                if text == ANY_JSON:
                    return xgr.Grammar.builtin_json_grammar()
                return xgr.Grammar.from_json_schema(text, any_whitespace=self._any_whitespace)
            if key == "regex":
                return xgr.Grammar.from_regex(text)
            if key == "ebnf":
                return xgr.Grammar.from_ebnf(text)
            return xgr.Grammar.from_structural_tag(_structural_tag(xgr, text))
        except (RuntimeError, ValueError, TypeError, KeyError) as e:
            raise InvalidGrammarError(f"{key} is not a valid grammar: {_clean(e)}") from None

    def _get_compiler(self, xgr: Any) -> Any:
        if self._compiler is None:
            if self._tokenizer is None:
                raise RuntimeError("constrained decoding needs the tokenizer (not loaded)")
            start = time.monotonic()
            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size)
            self._compiler = xgr.GrammarCompiler(
                info, max_threads=min(os.cpu_count() or 1, 8), cache_limit_bytes=_CACHE_LIMIT_BYTES
            )
            logger.info("Grammar backend xgrammar ready in %.2f s", time.monotonic() - start)
        return self._compiler


def _structural_tag(xgr: Any, text: str) -> Any:
    """xgrammar's structural tag for ``text``: SGLang's original format
    ``{"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}`` converted, any
    other (xgrammar's own ``{"type": "structural_tag", "format": ...}``) passed as it is."""
    try:
        tag = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e})") from None
    if isinstance(tag, dict) and "structures" in tag:
        if not isinstance(tag.get("triggers"), list) or not isinstance(tag["structures"], list):
            raise ValueError("'structures' and 'triggers' must be lists")
        items = [
            xgr.StructuralTagItem(
                begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"]
            )
            for s in tag["structures"]
        ]
        return xgr.StructuralTag.from_legacy_structural_tag(items, tag["triggers"])
    return text
