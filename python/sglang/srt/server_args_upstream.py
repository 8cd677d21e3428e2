"""Upstream SGLang's ServerArgs fields that this build does not have, and how an
``Engine(**kwargs)`` call or a command line that sets them is handled (docs/compatibility.md):

* a field set to upstream's default (or None) changes nothing and is accepted silently;
* a field in :data:`NOT_APPLICABLE` (hardware, CUDA-graph, multimodal, logging and
  deployment knobs that do not change what is generated) is accepted with ONE logged warning
  per call naming every such field;
* any other upstream field set to another value would change results, so it is refused with a
  ValueError naming the field and value;
* a name that upstream does not have either is a TypeError naming it.

Upstream attention and sampling backends that this build does not name at all (``fa3``,
``flashmla``, sampling ``flashinfer``, ...) fall back to this build's default backend, with the
same warning; ``attention_backend="flashinfer"``, which this build names but has not built, is
refused by ServerArgs as before.

The table holds upstream's field names and defaults at the API level of
:data:`sglang.version.UPSTREAM_API_VERSION`, and the kind of each value (for the CLI flags).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from typing import Any

from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

# name -> (kind of value: bool | int | float | str | list | json, upstream's default)
UPSTREAM_ONLY_FIELDS: dict[str, tuple[str, Any]] = {
    "tokenizer_mode": ("str", 'auto'),
    "tokenizer_worker_num": ("int", 1),
    "model_loader_extra_config": ("str", '{}'),
    "is_embedding": ("bool", False),
    "enable_multimodal": ("bool", None),
    "revision": ("str", None),
    "model_impl": ("str", 'auto'),
    "fastapi_root_path": ("str", ''),
    "grpc_mode": ("bool", False),
    "warmups": ("str", None),
    "nccl_port": ("int", None),
    "checkpoint_engine_wait_weights_before_ready": ("bool", False),
    "ssl_keyfile": ("str", None),
    "ssl_certfile": ("str", None),
    "ssl_ca_certs": ("str", None),
    "ssl_keyfile_password": ("str", None),
    "enable_ssl_refresh": ("bool", False),
    "quantization": ("str", None),
    "quantization_param_path": ("str", None),
    "kv_cache_dtype": ("str", 'auto'),
    "enable_fp32_lm_head": ("bool", False),
    "modelopt_quant": ("json", None),
    "modelopt_checkpoint_restore_path": ("str", None),
    "modelopt_checkpoint_save_path": ("str", None),
    "modelopt_export_path": ("str", None),
    "quantize_and_serve": ("bool", False),
    "rl_quant_profile": ("str", None),
    "max_queued_requests": ("int", None),
    "enable_dynamic_chunking": ("bool", False),
    "prefill_max_requests": ("int", None),
    "enable_priority_scheduling": ("bool", False),
    "disable_priority_preemption": ("bool", False),
    "default_priority_value": ("int", None),
    "abort_on_priority_when_disabled": ("bool", False),
    "schedule_low_priority_values_first": ("bool", False),
    "priority_scheduling_preemption_threshold": ("int", 10),
    "swa_full_tokens_ratio": ("float", 0.8),
    "disable_hybrid_swa_memory": ("bool", False),
    "radix_eviction_policy": ("str", 'lru'),
    "enable_prefill_delayer": ("bool", False),
    "prefill_delayer_max_delay_passes": ("int", 30),
    "prefill_delayer_token_usage_low_watermark": ("float", None),
    "prefill_delayer_forward_passes_buckets": ("list", None),
    "prefill_delayer_wait_seconds_buckets": ("list", None),
    "pp_size": ("int", 1),
    "pp_max_micro_batch_size": ("int", None),
    "pp_async_batch_depth": ("int", 0),
    "stream_response_default_include_usage": ("bool", False),
    "incremental_streaming_output": ("bool", False),
    "enable_streaming_session": ("bool", False),
    "constrained_json_whitespace_pattern": ("str", None),
    "constrained_json_disable_any_whitespace": ("bool", False),
    "watchdog_timeout": ("float", 300),
    "soft_watchdog_timeout": ("float", None),
    "download_dir": ("str", None),
    "model_checksum": ("str", None),
    "base_gpu_id": ("int", 0),
    "gpu_id_step": ("int", 1),
    "sleep_on_idle": ("bool", False),
    "use_ray": ("bool", False),
    "custom_sigquit_handler": ("json", None),
    "log_level_http": ("str", None),
    "log_requests_level": ("int", 2),
    "log_requests_format": ("str", 'text'),
    "log_requests_target": ("list", None),
    "uvicorn_access_log_exclude_prefixes": ("list", []),
    "crash_dump_folder": ("str", None),
    "show_time_cost": ("bool", False),
    "enable_mfu_metrics": ("bool", False),
    "enable_metrics_for_all_schedulers": ("bool", False),
    "tokenizer_metrics_custom_labels_header": ("str", 'x-custom-labels'),
    "tokenizer_metrics_allowed_custom_labels": ("list", None),
    "extra_metric_labels": ("json", None),
    "bucket_time_to_first_token": ("list", None),
    "bucket_inter_token_latency": ("list", None),
    "bucket_e2e_request_latency": ("list", None),
    "collect_tokens_histogram": ("bool", False),
    "prompt_tokens_buckets": ("list", None),
    "generation_tokens_buckets": ("list", None),
    "gc_warning_threshold_secs": ("float", 0.0),
    "decode_log_interval": ("int", 40),
    "enable_request_time_stats_logging": ("bool", False),
    "kv_events_config": ("str", None),
    "enable_trace": ("bool", False),
    "otlp_traces_endpoint": ("str", 'localhost:4317'),
    "export_metrics_to_file": ("bool", False),
    "export_metrics_to_file_dir": ("str", None),
    "admin_api_key": ("str", None),
    "hf_chat_template_name": ("str", None),
    "completion_template": ("str", None),
    "file_storage_path": ("str", 'sglang_storage'),
    "enable_cache_report": ("bool", False),
    "tool_server": ("str", None),
    "sampling_defaults": ("str", 'model'),
    "attn_cp_size": ("int", 1),
    "moe_dp_size": ("int", 1),
    "json_model_override_args": ("str", '{}'),
    "preferred_sampling_params": ("str", None),
    "enable_lora_overlap_loading": ("bool", None),
    "lora_eviction_policy": ("str", 'lru'),
    "lora_backend": ("str", 'csgmv'),
    "max_lora_chunk_size": ("int", 16),
    "experts_shared_outer_loras": ("bool", None),
    "decode_attention_backend": ("str", None),
    "prefill_attention_backend": ("str", None),
    "grammar_backend": ("str", None),
    "mm_attention_backend": ("str", None),
    "fp8_gemm_runner_backend": ("str", 'auto'),
    "fp4_gemm_runner_backend": ("str", 'auto'),
    "nsa_prefill_backend": ("str", None),
    "nsa_decode_backend": ("str", None),
    "disable_flashinfer_autotune": ("bool", False),
    "mamba_backend": ("str", 'triton'),
    "speculative_algorithm": ("str", None),
    "speculative_draft_model_path": ("str", None),
    "speculative_draft_model_revision": ("str", None),
    "speculative_draft_load_format": ("str", None),
    "speculative_num_steps": ("int", None),
    "speculative_eagle_topk": ("int", None),
    "speculative_num_draft_tokens": ("int", None),
    "speculative_accept_threshold_single": ("float", 1.0),
    "speculative_accept_threshold_acc": ("float", 1.0),
    "speculative_token_map": ("str", None),
    "speculative_attention_mode": ("str", 'prefill'),
    "speculative_draft_attention_backend": ("str", None),
    "speculative_moe_runner_backend": ("str", None),
    "speculative_moe_a2a_backend": ("str", None),
    "speculative_draft_model_quantization": ("str", None),
    "speculative_ngram_min_bfs_breadth": ("int", 1),
    "speculative_ngram_max_bfs_breadth": ("int", 10),
    "speculative_ngram_match_type": ("str", 'BFS'),
    "speculative_ngram_max_trie_depth": ("int", 18),
    "speculative_ngram_capacity": ("int", 10000000),
    "enable_multi_layer_eagle": ("bool", False),
    "ep_size": ("int", 1),
    "moe_a2a_backend": ("str", 'none'),
    "moe_runner_backend": ("str", 'auto'),
    "flashinfer_mxfp4_moe_precision": ("str", 'default'),
    "enable_flashinfer_allreduce_fusion": ("bool", False),
    "enforce_disable_flashinfer_allreduce_fusion": ("bool", False),
    "enable_aiter_allreduce_fusion": ("bool", False),
    "deepep_mode": ("str", 'auto'),
    "ep_num_redundant_experts": ("int", 0),
    "ep_dispatch_algorithm": ("str", None),
    "init_expert_location": ("str", 'trivial'),
    "enable_eplb": ("bool", False),
    "eplb_algorithm": ("str", 'auto'),
    "eplb_rebalance_num_iterations": ("int", 1000),
    "eplb_rebalance_layers_per_chunk": ("int", None),
    "eplb_min_rebalancing_utilization_threshold": ("float", 1.0),
    "expert_distribution_recorder_mode": ("str", None),
    "expert_distribution_recorder_buffer_size": ("int", None),
    "enable_expert_distribution_metrics": ("bool", False),
    "deepep_config": ("str", None),
    "moe_dense_tp_size": ("int", None),
    "elastic_ep_backend": ("str", None),
    "enable_elastic_expert_backup": ("bool", False),
    "mooncake_ib_device": ("str", None),
    "max_mamba_cache_size": ("int", None),
    "mamba_ssm_dtype": ("str", None),
    "mamba_full_memory_ratio": ("float", 0.9),
    "mamba_scheduler_strategy": ("str", 'auto'),
    "mamba_track_interval": ("int", 256),
    "linear_attn_backend": ("str", 'triton'),
    "linear_attn_decode_backend": ("str", None),
    "linear_attn_prefill_backend": ("str", None),
    "enable_hierarchical_cache": ("bool", False),
    "hicache_ratio": ("float", 2.0),
    "hicache_size": ("int", 0),
    "hicache_write_policy": ("str", 'write_through'),
    "hicache_io_backend": ("str", 'kernel'),
    "hicache_mem_layout": ("str", 'layer_first'),
    "hicache_storage_backend": ("str", None),
    "hicache_storage_prefetch_policy": ("str", 'best_effort'),
    "hicache_storage_backend_extra_config": ("str", None),
    "enable_hisparse": ("bool", False),
    "hisparse_config": ("str", None),
    "enable_lmcache": ("bool", False),
    "kt_weight_path": ("str", None),
    "kt_method": ("str", None),
    "kt_cpuinfer": ("int", None),
    "kt_threadpool_count": ("int", None),
    "kt_num_gpu_experts": ("int", None),
    "kt_max_deferred_experts_per_token": ("int", None),
    "dllm_algorithm": ("str", None),
    "dllm_algorithm_config": ("str", None),
    "enable_double_sparsity": ("bool", False),
    "ds_channel_config_path": ("str", None),
    "ds_heavy_channel_num": ("int", 32),
    "ds_heavy_token_num": ("int", 256),
    "ds_heavy_channel_type": ("str", 'qk'),
    "ds_sparse_decode_threshold": ("int", 4096),
    "cpu_offload_gb": ("int", 0),
    "offload_group_size": ("int", -1),
    "offload_num_in_group": ("int", 1),
    "offload_prefetch_step": ("int", 1),
    "offload_mode": ("str", 'cpu'),
    "multi_item_scoring_delimiter": ("int", None),
    "enable_profile_cuda_graph": ("bool", False),
    "enable_cudagraph_gc": ("bool", False),
    "enable_layerwise_nvtx_marker": ("bool", False),
    "enable_nccl_nvls": ("bool", False),
    "enable_symm_mem": ("bool", False),
    "disable_flashinfer_cutlass_moe_fp4_allgather": ("bool", False),
    "enable_tokenizer_batch_encode": ("bool", False),
    "disable_tokenizer_batch_decode": ("bool", False),
    "disable_outlines_disk_cache": ("bool", False),
    "disable_custom_all_reduce": ("bool", False),
    "enable_mscclpp": ("bool", False),
    "enable_torch_symm_mem": ("bool", False),
    "pre_warm_nccl": ("bool", False),
    "enable_mixed_chunk": ("bool", False),
    "enable_dp_attention": ("bool", False),
    "enable_dp_lm_head": ("bool", False),
    "enable_two_batch_overlap": ("bool", False),
    "enable_single_batch_overlap": ("bool", False),
    "tbo_token_distribution_threshold": ("float", 0.48),
    "disable_piecewise_cuda_graph": ("bool", False),
    "enforce_piecewise_cuda_graph": ("bool", False),
    "enable_torch_compile_debug_mode": ("bool", False),
    "piecewise_cuda_graph_max_tokens": ("int", None),
    "piecewise_cuda_graph_tokens": ("list", None),
    "piecewise_cuda_graph_compiler": ("str", 'eager'),
    "torchao_config": ("str", ''),
    "enable_nan_detection": ("bool", False),
    "enable_p2p_check": ("bool", False),
    "triton_attention_reduce_in_fp32": ("bool", False),
    "triton_attention_num_kv_splits": ("int", 8),
    "triton_attention_split_tile_size": ("int", None),
    "num_continuous_decode_steps": ("int", 1),
    "delete_ckpt_after_loading": ("bool", False),
    "enable_memory_saver": ("bool", False),
    "enable_weights_cpu_backup": ("bool", False),
    "enable_draft_weights_cpu_backup": ("bool", False),
    "allow_auto_truncate": ("bool", False),
    "enable_custom_logit_processor": ("bool", False),
    "flashinfer_mla_disable_ragged": ("bool", False),
    "disable_shared_experts_fusion": ("bool", False),
    "disable_chunked_prefix_cache": ("bool", False),
    "disable_fast_image_processor": ("bool", False),
    "keep_mm_feature_on_device": ("bool", False),
    "enable_return_hidden_states": ("bool", False),
    "enable_return_routed_experts": ("bool", False),
    "scheduler_recv_interval": ("int", 1),
    "numa_node": ("list", None),
    "rl_on_policy_target": ("str", None),
    "enable_attn_tp_input_scattered": ("bool", False),
    "gc_threshold": ("list", None),
    "enable_nsa_prefill_context_parallel": ("bool", False),
    "nsa_prefill_cp_mode": ("str", 'round-robin-split'),
    "enable_fused_qk_norm_rope": ("bool", False),
    "enable_precise_embedding_interpolation": ("bool", False),
    "enable_fused_moe_sum_all_reduce": ("bool", False),
    "enable_prefill_context_parallel": ("bool", False),
    "prefill_cp_mode": ("str", 'in-seq-split'),
    "enable_dynamic_batch_tokenizer": ("bool", False),
    "dynamic_batch_tokenizer_batch_size": ("int", 32),
    "dynamic_batch_tokenizer_batch_timeout": ("float", 0.002),
    "debug_tensor_dump_output_folder": ("str", None),
    "debug_tensor_dump_layers": ("list", None),
    "debug_tensor_dump_input_file": ("str", None),
    "debug_tensor_dump_inject": ("bool", False),
    "disaggregation_mode": ("str", 'null'),
    "disaggregation_transfer_backend": ("str", 'mooncake'),
    "disaggregation_bootstrap_port": ("int", 8998),
    "disaggregation_ib_device": ("str", None),
    "disaggregation_decode_enable_offload_kvcache": ("bool", False),
    "num_reserved_decode_tokens": ("int", 512),
    "disaggregation_decode_polling_interval": ("int", 1),
    "encoder_only": ("bool", False),
    "language_only": ("bool", False),
    "encoder_transfer_backend": ("str", "zmq_to_scheduler"),
    "encoder_urls": ("list", []),
    "enable_adaptive_dispatch_to_encoder": ("bool", False),
    "weight_loader_disable_mmap": ("bool", False),
    "remote_instance_weight_loader_seed_instance_ip": ("str", None),
    "remote_instance_weight_loader_seed_instance_service_port": ("int", None),
    "remote_instance_weight_loader_send_weights_group_ports": ("list", None),
    "remote_instance_weight_loader_backend": ("str", 'nccl'),
    "remote_instance_weight_loader_start_seed_via_transfer_engine": ("bool", False),
    "engine_info_bootstrap_port": ("int", 6789),
    "modelexpress_config": ("str", None),
    "enable_pdmux": ("bool", False),
    "pdmux_config_path": ("str", None),
    "sm_group_num": ("int", 8),
    "enable_broadcast_mm_inputs_process": ("bool", False),
    "enable_prefix_mm_cache": ("bool", False),
    "mm_enable_dp_encoder": ("bool", False),
    "mm_process_config": ("json", None),
    "limit_mm_data_per_request": ("json", None),
    "enable_mm_global_cache": ("bool", False),
    "decrypted_config_file": ("str", None),
    "decrypted_draft_config_file": ("str", None),
    "forward_hooks": ("list", None),
}

# Upstream fields accepted (with a warning) at any value: none of them changes the tokens,
# logprobs or states that this build returns; they tune hardware paths this build does not
# have (piecewise CUDA graphs, torch.compile's debug mode, custom all-reduce, NCCL, multimodal
# encoders, CPU offload), logging and metrics, or multi-node placement that a single-node run
# does not use.
NOT_APPLICABLE: frozenset[str] = frozenset({
    "base_gpu_id", "gpu_id_step", "nccl_port",
    "enable_memory_saver", "enable_weights_cpu_backup",
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
})

# Upstream's backend names for fields this build has with fewer choices.
_UPSTREAM_BACKENDS = {
    "attention_backend": frozenset({
        "flex_attention", "nsa", "cutlass_mla", "fa3", "fa4", "flashmla",
        "trtllm_mla", "trtllm_mha", "dual_chunk_flash_attn", "aiter", "wave", "intel_amx",
        "ascend", "intel_xpu",
    }),
    "sampling_backend": frozenset({"flashinfer", "ascend"}),
}

_OUR_FIELDS = frozenset(f.name for f in dataclasses.fields(ServerArgs))


def _is_default(name: str, value: Any) -> bool:
    return value is None or value == UPSTREAM_ONLY_FIELDS[name][1]


def split_server_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of :class:`ServerArgs` among ``kwargs`` (upstream's names).

    Raises TypeError naming every name neither this build nor upstream knows, and ValueError
    naming every upstream-only field set to a value that would change results. Logs one
    warning naming the not-applicable fields (and unavailable backends) that were set.
    """
    unknown = sorted(k for k in kwargs if k not in _OUR_FIELDS and k not in UPSTREAM_ONLY_FIELDS)
    if unknown:
        raise TypeError(f"unexpected server argument(s): {', '.join(unknown)}")
    ours = {k: v for k, v in kwargs.items() if k in _OUR_FIELDS}
    upstream = {k: v for k, v in kwargs.items() if k in UPSTREAM_ONLY_FIELDS}
    changed = {k: v for k, v in upstream.items() if not _is_default(k, v)}
    refused = sorted(f"{k}={v!r}" for k, v in changed.items() if k not in NOT_APPLICABLE)
    if refused:
        raise ValueError(f"not supported by this build: {', '.join(refused)}")
    ignored = sorted(f"{k}={v!r}" for k, v in changed.items() if k in NOT_APPLICABLE)
    for name, names in _UPSTREAM_BACKENDS.items():
        if ours.get(name) in names:
            ignored.append(f"{name}={ours.pop(name)!r} (this build's default is used)")
    if ignored:
        logger.warning(
            "Ignoring upstream SGLang option(s) that do not apply to this build: %s",
            ", ".join(ignored),
        )
    return ours


def server_args_from_kwargs(kwargs: dict[str, Any]) -> ServerArgs:
    """``ServerArgs`` from upstream-style keyword arguments (see :func:`split_server_kwargs`)."""
    return ServerArgs(**split_server_kwargs(kwargs))


def add_upstream_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add a ``--flag`` for every upstream-only field, hidden from ``--help`` (listed in
    docs/compatibility.md). Unset flags are absent from the parsed namespace."""
    types = {"int": int, "float": float, "str": str, "json": str}
    for name, (kind, _default) in UPSTREAM_ONLY_FIELDS.items():
        flag = "--" + name.replace("_", "-")
        extra: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS,
                                 "help": argparse.SUPPRESS}
        if kind == "bool":
            parser.add_argument(flag, action="store_true", **extra)
        elif kind == "list":
            parser.add_argument(flag, nargs="*", **extra)
        else:
            parser.add_argument(flag, type=types[kind], **extra)
