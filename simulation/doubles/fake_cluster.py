"""The fake worker group's cluster: nodes of ``cpus_per_node`` CPUs and placement groups on them.

A placement is ready once every bundle fits on a live node, not draining, that its node-id
selector admits (first fit, in the order requested, as Ray does), which may be never. A node
that dies takes its ranks with it. A part of
:class:`~simulation.doubles.fake_group.FakeWorkerGroup`: the group's state it works on is declared
here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from raytrec.elastic.workers import NODE_DIED, NodeInfo
from simulation.doubles import fake_faults
from simulation.doubles.fake_rank import FakeNode, FakePlacement, RankState

if TYPE_CHECKING:
    from raytrec.cluster.placement import PlacementSpec

__all__ = ["FakeCluster"]


class FakeCluster:
    """The nodes and placement groups of the fake worker group (module doc)."""

    clock: fake_faults.ManualClock
    cpus_per_node: float
    _nodes: list[FakeNode]
    _pending: list[FakePlacement]
    _arrivals: list[fake_faults.NodesJoin]
    _ranks: dict[int, RankState]

    def _advance(self, t: float) -> None:
        raise NotImplementedError

    def _kill(self, rank: RankState, cause: str, *, at: float) -> None:
        raise NotImplementedError

    def place(self, spec: PlacementSpec, *, name: str = "") -> FakePlacement:
        cpus = tuple(b.get("CPU", 0.0) for b in spec.bundles)
        placement = FakePlacement(name=name, cpus=cpus, selectors=spec.selectors)
        self._pending.append(placement)
        self._schedule()
        return placement

    def ready(self, placements: Sequence[FakePlacement], *, timeout: float) -> list[FakePlacement]:
        deadline = self.clock.now + timeout
        while True:
            self._schedule()
            done = [p for p in placements if p.nodes is not None and not p.released]
            if len(done) == len(placements):
                return done
            later = [a.at for a in self._arrivals if a.at <= deadline]
            self._advance(min(later) if later else deadline)
            if not later:
                self._schedule()
                return [p for p in placements if p.nodes is not None and not p.released]

    def release(self, placement: FakePlacement) -> None:
        if placement.released:
            return
        placement.released = True
        if placement in self._pending:
            self._pending.remove(placement)
        if placement.nodes is not None:
            for node, cpus in zip(placement.nodes, placement.cpus, strict=True):
                node.free += cpus
        self._schedule()

    def nodes(self) -> list[NodeInfo]:
        return [n.info(self.clock.now) for n in self._nodes]

    def available(self) -> dict[str, dict[str, float]]:
        now = self.clock.now
        return {n.node_id: {"CPU": n.free} for n in self._nodes if n.died_at > now}

    def placed_nodes(self, placement: FakePlacement) -> tuple[str, ...]:
        return tuple(n.node_id for n in placement.nodes or ())

    def draining_nodes(self) -> set[str]:
        now = self.clock.now
        return {n.node_id for n in self._nodes if n.draining_at <= now < n.died_at}

    def _add_nodes(self, count: int) -> None:
        start = len(self._nodes)
        for i in range(start, start + count):
            self._nodes.append(FakeNode(index=i, cpus=self.cpus_per_node, free=self.cpus_per_node))

    def _schedule(self) -> None:
        """Gives every pending placement whose bundles all fit its nodes (first fit, in the
        order requested), as Ray does; nodes that are dead or draining take no bundle."""
        now = self.clock.now
        usable = [n for n in self._nodes if n.died_at > now and n.draining_at > now]
        still: list[FakePlacement] = []
        for p in self._pending:
            taken: list[FakeNode] = []
            for b, cpus in enumerate(p.cpus):
                node = next((n for n in usable if n.free >= cpus and p.admits(b, n)), None)
                if node is None:
                    break
                node.free -= cpus
                taken.append(node)
            if len(taken) == len(p.cpus):
                p.nodes = taken
            else:
                for node, cpus in zip(taken, p.cpus, strict=False):
                    node.free += cpus
                still.append(p)
        self._pending = still

    def _node_dies(self, node: FakeNode, at: float) -> None:
        node.died_at = min(node.died_at, at)
        node.free = 0.0
        for rank in self._ranks.values():
            if rank.node is node and rank.died_at > at:
                self._kill(rank, NODE_DIED, at=at)
