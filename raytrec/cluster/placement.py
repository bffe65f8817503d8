"""Where ranks run: placement-group shapes computed from the topology.

Pure code. Each placement group is a list of bundles, one per host the group
spans, sized for the ranks on that host. With ``replicas_across_hosts`` every
gang gets its own group, so losing a host removes whole gangs; with
``replicas_within_host`` the whole job is one group of per-host bundles, so a
replica group shares a host.
"""

from __future__ import annotations

import dataclasses

from raytrec.cluster.topology import Layout, Topology

__all__ = [
    "RAY_WORKER_NICENESS",
    "PlacementSpec",
    "placement_specs",
    "rank_resources",
    "rank_runtime_env",
]

#: Ray's setting for the nice increment a worker process applies to itself when it starts.
RAY_WORKER_NICENESS = "RAY_worker_niceness"


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlacementSpec:
    """One Ray placement group: its bundles and which ranks go in which bundle."""

    name: str
    bundles: tuple[dict[str, float], ...]
    strategy: str  # "STRICT_PACK" for one bundle, "PACK" for several
    ranks: tuple[tuple[int, ...], ...]  # ranks[b]: the job ranks placed in bundle b
    #: selectors[b]: the Ray node label selector of bundle b (raytrec.cluster.domains); none:
    #: every bundle where Ray chooses.
    selectors: tuple[dict[str, str], ...] = ()


def rank_resources(*, cpus_per_rank: float, use_gpu: bool) -> dict[str, float]:
    res = {"CPU": float(cpus_per_rank)}
    if use_gpu:
        res["GPU"] = 1.0
    return res


def rank_runtime_env(niceness: int | None) -> dict[str, dict[str, str]] | None:
    """The runtime environment a rank actor is started with (``scaling.rank_niceness``).

    Ray's worker processes raise their own nice value by ``worker_niceness`` (default 15) when
    they start, so that a busy worker yields to the raylet and GCS. A rank is the job's main
    work, as a torchrun worker (nice 0) is; on a host whose cores the ranks fill, a rank at nice
    15 loses the core to every other process that wakes. The setting is read in the worker's
    own environment, so the rank actors get it through their runtime env (Ray's job supervisor
    starts job drivers at 0 the same way); no privilege is needed, since a process only keeps
    its nice value instead of lowering it. Ray merges ``env_vars`` with the job's runtime env,
    so a job's own variables still reach the ranks. Other workers (the coordinator, Ray Data's
    CPU workers) keep Ray's 15 and yield to the ranks. ``None``: Ray's default.
    """
    if niceness is None:
        return None
    return {"env_vars": {RAY_WORKER_NICENESS: str(niceness)}}


def _bundle(ranks: tuple[int, ...], per_rank: dict[str, float]) -> dict[str, float]:
    return {k: v * len(ranks) for k, v in per_rank.items()}


def placement_specs(
    topology: Topology, *, per_rank: dict[str, float], gangs: tuple[int, ...] | None = None
) -> list[PlacementSpec]:
    """Placement groups for ``gangs`` (default: all of them) of ``topology``."""
    gangs = tuple(range(topology.num_gangs)) if gangs is None else gangs
    specs = []
    if topology.layout is Layout.REPLICAS_ACROSS_HOSTS:
        for g in gangs:
            members = topology.gangs[g]
            hosts = topology.gang_hosts(g)
            ranks = tuple(tuple(r for r in members if topology.host_of(r) == h) for h in hosts)
            specs.append(_spec(f"gang{g}", ranks, per_rank))
    else:
        wanted = {r for g in gangs for r in topology.gangs[g]}
        ranks = tuple(
            tuple(r for r in topology.ranks_on_host(h) if r in wanted)
            for h in range(topology.num_hosts)
        )
        specs.append(_spec("hosts", tuple(r for r in ranks if r), per_rank))
    return specs


def _spec(
    name: str, ranks: tuple[tuple[int, ...], ...], per_rank: dict[str, float]
) -> PlacementSpec:
    return PlacementSpec(
        name=name,
        bundles=tuple(_bundle(r, per_rank) for r in ranks),
        strategy="STRICT_PACK" if len(ranks) == 1 else "PACK",
        ranks=ranks,
    )
