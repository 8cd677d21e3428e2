"""POST /v1/completions: OpenAI text completions on top of ``TokenizerManager.generate_request``.

The request is expanded to a batch of ``num_prompts * n`` engine requests (choice ``i`` is
copy ``i % n`` of prompt ``i // n``); the engine always sees a batch, so single and multiple
prompts share one code path. Sampling defaults are OpenAI's whatever the model's
generation_config.json says, as upstream (only chat takes the model's).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from sglang.srt.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    new_id,
)
from sglang.srt.entrypoints.openai.serving_base import (
    OpenAIServingBase,
    StreamState,
    first_output,
    json_response,
    map_finish_reason,
    sse_event,
    stream_response,
)
from sglang.srt.managers.io_struct import GenerateReqInput

_MAX_LOGPROBS = 20


class OpenAIServingCompletion(OpenAIServingBase):
    """Handler of /v1/completions. ``handle`` raises ValueError for bad requests (-> 400)."""

    async def handle(self, req: CompletionRequest, raw_request: Request) -> Response:
        prompts = _prompt_list(req.prompt)
        _check_request(req)
        self.check_num_choices(req.n, len(prompts))
        echoes = self._echo_texts(req, prompts)
        obj = self._to_generate(req, prompts)
        tracker = self.metrics.new_request(stream=req.stream)
        outputs = self.generate(obj, raw_request)
        first = await first_output(outputs, req.stream)
        response_id = new_id("cmpl")
        if req.stream:
            return self._stream(req, first, outputs, tracker, echoes, response_id)
        tracker.observe(first)
        return json_response(self._response(req, first, echoes, response_id))

    def _to_generate(self, req: CompletionRequest, prompts: list[Any]) -> GenerateReqInput:
        params = self.sampling_params(req, req.max_tokens, req.stop, model_defaults={})
        per_choice = self.per_choice_params(params, req.seed, req.n, len(prompts))
        expanded = [p for p in prompts for _ in range(req.n)]
        is_text = isinstance(expanded[0], str)
        return GenerateReqInput(
            text=expanded if is_text else None,
            input_ids=None if is_text else expanded,
            sampling_params=per_choice,
            rid=self.rids(req.rid, len(prompts), req.n),
            return_logprob=req.logprobs is not None,
            # echo + logprobs: the prompt's logprobs too (the first token's is None).
            logprob_start_len=0 if req.echo and req.logprobs is not None else -1,
            top_logprobs_num=req.logprobs or 0,
            return_text_in_logprobs=True,
            stream=req.stream,
            return_entropy=req.return_entropy,
            entropy_mode=req.entropy_mode,
            entropy_top_k=req.entropy_top_k,
            lora_path=self.lora_path(req.model, req.lora_path),
        )

    def _echo_texts(self, req: CompletionRequest, prompts: list[Any]) -> list[str]:
        """Per-choice text to prepend when ``echo`` is set. Token prompts are decoded without
        their special tokens, as upstream; ValueError when there is no tokenizer to do so."""
        if not req.echo:
            return [""] * (len(prompts) * req.n)
        tokenizer = self.tm.tokenizer
        if tokenizer is None and not isinstance(prompts[0], str):
            raise ValueError("echo with token-id prompts needs a tokenizer (server runs with "
                             "--skip-tokenizer-init)")
        texts = [p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=True)
                 for p in prompts]
        return [t for t in texts for _ in range(req.n)]

    def _logprobs(self, meta: dict[str, Any], start: int, offset: int,
                  with_prompt: bool = False) -> CompletionLogprobs:
        """Logprobs of output tokens ``start:``; ``offset`` is the text offset of the first.
        ``with_prompt`` (echo): the prompt tokens' logprobs come first."""
        result = CompletionLogprobs()
        if with_prompt:
            offset = self._add_logprobs(result, meta.get("input_token_logprobs") or [],
                                        meta.get("input_top_logprobs") or [], 0, 0)
        self._add_logprobs(result, meta.get("output_token_logprobs") or [],
                           meta.get("output_top_logprobs") or [], start, offset)
        return result

    def _add_logprobs(self, result: CompletionLogprobs, tokens_lp: list, tops: list,
                      start: int, offset: int) -> int:
        """Append entries ``start:`` of ``tokens_lp``; returns the text offset after them."""
        for pos in range(start, len(tokens_lp)):
            logprob, token_id, text = tokens_lp[pos]
            token = self.token_text(token_id, text)
            result.tokens.append(token)
            result.token_logprobs.append(logprob)
            result.text_offset.append(offset)
            offset += len(token)
            top = tops[pos] if pos < len(tops) and tops[pos] else None
            result.top_logprobs.append(
                {self.token_text(t_id, t_text): t_lp for t_lp, t_id, t_text in top}
                if top else None
            )
        return offset

    def _response(self, req: CompletionRequest, outputs: list[dict[str, Any]],
                  echoes: list[str], response_id: str) -> CompletionResponse:
        choices = []
        for i, out in enumerate(outputs):
            meta = out["meta_info"]
            finish_reason, matched = map_finish_reason(meta)
            choices.append(CompletionChoice(
                index=i,
                text=echoes[i] + out.get("text", ""),
                logprobs=self._logprobs(meta, 0, len(echoes[i]), with_prompt=req.echo)
                if req.logprobs is not None else None,
                finish_reason=finish_reason,
                matched_stop=matched,
                output_token_entropy=self.entropy_slice(meta, 0, req.return_entropy),
                metadata=self.weight_metadata(meta),
            ))
        return CompletionResponse(
            id=response_id, model=self.model_name, choices=choices,
            usage=self.usage(outputs, req.n),
            metadata={"weight_version": outputs[0]["meta_info"].get("weight_version")},
        )

    def _stream(self, req: CompletionRequest, first: Any,
                outputs: AsyncGenerator[Any, None], tracker: Any, echoes: list[str],
                response_id: str) -> Response:
        state = StreamState(len(echoes))
        offsets = [len(e) for e in echoes]
        prompt_sent: set[int] = set()  # choices whose echoed prompt logprobs were sent
        continuous_usage = bool(req.stream_options and req.stream_options.continuous_usage_stats)

        def render(out: dict[str, Any]) -> Iterable[bytes]:
            tracker.observe(out)
            delta = state.advance(out)
            i = delta.index
            text = delta.text
            if delta.token_start == 0 and echoes[i]:
                text = echoes[i] + text
            logprobs = None
            if req.logprobs is not None:
                with_prompt = req.echo and i not in prompt_sent
                prompt_sent.add(i)
                logprobs = self._logprobs(delta.meta_info, delta.token_start,
                                          0 if with_prompt else offsets[i], with_prompt)
                offsets[i] = (logprobs.text_offset[-1] + len(logprobs.tokens[-1])
                              if logprobs.tokens else offsets[i])
            if not text and delta.finish_reason is None and not (logprobs and logprobs.tokens):
                return
            choice = CompletionChoice(
                index=i, text=text, logprobs=logprobs, finish_reason=delta.finish_reason,
                matched_stop=delta.matched_stop,
                output_token_entropy=self.entropy_slice(
                    delta.meta_info, delta.token_start, req.return_entropy),
                metadata=None if delta.finish_reason is None
                else self.weight_metadata(delta.meta_info),
            )
            # continuous_usage_stats: every chunk carries its choice's usage so far (upstream).
            chunk = CompletionStreamResponse(
                id=response_id, model=self.model_name, choices=[choice],
                usage=self.choice_usage(delta.meta_info) if continuous_usage else None)
            yield sse_event(chunk.model_dump())

        def trailer() -> Iterable[bytes]:
            if self.stream_includes_usage(req.stream_options):
                chunk = CompletionStreamResponse(
                    id=response_id, model=self.model_name, choices=[],
                    usage=self.usage(state.final_outputs(), req.n),
                )
                yield sse_event(chunk.model_dump())

        return stream_response(
            first, outputs, render,
            trailer=trailer,
        )


def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[Any]:
    """The prompts as a list of strings or a list of token-id lists; empty ones are rejected."""
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise ValueError("prompt is empty")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("prompt is empty")
    return prompts


def _check_request(req: CompletionRequest) -> None:
    unsupported = req.unsupported_fields()
    if unsupported:
        raise ValueError(f"not supported by this server: {', '.join(unsupported)}")
    if req.suffix:
        raise ValueError("suffix is not supported")
    if req.n < 1:
        raise ValueError(f"n must be >= 1, got {req.n}")
    if req.logprobs is not None and not 0 <= req.logprobs <= _MAX_LOGPROBS:
        raise ValueError(f"logprobs must be in [0, {_MAX_LOGPROBS}], got {req.logprobs}")
