"""Custom weight loaders for the ``--custom-weight-loader`` tests: importable as
``compat_weight_loaders.<name>`` from the test directory (the tests put it on PYTHONPATH of
the servers they start)."""

from __future__ import annotations

import torch


def load_doubled(model: torch.nn.Module, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Upstream's call shape: the model and the (name, tensor) pairs. Loads every tensor times
    two through the model's own (partial) ``load_weights``, as SkyRL's loader does."""
    model.load_weights([(name, tensor * 2) for name, tensor in named_tensors])


def load_failing(model: torch.nn.Module, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    raise RuntimeError("this loader always fails")


NOT_CALLABLE = 42
