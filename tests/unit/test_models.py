"""The model options in one process: DeepFM, per-table dims, weighted ids, no dense columns,
per-table planner constraints; their refusals; and a DeepFM's export and load."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.models.dlrm import DLRMTrain

from raytrec._quiet import quiet_known_warnings
from raytrec.config import (
    ConfigError,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ScalingConfig,
    ShardingConfig,
    TableConfig,
    TrainConfig,
)
from raytrec.data.arrow_kjt import BadInputError, to_batch
from raytrec.data.from_config import parquet_spec, synthetic_source
from raytrec.data.preprocess import internal_columns_of, preprocess
from raytrec.engine.plan import apply_embedding_optimizer, make_plan, table_constraints
from raytrec.models import DeepFM, build_model, build_train_model
from raytrec.serving.export import export, load_exported, load_program, make_batch, score
from raytrec.serving.model_spec import ModelSpec, write_model_spec

CPU = torch.device("cpu")


def tables(*, weighted: bool = True, dims: tuple[int, int] = (4, 6)) -> tuple[TableConfig, ...]:
    return (
        TableConfig(name="t_user", num_embeddings=10, embedding_dim=dims[0], features=("u",)),
        TableConfig(
            name="t_item",
            num_embeddings=12,
            embedding_dim=dims[1],
            features=("i", "j"),
            weighted=weighted,
        ),
    )


DEEPFM = ModelConfig(
    arch="deepfm",
    tables=tables(),
    dense_arch_layers=(8, 5),
    over_arch_layers=(8, 1),
    deep_fm_dimension=7,
)


def rows(n: int = 6, *, num_dense: int = 3, seed: int = 0) -> pa.Table:
    """Rows in raytrec's Parquet layout for DEEPFM: id lists of 0-3 ids, weights for i and j."""
    rng = np.random.default_rng(seed)
    cols: dict[str, pa.Array] = {
        f"dense_{j}": pa.array(rng.standard_normal(n), pa.float32()) for j in range(num_dense)
    }
    for f, ids in (("u", 10), ("i", 12), ("j", 12)):
        lists = [rng.integers(0, ids, rng.integers(0, 4)).tolist() for _ in range(n)]
        cols[f] = pa.array(lists, pa.list_(pa.int64()))
        if f != "u":
            cols[f"{f}_weights"] = pa.array(
                [rng.uniform(0.1, 2.0, len(x)).tolist() for x in lists], pa.list_(pa.float32())
            )
    cols["label"] = pa.array(rng.integers(0, 2, n).astype(np.float32))
    cols["row_id"] = pa.array(np.arange(n), pa.int64())
    return pa.table(cols)


def job(model: ModelConfig = DEEPFM, *, num_dense: int = 3, **kw: object) -> TrainConfig:
    data = DataConfig(source="parquet", path="/nowhere", num_dense=num_dense, batch_size=8)
    return TrainConfig(model=model, data=data, **kw)  # type: ignore[arg-type]


# -- config: what each architecture allows --------------------------------------------------


def test_per_table_dims_only_where_the_arch_allows_them() -> None:
    assert [t.embedding_dim for t in DEEPFM.tables] == [4, 6]
    for arch in ("dlrm", "dlrm_dcn"):
        with pytest.raises(
            ConfigError,
            match=rf"model.arch='{arch}' needs one embedding_dim for all tables, got "
            r"4: \['t_user'\], 6: \['t_item'\]; per-table dims are allowed with "
            r"model.arch='deepfm'",
        ):
            ModelConfig(arch=arch, tables=tables(), dense_arch_layers=(8, 4))  # type: ignore[arg-type]
    # DeepFM's dense arch may end in any width: it is not an embedding of a table.
    assert DEEPFM.dense_arch_layers[-1] == 5


