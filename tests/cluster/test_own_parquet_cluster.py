"""examples/own_parquet.py end to end, small: a user's own column names (a string user id with
a vocabulary, hashed string tags, 1-based integer item ids, named dense and label columns, no
row id) train on 2 gangs x 2 ranks with held-out evaluation; the best checkpoint by held-out AUC
is exported with its vocabulary and scores rows in one process exactly as ``raytrec.evaluate``
scores them."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import raytrec
from raytrec.serving.export import load_exported, score

pytestmark = pytest.mark.cluster


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """The Mann-Whitney form of AUC: the chance a positive outscores a negative (ties: 1/2)."""
    pos, neg = scores[labels == 1], scores[labels == 0]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(wins / (len(pos) * len(neg)))


EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "own_parquet.py"


def test_own_columns_to_a_model_that_scores_new_rows(
    local_ray: None, tmp_path: pathlib.Path
) -> None:
    spec = importlib.util.spec_from_file_location("own_parquet", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = example.main(["--out", str(tmp_path), "--rows", "6144", "--steps", "20"])
    result = out["result"]

    # The best kept checkpoint is the one of the highest held-out AUC.
    evals = {m.step: m.eval_auc for m in result.history if m.eval_auc is not None}
    assert len(evals) == 2
    best, metrics = result.best_checkpoints[0]
    assert metrics["eval_auc"] == pytest.approx(max(evals.values()))
    # The export carries the user vocabulary, fitted on the training files.
    with open(os.path.join(out["export"].path, "model.json")) as f:
        doc = json.load(f)
    [user] = [f for f in doc["spec"]["features"]["sparse"] if f["name"] == "user"]
    train_users = set()
    for p in sorted((tmp_path / "train").glob("*.parquet")):
        train_users |= set(pq.read_table(p, columns=["user"])["user"].to_pylist())
    assert user["kind"] == "categorical" and set(user["vocabulary"]) == train_users
    # Scored in this process, the held-out rows give the AUC raytrec.evaluate reports.
    model, info = load_exported(out["export"].path)
    held = pq.read_table(sorted((tmp_path / "held_out").glob("*.parquet")))
    batch, _ = raytrec.make_batch(held, info.spec)
    scores = score(model, batch).numpy()
    labels = held["clicked"].to_numpy()
    evaluated = raytrec.evaluate(best, str(tmp_path / "held_out"))
    assert evaluated.rows == len(labels)
    assert roc_auc(labels, scores) == pytest.approx(evaluated.auc, abs=1e-6)
    assert evaluated.auc == pytest.approx(metrics["eval_auc"], abs=1e-6)
    # An unseen user is out of vocabulary: id 0.
    new = [{"user": "someone-new", "item": 3, "tags": ["tag-1"], "age": 40.0, "price": 2.0}]
    kjt = raytrec.make_batch(new, info.spec)[0].sparse_features
    assert kjt["user"].values().tolist() == [0]
    assert np.isfinite(out["scores"]).all() and torch.is_tensor(kjt.values())


def test_own_columns_without_dense_ones_train_a_deepfm(
    local_ray: None, tmp_path: pathlib.Path
) -> None:
    """The same example with ``--model deepfm``: a log of ids only (string users and tags,
    integer items; no numeric column at all) trains a DeepFM with ``columns.dense: []``, and its
    export scores rows of ids alone as ``raytrec.evaluate`` scores them."""
    spec = importlib.util.spec_from_file_location("own_parquet", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = example.main(
        ["--out", str(tmp_path), "--rows", "6144", "--steps", "20", "--model", "deepfm"]
    )
    held = pq.read_table(sorted((tmp_path / "held_out").glob("*.parquet")))
    assert held.column_names == ["user", "item", "tags", "clicked"]  # no dense column
    result = out["result"]
    assert result.config.model.arch == "deepfm" and result.config.data.columns.dense == ()
    best = result.best_checkpoints[0]
    model, info = load_exported(out["export"].path)
    assert info.spec.num_dense == 0
    scores = score(model, raytrec.make_batch(held, info.spec)[0]).numpy()
    evaluated = raytrec.evaluate(best.checkpoint, str(tmp_path / "held_out"))
    assert roc_auc(held["clicked"].to_numpy(), scores) == pytest.approx(evaluated.auc, abs=1e-6)
    assert evaluated.auc == pytest.approx(best.metrics["eval_auc"], abs=1e-6)
    assert evaluated.auc > 0.55  # it learned the users', items' and tags' tastes
    assert np.isfinite(out["scores"]).all()
