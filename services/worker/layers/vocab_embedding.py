"""Token embedding and LM head, with weight-loader hooks like the linear layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.layers.linear import linear


class VocabEmbedding(nn.Module):
    """input_ids [num_tokens] -> [num_tokens, hidden_size]; weight is [vocab_size, hidden_size]."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if param.shape != loaded_weight.shape:
            raise ValueError(
                f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, "
                f"expected {tuple(param.shape)}"
            )
        param.data.copy_(loaded_weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, hidden_size={self.hidden_size}"


class LMHead(VocabEmbedding):
    """hidden [num_rows, hidden_size] -> logits [num_rows, vocab_size] float32.

    `tie_to(embedding)` shares the embedding's weight (tie_word_embeddings).
    """

    def tie_to(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return linear(hidden_states, self.weight).float()
