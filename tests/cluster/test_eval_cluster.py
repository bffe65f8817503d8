"""Held-out evaluation while the job trains (TrainConfig.eval, fit(eval_source=...)).

One job (2 gangs x 2 ranks, shared by both tests) trains on 6 files of generated Parquet and
evaluates on the 2 files held out (same teacher, other rows) every 4 steps until early stopping
ends it. The evaluation scores every held-out row once (in rounds over the 4 ranks, the last one
padded), merges AUC, NE and log loss over all of them: its NE is its log loss over the entropy
of the held-out rows' click rate, read here from the files. (That scoring matches a
single-process model and updates nothing is tests/multiprocess/test_engine_2d.py's parity test.)
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest

from raytrec.api import Result, fit
from raytrec.checkpoint.config import CheckpointConfig
from raytrec.config import (
    DataConfig,
    EvalConfig,
    ModelConfig,
    ScalingConfig,
    TrainConfig,
    criteo_tables,
)
from raytrec.data.generate import write_synthetic_parquet
from raytrec.elastic.events import CheckpointSaved, EarlyStopped
from raytrec.observability.progress import METRICS_FILE

pytestmark = pytest.mark.cluster


def split_data(tmp_path: pathlib.Path, *, seed: int) -> tuple[pathlib.Path, pathlib.Path]:
    """8 files of generated Parquet, 512 rows each: 6 to train on, 2 held out."""
    data = write_synthetic_parquet(
        tmp_path / "all",
        rows=8 * 512,
        files=8,
        row_groups_per_file=1,
        seed=seed,
        num_embeddings=500,
    )
    train, held = tmp_path / "train", tmp_path / "held_out"
    train.mkdir(), held.mkdir()
    for i, path in enumerate(data.paths):
        shutil.move(path, (held if i >= 6 else train) / os.path.basename(path))
    return train, held


@pytest.fixture(scope="module")
def early_stopped_run(
    local_ray: None, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Result, pathlib.Path]:
    """One job that both tests check (one fit: most of a run is its ranks starting).

    Checkpoints ranked by held-out AUC, lowest first (``checkpoint_score_order="min"``, so
    the best one is not simply the newest): one is saved at every evaluation, and after each
    save only the best and the newest are left. Early stopping with a ``min_delta`` of 1 (no
    AUC can improve by more) ends the job after ``patience`` evaluations past the first."""
    tmp_path = tmp_path_factory.mktemp("eval")
    train, held = split_data(tmp_path, seed=6)
    config = TrainConfig(
        model=ModelConfig(tables=criteo_tables(num_features=26, num_embeddings=500)),
        scaling=ScalingConfig(num_workers=4, gang_size=2),
        data=DataConfig(source="parquet", path=str(train), batch_size=32),
        # 96 rows per batch: 11 batches over 4 ranks, so the third round is padded.
        eval=EvalConfig(
            every_n_steps=4,
            batch_size=96,
            early_stopping_patience=3,
            early_stopping_min_delta=1.0,
        ),
        checkpoint=CheckpointConfig(
            checkpoint_score_attribute="eval_auc", checkpoint_score_order="min", num_to_keep=1
        ),
        num_steps=40,
        log_every=4,
        storage_path=str(tmp_path / "runs"),
    )
    return fit(config, eval_source=str(held), shutdown_ray=False), held


def test_evaluation_scores_every_held_out_row_and_changes_nothing(
    early_stopped_run: tuple[Result, pathlib.Path],
) -> None:
    result, held = early_stopped_run
    held_rows = sum(pq.read_metadata(p).num_rows for p in held.glob("*.parquet"))
    labels = np.concatenate(
        [pq.read_table(p, columns=["label"])["label"].to_numpy() for p in held.glob("*.parquet")]
    )
    rate = float(labels.mean())
    entropy = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))

    assert [m.step for m in result.history] == [4, 8, 12, 16]
    for row in result.history:
        assert row.eval_rows == held_rows == 1024
        assert row.eval_auc is not None and 0.0 < row.eval_auc < 1.0
        assert row.eval_log_loss is not None and math.isfinite(row.eval_log_loss)
        assert row.eval_ne == pytest.approx(row.eval_log_loss / entropy, rel=1e-6)
    assert result.history[0].eval_auc != result.history[1].eval_auc  # the model moved
    # In the metrics file and the ledger.
    with open(os.path.join(result.run_dir, METRICS_FILE)) as f:
        rows = [json.loads(line) for line in f]
    assert [r["eval_auc"] for r in rows] == [m.eval_auc for m in result.history]
    ledger = result.ledger()
    assert ledger["final"]["eval_rows"] == 1024
    best = max(result.history, key=lambda m: np.float64(m.eval_auc))
    assert ledger["best"]["eval_auc"] == {"value": best.eval_auc, "step": best.step}


def test_the_best_checkpoint_by_eval_is_kept_and_early_stopping_ends_the_job(
    early_stopped_run: tuple[Result, pathlib.Path],
) -> None:
    result, _ = early_stopped_run
    # Early stopping: evaluations at 4, 8, 12 and 16, none better than the first by 1.
    assert [m.step for m in result.history] == [4, 8, 12, 16]
    assert result.steps == 16
    [early] = result.events.of(EarlyStopped)
    assert (early.step, early.best_step, early.metric) == (16, 4, "eval_auc")
    assert result.stopped_early is not None and "eval_auc did not improve" in result.stopped_early
    assert result.ledger()["stopped_early"] == result.stopped_early
    # A checkpoint at every evaluation; the lowest eval AUC and the newest are kept.
    saved = [e.uri for e in result.events.of(CheckpointSaved)]
    assert len(saved) == 4
    by_step = {m.step: m.eval_auc for m in result.history}
    worst = min(by_step, key=lambda s: by_step[s])
    kept = [uri for uri in saved if os.path.exists(uri)]
    assert sorted(kept) == sorted({saved[[4, 8, 12, 16].index(worst)], saved[-1]})
    best_uri, best_metrics = result.best_checkpoints[0]
    assert best_uri.path == saved[[4, 8, 12, 16].index(worst)]
    assert best_metrics["eval_auc"] == pytest.approx(by_step[worst])
    assert result.ledger()["artifacts"]["best_checkpoint"] == best_uri.path
    # One typed object: the step it was saved at, its metrics, its path.
    best = result.best_checkpoints[0]
    assert (best.step, best.path, best.metrics) == (worst, best_uri.path, best_metrics)
