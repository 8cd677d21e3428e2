"""Tensor parallelism: process groups and collectives (see parallel_state.py)."""

from sglang.srt.distributed.parallel_state import (
    GroupCoordinator,
    destroy_distributed_environment,
    divide,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    init_distributed_environment,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)

__all__ = [
    "GroupCoordinator",
    "destroy_distributed_environment",
    "divide",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tp_group",
    "init_distributed_environment",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
]
