"""Gangs in failure domains on a simulated multi-node Ray cluster whose shape makes Ray's own
choice put two gangs together: one large node (4 CPUs, rack r1) beside three small ones (2 CPUs,
racks r1, r2 and r3), each small one half used by another job's placement group. Ray packs two
one-rank gangs onto the large node; raytrec puts them on different nodes (``failure_domain:
node``) or racks (``label:rack``), says when gangs must share a rack, and, when a rack loses a
node, trains on with the other gang and places the replacement in a rack that neither lost a
node nor holds the survivor. One cluster serves the module; the job that loses a node runs
last."""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from actors.worker_group import RayWorkerGroup
from raytrec.api import fit
from raytrec.cluster.domain_placement import GangDomains
from raytrec.cluster.domains import FailureDomain
from raytrec.cluster.placement import PlacementSpec
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
from raytrec.elastic.events import DomainShared, GangDropped, GangJoined, GangPlaced
from raytrec.elastic.faults import FaultKind, FaultSpec
from raytrec.elastic.workers import SystemClock
from raytrec.testing import NodeRemover, running_coordinator, simulated_cluster

pytestmark = pytest.mark.cluster

RACKS = {"big": "r1", "s1": "r1", "s2": "r2", "s3": "r3"}


class Shape:
    """The module's cluster: its ``ray.cluster_utils.Cluster``, node name -> Ray node id."""

    def __init__(self, cluster: Any, ids: dict[str, str]) -> None:
        self.cluster = cluster
        self.ids = ids
        self.names = {v: k for k, v in ids.items()}

    def name_of(self, node: str) -> str:
        """The node's name from an event's ``<node id prefix> at <address>``."""
        prefix = node.split(" at ")[0]
        (name,) = [n for i, n in self.names.items() if i.startswith(prefix)]
        return name


@pytest.fixture(scope="module")
def shape() -> Iterator[Shape]:
    with simulated_cluster(0, cpus_per_node=0) as cluster:
        ids = {}
        for name, rack in RACKS.items():
            cpus = 4 if name == "big" else 2
            node = cluster.add_node(
                num_cpus=cpus, node_ip_address="127.0.0.1", labels={"rack": rack}
            )
            ids[name] = node.node_id
        # Another job's work holds one CPU of each small node.
        others = [
            placement_group(
                [{"CPU": 1}], strategy="STRICT_PACK", bundle_label_selector=[{NODE: ids[n]}]
            )
            for n in ("s1", "s2", "s3")
        ]
        ray.get([pg.ready() for pg in others], timeout=60)
        settle()
        yield Shape(cluster, ids)


NODE = "ray.io/node-id"
ONE_RANK = PlacementSpec(
    name="gang", bundles=({"CPU": 1.0},), strategy="STRICT_PACK", ranks=((0,),)
)


def settle() -> None:
    """Waits until the groups removed are free again in the GCS's view (removal is
    asynchronous), so the next choice reads the cluster as it is: 7 CPUs free."""
    from ray._private.state import available_resources_per_node

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        free = sum(r.get("CPU", 0.0) for r in available_resources_per_node().values())
        if free == 7:
            return
        time.sleep(0.2)
    raise AssertionError(f"the cluster has {free} CPUs free, not 7")


def node_of(pg: Any) -> str:
    from ray.util.placement_group import placement_group_table

    ray.get(pg.ready(), timeout=30)
    return str(placement_group_table(pg)["bundles_to_node_id"][0])


def test_ray_packs_two_gangs_on_the_large_node_and_raytrec_keeps_them_apart(shape: Shape) -> None:
    plain = [placement_group([{"CPU": 1}], strategy="STRICT_PACK") for _ in range(2)]
    assert [shape.names[node_of(pg)] for pg in plain] == ["big", "big"]
    for pg in plain:
        remove_placement_group(pg)
    settle()
    group, events = RayWorkerGroup(), []
    for domain in ("node", "label:rack"):
        domains = GangDomains(
            domain=FailureDomain.parse(domain),
            group=group,
            clock=SystemClock(),
            wait_s=0,
            record=events.append,
            stamp=lambda: (0.0, 0),
        )
        pgs = domains.place_all([ONE_RANK] * 2, ["", ""])
        nodes = [shape.names[node_of(pg)] for pg in pgs]
        for g, pg in enumerate(pgs):
            domains.placed(g, pg)
        for pg in pgs:
            group.release(pg)
        settle()
        if domain == "node":  # the large node takes one gang, the other goes elsewhere
            assert nodes[0] == "big" and nodes[1] != "big", nodes
        else:  # rack r1 (the room) takes one gang, another rack the other
            assert RACKS[nodes[0]] == "r1" and RACKS[nodes[1]] != "r1", nodes
    assert not events


