"""Elastic training on a simulated multi-node Ray cluster (``ray.cluster_utils.Cluster``).

One run loses a rank (killed), a hung rank and a whole node, and grows back each time: a new gang
is placed on the freed resources (or on a node added later), heals from a live peer and joins.
It must finish every step, end with every replica identical, and account for every batch:
each one trained into the final model exactly once, the lost gangs' uncommitted batches replayed
by the survivors.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

import pytest
from ray.cluster_utils import Cluster

from raytrec.api import Result, fit
from raytrec.config import (
    DataConfig,
    ModelConfig,
    ScalingConfig,
    SyncConfig,
    TestingConfig,
    TrainConfig,
    criteo_tables,
)
from raytrec.data.synthetic import split_batch_id
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.events import GangDropped, GangJoined
from raytrec.elastic.faults import FaultKind, FaultSpec
from raytrec.testing import NodeRemover, simulated_cluster

pytestmark = pytest.mark.cluster


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with simulated_cluster(3, cpus_per_node=2) as c:  # one gang of 2 ranks per node
        yield c


def assert_every_batch_once(result: Result) -> None:
    """Each shard's committed batches are a gap-free prefix 0..k-1, none counted twice."""
    distinct = sum(b - a for a, b in result.committed_batches)
    assert result.committed_count == distinct, "a batch was trained into the model twice"
    by_shard: dict[int, list[int]] = collections.defaultdict(list)
    for a, b in result.committed_batches:
        for i in range(a, b):
            shard, step = split_batch_id(i)
            by_shard[shard].append(step)
    for shard, steps in by_shard.items():
        assert sorted(steps) == list(range(len(steps))), f"shard {shard} lost batches"
    replayed = {i for a, b in result.replayed_batches for i in range(a, b)}
    committed = {i for a, b in result.committed_batches for i in range(a, b)}
    assert replayed <= committed
    assert result.lost_batches == 0


def assert_replicas_agree(result: Result) -> None:
    digests = result.state_digests
    assert len({d["dense"] for d in digests.values()}) == 1
    shards = collections.Counter(d["shards"] for d in digests.values())
    gangs = len(digests) // result.config.scaling.gang_size
    # gang_size distinct shards, each held by every gang.
    assert sorted(shards.values()) == [gangs] * result.config.scaling.gang_size


def test_three_failures_and_growth_in_one_run(cluster: Cluster, tmp_path: str) -> None:
    config = TrainConfig(
        model=ModelConfig(tables=criteo_tables(num_features=4, num_embeddings=200)),
        scaling=ScalingConfig(num_workers=6, gang_size=2),
        sync=SyncConfig(sync_every=2),
        data=DataConfig(batch_size=32),
        elastic=ElasticConfig(
            min_gangs=3,  # after each loss, training waits for the replacement gang
            max_gangs=3,
            step_timeout_s=15,  # the hung rank is singled out this long after its last step
            collective_timeout_s=8,
            resource_wait_s=180,  # a new node and actors can take a minute on a loaded machine
            poll_s=0.2,
        ),
        testing=TestingConfig(
            faults=(
                FaultSpec(kind=FaultKind.KILL_RANK, step=5, rank=1),
                FaultSpec(kind=FaultKind.HANG_RANK, step=13, rank=2),
                # Slows the job down from step 21 on, so the node removal below (done by the
                # driver once it sees step 20) lands while the job is still training.
                FaultSpec(kind=FaultKind.SLOW_RANK, step=21, rank=4, stall_s=1.0, steps=10),
            )
        ),
        num_steps=32,
        log_every=2,
        storage_path=str(tmp_path),
    )
    # The node of job rank 4 (gang 2) goes at step 20, and a fresh node is added.
    remover = NodeRemover(
        cluster=cluster,
        at_step=20,
        job_rank=4,
        add_at_step=20,
        add_node=lambda c: c.add_node(num_cpus=2, node_ip_address="127.0.0.1"),
    )
    result = fit(config, on_progress=remover, shutdown_ray=False)

    assert result.steps == 32, result.events
    steps = [m.step for m in result.history]  # an interval cut by a failure has no row
    assert steps == sorted(set(steps)) and steps[-1] >= 30, (steps, result.events)
    kinds = result.events.kinds()
    for kind in ("rank_died", "hang_detected", "node_died"):
        assert kind in kinds, " ".join(kinds)
    dropped = result.events.of(GangDropped)
    assert len(dropped) == 3, dropped
    joined = result.events.of(GangJoined)
    assert len(joined) == 3  # a replacement after each loss
    assert result.generation >= 6
    assert result.history[-1].gangs == 3
    assert_replicas_agree(result)
    assert_every_batch_once(result)
    assert result.replayed_batches  # the lost gangs had uncommitted batches
