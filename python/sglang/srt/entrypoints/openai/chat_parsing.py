"""One chat choice's output split into reasoning, content and tool calls, whole or chunk by
chunk: the reasoning parser runs first, the tool-call parser on what remains (the answer)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from sglang.srt.entrypoints.openai.protocol import FunctionResponse, ToolCall
from sglang.srt.function_call.function_call_parser import FunctionCallParser
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
    """Parsers for one choice (None: that part is not parsed). ``tools``: the request's."""

    def __init__(self, reasoning_parser: str | None, tool_call_parser: str | None,
                 tools: list[Any] | None) -> None:
        self.reasoning = ReasoningParser(reasoning_parser) if reasoning_parser else None
        self.tools = FunctionCallParser(tools, tool_call_parser) if tool_call_parser else None
        self.num_tool_calls = 0

    def feed(self, text: str, final: bool) -> ParsedDelta:
        """The next piece of output (``final`` on the last one, which releases held text)."""
        reasoning, answer = "", text
        if self.reasoning is not None:
            reasoning, answer = self.reasoning.parse_stream_chunk(text, final)
        calls: list[ToolCall] = []
        if self.tools is not None:
            answer, items = self.tools.parse_stream_chunk(answer, final)
            for item in items:
                calls.append(ToolCall(
                    id=f"call_{uuid.uuid4().hex[:24]}", index=self.num_tool_calls,
                    function=FunctionResponse(name=item.name, arguments=item.parameters),
                ))
                self.num_tool_calls += 1
        return ParsedDelta(answer, reasoning, calls)
