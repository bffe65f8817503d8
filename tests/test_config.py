"""Bad configuration fails on construction, naming the field and what is allowed."""

from __future__ import annotations

import pytest

from raytrec.config import (
    ConfigError,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ScalingConfig,
    ShardingConfig,
    SyncConfig,
    TableConfig,
    TrainConfig,
    criteo_tables,
    validate_features,
)
from raytrec.placement import rank_runtime_env
from raytrec.topology import Layout


def table(**kw: object) -> TableConfig:
    args: dict = {"name": "t", "num_embeddings": 10, "embedding_dim": 4, "features": ("f",)}
    args.update(kw)
    return TableConfig(**args)


def test_defaults_are_valid_and_consistent() -> None:
    cfg = TrainConfig()
    assert cfg.scaling.num_gangs * cfg.scaling.gang_size == cfg.scaling.world_size
    assert cfg.model.features == tuple(f"cat_{i}" for i in range(26))
    assert cfg.scaling.topology().layout is Layout.REPLICAS_ACROSS_HOSTS
    assert cfg.scaling.resolved_backend == "gloo"
    assert ScalingConfig(use_gpu=True).resolved_backend == "nccl"


@pytest.mark.parametrize(
    ("workers", "gang", "match"),
    [
        (
            6,
            4,
            r"scaling.gang_size=4 does not divide scaling.num_workers=6; allowed gang sizes: "
            r"\[1, 2, 3, 6\]",
        ),
        (2, 4, r"scaling.gang_size=4 is larger than scaling.num_workers=2"),
        (0, 1, r"scaling.num_workers must be a positive integer, got 0"),
        (4, -2, r"scaling.gang_size must be a positive integer, got -2"),
    ],
)
def test_gang_size_must_divide_the_world(workers: int, gang: int, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ScalingConfig(num_workers=workers, gang_size=gang)


def test_layout_and_backend_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"scaling.layout='diagonal' is not one of"):
        ScalingConfig(layout="diagonal")
    with pytest.raises(ConfigError, match=r"scaling.backend='mpi' is not one of 'auto'"):
        ScalingConfig(backend="mpi")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"backend='nccl' needs scaling.use_gpu=True"):
        ScalingConfig(backend="nccl")
    # A gang that cannot be packed on hosts as the layout demands.
    with pytest.raises(ConfigError, match=r"scaling: .*gang_size=3.*ranks_per_host=4"):
        ScalingConfig(num_workers=12, gang_size=3, ranks_per_host=4)


@pytest.mark.parametrize("value", [-1, 20, 2.5, True, "0"])
def test_rank_niceness_is_a_nice_increment_or_none(value: object) -> None:
    with pytest.raises(ConfigError, match=r"scaling.rank_niceness=.* allowed: an integer from 0"):
        ScalingConfig(rank_niceness=value)  # type: ignore[arg-type]


def test_rank_niceness_reaches_the_rank_actors_runtime_env() -> None:
    assert ScalingConfig().rank_niceness == 0
    assert rank_runtime_env(ScalingConfig().rank_niceness) == {
        "env_vars": {"RAY_worker_niceness": "0"}
    }
    assert rank_runtime_env(ScalingConfig(rank_niceness=19).rank_niceness) == {
        "env_vars": {"RAY_worker_niceness": "19"}
    }
    assert rank_runtime_env(ScalingConfig(rank_niceness=None).rank_niceness) is None


def test_unknown_sharding_type_names_the_allowed_ones() -> None:
    with pytest.raises(
        ConfigError, match=r"sharding.sharding_type='diagonal_wise' is not one of 'table_wise'"
    ):
        ShardingConfig(sharding_type="diagonal_wise")  # type: ignore[arg-type]


@pytest.mark.parametrize("sharding_type", ["row_wise", "table_row_wise"])
def test_sharding_types_without_a_cpu_kernel_fail_on_cpu_only(sharding_type: str) -> None:
    sharding = ShardingConfig(sharding_type=sharding_type)  # type: ignore[arg-type]
    with pytest.raises(
        ConfigError, match=rf"sharding.sharding_type='{sharding_type}' has no CPU kernel"
    ):
        TrainConfig(sharding=sharding)
    assert TrainConfig(sharding=sharding, scaling=ScalingConfig(use_gpu=True)).sharding == sharding


