"""Export, evaluate and predict on what a real job writes: a 1 x 2 fit on Parquet (each table on
one of two ranks), its last checkpoint and its final model, scored on held-out rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from test_serving import CONFIG, IDS, reference_model

from raytrec.api import Result, fit
from raytrec.checkpoint.config import CheckpointConfig
from raytrec.config import DataConfig, ScalingConfig, TrainConfig
from raytrec.data.generate import auc, write_synthetic_parquet
from raytrec.serving.evaluate import evaluate, predict
from raytrec.serving.export import STATE_FILE, export, load_model, make_batch, score
from raytrec.serving.model_spec import MODEL_SPEC

pytestmark = pytest.mark.cluster

HELD_OUT = 500


@pytest.fixture(scope="module")
def run(local_ray: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    tmp = tmp_path_factory.mktemp("serving")
    train, held_out = tmp / "train", tmp / "held_out"
    write_synthetic_parquet(train, rows=1024, files=2, row_groups_per_file=2, num_embeddings=IDS)
    write_synthetic_parquet(
        held_out, rows=HELD_OUT, files=2, row_groups_per_file=1, seed=99, num_embeddings=IDS
    )
    config = TrainConfig(
        model=CONFIG.model,
        scaling=ScalingConfig(num_workers=2, gang_size=2),
        data=DataConfig(source="parquet", path=str(train), batch_size=64),
        checkpoint=CheckpointConfig(every_n_steps=4, checkpoint_at_end=True),
        num_steps=8,
        log_every=4,
        storage_path=str(tmp / "runs"),
    )
    result = fit(config, shutdown_ray=False)
    return {"result": result, "tmp": tmp, "held_out": held_out}


def test_checkpoint_and_final_model_export_to_the_same_model(run: dict[str, object]) -> None:
    result, tmp = run["result"], run["tmp"]
    assert isinstance(result, Result) and isinstance(tmp, Path)
    assert result.checkpoint is not None and result.final_state_path is not None
    assert (Path(result.checkpoint.path) / MODEL_SPEC).is_file()
    assert (Path(result.final_state_path) / MODEL_SPEC).is_file()
    from_checkpoint = export(result.checkpoint, tmp / "from_checkpoint", program=False)
    from_final = export(result, tmp / "from_final")
    assert from_checkpoint.step == 8 and from_checkpoint.source_kind == "checkpoint"
    assert from_final.source_kind == "final_model" and from_final.program is not None
    a = torch.load(tmp / "from_checkpoint" / STATE_FILE, weights_only=True)
    b = torch.load(tmp / "from_final" / STATE_FILE, weights_only=True)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)  # both hold the model of step 8
    tables = [k for k in a if k.startswith("sparse_arch.embedding_bag_collection")]
    assert len(tables) == 4 and all(a[k].shape == (IDS, 8) for k in tables)
    # The checkpoint of step 4 holds another model: the job trained between the two.
    earlier = export(Path(result.checkpoint.path).parent / "checkpoint_0000000004", tmp / "at4")
    assert earlier.step == 4
    c = torch.load(tmp / "at4" / STATE_FILE, weights_only=True)
    assert all(not torch.equal(a[k], c[k]) for k in tables)


def test_exported_model_scores_equal_plain_torchrec(run: dict[str, object]) -> None:
    tmp, held_out = run["tmp"], run["held_out"]
    assert isinstance(tmp, Path) and isinstance(held_out, Path)
    path = tmp / "scored"
    result = run["result"]
    info = export(result, path, program=False)
    model = load_model(path)
    reference = reference_model(path)
    batch, _ = make_batch(pq.read_table(held_out), info.spec)
    with torch.no_grad():
        theirs = torch.sigmoid(
            reference(batch.dense_features, batch.sparse_features).double()
        ).reshape(-1)
    assert torch.allclose(score(model, batch), theirs, atol=1e-6, rtol=0)


def test_evaluate_and_predict_agree_with_closed_form(run: dict[str, object]) -> None:
    result, held_out = run["result"], run["held_out"]
    assert isinstance(result, Result) and isinstance(held_out, Path)
    metrics = evaluate(result.checkpoint, str(held_out))
    assert metrics.rows == HELD_OUT and metrics.step == 8
    scored = predict(result.checkpoint, str(held_out), batch_size=128, num_workers=2).to_pandas()
    # Exactly one score per input row, each under its own row id and label.
    assert len(scored) == HELD_OUT
    assert sorted(scored["row_id"]) == list(range(HELD_OUT))
    rows = pq.read_table(held_out).to_pandas().set_index("row_id")
    scored = scored.set_index("row_id").sort_index()
    assert np.array_equal(scored["label"].to_numpy(), rows.loc[scored.index, "label"].to_numpy())
    p = scored["score"].to_numpy()
    y = scored["label"].to_numpy().astype(np.float64)
    log_loss = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
    assert metrics.log_loss == pytest.approx(log_loss, abs=1e-6)
    assert metrics.auc == pytest.approx(auc(p, y), abs=1e-6)
    assert 0.0 < metrics.auc < 1.0 and metrics.ne is not None


def test_the_predict_command_prints_one_line_and_writes_the_scores(
    run: dict[str, object], tmp_path: Path
) -> None:
    """``python -m jobs.predict`` as a user runs it (its own embedded cluster, output not a
    terminal): one line on stdout, nothing on stderr (Ray's lines, Ray Data's progress bars and
    its actors' native warnings go to the predictions' ``_logs/``), and the same scores as
    :func:`predict`'s lazy dataset, which a user's script consumes without a line printed."""
    import os
    import subprocess
    import sys

    result, held_out = run["result"], run["held_out"]
    assert isinstance(result, Result) and result.checkpoint is not None
    out = tmp_path / "predictions"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    command = [sys.executable, "-m", "jobs.predict", result.checkpoint.path, str(held_out)]
    done = subprocess.run(
        [*command, str(out), "--workers", "1", "--batch-size", "128"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=env,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    [line] = done.stdout.splitlines()
    assert line.startswith(f"[raytrec] predicted {HELD_OUT} rows with the model (step 8) in ")
    assert line.endswith(f"Ray's output: {out}/_logs")
    assert {"driver.log", "workers.log", "native.log"} <= set(os.listdir(out / "_logs"))
    written = pq.read_table(out).to_pandas().sort_values("row_id")
    assert written["row_id"].tolist() == list(range(HELD_OUT))

    # The lazy dataset, consumed in a user's script (its own embedded cluster: one scoring actor
    # leaves a CPU of the machine's two for reading): nothing printed (no Ray Data progress bar,
    # INFO record or core worker line), the same scores.
    lazy = tmp_path / "lazy.parquet"
    script = (
        "import sys, raytrec\n"
        "scored = raytrec.predict(sys.argv[1], sys.argv[2], batch_size=128, num_workers=1)\n"
        "scored.to_pandas().to_parquet(sys.argv[3])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, result.checkpoint.path, str(held_out), str(lazy)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=env,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout + done.stderr == ""
    expected = pq.read_table(lazy).to_pandas().sort_values("row_id")
    assert written["row_id"].tolist() == expected["row_id"].tolist()
    assert written["label"].tolist() == expected["label"].tolist()
    assert np.allclose(written["score"], expected["score"], atol=1e-7)