def test_weights_need_sum_pooling_in_every_table() -> None:
    with pytest.raises(ConfigError, match=r"tables\[\]: weighted=True needs pooling='sum'"):
        TableConfig(
            name="t", num_embeddings=4, embedding_dim=4, features=("a",), weighted=True,
            pooling="mean",
        )  # fmt: skip
    mean = TableConfig(name="m", num_embeddings=4, embedding_dim=4, features=("a",), pooling="mean")
    weighted = TableConfig(
        name="w", num_embeddings=4, embedding_dim=4, features=("b",), weighted=True
    )
    with pytest.raises(
        ConfigError, match=r"weighted tables \['w'\] need every table sum-pooled, but \['m'\]"
    ):
        ModelConfig(arch="deepfm", tables=(mean, weighted))
    # Mean pooling alone, unweighted, is fine on every arch.
    for arch in ("dlrm", "dlrm_dcn", "deepfm"):
        ModelConfig(arch=arch, tables=(mean,), dense_arch_layers=(8, 4))  # type: ignore[arg-type]


def test_zero_dense_columns_only_for_deepfm() -> None:
    assert job(num_dense=0).data.num_dense == 0
    unweighted = tables(weighted=False, dims=(4, 4))
    for arch in ("dlrm", "dlrm_dcn"):
        model = ModelConfig(arch=arch, tables=unweighted, dense_arch_layers=(8, 4))  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=rf"model.arch='{arch}' needs dense features"):
            job(model, num_dense=0)
        with pytest.raises(ConfigError, match=rf"model.arch='{arch}' needs dense features"):
            build_model(model, 0, CPU, 0)  # a source of the caller's with no dense features
    with pytest.raises(ConfigError, match=r"data.num_dense=-1: must be greater than or equal to 0"):
        DataConfig(num_dense=-1)


def test_weighted_tables_need_a_source_with_weights() -> None:
    config = job().replace(data=DataConfig(source="synthetic"))
    with pytest.raises(ConfigError, match=r"model.tables \['t_item'\] are weighted.*'synthetic'"):
        synthetic_source(config)
    spec = parquet_spec(job())
    assert [(f.name, getattr(f, "weights", None)) for f in spec.sparse] == [
        ("u", None),
        ("i", "i_weights"),
        ("j", "j_weights"),
    ]


def test_per_table_sharding_types_are_checked_for_the_cpu() -> None:
    row_wise = TableConfig(
        name="t", num_embeddings=4, embedding_dim=4, features=("a",), sharding_types=("row_wise",)
    )
    model = ModelConfig(arch="deepfm", tables=(row_wise,))
    with pytest.raises(
        ConfigError, match=r"model.tables\[t\].sharding_types='row_wise' has no CPU"
    ):
        job(model)
    with pytest.raises(ConfigError, match=r"tables\[\].sharding_types\[0\]='diagonal': must be"):
        TableConfig(
            name="t", num_embeddings=4, embedding_dim=4, features=("a",),
            sharding_types=("diagonal",),  # type: ignore[arg-type]
        )  # fmt: skip
    with pytest.raises(ConfigError, match=r"tables\[\].min_partition=0: must be greater than 0"):
        TableConfig(name="t", num_embeddings=4, embedding_dim=4, features=("a",), min_partition=0)


# -- the planner's constraints ----------------------------------------------------------------


