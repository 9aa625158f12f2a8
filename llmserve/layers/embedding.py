"""Token embeddings: a float table, or rows read from a packed LM head's table."""

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class Embedding(nn.Module):
    """Token embedding; its weight doubles as the LM head when embeddings are tied."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim), requires_grad=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)


class PackedEmbedding(nn.Module):
    """Token embedding read from a packed head's table (`embedding_rows`: float rows)."""

    def __init__(self, weight: Any) -> None:
        super().__init__()
        self.table = weight

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.table.embedding_rows(token_ids)  # (T, hidden)
