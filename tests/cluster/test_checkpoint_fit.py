"""Checkpoints through fit() on a local Ray cluster: periodic saves, resume on another shape, a
new run from a checkpoint's model."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from raytrec.api import Result, fit
from raytrec.checkpoint.config import CheckpointConfig, checkpoint_root
from raytrec.checkpoint.errors import CheckpointError
from raytrec.checkpoint.layout import CheckpointStore, read_manifest
from raytrec.config import (
    ConfigError,
    DataConfig,
    ModelConfig,
    ScalingConfig,
    TrainConfig,
    criteo_tables,
)
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
    # A new run from its model is checked the same way.
    with pytest.raises(
        CheckpointError, match=r"table 't_cat_0' num_embeddings: saved 300, expected 301"
    ):
        fit(other, init_from=first.checkpoint, shutdown_ray=False)
    # A resume continues the saved data position: on other data (here the synthetic
    # generator's seed) it is refused, naming what changed.
    reseeded = config(str(tmp_path), workers=2, gang=1, steps=14).replace(seed=5)
    with pytest.raises(ConfigError, match=r"cannot be resumed on this data.*seed: saved 0, now 5"):
        fit(reseeded, resume_from_checkpoint=first.checkpoint, shutdown_ray=False)
    missing = os.path.join(str(tmp_path), "nothing-here")
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        fit(other, resume_from_checkpoint=missing, shutdown_ray=False)


def tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP directory (a checkpoint or a final model), by its flat key."""
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path, os.path.join(tmp, "state.pt"))
        state = torch.load(os.path.join(tmp, "state.pt"), weights_only=False)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value

    walk("", state)
    return flat


def test_init_from_takes_the_model_not_the_data_position_on_another_shape(
    first_run: Result, tmp_path: str
) -> None:
    first = first_run
    assert first.checkpoint is not None
    # One gang of two ranks (the first run had two gangs of one) starts from the step-10 model.
    # Learning rates too small to move a float32 weight: the model it trains is the model it
    # loaded, while the optimizer state (Adagrad's sums) still grows with the new gradients.
    new = config(str(tmp_path), workers=2, gang=2, steps=2)
    tiny = new.optimizer.replace(embedding_lr=1e-30, dense_lr=1e-30)
    second = fit(
        new.replace(optimizer=tiny),
        init_from=first.checkpoint,
        shutdown_ray=False,
    )
    # Not the saved job's step, data position or ledger: step 0, the new data from its start.
    restored = second.events.of(CheckpointRestored)
    assert [(e.saved_step, e.step) for e in restored] == [(10, 0)]
    assert [m.step for m in second.history] == [2]
    distinct = {i for a, b in second.committed_batches for i in range(a, b)}
    assert second.committed_count == len(distinct) == 2 * 2
    assert distinct == {batch_id(shard, k) for shard in range(2) for k in range(2)}
    ledger = second.ledger()
    assert ledger["rows"]["trained"] == 2 * 2 * 32
    assert [e.step for e in second.events.of(CheckpointSaved)] == [2]

    # The weights are the checkpoint's, resharded (table-wise over two ranks now).
    saved = tensors(first.checkpoint.path)
    assert second.final_state_path is not None
    final = tensors(second.final_state_path)
    assert final.keys() == {k[len("model.") :] for k in saved if k.startswith("model.")}
    for key, value in final.items():
        torch.testing.assert_close(value, saved[f"model.{key}"], rtol=0, atol=1e-20, msg=key)
    # And the optimizer state: the new run's sums are the saved ones plus its own gradients'
    # squares (a fresh state would be below them wherever the new run did not touch a row).
    assert second.checkpoint is not None
    after = tensors(second.checkpoint.path)
    sums = [k for k in saved if k.startswith("embedding_optimizer.") and "momentum1" in k]
    assert sums
    for key in sums:
        assert bool((after[key] >= saved[key]).all()), key
        assert bool((saved[key] > 0).any()), key
    # The new run records the data it read in its checkpoints.
    assert read_manifest(second.checkpoint.path).extra["data"]["kind"] == "synthetic"
