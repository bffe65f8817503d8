"""Failure domains: where each gang goes, so that one domain's loss takes one gang, not two.

A failure domain is a set of nodes that can fail together: each node on its own (the default),
or the nodes sharing the value of a Ray node label the job names (``scaling.failure_domain:
label:rack`` puts every node started with ``--labels rack=r1`` in domain ``r1``). Pure code:

- :func:`choose_domain` picks, for one gang's placement bundles, the domain(s) to pin them to
  from the live nodes' free resources and how many of the job's gangs each domain holds. A
  domain holding no gang comes first (one that just lost a gang after those, one a straggler
  was evicted from last), then the least crowded one; the gang's bundles go into one domain
  when one holds them all, else into the fewest domains. When the best a joining gang can get
  is a domain another gang holds while some domain holds none (it may free up), the answer
  is to wait for a better one (:class:`Waiting`), which the coordinator bounds in time.
- :class:`DomainBook` keeps the domains each live gang holds, and which domains lost a gang or
  had a straggler evicted, for the next choice.
- :func:`selector` and :func:`selects` write and read the Ray label selectors that pin a bundle
  (``{"ray.io/node-id": "<id>"}``, ``{"rack": "r1"}``, ``{"rack": "!in(r1,r2)"}``).
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

__all__ = [
    "NODE_ID_LABEL",
    "Anywhere",
    "Choice",
    "DomainBook",
    "DomainNode",
    "FailureDomain",
    "Pinned",
    "Waiting",
    "after",
    "choose_domain",
    "domain_nodes",
    "selector",
    "selects",
]

#: The label Ray gives every node: its node id (``ray.util.placement_group.NODE_ID_LABEL_KEY``).
NODE_ID_LABEL = "ray.io/node-id"
_LABEL_KEY = re.compile(r"([a-z0-9A-Z.-]{1,253}/)?[a-z0-9A-Z]([a-z0-9A-Z._-]{0,61}[a-z0-9A-Z])?")


class NodeLike(Protocol):
    """A node as the node table shows it (:class:`raytrec.elastic.workers.NodeInfo`)."""

    @property
    def node_id(self) -> str: ...
    @property
    def alive(self) -> bool: ...
    @property
    def labels(self) -> Mapping[str, str]: ...


@dataclasses.dataclass(frozen=True)
class FailureDomain:
    """What a failure domain is: the node label whose value names it (:data:`NODE_ID_LABEL`
    for ``node``)."""

    label: str = NODE_ID_LABEL

    @classmethod
    def parse(cls, text: str) -> FailureDomain:
        """``node`` or ``label:<key>``; a ValueError that says what is allowed otherwise."""
        if text == "node":
            return cls()
        key = text.removeprefix("label:")
        if text.startswith("label:") and _LABEL_KEY.fullmatch(key) and key != NODE_ID_LABEL:
            return cls(label=key)
        raise ValueError(
            f"{text!r} is not a failure domain; allowed: 'node', or 'label:<key>' with the key "
            "of a Ray node label (as in `ray start --labels rack=r1`: 'label:rack')"
        )

    @property
    def is_node(self) -> bool:
        return self.label == NODE_ID_LABEL

    def of(self, node: NodeLike) -> str | None:
        """The domain ``node`` is in (None: it has no such label)."""
        return node.node_id if self.is_node else node.labels.get(self.label)

    def name(self, domain: str, addresses: Mapping[str, str] | None = None) -> str:
        """``node 41c840e6ab12 at 127.0.0.1`` or ``rack=r1``, as events name a domain."""
        if not self.is_node:
            return f"{self.label}={domain}"
        at = (addresses or {}).get(domain)
        return f"node {domain[:12]}" + (f" at {at}" if at else "")


@dataclasses.dataclass(frozen=True)
class DomainNode:
    """A live node that may take a bundle: its domain and its free resources now."""

    node_id: str
    domain: str
    free: Mapping[str, float]


def domain_nodes(
    domain: FailureDomain,
    nodes: Iterable[NodeLike],
    available: Mapping[str, Mapping[str, float]],
    *,
    draining: Iterable[str] = (),
) -> list[DomainNode]:
    """The live nodes, not draining, that are in a domain, with their free resources
    (``available``: node id -> free resources, as Ray's GCS reports them)."""
    skip = set(draining)
    out = []
    for n in nodes:
        d = domain.of(n)
        if n.alive and d is not None and n.node_id not in skip:
            free = dict(available.get(n.node_id, {}))
            out.append(DomainNode(node_id=n.node_id, domain=d, free=free))
    return out


@dataclasses.dataclass(frozen=True)
class Pinned:
    """Pin bundle ``b`` to domain ``domains[b]``; ``shared``: those of them that other gangs
    of the job hold already (empty: the gang has its domains to itself)."""

    domains: tuple[str, ...]
    shared: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Waiting:
    """No good domain has room now: wait, for a bounded time, for room in a domain outside
    ``outside`` (those the job's gangs hold, and those to avoid)."""

    outside: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Anywhere:
    """No domain has room now: place as Ray chooses (the placement waits for room)."""


Choice = Pinned | Waiting | Anywhere

# The order domains are tried in: free of gangs, free but a gang was lost there, held by a gang
# already (the least crowded first), a straggler was evicted from there.
_FREE, _LOST_THERE, _SHARED, _EVICTED_THERE = range(4)


def _fit(
    bundles: Sequence[Mapping[str, float]],
    nodes: Sequence[DomainNode],
    free: dict[str, dict[str, float]],
) -> list[str | None]:
    """Node ids for as many of ``bundles`` as fit on ``nodes`` (first fit, largest bundle
    first, roomiest node first), in bundle order (None where one did not fit); ``free`` is
    updated."""
    order = sorted(range(len(bundles)), key=lambda b: -sum(bundles[b].values()))
    nodes = sorted(nodes, key=lambda n: (-free[n.node_id].get("CPU", 0.0), n.node_id))
    out: list[str | None] = [None] * len(bundles)
    for b in order:
        for n in nodes:
            room = free[n.node_id]
            if all(room.get(k, 0.0) >= v for k, v in bundles[b].items()):
                for k, v in bundles[b].items():
                    room[k] = room.get(k, 0.0) - v
                out[b] = n.node_id
                break
    return out


def choose_domain(
    bundles: Sequence[Mapping[str, float]],
    nodes: Sequence[DomainNode],
    held: Mapping[str, int],
    *,
    lost: Iterable[str] = (),
    evicted: Iterable[str] = (),
    may_wait: bool = False,
) -> Choice:
    """Where one gang's ``bundles`` go (module doc). ``held``: domain -> the job's gangs in it
    (placed or being placed); ``lost``: domains that lost a gang (tried after the free ones);
    ``evicted``: domains a straggler was evicted from (tried last); ``may_wait``: a joining gang
    may wait for a better domain than a shared one (:class:`Waiting`)."""
    lost, evicted = set(lost), set(evicted)
    by_domain: dict[str, list[DomainNode]] = collections.defaultdict(list)
    for n in nodes:
        by_domain[n.domain].append(n)

    def tier(d: str) -> int:
        if d in evicted:
            return _EVICTED_THERE
        if held.get(d, 0):
            return _SHARED
        return _LOST_THERE if d in lost else _FREE

    def room(d: str) -> float:
        return sum(n.free.get("CPU", 0.0) for n in by_domain[d])

    # Ties go to the node table's order (by_domain keeps it): stable from one choice to the next.
    order = {d: i for i, d in enumerate(by_domain)}
    ranked = sorted(by_domain, key=lambda d: (tier(d), held.get(d, 0), -room(d), order[d]))
    chosen: tuple[str, ...] | None = None
    for worst in range(_EVICTED_THERE + 1):
        pool = [d for d in ranked if tier(d) <= worst]
        chosen = _into_one(bundles, pool, by_domain) or _into_fewest(bundles, pool, by_domain)
        if chosen is not None:
            break
    # A domain holding no gang may free up (another job's work ends, a gang drains): a joining
    # gang waits for that rather than share; when every domain holds a gang, nothing will, and
    # with no room at all the group is asked for as Ray chooses (what an autoscaler sees).
    wait = may_wait and any(tier(d) in (_FREE, _LOST_THERE) for d in by_domain)
    outside = tuple(sorted({d for d, n in held.items() if n} | evicted))
    if chosen is None:
        return Waiting(outside=outside) if wait else Anywhere()
    if wait and max(tier(d) for d in chosen) >= _SHARED:
        return Waiting(outside=outside)
    return Pinned(domains=chosen, shared=tuple(sorted({d for d in chosen if held.get(d, 0)})))


def _into_one(
    bundles: Sequence[Mapping[str, float]], pool: Sequence[str], by_domain: Mapping[str, list]
) -> tuple[str, ...] | None:
    """The first domain of ``pool`` that holds every bundle."""
    for d in pool:
        free = {n.node_id: dict(n.free) for n in by_domain[d]}
        placed = _fit(bundles, by_domain[d], free)
        if all(p is not None for p in placed):
            return (d,) * len(bundles)
    return None


def _into_fewest(
    bundles: Sequence[Mapping[str, float]], pool: Sequence[str], by_domain: Mapping[str, list]
) -> tuple[str, ...] | None:
    """The bundles spread over the fewest domains of ``pool`` (greedy: the domain taking the
    most of those left first), or None when they do not all fit."""
    left = list(range(len(bundles)))
    out: list[str | None] = [None] * len(bundles)
    candidates = list(pool)
    while left and candidates:

        def takes(d: str) -> int:
            free = {n.node_id: dict(n.free) for n in by_domain[d]}
            return sum(p is not None for p in _fit([bundles[b] for b in left], by_domain[d], free))

        best = max(candidates, key=lambda d: (takes(d), -pool.index(d)))
        if takes(best) == 0:
            return None
        candidates.remove(best)
        free = {n.node_id: dict(n.free) for n in by_domain[best]}
        placed = _fit([bundles[b] for b in left], by_domain[best], free)
        for b, p in zip(list(left), placed, strict=True):
            if p is not None:
                out[b] = best
                left.remove(b)
    return None if left else tuple(d for d in out if d is not None)


def after(
    nodes: Sequence[DomainNode], bundles: Sequence[Mapping[str, float]], choice: Choice
) -> list[DomainNode]:
    """``nodes`` with the resources a :class:`Pinned` choice takes off their free ones (for
    the next gang's choice in the same round)."""
    if not isinstance(choice, Pinned):
        return list(nodes)
    chosen = set(choice.domains)
    free = {n.node_id: dict(n.free) for n in nodes if n.domain in chosen}
    for d in sorted(chosen):
        mine = [b for b, bd in enumerate(choice.domains) if bd == d]
        _fit([bundles[b] for b in mine], [n for n in nodes if n.domain == d], free)
    return [dataclasses.replace(n, free=free[n.node_id]) if n.node_id in free else n for n in nodes]


def selector(domain: FailureDomain, choice: Choice, bundles: int) -> tuple[dict[str, str], ...]:
    """The per-bundle label selectors that carry out ``choice`` (none for :class:`Anywhere`)."""
    if isinstance(choice, Pinned):
        return tuple({domain.label: d} for d in choice.domains)
    if isinstance(choice, Waiting) and choice.outside:
        return ({domain.label: f"!in({','.join(choice.outside)})"},) * bundles
    return ()


def selects(label_selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    """Whether a node with ``labels`` matches a Ray label selector (``value``, ``!value``,
    ``in(a,b)``, ``!in(a,b)``; a node without the label matches only the negated forms)."""
    for key, want in label_selector.items():
        negate = want.startswith("!")
        body = want.removeprefix("!")
        values = body[3:-1].split(",") if body.startswith("in(") else [body]
        if (labels.get(key) in values) == negate:
            return False
    return True


class DomainBook:
    """The domains each live gang holds, and where gangs were lost or stragglers evicted."""

    def __init__(self, domain: FailureDomain) -> None:
        self.domain = domain
        self.held: dict[int, tuple[str, ...]] = {}  # gang id -> the domains of its bundles
        self.lost: set[str] = set()  # domains that lost a gang
        self.evicted: set[str] = set()  # domains a straggler gang was evicted from

    def counts(self, extra: Iterable[Sequence[str]] = ()) -> collections.Counter[str]:
        """Domain -> how many gangs hold it (the live ones and ``extra``, being placed)."""
        out: collections.Counter[str] = collections.Counter()
        for domains in [*self.held.values(), *extra]:
            out.update(set(domains))
        return out

    def placed(self, gang_id: int, domains: Sequence[str]) -> dict[str, tuple[int, ...]]:
        """Gang ``gang_id`` runs in ``domains``; returns each of them that other live gangs
        hold too, with those gangs."""
        self.held[gang_id] = tuple(domains)
        shared = {}
        for d in sorted(set(domains)):
            others = tuple(sorted(g for g, ds in self.held.items() if g != gang_id and d in ds))
            if others:
                shared[d] = others
        return shared

    def dropped(self, gang_id: int, *, lost: bool = False, evicted: bool = False) -> None:
        """Gang ``gang_id`` is gone; ``lost``: it failed there, ``evicted``: it was a
        straggler there (a replacement goes elsewhere where the cluster has room)."""
        domains = self.held.pop(gang_id, ())
        if lost:
            self.lost.update(domains)
        if evicted:
            self.evicted.update(domains)
