"""Who is in the job right now: live gangs, their ranks and nodes, and the replica groups.

A :class:`Membership` is one generation of the job. Gangs are named by ids that are never
reused: the initial gangs are ``0 .. G-1`` (the topology's gang indices), and every gang placed
later gets the next id. Job ranks are stable names too: a new gang's ranks get fresh job ranks
past every rank ever used, so a log line naming rank 17 means the same process for the whole
run. Replica group ``k`` is gang rank ``k`` of every live gang, in gang-id order; a member's
index in its group is its gang's position in that order, which is what the replica plane of the
generation is built with.

Pure values: changes return a new membership, and every change of the live set starts a new
generation.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Sequence

from raytrec.cluster.topology import Layout, Topology

__all__ = ["Gang", "Membership", "MembershipError", "RankSlot", "ReplicaMember"]


class MembershipError(ValueError):
    """An inconsistent membership, or a change that names gangs or ranks it does not hold."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankSlot:
    """One rank of a gang: its stable job rank, its shard position and the node it runs on."""

    job_rank: int
    gang_rank: int
    node: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gang:
    """One model copy: ``ranks[k]`` holds shard position ``k``."""

    gang_id: int
    ranks: tuple[RankSlot, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(self.ranks))
        for k, slot in enumerate(self.ranks):
            if slot.gang_rank != k:
                raise MembershipError(
                    f"gang {self.gang_id}: ranks[{k}].gang_rank={slot.gang_rank}, expected {k}"
                )

    @property
    def job_ranks(self) -> tuple[int, ...]:
        return tuple(s.job_rank for s in self.ranks)

    @property
    def nodes(self) -> tuple[int, ...]:
        """Sorted distinct nodes the gang's ranks run on."""
        return tuple(sorted({s.node for s in self.ranks}))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicaMember:
    """One member of a replica group in the current generation."""

    job_rank: int
    gang_id: int
    #: Position in the replica group (the gang's position among live gangs, by id).
    member_index: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Membership:
    """One generation: the live gangs (sorted by id) and the allocators for new names."""

    generation: int
    layout: Layout
    gang_size: int
    gangs: tuple[Gang, ...]
    #: The last step at which every live gang completed a replica sync.
    last_sync_step: int
    next_gang_id: int
    next_job_rank: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "gangs", tuple(self.gangs))
        ids = [g.gang_id for g in self.gangs]
        if ids != sorted(set(ids)):
            raise MembershipError(f"gang ids must be distinct and sorted, got {ids}")
        if ids and not (ids[0] >= 0 and ids[-1] < self.next_gang_id):
            raise MembershipError(f"gang ids {ids} must lie in 0..{self.next_gang_id - 1}")
        seen: set[int] = set()
        for g in self.gangs:
            if len(g.ranks) != self.gang_size:
                raise MembershipError(
                    f"gang {g.gang_id} has {len(g.ranks)} ranks, expected gang_size="
                    f"{self.gang_size}"
                )
            for r in g.job_ranks:
                if r in seen or not 0 <= r < self.next_job_rank:
                    raise MembershipError(
                        f"job rank {r} of gang {g.gang_id} is repeated or outside "
                        f"0..{self.next_job_rank - 1}"
                    )
                seen.add(r)

    @classmethod
    def initial(cls, topology: Topology) -> Membership:
        """Generation 0 of a job laid out by ``topology``: gang i has id i, rank r runs on host
        ``topology.host_of(r)``."""
        gangs = tuple(
            Gang(
                gang_id=i,
                ranks=tuple(
                    RankSlot(job_rank=r, gang_rank=k, node=topology.host_of(r))
                    for k, r in enumerate(ranks)
                ),
            )
            for i, ranks in enumerate(topology.gangs)
        )
        return cls(
            generation=0,
            layout=topology.layout,
            gang_size=topology.gang_size,
            gangs=gangs,
            last_sync_step=0,
            next_gang_id=topology.num_gangs,
            next_job_rank=topology.world_size,
        )

    # -- lookups ------------------------------------------------------------------------------

    @property
    def num_gangs(self) -> int:
        return len(self.gangs)

    @functools.cached_property
    def gang_ids(self) -> tuple[int, ...]:
        return tuple(g.gang_id for g in self.gangs)

    @functools.cached_property
    def _member_index(self) -> dict[int, int]:
        return {g.gang_id: i for i, g in enumerate(self.gangs)}

    @functools.cached_property
    def _by_id(self) -> dict[int, Gang]:
        return {g.gang_id: g for g in self.gangs}

    @functools.cached_property
    def _gang_of_rank(self) -> dict[int, int]:
        return {s.job_rank: g.gang_id for g in self.gangs for s in g.ranks}

    @functools.cached_property
    def _gangs_of_node(self) -> dict[int, tuple[int, ...]]:
        out: dict[int, list[int]] = {}
        for g in self.gangs:
            for node in g.nodes:
                out.setdefault(node, []).append(g.gang_id)
        return {n: tuple(ids) for n, ids in out.items()}

    def gang(self, gang_id: int) -> Gang:
        try:
            return self._by_id[gang_id]
        except KeyError:
            raise MembershipError(
                f"gang {gang_id} is not live in generation {self.generation}; live gangs: "
                f"{list(self.gang_ids)}"
            ) from None

    def gang_of_rank(self, job_rank: int) -> int | None:
        """The live gang that ``job_rank`` belongs to, or None for a rank no longer (or never)
        in the job."""
        return self._gang_of_rank.get(job_rank)

    def gangs_on_nodes(self, nodes: Iterable[int]) -> tuple[int, ...]:
        """Live gangs with at least one rank on any of ``nodes``; sorted."""
        return tuple(sorted({g for n in set(nodes) for g in self._gangs_of_node.get(n, ())}))

    def member_index(self, gang_id: int) -> int:
        """The gang's position in every replica group of this generation."""
        self.gang(gang_id)
        return self._member_index[gang_id]

    @functools.cached_property
    def replica_groups(self) -> tuple[tuple[ReplicaMember, ...], ...]:
        """Replica group k -> gang rank k of every live gang, in gang-id order."""
        return tuple(
            tuple(
                ReplicaMember(job_rank=g.ranks[k].job_rank, gang_id=g.gang_id, member_index=i)
                for i, g in enumerate(self.gangs)
            )
            for k in range(self.gang_size)
        )

    def dead_shards(self, lost_ranks: Iterable[int]) -> tuple[int, ...]:
        """Shard positions (replica groups) whose every live copy is among ``lost_ranks``."""
        lost = set(lost_ranks)
        return tuple(
            k
            for k in range(self.gang_size)
            if self.gangs and all(g.ranks[k].job_rank in lost for g in self.gangs)
        )

    # -- changes ------------------------------------------------------------------------------

    def without(self, gang_ids: Iterable[int]) -> Membership:
        """The next generation, with ``gang_ids`` dropped."""
        drop = set(gang_ids)
        for gid in sorted(drop):
            self.gang(gid)
        if not drop:
            raise MembershipError("without(): no gang to drop; a generation needs a change")
        return dataclasses.replace(
            self,
            generation=self.generation + 1,
            gangs=tuple(g for g in self.gangs if g.gang_id not in drop),
        )

    def reserve(
        self, nodes_per_gang: Sequence[Sequence[int]]
    ) -> tuple[tuple[Gang, ...], Membership]:
        """Names new gangs placed on the given nodes (one node per gang rank) with fresh gang ids
        and job ranks. They are not live yet: :meth:`with_gangs` adds them when they join."""
        gangs = []
        gang_id, job_rank = self.next_gang_id, self.next_job_rank
        for i, nodes in enumerate(nodes_per_gang):
            if len(nodes) != self.gang_size:
                raise MembershipError(
                    f"placement {i} names {len(nodes)} nodes, one per gang rank is needed "
                    f"(gang_size={self.gang_size})"
                )
            gangs.append(
                Gang(
                    gang_id=gang_id,
                    ranks=tuple(
                        RankSlot(job_rank=job_rank + k, gang_rank=k, node=n)
                        for k, n in enumerate(nodes)
                    ),
                )
            )
            gang_id += 1
            job_rank += self.gang_size
        return tuple(gangs), dataclasses.replace(self, next_gang_id=gang_id, next_job_rank=job_rank)

    def with_gangs(self, gangs: Sequence[Gang], *, step: int) -> Membership:
        """The next generation, with reserved ``gangs`` joined at sync boundary ``step``."""
        if not gangs:
            raise MembershipError("with_gangs(): no gang to add; a generation needs a change")
        for g in gangs:
            if g.gang_id in self._by_id:
                raise MembershipError(f"gang {g.gang_id} is already live")
        return dataclasses.replace(
            self,
            generation=self.generation + 1,
            gangs=tuple(sorted((*self.gangs, *gangs), key=lambda g: g.gang_id)),
            last_sync_step=step,
        )

    def synced(self, step: int) -> Membership:
        """The same generation after every live gang completed the sync at ``step``."""
        if step < self.last_sync_step:
            raise MembershipError(
                f"sync at step {step} is before the last committed sync at {self.last_sync_step}"
            )
        return dataclasses.replace(self, last_sync_step=step)