def test_fused_adam_is_refused_on_cpu_with_fbgemms_reason() -> None:
    adam = OptimizerConfig(embedding="adam")
    with pytest.raises(ConfigError, match=r"Optimizer adam is not supported in CPU mode"):
        TrainConfig(optimizer=adam)
    assert TrainConfig(optimizer=adam, scaling=ScalingConfig(use_gpu=True)).optimizer == adam


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"num_embeddings": 0}, r"tables\[t\].num_embeddings must be a positive integer, got 0"),
        ({"embedding_dim": 0}, r"tables\[t\].embedding_dim must be a positive integer, got 0"),
        ({"num_embeddings": True}, r"num_embeddings must be a positive integer, got True"),
        ({"features": ()}, r"tables\[t\].features must name at least one feature"),
        ({"name": ""}, r"table name must be a non-empty string"),
    ],
)
def test_bad_tables(kw: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        table(**kw)


def test_model_checks_tables_together() -> None:
    a, b = table(name="a", features=("x",)), table(name="a", features=("y",))
    with pytest.raises(ConfigError, match=r"duplicate table names \['a'\]"):
        ModelConfig(tables=(a, b), dense_arch_layers=(4,))
    b = table(name="b", features=("x",))
    with pytest.raises(ConfigError, match=r"features \['x'\] are served by more than one table"):
        ModelConfig(tables=(a, b), dense_arch_layers=(4,))
    b = table(name="b", features=("y",), embedding_dim=8)
    with pytest.raises(ConfigError, match=r"one embedding_dim for all tables, got 4: \['a'\], 8"):
        ModelConfig(tables=(a, b), dense_arch_layers=(4,))
    with pytest.raises(ConfigError, match=r"dense_arch_layers\[-1\]=8 must equal .*=4"):
        ModelConfig(tables=(a,), dense_arch_layers=(8,))
    with pytest.raises(ConfigError, match=r"over_arch_layers\[-1\]=2 must be 1"):
        ModelConfig(tables=(a,), dense_arch_layers=(4,), over_arch_layers=(2,))
    with pytest.raises(ConfigError, match=r"model.arch='transformer' is not one of 'dlrm'"):
        ModelConfig(arch="transformer")  # type: ignore[arg-type]


def test_a_feature_that_no_table_serves() -> None:
    model = ModelConfig(tables=criteo_tables(num_features=3))
    validate_features(model, ["cat_0", "cat_1", "cat_2"])
    with pytest.raises(ConfigError, match=r"sparse features \['cat_9'\] from the data source"):
        validate_features(model, ["cat_0", "cat_1", "cat_2", "cat_9"])
    with pytest.raises(ConfigError, match=r"names \['cat_2'\], which the data source does not"):
        validate_features(model, ["cat_0", "cat_1"])


def test_other_fields() -> None:
    with pytest.raises(ConfigError, match=r"sync.sync_every must be a positive integer, got 0"):
        SyncConfig(sync_every=0)
    with pytest.raises(ConfigError, match=r"data.batch_size must be a positive integer"):
        DataConfig(batch_size=-1)
    with pytest.raises(ConfigError, match=r"optimizer.embedding_lr must be a positive number"):
        OptimizerConfig(embedding_lr=0.0)
    with pytest.raises(ConfigError, match=r"optimizer.dense='lbfgs' is not one of"):
        OptimizerConfig(dense="lbfgs")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"num_steps must be a positive integer"):
        TrainConfig(num_steps=0)
    with pytest.raises(ConfigError, match=r"scaling must be a ScalingConfig"):
        TrainConfig(scaling={"num_workers": 4})  # type: ignore[arg-type]


def test_read_ahead_auto_uses_a_thread_on_gpu_ranks_only() -> None:
    assert not TrainConfig().feed_in_background
    gpu = TrainConfig(scaling=ScalingConfig(use_gpu=True))
    assert gpu.feed_in_background
    for mode, background in (("background", True), ("inline", False)):
        cfg = TrainConfig(data=DataConfig(read_ahead=mode))  # type: ignore[arg-type]
        assert cfg.feed_in_background is background
    with pytest.raises(ConfigError, match=r"data\.read_ahead"):
        DataConfig(read_ahead="sometimes")  # type: ignore[arg-type]


def test_table_names_torchrec_cannot_hold_are_refused() -> None:
    from torch import nn

    from raytrec.config import RESERVED_TABLE_NAMES, TableConfig

    attributes = {n for n in dir(nn.ModuleDict) if not n.startswith("_")} | {"training"}
    assert attributes == RESERVED_TABLE_NAMES
    with pytest.raises(ConfigError, match="table name 'items' cannot be used"):
        TableConfig(name="items", num_embeddings=4, embedding_dim=4, features=("item",))
