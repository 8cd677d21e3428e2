"""Server arguments: the single source of truth for every knob of the engine.

The command line of ``python -m sglang.launch_server`` is generated from the fields of
:class:`ServerArgs`: each field becomes ``--field-name`` (or upstream's spelling, see
:meth:`ServerArgs.add_cli_args`) with the help text from its metadata.
``sglang.Engine(**kwargs)`` takes the same names as keyword arguments. Upstream SGLang's fields
that this build does not implement are inherited from
:class:`~sglang.srt.server_args_upstream.UpstreamOnlyArgs`, with the rules described there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import tempfile
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin

from sglang.srt import environ
from sglang.srt.managers.io_struct import DEFAULT_WEIGHT_VERSION, MAX_VERSION_LEN
from sglang.srt.server_args_upstream import (
    UPSTREAM_BACKENDS,
    UPSTREAM_CLI_FLAGS,
    UPSTREAM_ONLY_FIELDS,
    UpstreamOnlyArgs,
    upstream_default,
)

_DTYPES = ("auto", "float32", "bfloat16", "float16", "half", "float")
_ATTENTION_BACKENDS = ("torch_native", "triton", "flashinfer")
_SAMPLING_BACKENDS = ("pytorch", "triton")
_GRAMMAR_BACKENDS = ("xgrammar", "none")
_ENTROPY_MODES = ("raw", "scaled", "sampled")
_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_REASONING_PARSERS = ("qwen3", "deepseek-r1")
_TOOL_CALL_PARSERS = ("qwen25", "qwen", "llama3")
_LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "auto")
_DEFAULT_CUDA_GRAPH_MAX_BS = 256


def _arg(default: Any, help: str, **extra: Any) -> Any:
    """A dataclass field carrying its CLI help text (and optional choices / aliases)."""
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class ServerArgs(UpstreamOnlyArgs):
    """Every option of the server and of ``sglang.Engine``.

    ``__post_init__`` first applies the rules for upstream SGLang's fields (inherited,
    keyword-only; see :mod:`sglang.srt.server_args_upstream`: upstream defaults pass silently,
    not-applicable ones are logged once, result-changing ones are a ValueError naming them,
    unavailable upstream backends fall back), then resolves the automatic defaults (device,
    backends, seed) and rejects values we cannot honour with a ``ValueError`` that names the
    option. An unknown keyword is a TypeError (the dataclass ``__init__``). Fields whose default
    is None but whose type is not Optional (tokenizer_path, served_model_name, device,
    chunked_prefill_size, attention_backend, sampling_backend, random_seed) mean "resolve
    automatically": after construction they always hold a value, so readers need no None check.
    """

    # Model and tokenizer
    model_path: str = _arg(
        None,
        "Path of the model: an HF directory with config.json, or a .gguf file.",
        aliases=("--model",),
        required=True,
    )
    tokenizer_path: str = _arg(None, "Path of the tokenizer; defaults to --model-path.")
    skip_tokenizer_init: bool = _arg(
        False, "Do not load a tokenizer: requests must pass input_ids and get output_ids only."
    )
    load_format: str = _arg(
        "auto",
        "Weight format: auto (by file), safetensors, gguf, or dummy (random weights).",
        choices=("auto", "safetensors", "gguf", "dummy"),
    )
    weight_version: str = _arg(
        DEFAULT_WEIGHT_VERSION,
        "Label of the weights loaded at start-up: every output token carries it (meta_info "
        "weight_version) until an update or /update_weight_version relabels them.",
    )
    trust_remote_code: bool = _arg(
        False, "Allow custom code from the model directory when loading its config and tokenizer."
    )
    dtype: str = _arg(
        "auto",
        "Data type of weights and activations. auto: float32 on CPU, else the "
        "checkpoint's torch_dtype (float32 becomes bfloat16 on CUDA).",
        choices=_DTYPES,
    )
    context_length: int | None = _arg(
        None, "Maximum sequence length (prompt + output). Defaults to the model config's."
    )
    json_model_override_args: str = _arg(
        "{}",
        "A JSON object of config.json fields to replace before the model is built, e.g. "
        "'{\"num_hidden_layers\": 2}' or a rope_scaling; with fewer layers than the "
        "checkpoint, the tensors of the layers left out are skipped. Weight updates from disk "
        "read new checkpoints with the same replacements.",
    )
    enable_fp32_lm_head: bool = _arg(
        False,
        "Compute the LM head (the logits) in float32 in a bfloat16 or float16 model: the last "
        "hidden states and the head's weights are widened to float32, so logits, logprobs and "
        "entropies are not rounded to the model dtype. On CPU a float32 copy of the head's "
        "weights is kept (its size is logged); elsewhere they are widened at each step.",
    )
    served_model_name: str = _arg(
        None, "Model name reported by /v1/models and in responses; defaults to --model-path."
    )
    chat_template: str | None = _arg(
        None, "A Jinja chat template file to use instead of the tokenizer's own."
    )
    device: str = _arg(None, "cpu or cuda; defaults to cuda when available, else cpu.")

    # HTTP server
    host: str = _arg("127.0.0.1", "Host to bind the HTTP server to.")
    port: int = _arg(30000, "Port of the HTTP server.")
    api_key: str | None = _arg(
        None, "If set, every endpoint except /health requires 'Authorization: Bearer <key>'."
    )
    skip_server_warmup: bool = _arg(
        False, "Do not send a warm-up generation before reporting the server ready."
    )

    # Memory and scheduling
    mem_fraction_static: float | None = _arg(
        None,
        "Fraction of device memory for weights + KV cache (CUDA: 0.85 by default). On CPU "
        "the KV pool takes this fraction of the free RAM (0.2 by default); decode keeps a "
        "dense copy of the running requests' KV beside it, at most as large as the pool.",
    )
    max_total_tokens: int | None = _arg(
        None, "Size of the KV pool in tokens; overrides --mem-fraction-static."
    )
    max_running_requests: int | None = _arg(
        None, "Maximum number of requests decoded together (default: derived from the pool)."
    )
    max_queued_requests: int | None = _arg(
        None,
        "Most requests waiting to start (per data-parallel replica); a request that arrives "
        "when that many wait is refused with 503 ('The request queue is full'). Requests "
        "moved back by a retract are never refused. Default: no limit.",
    )
    max_prefill_tokens: int = _arg(
        16384, "Maximum number of prompt tokens prefilled in one forward pass."
    )
    prefill_max_requests: int | None = _arg(
        None,
        "Most requests in one prefill forward pass (the continuing chunked prompt counted); "
        "None: no limit but --max-prefill-tokens and --max-running-requests.",
    )
    chunked_prefill_size: int = _arg(
        None,
        "Split prompts longer than this into chunks prefilled step by step "
        "(default 8192; -1 disables chunking).",
    )
    page_size: int = _arg(1, "Number of tokens per KV page (allocation and prefix-cache unit).")
    schedule_policy: str = _arg(
        "fcfs",
        "Order of the waiting queue: fcfs (arrival) or lpm (longest cached prefix first).",
        choices=("fcfs", "lpm"),
    )
    schedule_conservativeness: float = _arg(
        1.0, "How conservatively new requests are admitted (larger reserves more KV for decode)."
    )
    disable_radix_cache: bool = _arg(False, "Disable the radix prefix cache.")
    paused_admission: str = _arg(
        "queue",
        "What a generate request gets while generation is paused: queue (it waits in the "
        "waiting queue and runs after continue) or reject (HTTP 503 with Retry-After).",
        choices=("queue", "reject"),
    )
    stream_interval: int = _arg(
        1, "Send streamed output every this many tokens (larger is cheaper for long outputs)."
    )

    # Backends
    attention_backend: str = _arg(
        None,
        "Attention kernel: torch_native (SDPA over gathered KV; the default on CPU) or triton "
        "(per-query paged Triton kernel, batch-invariant; the default on CUDA; on CPU only "
        "with TRITON_INTERPRET=1). flashinfer is not built yet. Upstream's other backends (fa3, "
        "flashmla, ...) fall back to the default, with a warning.",
        choices=_ATTENTION_BACKENDS,
    )
    sampling_backend: str = _arg(
        None,
        "Sampler: pytorch (torch reference, default on CPU) or triton (fused kernel, default on "
        "CUDA; on CPU only with TRITON_INTERPRET=1). Upstream's flashinfer falls back to the "
        "default, with a warning.",
        choices=_SAMPLING_BACKENDS,
    )
    grammar_backend: str = _arg(
        None,
        "Constrained decoding (json_schema, regex, ebnf, structural_tag; docs/"
        "constrained_decoding.md): xgrammar (the default) or none (such requests are refused). "
        "Upstream's outlines and llguidance fall back to xgrammar, with a warning.",
        choices=_GRAMMAR_BACKENDS,
    )
    constrained_json_disable_any_whitespace: bool = _arg(
        False,
        "Outputs of a JSON schema take one fixed layout, {\"a\": 1, \"b\": [2, 3]} (a "
        "space after each colon and comma, no other whitespace), instead of any whitespace "
        "where JSON allows it.",
    )
    enable_deterministic_inference: bool = _arg(
        False, "Batch-invariant kernels: the same tokens whatever the batch, chunking or cache."
    )
    disable_cpu_weight_prepack: bool = _arg(
        False,
        "On CPU, multiply by the weights as given instead of by copies packed once (the "
        "column blocks of the brgemm kernel, or oneDNN's blocked layout where that kernel does "
        "not take the weight), and without the C++ kernel that runs products of one to four "
        "rows (batch-1 decode; up to 16 on AVX2 hosts) at the memory's rate. The packed "
        "copies run the linear layers "
        "1.3-2x faster and take as much memory again as the weights; the log states how much "
        "(see docs/performance.md).",
    )
    disable_cpu_attention_kernel: bool = _arg(
        False,
        "On CPU, run decode and prefill attention with torch SDPA instead of the C++ decode- "
        "and prefill-attention kernels (compiled at model load and cached in torch's "
        "extensions directory; per layer 1.7-5.3x faster than SDPA for decode and "
        "1.3-3.6x for prefill, see docs/performance.md). The decode kernel is built on "
        "x86 hosts with AVX2 or AVX-512; where a kernel is not built, SDPA is used anyway.",
    )
    disable_cpu_fused_ops: bool = _arg(
        False,
        "On CPU, run each decoder layer's elementwise pieces (add + RMSNorm, SiLU-and-mul, "
        "RoPE, the K/V store into the pool) as torch ops instead of one C++ call each, and "
        "the pytorch sampler's passes over the vocabulary (the seeded Gumbel-max, the softmax "
        "statistics behind logprobs, top-p and entropy, the top-p candidates) as torch ops "
        "instead of one C++ pass per row each (compiled at model load and cached in torch's "
        "extensions directory; they round where the torch ops round, the sampler's tokens are "
        "the same bit for bit, logprobs and entropies within float32 rounding; see "
        "docs/performance.md and docs/sampling.md).",
    )
    disable_cpu_decode_loop: bool = _arg(
        False,
        "On CPU, run decode steps through the model's modules instead of one flat loop over "
        "the C++ kernels (the same kernels on the same operands, so the same bits, with the "
        "per-layer module calls and operand checks left out: 1.05-1.3x faster decode steps "
        "on SmolLM2-135M). The loop serves the dense Llama-family models (Llama, Mistral, "
        "Qwen2, Qwen3; not the MoE ones) with the C++ decode-attention kernel and fused "
        "elementwise kernels, one tensor-parallel rank, no LoRA and no --enable-torch-compile; "
        "other runs take the module path anyway (see docs/performance.md).",
    )
    disable_cuda_fused_ops: bool = _arg(
        False,
        "CUDA: run the torch ops instead of the fused Triton kernels for the add + RMSNorm, RoPE "
        "with the K/V store, and SiLU-and-mul of each layer (about 20 fewer kernels per layer; "
        "docs/cuda_graph.md). Deterministic mode keeps the torch ops and its batch-invariant "
        "norm. No effect on CPU.",
    )
    disable_cpu_malloc_tuning: bool = _arg(
        False,
        "On CPU, keep glibc's default allocation policy: large blocks (over its mmap "
        "threshold, at most 32 MiB) mapped fresh and handed back on free. By default the model "
        "process serves every block from its heap and keeps freed memory for reuse (no page "
        "faults on each prefill chunk's large temporaries; resident memory stays at its peak, "
        "up to 1/16 of the machine's memory (at least 1 GiB), and is given back when the KV "
        "cache or weights are released). It also skips the start-up memory warm-up "
        "(torch_native attention, outside deterministic mode), which otherwise touches the "
        "heap a full prefill chunk needs (a throwaway prefill through three decoder layers) and "
        "the KV pool's first 4 x --chunked-prefill-size slots, so that the first requests do "
        "not pay for first page faults (see docs/performance.md).",
    )
    cpu_bf16_linear: str = _arg(
        "auto",
        "How a bfloat16 model's linear layers compute on CPU: bf16 (native bfloat16 "
        "products: the brgemm kernel, or oneDNN's), fp32 (float32 copies of the weights, "
        "packed once, results rounded back to bfloat16; the copies take twice the bfloat16 "
        "weights' memory, stated in the log) or "
        "auto: fp32 on a CPU without native bfloat16 (no AVX512-BF16 or AMX), where it is "
        "faster, else bf16. Needs the weight prepack (see --disable-cpu-weight-prepack).",
        choices=("auto", "bf16", "fp32"),
    )
    enable_torch_compile: bool = _arg(
        False,
        "Compile the decoder layers with torch.compile (inductor; CPU only): the norms, "
        "residual adds, RoPE and activation between the linear products become a few fused "
        "kernels. Compiling takes seconds to tens of seconds at start-up (logged); measured, "
        "it speeds up prefill (up to ~1.1x in bfloat16) but not decode "
        "(docs/performance.md). Ignored, with a warning, in deterministic mode, with tensor "
        "parallelism or LoRA.",
    )
    torch_compile_max_bs: int = _arg(
        32,
        "With --enable-torch-compile: decode batches of at most this many requests run the "
        "compiled layers (prefill always does), larger ones run eagerly.",
    )
    disable_cuda_graph: bool = _arg(
        False,
        "CUDA: run decode steps and short prefills eagerly instead of replaying the CUDA graphs "
        "captured at start-up (one graph per batch size of --cuda-graph-bs; a batch is padded "
        "up to the nearest; larger ones and LoRA batches run eagerly). No effect on CPU.",
    )
    cuda_graph_max_bs: int | None = _arg(
        None,
        "CUDA: largest decode batch run through a CUDA graph. Default: 256, or "
        "--max-running-requests when smaller.",
    )
    cuda_graph_bs: list[int] | None = _arg(
        None,
        "CUDA: the decode batch sizes to capture, e.g. 1 2 4 8 16 (none above "
        "--cuda-graph-max-bs is captured). Default: 1, 2, 4, 8, every multiple of 8 up to "
        "--cuda-graph-max-bs, and that size itself.",
    )
    disable_cuda_graph_padding: bool = _arg(
        False,
        "CUDA: replay a graph only for a batch of exactly a captured size (no padding rows); "
        "other sizes run eagerly.",
    )
    disable_cuda_graph_prefill: bool = _arg(
        False,
        "CUDA: run every prefill eagerly. By default a prefill of at most --cuda-graph-max-bs "
        "new tokens (without prompt logprobs or LoRA) replays the decode graphs, one row per "
        "token.",
    )
    disable_overlap_schedule: bool = _arg(
        False,
        "CUDA: commit each decode step before launching the next. By default a steady decode "
        "step is launched while the previous one still runs on the GPU, and its results are "
        "committed after (docs/overlap.md); the tokens are the same either way. No effect on "
        "CPU, with tensor parallelism or with --enable-lora (their steps never overlap).",
    )
    random_seed: int = _arg(
        None, "Seed of the engine; requests without sampling_seed derive theirs from it."
    )
    tp_size: int = _arg(
        1,
        "Tensor-parallel size: this many scheduler processes (one per rank, one device each) "
        "serve each replica together over torch.distributed (gloo on CPU, NCCL on CUDA); "
        "rank 0 receives the requests and the ranks run every step in lockstep "
        "(docs/distributed.md).",
    )
    dp_size: int = _arg(
        1,
        "Data-parallel size: this many scheduler processes, each a full model replica with "
        "its own KV cache (on CPU each gets 1/N of the torch threads), behind one frontend "
        "(docs/distributed.md).",
    )
    nnodes: int = _arg(
        1,
        "Number of machines the tensor-parallel ranks span; each runs tp_size / nnodes of "
        "them. Start the same command on every node with its own --node-rank.",
    )
    node_rank: int = _arg(
        0,
        "This node's index among --nnodes: node 0 serves HTTP and runs TP rank 0; the others "
        "run only their scheduler ranks (the command blocks until they exit).",
    )
    dist_init_addr: str | None = _arg(
        None,
        "HOST:PORT of the tensor-parallel rendezvous (TP rank 0 listens there; node 0's "
        "address). Required with --nnodes > 1; on one node a free local port is used.",
    )
    dist_timeout: int | None = _arg(
        None,
        "Seconds a tensor-parallel rank waits for its peers (rendezvous and every collective) "
        "before failing; a peer that dies is noticed at once, this bounds the rest. "
        "Default: 600.",
    )
    load_balance_method: str = _arg(
        "round_robin",
        "How --dp-size > 1 spreads new requests over the ranks: round_robin, or "
        "shortest_queue (the rank with the fewest unfinished requests). 'auto' (upstream's "
        "default) means round_robin.",
        choices=_LOAD_BALANCE_METHODS,
    )
    custom_weight_loader: list[str] | None = _arg(
        None,
        "Import paths ('pkg.module.func') of functions that update_weights_from_tensor may "
        "name as its load_format; each is called as func(model, named_tensors) "
        "(docs/weights.md).",
    )

    # OpenAI chat parsing (docs/openai_api.md)
    sampling_defaults: str = _arg(
        "model",
        "Defaults of the chat completions API's temperature, top_p, top_k, min_p and "
        "repetition_penalty when a request leaves them out: 'model' reads them from the "
        "model's generation_config.json (OpenAI's defaults where it has none), 'openai' always "
        "uses OpenAI's. /generate and /v1/completions always use OpenAI's.",
        choices=("model", "openai"),
    )
    reasoning_parser: str | None = _arg(
        None,
        "Split the model's reasoning from its answer in chat completions: the text between "
        "the reasoning markers goes to message.reasoning_content (streamed as "
        "delta.reasoning_content). qwen3, deepseek-r1.",
        choices=_REASONING_PARSERS,
    )
    tool_call_parser: str | None = _arg(
        None,
        "Parse tool calls out of chat completions into message.tool_calls (streamed too): "
        "qwen25 (Qwen2.5/Qwen3 <tool_call> JSON) or llama3 (Llama-3 JSON calls).",
        choices=_TOOL_CALL_PARSERS,
    )
    stream_response_default_include_usage: bool = _arg(
        False,
        "Streamed OpenAI completions and chat completions always end with the usage chunk, as "
        "with stream_options.include_usage, whether or not a request asks for it.",
    )
    enable_cache_report: bool = _arg(
        False,
        "Report the prompt tokens served from the prefix cache in the OpenAI endpoints' usage: "
        "usage.prompt_tokens_details.cached_tokens (counted once per prompt, as prompt_tokens; "
        "left out when none was cached). /generate reports meta_info cached_tokens either way.",
    )

    # Logging and metrics
    log_level: str = _arg("info", "Logging level.", choices=_LOG_LEVELS)
    log_requests: bool = _arg(False, "Log every request and its output.")
    enable_metrics: bool = _arg(False, "Expose Prometheus metrics at /metrics.")
    gc_threshold: list[int] | None = _arg(
        None,
        "Python's garbage-collection thresholds (gc.set_threshold: 1 to 3 values, generation "
        "0 first) in the server's own processes: the schedulers, the detokenizer and, with "
        "launch_server, the HTTP server; an Engine's caller process is left alone. Larger "
        "values collect less often. Default: Python's.",
    )

    # Request limits and HTTP security defaults (docs/security.md)
    max_request_batch_size: int = _arg(
        8192, "Most generations one request may ask for: prompts in the batch times n."
    )
    max_prompt_bytes: int = _arg(
        8 * 1024 * 1024, "Largest text prompt in UTF-8 bytes, refused before tokenizing."
    )
    max_top_logprobs_num: int = _arg(128, "Largest top_logprobs_num a request may ask for.")
    max_stop_strings: int = _arg(64, "Most stop strings per request.")
    max_stop_str_len: int = _arg(512, "Longest stop string, in characters.")
    allow_auto_truncate: bool = _arg(
        False,
        "Cut a prompt that does not fit the context to its first tokens (the longest prompt "
        "the server takes) and lower a max_new_tokens that does not fit to what the context "
        "leaves, with a logged warning, instead of refusing the request (400).",
    )
    allowed_hosts: str | None = _arg(
        None,
        "Comma-separated Host header names the HTTP server answers (against DNS rebinding); "
        "'*.example.com' matches subdomains, '*' disables the check. Default: the --host "
        "address, localhost, and any IP address (with --host 0.0.0.0 or :: also this "
        "machine's host names).",
    )
    allow_get_control_routes: bool = _arg(
        False,
        "Answer any GET on /flush_cache, /release_memory_occupation, "
        "/resume_memory_occupation, /start_profile and /stop_profile, as upstream SGLang does. "
        "Off by default (any web page can make a browser send a GET), when only a GET with "
        "Content-Type: application/json is answered (slime's and miles' flush_cache poll). A "
        "GET that a browser marks cross-site is refused (403) either way.",
    )

    # Per-token entropy (docs/entropy.md)
    entropy_mode: str = _arg(
        "raw",
        "Entropy returned with return_entropy when the request does not choose: raw "
        "(softmax of the logits), scaled (after temperature) or sampled (after temperature "
        "and top-k/top-p/min-p, renormalised).",
        choices=_ENTROPY_MODES,
    )
    entropy_top_k: int = _arg(
        0, "Entropy over the K largest logits only (renormalised); 0 = the full vocabulary."
    )
    enable_entropy_with_logprobs: bool = _arg(
        False, "Also return output_token_entropy for every request that returns logprobs."
    )
    enable_return_routed_experts: bool = _arg(
        False,
        "Mixture-of-experts models: record which experts every layer routed each token to, so "
        "that requests with return_routed_experts get them in meta_info routed_experts "
        "(rollout routing replay; docs/models.md). Costs a host copy per step; refused for a "
        "model without MoE layers.",
    )

    # Multi-LoRA serving (docs/lora.md)
    enable_lora: bool = _arg(
        False,
        "Serve LoRA adapters: requests name one with lora_path (an adapter name); requests of "
        "different adapters and the base model share batches; works with --tp-size (each rank "
        "holds its slice of every adapter) and --dp-size (every replica loads every adapter).",
    )
    lora_paths: list[str] | None = _arg(
        None,
        "Adapters loaded at start, each 'name=path', 'path' (named by itself) or upstream's "
        "JSON '{\"lora_name\": ..., \"lora_path\": ...}'; Engine also takes a dict "
        "{name: path}. Implies --enable-lora.",
    )
    max_loras_per_batch: int = _arg(
        8, "Adapter slots: the most distinct adapters in one batch (the base model is free)."
    )
    max_lora_rank: int | None = _arg(
        None,
        "Largest adapter rank the slots hold. Default: the largest rank of --lora-paths, "
        "else 64.",
    )
    lora_target_modules: list[str] | None = _arg(
        None,
        "Projections adapters may adapt: q_proj k_proj v_proj o_proj gate_proj up_proj "
        "down_proj, or 'all'. Default: all.",
    )
    max_loaded_loras: int | None = _arg(
        None, "Most adapters loaded (in host memory) at once; None = no limit."
    )

    def __post_init__(self) -> None:
        self._apply_upstream_rules()
        if not self.model_path:
            raise ValueError("model_path is required")
        self.model_path = os.path.expanduser(self.model_path)
        if self.tokenizer_path is None:
            self.tokenizer_path = self.model_path
        if self.served_model_name is None:
            self.served_model_name = self.model_path
        if self.device is None:
            self.device = _default_device()
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.random_seed is None:
            self.random_seed = random.randint(0, 2**30)
        if self.attention_backend is None:
            # On CUDA the paged Triton kernel reads the KV pool in place (measured ~5x the
            # throughput of gathering it for SDPA on an H100) and is batch-invariant as well.
            self.attention_backend = "triton" if self.device == "cuda" else "torch_native"
        if self.sampling_backend is None:
            self.sampling_backend = "triton" if self.device == "cuda" else "pytorch"
        if self.grammar_backend is None:
            self.grammar_backend = "xgrammar"
        if self.chunked_prefill_size is None:
            self.chunked_prefill_size = 8192
        if self.custom_weight_loader is None:
            self.custom_weight_loader = []
        self._resolve_lora()
        self._check()

    def _check(self) -> None:
        """Reject values that we accept on the command line but cannot honour."""
        self._check_flags_and_choices()
        if (
            not isinstance(self.weight_version, str)
            or not self.weight_version
            or len(self.weight_version) > MAX_VERSION_LEN
            or not self.weight_version.isprintable()
        ):
            raise ValueError(
                f"--weight-version must be a non-empty printable label of at most "
                f"{MAX_VERSION_LEN} characters"
            )
        if not isinstance(self.torch_compile_max_bs, int) or self.torch_compile_max_bs < 0:
            raise ValueError(
                f"--torch-compile-max-bs must be >= 0, got {self.torch_compile_max_bs!r}"
            )
        self._check_cuda_graph_sizes()
        if not isinstance(self.dp_size, int) or self.dp_size < 1:
            raise ValueError(f"--dp-size must be >= 1, got {self.dp_size!r}")
        self._check_parallelism()
        if self.load_balance_method not in _LOAD_BALANCE_METHODS:
            raise ValueError(
                f"--load-balance-method must be one of {_LOAD_BALANCE_METHODS}, "
                f"got {self.load_balance_method!r}"
            )
        if self.attention_backend not in ("torch_native", "triton"):
            raise ValueError(
                f"--attention-backend {self.attention_backend} is not available; "
                "supported: torch_native, triton"
            )
        if self.sampling_backend not in _SAMPLING_BACKENDS:
            raise ValueError(
                f"--sampling-backend must be one of {_SAMPLING_BACKENDS}, "
                f"got {self.sampling_backend!r}"
            )
        if self.grammar_backend not in _GRAMMAR_BACKENDS:
            raise ValueError(
                f"--grammar-backend must be one of {_GRAMMAR_BACKENDS}, "
                f"got {self.grammar_backend!r}"
            )
        triton_on_cpu = self.device == "cpu" and not environ.triton_interpret_enabled()
        for flag, value, other in (
            ("--attention-backend", self.attention_backend, "torch_native"),
            ("--sampling-backend", self.sampling_backend, "pytorch"),
        ):
            if value == "triton" and triton_on_cpu:
                raise ValueError(
                    f"{flag} triton needs CUDA (on CPU only with TRITON_INTERPRET=1); "
                    f"use {flag} {other}"
                )
        if self.entropy_mode not in _ENTROPY_MODES:
            raise ValueError(
                f"--entropy-mode must be one of {_ENTROPY_MODES}, got {self.entropy_mode!r}"
            )
        if self.entropy_top_k < 0:
            raise ValueError(f"--entropy-top-k must be >= 0, got {self.entropy_top_k}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"--dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {self.page_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < 16:
            raise ValueError(f"--max-total-tokens must be >= 16, got {self.max_total_tokens}")
        queued = self.max_queued_requests
        if queued is not None and (type(queued) is not int or queued < 1):
            raise ValueError(f"--max-queued-requests must be an integer >= 1, got {queued!r}")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError("--max-running-requests must be >= 1")
        if self.max_prefill_tokens < 1:
            raise ValueError("--max-prefill-tokens must be >= 1")
        limit = self.prefill_max_requests
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool)
                                  or limit < 1):
            raise ValueError(f"--prefill-max-requests must be an integer >= 1, got {limit!r}")
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise ValueError("--chunked-prefill-size must be positive or -1 (disabled)")
        if self.chunked_prefill_size != -1 and self.chunked_prefill_size < self.page_size:
            raise ValueError("--chunked-prefill-size must be >= --page-size")
        if self.max_prefill_tokens < self.page_size:
            raise ValueError("--max-prefill-tokens must be >= --page-size")
        if self.stream_interval < 1:
            raise ValueError("--stream-interval must be >= 1")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError("--mem-fraction-static must be in (0, 1)")
        if self.context_length is not None and self.context_length < 1:
            raise ValueError("--context-length must be >= 1")
        self.model_override_args()  # raises for anything but a JSON object
        if self.gc_threshold is not None and not (
            1 <= len(self.gc_threshold) <= 3
            and all(type(v) is int and 0 <= v < 2**31 for v in self.gc_threshold)
        ):
            raise ValueError(
                "--gc-threshold takes 1 to 3 integers from 0 to 2**31 - 1 (gc.set_threshold's "
                f"C ints), got {self.gc_threshold}"
            )
        parsers: tuple[tuple[str, str | None, tuple[str, ...]], ...] = (
            ("--reasoning-parser", self.reasoning_parser, _REASONING_PARSERS),
            ("--tool-call-parser", self.tool_call_parser, _TOOL_CALL_PARSERS),
        )
        for flag, parser_name, choices in parsers:
            if parser_name is not None and parser_name not in choices:
                raise ValueError(f"{flag} must be one of {choices}, got {parser_name!r}")
        self._check_custom_weight_loader()
        for name in ("max_request_batch_size", "max_prompt_bytes", "max_top_logprobs_num",
                     "max_stop_strings", "max_stop_str_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")

    def model_override_args(self) -> dict[str, Any]:
        """``--json-model-override-args`` parsed: the config fields it replaces (None, as some
        callers pass for "no override", is none). Raises ValueError unless it is a JSON
        object."""
        if self.json_model_override_args is None:
            return {}
        try:
            overrides = json.loads(self.json_model_override_args)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"--json-model-override-args must be a JSON object, got "
                f"{self.json_model_override_args!r} ({error})"
            ) from None
        if not isinstance(overrides, dict):
            raise ValueError(
                f"--json-model-override-args must be a JSON object, got "
                f"{self.json_model_override_args!r}"
            )
        return overrides

    def _check_parallelism(self) -> None:
        """TP size, the node layout and the rendezvous address (docs/distributed.md)."""
        for flag, value, low in (("--tp-size", self.tp_size, 1), ("--nnodes", self.nnodes, 1),
                                 ("--node-rank", self.node_rank, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{flag} must be an integer >= {low}, got {value!r}")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} must be < --nnodes {self.nnodes}")
        if self.tp_size % self.nnodes:
            raise ValueError(
                f"--tp-size {self.tp_size} must be a multiple of --nnodes {self.nnodes} "
                "(each node runs the same number of TP ranks)"
            )
        if self.nnodes > 1 and self.dp_size > 1:
            raise ValueError(
                "--dp-size > 1 with --nnodes > 1 is not supported: run one multi-node "
                "engine per data-parallel replica (docs/distributed.md)"
            )
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address)")
        if self.dist_init_addr is not None:
            host, _, port = str(self.dist_init_addr).rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(
                    f"--dist-init-addr must be HOST:PORT, got {self.dist_init_addr!r}"
                )
        if self.dist_timeout is not None and not (
            isinstance(self.dist_timeout, (int, float)) and self.dist_timeout > 0
        ):
            raise ValueError(f"--dist-timeout must be > 0 seconds, got {self.dist_timeout!r}")

    def _resolve_lora(self) -> None:
        """Normalise --lora-paths to ['name=path', ...] and check the LoRA block."""
        self.lora_paths = _lora_path_entries(self.lora_paths)
        if self.lora_paths:
            self.enable_lora = True
        if isinstance(self.lora_target_modules, str):
            self.lora_target_modules = [self.lora_target_modules]
        if not self.enable_lora:
            return
        for name in ("max_loras_per_batch", "max_lora_rank", "max_loaded_loras"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value!r}")
        if self.max_loaded_loras is not None and self.lora_paths and (
            len(self.lora_paths) > self.max_loaded_loras
        ):
            raise ValueError("--lora-paths names more adapters than --max-loaded-loras")
        from sglang.srt.lora.adapter import normalize_target_modules  # imports torch

        normalize_target_modules(self.lora_target_modules)  # ValueError when unknown

    def lora_path_dict(self) -> dict[str, str]:
        """--lora-paths as {name: path}."""
        return dict(e.split("=", 1) for e in self.lora_paths or [])

    def _check_flags_and_choices(self) -> None:
        """Every on/off field is a bool and every field with choices holds one of them (or
        None): the command line guarantees both, keyword arguments (Engine) do not."""
        hints = typing.get_type_hints(ServerArgs)
        for f in own_fields():
            value = getattr(self, f.name)
            flag = "--" + f.name.replace("_", "-")
            if hints[f.name] is bool and not isinstance(value, bool):
                raise ValueError(f"{flag} must be true or false, got {value!r}")
            choices = f.metadata.get("choices")
            if choices and value is not None and value not in choices:
                raise ValueError(f"{flag} must be one of {tuple(choices)}, got {value!r}")

    def _check_custom_weight_loader(self) -> None:
        loaders = self.custom_weight_loader
        if isinstance(loaders, str):  # one path, as SkyRL passes it
            loaders = [loaders]
        if not isinstance(loaders, (list, tuple)):
            raise ValueError(
                f"--custom-weight-loader must be a list of import paths, got {loaders!r}"
            )
        for path in loaders:
            parts = path.split(".") if isinstance(path, str) else []
            if len(parts) < 2 or not all(p.isidentifier() for p in parts):
                raise ValueError(
                    f"--custom-weight-loader: {path!r} is not an import path 'pkg.module.func'"
                )
        self.custom_weight_loader = list(loaders)

    def _check_cuda_graph_sizes(self) -> None:
        max_bs, sizes = self.cuda_graph_max_bs, self.cuda_graph_bs
        if max_bs is not None and (
            not isinstance(max_bs, int) or isinstance(max_bs, bool) or max_bs < 1
        ):
            raise ValueError(f"--cuda-graph-max-bs must be >= 1, got {max_bs!r}")
        if sizes is not None:
            if not isinstance(sizes, list) or not all(
                isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in sizes
            ):
                raise ValueError(f"--cuda-graph-bs must be a list of sizes >= 1, got {sizes!r}")
            self.cuda_graph_bs = sorted(set(sizes))

    def cuda_graph_batch_sizes(self, max_running_requests: int) -> list[int]:
        """The decode batch sizes to capture, ascending, none above ``cap`` = the smaller of
        --cuda-graph-max-bs (default 256) and ``max_running_requests``: --cuda-graph-bs, else
        1, 2, 4, 8, the multiples of 8 and ``cap`` itself."""
        cap = min(self.cuda_graph_max_bs or _DEFAULT_CUDA_GRAPH_MAX_BS, max_running_requests)
        if self.cuda_graph_bs:
            return [b for b in self.cuda_graph_bs if b <= cap] or [cap]
        return sorted(b for b in {1, 2, 4, *range(8, cap + 1, 8), cap} if b <= cap)

    # ---- CLI generated from the fields -------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Register one ``parser.add_argument`` call per field, as upstream's ``add_cli_args``
        does: the flags in upstream's spelling (:func:`cli_flags`; no explicit ``dest``, so
        argparse derives upstream's from the first flag, e.g. ``tensor_parallel_size``), this
        build's fields with their help, type, choices and default, upstream-only fields hidden
        from ``--help`` with upstream's default (present in the namespace). A wrapper that
        rewrites the flags of each call (slime's ``--sglang-`` prefix) gets the namespace it gets
        from upstream; :meth:`from_cli_args` maps the dests back to the fields.
        ``--attention-backend``, ``--sampling-backend`` and ``--grammar-backend`` also take
        upstream's backend names, which fall back to this build's default with a warning."""
        hints = typing.get_type_hints(ServerArgs)
        for f in dataclasses.fields(ServerArgs):
            kind = _scalar_type(hints[f.name])
            upstream = f.name in UPSTREAM_ONLY_FIELDS
            default = upstream_default(f)
            kwargs: dict[str, Any] = {
                "default": default,
                "help": argparse.SUPPRESS if upstream else f.metadata["help"],
            }
            if kind is bool:
                kwargs["action"] = "store_true"
            elif get_origin(kind) is list:
                kwargs.update(type=_cli_type(get_args(kind)[0]), nargs="*")
            else:
                kwargs["type"] = _cli_type(kind)
                choices = f.metadata.get("choices")
                if choices:
                    kwargs["choices"] = (*choices, *sorted(UPSTREAM_BACKENDS.get(f.name, ())))
                    kwargs["metavar"] = "{" + ",".join(choices) + "}"
                if f.metadata.get("required"):
                    kwargs["required"] = True
                elif default is not None and not upstream:
                    kwargs["help"] += f" (default: {default})"
            parser.add_argument(*cli_flags(f), **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        """ServerArgs from a namespace parsed with :meth:`add_cli_args`. Each field is read from
        its flag's dest (``tensor_parallel_size`` -> ``tp_size``, as upstream maps it), else from
        an attribute named as the field; a field with neither keeps its default, and other
        attributes are ignored. Raises what the constructor raises."""
        values = vars(args)
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            for name in (cli_dest(f), f.name):
                if name in values:
                    kwargs[f.name] = values[name]
                    break
        return cls(**kwargs)

    def resolved_load_balance_method(self) -> str:
        """The DP dispatch policy: upstream's 'auto' is round_robin."""
        method = self.load_balance_method
        return "round_robin" if method == "auto" else method

    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def prepare_server_args(argv: list[str]) -> ServerArgs:
    """ServerArgs from command-line flags, as upstream's ``prepare_server_args``: the flags of
    ``python -m sglang.launch_server``, upstream-only flags included (handled as described in
    docs/compatibility.md). Exits with status 2 and a message naming the flag on bad input."""
    from sglang.launch_server import parse_server_args

    return parse_server_args(argv)


def own_fields() -> tuple[dataclasses.Field, ...]:
    """This build's ServerArgs fields (the documented, visible flags), without the upstream-only
    ones it inherits."""
    return tuple(f for f in dataclasses.fields(ServerArgs) if f.name not in UPSTREAM_ONLY_FIELDS)


def cli_flags(f: dataclasses.Field) -> tuple[str, ...]:
    """A field's command-line flags, upstream's first: ``--tensor-parallel-size --tp-size`` for
    tp_size, ``--model-path --model``, else ``--field-name``."""
    if f.name in UPSTREAM_CLI_FLAGS:
        return UPSTREAM_CLI_FLAGS[f.name]
    return ("--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ()))


def cli_dest(f: dataclasses.Field) -> str:
    """The namespace attribute argparse stores a field's flag in (from its first flag)."""
    return cli_flags(f)[0][2:].replace("-", "_")


def _cli_type(kind: Any) -> type:
    """The argparse ``type`` for a value of ``kind``: int, float or str (str for anything else,
    e.g. upstream's JSON-valued options)."""
    return kind if kind in (int, float, str) else str


def _scalar_type(hint: Any) -> type:
    """``int | None`` -> int, ``bool`` -> bool, ``Literal[...]`` -> str."""
    if get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in get_args(hint) if a is not type(None))
    if get_origin(hint) is Literal:
        return type(get_args(hint)[0])
    return hint


def _lora_path_entries(value: Any) -> list[str] | None:
    """--lora-paths in any of upstream's forms -> ['name=path', ...] (names unique)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if isinstance(value, dict):
        value = [{"lora_name": k, "lora_path": v} for k, v in value.items()]
    entries: dict[str, str] = {}
    for item in value:
        if isinstance(item, str) and item.lstrip().startswith("{"):
            try:
                item = json.loads(item)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-paths entry {item!r} is not valid JSON: {e}") from e
        if isinstance(item, dict):
            name, path = item.get("lora_name"), item.get("lora_path")
        elif isinstance(item, str):
            name, _, path = item.partition("=") if "=" in item else (item, "", item)
        else:
            name = path = None
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            raise ValueError(f"--lora-paths entry {item!r} is not 'name=path' or 'path'")
        if name in entries:
            raise ValueError(f"--lora-paths names adapter {name!r} twice")
        entries[name] = path
    return [f"{k}={v}" for k, v in entries.items()]


# Device nodes of the GPU drivers torch.cuda can use: NVIDIA's, ROCm's (/dev/kfd) and WSL2's
# (/dev/dxg). Without any of them torch.cuda.is_available() is False.
_GPU_DRIVER_PATHS = (
    "/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg"
)


def _default_device() -> str:
    """"cuda" when torch sees a GPU, else "cpu". A host without a GPU driver answers without
    importing torch (~1 s): the launcher parses its flags, and so resolves the device, before it
    starts the engine's children, which then start while it imports torch."""
    if not any(os.path.exists(path) for path in _GPU_DRIVER_PATHS):
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class PortArgs:
    """ZMQ endpoints joining the processes (IPC sockets in a private temp dir)."""

    tokenizer_ipc_name: str  # detokenizer (and scheduler control replies) -> tokenizer manager
    scheduler_input_ipc_name: str  # tokenizer manager -> scheduler
    detokenizer_ipc_name: str  # scheduler -> detokenizer

    @staticmethod
    def init_new() -> PortArgs:
        base = tempfile.mkdtemp(prefix="sglang-")
        return PortArgs(
            tokenizer_ipc_name=f"ipc://{base}/tokenizer",
            scheduler_input_ipc_name=f"ipc://{base}/scheduler",
            detokenizer_ipc_name=f"ipc://{base}/detokenizer",
        )


def rank_label(dp_rank: int | None, tp_rank: int, tp_size: int) -> str:
    """How logs and errors name a scheduler rank: "DP rank 1", "TP rank 1", "DP rank 1 TP rank
    0", or "" for the only scheduler."""
    parts = ([] if dp_rank is None else [f"DP rank {dp_rank}"]) + (
        [f"TP rank {tp_rank}"] if tp_size > 1 else []
    )
    return " ".join(parts)
