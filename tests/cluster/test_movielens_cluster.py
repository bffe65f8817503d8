"""examples/movielens/train.py end to end, short: MovieLens-100k converted from the installed
package, a DeepFM over string ids trained a few steps on 2 gangs x 2 ranks with validation AUC,
the best checkpoint evaluated on the test split, exported, loaded in one process and scoring the
test rows as ``raytrec.evaluate`` scores them. Skips only where the data's package is absent."""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pyarrow.parquet as pq
import pytest

import raytrec
from raytrec.data.generate import auc
from raytrec.data.movielens import find_ml100k

pytestmark = pytest.mark.cluster

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "movielens" / "train.py"


def test_movielens_trains_keeps_the_best_checkpoint_and_scores_the_test_split(
    local_ray: None, tmp_path: pathlib.Path
) -> None:
    try:
        find_ml100k()
    except FileNotFoundError as e:
        pytest.skip(f"{e} (this test trains on RecBole's copy of MovieLens-100k)")
    spec = importlib.util.spec_from_file_location("movielens_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    sets = ("num_steps=12", "log_every=6", "eval.every_n_steps=6")
    out = example.main(["--out", str(tmp_path), *(a for s in sets for a in ("--set", s))])

    result = out["result"]
    evals = {m.step: m.eval_auc for m in result.history if m.eval_auc is not None}
    assert sorted(evals) == [6, 12]
    best = result.best_checkpoints[0]
    assert best.metrics["eval_auc"] == pytest.approx(max(evals.values()))
    assert out["validation_auc"] == pytest.approx(best.metrics["eval_auc"], abs=1e-4)
    # The vocabularies were fitted on the training split: every user id of it has a row.
    train_users = set(pq.read_table(tmp_path / "train", columns=["user_id"])["user_id"].to_pylist())
    model = raytrec.load_model(out["export"].path)
    [user] = [f for f in out["export"].spec.features.sparse if f.name == "user_id"]
    assert set(user.vocabulary) == train_users
    # The export scores the test split in this process as the evaluation scored it.
    test = pq.read_table(tmp_path / "test")
    scores = raytrec.score(model, raytrec.make_batch(test, out["export"].spec)[0]).numpy()
    assert auc(scores, test["label"].to_numpy()) == pytest.approx(out["test_auc"], abs=1e-4)
    assert out["test_auc"] > 0.6  # 12 steps of 1,024 ratings already rank above chance
    assert np.isfinite(out["scores"]).all()