def test_constraints_map_onto_torchrec() -> None:
    own = TableConfig(
        name="b",
        num_embeddings=64,
        embedding_dim=256,
        features=("x", "y"),
        sharding_types=("column_wise",),
        min_partition=64,
        pooling_factor=3.5,
    )
    plain = TableConfig(name="a", num_embeddings=64, embedding_dim=256, features=("z",))
    got = table_constraints((plain, own), ShardingConfig(sharding_type="table_wise"))
    assert got == {
        "a": ParameterConstraints(
            sharding_types=["table_wise"], compute_kernels=["fused"], pooling_factors=[1.0]
        ),
        "b": ParameterConstraints(
            sharding_types=["column_wise"],
            compute_kernels=["fused"],
            min_partition=64,
            pooling_factors=[3.5, 3.5],
        ),
    }
    # The planner follows them: a whole, and b in four 64-column shards over the two ranks.
    quiet_known_warnings()
    model = ModelConfig(arch="deepfm", tables=(plain, own), dense_arch_layers=(8, 4))
    module = build_train_model(model, 3, CPU, 0)
    apply_embedding_optimizer(module, job(model).optimizer)
    plan = make_plan(
        module,
        gang_size=2,
        device_type="cpu",
        sharding=ShardingConfig(sharding_type="table_wise"),
        tables=model.tables,
        batch_size=8,
    ).plan["model.sparse_arch.embedding_bag_collection"]
    assert plan["a"].sharding_type == "table_wise"  # type: ignore[index]
    assert len(plan["a"].sharding_spec.shards) == 1  # type: ignore[index]
    assert plan["b"].sharding_type == "column_wise"  # type: ignore[index]
    shards = plan["b"].sharding_spec.shards  # type: ignore[index]
    assert sorted(s.shard_sizes[1] for s in shards) == [64] * 4
    assert {s.placement.rank() for s in shards} == {0, 1}


def test_kernels_and_precision_reach_the_planner_and_the_tables() -> None:
    big = TableConfig(
        name="big",
        num_embeddings=4_000_000,
        embedding_dim=64,
        features=("a",),
        compute_kernel="fused_uvm_caching",
        cache_load_factor=0.1,
    )
    half = TableConfig(name="small", num_embeddings=100, embedding_dim=64, features=("b",),
                       precision="fp16")  # fmt: skip
    got = table_constraints((big, half), ShardingConfig())
    assert got["big"].compute_kernels == ["fused_uvm_caching"]
    assert got["big"].cache_params is not None and got["big"].cache_params.load_factor == 0.1
    assert got["small"].compute_kernels == ["fused"] and got["small"].cache_params is None
    model = ModelConfig(tables=(big, half), dense_arch_layers=(8, 64))
    quiet_known_warnings()
    module = build_train_model(model, 3, CPU, 0)
    ebc = module.model.sparse_arch.embedding_bag_collection
    assert [c.data_type.name for c in ebc.embedding_bag_configs()] == ["FP32", "FP16"]
    apply_embedding_optimizer(module, OptimizerConfig())

    def plan(tables: tuple[TableConfig, ...], gib: float) -> dict[str, Any]:
        return make_plan(
            module, gang_size=1, device_type="cuda", sharding=ShardingConfig(), tables=tables,
            batch_size=512, device_memory=int(gib * 2**30),
        ).plan["model.sparse_arch.embedding_bag_collection"]  # type: ignore[return-value]  # fmt: skip

    # The 1 GiB table fits a 1 GiB budget only in host memory, with a tenth of it cached.
    cached = plan((big, half), 1.0)
    assert cached["big"].compute_kernel == "fused_uvm_caching"
    assert cached["big"].cache_params.load_factor == 0.1
    assert cached["small"].compute_kernel == "fused"
    in_hbm = big.model_copy(update={"compute_kernel": "fused", "cache_load_factor": None})
    with pytest.raises(ConfigError, match=r"within 1.00 GiB of device memory per rank .*"
                       r"compute_kernel='fused_uvm_caching'.*insufficient storage"):  # fmt: skip
        plan((in_hbm, half), 1.0)
    assert plan((in_hbm, half), 8.0)["big"].compute_kernel == "fused"


def test_the_planners_budget_is_the_configured_or_the_gpus_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from types import SimpleNamespace

    from raytrec import preflight

    assert preflight.device_memory(job()) is None  # CPU ranks: no device memory to plan within
    gpu = ScalingConfig(use_gpu=True)
    budget = ShardingConfig(device_memory_gib=2.5)
    assert preflight.device_memory(job(scaling=gpu, sharding=budget)) == int(2.5 * 2**30)
    # Unset: what the driver's GPU says (without one, a one-GPU Ray task asks a GPU node).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    props = SimpleNamespace(total_memory=80 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: props)
    assert preflight.device_memory(job(scaling=gpu)) == 80 * 2**30


