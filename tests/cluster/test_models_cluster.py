"""DLRM, a DeepFM with weighted ids and no dense columns (one table table-wise and one
column-wise) and a two-tower model, each trained end to end on Ray (2 gangs x 2 ranks),
exported, loaded in one process and scored: the same scores as ``predict`` on held-out rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raytrec.api import fit
from raytrec.config import (
    DataConfig,
    ModelConfig,
    ScalingConfig,
    SyncConfig,
    TableConfig,
    TrainConfig,
    criteo_tables,
)
from raytrec.data.generate import write_synthetic_parquet
from raytrec.models import DeepFM
from raytrec.models.two_tower import TwoTower
from raytrec.serving.evaluate import evaluate, predict
from raytrec.serving.export import export, load_model, make_batch, score

pytestmark = pytest.mark.cluster

IDS = 30


def write_rows(path: Path, n: int, seed: int) -> None:
    """Rows whose label depends on the weighted feature's weights, in two files."""
    rng = np.random.default_rng(seed)
    users = [rng.integers(0, IDS, rng.integers(1, 3)).tolist() for _ in range(n)]
    items = [rng.integers(0, IDS, rng.integers(0, 4)).tolist() for _ in range(n)]
    weights = [rng.uniform(0.0, 2.0, len(x)).tolist() for x in items]
    labels = [float(sum(w) > 1.5) for w in weights]
    table = pa.table(
        {
            "user": pa.array(users, pa.list_(pa.int64())),
            "item": pa.array(items, pa.list_(pa.int64())),
            "item_weights": pa.array(weights, pa.list_(pa.float32())),
            "label": pa.array(labels, pa.float32()),
            "row_id": pa.array(np.arange(n), pa.int64()),
        }
    )
    path.mkdir()
    half = n // 2
    pq.write_table(table.slice(0, half), path / "part-0.parquet")
    pq.write_table(table.slice(half), path / "part-1.parquet")


def test_dlrm_trains_exports_and_scores_like_predict(local_ray: None, tmp_path: Path) -> None:
    train, held_out = tmp_path / "train", tmp_path / "held_out"
    write_synthetic_parquet(train, rows=512, files=2, row_groups_per_file=1, num_embeddings=IDS)
    write_synthetic_parquet(
        held_out, rows=200, files=2, row_groups_per_file=1, seed=7, num_embeddings=IDS
    )
    config = TrainConfig(
        model=ModelConfig(tables=criteo_tables(num_features=4, num_embeddings=IDS)),
        scaling=ScalingConfig(num_workers=4, gang_size=2),
        sync=SyncConfig(sync_every=2),
        data=DataConfig(source="parquet", path=str(train), batch_size=32),
        num_steps=4,  # one pass: 512 rows over 4 ranks of 32
        log_every=2,
        storage_path=str(tmp_path / "runs"),
    )
    result = fit(config, shutdown_ray=False)
    info = export(result, tmp_path / "export", program=False)
    assert info.spec.kind == "DLRM"
    model = load_model(tmp_path / "export")
    batch, row_ids = make_batch(pq.read_table(held_out), info.spec)
    mine = score(model, batch).numpy()
    scored = predict(result, str(held_out), batch_size=64, num_workers=2).to_pandas()
    theirs = scored.set_index("row_id").loc[row_ids, "score"].to_numpy()
    assert len(theirs) == 200
    np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-6)


