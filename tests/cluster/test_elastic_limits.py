"""What elastic training cannot survive fails clearly: a host lost under
``replicas_within_host`` (every copy of a shard with it) with no checkpoint to rebuild from,
and the loss of the coordinator with no restart allowed. One rank lost under that layout is
survivable: the other copies of its shard live on its host, so its gang is dropped and the job
goes on."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import ray

from raytrec.api import CoordinatorDied, fit
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
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.events import GangDropped
from raytrec.elastic.faults import FaultKind, FaultSpec
from raytrec.errors import JobFailedError
from raytrec.observability.metrics import IntervalMetrics
from raytrec.observability.summary import SUMMARY_FILE
from raytrec.testing import running_coordinator

pytestmark = pytest.mark.cluster


def read_summary(error: BaseException) -> dict[str, Any]:
    """The summary.json of the run whose ``fit`` raised ``error`` (its result travels with it)."""
    result = error.result  # type: ignore[attr-defined]
    with open(os.path.join(result.run_dir, SUMMARY_FILE)) as f:
        summary: dict[str, Any] = json.load(f)
    assert summary == json.loads(json.dumps(result.ledger(failed=summary["failed"])))
    return summary


def config(tmp: str, **changes: object) -> TrainConfig:
    base = TrainConfig(
        model=ModelConfig(tables=criteo_tables(num_features=4, num_embeddings=200)),
        scaling=ScalingConfig(num_workers=4, gang_size=2, ranks_per_host=2),
        data=DataConfig(batch_size=32),
        elastic=ElasticConfig(collective_timeout_s=10, step_timeout_s=60, poll_s=0.2),
        num_steps=16,
        log_every=2,
        storage_path=tmp,
    )
    return base.replace(**changes)


WITHIN_HOST = ScalingConfig(
    num_workers=4, gang_size=2, ranks_per_host=2, layout="replicas_within_host"
)


def test_replicas_within_host_losing_a_host_without_a_checkpoint_fails_clearly(
    local_ray: None, tmp_path: str
) -> None:
    # Host 0 holds shard 0 of both gangs: every copy of that shard dies with it.
    cfg = config(
        str(tmp_path),
        scaling=WITHIN_HOST,
        testing=TestingConfig(faults=(FaultSpec(kind=FaultKind.KILL_RANK, step=5, node=0),)),
    )
    # No checkpoint configured: the message says one would have allowed a rebuild.
    with pytest.raises(
        JobFailedError,
        match=r"replicas_within_host.*cannot go on without a checkpoint, and none is configured: "
        r"with checkpoint.every_n_steps or checkpoint.every_minutes set, the job would have been "
        r"rebuilt from its last checkpoint automatically",
    ) as failed:
        fit(cfg, shutdown_ray=False)
    # Its ledger is written all the same: why it ended, what it had committed, no checkpoint.
    summary = read_summary(failed.value)
    assert summary["ended"] == "failed" and "cannot go on without a checkpoint" in summary["failed"]
    assert summary["resume_from"] is None and summary["failures"]["events"]["rank_died"] >= 1
    assert summary["failures"]["count"] >= 1
    # What was committed before the loss (job-wide syncs every 4 steps: none, or 4 ranks'
    # batches of each step up to the last sync the coordinator booked), in rows too.
    committed = summary["batches"]["committed"]
    assert committed % (4 * 4) == 0 and summary["rows"]["trained"] == committed * 32
    assert summary["steps"] < 16  # it ended at the loss, not after


def test_replicas_within_host_losing_one_rank_drops_its_gang_and_goes_on(
    local_ray: None, tmp_path: str, capfd: pytest.CaptureFixture[str]
) -> None:
    cfg = config(
        str(tmp_path),
        scaling=WITHIN_HOST,
        testing=TestingConfig(faults=(FaultSpec(kind=FaultKind.KILL_RANK, step=5, rank=0),)),
    )
    result = fit(cfg, shutdown_ray=False)
    kinds = result.events.kinds()
    assert result.steps == 16 and "total_loss" not in kinds, kinds
    [dropped] = result.events.of(GangDropped)
    assert dropped.gang_id == 0, dropped
    assert result.history[-1].gangs == 1
    assert result.lost_batches == 0
    # The console shows raytrec's lines only: Ray's report of the rank raytrec killed (the
    # raylet's "A worker died ..." block) is in the run's driver.log, and says so.
    terminal = capfd.readouterr()
    for line in (terminal.out + terminal.err).splitlines():
        assert line.startswith("[raytrec]") or not line.strip(), line
    assert "rank_died" in terminal.out
    with open(os.path.join(result.run_dir, "logs", "driver.log")) as f:
        driver = f.read()
    assert "A worker died or was killed" in driver, driver
    assert "(raytrec ended this process: kill_rank fault, rank 0, step 4)" in driver, driver


def test_losing_the_coordinator_with_no_restart_left_fails_the_job_with_its_ledger(
    local_ray: None, tmp_path: str
) -> None:
    killed: list[int] = []

    def kill_at_step_4(row: IntervalMetrics) -> None:
        if row.step >= 4 and not killed:
            ray.kill(running_coordinator())
            killed.append(row.step)

    # Slowed from step 5 on, so the kill (by the driver, once it sees step 4) lands mid-run.
    slow = TestingConfig(
        faults=(FaultSpec(kind=FaultKind.SLOW_RANK, step=5, rank=0, stall_s=1.0, steps=10),)
    )
    cfg = config(
        str(tmp_path),
        testing=slow,
        sync=SyncConfig(sync_every=2),
        checkpoint=CheckpointConfig(every_n_steps=2),
        elastic=ElasticConfig(
            collective_timeout_s=10, step_timeout_s=60, poll_s=0.2, max_coordinator_restarts=0
        ),
    )
    with pytest.raises(CoordinatorDied, match="coordinator actor died") as failed:
        fit(cfg, on_progress=kill_at_step_4, shutdown_ray=False)
    # The driver writes the ledger from the run's journal (what was committed when it died, and
    # the checkpoint to resume from) and the rows it saw up to the kill.
    summary = read_summary(failed.value)
    assert summary["ended"] == "failed" and "coordinator actor died" in summary["failed"]
    assert "max_coordinator_restarts=0" in summary["failed"]
    assert summary["steps"] >= summary["final"]["step"] >= 4
    committed = summary["batches"]["committed"]
    assert committed >= 4 * 4 and committed % 4 == 0, summary["batches"]
    assert summary["rows"]["trained"] == committed * 32
    assert summary["resume_from"] is not None and os.path.isdir(summary["resume_from"])
    assert summary["failures"]["events"] == {"coordinator_lost": 1}
    assert summary["failures"]["count"] == 1
    # It is gone, not restarted or left half alive.
    with pytest.raises(RuntimeError, match="expected one running raytrec coordinator, found 0"):
        running_coordinator()
