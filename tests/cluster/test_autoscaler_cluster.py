"""Elastic training on Ray's own autoscaler, and reading the node types an autoscaler may add.

The cluster tests run a head with Ray's autoscaler on its fake multi-node provider
(``raytrec.cluster.local.autoscaling_cluster``: the autoscaler starts and stops worker nodes as
processes on this machine; its own test helper would first stop every Ray process on the
machine). The worker node type is sized as docs/autoscaling.md prescribes: one node holds
``k = 1`` whole gang (``gang_size x cpus_per_rank`` CPUs), ``min_workers = ceil(min_gangs / k)``,
``max_workers = max_gangs / k`` (here scaled from zero: ``min_workers`` 0). One job run,
starting with fewer gangs than ``elastic.max_gangs``:

- with no worker node up and no node types published (Ray 2.60's autoscaler publishes none),
  the job warns instead of refusing, and its placement makes the autoscaler launch a node;
- its pending placement group for one more gang is the demand the autoscaler sees: it launches
  a node and the job grows onto it (a gang joins);
- a preemption notice marks that node for removal: the gang on it is given back at the next
  interval boundary and a replacement is requested; the autoscaler terminates the idle node
  (then it may launch one for the replacement, which joins if built before the job ends);
- every batch is trained into the final model exactly once and every replica agrees.

The unit tests read node types from a published cluster config (the fake cluster's own, as a
newer Ray autoscaler publishes it: Ray 2.60's publish none, which the cluster test pins), and a
failure to read them is an error naming what failed, while a fixed cluster (no config) works.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray._private.state import state
from ray.core.generated import autoscaler_pb2
from test_elastic_cluster import assert_every_batch_once, assert_replicas_agree

import raytrec
from raytrec.api import CapacityUnknownWarning, TrainingStopped, fit
from raytrec.cluster import (
    ClusterStateError,
    autoscaler_hides_node_types,
    autoscaling_in_status,
    cluster_shapes,
    node_shapes,
    read_cluster_config,
)
from raytrec.cluster.capacity import NodeShape
from raytrec.cluster.local import (
    AutoscalingCluster,
    WorkerNodeType,
    autoscaling_cluster,
    connected,
    fake_autoscaling_config,
)
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
from raytrec.elastic.events import GangDrained, GangJoined, GangRequested
from raytrec.elastic.faults import FaultKind, FaultSpec
from raytrec.errors import ConfigError, StopRequested
from raytrec.observability.metrics import IntervalMetrics
from raytrec.preflight import check_capacity
from raytrec.testing import NodeDrainer, running_coordinator

GANG_SIZE = 2
CPUS_PER_RANK = 1
MIN_GANGS, START_GANGS, MAX_GANGS = 1, 1, 2
GANGS_PER_NODE = 1  # k in docs/autoscaling.md
#: A bound: the job is stopped once it has grown and given the preempted node back.
NUM_STEPS = 600


def job_config(tmp_path: Any, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = {
        "model": ModelConfig(tables=criteo_tables(num_features=4, num_embeddings=200)),
        "scaling": ScalingConfig(
            num_workers=START_GANGS * GANG_SIZE, gang_size=GANG_SIZE, cpus_per_rank=CPUS_PER_RANK
        ),
        "sync": SyncConfig(sync_every=2),
        "data": DataConfig(batch_size=32),
        "elastic": ElasticConfig(
            min_gangs=MIN_GANGS,
            max_gangs=MAX_GANGS,
            step_timeout_s=30,
            collective_timeout_s=10,
            resource_wait_s=120,
            poll_s=0.2,
        ),
        "log_every": 2,
        "storage_path": str(tmp_path),
    }
    base.update(kw)
    return TrainConfig(**base)


def gang_node_type(config: TrainConfig) -> WorkerNodeType:
    """The worker node type docs/autoscaling.md prescribes for ``config``."""
    scaling, elastic = config.scaling, config.elastic
    assert elastic.max_gangs is not None and elastic.max_gangs % GANGS_PER_NODE == 0
    return WorkerNodeType(
        name="gang",
        resources={"CPU": float(GANGS_PER_NODE * scaling.gang_size * scaling.cpus_per_rank)},
        min_workers=math.ceil(elastic.min_gangs / GANGS_PER_NODE),
        max_workers=elastic.max_gangs // GANGS_PER_NODE,
    )


def published_config(autoscaling: dict[str, Any]) -> autoscaler_pb2.ClusterConfig:
    """The cluster config an autoscaler publishes in the GCS for its worker node types (what
    ``ray._private.state.state.get_cluster_config`` reads back)."""
    config = autoscaler_pb2.ClusterConfig()
    head = autoscaling["head_node_type"]
    for name, t in autoscaling["available_node_types"].items():
        if name == head:
            continue
        group = config.node_group_configs.add()
        group.name = name
        group.min_count = t.get("min_workers", 0)
        group.max_count = t["max_workers"]
        for k, v in t["resources"].items():
            group.resources[k] = int(v)
    return config


# --- reading node types (unit) -----------------------------------------------------------------

LIVE = [
    {"Alive": True, "Resources": {"CPU": 2.0, "memory": 1e9}},
    {"Alive": True, "Resources": {"memory": 1e9}},  # a head without CPUs holds no rank
    {"Alive": False, "Resources": {"CPU": 8.0}},
]


def test_node_types_are_read_from_the_config_the_autoscaler_published() -> None:
    node_type = gang_node_type(job_config("/tmp"))
    autoscaling = fake_autoscaling_config([node_type], gcs_address="127.0.0.1:1", idle_timeout_s=6)
    shapes = node_shapes(LIVE, published_config(autoscaling))
    assert shapes == [
        NodeShape(name="alive", resources={"CPU": 2.0}, count=1),
        NodeShape(name="node type gang", resources={"CPU": 2.0}, count=2),
    ]
    # A job of max_gangs gangs fits what the autoscaler may add; a gang bigger than a node not.
    check_capacity(job_config("/tmp", scaling=ScalingConfig(num_workers=4, gang_size=2)), shapes)
    with pytest.raises(ConfigError, match="no node is that big"):
        check_capacity(
            job_config("/tmp", scaling=ScalingConfig(num_workers=4, gang_size=4)), shapes
        )


def test_a_fixed_cluster_has_its_live_nodes_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state, "get_cluster_config", lambda: None)  # no autoscaler published
    assert read_cluster_config() is None
    assert node_shapes(LIVE, None) == [NodeShape(name="alive", resources={"CPU": 2.0}, count=1)]


def test_a_failed_read_of_node_types_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    def unreachable() -> None:
        raise ConnectionError("GCS at 127.0.0.1:1 did not answer in 10s")

    monkeypatch.setattr(state, "get_cluster_config", unreachable)
    with pytest.raises(ClusterStateError) as e:
        read_cluster_config()
    message = str(e.value)
    assert "autoscaler's node types" in message and "get_cluster_config" in message, message
    assert "ConnectionError: GCS at 127.0.0.1:1 did not answer" in message, message
    assert isinstance(e.value.__cause__, ConnectionError)
    # The check a job's start makes reports it the same way.
    with pytest.raises(ClusterStateError, match="autoscaler's node types"):
        autoscaler_hides_node_types()


def test_unpublished_node_types_turn_a_refusal_into_a_warning() -> None:
    config = job_config("/tmp")
    no_nodes: list[NodeShape] = []
    with pytest.raises(ConfigError, match="no node is that big"):
        check_capacity(config, no_nodes)
    with pytest.warns(CapacityUnknownWarning, match="not published its node types"):
        check_capacity(config, no_nodes, unpublished_node_types=True)


def status(mapping: dict[str, str]) -> bytes:
    """A status as Ray's monitor writes it under ``__autoscaling_status`` (the parts read)."""
    active: dict[str, int] = {}
    for t in mapping.values():
        active[t] = active.get(t, 0) + 1
    report = {"active_nodes": active, "node_type_mapping": mapping, "legacy": True}
    return json.dumps({"autoscaler_report": report, "load_metrics_report": {}}).encode()


