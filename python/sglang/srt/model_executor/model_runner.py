"""ModelRunner: owns the weights, the KV pools and the attention backend; runs forward passes.

It mutates nothing of the scheduler's: it reads a ForwardBatch, writes K/V into the pool slots
the batch names, and returns logits.

With tensor parallelism (the group joined before this is built) each rank's runner holds its
shard of the weights and a KV pool of its own KV heads; the pool size in tokens and the
number of request rows are agreed (the minimum over the ranks), so that every rank's
scheduler, taking the same decisions, finds the same slots free.
"""

from __future__ import annotations

import base64
import logging
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed.parallel_state import (
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_min,
)
from sglang.srt.layers import cpu_brgemm, cpu_fused_ops, cpu_sampling
from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.attention import get_attention_backend_class
from sglang.srt.layers.batch_invariant import enable_batch_invariant_mode
from sglang.srt.layers.cpu_extension import load_side_by_side
from sglang.srt.layers.cpu_gemv import load_kernel as load_small_linear_kernel
from sglang.srt.layers.cpu_gemv import max_rows as small_linear_max_rows
from sglang.srt.layers.cpu_prepack import (
    PackedLinear,
    enable_cpu_weight_prepack,
    native_bf16_supported,
    pack_now,
    prepack_supported,
)
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.logits_processor import (
    Float32Head,
    LogitsProcessor,
    LogitsProcessorOutput,
)
from sglang.srt.layers.moe import RoutedExpertsRecorder, SparseMoE
from sglang.srt.layers.rotary_embedding import RotaryEmbedding
from sglang.srt.layers.sampler import get_logsumexp, use_cpu_kernels
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.cpu_torch_compile import CompiledDecoderLayers, warm_up
from sglang.srt.model_executor.cuda_graph_runner import (
    DecodeGraphRunner,
    cuda_graph_off_reason,
    cuda_graph_reserve_bytes,
)
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.warmup import warm_up_cpu_memory
from sglang.srt.model_loader import get_model
from sglang.srt.models.llama_cpu_decode import LlamaCpuDecodeLoop
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.cpu_malloc import (
    FreedMemoryCap,
    keep_freed_memory,
    return_freed_memory,
)
from sglang.srt.utils.multiprocessing_serializer import MultiprocessingSerializer

logger = logging.getLogger(__name__)

_DEFAULT_CPU_KV_FRACTION = 0.2
_DEFAULT_CUDA_MEM_FRACTION = 0.85
_MAX_DEFAULT_RUNNING_REQUESTS = 256


@dataclass(repr=False)
class LocalSerializedTensor:
    """One tensor, serialized once per tensor-parallel rank (upstream's class, same field): the
    value of a ``(name, value)`` pair given to ``update_weights_from_tensor`` in place of the
    tensor. ``values[r]`` is a :class:`MultiprocessingSerializer` payload (bytes, or the base64
    string of them) that rank ``r`` of the engine's TP group loads; with TP size 1 only
    ``values[0]`` is read. ``sglang.srt.weight_sync.utils.update_weights`` builds these from
    the payloads of a trainer's ranks.

    ``values`` must be a list of bytes/str, whether constructed or unpickled (TypeError
    otherwise): the engine's unpickler admits this class, so it must not carry anything else.
    The payloads stay opaque until :meth:`get` decodes one with the same allowlist."""

    values: list[bytes | str]

    def __post_init__(self) -> None:
        _check_payloads(self.values)

    def __setstate__(self, state: object) -> None:
        # Unpickling sets the fields here, not through __init__: payloads get the same check.
        if not isinstance(state, dict) or set(state) != {"values"}:
            raise TypeError("a LocalSerializedTensor's state must be {'values': [...]}")
        _check_payloads(state["values"])
        self.values = state["values"]

    def __repr__(self) -> str:  # the payloads can be megabytes of tensor data
        return f"LocalSerializedTensor(<{len(self.values)} payload(s)>)"

    def get(self, rank: int) -> torch.Tensor:
        """The tensor of TP rank ``rank``: ``values[rank]`` deserialized. ValueError when there
        is no such entry or it does not decode to a tensor (a payload naming anything the
        serializer's allowlist refuses among them, with the serializer's message)."""
        if not 0 <= rank < len(self.values):
            raise ValueError(
                f"LocalSerializedTensor has {len(self.values)} payload(s); "
                f"tensor-parallel rank {rank} needs one"
            )
        try:
            tensor = MultiprocessingSerializer.deserialize(self.values[rank])
        except (pickle.UnpicklingError, ValueError) as e:
            raise ValueError(str(e)) from None
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(
                f"LocalSerializedTensor payload {rank} holds a {type(tensor).__name__}, "
                "not a tensor"
            )
        return tensor


