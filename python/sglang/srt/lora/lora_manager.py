"""LoRAManager: the adapters the server has loaded (host memory) and the device slots they run
from.

* ``prepare`` reads and checks a PEFT checkpoint completely (rank, target modules, every
  shape against the full base model) and keeps this tensor-parallel rank's slice of it
  (:meth:`LoRATarget.local_weights`); only ``commit`` then adds or replaces the adapter, so
  a refusal changes nothing and the ranks can agree on it in between.
* ``prepare_batch`` puts the adapters of one step into slots (least recently used slot whose
  adapter the step does not use is overwritten) and groups the step's rows by slot for the
  hooks (:mod:`sglang.srt.lora.layers`). The scheduler never runs a step with more distinct
  adapters than there are slots (``--max-loras-per-batch``), so a step always fits. Slot
  choice and LRU order depend only on the loads, unloads and steps, which every TP rank sees
  alike, so every rank puts each adapter in the same slot.
* Every load gets a fresh ``uid``: the prefix cache keys adapter KV by it, so KV computed under
  an adapter's previous weights is never matched once the adapter is reloaded.

Owned by the model worker (the scheduler process), driven by the Scheduler core.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from sglang.srt.lora.adapter import (
    PROJ_TO_MODULE,
    LoRAAdapter,
    LoRAError,
    build_adapter,
    check_adapter_config,
    load_adapter,
    normalize_target_modules,
    read_adapter_config,
)
from sglang.srt.lora.layers import LoRABatchInfo, LoRATarget, find_targets
from sglang.srt.lora.triton_ops import build_lora_segments, triton_lora_available

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

DEFAULT_MAX_LORA_RANK = 64


@dataclass
class LoadedLoRA:
    """A loaded adapter as the rest of the server sees it."""

    adapter: LoRAAdapter
    uid: int  # fresh per load: the prefix-cache namespace of its KV
    version: str  # label of its weights (weight_version / weight_versions of its outputs)
    num_loads: int


class LoRAManager:
    def __init__(self, model: nn.Module, server_args: ServerArgs) -> None:
        self.num_slots = server_args.max_loras_per_batch
        self.max_loaded = server_args.max_loaded_loras
        self.target_modules = normalize_target_modules(server_args.lora_target_modules)
        initial = server_args.lora_path_dict()
        self.max_rank = server_args.max_lora_rank or _largest_rank(initial.values())
        kinds = {PROJ_TO_MODULE[p][0] for p in self.target_modules}
        self.batch: LoRABatchInfo | None = None
        self.targets: dict[tuple[int, str], LoRATarget] = {}
        for _, module, layer, kind in find_targets(model):
            if kind in kinds:
                self.targets[(layer, kind)] = LoRATarget(
                    module,
                    layer,
                    kind,
                    self.num_slots,
                    self.max_rank,
                    lambda: self.batch,
                    batch_invariant=server_args.enable_deterministic_inference,
                )
        if not self.targets:
            raise ValueError("--enable-lora: the model has no projection LoRA can adapt")
        first = next(iter(self.targets.values()))
        self.dtype = first.A.dtype
        # The segment-grouped Triton kernels on CUDA; the torch path elsewhere and in
        # deterministic mode (the kernels' row tiles depend on the batch).
        self.use_triton_kernels = (
            first.A.device.type == "cuda"
            and not server_args.enable_deterministic_inference
            and triton_lora_available(first.A.device)
        )
        self.loaded: dict[str, LoadedLoRA] = {}
        self._uids = itertools.count(1)
        self.slot_names: list[str | None] = [None] * self.num_slots
        self.slot_uids: list[int] = [0] * self.num_slots
        self._slot_used = [0] * self.num_slots
        self._clock = 0
        for name, path in initial.items():
            self.load(name, path)

    # ---- the registry ------------------------------------------------------------------------
    def load(
        self,
        name: str,
        path: str,
        version: str | None = None,
        tensors: dict[str, torch.Tensor] | None = None,
        config: dict | None = None,
    ) -> LoadedLoRA:
        """:meth:`prepare` then :meth:`commit` (one process, or start-up: a rank that fails
        there fails the start)."""
        return self.commit(self.prepare(name, path, tensors, config), version)

    def prepare(
        self,
        name: str,
        path: str,
        tensors: dict[str, torch.Tensor] | None = None,
        config: dict | None = None,
    ) -> LoRAAdapter:
        """Read and check the adapter at ``path``, or the one given as PEFT-named ``tensors``
        (every rank gets them whole) and its adapter ``config`` (``path`` then only labels
        it), and keep this rank's slice of it. Changes nothing: with tensor parallelism the
        ranks agree on the verdict before any of them commits. LoRAError when it cannot be
        served, or when ``--max-loaded-loras`` adapters are loaded already."""
        if not name or not isinstance(name, str):
            raise LoRAError("lora_name must be a non-empty string")
        if name not in self.loaded and self.max_loaded and len(self.loaded) >= self.max_loaded:
            raise LoRAError(
                f"{len(self.loaded)} adapters are loaded (--max-loaded-loras "
                f"{self.max_loaded}); unload one first"
            )
        if tensors is None:
            adapter = load_adapter(name, path, self.max_rank, self.target_modules)
        else:
            checked = check_adapter_config(config, path)
            adapter = build_adapter(
                name, path, checked, tensors, self.max_rank, self.target_modules
            )
        self._check_shapes(adapter)
        return self._local_slice(adapter)

    def commit(self, adapter: LoRAAdapter, version: str | None = None) -> LoadedLoRA:
        """Add ``adapter`` (from :meth:`prepare`), or replace the one of its name; its slot,
        if any, is cleared (the next step that uses it copies the new weights in)."""
        name = adapter.name
        prev = self.loaded.get(name)
        num_loads = 1 if prev is None else prev.num_loads + 1
        entry = LoadedLoRA(adapter, next(self._uids), version or str(num_loads), num_loads)
        self.loaded[name] = entry
        self._drop_slot(name)
        logger.info("LoRA adapter %r loaded from %s (rank %d)", name, adapter.path, adapter.rank)
        return entry

    def unload(self, name: str) -> None:
        if name not in self.loaded:
            raise LoRAError(f"LoRA adapter {name!r} is not loaded")
        del self.loaded[name]
        self._drop_slot(name)

    def uid(self, name: str | None) -> int:
        """Prefix-cache namespace of ``name``'s current weights (0: the base model)."""
        return 0 if name is None else self.loaded[name].uid

    def version(self, name: str) -> str:
        return self.loaded[name].version

    def describe(self) -> list[dict]:
        """The loaded adapters, for get_server_info / get_loaded_lora_adapters."""
        return [
            {
                "lora_name": name,
                "lora_path": e.adapter.path,
                "rank": e.adapter.rank,
                "target_modules": list(e.adapter.target_modules),
                "weight_version": e.version,
                "slot": self.slot_names.index(name) if name in self.slot_names else None,
            }
            for name, e in self.loaded.items()
        ]

    def _check_shapes(self, adapter: LoRAAdapter) -> None:
        for layer, proj in adapter.weights:
            kind, shard = PROJ_TO_MODULE[proj]
            target = self.targets.get((layer, kind))
            if target is None:
                raise LoRAError(
                    f"adapter {adapter.name!r} adapts layer {layer} {proj}, which the base "
                    "model does not have (or --lora-target-modules excludes)"
                )
            target.check(adapter, proj, shard)

    def _local_slice(self, adapter: LoRAAdapter) -> LoRAAdapter:
        """``adapter`` (full weights, checked) reduced to this tensor-parallel rank's slice of
        every weight (the whole adapter with one rank)."""
        weights = {}
        for (layer, proj), (a, b) in adapter.weights.items():
            kind, shard = PROJ_TO_MODULE[proj]
            weights[(layer, proj)] = self.targets[(layer, kind)].local_weights(shard, a, b)
        return replace(adapter, weights=weights)

    def _drop_slot(self, name: str) -> None:
        if name in self.slot_names:
            slot = self.slot_names.index(name)
            self.slot_names[slot] = None
            self.slot_uids[slot] = 0
            for target in self.targets.values():
                target.write_slot(slot, None)

    # ---- one step ----------------------------------------------------------------------------
    def prepare_batch(self, forward_batch: ForwardBatch) -> None:
        """Slots for the step's adapters, and its rows grouped by slot (None: base only)."""
        names = forward_batch.lora_names
        if not names or all(n is None for n in names):
            self.batch = None
            return
        self._clock += 1
        wanted = {n for n in names if n is not None}
        slot_of = {n: self._slot_for(n, wanted) for n in wanted}
        lens = forward_batch.extend_seq_lens_cpu
        if None not in names and len(wanted) == 1:
            self.batch = LoRABatchInfo([(slot_of[names[0]], None)])  # type: ignore[index]
            return
        slot_list = [-1 if n is None else slot_of[n] for n in names]
        device = forward_batch.input_ids.device
        if self.use_triton_kernels:
            starts = itertools.accumulate(lens, initial=0)
            requests = zip(starts, lens, slot_list)
            self.batch = LoRABatchInfo([], segments=build_lora_segments(requests, device))
            return
        token_slots = torch.repeat_interleave(torch.tensor(slot_list), torch.tensor(lens))
        groups: list[tuple[int, torch.Tensor | None]] = []
        for slot in sorted(set(slot_of.values())):
            rows = torch.nonzero(token_slots == slot).squeeze(1).to(device)
            groups.append((slot, rows))
        self.batch = LoRABatchInfo(groups, _padded(groups, device, self.dtype))

    def finish_batch(self) -> None:
        self.batch = None

    def _slot_for(self, name: str, wanted: set[str]) -> int:
        entry = self.loaded.get(name)
        if entry is None:
            raise LoRAError(f"LoRA adapter {name!r} is not loaded")
        if name in self.slot_names:
            slot = self.slot_names.index(name)
        else:
            free = [i for i, n in enumerate(self.slot_names) if n is None]
            evictable = [i for i, n in enumerate(self.slot_names) if n not in wanted]
            if not free and not evictable:
                raise RuntimeError("more adapters in one step than --max-loras-per-batch slots")
            slot = free[0] if free else min(evictable, key=lambda i: self._slot_used[i])
            for target in self.targets.values():
                target.write_slot(slot, entry.adapter)
            self.slot_names[slot] = name
            self.slot_uids[slot] = entry.uid
        self._slot_used[slot] = self._clock
        return slot


