"""Every message that crosses a process boundary, as annotated dataclasses.

Flow (DESIGN §3)::

    TokenizerManager --TokenizedGenerateReqInput / control reqs--> Scheduler
    Scheduler --BatchTokenIDOutput--> DetokenizerManager --BatchStrOutput--> TokenizerManager
    Scheduler --control replies (same req_id as the request)--> TokenizerManager

Per-request output messages are *incremental*: each carries the tokens (and their logprobs)
produced since the previous message for that rid. The TokenizerManager accumulates them.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from sglang.srt.sampling.sampling_params import SamplingParams

# The label of the weights a server starts with, until update_weight_version or an update with
# ``weight_version`` names them (the one definition every process uses).
DEFAULT_WEIGHT_VERSION = "default"
# Longest weight-version label (it is repeated in every reply: keep it short).
MAX_VERSION_LEN = 256


def _new_id() -> str:
    return uuid.uuid4().hex


# ---------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------
# Fields of GenerateReqInput given once for a whole batch or as a list, one per prompt.
_PER_REQUEST_FIELDS = (
    "sampling_params",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_entropy",
    "entropy_mode",
    "entropy_top_k",
    "lora_path",
    "return_routed_experts",
    "routed_experts_start_len",
)


# Upstream GenerateReqInput fields for features this engine does not have (multimodal inputs,
# hidden states, custom logit processors, sessions, disaggregation): None / False / empty is
# accepted, as RL frameworks pass them unset; a set one is refused, never ignored.
UNSUPPORTED_GENERATE_FIELDS = (
    "input_embeds", "image_data", "video_data", "audio_data", "modalities", "token_ids_logprob",
    "return_hidden_states", "session_params", "lora_id",
    "custom_logit_processor", "bootstrap_host", "bootstrap_port", "bootstrap_room",
    "bootstrap_pair_key", "decode_tp_size", "require_reasoning", "background", "return_bytes",
    "need_wait_for_mm_inputs", "num_items_assigned", "max_dynamic_patch", "min_dynamic_patch",
    "image_max_dynamic_patch", "video_max_dynamic_patch",
)
# Upstream fields that do not change what is generated (data-parallel routing, priority without
# priority scheduling, cache/routing keys, metrics labels, tracing): accepted and not used.
IGNORED_GENERATE_FIELDS = (
    "routed_dp_rank", "disagg_prefill_dp_rank", "data_parallel_rank", "priority",
    "conversation_id", "extra_key", "routing_key", "no_logs",
    "custom_labels", "external_trace_header", "received_time",
)
# Fields upstream lets a client send as null, meaning the default.
_NULLABLE_DEFAULTS: dict[str, Any] = {
    "return_logprob": False, "logprob_start_len": -1, "top_logprobs_num": 0,
    "return_routed_experts": False, "routed_experts_start_len": 0,
}


def _is_set(value: Any) -> bool:
    """Whether an upstream-only field asks for something (not None / False / 0 / empty)."""
    if isinstance(value, (list, tuple, dict)):
        return any(_is_set(v) for v in (value.values() if isinstance(value, dict) else value))
    return value is not None and value is not False and value != 0 and value != ""


@dataclass
class GenerateReqInput:
    """A generate request as users send it: one prompt or a batch of prompts.

    Exactly one of ``text`` / ``input_ids`` is given. For a batch, per-request fields may be
    a single value (applied to all) or a list with one entry per prompt.
    """

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    # Prompt position from which input logprobs are returned; -1 (default): only the last
    # prompt token's entry, with a None logprob (upstream's shape).
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    return_entropy: bool | list[bool] = False
    # Entropy definition (docs/entropy.md): raw, scaled or sampled, and the top-k variant's K
    # (0 = full vocabulary). None: the server's --entropy-mode / --entropy-top-k.
    entropy_mode: str | list[str | None] | None = None
    entropy_top_k: int | list[int | None] | None = None
    # The LoRA adapter (its name, as upstream) of each prompt; None: the base model.
    lora_path: str | list[str | None] | None = None
    # MoE routing of the sequence (rollout routing replay; needs --enable-return-routed-experts):
    # meta_info["routed_experts"] covers positions [routed_experts_start_len, seqlen - 1).
    return_routed_experts: bool | list[bool] = False
    routed_experts_start_len: int | list[int] = 0
    log_metrics: bool = True
    # Upstream's other fields (UNSUPPORTED_GENERATE_FIELDS: refused when set;
    # IGNORED_GENERATE_FIELDS: accepted), so that code building upstream's request runs here.
    input_embeds: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    modalities: Any = None
    token_ids_logprob: Any = None
    return_hidden_states: Any = False
    session_params: Any = None
    lora_id: Any = None
    custom_logit_processor: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    bootstrap_pair_key: Any = None
    decode_tp_size: Any = None
    require_reasoning: Any = False
    background: Any = False
    return_bytes: Any = False
    need_wait_for_mm_inputs: Any = None
    num_items_assigned: Any = None
    max_dynamic_patch: Any = None
    min_dynamic_patch: Any = None
    image_max_dynamic_patch: Any = None
    video_max_dynamic_patch: Any = None
    routed_dp_rank: Any = None
    disagg_prefill_dp_rank: Any = None
    data_parallel_rank: Any = None
    priority: Any = None
    conversation_id: Any = None
    extra_key: Any = None
    routing_key: Any = None
    no_logs: Any = False
    custom_labels: Any = None
    external_trace_header: Any = None
    received_time: Any = None

    def __post_init__(self) -> None:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("Exactly one of 'text' or 'input_ids' must be provided")
        used = [name for name in UNSUPPORTED_GENERATE_FIELDS if _is_set(getattr(self, name))]
        if used:
            raise ValueError(f"not supported by this engine: {', '.join(used)}")
        for name, default in _NULLABLE_DEFAULTS.items():
            value = getattr(self, name)
            if value is None:
                setattr(self, name, default)
            elif isinstance(value, list):
                setattr(self, name, [default if v is None else v for v in value])

    @property
    def is_single(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, str)
        ids = self.input_ids or []
        return len(ids) == 0 or not isinstance(ids[0], list)

    @property
    def batch_size(self) -> int:
        if self.is_single:
            return 1
        prompts = self.text if self.text is not None else self.input_ids
        return len(prompts or [])

    def normalize_batch_and_arguments(self) -> None:
        """Fill defaults and check that every per-request list has one entry per prompt."""
        n = self.batch_size
        if not self.is_single and n == 0:
            raise ValueError("The batch of prompts is empty")
        if self.is_single:
            # A one-entry list is accepted for a single prompt (as for a batch of one).
            for name in _PER_REQUEST_FIELDS + ("rid",):
                value = getattr(self, name)
                if isinstance(value, list):
                    if len(value) != 1:
                        raise ValueError(
                            f"'{name}' has {len(value)} entries for a single prompt; give one "
                            "value (or a batch of prompts)"
                        )
                    setattr(self, name, value[0])
            if self.rid is None:
                self.rid = _new_id()
            if self.sampling_params is None:
                self.sampling_params = {}
            if not isinstance(self.sampling_params, dict):
                raise ValueError("'sampling_params' must be a JSON object (a dict)")
            return
        if self.rid is None:
            self.rid = [_new_id() for _ in range(n)]
        elif isinstance(self.rid, str):  # as upstream: one id per prompt, numbered
            self.rid = [f"{self.rid}_{i}" for i in range(n)]
        elif not isinstance(self.rid, list) or len(self.rid) != n:
            raise ValueError("'rid' must be a list with one id per prompt")
        if self.sampling_params is None:
            self.sampling_params = {}
        for name in _PER_REQUEST_FIELDS:
            value = getattr(self, name)
            if isinstance(value, list):
                if len(value) != n:
                    raise ValueError(f"'{name}' has {len(value)} entries for {n} prompts")
            else:
                setattr(self, name, [copy.deepcopy(value) for _ in range(n)])
        if not all(isinstance(p, dict) for p in self.sampling_params):
            raise ValueError("each entry of 'sampling_params' must be a JSON object (a dict)")

    def __getitem__(self, i: int) -> GenerateReqInput:
        """The i-th request of a normalized batch (every per-request field is a list), as a
        single request."""
        return GenerateReqInput(
            text=_entry(self.text, i),
            input_ids=_entry(self.input_ids, i),
            sampling_params=_entry(self.sampling_params, i),
            rid=_entry(self.rid, i),
            return_logprob=_entry(self.return_logprob, i),
            logprob_start_len=_entry(self.logprob_start_len, i),
            top_logprobs_num=_entry(self.top_logprobs_num, i),
            return_text_in_logprobs=self.return_text_in_logprobs,
            stream=self.stream,
            return_entropy=_entry(self.return_entropy, i),
            entropy_mode=_entry(self.entropy_mode, i),
            entropy_top_k=_entry(self.entropy_top_k, i),
            lora_path=_entry(self.lora_path, i),
            return_routed_experts=_entry(self.return_routed_experts, i),
            routed_experts_start_len=_entry(self.routed_experts_start_len, i),
            log_metrics=self.log_metrics,
        )


def _entry(values: object, i: int) -> Any:
    """Entry ``i`` of a per-prompt list of a normalized batch (None stays None)."""
    if values is None:
        return None
    if not isinstance(values, list):
        raise TypeError(f"a normalized batch field is a list, got {type(values).__name__}")
    return values[i]


@dataclass
class TokenizedGenerateReqInput:
    """One tokenized, validated request, sent from the TokenizerManager to the Scheduler."""

    rid: str
    input_text: str | None
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    return_entropy: bool = False
    entropy_mode: str | None = None  # None: the server's --entropy-mode
    entropy_top_k: int | None = None  # None: the server's --entropy-top-k
    lora_path: str | None = None  # LoRA adapter name; None: the base model
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0  # first position whose routing is returned


@dataclass
class BatchTokenIDOutput:
    """Scheduler -> detokenizer: new output tokens of several requests (incremental).

    Every list has one entry per rid. ``*_logprobs_*`` lists are None when no request of the
    batch asked for logprobs; otherwise the entry of a request that did not ask is empty.
    ``finished_reasons[i]`` is None while the request runs, else a dict such as
    ``{"type": "length", "length": 16}``.
    """

    rids: list[str]
    finished_reasons: list[dict[str, Any] | None]
    decode_ids: list[list[int]]  # output ids produced since the previous message for the rid
    skip_special_tokens: list[bool]
    spaces_between_special_tokens: list[bool]
    no_stop_trim: list[bool]
    # Length of the longest stop string (0: none). The detokenizer holds back that many - 1
    # trailing characters until the request finishes, so no stream chunk shows a partial stop.
    stop_str_max_len: list[int]
    prompt_tokens: list[int]
    completion_tokens: list[int]  # total so far, not incremental
    cached_tokens: list[int]
    retraction_counts: list[int]
    output_token_logprobs_val: list[list[float]] | None = None
    output_token_logprobs_idx: list[list[int]] | None = None
    output_top_logprobs_val: list[list[list[float]]] | None = None
    output_top_logprobs_idx: list[list[list[int]]] | None = None
    # Prompt logprobs are sent once, in the first message of the rid that carries them.
    input_token_logprobs_val: list[list[float | None]] | None = None
    input_token_logprobs_idx: list[list[int]] | None = None
    input_top_logprobs_val: list[list[list[float]]] | None = None
    input_top_logprobs_idx: list[list[list[int]]] | None = None
    output_token_entropy_val: list[list[float]] | None = None
    # Per rid, the weight-version spans ``[version, start, end)`` of the ids in this message, in
    # output-token positions (``start`` >= the tokens sent before). None: no version info.
    weight_version_spans: list[list[list]] | None = None
    weight_version: str | None = None  # the scheduler's current label when this was sent
    # Per rid, in its final message when it asked for them: the experts of each MoE layer for
    # positions [routed_experts_start_len, kv_len), base64 of int32 [rows, layers, top_k];
    # None otherwise. None for the whole list when no rid of the message has them.
    routed_experts: list[str | None] | None = None


@dataclass
class BatchStrOutput:
    """Detokenizer -> TokenizerManager: like BatchTokenIDOutput plus the new text."""

    rids: list[str]
    finished_reasons: list[dict[str, Any] | None]
    output_strs: list[str]  # text produced since the previous message for the rid
    output_ids: list[list[int]]  # ids produced since the previous message for the rid
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    retraction_counts: list[int]
    output_token_logprobs_val: list[list[float]] | None = None
    output_token_logprobs_idx: list[list[int]] | None = None
    output_top_logprobs_val: list[list[list[float]]] | None = None
    output_top_logprobs_idx: list[list[list[int]]] | None = None
    input_token_logprobs_val: list[list[float | None]] | None = None
    input_token_logprobs_idx: list[list[int]] | None = None
    input_top_logprobs_val: list[list[list[float]]] | None = None
    input_top_logprobs_idx: list[list[list[int]]] | None = None
    output_token_entropy_val: list[list[float]] | None = None
    weight_version_spans: list[list[list]] | None = None  # as in BatchTokenIDOutput
    weight_version: str | None = None
    routed_experts: list[str | None] | None = None  # as in BatchTokenIDOutput


# ---------------------------------------------------------------------------------------------
# Control requests: each gets exactly one reply carrying the same req_id.
# ---------------------------------------------------------------------------------------------
@dataclass
class AbortReq:
    """Abort the request ``rid`` (exact match, or every rid starting with it when
    ``match_prefix``), or every request with ``abort_all``."""

    rid: str = ""
    abort_all: bool = False
    finished_reason: dict[str, Any] | None = None
    aborted_message: str | None = None
    match_prefix: bool = False
    lora_name: str | None = None  # abort every request of this LoRA adapter
    req_id: str = field(default_factory=_new_id)


@dataclass
class AbortReqOutput:
    req_id: str
    num_aborted: int


@dataclass
class FlushCacheReqInput:
    req_id: str = field(default_factory=_new_id)


@dataclass
class FlushCacheReqOutput:
    success: bool
    flushed_items: int = 0
    error_msg: str = ""
    req_id: str = ""


@dataclass
class GetInternalStateReq:
    req_id: str = field(default_factory=_new_id)


@dataclass
class GetInternalStateReqOutput:
    internal_state: dict[str, Any]
    req_id: str = ""
    # With data parallelism: one state per DP rank (each with its ``dp_rank``), merged by the
    # DP controller; ``internal_state`` is then rank 0's. None with a single scheduler.
    internal_states: list[dict[str, Any]] | None = None


PAUSE_MODES = ("abort", "retract", "in_place", "keep", "wait")


@dataclass
class PauseGenerationReqInput:
    """Pause generation (DESIGN §5). ``mode``:

    * ``abort``: every request, running or waiting, finishes with its partial output;
    * ``retract``: running requests go back to the waiting queue and release their KV;
    * ``in_place``: running requests stay in the running batch with their KV;
    * ``keep`` (vLLM's name): ``in_place``, or ``retract`` + flush when ``clear_cache``;
    * ``wait`` (vLLM's name): admit nothing new, let running requests finish, then pause.
      ``timeout_s`` bounds the wait; requests still running then are retracted.

    For the other modes, ``timeout_s`` is a lease: the engine continues by itself when it
    expires, so a crashed trainer never leaves it paused.
    """

    # One of PAUSE_MODES, or an accepted alias ("in-place"); the scheduler resolves it and
    # refuses an unknown one with the state unchanged.
    mode: str = "abort"
    clear_cache: bool = False
    timeout_s: float | None = None
    # Pause only this LoRA adapter's requests (docs/lora.md); None: the whole engine.
    lora_name: str | None = None
    req_id: str = field(default_factory=_new_id)


@dataclass
class PauseGenerationReqOutput:
    success: bool
    message: str = ""
    mode: str = ""  # the resolved mode (abort | retract | in_place | wait)
    num_running: int = 0  # requests left in the running batch (in_place keeps them)
    num_retracted: int = 0
    num_aborted: int = 0
    num_waiting: int = 0  # requests in the waiting queue after the pause
    flushed: bool = False
    req_id: str = ""



@dataclass
class PauseStateOutput:
    """Sent by the scheduler, unsolicited, whenever its pause phase changes (a pause took
    effect, a drain ended, continue, the lease expired), always before the reply of the call
    that caused it. The TokenizerManager mirrors it (admission with ``--paused-admission
    reject``) instead of keeping a clock of its own."""

    paused: bool
    mode: str | None = None


@dataclass
class LoRAPauseStateOutput:
    """Sent by the scheduler, unsolicited, whenever the set of LoRA adapters paused (or
    draining) by name changes, before the reply of the call that changed it; the
    TokenizerManager mirrors it for ``--paused-admission reject`` (docs/lora.md)."""

    paused: list[str]


@dataclass
class ContinueGenerationReqInput:
    lora_name: str | None = None  # continue only this adapter (paused by name)
    req_id: str = field(default_factory=_new_id)


@dataclass
class ContinueGenerationReqOutput:
    success: bool
    was_paused: bool = False
    req_id: str = ""


# ---- weight updates (docs/weights.md) -------------------------------------------------------
@dataclass
class UpdateWeightFromDiskReqInput:
    """Load new weights of the same architecture from ``model_path`` into the running model.

    Validated first (path, config, every tensor's name and shape); a refusal changes nothing.
    ``load_format`` None: the server's. ``weight_version`` None keeps the current label.
    ``flush_cache``: flush the prefix cache when nothing holds KV (old-weight entries are made
    unmatchable in any case). ``abort_all_requests``: abort every request before the swap.
    """

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True
    req_id: str = field(default_factory=_new_id)


@dataclass
class UpdateWeightFromDiskReqOutput:
    success: bool
    message: str
    # Unfinished requests kept across the update (running, paused in place, or waiting); they
    # continue on the new weights.
    num_paused_requests: int = 0
    req_id: str = ""

    def __iter__(self) -> Iterator[Any]:
        """``success, message, num_paused = out``: upstream's TokenizerManager returns this."""
        return iter((self.success, self.message, self.num_paused_requests))


@dataclass
class UpdateWeightsFromTensorReqInput:
    """Copy ``named_tensors`` (HF checkpoint names, or parameter names with
    ``load_format="direct"``) into the running model; a subset of the weights is allowed.
    The tensors are pickled to the scheduler process. Validated first, like disk updates.

    Upstream's form: ``serialized_named_tensors``, one ``MultiprocessingSerializer`` payload
    (bytes or base64 string) per tensor-parallel rank; the TokenizerManager decodes it into
    ``named_tensors`` before anything is sent to the scheduler.
    """

    named_tensors: list[tuple[str, Any]] = field(default_factory=list)
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    req_id: str = field(default_factory=_new_id)
    serialized_named_tensors: list[str | bytes] | None = None


@dataclass
class UpdateWeightsFromTensorReqOutput:
    success: bool
    message: str
    num_paused_requests: int = 0
    req_id: str = ""

    def __iter__(self) -> Iterator[Any]:
        """``success, message = out``: upstream's TokenizerManager returns this pair."""
        return iter((self.success, self.message))


@dataclass
class InitWeightsUpdateGroupReqInput:
    """Join the trainer's weight-broadcast group (upstream's request): a torch.distributed
    group of ``world_size`` ranks rendezvousing at ``master_address:master_port``, in which
    this engine is rank ``rank_offset`` (the trainer is rank 0 and broadcasts)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"
    req_id: str = field(default_factory=_new_id)


@dataclass
class WeightsUpdateGroupReqOutput:
    """The scheduler ranks' answer to joining or leaving a weight-broadcast group (with
    ``--tp-size > 1``, where every TP rank is a member of the group)."""

    success: bool
    message: str
    req_id: str = ""

    def __iter__(self) -> Iterator[Any]:
        """``success, message = out``, like upstream's pair."""
        return iter((self.success, self.message))


@dataclass
class DestroyWeightsUpdateGroupReqInput:
    """Leave the weight-broadcast group ``group_name`` (upstream's request)."""

    group_name: str = "weight_update_group"
    req_id: str = field(default_factory=_new_id)


@dataclass
class UpdateWeightsFromDistributedReqInput:
    """Receive tensors broadcast by rank 0 of the group ``group_name`` and load them (upstream's
    request). One tensor with ``name``/``dtype``/``shape``, or several with ``names``/
    ``dtypes``/``shapes``, broadcast in that order; dtypes by torch name ("bfloat16")."""

    name: str | None = None
    dtype: str | None = None
    shape: list[int] | None = None
    names: list[str] | None = None
    dtypes: list[str] | None = None
    shapes: list[list[int]] | None = None
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    req_id: str = field(default_factory=_new_id)


@dataclass
class GetWeightsByNameReqInput:
    """Read a weight back: a parameter name, or an HF name (a fused parameter's shard)."""

    name: str
    truncate_size: int = 100
    req_id: str = field(default_factory=_new_id)


@dataclass
class GetWeightsByNameReqOutput:
    parameter: list | None  # float values, first dimension truncated; None when not found
    message: str = ""
    req_id: str = ""


@dataclass
class UpdateWeightVersionReqInput:
    """Relabel the current weights (no weight change); aborts nothing unless asked."""

    new_version: str
    abort_all_requests: bool = False
    req_id: str = field(default_factory=_new_id)


@dataclass
class UpdateWeightVersionReqOutput:
    success: bool
    message: str
    new_version: str = ""
    num_aborted: int = 0
    req_id: str = ""


# ---- memory occupation (docs/memory.md) ------------------------------------------------------
@dataclass
class ReleaseMemoryOccupationReqInput:
    """Free the memory of ``tags`` ("kv_cache", "weights", "cuda_graph"; None = all) until a
    resume; nothing runs meanwhile. Refused while a request holds KV."""

    tags: list[str] | None = None
    req_id: str = field(default_factory=_new_id)


@dataclass
class ReleaseMemoryOccupationReqOutput:
    success: bool
    message: str
    released_tags: list[str] = field(default_factory=list)  # released after this call
    req_id: str = ""


@dataclass
class ResumeMemoryOccupationReqInput:
    """Allocate the memory of ``tags`` (None = all) again."""

    tags: list[str] | None = None
    req_id: str = field(default_factory=_new_id)


@dataclass
class ResumeMemoryOccupationReqOutput:
    success: bool
    message: str
    released_tags: list[str] = field(default_factory=list)  # still released after this call
    req_id: str = ""


# ---- profiling (docs/native_api.md#profiling) ------------------------------------------------
@dataclass
class ProfileReq:
    """Start (``action="start"``) or stop the torch profiler of every scheduler rank (upstream's
    ``/start_profile`` / ``/stop_profile``). Each rank writes
    ``{output_dir}/{profile_prefix}{profile_id}-pid{pid}.trace.json.gz`` (Chrome trace format)
    when it stops: on ``stop``, or by itself after ``num_steps`` forward steps."""

    action: str  # "start" | "stop"
    output_dir: str | None = None
    start_step: int | None = None  # begin at this forward step (counted since start-up)
    num_steps: int | None = None
    activities: list[str] | None = None  # "CPU", "GPU"; None: CPU, and GPU on CUDA
    with_stack: bool = True
    record_shapes: bool = True
    profile_prefix: str | None = None
    profile_id: str = ""
    req_id: str = field(default_factory=_new_id)


@dataclass
class ProfileReqOutput:
    success: bool
    message: str
    req_id: str = ""


@dataclass
class SchedulerReply:
    """A control reply or pause-state message of the scheduler, sent through the detokenizer,
    which forwards ``payload`` unchanged: it then reaches the TokenizerManager after every
    output the scheduler sent before it (a pause that aborted or drained requests returns after
    their final outputs)."""

    payload: Any


@dataclass
class SchedulerErrorOutput:
    """The scheduler died; every pending caller gets this message as an error."""

    message: str


# ---- LoRA adapters (docs/lora.md) -----------------------------------------------------------
@dataclass
class LoadLoRAAdapterReqInput:
    """Load the PEFT adapter at ``lora_path`` under ``lora_name`` (upstream's fields). Over a
    loaded name it is a weight update of that adapter: refused while requests of the adapter
    hold KV, unless the adapter is paused (docs/lora.md). ``weight_version`` labels its
    weights (default: the count of loads of that name)."""

    lora_name: str
    lora_path: str
    pinned: bool = False  # upstream's; every adapter here stays loaded until unloaded
    lora_id: str | None = None
    weight_version: str | None = None
    req_id: str = field(default_factory=_new_id)


@dataclass
class LoadLoRAAdapterFromTensorsReqInput:
    """Load an adapter pushed in-process: PEFT-named ``tensors`` (``...q_proj.lora_A.weight``)
    and its ``config_dict`` (adapter_config.json's content). Same rules as
    :class:`LoadLoRAAdapterReqInput`."""

    lora_name: str
    tensors: dict[str, Any]
    config_dict: dict[str, Any]
    weight_version: str | None = None
    req_id: str = field(default_factory=_new_id)


@dataclass
class UnloadLoRAAdapterReqInput:
    lora_name: str
    lora_id: str | None = None
    req_id: str = field(default_factory=_new_id)


@dataclass
class LoRAUpdateOutput:
    """Reply of a load / unload (upstream's ``LoRAUpdateResult`` fields)."""

    success: bool
    error_message: str = ""
    loaded_adapters: dict[str, str] = field(default_factory=dict)  # name -> path
    req_id: str = ""
