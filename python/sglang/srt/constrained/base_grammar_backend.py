"""What the engine needs from a grammar library, and the request fields that name a grammar.

A request constrains its output with exactly one of the sampling parameters ``json_schema``,
``regex``, ``ebnf`` or ``structural_tag`` (SGLang's names; :func:`grammar_spec`). The frontend
checks the text's syntax (:meth:`GrammarBackend.check`, no tokenizer needed); the scheduler
compiles it against the model's vocabulary (:meth:`GrammarBackend.matcher`) and keeps one
:class:`GrammarMatcher` per request, which says, before each sampled token, which tokens the
grammar allows (:meth:`GrammarMatcher.fill_bitmask`) and follows the tokens committed
(:meth:`GrammarMatcher.accept`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the request models import this module; torch stays out of --help
    import torch

# The sampling parameters that name a grammar, in the order they are looked up.
GRAMMAR_KEYS = ("json_schema", "regex", "ebnf", "structural_tag")
# json_schema's value that means "any JSON value" (SGLang's spelling).
ANY_JSON = "$$ANY$$"

GrammarSpec = tuple[str, str]  # (one of GRAMMAR_KEYS, the grammar's text)


class InvalidGrammarError(ValueError):
    """The grammar's text does not parse; the message says where."""


def grammar_spec(params: Any) -> GrammarSpec | None:
    """The (key, text) of the grammar that ``params`` (a SamplingParams or a dict) sets, None
    when it sets none. Empty values count as unset, as upstream."""
    get = params.get if isinstance(params, dict) else lambda k: getattr(params, k, None)
    for key in GRAMMAR_KEYS:
        value = get(key)
        if value:
            return key, value
    return None


class GrammarMatcher(ABC):
    """The state of one request's grammar over the tokens it has produced."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write row ``row`` of ``bitmask`` (int32 [rows, ceil(V / 32)] on the CPU): bit ``t``
        set iff token ``t`` may come next."""

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance over ``token_id``; False (and no change) when the grammar forbids it."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar is complete and a stop token was accepted."""


class GrammarBackend(ABC):
    """Checks grammar texts and compiles them for one vocabulary (compiled grammars cached)."""

    @abstractmethod
    def check(self, spec: GrammarSpec) -> None:
        """Raise InvalidGrammarError when ``spec``'s text does not parse."""

    @abstractmethod
    def matcher(self, spec: GrammarSpec, stop_token_ids: list[int]) -> GrammarMatcher:
        """A fresh matcher for ``spec``; ``stop_token_ids`` end the output once the grammar is
        complete (empty: the tokenizer's end-of-sequence tokens). Raises InvalidGrammarError as
        :meth:`check`."""

    @property
    @abstractmethod
    def bitmask_width(self) -> int:
        """int32 words per bitmask row: ceil(vocabulary size / 32)."""


def create_grammar_backend(
    name: str, tokenizer: Any, vocab_size: int, any_whitespace: bool = True
) -> GrammarBackend | None:
    """The backend ``name`` (--grammar-backend) over ``tokenizer`` (None: syntax checks only);
    None for ``"none"`` (constrained decoding off)."""
    if name == "none":
        return None
    if name != "xgrammar":
        raise ValueError(f"unknown grammar backend {name!r}")
    from sglang.srt.constrained.xgrammar_backend import XGrammarBackend

    return XGrammarBackend(tokenizer, vocab_size, any_whitespace)