def test_train_pipeline_resolves_per_device_and_semi_sync_needs_a_gpu() -> None:
    assert job().resolved_pipeline == "off"
    assert job(train_pipeline="sparse_dist").resolved_pipeline == "sparse_dist"
    assert job(scaling=ScalingConfig(use_gpu=True)).resolved_pipeline == "sparse_dist"
    with pytest.raises(ConfigError, match=r"train_pipeline='semi_sync' cannot run on CPU ranks"):
        job(train_pipeline="semi_sync")
    gpu = job(train_pipeline="semi_sync", scaling=ScalingConfig(use_gpu=True))
    assert gpu.resolved_pipeline == "semi_sync"


def test_uvm_kernels_are_refused_on_cpu_ranks_and_a_cache_needs_one() -> None:
    uvm = TableConfig(name="t", num_embeddings=4, embedding_dim=4, features=("a",),
                      compute_kernel="fused_uvm")  # fmt: skip
    model = ModelConfig(arch="deepfm", tables=(uvm,))
    with pytest.raises(
        ConfigError, match=r"model.tables\[t\].compute_kernel='fused_uvm' cannot run on CPU "
        r"ranks: .*compute_kernel='fused', or set scaling.use_gpu=True",
    ):  # fmt: skip
        job(model)
    assert job(model, scaling=ScalingConfig(use_gpu=True)).model == model
    with pytest.raises(ConfigError, match=r"cache_load_factor=0.5 needs compute_kernel="
                       r"'fused_uvm_caching' \(got 'fused'\)"):  # fmt: skip
        TableConfig(name="t", num_embeddings=4, embedding_dim=4, features=("a",),
                    cache_load_factor=0.5)  # fmt: skip


# -- the DeepFM module --------------------------------------------------------------------------


def random_weights(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def reference_logits(
    model: DeepFM, cfg: ModelConfig, dense: torch.Tensor, kjt: object
) -> torch.Tensor:
    """DeepFM written out: weighted sum pooling per feature, the dense vector, the deep layer
    over everything flattened, the factorization machine's pairwise products, the over arch."""
    bags = model.sparse_arch.embedding_bag_collection.embedding_bags
    jagged = kjt.to_dict()  # type: ignore[attr-defined]
    pooled = []
    for t in cfg.tables:
        for f in t.features:
            jt = jagged[f]
            pooled.append(
                F.embedding_bag(
                    jt.values(),
                    bags[t.name].weight,
                    jt.offsets()[:-1].long(),
                    mode="sum",
                    per_sample_weights=jt.weights() if t.weighted else None,
                )
            )
    parts = ([model.dense_arch(dense)] if model.dense_arch is not None else []) + pooled
    x = torch.cat(parts, dim=1)
    deep = torch.relu(model.inter_arch.deep_fm.dense_module[0](x))
    # sum over pairs of distinct entries of x of their products
    fm = 0.5 * (x.sum(1, keepdim=True) ** 2 - (x * x).sum(1, keepdim=True))
    head = parts[0] if model.dense_arch is not None else x[:, :0]
    return model.over_arch(torch.cat([head, deep, fm], dim=1))


@pytest.mark.parametrize("num_dense", [3, 0])
def test_deepfm_computes_deepfm_with_weights_and_per_table_dims(num_dense: int) -> None:
    quiet_known_warnings()
    model = build_model(DEEPFM, num_dense, CPU, 0, embedding_device=CPU)
    assert isinstance(model, DeepFM)
    assert (model.dense_arch is None) == (num_dense == 0)
    assert model.sparse_arch.embedding_bag_collection.is_weighted()
    random_weights(model, 1)
    spec = parquet_spec(job(num_dense=num_dense))
    batch, _ = to_batch(rows(num_dense=num_dense), spec)
    assert batch.dense_features.shape == (6, num_dense)
    got = model(batch.dense_features, batch.sparse_features)
    want = reference_logits(model, DEEPFM, batch.dense_features, batch.sparse_features)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # Weights matter: the same ids with all weights 1 score differently.
    kjt = batch.sparse_features
    ones = type(kjt)(
        keys=kjt.keys(),
        values=kjt.values(),
        lengths=kjt.lengths(),
        weights=torch.ones_like(kjt.weights()),
    )
    assert not torch.allclose(model(batch.dense_features, ones), got, atol=1e-3)
    # Logits, not probabilities: TorchRec's SimpleDeepFMNN would end in a sigmoid.
    assert (got.abs() > 1).any() or (got < 0).any()


def test_deepfm_seeds_dense_layers_and_leaves_embeddings_on_meta() -> None:
    a = build_train_model(DEEPFM, 3, CPU, 7)
    b = build_train_model(DEEPFM, 3, CPU, 7)
    c = build_train_model(DEEPFM, 3, CPU, 8)
    dense = [k for k, v in a.state_dict().items() if not v.is_meta]
    assert dense and all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in dense)
    assert not all(torch.equal(a.state_dict()[k], c.state_dict()[k]) for k in dense)
    assert all(v.is_meta for k, v in a.state_dict().items() if k.startswith("model.sparse_arch."))
    assert isinstance(a, DLRMTrain)


