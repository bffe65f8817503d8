"""Fault-injection doubles for tests and demos on a simulated multi-node Ray cluster.

Rank faults (kill, hang, slow) are carried out by the rank itself, from ``testing.faults``.
Removing a node needs the cluster object, which only the test or demo holds:
:class:`NodeRemover` is an ``on_progress`` callback for :func:`raytrec.fit` that removes, once
the job has trained a given number of steps, the node of ``ray.cluster_utils.Cluster`` that runs
a chosen job rank (asked of the running coordinator), and can add a fresh node later so the job
grows back. :func:`simulated_cluster` starts such a cluster on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import ray
import ray.exceptions
from ray.cluster_utils import Cluster

from raytrec.cluster import COORDINATOR_PREFIX, bind_to_loopback
from raytrec.observability.metrics import IntervalMetrics

if TYPE_CHECKING:
    import numpy as np

    from raytrec.result import Result

__all__ = [
    "NodeDrainer",
    "NodeRemover",
    "committed_row_ids",
    "running_coordinator",
    "simulated_cluster",
]


@contextlib.contextmanager
def simulated_cluster(nodes: int, *, cpus_per_node: float) -> Iterator[Cluster]:
    """A multi-node Ray cluster in this machine, every node on 127.0.0.1, with this process
    connected to it. The head node has no CPUs, so no rank lands on it and removing any worker
    node never takes the driver's node (where the coordinator is pinned) with it."""
    if ray.is_initialized():  # a cluster this process is connected to: this one replaces it
        ray.shutdown()
    bind_to_loopback()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False},
    )
    try:
        for _ in range(nodes):
            cluster.add_node(num_cpus=cpus_per_node, node_ip_address="127.0.0.1")
        ray.init(address=cluster.address)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def running_coordinator() -> Any:
    """The handle of the one running raytrec coordinator in this Ray session."""
    names = [
        a["name"] if isinstance(a, dict) else a
        for a in ray.util.list_named_actors(all_namespaces=False)
    ]
    live = []
    for name in (n for n in names if n.startswith(COORDINATOR_PREFIX)):
        # A coordinator killed a moment ago can still be listed: keep those that answer.
        try:
            handle = ray.get_actor(name)
            ray.get(handle.progress.remote(0), timeout=10)
        except (ValueError, ray.exceptions.RayError):
            continue
        live.append(handle)
    if len(live) != 1:
        raise RuntimeError(f"expected one running raytrec coordinator, found {len(live)}")
    return live[0]


@dataclasses.dataclass
class NodeRemover:
    """``on_progress`` callback: at ``at_step`` removes the node running ``job_rank``; at
    ``add_at_step`` (optional) adds a node made by ``add_node``."""

    cluster: Any  # ray.cluster_utils.Cluster
    at_step: int
    job_rank: int
    add_at_step: int | None = None
    add_node: Callable[[Any], Any] | None = None
    then: Callable[[IntervalMetrics], None] | None = None  # the progress printer to chain
    removed: str | None = None  # the Ray node id removed
    added: Any = None

    def __call__(self, row: IntervalMetrics) -> None:
        if self.then is not None:
            self.then(row)
        if self.removed is None and row.step >= self.at_step:
            nodes = ray.get(running_coordinator().rank_nodes.remote())
            node_id = nodes[self.job_rank]
            node = next(n for n in self.cluster.list_all_nodes() if n.node_id == node_id)
            self.cluster.remove_node(node)
            self.removed = node_id
        if (
            self.add_at_step is not None
            and self.added is None
            and self.removed is not None
            and row.step >= self.add_at_step
        ):
            assert self.add_node is not None
            self.added = self.add_node(self.cluster)


@dataclasses.dataclass
class NodeDrainer:
    """``on_progress`` callback: at ``at_step`` marks the node running ``job_rank`` as draining
    in Ray's GCS, as an autoscaler does before it removes an idle node or a cloud before it
    preempts one (reason: preemption, ``deadline_s`` from now)."""

    at_step: int
    job_rank: int
    deadline_s: float = 600.0
    drained: str | None = None  # the Ray node id marked

    def __call__(self, row: IntervalMetrics) -> None:
        if self.drained is not None or row.step < self.at_step:
            return
        import time

        from ray.core.generated import autoscaler_pb2

        node_id = ray.get(running_coordinator().rank_nodes.remote())[self.job_rank]
        # This session's GCS ("auto" would find the cluster started last on this machine).
        gcs = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)
        accepted, why = gcs.drain_node(
            node_id,
            autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
            "raytrec test: node preempted",
            int(time.time() * 1000 + self.deadline_s * 1000),
        )
        if not accepted:
            raise RuntimeError(f"Ray refused to drain node {node_id}: {why}")
        self.drained = node_id


def committed_row_ids(result: Result, paths: Sequence[str]) -> np.ndarray:
    """The ``row_id`` of every row in the batches ``result`` committed into its model (one entry
    per time a row was trained), for a job that read the Parquet files ``paths`` by index: what
    an exactly-once check over the data compares with the files' own row ids. Re-shared
    streams are located with ``result.reshared_streams``."""
    import numpy as np
    import pyarrow.parquet as pq

    from raytrec.data.from_config import parquet_spec
    from raytrec.data.parquet import IndexedParquetShard, ParquetSource

    config = result.config
    source = ParquetSource(
        paths=list(paths),
        spec=parquet_spec(config),
        read_mode="indexed",
        epochs=config.data.epochs,
        shuffle_seed=config.data.shuffle_seed,
        shuffle_window_rows=config.data.shuffle_window_rows,
    )
    table = result.reshared_streams or {"made": {}}
    # The plan of the ranks the job's data was split for (a resumed job keeps its checkpoint's).
    shard = source.split(int(table.get("num_shards", config.scaling.world_size)))[0]
    if not isinstance(shard, IndexedParquetShard):
        raise TypeError("committed_row_ids needs Parquet read by index")
    assert config.num_steps is not None  # fit resolves it
    shard = shard.with_table(table, limit=config.num_steps)
    ids = {p: pq.read_table(p, columns=["row_id"])["row_id"].to_numpy() for p in paths}
    batch = config.data.batch_size
    found = [
        ids[p.path][p.file_row : p.file_row + p.rows]
        for a, b in result.committed_batches
        for i in range(a, b)
        for p in shard.batch_pieces(i, batch)
    ]
    return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