def test_an_autoscaler_is_told_from_the_fixed_clusters_read_only_one() -> None:
    head, worker = "f" * 51 + "00000", "f" * 51 + "00001"
    # The fake cluster's autoscaler, as it reported in the cluster test.
    assert autoscaling_in_status(status({head: "ray.head.default", worker: "gang"}))
    # A fixed cluster: the monitor's read-only autoscaler names each node's type after it.
    assert not autoscaling_in_status(status({head: f"node_{head}", worker: f"node_{worker}"}))
    assert not autoscaling_in_status(b'{"load_metrics_report": {}}')  # no autoscaler at all
    assert not autoscaling_in_status(None)


# --- on Ray's autoscaler --------------------------------------------------------------------


@pytest.fixture(scope="module")
def autoscaler() -> Iterator[AutoscalingCluster]:
    # Scaled from zero (min_workers 0, below the rule's 1): no worker node is up when the job
    # starts, so the job itself makes the autoscaler launch every node it trains on.
    node_type = dataclasses.replace(gang_node_type(job_config("/tmp")), min_workers=0)
    with (
        autoscaling_cluster([node_type], idle_timeout_s=3, update_interval_s=1) as c,
        connected(c),
    ):
        deadline = time.monotonic() + 60
        while not autoscaler_hides_node_types():  # the autoscaler has reported once
            assert time.monotonic() < deadline, "the autoscaler never reported its status"
            time.sleep(1)
        yield c


