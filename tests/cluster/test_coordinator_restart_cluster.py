"""The job survives its own coordinator: its process SIGKILLed mid-run (a ``kill_coordinator``
fault at step 10), the driver starts a new coordinator that continues the same run from the
checkpoint of step 8, and the job finishes with every batch committed exactly once.

2 gangs x 1 rank on the shared local cluster, 16 steps, a checkpoint every 4 steps and a
job-wide sync every 2. The ranks were the lost coordinator's actors, so they died with it; the
new coordinator places them again and trains steps 9..16, the batches of steps 9 and 10
(committed before the loss) a second time, counted once.
"""

from __future__ import annotations

import json
import os

import pytest
from test_elastic_cluster import assert_every_batch_once, assert_replicas_agree

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
from raytrec.data.synthetic import batch_id
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.events import CheckpointRestored, CoordinatorLost, CoordinatorRestarted
from raytrec.elastic.faults import FaultConfig
from raytrec.elastic.journal import CoordinatorStartedRecorded, FaultFiredRecorded, read_journal

pytestmark = pytest.mark.cluster


@pytest.mark.timeout(300)
def test_a_coordinator_killed_mid_run_is_restarted_from_the_checkpoint(
    local_ray: None, tmp_path: str
) -> None:
    config = TrainConfig(
        model=ModelConfig(tables=criteo_tables(num_features=4, num_embeddings=200)),
        scaling=ScalingConfig(num_workers=2, gang_size=1),
        sync=SyncConfig(sync_every=2),
        data=DataConfig(batch_size=32),
        elastic=ElasticConfig(
            step_timeout_s=60, collective_timeout_s=20, poll_s=0.2, max_coordinator_restarts=1
        ),
        checkpoint=CheckpointConfig(every_n_steps=4, num_to_keep=2),
        testing=TestingConfig(faults=FaultConfig.parse("kill_coordinator@10").faults),
        num_steps=16,
        log_every=2,
        storage_path=str(tmp_path),
    )
    result = fit(config, shutdown_ray=False)
    kinds = result.events.kinds()

    assert result.steps == 16, kinds
    [lost] = result.events.of(CoordinatorLost)
    [restarted] = result.events.of(CoordinatorRestarted)
    assert kinds.index("coordinator_lost") < kinds.index("coordinator_restarted"), kinds
    assert lost.step == 10 and lost.attempt == 0 and lost.restarts_left == 0, lost
    assert "died" in lost.reason, lost
    assert restarted.attempt == 1 and restarted.checkpoint_step == 8, restarted
    assert restarted.uri is not None and restarted.uri.endswith("checkpoint_0000000008")
    # Steps 9 and 10 of both ranks were committed before the loss: trained again, once counted.
    assert restarted.rolled_back_batches == 4, restarted
    assert [e.uri for e in result.events.of(CheckpointRestored)] == [restarted.uri]

    # Every batch in the final model exactly once; every replica identical.
    assert_every_batch_once(result)
    distinct = {i for a, b in result.committed_batches for i in range(a, b)}
    assert distinct == {batch_id(shard, k) for shard in range(2) for k in range(16)}
    assert result.committed_count == 32
    assert_replicas_agree(result)

    # The run's metrics and events go on across both coordinators, on one clock (the lost
    # one's last rows may not have reached the driver before it died).
    steps = [m.step for m in result.history]
    assert steps[-4:] == [10, 12, 14, 16], steps
    ats = [e.at for e in result.events]
    assert ats == sorted(ats)
    with open(os.path.join(result.run_dir, "events.jsonl")) as f:
        written = [json.loads(line)["kind"] for line in f]
    assert written.count("coordinator_lost") == written.count("coordinator_restarted") == 1

    # The ledger shows the restart and what it rolled back.
    ledger = result.ledger()
    assert ledger["coordinator_restarts"] == 1
    assert ledger["failures"]["events"] == {"coordinator_lost": 1}
    assert ledger["failures"]["count"] == 1
    assert ledger["batches"]["committed"] == ledger["batches"]["committed_distinct"] == 32
    assert ledger["batches"]["rolled_back"] == 4

    # The journal: two coordinators, and the fault fired once (not again after the restart).
    records = read_journal(result.run_dir)
    assert [r.attempt for r in records if isinstance(r, CoordinatorStartedRecorded)] == [0, 1]
    assert [r.step for r in records if isinstance(r, FaultFiredRecorded)] == [10]