def _largest_rank(paths: Iterable[str]) -> int:
    """The largest ``r`` among the adapters at ``paths`` (DEFAULT_MAX_LORA_RANK if none)."""
    ranks = [read_adapter_config(Path(p)).get("r") for p in paths]
    return max((r for r in ranks if isinstance(r, int)), default=DEFAULT_MAX_LORA_RANK)


def _padded(
    groups: list[tuple[int, torch.Tensor | None]], device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]] | None:
    """The ``[G, n_max]`` form of ``groups`` (LoRABatchInfo.padded) when several groups of
    similar sizes make it cheaper than one pass per group (at most half of it padding)."""
    sizes = [0 if rows is None else rows.numel() for _, rows in groups]
    n_max = max(sizes)
    if len(groups) < 2 or n_max * len(groups) > 2 * sum(sizes):
        return None
    rows_list, mask_list = [], []
    for (_, rows), n in zip(groups, sizes):
        assert rows is not None
        rows_list.append(torch.cat([rows, rows[:1].expand(n_max - n)]))
        mask_list.append(torch.cat([torch.ones(n), torch.zeros(n_max - n)]))
    slot_list = [slot for slot, _ in groups]
    return (
        torch.cat(rows_list),
        torch.cat(mask_list).unsqueeze(1).to(device=device, dtype=dtype),
        torch.tensor(slot_list, device=device),
        slot_list,
    )