def worker_nodes() -> dict[str, dict[str, Any]]:
    """The live nodes with CPUs (the head has none), by node id."""
    return {n["NodeID"]: n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")}


@pytest.mark.cluster
@pytest.mark.timeout(480)  # 200-230 s measured on the loaded 2-core machine
def test_the_job_grows_onto_nodes_the_autoscaler_adds_and_gives_a_preempted_one_back(
    autoscaler: AutoscalingCluster, tmp_path: Any
) -> None:
    assert not worker_nodes()
    seen: dict[str, Any] = {}

    def on_progress(row: IntervalMetrics) -> None:
        if "drained" in seen and row.gangs < MAX_GANGS and "stop" not in seen:
            # Grown and given back: the rest would only wait out the job's length.
            [run_dir] = [d for d in tmp_path.iterdir() if d.name.startswith("raytrec-")]
            seen["stop"] = raytrec.stop(str(run_dir))
        if row.gangs == MAX_GANGS and "grown" not in seen:
            nodes = ray.get(running_coordinator().rank_nodes.remote())
            seen["grown"] = row.step
            seen["first_gang_node"] = nodes[0]
            seen["new_gang_node"] = nodes[START_GANGS * GANG_SIZE]
            # A preemption notice for the new gang's node (Ray's DrainNode), as a cloud sends.
            drainer = NodeDrainer(at_step=0, job_rank=START_GANGS * GANG_SIZE, deadline_s=60)
            drainer(row)
            seen["drained"] = drainer.drained

    # Slow steps, so the job trains while nodes are launched, built on and taken away, until
    # it is stopped once that is done; the waits are bounded by the job's length (a job that
    # ends first fails the asserts below).
    config = job_config(
        tmp_path,
        testing=TestingConfig(
            faults=(
                FaultSpec(kind=FaultKind.SLOW_RANK, step=1, rank=0, stall_s=0.5, steps=NUM_STEPS),
            )
        ),
        num_steps=NUM_STEPS,
    )
    # No live node holds a gang, and the autoscaler published no node types: the job warns,
    # asks for its placement and waits for the autoscaler's node.
    with (
        pytest.warns(CapacityUnknownWarning, match="no node is that big"),
        pytest.raises(TrainingStopped) as stopped,
    ):
        fit(config, on_progress=on_progress, shutdown_ray=False)
    assert isinstance(stopped.value.cause, StopRequested), stopped.value
    result = stopped.value.result

    kinds = result.events.kinds()
    assert "grown" in seen, f"the job never reached {MAX_GANGS} gangs: {kinds}"
    # The new gang runs on a node the autoscaler launched for the job's pending group.
    assert seen["new_gang_node"] != seen["first_gang_node"]
    assert seen["drained"] == seen["new_gang_node"]
    requested = result.events.of(GangRequested)
    joined = result.events.of(GangJoined)
    (drained,) = result.events.of(GangDrained)
    assert drained.gang_id == 1 and "nodes marked for removal" in drained.reason, drained
    assert joined[0].gang_id == 1 and joined[0].step <= drained.step, kinds
    # Each time the job was below max_gangs it asked for one more gang: at the start, and for
    # a replacement once the preempted node's gang was given back.
    assert [(e.step, e.count) for e in requested[:2]] == [(0, 1), (drained.step, 1)]
    # A replacement joins if its node was launched and built before the job's end.
    assert [e.gang_id for e in joined] in ([1], [1, 2]), kinds
    # The autoscaler terminates the drained node once it is idle.
    deadline = time.monotonic() + 60
    while seen["drained"] in worker_nodes():
        assert time.monotonic() < deadline, "the autoscaler kept the drained node"
        time.sleep(1)
    assert not [e for e in result.events if e.kind in ("rank_died", "gang_dropped")], kinds
    assert drained.step < result.steps < NUM_STEPS  # stopped once given back
    assert_replicas_agree(result)
    assert_every_batch_once(result)


@pytest.mark.cluster
def test_node_types_on_the_autoscaling_cluster(autoscaler: AutoscalingCluster) -> None:
    # Ray 2.60's autoscaler publishes no node types: only the live nodes are known, and the
    # job knows an autoscaler may add more (its capacity check then warns instead of refusing).
    assert read_cluster_config() is None
    assert autoscaler_hides_node_types()
    assert {s.name for s in cluster_shapes()} <= {"alive"}
    # Published as a newer autoscaler does (the GCS's ReportClusterConfig), they are read back.
    gcs = ray._raylet.GcsClient(address=autoscaler.gcs_address)
    gcs.report_cluster_config(published_config(autoscaler.config()).SerializeToString())
    try:
        assert not autoscaler_hides_node_types()
        assert NodeShape(name="node type gang", resources={"CPU": 2.0}, count=2) in (
            cluster_shapes()
        )
    finally:
        gcs.report_cluster_config(b"")  # unpublished again
    assert read_cluster_config() is None


@pytest.mark.cluster
def test_a_fixed_cluster_has_no_autoscaler_to_wait_for(local_ray: None) -> None:
    from ray._private import ray_constants

    gcs = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)
    deadline = time.monotonic() + 60
    # Ray's monitor runs on a fixed cluster too, with no autoscaler: once it has reported, that
    # report says so, and a job's capacity check there refuses instead of waiting.
    while gcs.internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS.encode(), None) is None:
        assert time.monotonic() < deadline, "Ray's monitor never reported"
        time.sleep(1)
    assert read_cluster_config() is None
    assert not autoscaler_hides_node_types()
