"""Token embedding and the LM head weight (possibly tied to the embedding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.layers.linear import default_weight_loader, set_weight_loader


class VocabEmbedding(nn.Module):
    """``weight[input_ids]`` with ``weight`` of shape ``[num_embeddings, embedding_dim]``."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        set_weight_loader(self.weight, default_weight_loader)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings ``[*input_ids.shape, embedding_dim]``; ids must be in range."""
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class ParallelLMHead(VocabEmbedding):
    """Holds the ``[vocab, hidden]`` output projection; LogitsProcessor multiplies by it.

    Not called directly: logits are computed only for the rows that need them. With
    ``tie_word_embeddings`` a model uses its VocabEmbedding as the head instead of this class.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False) -> None:
        if bias:
            raise ValueError("an LM head bias is not supported")
        super().__init__(num_embeddings, embedding_dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is applied by LogitsProcessor, not called")
