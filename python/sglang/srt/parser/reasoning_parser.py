"""``ReasoningParser`` (upstream's name and signature): split a model's reasoning, written between
think markers, from its answer, whole or while streaming.

| model_type | markers | reasoning starts |
|---|---|---|
| ``qwen3`` | ``<think>`` ... ``</think>`` | only when the output opens with ``<think>`` |
| ``deepseek-r1`` | ``<think>`` ... ``</think>`` | at once (the chat template already opened it) |
"""

from __future__ import annotations

from dataclasses import dataclass

# model_type -> (start marker, end marker, reasoning from the first token)
_FORMATS: dict[str, tuple[str, str, bool]] = {
    "qwen3": ("<think>", "</think>", False),
    "deepseek-r1": ("<think>", "</think>", True),
}


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


@dataclass
class ReasoningDetector:
    """The markers of one format and the streaming state of one output."""

    think_start_token: str
    think_end_token: str
    force_reasoning: bool
    _buffer: str = ""
    _state: str = "start"  # start (undecided) | reasoning | answer

    def __post_init__(self) -> None:
        if self.force_reasoning:
            self._state = "reasoning"

    def feed(self, chunk: str, final: bool = False) -> tuple[str, str]:
        """The ``(reasoning, answer)`` text that ``chunk`` completes; with ``final``, also what
        was held back (a partial marker is then plain text of the part it is in)."""
        self._buffer += chunk
        reasoning, answer = "", ""
        if self._state == "start":
            stripped = self._buffer.lstrip()
            if stripped.startswith(self.think_start_token):
                self._buffer = stripped[len(self.think_start_token):]
                self._state = "reasoning"
            elif self.think_start_token.startswith(stripped) and not final:
                return "", ""  # could still become the start marker
            else:
                self._state = "answer"
        if self._state == "reasoning":
            end = self._buffer.find(self.think_end_token)
            if end >= 0:
                reasoning = self._buffer[:end]
                self._buffer = self._buffer[end + len(self.think_end_token):]
                self._state = "answer"
            else:
                keep = 0 if final else _partial_suffix(self._buffer, self.think_end_token)
                reasoning = self._buffer[: len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep:]
        if self._state == "answer":
            answer, self._buffer = self._buffer, ""
        return reasoning, answer


def think_end_token(model_type: str) -> str:
    """The marker that ends the reasoning of ``model_type`` (ValueError for an unknown one)."""
    if model_type not in _FORMATS:
        raise ValueError(f"unknown reasoning parser {model_type!r}; supported: {sorted(_FORMATS)}")
    return _FORMATS[model_type][1]


class ReasoningParser:
    """Split reasoning from answer for ``model_type`` (one of :data:`_FORMATS`; ValueError
    otherwise). One parser per output: streaming keeps state across chunks."""

    def __init__(self, model_type: str, stream_reasoning: bool = True,
                 force_reasoning: bool | None = None) -> None:
        if model_type not in _FORMATS:
            raise ValueError(
                f"unknown reasoning parser {model_type!r}; supported: {sorted(_FORMATS)}"
            )
        start, end, forced = _FORMATS[model_type]
        self.detector = ReasoningDetector(
            start, end, forced if force_reasoning is None else force_reasoning
        )
        self.stream_reasoning = stream_reasoning

    def parse_non_stream(self, full_text: str) -> tuple[str | None, str]:
        """``(reasoning or None, answer)`` of a whole output."""
        reasoning, answer = self.detector.feed(full_text, final=True)
        return (reasoning.strip() or None), answer.lstrip()

    def parse_stream_chunk(self, chunk_text: str, final: bool = False) -> tuple[str, str]:
        """``(reasoning delta, answer delta)`` for the next chunk; text that may be part of a
        marker is held until the next chunk (``final`` releases it)."""
        return self.detector.feed(chunk_text, final)
