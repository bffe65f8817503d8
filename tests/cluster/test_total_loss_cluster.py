"""Automatic recovery from a total loss on a simulated 2-node cluster (``ray.cluster_utils``).

Layout ``replicas_within_host``, 2 gangs x 2 ranks: a node holds one replica group (or, with
bigger nodes, the whole job), so losing a node takes every copy of a shard with it. The job
checkpoints every 4 steps; the node is removed after step 10 and a fresh node added, as an
autoscaler would. The coordinator must rebuild the whole job from the checkpoint of step 8,
train steps 9..16 again and on, and end with every replica identical and every batch trained
into the final model exactly once.
"""

from __future__ import annotations

import collections
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
from raytrec.data.generate import write_synthetic_parquet
from raytrec.data.synthetic import batch_id
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.events import CheckpointRestored, CheckpointSaved, RankDied, TotalLoss
from raytrec.elastic.faults import FaultKind, FaultSpec
from raytrec.testing import NodeRemover, committed_row_ids, simulated_cluster

pytestmark = pytest.mark.cluster

ROWS = 4 * 16 * 32


def _cpus_per_node(source: str) -> int:
    """Synthetic: a CPU per rank, so a node holds one replica group (2 ranks). Parquet: half a
    CPU per rank, and nodes big enough for the whole job and Ray Data's read tasks, so Ray
    packs both replica groups onto one node: losing it kills every rank at once."""
    return 2 if source == "synthetic" else 4


@pytest.fixture
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    with simulated_cluster(
        2, cpus_per_node=_cpus_per_node(request.node.callspec.params["source"])
    ) as c:
        yield c


@pytest.mark.parametrize("source", ["synthetic", "parquet"])
def test_a_lost_host_with_every_copy_of_a_shard_is_rebuilt_from_the_checkpoint(
    cluster: Cluster, tmp_path: str, source: str
) -> None:
    data = DataConfig(batch_size=32)
    paths: list[str] = []
    if source == "parquet":  # one epoch: 4 ranks x 16 batches of 32 rows, read by index
        paths = write_synthetic_parquet(
            f"{tmp_path}/data",
            rows=ROWS,
            files=4,
            row_groups_per_file=2,
            seed=4,
            num_embeddings=200,
        ).paths
        data = DataConfig(batch_size=32, source="parquet", path=f"{tmp_path}/data")
    config = TrainConfig(
        model=ModelConfig(tables=criteo_tables(num_features=4, num_embeddings=200)),
        scaling=ScalingConfig(
            num_workers=4,
            gang_size=2,
            ranks_per_host=2,
            layout="replicas_within_host",
            cpus_per_rank=0.5 if source == "parquet" else 1.0,
        ),
        sync=SyncConfig(sync_every=2),
        data=data,
        elastic=ElasticConfig(
            step_timeout_s=30, collective_timeout_s=10, resource_wait_s=60, poll_s=0.2
        ),
        checkpoint=CheckpointConfig(every_n_steps=4, num_to_keep=2),
        # Slows the job down from step 11 on, so the node removal below (done by the driver
        # once it sees step 10) lands while the job trains. The rebuilt ranks have new job
        # ranks, so the slowdown ends with the loss.
        testing=TestingConfig(
            faults=(FaultSpec(kind=FaultKind.SLOW_RANK, step=11, rank=0, stall_s=1.0, steps=6),)
        ),
        num_steps=16,
        log_every=2,
        storage_path=str(tmp_path),
    )
    # Job rank 2 holds shard 1 of gang 0 on the second node, beside rank 3 (shard 1 of gang 1).
    remover = NodeRemover(
        cluster=cluster,
        at_step=10,
        job_rank=2,
        add_at_step=10,
        add_node=lambda c: c.add_node(num_cpus=_cpus_per_node(source), node_ip_address="127.0.0.1"),
    )
    result = fit(config, on_progress=remover, shutdown_ray=False)
    events = result.events
    kinds = events.kinds()

    assert result.steps == 16, kinds
    assert "node_died" in kinds and "job_failed" not in kinds, kinds
    [total] = events.of(TotalLoss)
    assert total.lost_gangs == (0, 1), total
    # The removed node held replica group 1 (job ranks 2 and 3), and with Parquet the whole job:
    # then every rank died with it, though the coordinator sees one death first and kills
    # that rank's gang peers itself. A shard is dead when every copy was on the node.
    died = {e.job_rank: e.cause for e in events.of(RankDied)}
    with_node = [r for r, cause in sorted(died.items()) if cause == "its node died"]
    assert with_node == ([2, 3] if source == "synthetic" else [0, 1, 2, 3]), died
    assert total.dead_shards == ((1,) if source == "synthetic" else (0, 1)), total
    assert total.checkpoint_step == 8 and total.uri.endswith("checkpoint_0000000008")
    assert total.steps_to_redo == total.step - 8 >= 2, total
    [restored] = events.of(CheckpointRestored)
    assert kinds.index("total_loss") < kinds.index("checkpoint_restored")
    assert (restored.saved_step, restored.step, restored.uri) == (8, 8, total.uri)
    # Saves at 4 and 8; after the rewind to 8 the next ones are due at 12 and 16.
    assert [e.step for e in events.of(CheckpointSaved)] == [4, 8, 12, 16]
    # The rebuilt job trains from step 9 on with the initial shape, under new gang ids.
    after = result.history[[m.step for m in result.history].index(10) + 1 :]
    assert [m.step for m in after][-4:] == [10, 12, 14, 16], [m.step for m in result.history]
    assert all(m.gangs == 2 for m in after)
    # Steps 9 and 10 again, from the checkpoint's state on the same batches: the same loss.
    before = next(m for m in result.history if m.step == 10)
    assert after[0].step == 10 and after[0].generation > before.generation
    assert after[0].loss == pytest.approx(before.loss, rel=1e-5)
    assert sorted(result.state_digests) == [4, 5, 6, 7]

    # Every replica identical: 2 distinct shards, each held by both gangs; one dense state.
    digests = result.state_digests
    assert len({d["dense"] for d in digests.values()}) == 1
    assert sorted(collections.Counter(d["shards"] for d in digests.values()).values()) == [2, 2]
    # Every batch in the final model exactly once: each shard's batches 0..15, the ones
    # trained after the checkpoint and before the loss (committed at steps 10) not twice.
    distinct = {i for a, b in result.committed_batches for i in range(a, b)}
    assert result.committed_count == len(distinct)
    assert distinct == {batch_id(shard, k) for shard in range(4) for k in range(16)}
    assert result.lost_batches == 0
    if source == "parquet":  # and in rows: the epoch's, each once
        assert sorted(committed_row_ids(result, paths).tolist()) == list(range(ROWS))
        assert result.ledger()["rows"]["trained"] == ROWS  # rebuilt from a checkpoint too
