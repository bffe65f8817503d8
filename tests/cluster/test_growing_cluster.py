"""A growing Parquet source on a simulated two-node cluster (127.0.0.1): day partitions land
while the job trains, a rank dies on the way, and the job ends once the last day is trained.
Every row of every day is trained into the model exactly once (by row id), and the replicas
agree. Then one more day lands and a resume from the job's last checkpoint trains it: once,
across both jobs."""

from __future__ import annotations

import os
import pathlib
import threading
from collections.abc import Iterator

import pytest
from ray.cluster_utils import Cluster

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
from raytrec.data.config import GrowingConfig
from raytrec.data.partitions import stage_days
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.events import DataGrowthEnded, FilesLanded, RankDied
from raytrec.elastic.faults import FaultKind, FaultSpec
from raytrec.observability.metrics import IntervalMetrics
from raytrec.testing import committed_row_ids, simulated_cluster

pytestmark = pytest.mark.cluster

DAYS, ROWS, VOCAB, B = 4, 640, 200, 32  # 2 ranks x 10 batches of 32 rows per day


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with simulated_cluster(2, cpus_per_node=2) as c:
        yield c


def test_days_that_land_while_it_trains_are_each_trained_once_across_a_loss(
    cluster: Cluster, tmp_path: pathlib.Path
) -> None:
    root = tmp_path / "days"
    lander, _ = stage_days(
        str(root),
        days=DAYS + 1,
        rows_per_day=ROWS,
        row_groups_per_day=2,
        seed=5,
        num_embeddings=VOCAB,
    )
    lander.land(0)  # the job starts on the first day (10 steps); the others land as it trains
    landed_at = {1: 2, 2: 5}  # day -> the step after which it lands, before the data ends
    stop = threading.Event()

    def land(row: IntervalMetrics) -> None:
        for day, step in landed_at.items():
            if row.step >= step and not os.path.exists(lander.day_dir(day)):
                lander.land(day)
                if day == 2:  # the last day a while later: the job may be waiting for it
                    threading.Thread(target=lambda: stop.wait(3.0) or lander.land(3)).start()

    config = TrainConfig(
        model=ModelConfig(tables=criteo_tables(num_features=4, num_embeddings=VOCAB)),
        scaling=ScalingConfig(num_workers=2, gang_size=1),
        sync=SyncConfig(sync_every=2),
        data=DataConfig(
            source="parquet",
            path=str(root),
            batch_size=B,
            growing=GrowingConfig(poll_s=0.5, max_files=DAYS, idle_stop_s=30),
        ),
        elastic=ElasticConfig(
            min_gangs=1, grow=False, step_timeout_s=30, collective_timeout_s=10, poll_s=0.2
        ),
        # Rank 1 dies at step 6; no gang replaces it (the demonstration's does: a join).
        testing=TestingConfig(faults=(FaultSpec(kind=FaultKind.KILL_RANK, step=6, rank=1),)),
        checkpoint=CheckpointConfig(every_n_steps=10),
        log_every=2,
        storage_path=str(tmp_path),
    )
    try:
        result = fit(config, on_progress=land, shutdown_ray=False)
    finally:
        stop.set()

    landed = result.events.of(FilesLanded)
    assert sum(len(e.paths) for e in landed) == DAYS - 1, landed
    assert landed[0].step > 0, landed  # found while the job trained
    assert all(f >= t for e in landed for f, t in zip(e.found_at, e.landed_at, strict=True))
    assert all(e.first_step is None or e.first_step > e.step for e in landed), landed
    (ended,) = result.events.of(DataGrowthEnded)
    assert ended.files == DAYS, ended
    assert result.events.of(RankDied), result.events.kinds()
    assert len({d["dense"] for d in result.state_digests.values()}) == 1
    assert len({d["shards"] for d in result.state_digests.values()}) == 1
    assert result.lost_batches == 0
    distinct = sum(b - a for a, b in result.committed_batches)
    assert result.committed_count == distinct, "a batch was trained into the model twice"
    # Every row of every day (row ids 0..DAYS*ROWS-1) in exactly one committed batch.
    table = result.reshared_streams
    assert table is not None and len(table["files"]["paths"]) == DAYS
    trained = committed_row_ids(result, lander.landed())
    assert sorted(trained.tolist()) == list(range(DAYS * ROWS))
    assert result.ledger()["rows"]["per_file"] == dict.fromkeys(lander.landed(), ROWS)

    # A day lands after the job ended; a resume from its last checkpoint (at its last step)
    # finds it and trains it, and only it.
    assert result.checkpoint is not None and result.checkpoint.path.endswith(f"{result.steps:010d}")
    lander.land(DAYS)
    more = config.replace(
        data=config.data.replace(growing=GrowingConfig(poll_s=0.5, max_files=DAYS + 1))
    )
    resumed = fit(more, resume_from_checkpoint=result.checkpoint, shutdown_ray=False)
    (found,) = resumed.events.of(FilesLanded)
    assert found.paths == (lander.landed()[-1],) and found.step == result.steps, found
    trained = committed_row_ids(resumed, lander.landed())
    assert sorted(trained.tolist()) == list(range((DAYS + 1) * ROWS))