# -- weighted ids from Arrow ------------------------------------------------------------------


def test_weights_follow_their_ids_into_the_kjt() -> None:
    table = rows()
    batch, _ = to_batch(table, parquet_spec(job()))
    kjt = batch.sparse_features
    for f in ("u", "i", "j"):
        jt = kjt[f]
        assert jt.values().tolist() == [x for row in table.column(f).to_pylist() for x in row]
        want = (
            [1.0] * len(jt.values())  # an unweighted feature of a weighted batch: weight 1
            if f == "u"
            else [x for row in table.column(f"{f}_weights").to_pylist() for x in row]
        )
        np.testing.assert_allclose(jt.weights().numpy(), want, rtol=1e-6)
    # The preprocessing's internal layout carries the weights through.
    spec = parquet_spec(job())
    again, _ = internal_columns_of(spec).decode(preprocess(table, spec=spec, on_bad_rows="error"))
    assert torch.equal(again.sparse_features.weights(), kjt.weights())
    assert torch.equal(again.sparse_features.values(), kjt.values())


def with_column(table: pa.Table, name: str, values: list[object]) -> pa.Table:
    i = table.column_names.index(name)
    return table.set_column(i, name, pa.array(values, table.schema.field(name).type))


def test_bad_weights_name_file_column_and_row() -> None:
    table, spec = rows(), parquet_spec(job())
    ids = table.column("i").to_pylist()
    r = next(k for k, x in enumerate(ids) if len(x) >= 1)
    short = [[0.5] * len(x) for x in ids]
    short[r] = short[r][:-1]
    with pytest.raises(
        BadInputError,
        match=rf"column 'i_weights', row {r}: {len(ids[r]) - 1} weights for {len(ids[r])} ids",
    ) as e:
        to_batch(with_column(table, "i_weights", short), spec, file="part-0.parquet")
    assert e.value.reason == "weights_length_mismatch" and e.value.file == "part-0.parquet"
    bad = [[0.5] * len(x) for x in ids]
    bad[r][-1] = math.nan
    with pytest.raises(
        BadInputError, match=rf"column 'i_weights', row {r}: weight nan is not finite"
    ):
        to_batch(with_column(table, "i_weights", bad), spec)
    huge = [[0.5] * len(x) for x in ids]
    huge[r][0] = 1e300  # finite as a double, inf as the float32 the model takes
    table64 = table.set_column(
        table.column_names.index("i_weights"), "i_weights", pa.array(huge, pa.list_(pa.float64()))
    )
    with pytest.raises(BadInputError, match=r"weight inf is not finite"):
        to_batch(table64, spec)
    # Skipping drops the bad row and counts it.
    batch, report = to_batch(with_column(table, "i_weights", bad), spec, on_bad_rows="skip")
    assert report.skipped == {"non_finite_weight": 1} and report.rows_out == table.num_rows - 1
    assert torch.isfinite(batch.sparse_features.weights()).all()
    wrong = table.set_column(
        table.column_names.index("i_weights"), "i_weights", pa.array([["x"]] * 6)
    )
    with pytest.raises(BadInputError, match=r"column 'i_weights'.*expected list<float>"):
        to_batch(wrong, spec)