def _check_payloads(values: object) -> None:
    ok = isinstance(values, list) and all(isinstance(v, (bytes, str)) for v in values)
    if not ok:
        raise TypeError("LocalSerializedTensor.values must be a list of bytes or str payloads")


def unwrap_local_serialized(
    named_tensors: list[tuple[str, Any]], tp_rank: int
) -> list[tuple[str, Any]]:
    """``named_tensors`` with every :class:`LocalSerializedTensor` value replaced by the tensor
    of rank ``tp_rank`` (other values as they are; their own checks come later). Called where
    a rank takes its tensors of an update, before validation. ValueError naming the tensor
    when its payload is missing or refused."""
    out: list[tuple[str, Any]] = []
    for name, value in named_tensors:
        if isinstance(value, LocalSerializedTensor):
            try:
                value = value.get(tp_rank)
            except ValueError as e:
                raise ValueError(f"tensor {name!r}: {e}") from None
        out.append((name, value))
    return out


class ModelRunner:
    def __init__(self, server_args: ServerArgs, model_config: ModelConfig) -> None:
        self.server_args = server_args
        self.model_config = model_config
        self.device = server_args.device
        self.dtype = model_config.dtype
        self.page_size = server_args.page_size
        torch.manual_seed(server_args.random_seed)
        self.tp_size = get_tensor_model_parallel_world_size()
        # KV heads of this rank (replicated when there are fewer KV heads than ranks).
        self.num_kv_heads = model_config.get_num_kv_heads(self.tp_size)
        self._malloc_cap = self._tune_cpu_malloc()

        self.model = get_model(model_config, self.device)
        # Parameter shapes while the weights are released (release_weights), by name.
        self._released_shapes: dict[str, torch.Size] = {}
        # Device memory held back from the KV pool for the CUDA graphs (0 without them).
        self._graph_reserve = 0
        if cuda_graph_off_reason(server_args, self.tp_size, self.model) is None:
            self._graph_reserve = cuda_graph_reserve_bytes(
                server_args, model_config, _MAX_DEFAULT_RUNNING_REQUESTS
            )
        # Decode replayed from CUDA graphs (docs/cuda_graph.md), set up last; None: eager.
        self.graph_runner: DecodeGraphRunner | None = None
        # Identical on every rank (the minimum), and so is everything derived from it.
        self.max_total_num_tokens = tensor_model_parallel_min(self._kv_pool_size())
        self.max_running_requests = server_args.max_running_requests or min(
            _MAX_DEFAULT_RUNNING_REQUESTS, max(1, self.max_total_num_tokens // 8)
        )
        self.req_to_token_pool = ReqToTokenPool(
            self.max_running_requests + 1, model_config.context_len + 8, self.device
        )
        self.token_to_kv_pool = MHATokenToKVPool(
            self.max_total_num_tokens,
            self.page_size,
            self.dtype,
            self.num_kv_heads,
            model_config.head_dim,
            model_config.num_hidden_layers,
            self.device,
        )
        self.allocator = TokenToKVPoolAllocator(
            self.max_total_num_tokens,
            self.page_size,
            self.device,
            debug=server_args.log_level == "debug",
        )
        backend = server_args.attention_backend
        if server_args.enable_deterministic_inference:
            backend = f"{backend}_deterministic"
            # Triton attention comes with the Triton matmul and norm (CUDA); torch_native with
            # the fixed-block torch product (CPU).
            kernels = "triton" if server_args.attention_backend == "triton" else "torch"
            if not enable_batch_invariant_mode(self.model, kernels):
                raise RuntimeError("deterministic mode: the model has no switchable linear layer")
        self.attn_backend = get_attention_backend_class(backend)()
        # --enable-return-routed-experts: each token's experts per MoE layer, per KV slot.
        self.routing_recorder = self._init_routing_recorder(model_config)
        self._build_cpu_kernels(backend)
        # --enable-fp32-lm-head: the LM head's product in float32 (None when off), set before
        # packing so that the CPU's packed head is its float32 copy.
        self.fp32_head = self._enable_fp32_lm_head()
        # oneDNN-packed copies of the linear weights (CPU; empty when off), dropped on release.
        self.weight_packers = self._enable_prepack()
        self._enable_cpu_fused_ops()
        self._enable_cpu_sampling_kernel()
        self._enable_cuda_fused_ops()
        logsumexp = get_logsumexp(server_args.sampling_backend)
        for module in self.model.modules():
            if isinstance(module, LogitsProcessor):
                module.logsumexp_fn = logsumexp
        logger.info(
            "KV pool: %d tokens (%.1f MiB, %d KV heads per rank of %d), max running requests %d",
            self.max_total_num_tokens,
            self.max_total_num_tokens * self._kv_bytes_per_token() / 2**20,
            self.num_kv_heads,
            self.tp_size,
            self.max_running_requests,
        )
        # Inductor-compiled decoder layers (--enable-torch-compile; None when off).
        self.compiled_layers: CompiledDecoderLayers | None = None
        # The flat CPU decode loop over the C++ kernels (None: the modules serve decode).
        self.cpu_decode_loop: LlamaCpuDecodeLoop | None = None
        # The CPU serving path only: not the Triton interpreter (tests), nor deterministic
        # mode, whose backend is "torch_native_deterministic" and whose batch-invariant
        # products are not what serving speed is.
        if (
            torch.device(self.device).type == "cpu"
            and backend == "torch_native"
            and not server_args.disable_cpu_malloc_tuning
        ):
            self._warm_up_cpu_memory()
        self._enable_torch_compile()
        self.cpu_decode_loop = self._enable_cpu_decode_loop()
        self.graph_runner = self._init_cuda_graphs()
        if self.graph_runner is not None:
            self.graph_runner.capture()
            if self.graph_runner.graph_memory_bytes > self._graph_reserve:
                logger.warning(
                    "CUDA graphs took %.1f MiB, %.1f MiB more than held back from the KV pool",
                    self.graph_runner.graph_memory_bytes / 2**20,
                    (self.graph_runner.graph_memory_bytes - self._graph_reserve) / 2**20,
                )

    def _init_cuda_graphs(self) -> DecodeGraphRunner | None:
        """The decode graph runner, or None where decode stays eager (the reason logged on
        CUDA)."""
        reason = cuda_graph_off_reason(self.server_args, self.tp_size, self.model)
        if reason is not None:
            if torch.device(self.device).type == "cuda":
                logger.info("CUDA graphs off: %s; decode runs eagerly", reason)
            return None
        args = self.server_args
        return DecodeGraphRunner(
            self._forward_eager,
            self.req_to_token_pool,
            args.cuda_graph_batch_sizes(self.max_running_requests),
            self.device,
            pad=not args.disable_cuda_graph_padding,
            prefill=not args.disable_cuda_graph_prefill,
        )

    def _enable_torch_compile(self) -> None:
        """Compile the decoder layers and warm them up (cpu_torch_compile.py), unless the flag
        is off or this configuration keeps the eager path (the log says why)."""
        args = self.server_args
        if not args.enable_torch_compile:
            return
        reason = None
        if torch.device(self.device).type != "cpu":
            reason = "it is implemented for CPU only"
        elif args.enable_deterministic_inference:
            reason = "deterministic mode keeps its batch-invariant kernels"
        elif self.tp_size > 1:
            reason = "tensor parallelism is not supported by the compiled layers"
        elif args.enable_lora:
            reason = "LoRA adapters are not supported by the compiled layers"
        if reason is not None:
            logger.warning("--enable-torch-compile ignored: %s", reason)
            return
        self.compiled_layers = CompiledDecoderLayers(self.model, args.torch_compile_max_bs)
        logger.info(
            "torch.compile: compiling %d decoder layers ...", len(self.compiled_layers.layers)
        )
        seconds = warm_up(self.forward, self.req_to_token_pool)
        logger.info(
            "torch.compile: compiled in %.1f s (prefill and decode batches of up to %d "
            "requests run compiled)",
            seconds,
            args.torch_compile_max_bs,
        )

    def _warm_up_cpu_memory(self) -> None:
        """Touch, before the first request, the heap and KV memory that serving writes anyway
        (model_executor/warmup.py), sized to the largest prefill a step runs."""
        args = self.server_args
        chunk = args.chunked_prefill_size
        step_tokens = args.max_prefill_tokens if chunk <= 0 else min(chunk, args.max_prefill_tokens)
        warm_up_cpu_memory(
            self.model,
            self.forward,
            self.req_to_token_pool,
            self.token_to_kv_pool,
            min(step_tokens, self.max_total_num_tokens),
            self.model_config.context_len,
        )

    def _tune_cpu_malloc(self) -> FreedMemoryCap | None:
        """On CPU, keep freed memory in the heap for reuse (utils/cpu_malloc.py), before the
        weights are loaded, up to 1/16 of the machine's memory (at least 1 GiB); unless
        --disable-cpu-malloc-tuning. Returns the cap that forward() steps."""
        if torch.device(self.device).type != "cpu" or self.server_args.disable_cpu_malloc_tuning:
            return None
        if not keep_freed_memory():
            return None
        import psutil

        limit = max(1 << 30, psutil.virtual_memory().total // 16)
        logger.info(
            "CPU malloc: freed memory kept for reuse, up to %.1f GiB (--disable-cpu-malloc-tuning "
            "for glibc's default)",
            limit / 2**30,
        )
        return FreedMemoryCap(limit)

    def _enable_cuda_fused_ops(self) -> None:
        """On CUDA, switch the model's norms, activations, rotary embeddings and K/V store to
        the fused Triton kernels (sgl_kernel.fused_elementwise); not in deterministic mode (its own
        norm) nor with --disable-cuda-fused-ops."""
        args = self.server_args
        if (
            torch.device(self.device).type != "cuda"
            or args.disable_cuda_fused_ops
            or args.enable_deterministic_inference
        ):
            return
        fused = (RMSNorm, SiluAndMul, RotaryEmbedding)
        modules = [m for m in self.model.modules() if isinstance(m, fused)]
        for module in modules:
            module.use_triton_fused_ops = True
        self.token_to_kv_pool.use_triton_store = True
        logger.info("CUDA fused elementwise kernels (Triton): %d modules", len(modules))

    def _build_cpu_kernels(self, backend: str) -> None:
        """Build (or load from the cache) the C++ CPU kernels this runner will use, now rather
        than mid-serving, side by side: a first start then compiles them in about the time of
        the longest build instead of the sum (12-20 s each on 2 cores). The attention backend
        switches to its kernels here; the packing and fused-op code below finds theirs loaded."""
        loaders: list[Callable[[], bool]] = []
        if self._cpu_attention_kernel_wanted(backend):
            # Decode then prefill attention, two builds in turn: first in line.
            loaders.append(self.attn_backend.enable_cpu_decode_kernel)
        if self._prepack_wanted():
            loaders += [load_small_linear_kernel, cpu_brgemm.load_kernel]
        if self._cpu_fused_ops_wanted():
            # The sampling kernels' check runs later, on this thread (_enable_cpu_sampling_kernel).
            loaders += [cpu_fused_ops.load_kernel, cpu_sampling.build_kernel]
        load_side_by_side(loaders)

    def _cpu_attention_kernel_wanted(self, backend: str) -> bool:
        """The C++ decode- and prefill-attention kernels serve the ``torch_native`` backend on
        CPU, unless --disable-cpu-attention-kernel."""
        return (
            torch.device(self.device).type == "cpu"
            and backend == "torch_native"
            and not self.server_args.disable_cpu_attention_kernel
        )

    def _cpu_fused_ops_wanted(self) -> bool:
        """The fused elementwise kernels serve CPU runs unless --disable-cpu-fused-ops."""
        return (
            torch.device(self.device).type == "cpu" and not self.server_args.disable_cpu_fused_ops
        )

    def _enable_cpu_fused_ops(self) -> None:
        """On CPU, switch the model's norms, activations and rotary embeddings and the KV pool's
        store to the fused elementwise kernels (cpu_fused_ops.py); unless
        --disable-cpu-fused-ops (or the build failed: the torch ops stay)."""
        if not self._cpu_fused_ops_wanted() or not cpu_fused_ops.load_kernel():
            return
        fused = (RMSNorm, SiluAndMul, RotaryEmbedding)
        modules = [m for m in self.model.modules() if isinstance(m, fused)]
        for module in modules:
            module.use_cpu_fused_ops = True
        self.token_to_kv_pool.use_cpu_fused_ops = True
        logger.info("CPU fused elementwise kernels: %d modules and the KV store", len(modules))

    def _enable_cpu_sampling_kernel(self) -> None:
        """On CPU, the ``pytorch`` sampler's whole-vocabulary Gumbel-max (the same tokens bit for
        bit), softmax statistics (logprobs, top-p, entropy) and top-p candidates run in the C++
        kernels of cpu_sampling.py, unless --disable-cpu-fused-ops (or they could not be built or
        checked). Process-wide (sampling_torch.use_cpu_kernels): the last CPU runner started
        decides."""
        if torch.device(self.device).type != "cpu":
            return
        native = self._cpu_fused_ops_wanted() and cpu_sampling.load_kernel()
        use_cpu_kernels(cpu_sampling.KERNELS if native else None)

    def _enable_cpu_decode_loop(self) -> LlamaCpuDecodeLoop | None:
        """The decode loop of models/llama_cpu_decode.py where the C++ decode-attention
        kernel serves decode, unless --disable-cpu-decode-loop, LoRA (whose hooks are added
        after this) or the compiled layers; None (the module path) there and where the model
        or its kernels do not fit it, tensor parallelism included (logged)."""
        args = self.server_args
        if (
            # set where the torch_native backend decodes with the C++ kernel on CPU (built)
            not getattr(self.attn_backend, "uses_cpu_kernel", False)
            or args.disable_cpu_decode_loop
            or args.enable_lora
            or self.compiled_layers is not None
        ):
            return None
        reason = LlamaCpuDecodeLoop.unsupported_reason(self.model, self.token_to_kv_pool)
        if reason is not None:
            logger.info("CPU decode loop off (decode runs through the modules): %s", reason)
            return None
        logger.info("CPU decode loop: decode steps call the C++ kernels from one loop")
        return LlamaCpuDecodeLoop(self.model, self.token_to_kv_pool)

    def _enable_fp32_lm_head(self) -> Float32Head | None:
        """A :class:`Float32Head` on the model's logits processor when --enable-fp32-lm-head
        asks for one and the model is not float32 already; its float32 copy of the head's
        weights (CPU) is made now, so that its size is logged and the first step does not pay
        for it."""
        if not self.server_args.enable_fp32_lm_head or self.dtype == torch.float32:
            return None
        cache = torch.device(self.device).type == "cpu"
        head = Float32Head(cache)
        processors = [m for m in self.model.modules() if isinstance(m, LogitsProcessor)]
        for processor in processors:
            processor.fp32_head = head
        weight = getattr(getattr(self.model, "lm_head", None), "weight", None)
        if cache and isinstance(weight, torch.Tensor):
            head.weight(weight)
        logger.info(
            "--enable-fp32-lm-head: the LM head computes in float32 (%s)",
            f"a float32 copy of its weights, {head.nbytes / 2**20:.1f} MiB"
            if cache
            else "its weights widened at each step",
        )
        return head

    def _prepack_wanted(self) -> bool:
        """Packed weight copies (with the small-batch and brgemm kernels) serve CPU runs, not
        in deterministic mode nor with --disable-cpu-weight-prepack."""
        args = self.server_args
        return (
            torch.device(self.device).type == "cpu"
            and not args.enable_deterministic_inference
            and not args.disable_cpu_weight_prepack
            and prepack_supported()
        )

    def _enable_prepack(self) -> list[PackedLinear]:
        """oneDNN-packed weight copies for the linear layers on CPU (layers/cpu_prepack.py);
        not in deterministic mode, whose batch-invariant product must stay in place."""
        if not self._prepack_wanted():
            return []
        args = self.server_args
        upcast = self.dtype == torch.bfloat16 and (
            args.cpu_bf16_linear == "fp32"
            or (args.cpu_bf16_linear == "auto" and not native_bf16_supported())
        )
        if self.dtype == torch.bfloat16 and not upcast and not native_bf16_supported():
            logger.warning(
                "--cpu-bf16-linear bf16 on a CPU without native bfloat16 (no AVX512-BF16 or "
                "AMX): oneDNN cannot pack bfloat16 weights here, so the linear layers above %d "
                "rows use torch's emulated bfloat16 product (--cpu-bf16-linear auto is faster)",
                small_linear_max_rows(),
            )
        packers = enable_cpu_weight_prepack(self.model, upcast_bf16=upcast)
        # The small-batch and brgemm kernels are loaded by now (_build_cpu_kernels): packing
        # lays float32 copies out for the brgemm kernel where it is there.
        nbytes = pack_now(self.model)
        logger.info(
            "CPU weight prepack: %d linear layers (%d in brgemm column blocks, the rest in "
            "oneDNN's layout), %.1f MiB of packed %s copies (--disable-cpu-weight-prepack saves "
            "it)",
            len(packers),
            sum(p.blocked for p in packers),
            nbytes / 2**20,
            " and ".join(sorted({
                str(p.packed_dtype).removeprefix("torch.") for p in packers if p.packed_dtype
            })) or "no",
        )
        return packers

    def _kv_bytes_per_token(self) -> int:
        cfg = self.model_config
        return MHATokenToKVPool.bytes_per_token(
            self.dtype, self.num_kv_heads, cfg.head_dim, cfg.num_hidden_layers
        )

    def _kv_pool_size(self) -> int:
        """Tokens in this rank's KV pool: --max-total-tokens, else a fraction of free memory
        (the ranks then agree on the minimum)."""
        size = self.server_args.max_total_tokens
        if size is None:
            fraction = self.server_args.mem_fraction_static
            if self.device == "cuda":
                free, total = torch.cuda.mem_get_info()
                budget = free - total * (1 - (fraction or _DEFAULT_CUDA_MEM_FRACTION))
                budget -= self._graph_reserve
            else:
                import psutil

                budget = psutil.virtual_memory().available * (fraction or _DEFAULT_CPU_KV_FRACTION)
            # Agreed before the check, so that every rank raises (none waits on the others).
            size = tensor_model_parallel_min(int(budget // self._kv_bytes_per_token()))
            if size < 16:
                raise RuntimeError(
                    "Not enough memory for the KV cache; lower the model size or set "
                    "--max-total-tokens / --mem-fraction-static"
                )
        return size // self.page_size * self.page_size

    def forward(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        """Logits of ``forward_batch`` (writing its K/V): replayed from a CUDA graph when the
        graph runner takes the batch, else eagerly."""
        if self.graph_runner is not None and self.graph_runner.can_run(forward_batch):
            with torch.inference_mode():
                return self.graph_runner.run(forward_batch)
        return self._forward_eager(forward_batch)

    @torch.inference_mode()
    def _forward_eager(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        forward_batch.token_to_kv_pool = self.token_to_kv_pool
        forward_batch.attn_backend = self.attn_backend
        self.attn_backend.init_forward_metadata(forward_batch)
        if self.compiled_layers is not None:
            self.compiled_layers.prepare(forward_batch)
        if self._malloc_cap is not None:
            self._malloc_cap.step()
        if self.cpu_decode_loop is not None and self.cpu_decode_loop.applies(forward_batch):
            return self.cpu_decode_loop.forward(forward_batch)
        recorder = self.routing_recorder
        if recorder is not None:
            forward_batch.records_routing = True
            recorder.begin(forward_batch.num_tokens, forward_batch.input_ids.device)
        out = self.model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch)
        if recorder is not None:
            recorder.commit(forward_batch.out_cache_loc)
        return out

    def _init_routing_recorder(self, model_config: ModelConfig) -> RoutedExpertsRecorder | None:
        """The recorder of --enable-return-routed-experts, attached to every MoE block; None
        when the flag is off. ValueError for a model without MoE blocks."""
        if not self.server_args.enable_return_routed_experts:
            return None
        blocks = [m for m in self.model.modules() if isinstance(m, SparseMoE)]
        if not blocks:
            raise ValueError(
                "--enable-return-routed-experts needs a mixture-of-experts model; "
                f"{type(self.model).__name__} has no MoE layers"
            )
        num_slots = self.token_to_kv_pool.num_slots
        recorder = RoutedExpertsRecorder(
            num_slots, model_config.num_hidden_layers, blocks[0].top_k
        )
        for block in blocks:
            block.recorder = recorder
        logger.info(
            "Recording routed experts: %.1f MiB for %d KV slots",
            recorder.host.numel() * 4 / 2**20,
            num_slots,
        )
        return recorder

    def routed_experts(self, slots: torch.Tensor) -> str:
        """The recorded experts of the tokens in KV ``slots`` (in order), as upstream returns
        them: base64 of int32 ``[len(slots), num_hidden_layers, top_k]``. RuntimeError when
        the server does not record them (the request validation refuses such requests)."""
        if self.routing_recorder is None:
            raise RuntimeError("routed experts are not recorded (--enable-return-routed-experts)")
        return base64.b64encode(self.routing_recorder.read(slots)).decode("ascii")

    def cuda_graph_state(self) -> dict[str, Any]:
        """For get_internal_state: the captured decode batch sizes (empty while released or
        without graphs) and the numbers of decode and prefill steps replayed from them so far."""
        runner = self.graph_runner
        if runner is None:
            return {
                "enabled": False,
                "captured_batch_sizes": [],
                "replays": 0,
                "prefill_replays": 0,
            }
        return {
            "enabled": True,
            "captured_batch_sizes": runner.batch_sizes if runner.captured else [],
            "replays": runner.num_replays,
            "prefill_replays": runner.num_prefill_replays,
        }

    # ---- release_memory_occupation / resume_memory_occupation (docs/memory.md) --------------
    def release_cuda_graph(self) -> None:
        """Drop the captured graphs (before the weights or KV they read are freed); decode
        runs eagerly until :meth:`resume_cuda_graph`."""
        if self.graph_runner is not None:
            self.graph_runner.release()

    def resume_cuda_graph(self) -> None:
        """Capture the graphs again (the weights and KV pool are allocated)."""
        if self.graph_runner is not None:
            self.graph_runner.capture()

    def release_kv_cache(self) -> None:
        """Free the KV buffers and whatever the attention backend derived from them. The
        caller has freed every slot (a flush); nothing runs until :meth:`resume_kv_cache`."""
        self.attn_backend.release_memory()
        self.token_to_kv_pool.release()
        return_freed_memory()

    def resume_kv_cache(self) -> None:
        self.token_to_kv_pool.resume()

    def release_weights(self) -> None:
        """Free every parameter's storage (the Parameter objects, their shapes and weight
        loaders stay); nothing runs until :meth:`resume_weights`."""
        for packer in self.weight_packers:
            packer.clear()
        if self.fp32_head is not None:
            self.fp32_head.clear()
        for name, param in self.model.named_parameters():
            self._released_shapes[name] = param.shape
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        return_freed_memory()

    def resume_weights(self) -> None:
        """Allocate the parameters again, zero-filled: the caller reloads or pushes weights."""
        for name, param in self.model.named_parameters():
            shape = self._released_shapes.pop(name, None)
            if shape is not None:
                param.data = torch.zeros(shape, dtype=param.dtype, device=param.device)
