"""A job whose length is ``data.epochs`` passes over Parquet (``num_steps=None``), read by index
with rows shuffled within a window: one rank trains every batch of 2 epochs, each row exactly
once per epoch, and the progress bar and the ledger show the length the data gave."""

from __future__ import annotations

import collections
import io
import pathlib

import pytest

from raytrec.api import fit
from raytrec.config import DataConfig, ModelConfig, ScalingConfig, TrainConfig, criteo_tables
from raytrec.data.generate import write_synthetic_parquet
from raytrec.observability.progress import ProgressReporter
from raytrec.testing import committed_row_ids

pytestmark = pytest.mark.cluster


def test_epochs_alone_set_the_length_of_a_shuffled_job(
    local_ray: None, tmp_path: pathlib.Path
) -> None:
    data = write_synthetic_parquet(
        tmp_path / "data", rows=512, files=2, row_groups_per_file=2, seed=3, num_embeddings=100
    )
    config = TrainConfig(
        model=ModelConfig(tables=criteo_tables(num_features=4, num_embeddings=100)),
        scaling=ScalingConfig(num_workers=1, gang_size=1),
        # 512 rows per epoch: 8 batches of 64; windows of 200 rows mix the 128-row row groups.
        data=DataConfig(
            source="parquet",
            path=str(tmp_path / "data"),
            batch_size=64,
            epochs=2,
            shuffle_seed=7,
            shuffle_window_rows=200,
        ),
        num_steps=None,
        log_every=4,
        storage_path=str(tmp_path / "runs"),
    )
    out = io.StringIO()
    reporter = ProgressReporter(None, console=out, tty=False, tensorboard=False, plot=False)
    result = fit(config, on_progress=reporter, shutdown_ray=False)

    assert result.steps == result.config.num_steps == 2 * 8
    assert [m.step for m in result.history] == [4, 8, 12, 16]
    assert result.history[-1].end_step == 16 and reporter.total_steps == 16
    assert "step      4/16" in out.getvalue()
    assert result.ledger()["num_steps"] == 16
    assert result.committed_count == 16 and result.lost_batches == 0
    # Every row trained once per epoch: twice, through the Ray Data pipeline's gathers.
    ids = committed_row_ids(result, data.paths)
    assert collections.Counter(collections.Counter(ids.tolist()).values()) == {2: 512}
    assert result.ledger()["rows"]["trained"] == len(ids)  # the ledger's rows: the model's
