"""One sharding plan per job, made by TorchRec's planner for one gang.

The plan is computed once, on the driver, for a world of ``gang_size`` ranks
and shipped to every rank, so shard ``k`` of gang ``a`` is laid out exactly
like shard ``k`` of gang ``b``: that correspondence is what lets replica
groups average their shards element-wise. Planning on the driver also turns
a sharding type with no kernel on the device into an error before any actor
starts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
from torchrec import optim as trec_optim
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.constants import POOLING_FACTOR
from torchrec.distributed.planner.types import ParameterConstraints, PlannerError
from torchrec.distributed.types import CacheParams, ModuleSharder, ShardingPlan
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from raytrec.config import ConfigError, OptimizerConfig, ShardingConfig, TableConfig, TrainConfig

__all__ = [
    "apply_embedding_optimizer",
    "embedding_optimizer_kwargs",
    "job_plan",
    "make_plan",
    "sharders",
    "table_constraints",
]

_EMBEDDING_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": trec_optim.SGD,
    "adagrad": trec_optim.Adagrad,
    "rowwise_adagrad": trec_optim.RowWiseAdagrad,
    "adam": trec_optim.Adam,
}


def sharders() -> list[ModuleSharder[nn.Module]]:
    return [EmbeddingBagCollectionSharder()]


def embedding_optimizer_kwargs(cfg: OptimizerConfig) -> dict[str, Any]:
    """The fused optimizer's arguments, as TorchRec hands them to FBGEMM's table batch."""
    kwargs: dict[str, Any] = {"lr": cfg.embedding_lr}
    if cfg.embedding != "sgd":
        kwargs["eps"] = cfg.eps
    if cfg.embedding_weight_decay:
        # Where FBGEMM 1.6 (torch 2.11) and 1.8 (torch 2.13) both export it.
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode

        kwargs["weight_decay"] = cfg.embedding_weight_decay
        # Row-wise Adagrad takes L2 or decoupled decay; L2 is torch's weight_decay. FBGEMM's
        # Adam decays decoupled (as AdamW) whatever the mode says.
        kwargs["weight_decay_mode"] = (
            WeightDecayMode.L2 if cfg.embedding == "rowwise_adagrad" else WeightDecayMode.DECOUPLE
        )
    return kwargs


def apply_embedding_optimizer(model: nn.Module, cfg: OptimizerConfig) -> None:
    """Marks every embedding table for FBGEMM's fused, in-backward optimizer."""
    kwargs = embedding_optimizer_kwargs(cfg)
    params = [
        p for m in model.modules() if isinstance(m, EmbeddingBagCollection) for p in m.parameters()
    ]
    if not params:
        raise ConfigError("the model has no EmbeddingBagCollection to shard")
    apply_optimizer_in_backward(_EMBEDDING_OPTIMIZERS[cfg.embedding], params, kwargs)


def table_constraints(
    tables: Sequence[TableConfig], sharding: ShardingConfig
) -> dict[str, ParameterConstraints]:
    """TorchRec's planner constraints for each table: its own ``sharding_types`` (else
    ``sharding.sharding_type``), ``min_partition``, ``pooling_factor`` and FBGEMM kernel
    (``compute_kernel``, with the cache's ``cache_load_factor``). Every kernel allowed is a
    fused one, whose in-backward optimizer state the replica syncs average."""
    return {
        t.name: ParameterConstraints(
            sharding_types=list(t.sharding_types or (sharding.sharding_type,)),
            compute_kernels=[EmbeddingComputeKernel(t.compute_kernel).value],
            min_partition=t.min_partition,
            pooling_factors=[t.pooling_factor or POOLING_FACTOR] * len(t.features),
            cache_params=(
                None
                if t.cache_load_factor is None
                else CacheParams(load_factor=t.cache_load_factor)
            ),
        )
        for t in tables
    }


def make_plan(
    model: nn.Module,
    *,
    gang_size: int,
    device_type: str,
    sharding: ShardingConfig,
    tables: Sequence[TableConfig],
    batch_size: int,
    device_memory: int | None = None,
) -> ShardingPlan:
    """Plans ``model`` for ``gang_size`` ranks within each table's constraints
    (:func:`table_constraints`); ``device_memory``: the bytes of device memory per rank the
    plan may fill (the planner's HBM capacity; None: TorchRec's default)."""
    planner = EmbeddingShardingPlanner(
        topology=Topology(
            world_size=gang_size,
            compute_device=device_type,
            local_world_size=gang_size,
            hbm_cap=device_memory if device_type == "cuda" else None,
        ),
        batch_size=batch_size,
        constraints=table_constraints(tables, sharding),
    )
    try:
        return planner.plan(model, sharders())
    except PlannerError as e:
        first_line = str(e).strip().splitlines()[0]
        own = [f"{t.name}: {list(t.sharding_types)}" for t in tables if t.sharding_types]
        choices = f"sharding.sharding_type={sharding.sharding_type!r}" + (
            f" (per table: {', '.join(own)})" if own else ""
        )
        memory = ""
        if device_memory is not None and device_type == "cuda":
            memory = (
                f" within {device_memory / 2**30:.2f} GiB of device memory per rank (tables "
                "larger than that can live in host memory: model.tables[*].compute_kernel="
                "'fused_uvm_caching')"
            )
        raise ConfigError(
            f"{choices}: TorchRec's planner found no plan for {gang_size} {device_type} "
            f"rank(s){memory}: {first_line}"
        ) from e


def job_plan(
    config: TrainConfig,
    num_dense: int,
    model_factory: Callable[..., nn.Module],
    *,
    device_memory: int | None = None,
) -> ShardingPlan:
    """The job's plan: its model (tables on ``meta``, nothing allocated) planned for one gang of
    ``scaling.gang_size`` ranks on their device, within ``device_memory`` bytes per GPU rank."""
    model = model_factory(config.model, num_dense, torch.device("cpu"), config.seed)
    apply_embedding_optimizer(model, config.optimizer)
    return make_plan(
        model,
        gang_size=config.scaling.gang_size,
        device_type="cuda" if config.scaling.use_gpu else "cpu",
        sharding=config.sharding,
        tables=config.model.tables,
        batch_size=config.data.batch_size,
        device_memory=device_memory,
    )
