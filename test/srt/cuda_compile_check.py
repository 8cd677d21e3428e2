"""Compile every Triton kernel (sgl_kernel's and LoRA's) for an NVIDIA target, without a GPU.

The interpreter (TRITON_INTERPRET=1) checks what the kernels compute, but not that they
compile: layouts, dynamic loop bounds and dtype rules are only checked by the real compiler.
``triton.compile`` lowers to PTX and runs ptxas (shipped with triton) with no driver, so CPU CI
can catch a kernel that would fail on its first CUDA launch. Run as a script with
TRITON_INTERPRET unset (Triton decides at decoration time whether a kernel is interpreted):

    python test/srt/cuda_compile_check.py 90     # compute capability, e.g. 80 or 90

It prints one line per compiled specialization and exits non-zero on the first failure.
"""

from __future__ import annotations

import contextlib
import inspect
import sys

import torch
import triton
from test_entropy_kernel import FakeReq
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import sgl_kernel.batch_invariant as bi
import sgl_kernel.decode_attention as da
import sgl_kernel.fused_elementwise as fe
import sgl_kernel.sampling as sampling
import sglang.srt.lora.triton_kernels as lora_kernels
import sglang.srt.lora.triton_ops as lora_ops
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.sampling.sampling_params import SamplingParams

_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _compile(target: GPUTarget, kernel, types: dict[str, str], consts: dict, **options) -> None:
    """Compile ``kernel`` with ``consts``; parameters not in ``types`` are int32 scalars."""
    names = inspect.signature(kernel.fn).parameters
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    triton.compile(ASTSource(kernel, signature, consts), target=target, options=options)
    print(f"ok {kernel.fn.__name__} {consts}")


_POINTER_TYPES = {**{dtype: "*" + name for dtype, name in _DTYPES.items()},
                  torch.int64: "*i64", torch.int32: "*i32", torch.bool: "*i1"}  # fmt: skip


def _recorded_sampler_launches() -> list[tuple[object, dict[str, str], dict]]:
    """The sampler's launches as its host code makes them, for batches that use each feature:
    (kernel, the argument types, the constexprs). Nothing runs: each kernel's ``run`` is
    replaced by a recorder, so the types compiled are those of the real arguments."""
    launches: list[tuple[object, dict[str, str], dict]] = []
    kernels = [sampling._stats_kernel, sampling._verify_kernel, sampling._search_kernel,
               sampling._final_kernel, sampling._finish_kernel, sampling._log_z_tile_kernel,
               sampling._log_z_kernel]  # fmt: skip

    def recorder(kernel):
        def run(*args, grid, warmup, **kwargs):
            names = list(inspect.signature(kernel.fn).parameters)
            options = {n: kwargs.pop(n) for n in ("num_warps",) if n in kwargs}
            types = {}
            for name, arg in zip(names, args):
                if isinstance(arg, torch.Tensor):
                    types[name] = _POINTER_TYPES[arg.dtype]
                else:
                    types[name] = "fp32" if isinstance(arg, float) else "i32"
            launches.append((kernel, types, {**kwargs, **options}))

        return run

    saved = {k: k.run for k in kernels}
    vocab = 151936
    batches = [  # (params, entropy requests, logits dtype): all greedy, a plain batch, min-p
        # alone (no search), every feature; 5 rows search with fewer pivots than 2
        ([{"temperature": 1.0, "top_k": 20, "top_p": 0.8}] * 5, None, torch.float32),
        ([{"temperature": 0.0}] * 2, None, torch.float32),
        ([{"temperature": 0.0}, {"temperature": 1.0}], None, torch.bfloat16),
        ([{"temperature": 0.7, "min_p": 0.1}, {"temperature": 1.0}], [("raw", 0), None],
         torch.bfloat16),
        ([{"temperature": 0.7, "top_k": 50, "top_p": 0.9, "min_p": 0.05}, {"temperature": 0.0}],
         [("raw", 0), ("sampled", 20)], torch.bfloat16),
    ]  # fmt: skip
    try:
        for k in kernels:
            k.run = recorder(k)
        for params, entropy, dtype in batches:
            reqs = [FakeReq(SamplingParams(**p), i, range(5)) for i, p in enumerate(params)]
            info = SamplingBatchInfo.from_reqs(reqs, vocab, "cpu", entropy)
            plan = None if entropy is None else info.entropy_plan("raw", 0)
            logits = torch.zeros(len(params), vocab, dtype=dtype)
            with _as_cuda():
                sampling.sample_triton(logits, info, True, None, plan)
        with _as_cuda():
            sampling.row_logsumexp_triton(torch.zeros(2, vocab))
    finally:
        for k, run in saved.items():
            k.run = run
    return launches


@contextlib.contextmanager
def _as_cuda():
    """Plan the sampler's launches for a GPU (its tiling) while the tensors stay on the CPU."""
    tiling = sampling._tiling
    sampling._tiling = lambda device, vocab_size, num_rows: tiling(
        torch.device("cuda"), vocab_size, num_rows
    )
    try:
        yield
    finally:
        sampling._tiling = tiling


def _compile_sampler_launches(target: GPUTarget) -> None:
    """Compile each distinct launch of :func:`_recorded_sampler_launches` once."""
    seen = set()
    for kernel, types, consts in _recorded_sampler_launches():
        options = {"num_warps": consts.pop("num_warps")} if "num_warps" in consts else {}
        key = (kernel.fn.__name__, tuple(sorted(types.items())), tuple(sorted(consts.items())))
        if key not in seen:
            seen.add(key)
            _compile(target, kernel, types, consts, **options)


