"""A two-tower retrieval model over TorchRec's embedding collection.

The user tower reads the dense features and the pooled embeddings of ``model.user_features``;
the item tower reads those of every other feature; each is an MLP whose last layer is linear
and gives the vector the dot product is taken over. One ``EmbeddingBagCollection`` holds both
towers' tables (each table serves one tower), so TorchRec shards them as any other model's and
one lookup per step serves both towers.

:class:`TwoTowerTrain` is the training module (as TorchRec's ``DLRMTrain`` is for DLRM): the
in-batch softmax (each positive row's item scored against every item of the local batch) or a
pointwise logistic loss on explicit negatives. Its logits for the metrics are each row's own
score, ``user · item``. TorchRec's retrieval example keeps its towers outside the library, so
they are written here from TorchRec's modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.mlp import MLP
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from raytrec.config import ModelConfig
from raytrec.data.source import Batch

__all__ = ["TwoTower", "TwoTowerTrain"]


def _tower(in_features: int, layers: list[int], device: torch.device | None) -> nn.Module:
    """Hidden layers with ReLU (TorchRec's MLP), then a linear layer to the output vector."""
    if len(layers) == 1:
        return nn.Linear(in_features, layers[0], device=device)
    return nn.Sequential(
        MLP(in_features, layers[:-1], device=device),
        nn.Linear(layers[-2], layers[-1], device=device),
    )


class TwoTower(nn.Module):
    """``forward(dense, kjt)`` gives each row's score ``[B, 1]``: the dot product of its user
    and item vectors (:meth:`towers`)."""

    def __init__(
        self,
        *,
        embedding_bag_collection: EmbeddingBagCollection,
        num_dense: int,
        user_features: list[str],
        tower_layers: list[int],
        dense_device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.embedding_bag_collection = embedding_bag_collection
        dims = {
            f: c.embedding_dim
            for c in embedding_bag_collection.embedding_bag_configs()
            for f in c.feature_names
        }
        self.user_features = [f for f in dims if f in user_features]
        self.item_features = [f for f in dims if f not in user_features]
        user_width = num_dense + sum(dims[f] for f in self.user_features)
        item_width = sum(dims[f] for f in self.item_features)
        self.user_tower = _tower(user_width, tower_layers, dense_device)
        self.item_tower = _tower(item_width, tower_layers, dense_device)

    def towers(
        self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's user vector and item vector, ``[B, D]`` each."""
        pooled = self.embedding_bag_collection(sparse_features).to_dict()
        user = torch.cat([dense_features, *(pooled[f] for f in self.user_features)], dim=1)
        item = torch.cat([pooled[f] for f in self.item_features], dim=1)
        return self.user_tower(user), self.item_tower(item)

    def forward(
        self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor
    ) -> torch.Tensor:
        user, item = self.towers(dense_features, sparse_features)
        return (user * item).sum(dim=1, keepdim=True)


class TwoTowerTrain(nn.Module):
    """``forward(batch)`` gives ``(loss, (loss, logits, labels))``, as TorchRec's ``DLRMTrain``;
    the logits are each row's own score."""

    def __init__(self, model: TwoTower, *, loss: str, temperature: float) -> None:
        super().__init__()
        self.model = model
        self.loss = loss
        self.temperature = temperature

    def forward(
        self, batch: Batch
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        user, item = self.model.towers(batch.dense_features, batch.sparse_features)
        labels = batch.labels.reshape(-1).float()
        logits = (user * item).sum(dim=1)
        if self.loss == "logistic":
            loss = F.binary_cross_entropy_with_logits(logits, labels)
        else:
            loss = in_batch_softmax(user, item, labels, temperature=self.temperature)
        return loss, (loss.detach(), logits.detach(), labels.detach())


def in_batch_softmax(
    user: torch.Tensor, item: torch.Tensor, labels: torch.Tensor, *, temperature: float
) -> torch.Tensor:
    """The mean cross-entropy of each positive row's own item among every item of the batch
    (scores divided by ``temperature``). A batch without positives gives a zero loss that
    still reaches every parameter (so every rank takes part in the same collectives)."""
    scores = user @ item.T / temperature
    positive = labels > 0.5
    if not bool(positive.any()):
        return scores.sum() * 0.0
    rows = torch.nonzero(positive).reshape(-1)
    return F.cross_entropy(scores[rows], rows)


def build_two_tower(
    cfg: ModelConfig, num_dense: int, ebc: EmbeddingBagCollection, device: torch.device
) -> TwoTower:
    return TwoTower(
        embedding_bag_collection=ebc,
        num_dense=num_dense,
        user_features=list(cfg.user_features),
        tower_layers=list(cfg.tower_layers),
        dense_device=device,
    )
