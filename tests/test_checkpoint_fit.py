"""Checkpoints through fit() on a local Ray cluster: periodic saves, resume on another shape."""

from __future__ import annotations

import os

import pytest

from raytrec.api import Result, fit
from raytrec.checkpoint.config import CheckpointConfig, checkpoint_root
from raytrec.checkpoint.errors import CheckpointError
from raytrec.checkpoint.layout import CheckpointStore
from raytrec.config import DataConfig, ModelConfig, ScalingConfig, TrainConfig, criteo_tables
from raytrec.data.synthetic import batch_id
from raytrec.elastic.events import CheckpointRestored, CheckpointSaved

pytestmark = pytest.mark.cluster


def config(tmp: str, *, workers: int, gang: int, steps: int, rows: int = 300) -> TrainConfig:
    return TrainConfig(
        model=ModelConfig(tables=criteo_tables(num_features=4, num_embeddings=rows)),
        scaling=ScalingConfig(num_workers=workers, gang_size=gang),
        data=DataConfig(batch_size=32),
        checkpoint=CheckpointConfig(every_n_steps=4, num_to_keep=2, checkpoint_at_end=True),
        num_steps=steps,
        log_every=2,
        storage_path=tmp,
    )


@pytest.fixture(scope="module")
def first_run(local_ray: None, tmp_path_factory: pytest.TempPathFactory) -> Result:
    tmp = str(tmp_path_factory.mktemp("first"))
    return fit(config(tmp, workers=2, gang=1, steps=10), shutdown_ray=False)


def test_save_every_n_steps_then_resume_on_another_shape(first_run: Result, tmp_path: str) -> None:
    first = first_run
    store = CheckpointStore(checkpoint_root(first.run_dir))
    # Saved at steps 4, 8 and 10 (the end); the last two kept.
    assert [c.step for c in store.committed()] == [8, 10]
    assert first.checkpoint is not None and first.checkpoint.path == store.latest().uri
    saved = [e.step for e in first.events.of(CheckpointSaved)]
    assert saved == [4, 8, 10]

    # One gang of two ranks (another plan) picks up at step 10 and trains to 14.
    second = fit(
        config(str(tmp_path), workers=2, gang=2, steps=14),
        resume_from_checkpoint=first.checkpoint,
        shutdown_ray=False,
    )
    restored = second.events.of(CheckpointRestored)
    assert [(e.saved_step, e.step) for e in restored] == [(10, 10)]
    assert [m.step for m in second.history] == [12, 14]
    # It continues the trained model: its loss is already below the first run's start.
    assert second.history[0].loss < first.history[0].loss - 0.02
    # And the data where the checkpoint left it: each saved rank's stream goes on, and the
    # accounting carried in the checkpoint counts every batch of both runs exactly once.
    distinct = {i for a, b in second.committed_batches for i in range(a, b)}
    assert second.committed_count == len(distinct)
    assert distinct == {batch_id(shard, k) for shard in range(2) for k in range(14)}


def test_an_incompatible_checkpoint_fails_before_any_rank_starts(
    first_run: Result, tmp_path: str
) -> None:
    first = first_run
    assert first.checkpoint is not None
    other = config(str(tmp_path), workers=2, gang=1, steps=8, rows=301)
    with pytest.raises(
        CheckpointError, match=r"table 't_cat_0' num_embeddings: saved 300, expected 301"
    ):
        fit(other, resume_from_checkpoint=first.checkpoint, shutdown_ray=False)
    missing = os.path.join(str(tmp_path), "nothing-here")
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        fit(other, resume_from_checkpoint=missing, shutdown_ray=False)
