"""Preallocated pools: the request -> KV-slot table and the per-layer K/V tensors.

Slot 0 of the KV pool is a dummy that is never handed out: padded index tensors point at it, so
gathers over padding read finite zeros instead of garbage.
"""

from __future__ import annotations

import torch

from sglang.srt.layers import cpu_fused_ops


class ReqToTokenPool:
    """``req_to_token[row, i]`` is the KV slot of token i of the request living in ``row``.

    Owner of the rows: the scheduler allocates one row per admitted request and frees it when the
    request leaves the running set (finish, abort, retract). ``size`` rows are handed out; one
    more, :attr:`padding_row`, never is: the padding rows of a padded decode batch (CUDA graphs)
    use it, its entries all 0 (the allocator's reserved padding slot).
    """

    def __init__(self, size: int, max_context_len: int, device: str) -> None:
        self.size = size
        self.padding_row = size
        self.max_context_len = max_context_len
        self.device = device
        self.req_to_token = torch.zeros(
            (size + 1, max_context_len), dtype=torch.int64, device=device
        )
        self._free_rows: list[int] = list(range(size))
        # Bumped whenever a row is handed out or rewritten through alloc/write/clear: whoever
        # keeps data derived from a row's KV (the CPU decode mirror) may reuse it while the
        # row's epoch is unchanged. Decode appends (one slot per step) do not bump it.
        self.row_epochs: list[int] = [0] * (size + 1)

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self, num_rows: int) -> list[int] | None:
        """Take ``num_rows`` free rows, or return None (and take nothing) if too few are free."""
        if num_rows > len(self._free_rows):
            return None
        rows, self._free_rows = self._free_rows[:num_rows], self._free_rows[num_rows:]
        for row in rows:
            self.row_epochs[row] += 1
        return rows

    def free(self, rows: int | list[int]) -> None:
        """Give rows back. Their contents are stale from now on."""
        self._free_rows.extend([rows] if isinstance(rows, int) else rows)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Record ``slots`` as the KV slots of tokens ``start .. start+len(slots)-1`` of ``row``."""
        self.req_to_token[row, start : start + slots.numel()] = slots
        self.row_epochs[row] += 1

    def clear(self) -> None:
        self._free_rows = list(range(self.size))
        self.row_epochs = [epoch + 1 for epoch in self.row_epochs]


class MHATokenToKVPool:
    """K and V tensors of every layer, ``[num_slots, num_kv_heads, head_dim]`` each.

    ``num_slots == size + page_size``: the first page (slot 0 included) is reserved as padding.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: str,
    ) -> None:
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.head_num = head_num
        self.head_dim = head_dim
        self.layer_num = layer_num
        self.device = device
        # Set by the model runner once the CPU fused kernels are built (cpu_fused_ops.py).
        self.use_cpu_fused_ops = False
        # Set by the model runner on CUDA: K and V stored by one Triton kernel.
        self.use_triton_store = False
        self.k_buffer: list[torch.Tensor] = []
        self.v_buffer: list[torch.Tensor] = []
        self.resume()

    @property
    def num_slots(self) -> int:
        """Slots of each layer's buffers: ``size`` plus the reserved first page."""
        return self.size + self.page_size

    def resume(self) -> None:
        """(Re)allocate the buffers; their slots hold no KV (after release: all slots free)."""
        shape = (self.num_slots, self.head_num, self.head_dim)
        # torch.empty leaves the pages untouched, so the unused part of a large pool costs no
        # resident memory. Only the reserved first page is ever read before being written (it
        # pads gathers), so only it is zeroed.
        self.k_buffer = [self._empty(shape) for _ in range(self.layer_num)]
        self.v_buffer = [self._empty(shape) for _ in range(self.layer_num)]
        for buf in self.k_buffer + self.v_buffer:
            buf[: self.page_size].zero_()

    def prefault(self, num_slots: int) -> int:
        """Write zeros to the first ``num_slots`` slots of every layer's buffers (clamped to the
        pool), so that their pages are in memory before the first request writes them
        (model_executor/warmup.py); returns the bytes touched. Precondition: no request holds
        KV (start-up): the slots' contents are lost."""
        touched = 0
        for buf in self.k_buffer + self.v_buffer:
            touched += buf[:num_slots].zero_().nbytes
        return touched

    def release(self) -> None:
        """Free the buffers (release_memory_occupation); the caller has freed every slot, and
        nothing reads the pool until :meth:`resume`."""
        self.k_buffer, self.v_buffer = [], []

    def _empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(
        self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor
    ) -> None:
        """Write ``cache_k/v`` (``[T, head_num, head_dim]``) at slots ``loc`` (``[T]`` int64,
        distinct slots)."""
        k_buf, v_buf = self.k_buffer[layer_id], self.v_buffer[layer_id]
        if (
            self.use_cpu_fused_ops
            and cpu_fused_ops.supports(k_buf)
            and loc.dtype == torch.int64
            and cache_k.dtype == cache_v.dtype == self.dtype
            and cache_k.stride(-1) == cache_v.stride(-1) == 1
            and cache_k.stride(-2) == cache_v.stride(-2) == self.head_dim
        ):
            # One C++ call for both (index_copy_ costs ~15-80 us a call, the store ~1-3 us).
            cpu_fused_ops.store_kv(k_buf, v_buf, loc, cache_k, cache_v)
            return
        if self.use_triton_store:
            from sgl_kernel import fused_elementwise  # triton: loaded where it is used

            fused_elementwise.store_kv(k_buf, v_buf, loc, cache_k, cache_v)
            return
        # index_copy_ rather than advanced-index assignment: about half the CPU time per call.
        self.k_buffer[layer_id].index_copy_(0, loc, cache_k.to(self.dtype))
        self.v_buffer[layer_id].index_copy_(0, loc, cache_v.to(self.dtype))

    @staticmethod
    def bytes_per_token(dtype: torch.dtype, head_num: int, head_dim: int, layer_num: int) -> int:
        """Memory one token's K and V take over all layers (used to size the pool)."""
        return 2 * head_num * head_dim * layer_num * torch.empty((), dtype=dtype).element_size()
