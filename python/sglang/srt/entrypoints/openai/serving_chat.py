"""POST /v1/chat/completions: chat on top of ``TokenizerManager.generate_request``.

The conversation is rendered with the tokenizer's chat template (or ``--chat-template``) and
tokenized here, without adding special tokens again (the template already has them), so the
engine receives ``input_ids``. The request is expanded to ``n`` engine requests, one per choice.
Sampling fields the request leaves out (or sends as null) take the model's
generation_config.json values (upstream's ``--sampling-defaults model``; sampling_defaults.py).
With ``--reasoning-parser`` the reasoning goes to ``reasoning_content`` (unless the request sets
``separate_reasoning: false``); with
``--tool-call-parser`` (and ``tools`` in the request) calls go to ``tool_calls`` and the finish
reason "stop" becomes "tool_calls" (chat_parsing.py). ``tool_choice`` "required" or a named
function constrains the output to a JSON array of calls (docs/constrained_decoding.md), which
becomes ``tool_calls`` without a parser.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from sglang.srt.entrypoints.openai.chat_parsing import ChatOutputParser
from sglang.srt.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
    UsageInfo,
    new_id,
)
from sglang.srt.entrypoints.openai.sampling_defaults import load_model_sampling_defaults
from sglang.srt.entrypoints.openai.serving_base import (
    OpenAIServingBase,
    StreamState,
    first_output,
    json_response,
    map_finish_reason,
    sse_event,
    stream_response,
)
from sglang.srt.managers.field_checks import InvalidRequestError
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.request_validation import TOKENIZE_INLINE_MAX_CHARS

_MAX_TOP_LOGPROBS = 20


class OpenAIServingChat(OpenAIServingBase):
    """Handler of /v1/chat/completions. ``handle`` raises ValueError for bad requests (-> 400).

    ``chat_template`` (the text of a Jinja template) replaces the tokenizer's own when given.
    The model's sampling defaults are read once, here, from ``tokenizer_manager.model_path``
    (none with ``server_args.sampling_defaults == "openai"``).
    """

    def __init__(self, tokenizer_manager: Any, metrics: Any, chat_template: str | None) -> None:
        super().__init__(tokenizer_manager, metrics)
        self.chat_template = chat_template
        self.reasoning_parser = getattr(self.server_args, "reasoning_parser", None)
        self.tool_call_parser = getattr(self.server_args, "tool_call_parser", None)
        self.model_sampling_defaults = load_model_sampling_defaults(
            tokenizer_manager.model_path, getattr(self.server_args, "sampling_defaults", "model")
        )

    def _output_parser(self, req: ChatCompletionRequest) -> ChatOutputParser:
        use_tools = bool(req.tools) and req.tool_choice != "none"
        return ChatOutputParser(
            self.reasoning_parser if req.separate_reasoning else None,
            self.tool_call_parser if use_tools else None, req.tools,
            stream_reasoning=req.stream_reasoning, forced_calls=req.forces_tool_calls,
        )

    async def handle(self, req: ChatCompletionRequest, raw_request: Request) -> Response:
        _check_request(req)
        self.check_num_choices(req.n, 1)
        input_ids = await self._render_off_loop(req)
        obj = self._to_generate(req, input_ids)
        tracker = self.metrics.new_request(stream=req.stream)
        outputs = self.generate(obj, raw_request)
        first = await first_output(outputs, req.stream)
        response_id = new_id("chatcmpl")
        if req.stream:
            return self._stream(req, first, outputs, tracker, response_id)
        tracker.observe(first)
        return json_response(self._response(req, first, response_id))

    async def _render_off_loop(self, req: ChatCompletionRequest) -> list[int]:
        """:meth:`render_prompt`, in a worker thread when the messages are long (the event
        loop keeps serving); InvalidRequestError when they are over --max-prompt-bytes."""
        num_chars = req.content_chars()
        max_bytes = self.tm.limits.max_prompt_bytes
        if num_chars > max_bytes:
            raise InvalidRequestError(
                "messages", f"the messages have more than {max_bytes} characters "
                            "(--max-prompt-bytes)")
        if num_chars <= TOKENIZE_INLINE_MAX_CHARS:
            return self.render_prompt(req)
        return await asyncio.to_thread(self.render_prompt, req)

    def render_prompt(self, req: ChatCompletionRequest) -> list[int]:
        """Token ids of the conversation rendered by the chat template.

        Raises ValueError when there is no tokenizer or template, or the template fails.
        """
        tokenizer = self.tm.tokenizer
        if tokenizer is None:
            raise ValueError("chat completions need a tokenizer (server runs with "
                             "--skip-tokenizer-init)")
        messages = [_message_dict(m) for m in req.messages]
        template_kwargs = dict(req.chat_template_kwargs or {})
        if req.tools and req.tool_choice != "none":
            template_kwargs.setdefault("tools", req.tools)
        if req.reasoning_effort is not None:
            template_kwargs.setdefault("reasoning_effort", req.reasoning_effort)
        if req.reasoning_effort == "none":
            # Templates switch thinking off by one of these names (Qwen3 and GLM use the
            # second, DeepSeek and Kimi the first); an explicit chat_template_kwargs wins.
            template_kwargs.setdefault("thinking", False)
            template_kwargs.setdefault("enable_thinking", False)
        try:
            text = tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=not req.continue_final_message,
                continue_final_message=req.continue_final_message,
                chat_template=self.chat_template,
                **template_kwargs,
            )
        except Exception as e:  # jinja and tokenizer errors all mean a request we cannot render
            raise ValueError(f"cannot apply the chat template: {e}") from e
        return tokenizer.encode(text, add_special_tokens=False)

    def _to_generate(self, req: ChatCompletionRequest, input_ids: list[int]) -> GenerateReqInput:
        max_tokens = (req.max_completion_tokens if req.max_completion_tokens is not None
                      else req.max_tokens)
        params = self.sampling_params(req, max_tokens, req.stop, self.model_sampling_defaults)
        return GenerateReqInput(
            input_ids=[list(input_ids) for _ in range(req.n)],
            sampling_params=self.per_choice_params(params, req.seed, req.n, 1),
            rid=self.rids(req.rid, 1, req.n),
            return_logprob=req.logprobs,
            top_logprobs_num=(req.top_logprobs or 0) if req.logprobs else 0,
            return_text_in_logprobs=True,
            stream=req.stream,
            return_entropy=req.return_entropy,
            entropy_mode=req.entropy_mode,
            entropy_top_k=req.entropy_top_k,
            lora_path=self.lora_path(req.model, req.lora_path),
        )

    def _logprobs(self, meta: dict[str, Any], start: int) -> ChatChoiceLogprobs:
        tokens_lp = meta.get("output_token_logprobs") or []
        tops = meta.get("output_top_logprobs") or []
        content = []
        for pos in range(start, len(tokens_lp)):
            logprob, token_id, text = tokens_lp[pos]
            token = self.token_text(token_id, text)
            top = tops[pos] if pos < len(tops) and tops[pos] else []
            content.append(ChatTokenLogprob(
                token=token, logprob=logprob, bytes=list(token.encode("utf-8")),
                top_logprobs=[_top_entry(self.token_text(t_id, t_text), t_lp)
                              for t_lp, t_id, t_text in top],
            ))
        return ChatChoiceLogprobs(content=content)

    def _response(self, req: ChatCompletionRequest, outputs: list[dict[str, Any]],
                  response_id: str) -> ChatCompletionResponse:
        choices = []
        for i, out in enumerate(outputs):
            meta = out["meta_info"]
            finish_reason, matched = map_finish_reason(meta)
            parsed = self._output_parser(req).parse_whole(out.get("text", ""))
            if parsed.tool_calls and finish_reason == "stop":
                finish_reason = "tool_calls"
            choices.append(ChatCompletionChoice(
                index=i,
                message=ChatResponseMessage(
                    content=parsed.content, reasoning_content=parsed.reasoning or None,
                    tool_calls=parsed.tool_calls or None,
                ),
                logprobs=self._logprobs(meta, 0) if req.logprobs else None,
                finish_reason=finish_reason,
                matched_stop=matched,
                output_token_entropy=self.entropy_slice(meta, 0, req.return_entropy),
                metadata=self.weight_metadata(meta),
            ))
        return ChatCompletionResponse(
            id=response_id, model=self.model_name, choices=choices,
            usage=self.usage(outputs, req.n),
            metadata={"weight_version": outputs[0]["meta_info"].get("weight_version")},
        )

    def _stream(self, req: ChatCompletionRequest, first: Any,
                outputs: AsyncGenerator[Any, None], tracker: Any, response_id: str) -> Response:
        state = StreamState(req.n)
        role_sent: set[int] = set()
        parsers = [self._output_parser(req) for _ in range(req.n)]
        continuous_usage = bool(req.stream_options and req.stream_options.continuous_usage_stats)

        def chunk(choice: ChatCompletionStreamChoice, usage: UsageInfo | None = None) -> bytes:
            return sse_event(ChatCompletionStreamResponse(
                id=response_id, model=self.model_name, choices=[choice], usage=usage,
            ).model_dump())

        def render(out: dict[str, Any]) -> Iterable[bytes]:
            tracker.observe(out)
            delta = state.advance(out)
            i = delta.index
            if i not in role_sent:
                # OpenAI's first chunk of each choice carries the role and empty content.
                role_sent.add(i)
                yield chunk(ChatCompletionStreamChoice(
                    index=i, delta=DeltaMessage(role="assistant", content="")))
            logprobs = self._logprobs(delta.meta_info, delta.token_start) if req.logprobs else None
            parsed = parsers[i].feed(delta.text, final=delta.finish_reason is not None)
            # One tool-call delta per chunk, as upstream: a call's name, then its arguments.
            first_calls, more_calls = parsed.tool_calls[:1], parsed.tool_calls[1:]
            # continuous_usage_stats: each content chunk carries its choice's usage so far, as
            # upstream (the role and finish_reason chunks do not).
            usage = self.choice_usage(delta.meta_info) if continuous_usage else None
            if parsed or (logprobs and logprobs.content):
                yield chunk(ChatCompletionStreamChoice(
                    index=i, delta=DeltaMessage(
                        content=parsed.content or None if parsed.reasoning else parsed.content,
                        reasoning_content=parsed.reasoning or None,
                        tool_calls=first_calls or None,
                    ), logprobs=logprobs,
                    output_token_entropy=self.entropy_slice(
                        delta.meta_info, delta.token_start, req.return_entropy),
                ), usage)
            for call in more_calls:
                yield chunk(ChatCompletionStreamChoice(
                    index=i, delta=DeltaMessage(tool_calls=[call])), usage)
            if delta.finish_reason is not None:
                finish_reason = delta.finish_reason
                if parsers[i].num_tool_calls and finish_reason == "stop":
                    finish_reason = "tool_calls"
                yield chunk(ChatCompletionStreamChoice(
                    index=i, delta=DeltaMessage(), finish_reason=finish_reason,
                    matched_stop=delta.matched_stop,
                    metadata=self.weight_metadata(delta.meta_info),
                ))

        def trailer() -> Iterable[bytes]:
            if self.stream_includes_usage(req.stream_options):
                yield sse_event(ChatCompletionStreamResponse(
                    id=response_id, model=self.model_name, choices=[],
                    usage=self.usage(state.final_outputs(), req.n),
                ).model_dump())

        return stream_response(
            first, outputs, render,
            trailer=trailer,
        )


def _message_dict(message: Any) -> dict[str, Any]:
    """A message as the chat template expects it; text parts are joined, others rejected."""
    data = message.model_dump(exclude_none=True)
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"unsupported content part type {part.type!r}: only text")
            texts.append(part.text)
        data["content"] = "".join(texts)
    elif content is None:
        data["content"] = ""
    return data


def _top_entry(token: str, logprob: float) -> TopLogprob:
    return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))


def _check_request(req: ChatCompletionRequest) -> None:
    unsupported = req.unsupported_fields()
    if unsupported:
        raise ValueError(f"not supported by this server: {', '.join(unsupported)}")
    if req.n < 1:
        raise ValueError(f"n must be >= 1, got {req.n}")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= _MAX_TOP_LOGPROBS:
        raise ValueError(
            f"top_logprobs must be in [0, {_MAX_TOP_LOGPROBS}], got {req.top_logprobs}"
        )
    if req.top_logprobs and not req.logprobs:
        raise ValueError("top_logprobs requires logprobs to be true")
