"""Whether a cluster can ever hold a job: checked before any data is generated or actor started.

Pure code. The cluster is described by its node shapes: the nodes alive now and, on an
autoscaling cluster, the node types the autoscaler may add (with their maximum counts, as
Ray's cluster config gives them). The job is described by its placement bundles
(:func:`raytrec.cluster.placement.placement_specs`: one bundle per host a gang spans, whole on one
node). A job is refused when

- it asks for GPUs and no node, present or addable, has one;
- one of its bundles fits no node shape (a gang's ranks on one host need more than the
  biggest node holds);
- its bundles cannot all be placed at once on every node the cluster has or may add
  (first-fit decreasing over node instances, which is exact for the equal-sized bundles a
  topology makes), or, with a Ray Data source, they leave no CPU for its tasks.

An autoscaling node type with no maximum count holds any number of bundles.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from raytrec.cluster.placement import PlacementSpec, placement_specs, rank_resources
from raytrec.config import TrainConfig

if TYPE_CHECKING:
    from raytrec.elastic.workers import NodeInfo

__all__ = [
    "NodeShape",
    "capacity_refusal",
    "describe_bundles",
    "describe_nodes",
    "describe_shapes",
    "gangs_that_fit",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeShape:
    """A kind of node: ``count`` nodes (None: as many as needed) with ``resources`` each."""

    name: str
    resources: Mapping[str, float]
    count: int | None = 1


def _fmt(resources: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {resources[k]:g}" for k in ("CPU", "GPU") if k in resources) + "}"


def describe_shapes(shapes: Sequence[NodeShape]) -> str:
    """``2 x {CPU: 4} (alive), 10 x {CPU: 8, GPU: 1} (node type gpu-gang)`` and so on."""
    parts = []
    for s in shapes:
        count = "any number of" if s.count is None else f"{s.count} x"
        parts.append(f"{count} {_fmt(s.resources)} ({s.name})")
    return ", ".join(parts) or "no nodes"


def describe_bundles(specs: Sequence[PlacementSpec]) -> str:
    """``2 x {CPU: 2}``: the job's bundles (each whole on one node), alike ones counted."""
    counts: dict[str, int] = {}
    for spec in specs:
        for bundle in spec.bundles:
            counts[_fmt(bundle)] = counts.get(_fmt(bundle), 0) + 1
    return ", ".join(f"{n} x {shape}" for shape, n in counts.items()) + " on one node each"


def describe_nodes(nodes: Sequence[NodeInfo], *, most: int = 8) -> str:
    """``127.0.0.1 {CPU: 4}, 127.0.0.2 {CPU: 4}``: the live nodes that can hold a rank (with
    CPUs or GPUs), with their sizes."""
    alive = [
        f"{n.address} {_fmt(n.resources)}"
        for n in nodes
        if n.alive and (n.resources.get("CPU") or n.resources.get("GPU"))
    ]
    more = f" and {len(alive) - most} more" if len(alive) > most else ""
    return (", ".join(alive[:most]) + more) or "none"


def _fits(bundle: Mapping[str, float], free: Mapping[str, float]) -> bool:
    return all(free.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items())


def _take(bundle: Mapping[str, float], free: Sequence[dict[str, float]]) -> bool:
    """Places ``bundle`` on the first node of ``free`` it fits (first fit), taking its room."""
    for node in free:
        if _fits(bundle, node):
            for k, v in bundle.items():
                node[k] -= v
            return True
    return False


def gangs_that_fit(
    gangs: Sequence[Sequence[Mapping[str, float]]], nodes: Sequence[Mapping[str, float]]
) -> int:
    """How many of ``gangs`` (each its placement bundles, every bundle whole on one node), taken
    in order, nodes of ``nodes``' resources hold at once (first fit, exact for the equal gangs a
    topology makes)."""
    free = [dict(n) for n in nodes]
    for placed, bundles in enumerate(gangs):
        if not all(_take(bundle, free) for bundle in bundles):
            return placed
    return len(gangs)


def capacity_refusal(
    config: TrainConfig, shapes: Sequence[NodeShape], *, ray_data: bool = False
) -> str | None:
    """Why the cluster of ``shapes`` can never run ``config``; None when it can."""
    scaling = config.scaling
    per_rank = rank_resources(cpus_per_rank=scaling.cpus_per_rank, use_gpu=scaling.use_gpu)
    asked = (
        f"{scaling.world_size} workers ({scaling.num_gangs} "
        f"gang{'s' if scaling.num_gangs != 1 else ''} x {scaling.gang_size} ranks, "
        f"{_fmt(per_rank)} each)"
    )
    nodes = describe_shapes(shapes)
    if scaling.use_gpu and not any(s.resources.get("GPU", 0.0) > 0 for s in shapes):
        return (
            f"scaling.use_gpu is set: {asked} need a GPU per rank, but no node of the cluster "
            f"has a GPU (nodes: {nodes}); set scaling.use_gpu: false or add GPU nodes"
        )
    specs = placement_specs(scaling.topology(), per_rank=per_rank)
    # Largest first; a bundle holds the ranks of one host, so its size is its rank count.
    sized = sorted(
        (
            (len(ranks), bundle)
            for s in specs
            for ranks, bundle in zip(s.ranks, s.bundles, strict=True)
        ),
        key=lambda pair: -pair[0],
    )
    bundles = [bundle for _, bundle in sized]
    ranks, biggest = sized[0]
    if not any(_fits(biggest, s.resources) for s in shapes):
        return (
            f"scaling: {ranks} ranks of a gang share a host (scaling.ranks_per_host="
            f"{scaling.ranks_per_host or scaling.gang_size}) and must be placed on one node "
            f"together, needing {_fmt(biggest)}, but no node is that big (nodes: {nodes}); lower "
            "scaling.ranks_per_host or scaling.cpus_per_rank, or add bigger nodes"
        )
    # A node type never needs more instances than there are bundles.
    free = [
        dict(s.resources)
        for s in shapes
        for _ in range(min(len(bundles), len(bundles) if s.count is None else s.count))
    ]
    placed = sum(_take(bundle, free) for bundle in bundles)
    if placed < len(bundles):
        return (
            f"scaling: {asked} are placed as {len(bundles)} groups of ranks that each share a "
            f"node, and the cluster holds at most {placed} of them at once (nodes: {nodes}); "
            "lower scaling.num_workers or scaling.cpus_per_rank, or add nodes"
        )
    if ray_data and not any(s.count is None for s in shapes):
        cpus = sum(s.resources.get("CPU", 0.0) * (s.count or 0) for s in shapes)
        if cpus - per_rank["CPU"] * scaling.world_size < 1:
            return (
                f"scaling: the ranks take {per_rank['CPU'] * scaling.world_size:g} of the "
                f"cluster's CPUs (nodes: {nodes}) and data.source={config.data.source!r} reads "
                "through Ray Data, whose tasks need at least 1 CPU of their own; lower "
                "scaling.cpus_per_rank or scaling.num_workers, or add CPUs"
            )
    return None
