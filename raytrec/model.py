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

__all__ = ["ModelFactory", "build_dlrm", "embedding_bag_configs"]

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


def build_dlrm(cfg: ModelConfig, num_dense: int, device: torch.device, seed: int) -> nn.Module:
    """``DLRMTrain`` around DLRM or DLRM-DCN, embeddings on ``meta``, dense on ``device``."""
    ebc = EmbeddingBagCollection(tables=embedding_bag_configs(cfg), device=torch.device("meta"))
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
    return DLRMTrain(model)
