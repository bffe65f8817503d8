"""Gangs placed in failure domains of their own, through the coordinator's worker group.

:class:`GangDomains` is the coordinator's part that decides where each gang's placement group
may go (:func:`~raytrec.cluster.domains.choose_domain`) and pins it there with Ray label
selectors on its bundles, for the whole job at the start (and after a total loss) and for each
gang requested later (a replacement, growth). It owns the domains each live gang holds
(:class:`~raytrec.cluster.domains.DomainBook`) and the requests waiting for a domain of their
own, and says when a gang shares a domain with another (a ``domain_shared`` event).

- At the start every gang is pinned to a domain of its own where one has room; the rest share
  the least crowded domain with room, or go where Ray puts them when nothing has room yet. A
  pinned group that does not become ready by the first ``placement_waiting`` report (the free
  resources read were out of date) is placed again where Ray chooses.
- A gang requested later that could only share a domain, while some domain holds no gang,
  waits up to ``elastic.domain_wait_s`` for room outside the domains the live gangs hold (a
  label selector ``!in(...)``), then is placed in the best domain with room, or as Ray chooses.
- Where a gang landed is read back from Ray once its group is ready; the event names each
  domain it shares and the gangs it shares it with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from raytrec.cluster.domains import (
    Choice,
    DomainBook,
    DomainNode,
    FailureDomain,
    Pinned,
    Waiting,
    after,
    choose_domain,
    domain_nodes,
    selector,
)
from raytrec.elastic.events import DomainShared, Event

if TYPE_CHECKING:
    from raytrec.cluster.placement import PlacementSpec
    from raytrec.elastic.workers import Clock, Placement, WorkerGroup

__all__ = ["GangDomains"]


class GangDomains:
    """Failure-domain placement of gangs (module doc). ``enabled``: False places every group
    as asked (the job's one group under ``replicas_within_host``); ``record``: records an event;
    ``stamp``: the event time and the job's step now."""

    def __init__(
        self,
        *,
        domain: FailureDomain,
        group: WorkerGroup,
        clock: Clock,
        wait_s: float,
        record: Callable[[Event], None],
        stamp: Callable[[], tuple[float, int]],
        enabled: bool = True,
    ) -> None:
        self.domain = domain
        self.book = DomainBook(domain)
        self.group = group
        self.clock = clock
        self.wait_s = wait_s
        self.record = record
        self.stamp = stamp
        self.enabled = enabled
        self._asked: dict[Placement, tuple[PlacementSpec, Choice]] = {}  # not placed yet
        self._since: dict[Placement, float] = {}  # waiting requests: when asked

    # -- choosing -------------------------------------------------------------------------------

    def _cluster(self) -> list[DomainNode]:
        return domain_nodes(
            self.domain,
            self.group.nodes(),
            self.group.available(),
            draining=self.group.draining_nodes(),
        )

    def _choose(self, specs: Sequence[PlacementSpec], *, may_wait: bool) -> list[Choice]:
        """A choice for each spec in turn, each taking its room before the next chooses."""
        nodes = self._cluster()
        pending = [c.domains for _, c in self._asked.values() if isinstance(c, Pinned)]
        out: list[Choice] = []
        for spec in specs:
            held = self.book.counts([*pending, *(c.domains for c in out if isinstance(c, Pinned))])
            choice = choose_domain(
                spec.bundles,
                nodes,
                held,
                lost=self.book.lost,
                evicted=self.book.evicted,
                may_wait=may_wait,
            )
            nodes = after(nodes, spec.bundles, choice)
            out.append(choice)
        return out

    def _place(self, spec: PlacementSpec, choice: Choice | None, *, name: str = "") -> Placement:
        pinned = spec
        if choice is not None:
            pinned = dataclasses.replace(
                spec, selectors=selector(self.domain, choice, len(spec.bundles))
            )
        pg = self.group.place(pinned, name=name)
        if choice is not None and pinned.selectors:
            self._asked[pg] = (spec, choice)
            if isinstance(choice, Waiting):
                self._since[pg] = self.clock.monotonic()
        return pg

    # -- the whole job -------------------------------------------------------------------------

    def place_all(self, specs: Sequence[PlacementSpec], names: Sequence[str]) -> list[Placement]:
        """Places a whole job's groups, each gang in a domain of its own where one has room."""
        if not self.enabled:
            return [self.group.place(s, name=n) for s, n in zip(specs, names, strict=True)]
        choices = self._choose(specs, may_wait=False)
        return [self._place(s, c, name=n) for s, c, n in zip(specs, choices, names, strict=True)]

    def unpin(self, placements: Sequence[Placement], ready: Sequence[Placement]) -> list[Placement]:
        """``placements`` with each pinned one not ``ready`` placed again where Ray chooses
        (the room it was pinned to was taken meanwhile)."""
        out = []
        for pg in placements:
            asked = self._asked.pop(pg, None)
            self._since.pop(pg, None)
            if asked is None or pg in ready:
                out.append(pg)
                continue
            self.group.release(pg)
            out.append(self.group.place(asked[0]))
        return out

    # -- gangs requested later ------------------------------------------------------------------

    def request(self, spec: PlacementSpec, count: int) -> list[Placement]:
        """``count`` groups for gangs to join later, each in a domain no gang holds where one
        has room, else waiting for one (:meth:`relax`)."""
        if not self.enabled:
            return [self.group.place(spec) for _ in range(count)]
        choices = self._choose([spec] * count, may_wait=self.wait_s > 0)
        return [self._place(spec, c) for c in choices]

    def relax(self, pending: Sequence[Placement]) -> list[Placement]:
        """``pending`` with each request that waited ``elastic.domain_wait_s`` for a domain of
        its own placed again in the best domain with room (or as Ray chooses); forgets the
        requests given back meanwhile."""
        for pg in [p for p in self._asked if p not in pending]:
            del self._asked[pg]
            self._since.pop(pg, None)
        now = self.clock.monotonic()
        out = []
        for pg in pending:
            since = self._since.get(pg)
            if since is None or now < since + self.wait_s or self.group.ready([pg], timeout=0):
                out.append(pg)
                continue
            spec, _ = self._asked.pop(pg)
            del self._since[pg]
            self.group.release(pg)
            (choice,) = self._choose([spec], may_wait=False)
            out.append(self._place(spec, choice))
        return out

    # -- where gangs are -------------------------------------------------------------------------

    def placed(self, gang_id: int, placement: Placement) -> None:
        """Gang ``gang_id``'s group is ready: notes its domains, with a ``domain_shared`` event
        for each it shares with another live gang."""
        self._asked.pop(placement, None)
        self._since.pop(placement, None)
        if not self.enabled:
            return
        nodes = {n.node_id: n for n in self.group.nodes()}
        domains = []
        for node_id in self.group.placed_nodes(placement):
            node = nodes.get(node_id)
            d = self.domain.of(node) if node is not None else None
            if d is not None:
                domains.append(d)
        addresses = {n.node_id: n.address for n in nodes.values()}
        for d, others in self.book.placed(gang_id, domains).items():
            at, step = self.stamp()
            self.record(
                DomainShared(
                    at=at,
                    step=step,
                    gang_id=gang_id,
                    domain=self.domain.name(d, addresses),
                    with_gangs=others,
                )
            )

    def dropped(self, gang_id: int, *, lost: bool = False, evicted: bool = False) -> None:
        """Gang ``gang_id`` is gone (``lost``: it failed; ``evicted``: a straggler)."""
        self.book.dropped(gang_id, lost=lost, evicted=evicted)

    def clear(self) -> None:
        """Every gang is gone (the job is torn down)."""
        self.book.held.clear()
        self._asked.clear()
        self._since.clear()
