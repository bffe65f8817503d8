"""Where gangs go (raytrec.cluster.domains): one gang per failure domain while the cluster has
room, the lost and the evicted domains avoided by replacements, a bounded wait for a joining
gang that could only share, and the label selectors that carry a choice out. Pure code, and
the placement part of the coordinator over the fake worker group (no Ray)."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from raytrec.cluster.domain_placement import GangDomains
from raytrec.cluster.domains import (
    NODE_ID_LABEL,
    Anywhere,
    DomainBook,
    DomainNode,
    FailureDomain,
    Pinned,
    Waiting,
    after,
    choose_domain,
    domain_nodes,
    selector,
    selects,
)
from raytrec.cluster.placement import PlacementSpec
from raytrec.config import ScalingConfig
from raytrec.elastic.events import DomainShared, Event
from raytrec.elastic.workers import NodeInfo
from raytrec.errors import ConfigError
from simulation.doubles.fake_group import FakeWorkerGroup

ONE = ({"CPU": 1.0},)  # a gang of one rank: one bundle


def node(node_id: str, domain: str, cpus: float) -> DomainNode:
    return DomainNode(node_id=node_id, domain=domain, free={"CPU": cpus})


def place_gangs(
    nodes: list[DomainNode], gangs: int, bundles: tuple[Mapping[str, float], ...] = ONE
) -> list[tuple[str, ...]]:
    """The domains of ``gangs`` gangs chosen one after the other, each taking its room."""
    out: list[tuple[str, ...]] = []
    for _ in range(gangs):
        held: dict[str, int] = {}
        for domains in out:
            for d in set(domains):
                held[d] = held.get(d, 0) + 1
        choice = choose_domain(bundles, nodes, held)
        assert isinstance(choice, Pinned), choice
        nodes = after(nodes, bundles, choice)
        out.append(choice.domains)
    return out


def test_gangs_go_to_different_nodes_beside_a_large_node_with_room_for_all() -> None:
    # Ray's own scheduler puts both gangs on the large node (tests/cluster/test_domains_cluster.py
    # shows it); one gang per node keeps a copy of every shard through one node's loss.
    nodes = [node("big", "big", 4), node("s1", "s1", 1), node("s2", "s2", 1)]
    assert place_gangs(nodes, 2) == [("big",), ("s1",)]
    assert place_gangs(nodes, 3) == [("big",), ("s1",), ("s2",)]


def test_gangs_go_to_different_racks_when_one_rack_has_all_the_room() -> None:
    nodes = [node("a1", "r1", 4), node("a2", "r1", 4), node("b1", "r2", 1)]
    assert place_gangs(nodes, 2) == [("r1",), ("r2",)]


def test_more_gangs_than_domains_share_the_least_crowded_domain_with_room() -> None:
    nodes = [node("a", "a", 4), node("b", "b", 4)]
    assert place_gangs(nodes, 4) == [("a",), ("b",), ("a",), ("b",)]
    choice = choose_domain(ONE, nodes, {"a": 2, "b": 1})
    assert choice == Pinned(domains=("b",), shared=("b",))


def test_a_domain_without_room_is_not_chosen_and_nothing_with_room_places_anywhere() -> None:
    nodes = [node("a", "a", 0.5), node("b", "b", 0)]
    assert choose_domain(ONE, nodes, {}) == Anywhere()
    assert choose_domain(ONE, nodes, {"a": 1}, may_wait=True) == Waiting(outside=("a",))
    # Every domain holds a gang and none has room: asked for as Ray chooses (an autoscaler sees
    # the plain demand), not held back.
    assert choose_domain(ONE, nodes, {"a": 1, "b": 1}, may_wait=True) == Anywhere()


def test_a_replacement_avoids_the_domain_that_lost_a_gang_where_another_is_free() -> None:
    # Rack r1 lost a node and its gang; r2 runs the survivor; r3 is free.
    nodes = [node("a2", "r1", 2), node("b1", "r2", 1), node("c1", "r3", 1)]
    held = {"r2": 1}
    assert choose_domain(ONE, nodes, held, lost={"r1"}).domains == ("r3",)  # type: ignore[union-attr]
    # No other free rack: the one that lost a gang beats sharing the survivor's.
    nodes = nodes[:2]
    assert choose_domain(ONE, nodes, held, lost={"r1"}) == Pinned(domains=("r1",))


def test_a_straggler_replacement_avoids_the_evicted_domain_where_there_is_room_elsewhere() -> None:
    nodes = [node("n0", "n0", 1), node("n1", "n1", 1), node("n2", "n2", 1)]
    held = {"n0": 1}
    # n1 is free but a straggler was evicted from it: n2 is taken.
    assert choose_domain(ONE, nodes, held, evicted={"n1"}) == Pinned(domains=("n2",))
    # Only a shared domain besides: shared rather than the slow node.
    nodes = [node("n0", "n0", 2), node("n1", "n1", 1)]
    assert choose_domain(ONE, nodes, held, evicted={"n1"}) == Pinned(("n0",), shared=("n0",))
    # No room elsewhere: back on it.
    nodes = [node("n0", "n0", 0), node("n1", "n1", 1)]
    assert choose_domain(ONE, nodes, held, evicted={"n1"}) == Pinned(domains=("n1",))


def test_a_joining_gang_waits_for_a_domain_of_its_own_while_one_may_free_up() -> None:
    # n1 holds no gang but has no room now (another job's work): it may free up.
    nodes = [node("n0", "n0", 3), node("n1", "n1", 0)]
    assert choose_domain(ONE, nodes, {"n0": 1}, may_wait=True) == Waiting(outside=("n0",))
    # Every domain holds a gang: nothing will free up, so it shares at once.
    nodes = [node("n0", "n0", 3), node("n1", "n1", 0)]
    choice = choose_domain(ONE, nodes, {"n0": 1, "n1": 1}, may_wait=True)
    assert choice == Pinned(domains=("n0",), shared=("n0",))
    # Waiting also avoids the evicted domains.
    choice = choose_domain(ONE, nodes, {"n0": 1}, evicted={"n1"}, may_wait=True)
    assert choice == Pinned(domains=("n0",), shared=("n0",))


def test_a_gang_larger_than_a_node_spreads_over_the_fewest_free_nodes() -> None:
    bundles = ({"CPU": 2.0},) * 3  # a gang on three hosts of two ranks
    nodes = [node(f"n{i}", f"n{i}", c) for i, c in enumerate([2, 4, 2, 2])]
    choice = choose_domain(bundles, nodes, {})
    assert choice == Pinned(domains=("n1", "n1", "n0"))
    # With n1 held by another gang, three free nodes are taken rather than sharing it.
    choice = choose_domain(bundles, nodes, {"n1": 1})
    assert choice == Pinned(domains=("n0", "n2", "n3"))
    # In a rack that holds it all, it stays in that rack.
    racks = [node("a", "r1", 2), node("b", "r1", 4), node("c", "r2", 2)]
    assert choose_domain(bundles, racks, {}) == Pinned(domains=("r1",) * 3)


def test_selectors_pin_exclude_and_match_as_ray_reads_them() -> None:
    rack = FailureDomain.parse("label:rack")
    assert selector(rack, Pinned(domains=("r1", "r2")), 2) == ({"rack": "r1"}, {"rack": "r2"})
    assert selector(rack, Waiting(outside=("r1", "r2")), 2) == ({"rack": "!in(r1,r2)"},) * 2
    assert selector(rack, Anywhere(), 2) == ()
    assert selects({"rack": "r1"}, {"rack": "r1"}) and not selects({"rack": "r1"}, {})
    assert selects({"rack": "!in(r1,r2)"}, {"rack": "r3"})
    assert not selects({"rack": "!in(r1,r2)"}, {"rack": "r2"})
    assert selects({"rack": "!in(r1,r2)"}, {})  # a node without the label is outside
    assert selects({"rack": "in(r1,r2)"}, {"rack": "r2"}) and selects({"rack": "!r1"}, {})
    assert FailureDomain.parse("node").label == NODE_ID_LABEL
    assert FailureDomain.parse("node").name(
        "0123456789abcdef", {"0123456789abcdef": "10.0.0.1"}
    ) == ("node 0123456789ab at 10.0.0.1")
    assert rack.name("r1") == "rack=r1"


@pytest.mark.parametrize("bad", ["rack", "label:", "label:ray.io/node-id", "label:a b", ""])
def test_a_bad_failure_domain_is_refused_naming_the_key(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"scaling\.failure_domain.*allowed: 'node'"):
        ScalingConfig(failure_domain=bad)


def test_domain_nodes_reads_labels_and_leaves_out_dead_draining_and_unlabelled_nodes() -> None:
    nodes = [
        NodeInfo(node_id="a", address="x", alive=True, labels={"rack": "r1"}),
        NodeInfo(node_id="b", address="x", alive=False, labels={"rack": "r1"}),
        NodeInfo(node_id="c", address="x", alive=True, labels={}),
        NodeInfo(node_id="d", address="x", alive=True, labels={"rack": "r2"}),
    ]
    got = domain_nodes(
        FailureDomain("rack"), nodes, {"a": {"CPU": 2.0}, "d": {"CPU": 1.0}}, draining={"d"}
    )
    assert got == [DomainNode(node_id="a", domain="r1", free={"CPU": 2.0})]


def test_the_book_says_which_gangs_share_a_domain_and_remembers_losses() -> None:
    book = DomainBook(FailureDomain())
    assert book.placed(0, ["n0"]) == {}
    assert book.placed(1, ["n0", "n1"]) == {"n0": (0,)}
    assert book.counts([("n2",)]) == {"n0": 2, "n1": 1, "n2": 1}
    book.dropped(0, lost=True)
    book.dropped(1, evicted=True)
    assert book.lost == {"n0"} and book.evicted == {"n0", "n1"} and not book.held


# -- the coordinator's part, over the fake worker group --------------------------------------


def domains_over(group: FakeWorkerGroup, events: list[Event], *, wait_s: float) -> GangDomains:
    return GangDomains(
        domain=FailureDomain(),
        group=group,
        clock=group.clock,
        wait_s=wait_s,
        record=events.append,
        stamp=lambda: (group.clock.now, 0),
    )


def gang_spec(cpus: float = 1.0) -> PlacementSpec:
    return PlacementSpec(
        name="gang", bundles=({"CPU": cpus},), strategy="STRICT_PACK", ranks=((0,),)
    )


def test_a_shared_node_is_reported_with_the_gangs_on_it() -> None:
    group = FakeWorkerGroup(nodes=2, cpus_per_node=2)
    events: list[Event] = []
    domains = domains_over(group, events, wait_s=0)
    pgs = domains.place_all([gang_spec()] * 3, ["g0", "g1", "g2"])
    assert len(group.ready(pgs, timeout=0)) == 3
    for g, pg in enumerate(pgs):
        domains.placed(g, pg)
    assert [group.placed_nodes(pg) for pg in pgs] == [
        ("fake-node-0",),
        ("fake-node-1",),
        ("fake-node-0",),
    ]
    assert events == [
        DomainShared(
            at=0.0, step=0, gang_id=2, domain="node fake-node-0 at 127.0.0.1", with_gangs=(0,)
        )
    ]


def test_a_joining_gang_waits_for_a_free_node_then_shares_once_the_wait_is_over() -> None:
    group = FakeWorkerGroup(nodes=2, cpus_per_node=2)
    events: list[Event] = []
    domains = domains_over(group, events, wait_s=30)
    (live,) = domains.place_all([gang_spec()], ["g0"])
    other = group.place(gang_spec(2.0))  # another job's work fills node 1 for now
    assert group.ready([live, other], timeout=0) == [live, other]
    domains.placed(0, live)
    pending = domains.request(gang_spec(), 1)
    group.clock.advance_to(10)
    pending = domains.relax(pending)
    assert not group.ready(pending, timeout=0)  # node 0 has room, but gang 0 holds it
    group.clock.advance_to(30)
    pending = domains.relax(pending)  # waited long enough: shares node 0
    (pg,) = group.ready(pending, timeout=0)
    domains.placed(1, pg)
    assert group.placed_nodes(pg) == ("fake-node-0",)
    assert [(e.gang_id, e.with_gangs) for e in events if isinstance(e, DomainShared)] == [(1, (0,))]
    # Had node 1 freed up within the wait, the gang would have gone there.
    group.release(pg)
    domains.dropped(1)
    pending = domains.request(gang_spec(), 1)
    group.release(other)
    (pg,) = group.ready(domains.relax(pending), timeout=0)
    assert group.placed_nodes(pg) == ("fake-node-1",)
