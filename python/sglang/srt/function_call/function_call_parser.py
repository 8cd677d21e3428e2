"""``FunctionCallParser`` (upstream's name and signature): tool calls out of a model's output.

* ``qwen25`` (alias ``qwen``): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call;
* ``llama3``: ``<|python_tag|>`` and/or JSON ``{"name": ..., "parameters": {...}}``, calls
  separated by ``;``.

Text before the first call is the message content. Calls to functions not among ``tools`` are
dropped (logged), as upstream. Streaming holds the text from a possible call start on, and
returns each call once it is complete (for llama3: at the end of the output).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

_QWEN_START, _QWEN_END = "<tool_call>", "</tool_call>"
_LLAMA_TAG = "<|python_tag|>"


@dataclass
class ToolCallItem:
    """One parsed call: ``parameters`` is the arguments as a JSON string."""

    tool_index: int
    name: str
    parameters: str


class FunctionCallParser:
    """Parse calls to ``tools`` (objects or dicts with ``function.name``) in format
    ``tool_call_parser``; ValueError for an unknown format."""

    def __init__(self, tools: list[Any] | None, tool_call_parser: str) -> None:
        if tool_call_parser not in ("qwen25", "qwen", "llama3"):
            raise ValueError(
                f"unknown tool call parser {tool_call_parser!r}; supported: qwen25, llama3"
            )
        self.format = "llama3" if tool_call_parser == "llama3" else "qwen25"
        self.tool_names = [_tool_name(t) for t in tools or []]
        self._buffer = ""
        self._holding = False
        self._num_calls = 0

    def has_tool_call(self, text: str) -> bool:
        """Whether ``text`` contains the start of a call in this format."""
        if self.format == "qwen25":
            return _QWEN_START in text
        return _LLAMA_TAG in text or text.lstrip().startswith("{")

    def parse_non_stream(self, full_text: str) -> tuple[str, list[ToolCallItem]]:
        """``(content before the first call, calls)``; text that does not parse stays content."""
        start = self._call_start(full_text)
        if start is None:
            return full_text, []
        calls = self._parse_calls(full_text[start:])
        if calls is None:
            return full_text, []
        return full_text[:start], calls

    def parse_stream_chunk(self, chunk_text: str, final: bool = False
                           ) -> tuple[str, list[ToolCallItem]]:
        """``(content delta, calls completed by this chunk)``. ``final`` ends the output: what
        was held is parsed (or given back as content when it is not a call)."""
        self._buffer += chunk_text
        if not self._holding:
            start = self._call_start(self._buffer)
            if start is None:
                keep = 0 if final else self._possible_start(self._buffer)
                content = self._buffer[: len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return content, []
            content, self._buffer, self._holding = self._buffer[:start], self._buffer[start:], True
        else:
            content = ""
        calls: list[ToolCallItem] = []
        if self.format == "qwen25":
            while (end := self._buffer.find(_QWEN_END)) >= 0:
                cut = end + len(_QWEN_END)
                block, self._buffer = self._buffer[:cut], self._buffer[cut:]
                calls += self._parse_calls(block) or []
                self._buffer = self._buffer.lstrip()
        if final and self._buffer:
            held, self._buffer = self._buffer, ""
            parsed = self._parse_calls(held)
            if parsed is None:
                content += held
            else:
                calls += parsed
        return content, calls

    # ---- format details ----------------------------------------------------------------------
    def _call_start(self, text: str) -> int | None:
        if self.format == "qwen25":
            pos = text.find(_QWEN_START)
            return pos if pos >= 0 else None
        pos = text.find(_LLAMA_TAG)
        if pos >= 0:
            return pos
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith("{") else None

    def _possible_start(self, text: str) -> int:
        """How many trailing characters of ``text`` could begin a call (held back)."""
        marker = _QWEN_START if self.format == "qwen25" else _LLAMA_TAG
        for size in range(min(len(text), len(marker) - 1), 0, -1):
            if marker.startswith(text[-size:]):
                return size
        return 0

    def _parse_calls(self, text: str) -> list[ToolCallItem] | None:
        """The calls in ``text`` (which starts at a call), or None when it is not valid."""
        if self.format == "qwen25":
            bodies = [part.split(_QWEN_END)[0] for part in text.split(_QWEN_START)[1:]]
        else:
            text = text.replace(_LLAMA_TAG, "")
            bodies = _split_json_objects(text)
        calls = []
        for body in bodies:
            try:
                data = json.loads(body)
            except json.JSONDecodeError:
                return None
            if not isinstance(data, dict) or not isinstance(data.get("name"), str):
                return None
            args = data.get("arguments", data.get("parameters", {}))
            if self.tool_names and data["name"] not in self.tool_names:
                logger.warning("Dropping a call to %r: not among the tools", data["name"])
                continue
            calls.append(ToolCallItem(self._num_calls, data["name"],
                                      json.dumps(args, ensure_ascii=False)))
            self._num_calls += 1
        return calls


def _split_json_objects(text: str) -> list[str]:
    """The JSON objects of ``obj; obj; ...`` (or objects one after another)."""
    decoder = json.JSONDecoder()
    bodies, pos = [], 0
    while pos < len(text):
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
        if pos >= len(text):
            break
        try:
            _, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return [text[pos:]]  # not JSON: the caller refuses it
        bodies.append(text[pos:end])
        pos = end
    return bodies


def _tool_name(tool: Any) -> str:
    function = tool["function"] if isinstance(tool, dict) else tool.function
    return function["name"] if isinstance(function, dict) else function.name