def test_a_dropped_null_id_drops_its_weight() -> None:
    from raytrec.data.spec import FeatureSpec, SparseFeature

    spec = FeatureSpec(
        dense=(),
        sparse=(SparseFeature(name="a", num_embeddings=10, null_id_policy="drop", weights="w"),),
    )
    table = pa.table(
        {
            "a": pa.array([[1, None, 3], None, [4]], pa.list_(pa.int64())),
            "w": pa.array([[0.1, 0.2, 0.3], None, [0.4]], pa.list_(pa.float32())),
            "label": pa.array([0.0, 1.0, 0.0], pa.float32()),
        }
    )
    batch, _ = to_batch(table, spec)
    jt = batch.sparse_features["a"]
    assert jt.values().tolist() == [1, 3, 4] and jt.lengths().tolist() == [2, 0, 1]
    np.testing.assert_allclose(jt.weights().numpy(), [0.1, 0.3, 0.4], rtol=1e-6)
    assert batch.dense_features.shape == (3, 0)


# -- a DeepFM's export and load -----------------------------------------------------------------


@pytest.mark.parametrize("num_dense", [3, 0])
def test_deepfm_exports_loads_and_scores_like_the_trained_module(
    num_dense: int, tmp_path: Path
) -> None:
    quiet_known_warnings()
    config = job(num_dense=num_dense)
    trained = DLRMTrain(build_model(DEEPFM, num_dense, CPU, 0, embedding_device=CPU))  # type: ignore[arg-type]
    random_weights(trained, 2)
    final = tmp_path / "final_model"
    dcp.save(trained.state_dict(), checkpoint_id=str(final), no_dist=True)
    write_model_spec(str(final), ModelSpec.for_config(config, num_dense))
    info = export(str(final), tmp_path / "export")
    assert info.spec.kind == "DeepFM" and info.spec.num_dense == num_dense
    assert info.program is not None, info.program_error
    model, loaded = load_exported(tmp_path / "export")
    assert loaded.spec == info.spec and isinstance(model, DeepFM)
    batch, row_ids = make_batch(rows(num_dense=num_dense, seed=3), loaded.spec)
    assert row_ids is not None and row_ids.tolist() == list(range(6))
    with torch.no_grad():
        want = torch.sigmoid(trained.model(batch.dense_features, batch.sparse_features).double())
    torch.testing.assert_close(score(model, batch), want.reshape(-1), rtol=0, atol=1e-6)
    program = load_program(tmp_path / "export")
    with torch.no_grad():
        logits = program(batch.dense_features, batch.sparse_features)
    torch.testing.assert_close(
        torch.sigmoid(logits.double()).reshape(-1), want.reshape(-1), rtol=0, atol=1e-6
    )
    # A spec without the weights columns would feed a weighted model unweighted batches.
    unweighted = parquet_spec(
        config.replace(model=ModelConfig(arch="deepfm", tables=tables(weighted=False)))
    )
    with pytest.raises(
        ValueError, match=r"no weights column for the weighted features \['i', 'j'\]"
    ):
        ModelSpec(model=DEEPFM, num_dense=num_dense, features=unweighted)
