"""Pydantic models of the OpenAI-compatible API (/v1/completions, /v1/chat/completions).

Request models accept OpenAI's fields plus SGLang's extra sampling fields (``top_k``,
``min_p``, ``ignore_eos``, ...) in the same body. Response models serialize to exactly the
shapes the official ``openai`` Python client parses; fields that are None are kept (the client
expects e.g. ``"logprobs": null`` and ``"finish_reason": null`` in stream chunks).
Unknown request fields are ignored, as OpenAI-compatible servers commonly do; upstream SGLang's
extras for features this engine does not have are declared so that a request setting one is
refused by name (``SamplingExtras.unsupported_fields``) rather than answered as if it were not
set. Request models
are strict (docs/security.md): a boolean is not a number, a string is not a boolean, numbers
are finite; the values are then checked like native requests by the TokenizerManager.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator


def new_id(prefix: str) -> str:
    """A fresh response id such as ``cmpl-<hex>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# ---------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------
# The configuration of every request model: strict types, finite numbers.
_STRICT = ConfigDict(strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False
    continuous_usage_stats: bool = False


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # {"cached_tokens": N} with --enable-cache-report when N > 0, else None.
    prompt_tokens_details: dict[str, int] | None = None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """``{"error": {"message", "type", "param", "code"}}``: how every error is reported. On /v1
    endpoints the body also has upstream SGLang's top-level ``object: "error"``, ``message``,
    ``type``, ``param`` and ``code`` (``serving_base.error_body``)."""

    error: ErrorInfo
    object: Literal["error"] | None = None
    message: str | None = None
    type: str | None = None
    param: str | None = None
    code: int | None = None


class SamplingExtras(BaseModel):
    """SGLang's fields accepted next to OpenAI's in a request body (both endpoints).

    ``temperature``, ``top_p``, ``top_k``, ``min_p`` and ``repetition_penalty`` are declared by
    each request model: chat takes ``null`` for them (the model's default, as upstream),
    completions does not.
    """

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    return_entropy: bool = False
    # LoRA adapter name (docs/lora.md); upstream's ``model: "base:adapter"`` also names one.
    lora_path: str | None = None
    # Entropy definition for return_entropy (docs/entropy.md); None: the server's default.
    entropy_mode: str | None = None
    entropy_top_k: int | None = None
    # One id, or (upstream's list form) one per prompt; suffixed per choice when n > 1.
    rid: str | list[str] | None = None
    # Structured output (docs/constrained_decoding.md): {"type": "text"}, {"type":
    # "json_object"}, {"type": "json_schema", "json_schema": {"name", "schema"}} or a
    # structural tag ({"type": "structural_tag", ...}).
    response_format: dict[str, Any] | None = None
    # SGLang's constrained decoding: at most one, and not with a response_format.
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    # OpenAI's: token id (a decimal string) -> a bias added to its logit.
    logit_bias: dict[str, float] | None = None
    # Upstream SGLang's extras for features this engine does not have (they change the tokens
    # or promise more output): refused by name when set; None, false or empty is accepted.
    return_hidden_states: bool = False
    return_routed_experts: bool = False
    return_cached_tokens_details: bool = False
    custom_logit_processor: str | list[str | None] | None = None
    session_params: dict[str, Any] | None = None
    bootstrap_host: str | list[str] | None = None
    bootstrap_room: int | list[int] | None = None

    @field_validator("response_format")
    @classmethod
    def _check_response_format(cls, fmt: dict[str, Any] | None) -> dict[str, Any] | None:
        response_format_grammar(fmt)
        return fmt

    def unsupported_fields(self) -> list[str]:
        """The fields of this request that ask for features this engine does not have."""
        return [name for name in _REFUSED_WHEN_SET if _is_set(getattr(self, name))]

    def extra_sampling_params(self) -> dict[str, Any]:
        """The SGLang-only entries of ``sampling_params`` (names as SamplingParams spells them)."""
        return {
            "min_new_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "stop_token_ids": self.stop_token_ids,
            "stop_regex": self.stop_regex,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "no_stop_trim": self.no_stop_trim,
            "regex": self.regex,
            "json_schema": self.json_schema,
            "ebnf": self.ebnf,
            "logit_bias": self.logit_bias,
            **response_format_grammar(self.response_format),
        }


# The SamplingExtras fields refused when set, in the order the refusal names them.
_REFUSED_WHEN_SET = (
    "return_hidden_states", "return_routed_experts", "return_cached_tokens_details",
    "custom_logit_processor", "session_params", "bootstrap_host", "bootstrap_room",
)


def response_format_grammar(fmt: dict[str, Any] | None) -> dict[str, str]:
    """The ``sampling_params`` grammar entry for an OpenAI ``response_format`` (as upstream):
    nothing for ``text`` (or none), ``json_schema`` = ``{"type": "object"}`` for
    ``json_object``, the given schema for ``json_schema`` (any JSON object without one), and
    the whole object as ``structural_tag`` for ``structural_tag``. ValueError for any other
    shape."""
    if fmt is None:
        return {}
    kind = fmt.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": json.dumps({"type": "object"})}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("response_format 'json_schema' needs a 'json_schema' object")
        schema = spec.get("schema", spec.get("schema_", {"type": "object"}))
        if not isinstance(schema, (dict, bool)):
            raise ValueError("response_format.json_schema.schema must be a JSON Schema object")
        return {"json_schema": json.dumps(schema)}
    if kind == "structural_tag":
        return {"structural_tag": json.dumps(fmt)}
    raise ValueError(
        f"response_format type must be one of text, json_object, json_schema, "
        f"structural_tag; got {kind!r}"
    )


def _is_set(value: Any) -> bool:
    """True unless ``value`` is None, false, empty, or a list of such values."""
    if isinstance(value, list):
        return any(_is_set(v) for v in value)
    return bool(value)


# ---------------------------------------------------------------------------------------------
# /v1/models
# ---------------------------------------------------------------------------------------------
class ModelCard(BaseModel):
    """One entry of /v1/models: the served model (``root`` its checkpoint), or a loaded LoRA
    adapter (upstream's shape: ``id`` its name, ``root`` its path, ``parent`` the served
    model's name, no ``max_model_len``)."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "sglang"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---------------------------------------------------------------------------------------------
# /v1/completions
# ---------------------------------------------------------------------------------------------
class CompletionRequest(SamplingExtras):
    """Body of POST /v1/completions. ``prompt``: a string, strings, token ids, or lists of ids."""

    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    # At least 1, as OpenAI and upstream (the native API's max_new_tokens may be 0).
    max_tokens: PositiveInt | None = 16
    # OpenAI's defaults, whatever the model's generation config says (as upstream).
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = None
    echo: bool = False
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    suffix: str | None = None
    user: str | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    output_token_entropy: list[float] | None = None
    # {"weight_version", "weight_versions"} of this choice's tokens (docs/weights.md)
    metadata: dict[str, Any] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    metadata: dict[str, Any] | None = None  # {"weight_version"} (SGLang's field)


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------------------------------
# /v1/chat/completions
# ---------------------------------------------------------------------------------------------
class ChatContentPart(BaseModel):
    """One part of a multi-part message content; only text parts are supported."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One message of the conversation. Extra keys (name, tool_calls, ...) go to the template."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "tool", "function", "developer"]
    content: str | list[ChatContentPart] | None = None


