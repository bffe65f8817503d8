from __future__ import annotations

import dataclasses
import itertools
import pickle
from typing import Any

import pytest

from raytrec.cluster.topology import Layout, RankPosition, Topology, TopologyError
from raytrec.elastic.membership import Membership

WITHIN = Layout.REPLICAS_WITHIN_HOST
ACROSS = Layout.REPLICAS_ACROSS_HOSTS


def gangs_lost_with_host(topo: Topology, host: int) -> tuple[int, ...]:
    """The gangs a loss of ``host`` breaks, by the job's own rule (its membership)."""
    return Membership.initial(topo).gangs_on_nodes([host])


def shards_without_live_copy(topo: Topology, hosts: Any) -> tuple[int, ...]:
    """The shards a loss of ``hosts`` leaves without a live copy, by the job's own rule."""
    lost = [r for h in set(hosts) for r in topo.ranks_on_host(h)]
    return Membership.initial(topo).dead_shards(lost)


def check_grid(topo: Topology) -> None:
    """Invariants every valid topology must satisfy, checked against the public API."""
    t, n, g = topo.world_size, topo.gang_size, topo.num_gangs
    gangs, groups = topo.gangs, topo.replica_groups
    assert len(gangs) == g and all(len(gang) == n for gang in gangs)
    assert len(groups) == n and all(len(group) == g for group in groups)
    assert sorted(r for gang in gangs for r in gang) == list(range(t))
    assert sorted(r for group in groups for r in group) == list(range(t))
    for gi, ki in itertools.product(range(g), range(n)):
        assert gangs[gi][ki] == groups[ki][gi]
    for gi, gang in enumerate(gangs):
        for ki, rank in enumerate(gang):
            assert topo.position(rank) == RankPosition(
                rank=rank,
                gang=gi,
                gang_rank=ki,
                replica_group=ki,
                replica_rank=gi,
                host=rank // topo.ranks_per_host,
            )
    assert topo.num_hosts == -(-t // topo.ranks_per_host)
    hosts = [topo.ranks_on_host(h) for h in range(topo.num_hosts)]
    assert [r for ranks in hosts for r in ranks] == list(range(t))
    assert all(topo.host_of(r) == h for h, ranks in enumerate(hosts) for r in ranks)
    if topo.layout is WITHIN:
        assert all(len({topo.host_of(r) for r in group}) == 1 for group in groups)
    else:
        # Packed gangs: any two gangs either share all their hosts or none of them.
        host_sets = [set(topo.gang_hosts(gi)) for gi in range(g)]
        for a, b in itertools.combinations(host_sets, 2):
            assert a == b or not a & b


def test_seed_example_within_host() -> None:
    topo = Topology(world_size=8, gang_size=4, ranks_per_host=4, layout=WITHIN)
    assert topo.num_gangs == 2 and topo.num_hosts == 2
    assert topo.gangs == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert topo.replica_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert [{topo.host_of(r) for r in group} for group in topo.replica_groups] == [
        {0},
        {0},
        {1},
        {1},
    ]
    assert topo.gang_hosts(0) == (0, 1)
    assert gangs_lost_with_host(topo, 0) == (0, 1)
    assert shards_without_live_copy(topo, [0]) == (0, 1)
    assert shards_without_live_copy(topo, [1]) == (2, 3)
    assert shards_without_live_copy(topo, []) == ()
    assert topo.position(5) == RankPosition(
        rank=5, gang=1, gang_rank=2, replica_group=2, replica_rank=1, host=1
    )
    check_grid(topo)


def test_seed_example_across_hosts() -> None:
    topo = Topology(world_size=8, gang_size=4, ranks_per_host=4, layout=ACROSS)
    assert topo.gangs == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert topo.replica_groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert [topo.gang_hosts(g) for g in range(2)] == [(0,), (1,)]
    assert gangs_lost_with_host(topo, 0) == (0,)
    assert shards_without_live_copy(topo, [0]) == ()
    assert shards_without_live_copy(topo, [1, 1]) == ()
    assert shards_without_live_copy(topo, [0, 1]) == (0, 1, 2, 3)
    assert topo.position(5) == RankPosition(
        rank=5, gang=1, gang_rank=1, replica_group=1, replica_rank=1, host=1
    )
    check_grid(topo)


def test_defaults_strings_equality_and_pickle() -> None:
    topo = Topology(world_size=8, gang_size=4, ranks_per_host=4)
    assert topo.layout is ACROSS
    # Config files give plain strings; mypy rejects a str for `layout`, so bypass it here.
    as_string: dict[str, Any] = {"layout": "replicas_within_host"}
    from_str = Topology(world_size=8, gang_size=4, ranks_per_host=4, **as_string)
    assert from_str.layout is WITHIN
    assert from_str == Topology(world_size=8, gang_size=4, ranks_per_host=4, layout=WITHIN)
    _ = from_str.gangs  # populating the cache must not affect equality or hashing
    assert from_str == Topology(world_size=8, gang_size=4, ranks_per_host=4, layout=WITHIN)
    assert hash(from_str) == hash(
        Topology(world_size=8, gang_size=4, ranks_per_host=4, layout=WITHIN)
    )
    assert pickle.loads(pickle.dumps(from_str)) == from_str
    with pytest.raises(dataclasses.FrozenInstanceError):
        topo.world_size = 16  # type: ignore[misc]


@pytest.mark.parametrize("layout", list(Layout))
def test_1024_ranks(layout: Layout) -> None:
    topo = Topology(world_size=1024, gang_size=256, ranks_per_host=8, layout=layout)
    assert topo.num_gangs == 4 and topo.num_hosts == 128
    check_grid(topo)
    if layout is WITHIN:
        assert all(len({r // 8 for r in group}) == 1 for group in topo.replica_groups)
        assert shards_without_live_copy(topo, [0]) == (0, 1)
    else:
        spans = [topo.gang_hosts(g) for g in range(topo.num_gangs)]
        assert spans == [tuple(range(32 * g, 32 * (g + 1))) for g in range(4)]
        assert all(len(gangs_lost_with_host(topo, h)) == 1 for h in range(topo.num_hosts))
        assert all(
            set(topo.ranks_on_host(h)) <= set(topo.gangs[g]) for g in range(4) for h in spans[g]
        )
        # Losing one host from every gang but the last still leaves a live copy of every shard.
        assert shards_without_live_copy(topo, [0, 32, 64]) == ()
        assert shards_without_live_copy(topo, range(128)) == tuple(range(256))


@pytest.mark.parametrize("layout", list(Layout))
def test_4096_ranks(layout: Layout) -> None:
    topo = Topology(world_size=4096, gang_size=512, ranks_per_host=8, layout=layout)
    assert topo.num_gangs == 8 and topo.num_hosts == 512
    check_grid(topo)
    last = topo.position(4095)
    assert (last.gang, last.gang_rank, last.host) == (7, 511, 511)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(world_size=10, gang_size=4, ranks_per_host=8), "world_size=10 .* gang_size=4"),
        (dict(world_size=4, gang_size=8, ranks_per_host=8), "gang_size=8 > world_size=4"),
        (dict(world_size=0, gang_size=1, ranks_per_host=1), "world_size must be >= 1, got 0"),
        (dict(world_size=-8, gang_size=1, ranks_per_host=1), "world_size must be >= 1, got -8"),
        (dict(world_size=8, gang_size=0, ranks_per_host=1), "gang_size must be >= 1, got 0"),
        (dict(world_size=8, gang_size=-2, ranks_per_host=1), "gang_size must be >= 1, got -2"),
        (dict(world_size=8, gang_size=2, ranks_per_host=0), "ranks_per_host must be >= 1, got 0"),
        (dict(world_size=8, gang_size=2, ranks_per_host=-4), "ranks_per_host must be >= 1, got -4"),
        (
            dict(world_size=True, gang_size=1, ranks_per_host=1),
            "world_size must be an int, got True",
        ),
        (
            dict(world_size=8, gang_size=True, ranks_per_host=1),
            "gang_size must be an int, got True",
        ),
        (dict(world_size=8, gang_size=2, ranks_per_host=False), "ranks_per_host .* got False"),
        (dict(world_size=8.0, gang_size=2, ranks_per_host=4), "world_size must be an int, got 8.0"),
        (
            dict(world_size=8, gang_size=2, ranks_per_host=4, layout="ring"),
            "layout='ring' .*'replicas_within_host', 'replicas_across_hosts'",
        ),
        (
            dict(world_size=12, gang_size=4, ranks_per_host=4, layout="replicas_within_host"),
            r"num_gangs=3 .* ranks_per_host=4 is not a multiple of 3",
        ),
        (
            # 16 replicas per group cannot fit on an 8-rank host.
            dict(world_size=32, gang_size=2, ranks_per_host=8, layout="replicas_within_host"),
            r"num_gangs=16 .* ranks_per_host=8 is not a multiple of 16",
        ),
        (
            dict(world_size=12, gang_size=3, ranks_per_host=4),
            "replicas_across_hosts .* gang_size=3 and ranks_per_host=4",
        ),
        (
            dict(world_size=12, gang_size=6, ranks_per_host=4),
            "gang_size=6 and ranks_per_host=4",
        ),
    ],
)
def test_impossible_shapes(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(TopologyError, match=match):
        Topology(**kwargs)  # type: ignore[arg-type]


def test_single_host_is_always_placeable() -> None:
    # Neither divisibility rule holds, but one host holds every rank so nothing can straddle.
    for layout in Layout:
        topo = Topology(world_size=6, gang_size=3, ranks_per_host=8, layout=layout)
        assert topo.num_hosts == 1
        assert shards_without_live_copy(topo, [0]) == (0, 1, 2)
        check_grid(topo)


def test_partial_last_host() -> None:
    topo = Topology(world_size=12, gang_size=3, ranks_per_host=8, layout=WITHIN)
    assert topo.num_hosts == 2 and topo.ranks_on_host(1) == (8, 9, 10, 11)
    check_grid(topo)


def test_index_errors() -> None:
    topo = Topology(world_size=8, gang_size=4, ranks_per_host=4)
    with pytest.raises(TopologyError, match=r"rank=8 .* 0\.\.7"):
        topo.position(8)
    with pytest.raises(TopologyError, match=r"rank=-1 .* 0\.\.7"):
        topo.host_of(-1)
    with pytest.raises(TopologyError, match="rank must be an int, got True"):
        topo.position(True)
    with pytest.raises(TopologyError, match=r"gang=2 .* 0\.\.1"):
        topo.gang_hosts(2)
    with pytest.raises(TopologyError, match=r"host=2 .* 0\.\.1"):
        topo.ranks_on_host(2)


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("t", range(1, 33))
def test_small_shapes_raise_or_hold(t: int, layout: Layout) -> None:
    # One test per (T, layout) with the other dimensions looped inside keeps the sweep
    # (~1700 shapes) fast; the assertion messages name the failing shape.
    for n, per_host in itertools.product(range(1, t + 1), (1, 2, 3, 4, 6, 8, 16)):
        if t % n == 0:
            check_small_shape(t, n, per_host, layout)


def check_small_shape(t: int, n: int, per_host: int, layout: Layout) -> None:
    shape = f"T={t} L={n} ranks_per_host={per_host} {layout.value}"
    try:
        topo = Topology(world_size=t, gang_size=n, ranks_per_host=per_host, layout=layout)
    except TopologyError:
        # Rejected only when the layout's placement rule genuinely fails on several hosts.
        assert t > per_host, shape
        if layout is WITHIN:
            assert per_host % (t // n) != 0, shape
        else:
            assert per_host % n != 0 and n % per_host != 0, shape
        return
    check_grid(topo)
    # Fault tolerance of the across-hosts layout: with two or more gangs on several hosts,
    # losing any single host leaves a live copy of every shard.
    if layout is ACROSS and topo.num_gangs > 1 and t > per_host:
        for h in range(topo.num_hosts):
            assert shards_without_live_copy(topo, [h]) == (), (shape, h)