def test_deepfm_with_weighted_ids_trains_exports_and_scores_like_predict(
    local_ray: None, tmp_path: Path
) -> None:
    train, held_out = tmp_path / "train", tmp_path / "held_out"
    write_rows(train, 512, seed=1)
    write_rows(held_out, 200, seed=2)
    tables = (
        TableConfig(name="t_user", num_embeddings=IDS, embedding_dim=4, features=("user",)),
        TableConfig(
            name="t_item",
            num_embeddings=IDS,
            embedding_dim=8,
            features=("item",),
            weighted=True,
            sharding_types=("column_wise",),
            min_partition=4,
        ),
    )
    config = TrainConfig(
        model=ModelConfig(
            arch="deepfm", tables=tables, over_arch_layers=(8, 1), deep_fm_dimension=8
        ),
        scaling=ScalingConfig(num_workers=4, gang_size=2),
        sync=SyncConfig(sync_every=2),
        data=DataConfig(source="parquet", path=str(train), batch_size=32, num_dense=0),
        num_steps=4,  # one pass: 512 rows over 4 ranks of 32
        log_every=2,
        storage_path=str(tmp_path / "runs"),
    )
    result = fit(config, shutdown_ray=False)
    assert result.final_state_path is not None
    info = export(result, tmp_path / "export", program=False)
    assert info.spec.kind == "DeepFM" and info.spec.num_dense == 0
    model = load_model(tmp_path / "export")
    assert isinstance(model, DeepFM) and model.dense_arch is None
    rows = pq.read_table(held_out)
    batch, row_ids = make_batch(rows, info.spec)
    assert batch.dense_features.shape == (200, 0) and batch.sparse_features.weights() is not None
    mine = score(model, batch).numpy()
    scored = predict(result, str(held_out), batch_size=64, num_workers=2).to_pandas()
    theirs = scored.set_index("row_id").loc[row_ids, "score"].to_numpy()
    np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-6)
    metrics = evaluate(result, str(held_out))
    y = rows.column("label").to_numpy().astype(np.float64)
    p = mine.astype(np.float64)
    log_loss = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
    assert metrics.rows == 200 and metrics.log_loss == pytest.approx(log_loss, abs=1e-6)
    # Training moved the model: its weights are not where a fresh one starts.
    state = torch.load(tmp_path / "export" / "model.pt", weights_only=True)
    assert state["sparse_arch.embedding_bag_collection.embedding_bags.t_item.weight"].shape == (
        IDS,
        8,
    )


def write_pairs(path: Path, n: int, seed: int) -> None:
    """Users who click one item each (``7 * user % IDS``): half the rows show it (clicked), half
    a random item (clicked only if it happens to be theirs)."""
    rng = np.random.default_rng(seed)
    users = rng.integers(0, IDS, n)
    liked = (7 * users) % IDS
    shown = np.where(rng.random(n) < 0.5, liked, rng.integers(0, IDS, n))
    table = pa.table(
        {
            "dense_0": pa.array(rng.normal(size=n), pa.float32()),
            "user": pa.array(users, pa.int64()),
            "item": pa.array(shown, pa.int64()),
            "label": pa.array((shown == liked).astype(np.float32)),
            "row_id": pa.array(np.arange(n), pa.int64()),
        }
    )
    path.mkdir()
    pq.write_table(table.slice(0, n // 2), path / "part-0.parquet")
    pq.write_table(table.slice(n // 2), path / "part-1.parquet")


def test_two_tower_trains_on_2x2_reports_recall_and_scores_like_predict(
    local_ray: None, tmp_path: Path
) -> None:
    train, held_out = tmp_path / "train", tmp_path / "held_out"
    write_pairs(train, 2048, seed=1)
    write_pairs(held_out, 400, seed=2)
    tables = (
        TableConfig(name="t_user", num_embeddings=IDS, embedding_dim=8, features=("user",)),
        TableConfig(name="t_item", num_embeddings=IDS, embedding_dim=8, features=("item",)),
    )
    config = TrainConfig(
        model=ModelConfig(
            arch="two_tower", tables=tables, user_features=("user",), tower_layers=(16, 8)
        ),
        scaling=ScalingConfig(num_workers=4, gang_size=2),
        data=DataConfig(source="parquet", path=str(train), batch_size=32, num_dense=1, epochs=6),
        num_steps=None,  # every batch of the 6 epochs: 96 steps
        log_every=24,
        storage_path=str(tmp_path / "runs"),
    )
    result = fit(config, shutdown_ray=False)
    assert result.steps == 96
    info = export(result, tmp_path / "export", program=False)
    model = load_model(tmp_path / "export")
    assert info.spec.kind == "TwoTower" and isinstance(model, TwoTower)
    rows = pq.read_table(held_out)
    batch, row_ids = make_batch(rows, info.spec)
    mine = score(model, batch).numpy()
    scored = predict(result, str(held_out), batch_size=64, num_workers=2).to_pandas()
    theirs = scored.set_index("row_id").loc[row_ids, "score"].to_numpy()
    np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-6)
    metrics = evaluate(result, str(held_out), recall_at=(1, 5))
    assert metrics.recall_at_k is not None
    print(f"two-tower held-out recall@k over {IDS} items: {metrics.recall_at_k}, AUC {metrics.auc}")
    # Chance is k / 30; each user's item is learned.
    assert metrics.recall_at_k[1] > 0.5 and metrics.recall_at_k[5] > 0.8
