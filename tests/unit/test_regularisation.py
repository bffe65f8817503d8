"""Weight decay (dense and fused embedding optimizers) and dropout in the dense and over arch
(in one process, no process group: milliseconds to a second)."""

from __future__ import annotations

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
    WeightDecayMode,
)
from torch import nn
from torchrec.models.dlrm import DLRMTrain
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from raytrec.config import ModelConfig, OptimizerConfig, ScalingConfig, TrainConfig, criteo_tables
from raytrec.engine.plan import apply_embedding_optimizer, embedding_optimizer_kwargs
from raytrec.engine.rank_engine import _DENSE_OPTIMIZERS, dense_optimizer_kwargs, dropout_seed
from raytrec.errors import ConfigError
from raytrec.models import build_dlrm_model
from raytrec.serving.export import example_batch
from raytrec.serving.model_spec import ModelSpec


def test_weight_decay_and_dropout_are_checked_naming_the_field() -> None:
    for field, value in (("dense_weight_decay", -0.1), ("embedding_weight_decay", "a")):
        with pytest.raises(
            ConfigError,
            match=rf"optimizer.{field}=.*: must be (greater than or equal to 0|a valid number)",
        ):
            OptimizerConfig(**{field: value})  # type: ignore[arg-type]
    for optimizer in ("sgd", "adagrad"):
        with pytest.raises(ConfigError, match=rf"not supported by FBGEMM's fused '{optimizer}'"):
            OptimizerConfig(embedding=optimizer, embedding_weight_decay=0.01)  # type: ignore[arg-type]
    for bad in (-0.1, 1.0, True):
        with pytest.raises(
            ConfigError,
            match=r"model.dropout=.*: must be (greater than or equal to 0|less than 1|a valid num)",
        ):
            ModelConfig(dropout=bad)


@pytest.mark.parametrize("dense", ["sgd", "adagrad", "adam", "adamw"])
def test_the_dense_optimizer_decays_the_dense_weights(dense: str) -> None:
    cfg = OptimizerConfig(dense=dense, dense_lr=0.1, dense_weight_decay=0.5)  # type: ignore[arg-type]
    assert dense_optimizer_kwargs(cfg)["weight_decay"] == 0.5
    # No decay unless configured (AdamW's own default would be 0.01).
    assert not dense_optimizer_kwargs(OptimizerConfig(dense=dense)).get("weight_decay")  # type: ignore[arg-type]
    param = nn.Parameter(torch.full((3,), 2.0))
    optimizer = _DENSE_OPTIMIZERS[dense]([param], **dense_optimizer_kwargs(cfg))
    param.grad = torch.zeros(3)  # no loss gradient: only the decay moves the weight
    optimizer.step()
    assert bool((param.detach() < 2.0).all())


def test_the_fused_optimizer_gets_the_weight_decay() -> None:
    rowwise = OptimizerConfig(embedding="rowwise_adagrad", embedding_weight_decay=0.1)
    assert embedding_optimizer_kwargs(rowwise)["weight_decay_mode"] == WeightDecayMode.L2
    adam = OptimizerConfig(embedding="adam", embedding_weight_decay=0.1)
    assert embedding_optimizer_kwargs(adam)["weight_decay_mode"] == WeightDecayMode.DECOUPLE
    assert "weight_decay" not in embedding_optimizer_kwargs(OptimizerConfig())
    # What TorchRec's sharder reads from each table's parameter and hands to FBGEMM.
    model = DLRMTrain(
        build_dlrm_model(
            ModelConfig(tables=criteo_tables(num_features=2)), 13, torch.device("cpu"), 0
        )
    )
    apply_embedding_optimizer(model, rowwise)
    ebc = next(m for m in model.modules() if isinstance(m, EmbeddingBagCollection))
    for p in ebc.parameters():
        assert p._optimizer_kwargs[0]["weight_decay"] == 0.1  # type: ignore[attr-defined]


