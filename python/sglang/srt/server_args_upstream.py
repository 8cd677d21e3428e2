"""Upstream SGLang's ServerArgs fields that this build does not implement, and the rules that
``ServerArgs(...)``, ``Engine(**kwargs)`` and the command line apply to them
(docs/compatibility.md, "Upstream server arguments"):

* a field set to upstream's default (or None) changes nothing and is accepted silently;
* a field in :data:`NOT_APPLICABLE` (hardware, CUDA-graph, multimodal, logging and
  deployment knobs that do not change what is generated) is accepted with ONE logged warning
  per construction naming every such field;
* any other upstream field set to another value would change results, so it is refused with a
  ValueError naming the field and value;
* a name that upstream does not have either is a TypeError naming it.

Upstream attention and sampling backends that this build does not name at all (``fa3``,
``flashmla``, sampling ``flashinfer``, ...) fall back to this build's default backend, with the
same warning; ``attention_backend="flashinfer"``, which this build names but has not built, is
refused by ServerArgs. ``lora_backend`` "triton" and "csgmv" (upstream's default) both name
Triton LoRA kernels, which is what this build runs on CUDA: accepted silently.

:class:`UpstreamOnlyArgs` declares the fields with upstream's defaults at the API level of
:data:`sglang.version.UPSTREAM_API_VERSION`. :class:`sglang.srt.server_args.ServerArgs` inherits
them as keyword-only dataclass fields, so ``dataclasses.fields``, ``asdict``, ``replace``,
pickling and the command line see them like its own fields, and reading one back gives the value
passed (or upstream's default). This module imports nothing from ``server_args`` at import time:
that module imports this one.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class UpstreamOnlyArgs:
    """Upstream's ServerArgs fields absent from this build, each with upstream's default.

    :meth:`_apply_upstream_rules` enforces the module's rules on them; ServerArgs calls it first
    thing in ``__post_init__``.
    """

    tokenizer_mode: str = "auto"
    tokenizer_worker_num: int = 1
    model_loader_extra_config: str = "{}"
    is_embedding: bool = False
    enable_multimodal: bool | None = None
    revision: str | None = None
    model_impl: str = "auto"
    fastapi_root_path: str = ""
    grpc_mode: bool = False
    warmups: str | None = None
    nccl_port: int | None = None
    checkpoint_engine_wait_weights_before_ready: bool = False
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_keyfile_password: str | None = None
    enable_ssl_refresh: bool = False
    quantization: str | None = None
    quantization_param_path: str | None = None
    kv_cache_dtype: str = "auto"
    modelopt_quant: Any = None
    modelopt_checkpoint_restore_path: str | None = None
    modelopt_checkpoint_save_path: str | None = None
    modelopt_export_path: str | None = None
    quantize_and_serve: bool = False
    rl_quant_profile: str | None = None
    enable_dynamic_chunking: bool = False
    enable_priority_scheduling: bool = False
    disable_priority_preemption: bool = False
    default_priority_value: int | None = None
    abort_on_priority_when_disabled: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10
    swa_full_tokens_ratio: float = 0.8
    disable_hybrid_swa_memory: bool = False
    radix_eviction_policy: str = "lru"
    enable_prefill_delayer: bool = False
    prefill_delayer_max_delay_passes: int = 30
    prefill_delayer_token_usage_low_watermark: float | None = None
    prefill_delayer_forward_passes_buckets: list[float] | None = None
    prefill_delayer_wait_seconds_buckets: list[float] | None = None
    pp_size: int = 1
    pp_max_micro_batch_size: int | None = None
    pp_async_batch_depth: int = 0
    incremental_streaming_output: bool = False
    enable_streaming_session: bool = False
    constrained_json_whitespace_pattern: str | None = None
    watchdog_timeout: float = 300
    soft_watchdog_timeout: float | None = None
    download_dir: str | None = None
    model_checksum: str | None = None
    base_gpu_id: int = 0
    gpu_id_step: int = 1
    sleep_on_idle: bool = False
    use_ray: bool = False
    custom_sigquit_handler: Any = None
    log_level_http: str | None = None
    log_requests_level: int = 2
    log_requests_format: str = "text"
    log_requests_target: list[str] | None = None
    uvicorn_access_log_exclude_prefixes: list[str] = field(default_factory=list)
    crash_dump_folder: str | None = None
    show_time_cost: bool = False
    enable_mfu_metrics: bool = False
    enable_metrics_for_all_schedulers: bool = False
    tokenizer_metrics_custom_labels_header: str = "x-custom-labels"
    tokenizer_metrics_allowed_custom_labels: list[str] | None = None
    extra_metric_labels: Any = None
    bucket_time_to_first_token: list[float] | None = None
    bucket_inter_token_latency: list[float] | None = None
    bucket_e2e_request_latency: list[float] | None = None
    collect_tokens_histogram: bool = False
    prompt_tokens_buckets: list[str] | None = None
    generation_tokens_buckets: list[str] | None = None
    gc_warning_threshold_secs: float = 0.0
    decode_log_interval: int = 40
    enable_request_time_stats_logging: bool = False
    kv_events_config: str | None = None
    enable_trace: bool = False
    otlp_traces_endpoint: str = "localhost:4317"
    export_metrics_to_file: bool = False
    export_metrics_to_file_dir: str | None = None
    admin_api_key: str | None = None
    hf_chat_template_name: str | None = None
    completion_template: str | None = None
    file_storage_path: str = "sglang_storage"
    tool_server: str | None = None
    attn_cp_size: int = 1
    moe_dp_size: int = 1
    preferred_sampling_params: str | None = None
    enable_lora_overlap_loading: bool | None = None
    lora_eviction_policy: str = "lru"
    lora_backend: str = "csgmv"
    max_lora_chunk_size: int = 16
    experts_shared_outer_loras: bool | None = None
    decode_attention_backend: str | None = None
    prefill_attention_backend: str | None = None
    mm_attention_backend: str | None = None
    fp8_gemm_runner_backend: str = "auto"
    fp4_gemm_runner_backend: str = "auto"
    nsa_prefill_backend: str | None = None
    nsa_decode_backend: str | None = None
    disable_flashinfer_autotune: bool = False
    mamba_backend: str = "triton"
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_draft_model_revision: str | None = None
    speculative_draft_load_format: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_accept_threshold_single: float = 1.0
    speculative_accept_threshold_acc: float = 1.0
    speculative_token_map: str | None = None
    speculative_attention_mode: str = "prefill"
    speculative_draft_attention_backend: str | None = None
    speculative_moe_runner_backend: str | None = None
    speculative_moe_a2a_backend: str | None = None
    speculative_draft_model_quantization: str | None = None
    speculative_ngram_min_bfs_breadth: int = 1
    speculative_ngram_max_bfs_breadth: int = 10
    speculative_ngram_match_type: str = "BFS"
    speculative_ngram_max_trie_depth: int = 18
    speculative_ngram_capacity: int = 10000000
    enable_multi_layer_eagle: bool = False
    ep_size: int = 1
    moe_a2a_backend: str = "none"
    moe_runner_backend: str = "auto"
    flashinfer_mxfp4_moe_precision: str = "default"
    enable_flashinfer_allreduce_fusion: bool = False
    enforce_disable_flashinfer_allreduce_fusion: bool = False
    enable_aiter_allreduce_fusion: bool = False
    deepep_mode: str = "auto"
    ep_num_redundant_experts: int = 0
    ep_dispatch_algorithm: str | None = None
    init_expert_location: str = "trivial"
    enable_eplb: bool = False
    eplb_algorithm: str = "auto"
    eplb_rebalance_num_iterations: int = 1000
    eplb_rebalance_layers_per_chunk: int | None = None
    eplb_min_rebalancing_utilization_threshold: float = 1.0
    expert_distribution_recorder_mode: str | None = None
    expert_distribution_recorder_buffer_size: int | None = None
    enable_expert_distribution_metrics: bool = False
    deepep_config: str | None = None
    moe_dense_tp_size: int | None = None
    elastic_ep_backend: str | None = None
    enable_elastic_expert_backup: bool = False
    mooncake_ib_device: str | None = None
    max_mamba_cache_size: int | None = None
    mamba_ssm_dtype: str | None = None
    mamba_full_memory_ratio: float = 0.9
    mamba_scheduler_strategy: str = "auto"
    mamba_track_interval: int = 256
    linear_attn_backend: str = "triton"
    linear_attn_decode_backend: str | None = None
    linear_attn_prefill_backend: str | None = None
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_size: int = 0
    hicache_write_policy: str = "write_through"
    hicache_io_backend: str = "kernel"
    hicache_mem_layout: str = "layer_first"
    hicache_storage_backend: str | None = None
    hicache_storage_prefetch_policy: str = "best_effort"
    hicache_storage_backend_extra_config: str | None = None
    enable_hisparse: bool = False
    hisparse_config: str | None = None
    enable_lmcache: bool = False
    kt_weight_path: str | None = None
    kt_method: str | None = None
    kt_cpuinfer: int | None = None
    kt_threadpool_count: int | None = None
    kt_num_gpu_experts: int | None = None
    kt_max_deferred_experts_per_token: int | None = None
    dllm_algorithm: str | None = None
    dllm_algorithm_config: str | None = None
    enable_double_sparsity: bool = False
    ds_channel_config_path: str | None = None
    ds_heavy_channel_num: int = 32
    ds_heavy_token_num: int = 256
    ds_heavy_channel_type: str = "qk"
    ds_sparse_decode_threshold: int = 4096
    cpu_offload_gb: int = 0
    offload_group_size: int = -1
    offload_num_in_group: int = 1
    offload_prefetch_step: int = 1
    offload_mode: str = "cpu"
    multi_item_scoring_delimiter: int | None = None
    enable_profile_cuda_graph: bool = False
    enable_cudagraph_gc: bool = False
    enable_layerwise_nvtx_marker: bool = False
    enable_nccl_nvls: bool = False
    enable_symm_mem: bool = False
    disable_flashinfer_cutlass_moe_fp4_allgather: bool = False
    enable_tokenizer_batch_encode: bool = False
    disable_tokenizer_batch_decode: bool = False
    disable_outlines_disk_cache: bool = False
    disable_custom_all_reduce: bool = False
    enable_mscclpp: bool = False
    enable_torch_symm_mem: bool = False
    pre_warm_nccl: bool = False
    enable_mixed_chunk: bool = False
    enable_dp_attention: bool = False
    enable_dp_lm_head: bool = False
    enable_two_batch_overlap: bool = False
    enable_single_batch_overlap: bool = False
    tbo_token_distribution_threshold: float = 0.48
    disable_piecewise_cuda_graph: bool = False
    enforce_piecewise_cuda_graph: bool = False
    enable_torch_compile_debug_mode: bool = False
    piecewise_cuda_graph_max_tokens: int | None = None
    piecewise_cuda_graph_tokens: list[int] | None = None
    piecewise_cuda_graph_compiler: str = "eager"
    torchao_config: str = ""
    enable_nan_detection: bool = False
    enable_p2p_check: bool = False
    triton_attention_reduce_in_fp32: bool = False
    triton_attention_num_kv_splits: int = 8
    triton_attention_split_tile_size: int | None = None
    num_continuous_decode_steps: int = 1
    delete_ckpt_after_loading: bool = False
    enable_memory_saver: bool = False
    enable_weights_cpu_backup: bool = False
    enable_draft_weights_cpu_backup: bool = False
    enable_custom_logit_processor: bool = False
    flashinfer_mla_disable_ragged: bool = False
    disable_shared_experts_fusion: bool = False
    disable_chunked_prefix_cache: bool = False
    disable_fast_image_processor: bool = False
    keep_mm_feature_on_device: bool = False
    enable_return_hidden_states: bool = False
    scheduler_recv_interval: int = 1
    numa_node: list[int] | None = None
    rl_on_policy_target: str | None = None
    enable_attn_tp_input_scattered: bool = False
    enable_nsa_prefill_context_parallel: bool = False
    nsa_prefill_cp_mode: str = "round-robin-split"
    enable_fused_qk_norm_rope: bool = False
    enable_precise_embedding_interpolation: bool = False
    enable_fused_moe_sum_all_reduce: bool = False
    enable_prefill_context_parallel: bool = False
    prefill_cp_mode: str = "in-seq-split"
    enable_dynamic_batch_tokenizer: bool = False
    dynamic_batch_tokenizer_batch_size: int = 32
    dynamic_batch_tokenizer_batch_timeout: float = 0.002
    debug_tensor_dump_output_folder: str | None = None
    debug_tensor_dump_layers: list[int] | None = None
    debug_tensor_dump_input_file: str | None = None
    debug_tensor_dump_inject: bool = False
    disaggregation_mode: str = "null"
    disaggregation_transfer_backend: str = "mooncake"
    disaggregation_bootstrap_port: int = 8998
    disaggregation_ib_device: str | None = None
    disaggregation_decode_enable_offload_kvcache: bool = False
    num_reserved_decode_tokens: int = 512
    disaggregation_decode_polling_interval: int = 1
    encoder_only: bool = False
    language_only: bool = False
    encoder_transfer_backend: str = "zmq_to_scheduler"
    encoder_urls: list[str] = field(default_factory=list)
    enable_adaptive_dispatch_to_encoder: bool = False
    weight_loader_disable_mmap: bool = False
    remote_instance_weight_loader_seed_instance_ip: str | None = None
    remote_instance_weight_loader_seed_instance_service_port: int | None = None
    remote_instance_weight_loader_send_weights_group_ports: list[int] | None = None
    remote_instance_weight_loader_backend: str = "nccl"
    remote_instance_weight_loader_start_seed_via_transfer_engine: bool = False
    engine_info_bootstrap_port: int = 6789
    modelexpress_config: str | None = None
    enable_pdmux: bool = False
    pdmux_config_path: str | None = None
    sm_group_num: int = 8
    enable_broadcast_mm_inputs_process: bool = False
    enable_prefix_mm_cache: bool = False
    mm_enable_dp_encoder: bool = False
    mm_process_config: Any = None
    limit_mm_data_per_request: Any = None
    enable_mm_global_cache: bool = False
    decrypted_config_file: str | None = None
    decrypted_draft_config_file: str | None = None
    forward_hooks: list[Any] | None = None

    def _apply_upstream_rules(self) -> None:
        """Enforce the module's rules. Raises ValueError naming every upstream-only field set to
        a value that would change results. Resets ``attention_backend`` / ``sampling_backend``
        holding an upstream name this build does not have to None (this build's default,
        resolved by ServerArgs afterwards). Logs one warning naming every not-applicable field
        set and every backend replaced; nothing when there is none."""
        changed = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(UpstreamOnlyArgs)
            if not _is_default(f, getattr(self, f.name))
        }
        refused = sorted(f"{k}={v!r}" for k, v in changed.items() if k not in NOT_APPLICABLE)
        if refused:
            raise ValueError(f"not supported by this build: {', '.join(refused)}")
        ignored = sorted(f"{k}={v!r}" for k, v in changed.items() if k in NOT_APPLICABLE)
        for name, names in UPSTREAM_BACKENDS.items():
            value = getattr(self, name)
            if isinstance(value, str) and value in names:
                setattr(self, name, None)
                ignored.append(f"{name}={value!r} (this build's default is used)")
        if ignored:
            logger.warning(
                "Ignoring upstream SGLang option(s) that do not apply to this build: %s",
                ", ".join(ignored),
            )


UPSTREAM_ONLY_FIELDS: frozenset[str] = frozenset(
    f.name for f in dataclasses.fields(UpstreamOnlyArgs)
)

# Upstream fields accepted (with a warning) at any value: none of them changes the tokens,
# logprobs or states that this build returns; they tune hardware paths this build does not
# have (piecewise CUDA graphs, torch.compile's debug mode, custom all-reduce, NCCL, multimodal
# encoders, CPU offload and CPU weight backups, draft-model weights, the LoRA kernels), logging,
# tracing and metrics, how often or in what batches the frontend's and the scheduler's loops
# take their input (tokenizer batching, the scheduler's receive interval), CPU placement, the
# collector during CUDA-graph capture, or multi-node placement that a single-node run does not
# use.
NOT_APPLICABLE: frozenset[str] = frozenset({
    "base_gpu_id", "gpu_id_step", "nccl_port",
    "enable_memory_saver", "enable_weights_cpu_backup", "enable_draft_weights_cpu_backup",
    "lora_backend",
    "mm_attention_backend", "enable_multimodal", "keep_mm_feature_on_device",
    "enable_broadcast_mm_inputs_process", "enable_prefix_mm_cache", "mm_enable_dp_encoder",
    "enable_mm_global_cache", "limit_mm_data_per_request", "mm_process_config",
    "enable_profile_cuda_graph", "disable_piecewise_cuda_graph", "enforce_piecewise_cuda_graph",
    "piecewise_cuda_graph_max_tokens", "piecewise_cuda_graph_tokens",
    "piecewise_cuda_graph_compiler",
    "disable_custom_all_reduce", "enable_nccl_nvls", "enable_symm_mem", "enable_torch_symm_mem",
    "pre_warm_nccl", "enable_p2p_check", "enable_mixed_chunk",
    "num_continuous_decode_steps", "triton_attention_reduce_in_fp32",
    "triton_attention_num_kv_splits", "disable_outlines_disk_cache", "fp8_gemm_runner_backend",
    "fp4_gemm_runner_backend", "cpu_offload_gb", "model_loader_extra_config", "download_dir",
    "tokenizer_worker_num", "sleep_on_idle", "watchdog_timeout", "soft_watchdog_timeout",
    "log_level_http", "log_requests_level", "log_requests_format", "log_requests_target",
    "uvicorn_access_log_exclude_prefixes", "crash_dump_folder", "show_time_cost",
    "decode_log_interval", "enable_mfu_metrics", "enable_metrics_for_all_schedulers",
    "tokenizer_metrics_custom_labels_header", "tokenizer_metrics_allowed_custom_labels",
    "extra_metric_labels", "bucket_time_to_first_token", "bucket_inter_token_latency",
    "bucket_e2e_request_latency", "collect_tokens_histogram", "prompt_tokens_buckets",
    "generation_tokens_buckets",
    "scheduler_recv_interval", "numa_node", "enable_cudagraph_gc", "weight_loader_disable_mmap",
    "enable_tokenizer_batch_encode", "disable_tokenizer_batch_decode",
    "enable_dynamic_batch_tokenizer", "dynamic_batch_tokenizer_batch_size",
    "dynamic_batch_tokenizer_batch_timeout", "gc_warning_threshold_secs",
    "enable_layerwise_nvtx_marker", "enable_request_time_stats_logging", "enable_trace",
    "otlp_traces_endpoint",
})

# Upstream's backend names for fields this build has with fewer choices: accepted (the command
# line takes them too) and replaced by this build's default.
UPSTREAM_BACKENDS: dict[str, frozenset[str]] = {
    "attention_backend": frozenset({
        "flex_attention", "nsa", "cutlass_mla", "fa3", "fa4", "flashmla",
        "trtllm_mla", "trtllm_mha", "dual_chunk_flash_attn", "aiter", "wave", "intel_amx",
        "ascend", "intel_xpu",
    }),
    "sampling_backend": frozenset({"flashinfer", "ascend"}),
    "grammar_backend": frozenset({"outlines", "llguidance"}),
}

# Values other than upstream's default that name what this build runs anyway: silent.
_SAME_AS_DEFAULT: dict[str, frozenset[str]] = {"lora_backend": frozenset({"triton"})}

# Upstream's flags whose first spelling is not --<field-name>. argparse derives the dest from the
# first flag (--tensor-parallel-size -> tensor_parallel_size); ServerArgs.from_cli_args maps it
# back to the field, as upstream's does.
UPSTREAM_CLI_FLAGS: dict[str, tuple[str, ...]] = {
    "tp_size": ("--tensor-parallel-size", "--tp-size"),
    "pp_size": ("--pipeline-parallel-size", "--pp-size"),
    "attn_cp_size": ("--attention-context-parallel-size", "--attn-cp-size"),
    "moe_dp_size": ("--moe-data-parallel-size", "--moe-dp-size"),
    "dp_size": ("--data-parallel-size", "--dp-size"),
    "ep_size": ("--expert-parallel-size", "--ep-size", "--ep"),
}


def upstream_default(f: dataclasses.Field) -> Any:
    """The default of a dataclass field (a fresh list for the list-valued upstream ones)."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _is_default(f: dataclasses.Field, value: Any) -> bool:
    """True when an upstream-only field's value changes nothing: None, upstream's default, or a
    value that names what this build does anyway."""
    return (
        value is None
        or value == upstream_default(f)
        or (isinstance(value, str) and value in _SAME_AS_DEFAULT.get(f.name, ()))
    )


def server_args_from_kwargs(kwargs: dict[str, Any]) -> ServerArgs:
    """``ServerArgs(**kwargs)`` (how ``Engine(**kwargs)`` builds its arguments), except that the
    TypeError names every name that neither this build nor upstream has, not only the first."""
    from sglang.srt.server_args import ServerArgs

    known = {f.name for f in dataclasses.fields(ServerArgs)}
    unknown = sorted(k for k in kwargs if k not in known)
    if unknown:
        raise TypeError(f"unexpected server argument(s): {', '.join(unknown)}")
    return ServerArgs(**kwargs)
