"""Parquet read by index through fit() on a local Ray cluster (127.0.0.1): a gang lost
mid-epoch, whose uncommitted batches the survivor reads again and whose untaken rows it trains
too, so every row of the epoch is in the final model exactly once, and the same job run again
(same seed, same fault plan) ends with bitwise-identical weights and optimizer state; and a
resume from a checkpoint that goes on with the batches after it."""

from __future__ import annotations

import pathlib

import pytest
from test_reproducible_cluster import assert_same_state, final_state

from raytrec.api import fit
from raytrec.checkpoint.config import CheckpointConfig
from raytrec.config import (
    DataConfig,
    ModelConfig,
    ScalingConfig,
    SyncConfig,
    TestingConfig,
    TrainConfig,
    criteo_tables,
)
from raytrec.data.from_config import parquet_spec
from raytrec.data.generate import write_synthetic_parquet
from raytrec.data.parquet import IndexedParquetShard, ParquetSource
from raytrec.data.synthetic import batch_id, split_batch_id
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.events import DataReshared
from raytrec.elastic.faults import FaultKind, FaultSpec
from raytrec.testing import committed_row_ids

pytestmark = pytest.mark.cluster

ROWS, VOCAB, B, EPOCH_STEPS = 1200, 200, 32, 19


def test_a_lost_gang_s_rows_are_trained_by_the_survivors_exactly_once_over_the_epoch(
    local_ray: None, tmp_path: pathlib.Path
) -> None:
    data = write_synthetic_parquet(
        tmp_path / "data", rows=ROWS, files=4, row_groups_per_file=2, seed=2, num_embeddings=VOCAB
    )
    config = TrainConfig(
        model=ModelConfig(tables=criteo_tables(num_features=4, num_embeddings=VOCAB)),
        scaling=ScalingConfig(num_workers=2, gang_size=1),  # 2 gangs x 1 rank
        sync=SyncConfig(sync_every=4),
        data=DataConfig(
            source="parquet",
            path=str(tmp_path / "data"),
            parquet_read="indexed",
            batch_size=B,
            shuffle_seed=1,
        ),
        elastic=ElasticConfig(
            min_gangs=1, grow=False, step_timeout_s=60, collective_timeout_s=10, poll_s=0.2
        ),
        # Rank 1 dies as it starts step 7: it trained 5 and 6 after the job-wide sync of step 4.
        testing=TestingConfig(faults=(FaultSpec(kind=FaultKind.KILL_RANK, step=7, rank=1),)),
        num_steps=EPOCH_STEPS,  # one whole epoch: 2 ranks x 19 batches of at most 32 rows
        log_every=2,
        storage_path=str(tmp_path),
    )
    result = fit(config, shutdown_ray=False)

    kinds = result.events.kinds()
    assert "rank_died" in kinds and "gang_dropped" in kinds, kinds
    assert result.history[-1].gangs == 1
    # Rank 0 replays rank 1's uncommitted batches (it trained its batches 4 and 5 at steps 5
    # and 6 after the sync of step 4; at the failure's step the coordinator counts one more as
    # taken), reads on to the end of its own stream (one epoch: one part), then trains the rows
    # rank 1 had not taken, cut into batches of at most 32 rows (rank 0 may have stopped at
    # step 6 or 7).
    replayed = [split_batch_id(i) for a, b in result.replayed_batches for i in range(a, b)]
    (reshared,) = result.events.of(DataReshared)
    step = reshared.step
    assert {(1, 4), (1, 5)} <= set(replayed) == {(1, k) for k in range(4, step)}
    assert reshared.ranks == 1 and reshared.left_over == 0 and reshared.taken_over
    assert reshared.rows == 600 - step * 600 // 19
    own = EPOCH_STEPS - step
    assert result.steps == reshared.end_step == step + len(replayed) + own + -(-reshared.rows // B)
    distinct = sum(b - a for a, b in result.committed_batches)
    assert result.committed_count == distinct, "a batch was trained into the model twice"
    assert result.lost_batches == 0
    assert len({d["dense"] for d in result.state_digests.values()}) == 1

    # In rows: the committed batches hold every row of the epoch (by row_id) exactly once.
    source = ParquetSource(paths=data.paths, spec=parquet_spec(config), read_mode="indexed")
    shard = source.split(2)[0]
    assert isinstance(shard, IndexedParquetShard) and result.reshared_streams is not None
    assert shard.plan(B).steps_per_epoch == EPOCH_STEPS
    trained = committed_row_ids(result, data.paths)
    assert sorted(trained.tolist()) == list(range(ROWS))

    # Reproducible through the failure: the same job again ends with the same bits.
    again = fit(config.replace(name="again"), shutdown_ray=False)
    assert again.steps == result.steps and again.replayed_batches == result.replayed_batches
    assert_same_state(final_state(result), final_state(again))
    assert again.state_digests == result.state_digests  # the optimizer state too


def test_a_resume_continues_on_the_batches_after_the_checkpoint(
    local_ray: None, tmp_path: pathlib.Path
) -> None:
    paths = write_synthetic_parquet(
        tmp_path / "data", rows=ROWS, files=4, row_groups_per_file=2, seed=3, num_embeddings=VOCAB
    ).paths
    config = TrainConfig(
        model=ModelConfig(tables=criteo_tables(num_features=4, num_embeddings=VOCAB)),
        scaling=ScalingConfig(num_workers=2, gang_size=1),
        data=DataConfig(source="parquet", path=str(tmp_path / "data"), batch_size=B),
        checkpoint=CheckpointConfig(every_n_steps=4, checkpoint_at_end=True),
        num_steps=6,
        log_every=2,
        storage_path=str(tmp_path),
    )
    first = fit(config, shutdown_ray=False)
    assert first.checkpoint is not None
    second = fit(
        config.replace(num_steps=10), resume_from_checkpoint=first.checkpoint, shutdown_ray=False
    )
    # Each rank went on from batch 6 of its own stream: over both runs every batch 0..9 of
    # both shards is in the model once (the accounting travels in the checkpoint).
    committed = {i for a, b in second.committed_batches for i in range(a, b)}
    assert second.committed_count == len(committed)
    assert committed == {batch_id(shard, k) for shard in range(2) for k in range(10)}
    expected = committed_row_ids(second, paths)
    assert len(set(expected.tolist())) == len(expected)
    # On another number of ranks the rows the checkpoint had not trained are shared among
    # them: the same rows end up in the model, each once (on 1 rank in 8 more steps, on 3
    # ranks in 3: 252 rows left, batches 6..9 of both streams, in batches of at most 32).
    for ranks, steps in ((1, 6 + 8), (3, 6 + 3)):
        other = config.replace(num_steps=10, scaling=ScalingConfig(num_workers=ranks, gang_size=1))
        again = fit(other, resume_from_checkpoint=first.checkpoint, shutdown_ray=False)
        assert again.steps == steps
        (reshared,) = again.events.of(DataReshared)
        assert reshared.ranks == ranks and reshared.rows == 2 * (10 * 600 // 19 - 6 * 600 // 19)
        assert again.committed_count == sum(b - a for a, b in again.committed_batches)
        assert sorted(committed_row_ids(again, paths).tolist()) == sorted(expected.tolist())
