"""Bad configuration fails on construction, naming the field and what is allowed."""

from __future__ import annotations

import pytest

from raytrec.cluster.placement import rank_runtime_env
from raytrec.cluster.topology import Layout
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
        (0, 1, r"scaling.num_workers=0: must be greater than 0"),
        (4, -2, r"scaling.gang_size=-2: must be greater than 0"),
    ],
)
def test_gang_size_must_divide_the_world(workers: int, gang: int, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ScalingConfig(num_workers=workers, gang_size=gang)


def test_layout_and_backend_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"scaling.layout='diagonal': must be 'replicas_within"):
        ScalingConfig(layout="diagonal")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"scaling.backend='mpi': must be 'auto', 'gloo' or"):
        ScalingConfig(backend="mpi")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"backend='nccl' needs scaling.use_gpu=True"):
        ScalingConfig(backend="nccl")
    # A gang that cannot be packed on hosts as the layout demands.
    with pytest.raises(ConfigError, match=r"scaling: .*gang_size=3.*ranks_per_host=4"):
        ScalingConfig(num_workers=12, gang_size=3, ranks_per_host=4)


@pytest.mark.parametrize("value", [-1, 20, 2.5, True, "0"])
def test_rank_niceness_is_a_nice_increment_or_none(value: object) -> None:
    with pytest.raises(ConfigError, match=r"scaling.rank_niceness=.*: must be"):
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
        ConfigError, match=r"sharding.sharding_type='diagonal_wise': must be 'table_wise'"
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
        ({"num_embeddings": 0}, r"tables\[\].num_embeddings=0: must be greater than 0"),
        ({"embedding_dim": 0}, r"tables\[\].embedding_dim=0: must be greater than 0"),
        ({"num_embeddings": True}, r"num_embeddings=true: must be a valid integer"),
        ({"num_embeddings": "10"}, r"num_embeddings='10': must be a valid integer"),
        ({"features": ()}, r"tables\[\].features=\[\]: must have at least 1 item"),
        ({"name": ""}, r"tables\[\].name='': must have at least 1 character"),
        ({"pooling": "mean", "weighted": True}, r"tables\[\]: weighted=True needs pooling='sum'"),
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
        ModelConfig(tables=(a,), dense_arch_layers=(4,), over_arch_layers=(8, 2))
    with pytest.raises(ConfigError, match=r"model.arch='transformer': must be 'dlrm'"):
        ModelConfig(arch="transformer")  # type: ignore[arg-type]


def test_a_feature_that_no_table_serves() -> None:
    model = ModelConfig(tables=criteo_tables(num_features=3))
    validate_features(model, ["cat_0", "cat_1", "cat_2"])
    with pytest.raises(ConfigError, match=r"sparse features \['cat_9'\] from the data source"):
        validate_features(model, ["cat_0", "cat_1", "cat_2", "cat_9"])
    with pytest.raises(ConfigError, match=r"names \['cat_2'\], which the data source does not"):
        validate_features(model, ["cat_0", "cat_1"])


def test_other_fields() -> None:
    with pytest.raises(ConfigError, match=r"sync.sync_every=0: must be greater than 0"):
        SyncConfig(sync_every=0)
    with pytest.raises(ConfigError, match=r"data.batch_size=-1: must be greater than 0"):
        DataConfig(batch_size=-1)
    with pytest.raises(ConfigError, match=r"optimizer.embedding_lr=0.0: must be greater than 0"):
        OptimizerConfig(embedding_lr=0.0)
    with pytest.raises(ConfigError, match=r"optimizer.eps=.nan: must be a finite number"):
        OptimizerConfig(eps=float("nan"))
    with pytest.raises(ConfigError, match=r"optimizer.dense='lbfgs': must be 'sgd', 'adagrad'"):
        OptimizerConfig(dense="lbfgs")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"num_steps=0: must be greater than 0"):
        TrainConfig(num_steps=0)
    with pytest.raises(ConfigError, match=r"scaling=4: must be a mapping"):
        TrainConfig(scaling=4)  # type: ignore[arg-type]
    # A section given as a mapping is validated like one read from YAML.
    as_dict = TrainConfig(scaling={"num_workers": 6})  # type: ignore[arg-type]
    assert as_dict == TrainConfig(scaling=ScalingConfig(num_workers=6))
    with pytest.raises(ConfigError, match=r"scaling.gang_size=4 does not divide"):
        TrainConfig(scaling={"gang_size": 4, "num_workers": 6})  # type: ignore[arg-type]


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


def test_unknown_keys_and_scalars_of_the_wrong_type_are_refused() -> None:
    with pytest.raises(
        ConfigError,
        match=r"unknown key 'scaling.gang_sise' \(did you mean 'scaling.gang_size'\?\); allowed "
        r"keys under 'scaling': num_workers, gang_size, ranks_per_host",
    ):
        ScalingConfig(gang_sise=2)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match=r"scaling.use_gpu='yes': must be a valid boolean"):
        ScalingConfig(use_gpu="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"scaling.use_gpu=1: must be a valid boolean"):
        ScalingConfig(use_gpu=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^name=12: must be a valid string$"):
        TrainConfig(name=12)  # type: ignore[arg-type]
    # Every problem is named, not only the first.
    with pytest.raises(ConfigError, match=r"num_workers=0: .*; scaling.cpus_per_rank=-1"):
        ScalingConfig(num_workers=0, cpus_per_rank=-1)
    # An int is a float; a list is a tuple; an enum's value is the enum.
    scaling = ScalingConfig(cpus_per_rank=2, layout="replicas_within_host")  # type: ignore[arg-type]
    assert scaling.cpus_per_rank == 2.0 and isinstance(scaling.cpus_per_rank, float)
    assert scaling.layout is Layout.REPLICAS_WITHIN_HOST
    assert SyncConfig(levels=[[2, 2]], sync_every=4).levels == ((2, 2),)  # type: ignore[arg-type]


def test_configs_are_frozen_values_that_pickle_and_replace() -> None:
    import pickle

    import pydantic

    cfg = TrainConfig(num_steps=5, scaling=ScalingConfig(num_workers=2, gang_size=1))
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        cfg.num_steps = 6  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    assert hash(cfg.scaling) == hash(ScalingConfig(num_workers=2, gang_size=1))
    assert cfg.replace(num_steps=6) == TrainConfig(
        num_steps=6, scaling=ScalingConfig(num_workers=2, gang_size=1)
    )
    assert cfg.replace(num_steps=6) != cfg
    with pytest.raises(ConfigError, match=r"scaling.gang_size=3 is larger than"):
        cfg.scaling.replace(gang_size=3)


def test_sync_merge_was_removed() -> None:
    with pytest.raises(ConfigError, match=r"^sync.merge was removed: .*touched_mean, lowered"):
        SyncConfig(merge="touched_mean")  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match=r"^sync.merge was removed"):
        TrainConfig(sync={"merge": "mean"})  # type: ignore[arg-type]


def test_touched_rows_track_at_most_15_levels() -> None:
    # Touched rows are tracked per schedule level, at most 15 levels with the job-wide one.
    deep = tuple((2**i, 2**i) for i in range(1, 15))
    assert SyncConfig(levels=deep, sync_every=2**15).levels == deep
    deeper = (*deep, (2**15, 2**15))
    with pytest.raises(ConfigError, match=r"sync.rows=touched tracks .* at most 15 .*rows=all"):
        SyncConfig(levels=deeper, sync_every=2**16)  # rows: touched is the default
    untracked = SyncConfig(rows="all", levels=deeper, sync_every=2**16)
    assert untracked.levels == deeper  # nothing tracked
