"""One chat choice's output split into reasoning, content and tool calls, whole or chunk by
chunk: the reasoning parser runs first, the tool-call parser on what remains (the answer).

Streamed tool calls arrive as upstream's (and OpenAI's) deltas: a call's first delta has its
``id``, ``type`` and ``function.name`` (``arguments`` empty, or the first fragment), later ones
only ``index`` and an ``arguments`` fragment; the fragments concatenate to the arguments the
whole (non-streamed) response has."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from sglang.srt.entrypoints.openai.protocol import FunctionResponse, ToolCall
from sglang.srt.function_call.function_call_parser import FunctionCallParser, ToolCallItem
from sglang.srt.parser.reasoning_parser import ReasoningParser


@dataclass
class ParsedDelta:
    """What one ``feed`` produced; falsy when there is nothing to send."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


class ChatOutputParser:
    """Parsers for one choice (None: that part is not parsed). ``tools``: the request's.

    ``stream_reasoning`` False (the request's): ``feed`` holds the reasoning back and returns
    it whole, in the piece where the answer starts (or the final one), as upstream does.
    """

    def __init__(self, reasoning_parser: str | None, tool_call_parser: str | None,
                 tools: list[Any] | None, stream_reasoning: bool = True,
                 forced_calls: bool = False) -> None:
        self.reasoning = ReasoningParser(reasoning_parser) if reasoning_parser else None
        self.tools = (FunctionCallParser(tools, tool_call_parser)
                      if tool_call_parser and not forced_calls else None)
        self.stream_reasoning = stream_reasoning
        # tool_choice "required" or named: the answer is a JSON array of calls (its grammar
        # made it so), held while streaming and parsed whole at the end.
        self.forced_calls = forced_calls
        self.held_answer = ""
        self.held_reasoning = ""
        self.num_tool_calls = 0

    def feed(self, text: str, final: bool) -> ParsedDelta:
        """The next piece of output (``final`` on the last one, which releases held text)."""
        reasoning, answer = "", text
        if self.reasoning is not None:
            reasoning, answer = self.reasoning.parse_stream_chunk(text, final)
            if not self.stream_reasoning:
                # The reasoning is complete once answer text follows it (or the output ends).
                self.held_reasoning += reasoning
                reasoning = ""
                if answer or final:
                    reasoning, self.held_reasoning = self.held_reasoning, ""
        calls: list[ToolCall] = []
        if self.forced_calls:
            self.held_answer += answer
            if not final:
                return ParsedDelta("", reasoning)
            answer, calls = self._json_calls(self.held_answer)
        elif self.tools is not None:
            answer, items = self.tools.parse_stream_chunk(answer, final)
            calls = self._deltas(items)
        return ParsedDelta(answer, reasoning, calls)

    def parse_whole(self, text: str) -> ParsedDelta:
        """A whole output: each tool call complete, in one ``ToolCall``."""
        reasoning, answer = "", text
        if self.reasoning is not None:
            reasoning, answer = self.reasoning.parse_stream_chunk(text, True)
        calls: list[ToolCall] = []
        if self.forced_calls:
            answer, calls = self._json_calls(answer)
        elif self.tools is not None:
            answer, items = self.tools.parse_non_stream(answer)
            for item in items:
                calls.append(ToolCall(
                    id=_new_call_id(), index=self.num_tool_calls,
                    function=FunctionResponse(name=item.name, arguments=item.parameters),
                ))
                self.num_tool_calls += 1
        return ParsedDelta(answer, reasoning, calls)

    def _json_calls(self, answer: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a forced answer: ``[{"name", "parameters"}, ...]`` becomes one
        call each (``arguments`` the parameters as JSON), with no content; an answer that is
        not such an array (cut short by max_tokens or a stop string) stays content."""
        try:
            items = json.loads(answer)
        except json.JSONDecodeError:
            return answer, []
        if not isinstance(items, list) or not all(
            isinstance(i, dict) and isinstance(i.get("name"), str) and "parameters" in i
            for i in items
        ):
            return answer, []
        calls = []
        for item in items:
            calls.append(ToolCall(
                id=_new_call_id(), index=self.num_tool_calls, function=FunctionResponse(
                    name=item["name"],
                    arguments=json.dumps(item["parameters"], ensure_ascii=False)),
            ))
            self.num_tool_calls += 1
        return "", calls

    def _deltas(self, items: list[ToolCallItem]) -> list[ToolCall]:
        """The deltas of ``items``: a call's first (id, type, name, empty arguments), then its
        argument fragments of this piece joined into one."""
        calls: list[ToolCall] = []
        for item in items:
            if item.name is not None:
                calls.append(ToolCall(
                    id=_new_call_id(), index=item.tool_index,
                    function=FunctionResponse(name=item.name, arguments=item.parameters),
                ))
                self.num_tool_calls += 1
            elif calls and calls[-1].index == item.tool_index and calls[-1].id is None:
                function = calls[-1].function
                function.arguments = (function.arguments or "") + item.parameters
            else:
                calls.append(ToolCall(
                    index=item.tool_index, function=FunctionResponse(arguments=item.parameters)
                ))
        return calls


def _new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
