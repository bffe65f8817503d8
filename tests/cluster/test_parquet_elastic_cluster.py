"""Parquet read by index on a simulated two-node cluster (127.0.0.1): a node is lost mid-epoch
and a fresh one added. The survivor takes over the lost rank's rows at once; the gang built on
the new node is then given its share of the rows left. Over the epoch every row is trained into
the final model exactly once, and the replicas agree."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
from ray.cluster_utils import Cluster

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
from raytrec.data.generate import write_synthetic_parquet
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.events import DataReshared, GangJoined, GangPlaced, NodeDied, RankDied
from raytrec.elastic.faults import FaultKind, FaultSpec
from raytrec.testing import NodeRemover, committed_row_ids, simulated_cluster

pytestmark = pytest.mark.cluster

ROWS, VOCAB, B = 1280, 200, 32  # 2 ranks x 20 batches of 32 rows per epoch


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    # One rank per node, and a CPU beside it for the rank's Ray Data read tasks.
    with simulated_cluster(2, cpus_per_node=2) as c:
        yield c


def test_a_lost_node_s_rows_go_to_the_survivor_then_to_the_gang_that_joins(
    cluster: Cluster, tmp_path: pathlib.Path
) -> None:
    data = write_synthetic_parquet(
        tmp_path / "data", rows=ROWS, files=4, row_groups_per_file=2, seed=5, num_embeddings=VOCAB
    )
    config = TrainConfig(
        model=ModelConfig(tables=criteo_tables(num_features=4, num_embeddings=VOCAB)),
        scaling=ScalingConfig(num_workers=2, gang_size=1),
        sync=SyncConfig(sync_every=2),
        data=DataConfig(source="parquet", path=str(tmp_path / "data"), batch_size=B),
        elastic=ElasticConfig(
            min_gangs=2,  # after the loss, training waits for the replacement gang
            max_gangs=2,
            step_timeout_s=30,
            collective_timeout_s=10,
            resource_wait_s=120,
            poll_s=0.2,
        ),
        # Slow steps from step 5 on, so the node removal below (done by the driver once it
        # sees step 6) lands while the job is still training.
        testing=TestingConfig(
            faults=(FaultSpec(kind=FaultKind.SLOW_RANK, step=5, rank=0, stall_s=1.0, steps=6),)
        ),
        num_steps=20,  # one epoch
        log_every=2,
        storage_path=str(tmp_path),
    )
    remover = NodeRemover(
        cluster=cluster,
        at_step=6,
        job_rank=1,
        add_at_step=6,
        add_node=lambda c: c.add_node(num_cpus=2, node_ip_address="127.0.0.1"),
    )
    result = fit(config, on_progress=remover, shutdown_ray=False)

    kinds = result.events.kinds()
    for kind in ("node_died", "gang_dropped", "gang_joined"):
        assert kind in kinds, " ".join(kinds)
    # Events name real nodes: Ray's node id and its address.
    (died,) = result.events.of(NodeDied)
    assert died.address == "127.0.0.1" and len(died.node_id) == 56, died
    lost = result.events.of(RankDied)
    assert lost and all(e.node == f"{died.node_id[:12]} at 127.0.0.1" for e in lost), lost
    (placed,) = result.events.of(GangPlaced)
    assert [n.split(" at ")[1] for n in placed.nodes] == ["127.0.0.1"], placed
    assert placed.nodes[0].split(" at ")[0] != died.node_id[:12]
    # Re-shared twice: to the survivor's rank when the node went (it reads on, the lost
    # rank's rows appended to its stream), then, when the new gang joined, the end of the
    # survivor's stream to the new rank (the survivor reads on); every rank then has as many
    # batches as the other.
    reshares = result.events.of(DataReshared)
    assert [e.ranks for e in reshares] == [1, 1], reshares
    assert [e.taken_over for e in reshares] == [True, False], reshares
    assert [e.handed_off for e in reshares] == [False, True], reshares
    assert all(e.left_over == 0 for e in reshares)
    (joined,) = result.events.of(GangJoined)
    assert reshares[1].step == joined.step
    assert result.steps == reshares[-1].end_step
    assert result.history[-1].gangs == 2
    assert len({d["dense"] for d in result.state_digests.values()}) == 1
    assert len({d["shards"] for d in result.state_digests.values()}) == 1  # gang size 1
    assert result.lost_batches == 0
    distinct = sum(b - a for a, b in result.committed_batches)
    assert result.committed_count == distinct, "a batch was trained into the model twice"

    # Every row of the epoch (by row_id) in exactly one committed batch.
    trained = committed_row_ids(result, data.paths)
    assert sorted(trained.tolist()) == list(range(ROWS))
