"""Token embedding and LM head, split over the tensor-parallel group by vocabulary range.

The vocabulary is padded to a multiple of tp and cut into contiguous equal ranges; rank r
holds rows ``[r*n, (r+1)*n)`` (``n = ceil(vocab / tp)``; rows past the real vocabulary are
zero padding)::

    vocab 10, tp 4:  n = 3    rank 0: 0..2   rank 1: 3..5   rank 2: 6..8   rank 3: 9 + 2 pad

One rank is exactly the unsplit embedding (no padding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.distributed.parallel_state import get_tp_group
from sglang.srt.layers.linear import ShardedWeightLoader, TPShard, set_weight_loader


def vocab_range(num_embeddings: int, rank: int, tp_size: int) -> tuple[int, int, int]:
    """``(start, end, rows_per_rank)``: rank ``rank`` holds token ids ``[start, end)``."""
    per_rank = -(-num_embeddings // tp_size)
    start = min(rank * per_rank, num_embeddings)
    return start, min(start + per_rank, num_embeddings), per_rank


class VocabParallelEmbedding(nn.Module):
    """``weight[input_ids]``; the rank's weight is ``[ceil(vocab / tp), embedding_dim]``.

    Each rank looks up the ids in its range (zeros for the others) and the ranks' results are
    summed: exactly one rank contributes each row, so the sum is the embedding itself.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        super().__init__()
        group = get_tp_group()
        self.tp_rank = group.rank if tp_rank is None else tp_rank
        self.tp_size = group.world_size if tp_size is None else tp_size
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.vocab_start, self.vocab_end, per_rank = vocab_range(
            num_embeddings, self.tp_rank, self.tp_size
        )
        self.num_embeddings_per_partition = per_rank
        self.num_embeddings_padded = per_rank * self.tp_size
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim), requires_grad=False)
        starts = tuple(vocab_range(num_embeddings, r, self.tp_size)[0] for r in range(self.tp_size))
        shard = TPShard(0, per_rank, num_embeddings, starts)
        set_weight_loader(self.weight, ShardedWeightLoader(0, {None: shard}, self.tp_rank))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings ``[*input_ids.shape, embedding_dim]``; ids must be in range."""
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(~in_range, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(~in_range.unsqueeze(-1), 0.0)
        return get_tp_group().all_reduce(out.contiguous())

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_size}, "
            f"rows=[{self.vocab_start}, {self.vocab_end})"
        )


# The unsplit name this engine used before tensor parallelism.
VocabEmbedding = VocabParallelEmbedding


class ParallelLMHead(VocabParallelEmbedding):
    """Holds this rank's ``[ceil(vocab / tp), hidden]`` slice of the output projection;
    LogitsProcessor multiplies by it and gathers the full vocabulary.

    Not called directly: logits are computed only for the rows that need them. With
    ``tie_word_embeddings`` a model uses its embedding as the head instead of this class
    (same split, so the same slice).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        bias: bool = False,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        if bias:
            raise ValueError("an LM head bias is not supported")
        super().__init__(num_embeddings, embedding_dim, tp_rank, tp_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is applied by LogitsProcessor, not called")