def test_cpu_ranks_refuse_embedding_weight_decay() -> None:
    decay = OptimizerConfig(embedding="rowwise_adagrad", embedding_weight_decay=0.1)
    with pytest.raises(ConfigError, match=r"embedding_weight_decay=0.1 cannot run on CPU ranks"):
        TrainConfig(optimizer=decay)
    assert TrainConfig(optimizer=decay, scaling=ScalingConfig(use_gpu=True)).optimizer == decay


def rowwise_adagrad_on_cpu(decay: float, grad_scale: float) -> torch.Tensor:
    """Row 0 after one step of FBGEMM's CPU row-wise Adagrad with the arguments raytrec
    passes, from weights (1, 2, 3, 4)."""
    cfg = OptimizerConfig(
        embedding="rowwise_adagrad", embedding_lr=0.1, embedding_weight_decay=decay
    )
    kwargs = embedding_optimizer_kwargs(cfg)
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(4, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=kwargs["lr"],
        eps=kwargs["eps"],
        weight_decay=kwargs.get("weight_decay", 0.0),
        weight_decay_mode=kwargs.get("weight_decay_mode", WeightDecayMode.NONE),
    )
    with torch.no_grad():
        tbe.split_embedding_weights()[0].copy_(torch.tensor([1.0, 2, 3, 4]).repeat(4, 1))
    out = tbe(torch.tensor([0, 2]), torch.tensor([0, 1, 2]))  # rows 0 and 2, one bag each
    (out * grad_scale).sum().backward()
    return tbe.split_embedding_weights()[0][0].detach().clone()


def test_fbgemm_cpu_kernels_ignore_weight_decay() -> None:
    """Why CPU ranks refuse embedding_weight_decay: FBGEMM's CPU row-wise Adagrad steps alike
    with and without it (L2 would change the step of a row with unequal weights)."""
    for scale in (0.0, 1.0):
        assert torch.equal(rowwise_adagrad_on_cpu(0.5, scale), rowwise_adagrad_on_cpu(0.0, scale))
    assert not torch.equal(rowwise_adagrad_on_cpu(0.0, 1.0), torch.tensor([1.0, 2, 3, 4]))


def small(dropout: float, arch: str = "dlrm") -> ModelConfig:
    return ModelConfig(
        arch=arch,  # type: ignore[arg-type]
        tables=criteo_tables(num_features=3, num_embeddings=20, embedding_dim=8),
        dense_arch_layers=(32, 16, 8),
        over_arch_layers=(32, 16, 1),
        dropout=dropout,
    )


@pytest.mark.parametrize("arch", ["dlrm", "dlrm_dcn", "deepfm"])
def test_dropout_trains_noisy_evaluates_exact_and_keeps_the_state_dict(arch: str) -> None:
    cpu = torch.device("cpu")
    plain = build_dlrm_model(small(0.0, arch), 13, cpu, 3, embedding_device=cpu)
    noisy = build_dlrm_model(small(0.4, arch), 13, cpu, 3, embedding_device=cpu)
    # Hidden layers only: dense arch 32 and 16 (not its output 8), over arch 32 and 16.
    assert sum(isinstance(m, nn.Dropout) for m in noisy.modules()) == 4
    assert not any(isinstance(m, nn.Dropout) for m in plain.modules())
    assert plain.state_dict().keys() == noisy.state_dict().keys()
    noisy.load_state_dict(plain.state_dict())  # embeddings are random per build: copy all
    spec = ModelSpec.for_config(TrainConfig(model=small(0.4, arch)), 13)
    batch = example_batch(spec, batch_size=16)
    args = (batch.dense_features + torch.randn(16, 13), batch.sparse_features)
    plain.eval()
    noisy.eval()
    with torch.no_grad():
        assert torch.equal(noisy(*args), plain(*args))
        noisy.train()
        first, second = noisy(*args), noisy(*args)
    assert not torch.equal(first, second) and not torch.equal(first, plain(*args))


def test_ranks_draw_their_own_dropout_masks() -> None:
    seeds = {dropout_seed(0, rank) for rank in range(64)}
    assert len(seeds) == 64 and dropout_seed(1, 0) not in seeds
    assert dropout_seed(0, 5) == dropout_seed(0, 5)
