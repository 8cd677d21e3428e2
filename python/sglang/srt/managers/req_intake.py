"""Turning a tokenized request into a scheduler ``Req``, and deciding whether it can ever run.

Pure functions: the Scheduler core queues the request or finishes it with the refusal.
"""

from __future__ import annotations

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.sampling.sampling_params import derive_seed

# The abort message of a request refused by --max-queued-requests (upstream's words).
QUEUE_FULL_MESSAGE = "The request queue is full."


def make_req(recv: TokenizedGenerateReqInput, model_config: ModelConfig, random_seed: int) -> Req:
    """The scheduler's view of ``recv``: its stop tokens (the model's EOS and the request's
    ``stop_token_ids``; none with ``ignore_eos``, which turns off every token-based stop, as
    upstream) and its sampling seed (its own, else one derived from ``--random-seed`` and the
    rid)."""
    sp = recv.sampling_params
    eos: set[int] = set()
    if not sp.ignore_eos:
        eos = set(sp.stop_token_ids or []) | model_config.eos_token_ids
    seed = sp.sampling_seed if sp.sampling_seed is not None else derive_seed(random_seed, recv.rid)
    return Req(
        rid=recv.rid,
        origin_input_ids=list(recv.input_ids),
        sampling_params=sp,
        sampling_seed=seed,
        eos_token_ids=eos,
        return_logprob=recv.return_logprob,
        logprob_start_len=recv.logprob_start_len,
        top_logprobs_num=recv.top_logprobs_num,
        stream=recv.stream,
        return_entropy=recv.return_entropy,
        entropy_mode=recv.entropy_mode,
        entropy_top_k=recv.entropy_top_k,
        lora_name=recv.lora_path,
        return_routed_experts=recv.return_routed_experts,
        routed_experts_start_len=recv.routed_experts_start_len,
    )


def refusal(req: Req, max_req_input_len: int, max_total_num_tokens: int) -> str | None:
    """Why ``req`` can never run on this pool (None: it can)."""
    if not req.origin_input_ids:
        return "The prompt is empty"
    if req.prompt_len > max_req_input_len:
        return (
            f"The prompt has {req.prompt_len} tokens; at most "
            f"{max_req_input_len} fit in the context or KV pool"
        )
    min_total = req.prompt_len + req.sampling_params.min_new_tokens
    if min_total > max_total_num_tokens:
        return (
            f"The prompt ({req.prompt_len} tokens) plus min_new_tokens "
            f"({req.sampling_params.min_new_tokens}) needs {min_total} KV tokens; the KV "
            f"pool holds {max_total_num_tokens}"
        )
    return None