class ChatCompletionRequest(SamplingExtras):
    """Body of POST /v1/chat/completions."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    # None (left out or null): the model's generation_config.json value, else OpenAI's
    # (sampling_defaults.py).
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    user: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    # Passed to the chat template as upstream does; "none" also turns thinking off there.
    reasoning_effort: Literal["none", "low", "medium", "high"] | None = None
    # With --reasoning-parser: false leaves the reasoning inline in content; stream_reasoning
    # false sends it in one delta once complete instead of token by token.
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    # Tools are rendered into the prompt by the chat template; calls come back in
    # message.tool_calls with --tool-call-parser, else as plain text. tool_choice "required" or
    # a named function ({"type": "function", "function": {"name": ...}}) constrains the output
    # to a JSON array of calls (forced_tool_schema), parsed into message.tool_calls.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    @field_validator("tools")
    @classmethod
    def _check_tools(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        """Each tool must carry a ``function`` object with a string ``name`` (what upstream's
        ``Tool`` model requires) and, if any, object ``parameters``; the dicts are kept as
        sent, for the chat template."""
        for i, tool in enumerate(tools or []):
            function = tool.get("function")
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ValueError(f"tools[{i}] needs a 'function' object with a string 'name'")
            parameters = function.get("parameters")
            if parameters is not None and not isinstance(parameters, dict):
                raise ValueError(f"tools[{i}].function.parameters must be a JSON Schema object")
            if not isinstance((parameters or {}).get("$defs", {}), dict):
                raise ValueError(f"tools[{i}].function.parameters.$defs must be an object")
        return tools

    def content_chars(self) -> int:
        """Characters of text in the messages (what the chat template renders)."""
        total = 0
        for message in self.messages:
            parts = message.content if isinstance(message.content, list) else [message]
            for part in parts:
                text = part.text if isinstance(part, ChatContentPart) else part.content
                total += len(text) if isinstance(text, str) else 0
        return total

    @field_validator("tool_choice")
    @classmethod
    def _check_tool_choice(cls, choice: str | dict[str, Any] | None) -> Any:
        if choice is None or choice in ("none", "auto", "required"):
            return choice
        function = choice.get("function") if isinstance(choice, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError('tool_choice must be "none", "auto", "required" or {"type": '
                             '"function", "function": {"name": ...}}')
        return choice

    @property
    def forces_tool_calls(self) -> bool:
        """tool_choice "required" or a named function (with tools): the output is calls."""
        return bool(self.tools) and (
            self.tool_choice == "required" or isinstance(self.tool_choice, dict))

    def forced_tool_schema(self) -> dict[str, Any] | None:
        """The JSON schema a forced tool choice puts on the output, as upstream's: an array of
        ``{"name", "parameters"}`` objects, one or more for "required" (any of the tools),
        exactly one for a named function. None when the choice forces nothing. ValueError when
        the named function is not among the tools."""
        if not self.forces_tool_calls:
            return None
        tools = [t["function"] for t in self.tools or []]
        if isinstance(self.tool_choice, dict):
            name = self.tool_choice["function"]["name"]
            tools = [f for f in tools if f["name"] == name]
            if not tools:
                raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
        calls = [{
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [f["name"]]},
                "parameters": f.get("parameters") or {"type": "object", "properties": {}},
            },
            "required": ["name", "parameters"],
        } for f in tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if isinstance(self.tool_choice, dict):
            schema["maxItems"] = 1
        # References inside the parameters ("#/$defs/...") resolve against the root.
        defs = {k: v for f in tools for k, v in ((f.get("parameters") or {}).get("$defs") or {})
                .items()}
        if defs:
            schema["$defs"] = defs
        return schema

    def extra_sampling_params(self) -> dict[str, Any]:
        params = super().extra_sampling_params()
        schema = self.forced_tool_schema()
        if schema is not None:
            if any(params.get(k) for k in ("regex", "json_schema", "ebnf", "structural_tag")):
                raise ValueError(f"tool_choice {self.tool_choice!r} constrains the output to "
                                 f"tool calls; it cannot be combined with response_format, "
                                 f"regex, json_schema or ebnf")
            params["json_schema"] = json.dumps(schema)
        return params


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class Function(BaseModel):
    """A function a tool offers (upstream's ``protocol.Function``)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    """One entry of a request's ``tools`` (upstream's ``protocol.Tool``)."""

    type: Literal["function"] = "function"
    function: Function


class FunctionResponse(BaseModel):
    name: str | None = None
    arguments: str | None = None  # JSON text


class ToolCall(BaseModel):
    """A call parsed by --tool-call-parser (``index`` orders the calls of a choice). Streamed,
    only a call's first delta has ``id`` and ``function.name``; later ones add arguments."""

    id: str | None = None
    index: int | None = None
    type: Literal["function"] = "function"
    function: FunctionResponse


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser
    tool_calls: list[ToolCall] | None = None  # with --tool-call-parser


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    output_token_entropy: list[float] | None = None
    # {"weight_version", "weight_versions"} of this choice's tokens (docs/weights.md)
    metadata: dict[str, Any] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    metadata: dict[str, Any] | None = None  # {"weight_version"} (SGLang's field)


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    output_token_entropy: list[float] | None = None
    # {"weight_version", "weight_versions"} of this choice's tokens (docs/weights.md)
    metadata: dict[str, Any] | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