def main(capability: int) -> None:
    target = GPUTarget("cuda", capability, 32)
    for dtype, config in bi._MATMUL_CONFIG.items():
        config = dict(config)
        options = {"num_warps": config.pop("num_warps"), "num_stages": config.pop("num_stages")}
        ptr = "*" + _DTYPES[dtype]
        types = {"a_ptr": ptr, "b_ptr": ptr, "c_ptr": ptr, "bias_ptr": ptr}
        consts = {"HAS_BIAS": True, "IEEE": dtype == torch.float32, "INTERPRETED": False,
                  "GROUP_M": bi._GROUP_M, **config}  # fmt: skip
        _compile(target, bi._matmul_kernel, types, consts, **options)
    for dtype in (torch.float32, torch.bfloat16):
        ptr = "*" + _DTYPES[dtype]
        types = {"x_ptr": ptr, "w_ptr": ptr, "out_ptr": ptr, "eps": "fp32"}
        _compile(target, bi._rms_norm_kernel, types, {"BLOCK": 4096})
        types = {"q_ptr": ptr, "k_ptr": ptr, "v_ptr": ptr, "out_ptr": ptr, "table_ptr": "*i64",
                 "pool_rows_ptr": "*i64", "positions_ptr": "*i64", "scale": "fp32"}  # fmt: skip
        for group, head_dim in [(1, 64), (3, 64), (4, 128), (7, 128), (8, 256)]:
            block_g, block_d, block_n = bi.attention_tile_shape(group, head_dim)
            consts = {"GROUP": group, "HEAD_DIM": head_dim, "BLOCK_G": block_g,
                      "BLOCK_D": block_d, "BLOCK_N": block_n}  # fmt: skip
            _compile(target, bi._paged_attention_kernel, types, consts, num_warps=4)
            split_types = {**types, "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}
            split_consts = {**consts, "NUM_SPLITS": da.NUM_SPLITS}
            _compile(target, da._split_kernel, split_types, split_consts, num_warps=4)
            merge_consts = {"HEAD_DIM": head_dim, "BLOCK_D": block_d, "BLOCK_N": block_n,
                            "NUM_SPLITS": da.NUM_SPLITS}  # fmt: skip
            _compile(target, da._merge_kernel, split_types, merge_consts, num_warps=1)

    for dtype in (torch.float32, torch.bfloat16):
        ptr = "*" + _DTYPES[dtype]
        for has_residual in (False, True):
            types = {"x_ptr": ptr, "res_ptr": ptr, "w_ptr": ptr, "out_ptr": ptr,
                     "sum_ptr": ptr, "eps": "fp32"}  # fmt: skip
            consts = {"HAS_RESIDUAL": has_residual, "BLOCK": 1024}
            _compile(target, fe._add_rms_norm_kernel, types, consts)
        types = {"x_ptr": ptr, "out_ptr": ptr, "positions_ptr": "*i64", "table_ptr": "*fp32"}
        for head_dim, rotary_dim, heads in [(64, 64, 12), (128, 64, 40)]:
            half, rest = rotary_dim // 2, head_dim - rotary_dim
            consts = {"HEAD_DIM": head_dim, "HALF": half, "BLOCK_H": triton.next_power_of_2(heads),
                      "BLOCK_HALF": half, "PASS": rest,
                      "BLOCK_PASS": triton.next_power_of_2(max(rest, 1))}  # fmt: skip
            _compile(target, fe._rope_kernel, types, consts, **fe._LAUNCH)
            store_types = {"q_ptr": ptr, "k_ptr": ptr, "v_ptr": ptr, "q_out_ptr": ptr,
                           "k_buf_ptr": ptr, "v_buf_ptr": ptr, "loc_ptr": "*i64",
                           "positions_ptr": "*i64", "table_ptr": "*fp32"}  # fmt: skip
            store_consts = {**consts, "BLOCK_KVH": 4, "BLOCK_V": 4 * head_dim}
            _compile(target, fe._rope_store_kv_kernel, store_types, store_consts, **fe._LAUNCH)
        types = {"x_ptr": ptr, "out_ptr": ptr}
        _compile(target, fe._silu_and_mul_kernel, types, {"BLOCK": fe._SILU_BLOCK}, **fe._LAUNCH)
        types = {"k_buf_ptr": ptr, "v_buf_ptr": ptr, "loc_ptr": "*i64", "k_ptr": ptr, "v_ptr": ptr}
        _compile(target, fe._store_kv_kernel, types, {"BLOCK": 256})

    _compile_sampler_launches(target)

    segments = {"seg_starts_ptr": "*i32", "seg_lens_ptr": "*i32", "seg_slots_ptr": "*i32",
                "widths_ptr": "*i32"}  # fmt: skip
    # Decode tiles in bfloat16 and prefill tiles in float32; 1 and 3 shards for expand.
    for block_m, dtype, num_shards in [(lora_ops._SHORT_SEGMENT, torch.bfloat16, 1),
                                       (lora_ops._LONG_BLOCK_M, torch.float32, 3)]:  # fmt: skip
        ptr = "*" + _DTYPES[dtype]
        common = {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 64,
                  "IEEE": dtype == torch.float32, "INTERPRETED": False}  # fmt: skip
        types = {"x_ptr": ptr, "a_ptr": ptr, "y_ptr": ptr, **segments}
        _compile(target, lora_kernels.lora_shrink_kernel, types, common)
        types = {"y_ptr": ptr, "b_ptr": ptr, "out_ptr": ptr, **segments}
        consts = {"NUM_SHARDS": num_shards, **common}
        _compile(target, lora_kernels.lora_expand_kernel, types, consts)


if __name__ == "__main__":
    main(int(sys.argv[1]))
