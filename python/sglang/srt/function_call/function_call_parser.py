"""``FunctionCallParser`` (upstream's name and signature): tool calls out of a model's output.

* ``qwen25`` (alias ``qwen``): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call;
* ``llama3``: ``<|python_tag|>`` and/or JSON ``{"name": ..., "parameters": {...}}``, calls
  separated by ``;``.

Text before the first call is the message content. Calls to functions not among ``tools`` are
dropped (logged), as upstream.

Streaming is incremental, as upstream's: :meth:`FunctionCallParser.parse_stream_chunk` returns
a call's first :class:`ToolCallItem` (``name`` set, ``parameters`` empty) as soon as the name is
complete, then ``parameters`` fragments (``name`` None) while the arguments are generated.
The fragments are the arguments re-encoded token by token as ``json.dumps(arguments,
ensure_ascii=False)`` writes them, so they concatenate to exactly the ``parameters`` that
:meth:`FunctionCallParser.parse_non_stream` returns for the same output. A call whose JSON is
not ``{"name": ..., "arguments"/"parameters": ...}`` in that order is sent whole once complete.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

_QWEN_START, _QWEN_END = "<tool_call>", "</tool_call>"
_LLAMA_TAG = "<|python_tag|>"
_WHITESPACE = " \t\r\n"
# The head of a call's JSON up to where its arguments begin: name first, then the arguments.
_CALL_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)
_SCALAR = re.compile(r'[^\s,:\[\]{}"]+')


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


@dataclass
class ToolCallItem:
    """One parsed call, or (streaming) one piece of it: ``name`` on a call's first item only,
    ``parameters`` the arguments as JSON text (a fragment of it while streaming)."""

    tool_index: int
    name: str | None
    parameters: str


class _JsonStream:
    """The canonical text (``json.dumps(value, ensure_ascii=False)``) of one JSON value while
    its raw text arrives: complete tokens are re-encoded and returned at once (strings as far
    as their characters are complete, numbers and literals once delimited). ``done`` once the
    value is complete (``end``: where it ended in the raw text); ``error`` when the text is not
    JSON, after which nothing more is returned."""

    def __init__(self) -> None:
        self.raw = ""
        self.pos = 0
        self.stack: list[str] = []
        self.text = ""  # everything returned so far
        self.done = False
        self.error = False
        self._string_start: int | None = None  # in a string: where its characters begin
        self._string_sent = 0  # decoded characters of that string already returned

    def feed(self, text: str) -> str:
        self.raw += text
        parts: list[str] = []
        while not (self.done or self.error):
            if self._string_start is not None:
                piece, closed = self._scan_string()
                parts.append(piece)
                if not closed:
                    break
                self._value_ended()
                continue
            while self.pos < len(self.raw) and self.raw[self.pos] in _WHITESPACE:
                self.pos += 1
            if self.pos >= len(self.raw):
                break
            char = self.raw[self.pos]
            if char in "{[":
                self.stack.append(char)
                parts.append(char)
                self.pos += 1
            elif char in "}]":
                if not self.stack or "{[".index(self.stack.pop()) != "}]".index(char):
                    self.error = True
                    break
                parts.append(char)
                self.pos += 1
                self._value_ended()
            elif char in ",:":
                if not self.stack:
                    self.error = True
                    break
                parts.append(char + " ")
                self.pos += 1
            elif char == '"':
                parts.append('"')
                self.pos += 1
                self._string_start, self._string_sent = self.pos, 0
            else:
                match = _SCALAR.match(self.raw, self.pos)
                assert match is not None
                if match.end() == len(self.raw):
                    break  # a number may go on: wait for its delimiter
                try:
                    value = json.loads(match.group())
                except json.JSONDecodeError:
                    self.error = True
                    break
                parts.append(json.dumps(value))
                self.pos = match.end()
                self._value_ended()
        out = "".join(parts)
        self.text += out
        return out

    @property
    def end(self) -> int:
        return self.pos

    def _value_ended(self) -> None:
        if not self.stack:
            self.done = True

    def _scan_string(self) -> tuple[str, bool]:
        """The newly complete characters of the current string, re-encoded; and whether the
        string closed (then its closing quote is included)."""
        assert self._string_start is not None
        raw, i, closed = self.raw, self.pos, False
        while i < len(raw):
            char = raw[i]
            if char == "\\":
                step = 6 if raw[i + 1 : i + 2] == "u" else 2
                if i + step > len(raw):
                    break  # an escape still being written
                i += step
            elif char == '"':
                closed = True
                break
            else:
                i += 1
        self.pos = i
        try:
            decoded = json.loads('"' + raw[self._string_start : i] + '"')
        except json.JSONDecodeError:
            self.error = True
            return "", False
        if not closed and decoded and "\ud800" <= decoded[-1] <= "\udbff":
            decoded = decoded[:-1]  # half of a surrogate pair: wait for the other half
        new = decoded[self._string_sent :]
        self._string_sent = len(decoded)
        piece = json.dumps(new, ensure_ascii=False)[1:-1]
        if closed:
            self.pos = i + 1
            self._string_start = None
            piece += '"'
        return piece, closed


@dataclass
class _StreamedCall:
    """The call being streamed: its raw JSON so far, and what was sent of it."""

    body: str = ""
    outer: _JsonStream = field(default_factory=_JsonStream)  # finds where the JSON ends
    args: _JsonStream | None = None  # the arguments' canonical text, once they began
    args_from: int = 0  # where the arguments begin in ``body``
    tool_index: int | None = None  # set once the name was sent
    dropped: bool = False  # a function not among the tools: nothing is sent


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
        self._num_calls = 0
        # streaming state
        self._buffer = ""  # text received and not handled yet
        self._sent_text = False  # content was returned (a bare llama3 "{" starts no call then)
        self._in_calls = False  # past the first call: text outside calls is not content
        self._call: _StreamedCall | None = None

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

    def parse_stream_chunk(
        self, chunk_text: str, final: bool = False
    ) -> tuple[str, list[ToolCallItem]]:
        """``(content delta, call items)`` for the next piece of output: a call's first item
        carries its name, the next ones fragments of its arguments. ``final`` ends the output:
        held text is released (as content when it turned out not to be a call)."""
        self._buffer += chunk_text
        content = ""
        items: list[ToolCallItem] = []
        while True:
            if self._call is not None:
                ended, given_back = self._advance_call(items, final)
                content += given_back
                if not ended:
                    break
                continue
            if not self._in_calls:
                start = self._call_start(self._buffer) if self._may_start() else None
                if start is None:
                    keep = 0 if final else self._possible_start(self._buffer)
                    cut = len(self._buffer) - keep
                    content += self._buffer[:cut]
                    self._sent_text = self._sent_text or bool(self._buffer[:cut])
                    self._buffer = self._buffer[cut:]
                    break
                content += self._buffer[:start]
                self._buffer = self._buffer[start:]
                self._in_calls = True
            if not self._open_call(final):
                break
        if final and self._buffer:
            content += self._buffer  # a held start marker that no call followed
            self._buffer = ""
        return content, items

    # ---- streaming steps ---------------------------------------------------------------------
    def _may_start(self) -> bool:
        """A llama3 call may begin with a bare "{" only at the start of the output."""
        return self.format == "qwen25" or not self._sent_text or _LLAMA_TAG in self._buffer

    def _open_call(self, final: bool) -> bool:
        """Between calls: drop what is not a call and begin the next one. False when more
        text is needed."""
        if self.format == "qwen25":
            start = self._buffer.find(_QWEN_START)
            if start < 0:
                keep = self._possible_start(self._buffer)
                self._drop(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return False
            self._drop(self._buffer[:start])
            self._buffer = self._buffer[start + len(_QWEN_START) :]
            self._call = _StreamedCall()
            return True
        rest = self._buffer.lstrip(_WHITESPACE + ";")
        if rest.startswith(_LLAMA_TAG):
            rest = rest[len(_LLAMA_TAG) :].lstrip(_WHITESPACE)
        if not rest or (_LLAMA_TAG.startswith(rest) and not final):
            self._buffer = rest
            return False
        if not rest.startswith("{"):
            self._drop(rest)
            self._buffer = ""
            return False
        self._buffer = rest
        self._call = _StreamedCall()
        return True

    def _advance_call(self, items: list[ToolCallItem], final: bool) -> tuple[bool, str]:
        """Feed the buffered text to the current call. Returns whether the call ended (the
        buffer then holds what follows it) and text to give back as content (a "call" that
        turned out not to be one)."""
        call = self._call
        assert call is not None
        text, self._buffer, ended = self._buffer, "", False
        if self.format == "qwen25":
            end = text.find(_QWEN_END)
            if end >= 0:
                text, self._buffer, ended = text[:end], text[end + len(_QWEN_END) :], True
            else:  # hold a possible start of the end marker
                keep = _partial_suffix(text, _QWEN_END)
                text, self._buffer = text[: len(text) - keep], text[len(text) - keep :]
        call.body += text
        call.outer.feed(text)
        if self.format == "llama3" and call.outer.done:
            self._buffer = call.body[call.outer.end :] + self._buffer
            call.body, ended = call.body[: call.outer.end], True
        invalid = call.outer.error and call.tool_index is None
        if not invalid:
            self._stream_call(call, items)
        if not (ended or final or invalid):
            return False, ""
        self._call = None
        given_back = self._finish_call(call, items, closed=ended)
        if given_back:  # not a call: back to plain text
            self._in_calls, self._sent_text = False, True
            given_back += self._buffer
            self._buffer = ""
        return not given_back and (ended or invalid), given_back

    def _stream_call(self, call: _StreamedCall, items: list[ToolCallItem]) -> None:
        if call.args is None and not call.dropped:
            head = _CALL_HEAD.match(call.body)
            if head is None:
                return
            try:
                name = json.loads(f'"{head.group(1)}"')
            except json.JSONDecodeError:
                return
            if self.tool_names and name not in self.tool_names:
                logger.warning("Dropping a call to %r: not among the tools", name)
                call.dropped = True
                return
            call.tool_index = self._num_calls
            self._num_calls += 1
            call.args, call.args_from = _JsonStream(), head.end()
            items.append(ToolCallItem(call.tool_index, name, ""))
        if call.args is not None and call.tool_index is not None:
            fed = call.args_from + len(call.args.raw)
            piece = call.args.feed(call.body[fed:])
            if piece:
                items.append(ToolCallItem(call.tool_index, None, piece))

    def _finish_call(self, call: _StreamedCall, items: list[ToolCallItem], closed: bool) -> str:
        """The call's text ended: send what its arguments still lack, or the whole call when
        its name could not be streamed. Returns the call's text when it is not a call."""
        data = _call_data(call.body)
        if call.dropped:
            return ""
        if call.tool_index is None:
            if data is None:  # not a call after all: give the text back
                if self.format == "llama3":
                    return call.body
                return _QWEN_START + call.body + (_QWEN_END if closed else "")
            name, args = data
            if self.tool_names and name not in self.tool_names:
                logger.warning("Dropping a call to %r: not among the tools", name)
                return ""
            index = self._num_calls
            self._num_calls += 1
            items.append(ToolCallItem(index, name, ""))
            items.append(ToolCallItem(index, None, args))
            return ""
        if data is None:
            logger.warning("A streamed tool call did not end as valid JSON: %r", call.body)
            return ""
        sent = call.args.text if call.args is not None else ""
        if data[1].startswith(sent):
            if data[1][len(sent) :]:
                items.append(ToolCallItem(call.tool_index, None, data[1][len(sent) :]))
        else:
            logger.warning("Streamed arguments %r differ from the parsed %r", sent, data[1])
        return ""

    def _drop(self, text: str) -> None:
        if text.strip():
            logger.debug("Dropping text between tool calls: %r", text)

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
        if self.format == "llama3" and not self._sent_text and not text.strip():
            return len(text)  # only whitespace so far: a bare "{" may still start a call
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
            data = _call_data(body)
            if data is None:
                return None
            name, args = data
            if self.tool_names and name not in self.tool_names:
                logger.warning("Dropping a call to %r: not among the tools", name)
                continue
            calls.append(ToolCallItem(self._num_calls, name, args))
            self._num_calls += 1
        return calls


def _call_data(body: str) -> tuple[str, str] | None:
    """``(name, arguments as canonical JSON text)`` of a call's JSON, or None."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    args = data.get("arguments", data.get("parameters", {}))
    return data["name"], json.dumps(args, ensure_ascii=False)


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
