"""The grammar rows of a batch: fill their bitmasks from the matchers, mask their logits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sglang.srt.constrained.base_grammar_backend import GrammarMatcher
from sglang.srt.constrained.bitmask import apply_token_bitmask


@dataclass
class GrammarBatch:
    """Rows ``rows`` of a batch follow ``matchers`` (in that order). Built with the batch's
    SamplingBatchInfo; the matchers belong to the requests and advance as tokens commit."""

    matchers: tuple[GrammarMatcher, ...]
    rows: torch.Tensor  # [G] int64 on the batch's device
    bitmask: torch.Tensor  # [G, ceil(V / 32)] int32 on the CPU, refilled every step

    @classmethod
    def build(
        cls, matchers: Sequence[GrammarMatcher | None], vocab_size: int, device: torch.device
    ) -> GrammarBatch | None:
        """The batch's grammar rows (``matchers`` has one entry per row); None when no row has
        a grammar."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        return cls(
            matchers=tuple(m for m in matchers if m is not None),
            rows=torch.tensor(rows, dtype=torch.int64, device=device),
            bitmask=torch.empty(len(rows), (vocab_size + 31) // 32, dtype=torch.int32),
        )

    def apply(self, logits: torch.Tensor) -> None:
        """Set every token that a row's grammar does not allow next to -inf, IN PLACE. Runs
        each matcher on the host (before the step's sampling, after the last commit)."""
        for i, matcher in enumerate(self.matchers):
            matcher.fill_bitmask(self.bitmask, i)
        apply_token_bitmask(logits, self.bitmask.to(logits.device), self.rows)