def test_gangs_that_must_share_a_rack_are_placed_and_reported(shape: Shape) -> None:
    group, events = RayWorkerGroup(), []
    domains = GangDomains(
        domain=FailureDomain.parse("label:rack"),
        group=group,
        clock=SystemClock(),
        wait_s=0,
        record=events.append,
        stamp=lambda: (0.0, 0),
    )
    pgs = domains.place_all([ONE_RANK] * 4, [""] * 4)  # four gangs, three racks
    racks = [RACKS[shape.names[node_of(pg)]] for pg in pgs]
    for g, pg in enumerate(pgs):
        domains.placed(g, pg)
    for pg in pgs:
        group.release(pg)
    settle()
    assert sorted(racks[:3]) == ["r1", "r2", "r3"] and racks[3] == "r1"  # r1 has room left
    assert events == [DomainShared(at=0.0, step=0, gang_id=3, domain="rack=r1", with_gangs=(0,))]


def test_a_rack_loses_a_node_the_other_gang_trains_on_and_the_replacement_avoids_it(
    shape: Shape, tmp_path: str
) -> None:
    config = TrainConfig(
        model=ModelConfig(tables=criteo_tables(num_features=4, num_embeddings=200)),
        scaling=ScalingConfig(num_workers=2, gang_size=1, failure_domain="label:rack"),
        sync=SyncConfig(sync_every=2),
        data=DataConfig(batch_size=32),
        elastic=ElasticConfig(
            min_gangs=2,  # training waits for the replacement, so it joins in this short run
            max_gangs=2,
            step_timeout_s=15,
            collective_timeout_s=8,
            resource_wait_s=120,
            poll_s=0.2,
        ),
        # Gang 1 slows down from step 5 on, so the node removal below (done by the driver once
        # it sees step 4) lands while the job is still training.
        testing=TestingConfig(
            faults=(FaultSpec(kind=FaultKind.SLOW_RANK, step=5, rank=1, stall_s=1.0, steps=10),)
        ),
        num_steps=20,
        log_every=2,
        storage_path=str(tmp_path),
    )
    remover = NodeRemover(cluster=shape.cluster, at_step=4, job_rank=0)  # gang 0's node
    started: dict[int, str] = {}  # job rank -> its node, as the job started

    def on_progress(row: Any) -> None:
        if not started:
            started.update(ray.get(running_coordinator().rank_nodes.remote()))
        remover(row)

    result = fit(config, on_progress=on_progress, shutdown_ray=False)

    assert result.steps == 20, result.events
    # Apart: gang 0 in r1 (where the room is), gang 1 in another rack, though Ray alone would
    # have put both on the large node.
    first = [shape.names[started[r]] for r in (0, 1)]
    assert RACKS[first[0]] == "r1" and RACKS[first[1]] != "r1", first
    assert remover.removed == started[0]
    # The rack lost a node and gang 0 with it; gang 1 trained on: no total loss, nothing shared.
    assert [e.gang_id for e in result.events.of(GangDropped)] == [0]
    assert "total_loss" not in result.events.kinds() and not result.events.of(DomainShared)
    (joined,) = result.events.of(GangJoined)
    # The replacement is in neither the rack that lost a node (its other node has room) nor
    # the survivor's.
    (placed,) = result.events.of(GangPlaced)
    replacement = RACKS[shape.name_of(placed.nodes[0])]
    assert replacement not in {"r1", RACKS[first[1]]}, (first, placed)
    # Every batch trained once, and the replicas agree.
    distinct = sum(b - a for a, b in result.committed_batches)
    assert result.committed_count == distinct and result.lost_batches == 0
    by_shard: dict[int, list[int]] = collections.defaultdict(list)
    for a, b in result.committed_batches:
        for i in range(a, b):
            shard, step = split_batch_id(i)
            by_shard[shard].append(step)
    assert all(sorted(s) == list(range(len(s))) for s in by_shard.values())
    assert len({d["dense"] for d in result.state_digests.values()}) == 1
    assert len(result.state_digests) == 2 and joined.gang_id == 2
