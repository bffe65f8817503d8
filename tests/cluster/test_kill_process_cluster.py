"""A rank SIGKILLed at a random moment on a 2-node cluster is seen at Ray's death notice.

2 gangs x 2 ranks, one gang per node (``ray.cluster_utils.Cluster``). A ``kill_process`` fault
SIGKILLs job rank 3 (gang 1, node 1) from another thread at a seeded random moment of a step
drawn from steps 20..29: mid-step, as often as not mid-collective. The collective timeout is
60 s, so a survivor left in a collective with the dead rank would stall the job that long; the
job must instead drop gang 1 and train on within a few seconds, every batch once.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator

import pytest
from ray.cluster_utils import Cluster
from test_elastic_cluster import assert_every_batch_once, assert_replicas_agree

from raytrec.api import fit
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
from raytrec.elastic.control import queue_depth
from raytrec.elastic.events import GangDropped, RankDied
from raytrec.elastic.faults import FaultConfig
from raytrec.testing import simulated_cluster

pytestmark = pytest.mark.cluster

COLLECTIVE_TIMEOUT_S = 60.0
STALL_LIMIT_S = 6.0  # the target is 3 s; a loaded 2-core machine gets a margin


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with simulated_cluster(2, cpus_per_node=2) as c:  # one gang of 2 ranks per node
        yield c


@pytest.mark.timeout(600)
def test_a_process_killed_mid_step_is_seen_at_once(cluster: Cluster, tmp_path: str) -> None:
    plan = FaultConfig.parse("kill_process@20:rank=3:steps=10:seed=1")
    kill_step, _ = plan.faults[0].kill_at(3)
    config = TrainConfig(
        model=ModelConfig(tables=criteo_tables(num_features=4, num_embeddings=200)),
        scaling=ScalingConfig(num_workers=4, gang_size=2),
        sync=SyncConfig(sync_every=4),
        data=DataConfig(batch_size=32),
        elastic=ElasticConfig(
            min_gangs=1,
            max_gangs=2,
            grow=False,
            collective_timeout_s=COLLECTIVE_TIMEOUT_S,
            step_timeout_s=2 * COLLECTIVE_TIMEOUT_S,
            poll_s=0.2,
        ),
        testing=TestingConfig(faults=plan.faults),
        num_steps=60,
        log_every=2,
        storage_path=str(tmp_path),
    )
    result = fit(config, shutdown_ray=False)

    assert result.steps == 60, result.events
    (died,) = [e for e in result.events.of(RankDied) if e.job_rank == 3]
    # The event carries the job's step when the death was noticed: the rank's own step, or up
    # to the intervals queued behind it earlier (queue_depth of log_every steps) when the
    # coordinator had not yet collected the interval before the one the rank died in.
    behind = queue_depth(config.sync) * config.log_every
    assert kill_step - 1 - behind <= died.step <= kill_step, (kill_step, died)
    assert "ActorDiedError" in died.cause, died  # Ray's death notice, not a timeout
    assert [e.gang_id for e in result.events.of(GangDropped)] == [1]
    # The survivors' stall: the gap between the rows around the loss, less the normal pace.
    rows = result.history
    before = [r for r in rows if r.at <= died.at]
    after = [r for r in rows if r.at > died.at]
    assert before and after, [r.at for r in rows]
    pace = statistics.median(r.seconds / r.steps for r in rows)
    stall = after[0].at - before[-1].at - after[0].steps * pace
    print(f"kill at step {kill_step}: survivors stalled {stall:.2f} s beyond the pace")
    assert stall < STALL_LIMIT_S, (stall, died, [(r.step, r.at) for r in rows])
    assert after[0].gangs == 1 and rows[-1].gangs == 1
    assert_replicas_agree(result)
    assert_every_batch_once(result)
