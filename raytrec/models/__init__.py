"""Model factories: TorchRec's DLRM and DLRM-DCN, and a DeepFM of TorchRec's parts.

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
from typing import Any

import torch
from torch import nn
from torchrec.models.deepfm import FMInteractionArch
from torchrec.models.deepfm import SparseArch as DeepFMSparseArch
from torchrec.models.dlrm import DLRM, DLRM_DCN, DenseArch, DLRMTrain, OverArch
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.mlp import MLP, Perceptron
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from raytrec.config import ModelConfig

__all__ = [
    "DeepFM",
    "ModelFactory",
    "add_dropout",
    "build_dlrm",
    "build_dlrm_model",
    "build_model",
    "build_train_model",
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
            data_type=DataType[t.precision.upper()],
        )
        for t in cfg.tables
    ]


class DeepFM(nn.Module):
    """DeepFM (https://arxiv.org/abs/1703.04247) from TorchRec's parts: ``forward(dense, kjt)``
    gives logits ``[B, 1]``.

    The layout of TorchRec's ``SimpleDeepFMNN``: the dense features go through a dense arch to
    one vector, which joins the pooled embeddings in ``FMInteractionArch`` (TorchRec's
    ``DeepFM`` deep part and ``FactorizationMachine``). Two differences: the over arch is
    DLRM's, ending in a logit (``SimpleDeepFMNN`` ends in a sigmoid, which a logit loss would
    apply twice), and tables may have different embedding dims, since both parts flatten the
    embeddings. Without dense features (``num_dense=0``) there is no dense arch and the
    interaction starts from the embeddings alone.
    """

    def __init__(
        self,
        *,
        embedding_bag_collection: EmbeddingBagCollection,
        num_dense: int,
        dense_arch_layers: list[int],
        deep_fm_dimension: int,
        over_arch_layers: list[int],
        dense_device: torch.device | None = None,
    ) -> None:
        super().__init__()
        configs = embedding_bag_collection.embedding_bag_configs()
        features = [f for c in configs for f in c.feature_names]
        sparse_width = sum(c.embedding_dim * len(c.feature_names) for c in configs)
        dense_width = dense_arch_layers[-1] if num_dense else 0
        self.sparse_arch = DeepFMSparseArch(embedding_bag_collection)
        self.dense_arch: nn.Module | None = (
            DenseArch(in_features=num_dense, layer_sizes=dense_arch_layers, device=dense_device)
            if num_dense
            else None
        )
        self.inter_arch = FMInteractionArch(
            fm_in_features=dense_width + sparse_width,
            sparse_feature_names=features,
            deep_fm_dimension=deep_fm_dimension,
        ).to(dense_device)
        self.over_arch = OverArch(
            in_features=dense_width + deep_fm_dimension + 1,
            layer_sizes=over_arch_layers,
            device=dense_device,
        )

    def forward(
        self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor
    ) -> torch.Tensor:
        # Without a dense arch the dense input is [B, 0]: it adds nothing to the concatenations.
        dense = dense_features if self.dense_arch is None else self.dense_arch(dense_features)
        embedded = self.sparse_arch(sparse_features)
        return self.over_arch(self.inter_arch(dense_features=dense, sparse_features=embedded))


def build_model(
    cfg: ModelConfig,
    num_dense: int,
    device: torch.device,
    seed: int,
    *,
    embedding_device: torch.device | None = None,
) -> nn.Module:
    """The model of ``cfg.arch`` (TorchRec's ``DLRM``, ``DLRM_DCN``, or :class:`DeepFM`):
    ``forward(dense, kjt)`` gives logits ``[B, 1]``.

    Dense layers on ``device`` from ``seed``; embedding tables on ``embedding_device`` (default
    ``meta``: allocated later, by DistributedModelParallel or a state dict loaded with
    ``assign=True``). A weighted table makes the collection weighted (``is_weighted``): the
    batches' KeyedJaggedTensor then carries weights."""
    cfg.check_num_dense(num_dense)
    ebc = EmbeddingBagCollection(
        tables=embedding_bag_configs(cfg),
        is_weighted=cfg.is_weighted,
        device=embedding_device or torch.device("meta"),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: nn.Module
        if cfg.arch == "two_tower":
            from raytrec.models.two_tower import build_two_tower

            model = build_two_tower(cfg, num_dense, ebc, device)
        elif cfg.arch == "deepfm":
            model = DeepFM(
                embedding_bag_collection=ebc,
                num_dense=num_dense,
                dense_arch_layers=list(cfg.dense_arch_layers),
                deep_fm_dimension=cfg.deep_fm_dimension,
                over_arch_layers=list(cfg.over_arch_layers),
                dense_device=device,
            )
        elif cfg.arch == "dlrm_dcn":
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
    if cfg.dropout and cfg.arch != "two_tower":
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


def add_dropout(model: nn.Module, p: float) -> None:
    """Dropout ``p`` after every hidden layer of ``model``'s dense and over arch: every
    Perceptron of the over arch's MLP (its final Linear makes the logit) and every one of the
    dense arch's but the last (whose output is the dense features' embedding). DeepFM without
    dense features has no dense arch."""
    dense_arch = getattr(model, "dense_arch", None)
    dense = [] if dense_arch is None else _perceptrons(dense_arch.model)[:-1]
    over_arch: Any = model.over_arch  # DLRM's and DeepFM's OverArch: an MLP, then a Linear
    over = [p_ for m in over_arch.model if isinstance(m, MLP) for p_ in _perceptrons(m)]
    for perceptron in [*dense, *over]:
        perceptron._activation_fn = _ActivationThenDropout(perceptron._activation_fn, p)


def _perceptrons(mlp: nn.Module) -> list[Perceptron]:
    assert isinstance(mlp, MLP), f"TorchRec's DLRM arch holds an MLP, got {type(mlp).__name__}"
    return [m for m in mlp._mlp if isinstance(m, Perceptron)]


def build_train_model(
    cfg: ModelConfig, num_dense: int, device: torch.device, seed: int
) -> nn.Module:
    """TorchRec's ``DLRMTrain`` (logits, BCE-with-logits loss) around the model of ``cfg.arch``,
    embeddings on ``meta``, dense on ``device``: the default :data:`ModelFactory`."""
    model = build_model(cfg, num_dense, device, seed)
    if cfg.arch == "two_tower":
        from raytrec.models.two_tower import TwoTower, TwoTowerTrain

        assert isinstance(model, TwoTower)
        return TwoTowerTrain(model, loss=cfg.two_tower_loss, temperature=cfg.temperature)
    # DLRMTrain calls its module as model(dense, kjt) and needs nothing else of DLRM.
    return DLRMTrain(model)


# The names of these factories from when DLRM was the only architecture; they build any.
build_dlrm = build_train_model
build_dlrm_model = build_model
