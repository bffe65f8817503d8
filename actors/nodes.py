"""Where the job's ranks run, and which of those nodes died.

:class:`JobNodes` is a part of :class:`~actors.coordinator.Coordinator` with state of its own:
the Ray node of every built rank, the gangs each node held, its address, and the nodes already
reported dead. It names nodes the way events do (``<node id prefix> at <address>``), gives the
sync planner a small index per node, and turns what Ray says about lost ranks into
``node_died`` events: at once when a rank's call says its node died, or later, at an interval
boundary, when the node table catches up with a node that went without saying so. It sees the
job through the ports it calls (:class:`NodesPorts`) only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

from actors.job import IntervalOutcome
from actors.ports import HasClock, HasClusterNodes, HasEvents, HasGangOf, HasStep
from raytrec.elastic.events import NodeDied
from raytrec.elastic.membership import Gang, RankSlot
from raytrec.elastic.report import RankInfo
from raytrec.elastic.workers import NODE_DIED

__all__ = ["JobNodes", "NodesPorts"]

# How long a recovery waits for Ray's node table to show a node death it suspects.
NODE_TABLE_GRACE_S = 5.0


class NodesPorts(HasGangOf, HasStep, HasEvents, HasClock, HasClusterNodes, Protocol):
    """The ports :class:`JobNodes` calls."""


class JobNodes:
    """The nodes the job's ranks run on."""

    def __init__(self, job: NodesPorts) -> None:
        self.job = job
        self.of_rank: dict[int, str] = {}  # job rank -> Ray node id (built, live ranks)
        self._index: dict[str, int] = {}
        self._addresses: dict[str, str] = {}  # Ray node id -> its address
        self._gangs: dict[str, set[int]] = {}  # Ray node id -> gangs that ran there
        self._reported_dead: set[str] = set()  # nodes with a node_died event
        # Nodes of ranks lost for another reason than a known node death: checked at the
        # boundaries until the node table says whether they died (report_late_deaths).
        self._suspects: set[str] = set()

    def forget_all(self) -> None:
        """Every rank is gone (the job is torn down to be rebuilt)."""
        self.of_rank.clear()

    def index(self, node_id: str) -> int:
        """A small index for a Ray node id (in order of first sight)."""
        return self._index.setdefault(node_id, len(self._index))

    def saw(self, info: RankInfo) -> None:
        """Notes where a built rank runs."""
        self.of_rank[info.rank] = info.node_id
        self.index(info.node_id)
        self._gangs.setdefault(info.node_id, set()).add(info.gang)
        if info.address:
            self._addresses[info.node_id] = info.address

    def of_slot(self, slot: RankSlot) -> int:
        """The index of the node a rank slot's rank runs on (the slot's own before it is built)."""
        node_id = self.of_rank.get(slot.job_rank)
        return slot.node if node_id is None else self.index(node_id)

    def with_nodes(self, gangs: Sequence[Gang]) -> tuple[Gang, ...]:
        """The gangs with the nodes their built ranks run on."""
        return tuple(
            dataclasses.replace(
                g,
                ranks=tuple(
                    RankSlot(job_rank=s.job_rank, gang_rank=s.gang_rank, node=self.of_slot(s))
                    for s in g.ranks
                ),
            )
            for g in gangs
        )

    def name(self, node_id: str) -> str:
        """``<first 12 hex digits of the node id> at <address>``, as events name a node."""
        address = self._addresses.get(node_id)
        if address is None:
            known = {n.node_id: n.address for n in self.job.cluster_nodes()}
            address = self._addresses.setdefault(node_id, known.get(node_id, "?"))
        return f"{node_id[:12]} at {address}"

    def rank_names(self, ranks: Sequence[int]) -> tuple[str, ...]:
        """The names of the nodes ``ranks`` run on (``?`` for a rank not built)."""
        return tuple(self.name(self.of_rank[r]) if r in self.of_rank else "?" for r in ranks)

    def dead(self) -> list[str]:
        """The nodes of built ranks that the node table shows dead."""
        alive = {n.node_id for n in self.job.cluster_nodes() if n.alive}
        return sorted({n for n in self.of_rank.values() if n not in alive})

    def report_dead(self, node_id: str, gangs: Sequence[int], *, at: float) -> None:
        """A ``node_died`` event for ``node_id``, once per node."""
        if node_id in self._reported_dead:
            return
        self._reported_dead.add(node_id)
        self.job.record(
            NodeDied(
                at=at,
                step=self.job.step(),
                node=self.index(node_id),
                gang_ids=tuple(gangs),
                node_id=node_id,
                address=self.name(node_id).split(" at ", 1)[1],
            )
        )

    def report_late_deaths(self) -> None:
        """The nodes of ranks lost without a node death being known (the node table can lag
        behind a lost raylet) that the table now shows dead: each gets its ``node_died`` event
        with the gangs it held. Asks the node table only while such a node is unresolved."""
        suspects = self._suspects - self._reported_dead
        if not suspects:
            return
        dead = suspects - {n.node_id for n in self.job.cluster_nodes() if n.alive}
        for node_id in sorted(dead):
            self.report_dead(node_id, sorted(self._gangs.get(node_id, ())), at=self.job.now())

    def settle_deaths(self, result: IntervalOutcome, *, now: float) -> None:
        """Reconciles a failed interval's outcome with the node table: a rank that looked hung
        on a node that just went, or that died with another cause on a dead node, died with its
        node; each dead node gets its ``node_died`` event (once), and the node of a rank lost
        for another reason is watched for a late death (:meth:`report_late_deaths`)."""
        clock = self.job.clock
        # Ray says when an actor died with its node; the node table may lag behind that, and
        # a rank on a node that just went can look hung for a moment: give the table a few
        # seconds to catch up, and count such ranks as dead.
        if result.hung:
            deadline = clock.monotonic() + NODE_TABLE_GRACE_S
            while clock.monotonic() < deadline and not self.dead():
                clock.sleep(0.5)
            gone = set(self.dead())
            for r in [r for r in result.hung if self.of_rank.get(r) in gone]:
                result.hung.remove(r)
                result.dead[r] = NODE_DIED
        dead_nodes = set(self.dead()) | {
            self.of_rank[r]
            for r, cause in result.dead.items()
            if "node" in cause and r in self.of_rank
        }
        # A rank on a dead node died with it, whatever its call said first: a gang peer killed
        # because its gang lost a rank may have been there too (the whole job fits on one
        # host). It counts as lost in its own right; otherwise a shard whose every copy was on
        # that node would look alive.
        for r, cause in list(result.dead.items()):
            if cause != NODE_DIED and self.of_rank.get(r) in dead_nodes:
                result.dead[r] = NODE_DIED
        for node_id in sorted(n for n in dead_nodes if n not in result.logged):
            result.logged.add(node_id)
            gangs = sorted({self.job.gang_of(r) for r, n in self.of_rank.items() if n == node_id})
            self.report_dead(node_id, gangs, at=now)
        for r, cause in result.dead.items():
            if cause != NODE_DIED and r not in result.logged and r in self.of_rank:
                self._suspects.add(self.of_rank[r])

    def forget(self, rank: int) -> None:
        """A rank's actor was ended."""
        self.of_rank.pop(rank, None)
