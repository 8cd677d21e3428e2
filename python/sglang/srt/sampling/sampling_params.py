"""Per-request sampling parameters (SGLang's names and defaults)."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, fields
from typing import Any

from sglang.srt.constrained.base_grammar_backend import GRAMMAR_KEYS
from sglang.srt.sampling.stop_regex import compile_stop_regexes

_GREEDY_EPS = 1e-6


@dataclass
class SamplingParams:
    """What a request asks of the sampler and of the stop conditions.

    ``temperature == 0`` means greedy. ``top_k == -1`` disables top-k. ``max_new_tokens == 0``
    asks for the prefill only (prompt logprobs; no output token). ``sampling_seed`` makes
    sampling reproducible: the noise depends only on (seed, absolute position, token id).
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop: str | list[str] | None = None
    stop_regex: str | list[str] | None = None  # see sampling/stop_regex.py
    stop_token_ids: list[int] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    n: int = 1
    # Streamed requests: send output every this many tokens (None: --stream-interval).
    stream_interval: int | None = None
    # Constrained decoding: at most one of these (docs/constrained_decoding.md).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    # Added to the logits of the named token ids ("id" -> bias) before sampling.
    logit_bias: dict[str, float] | None = None
    # Derived by normalize(): the stop strings and stop regexes as lists.
    stop_strs: list[str] = field(default_factory=list, repr=False)
    stop_regex_strs: list[str] = field(default_factory=list, repr=False)

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> SamplingParams:
        """Build from a user dict; an unknown key is a ValueError naming it."""
        params = dict(params or {})
        known = {f.name for f in fields(cls)} - {"stop_strs", "stop_regex_strs"}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"Unknown sampling parameter(s): {', '.join(unknown)}")
        try:
            sp = cls(**params)
        except TypeError as e:
            raise ValueError(f"Invalid sampling parameters: {e}") from e
        sp.verify()
        return sp

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    def verify(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first invalid field."""
        _check_number("temperature", self.temperature)
        _check_number("top_p", self.top_p)
        _check_number("min_p", self.min_p)
        for name in ("max_new_tokens", "min_new_tokens", "top_k", "n"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens}"
            )
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not 0 < self.repetition_penalty <= 2:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.stream_interval is not None and (
            isinstance(self.stream_interval, bool)
            or not isinstance(self.stream_interval, int)
            or self.stream_interval < 1
        ):
            raise ValueError(
                f"stream_interval must be an integer >= 1, got {self.stream_interval!r}"
            )
        if self.sampling_seed is not None and (
            not isinstance(self.sampling_seed, int) or isinstance(self.sampling_seed, bool)
        ):
            raise ValueError(f"sampling_seed must be an integer, got {self.sampling_seed!r}")
        if self.stop is not None and not isinstance(self.stop, (str, list)):
            raise ValueError("stop must be a string or a list of strings")
        if isinstance(self.stop, list) and not all(isinstance(s, str) for s in self.stop):
            raise ValueError("stop must be a string or a list of strings")
        compile_stop_regexes(self.stop_regex)
        grammars = [k for k in GRAMMAR_KEYS if getattr(self, k) is not None]
        for key in grammars:
            if not isinstance(getattr(self, key), str):
                raise ValueError(f"{key} must be a string")
        if len([k for k in grammars if getattr(self, k)]) > 1:
            raise ValueError(f"at most one of {', '.join(GRAMMAR_KEYS)} may be set")
        if self.logit_bias is not None:
            _check_logit_bias(self.logit_bias, vocab_size)
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, list) or not all(
                isinstance(t, int) for t in self.stop_token_ids
            ):
                raise ValueError("stop_token_ids must be a list of integers")
            if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stop_token_ids):
                raise ValueError(f"stop_token_ids must be in [0, {vocab_size})")

    def normalize(self) -> None:
        """Derive ``stop_strs`` from ``stop``; greedy requests drop top-k/p sampling knobs."""
        if self.stop is None:
            self.stop_strs = []
        elif isinstance(self.stop, str):
            self.stop_strs = [self.stop] if self.stop else []
        else:
            self.stop_strs = [s for s in self.stop if s]
        self.stop_regex_strs = compile_stop_regexes(self.stop_regex)
        if self.temperature < _GREEDY_EPS:
            self.temperature = 0.0


def is_token_id_key(key: Any) -> bool:
    """A logit_bias key: a decimal string (JSON's keys) or, from Python, a non-negative int."""
    if isinstance(key, str):
        return key.isascii() and key.isdecimal()
    return isinstance(key, int) and not isinstance(key, bool) and key >= 0


def _check_logit_bias(bias: Any, vocab_size: int | None) -> None:
    """``bias`` maps token ids (decimal strings as JSON has them, or ints) to finite numbers."""
    if not isinstance(bias, dict):
        raise ValueError("logit_bias must be an object mapping token ids to numbers")
    for token, value in bias.items():
        if not is_token_id_key(token):
            raise ValueError(f"logit_bias keys must be token ids, got {token!r}")
        if vocab_size is not None and int(token) >= vocab_size:
            raise ValueError(f"logit_bias keys must be in [0, {vocab_size}), got {token}")
        _check_number(f"logit_bias[{token!r}]", value)
        if not math.isfinite(value):
            raise ValueError(f"logit_bias[{token!r}] must be finite, got {value}")


def _check_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")


def derive_seed(random_seed: int, rid: str) -> int:
    """Seed of a request that gave no ``sampling_seed``: stable across processes and runs
    (blake2b of the engine seed and the rid), in [0, 2**63)."""
    digest = hashlib.blake2b(f"{random_seed}\x00{rid}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)
