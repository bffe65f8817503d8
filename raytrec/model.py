"""Model factories: TorchRec's DLRM and DLRM-DCN from raytrec table configs.

A model factory returns a module whose ``forward(batch)`` gives
``(loss, (loss, logits, labels))`` the way ``torchrec.models.dlrm.DLRMTrain``
does, with its ``EmbeddingBagCollection`` on the ``meta`` device so that
``DistributedModelParallel`` materialises only the local shards. Dense layers
are built on ``device`` from ``seed``, so every rank of the job starts with
the same dense weights.

``ModelConfig.dropout`` adds dropout after the activation of every hidden layer of the dense
and over arch (TorchRec's MLPs take none): as a module inside each ``Perceptron``'s
activation, so the parameter names, the state dict and a saved model are those of the model
without dropout, and ``model.eval()`` turns it off for evaluation, export and serving.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.mlp import MLP, Perceptron

from raytrec.config import ModelConfig

__all__ = [
    "ModelFactory",
    "add_dropout",
    "build_dlrm",
    "build_dlrm_model",
    "embedding_bag_configs",
]

# (model config, number of dense features, dense device, seed) -> train module
ModelFactory = Callable[[ModelConfig, int, torch.device, int], nn.Module]


def embedding_bag_configs(cfg: ModelConfig) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=t.name,
            num_embeddings=t.num_embeddings,
            embedding_dim=t.embedding_dim,
            feature_names=list(t.features),
            pooling=PoolingType[t.pooling.upper()],
        )
        for t in cfg.tables
    ]


def build_dlrm_model(
    cfg: ModelConfig,
    num_dense: int,
    device: torch.device,
    seed: int,
    *,
    embedding_device: torch.device | None = None,
) -> DLRM:
    """TorchRec's DLRM or DLRM-DCN (``cfg.arch``): ``forward(dense, kjt)`` gives logits ``[B, 1]``.

    Dense layers on ``device`` from ``seed``; embedding tables on ``embedding_device`` (default
    ``meta``: allocated later, by DistributedModelParallel or a state dict loaded with
    ``assign=True``)."""
    ebc = EmbeddingBagCollection(
        tables=embedding_bag_configs(cfg), device=embedding_device or torch.device("meta")
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: DLRM
        if cfg.arch == "dlrm_dcn":
            model = DLRM_DCN(
                embedding_bag_collection=ebc,
                dense_in_features=num_dense,
                dense_arch_layer_sizes=list(cfg.dense_arch_layers),
                over_arch_layer_sizes=list(cfg.over_arch_layers),
                dcn_num_layers=cfg.dcn_num_layers,
                dcn_low_rank_dim=cfg.dcn_low_rank_dim,
                dense_device=device,
            )
        else:
            model = DLRM(
                embedding_bag_collection=ebc,
                dense_in_features=num_dense,
                dense_arch_layer_sizes=list(cfg.dense_arch_layers),
                over_arch_layer_sizes=list(cfg.over_arch_layers),
                dense_device=device,
            )
    if cfg.dropout:
        add_dropout(model, cfg.dropout)
    return model


class _ActivationThenDropout(nn.Module):
    """A Perceptron's activation followed by dropout (no parameters, no state)."""

    def __init__(self, activation: nn.Module | Callable[[torch.Tensor], torch.Tensor], p: float):
        super().__init__()
        self.activation = activation
        self.dropout = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.activation(x))


def add_dropout(model: DLRM, p: float) -> None:
    """Dropout ``p`` after every hidden layer of ``model``'s dense and over arch: every
    Perceptron of the over arch's MLP (its final Linear makes the logit) and every one of the
    dense arch's but the last (whose output is the dense features' embedding)."""
    dense = _perceptrons(model.dense_arch.model)[:-1]
    over = [p_ for m in model.over_arch.model if isinstance(m, MLP) for p_ in _perceptrons(m)]
    for perceptron in [*dense, *over]:
        perceptron._activation_fn = _ActivationThenDropout(perceptron._activation_fn, p)


def _perceptrons(mlp: nn.Module) -> list[Perceptron]:
    assert isinstance(mlp, MLP), f"TorchRec's DLRM arch holds an MLP, got {type(mlp).__name__}"
    return [m for m in mlp._mlp if isinstance(m, Perceptron)]


def build_dlrm(cfg: ModelConfig, num_dense: int, device: torch.device, seed: int) -> nn.Module:
    """``DLRMTrain`` around DLRM or DLRM-DCN, embeddings on ``meta``, dense on ``device``."""
    return DLRMTrain(build_dlrm_model(cfg, num_dense, device, seed))
