"""Model factories: TorchRec's DLRM and DLRM-DCN from raytrec table configs.

A model factory returns a module whose ``forward(batch)`` gives
``(loss, (loss, logits, labels))`` the way ``torchrec.models.dlrm.DLRMTrain``
does, with its ``EmbeddingBagCollection`` on the ``meta`` device so that
``DistributedModelParallel`` materialises only the local shards. Dense layers
are built on ``device`` from ``seed``, so every rank of the job starts with
the same dense weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from raytrec.config import ModelConfig

__all__ = ["ModelFactory", "build_dlrm", "build_dlrm_model", "embedding_bag_configs"]

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
        if cfg.arch == "dlrm_dcn":
            return DLRM_DCN(
                embedding_bag_collection=ebc,
                dense_in_features=num_dense,
                dense_arch_layer_sizes=list(cfg.dense_arch_layers),
                over_arch_layer_sizes=list(cfg.over_arch_layers),
                dcn_num_layers=cfg.dcn_num_layers,
                dcn_low_rank_dim=cfg.dcn_low_rank_dim,
                dense_device=device,
            )
        return DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=num_dense,
            dense_arch_layer_sizes=list(cfg.dense_arch_layers),
            over_arch_layer_sizes=list(cfg.over_arch_layers),
            dense_device=device,
        )


def build_dlrm(cfg: ModelConfig, num_dense: int, device: torch.device, seed: int) -> nn.Module:
    """``DLRMTrain`` around DLRM or DLRM-DCN, embeddings on ``meta``, dense on ``device``."""
    return DLRMTrain(build_dlrm_model(cfg, num_dense, device, seed))
