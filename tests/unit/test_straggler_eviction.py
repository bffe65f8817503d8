"""The persistent-straggler eviction rule (:mod:`raytrec.elastic.straggler_policy`), asked
through :func:`~raytrec.elastic.boundary.decide` at production sizes (pure, milliseconds)."""

from __future__ import annotations

import dataclasses

import pytest
from test_decide import state
from test_elastic_rules import ELASTIC as RULES_ELASTIC

from raytrec.cluster.topology import Topology
from raytrec.config.base import ConfigError
from raytrec.elastic.boundary import JobState, Observations, decide
from raytrec.elastic.config import ElasticConfig, StragglerEviction
from raytrec.elastic.decisions import Continue, Drain
from raytrec.elastic.drain_policy import DrainRequest
from raytrec.elastic.membership import Membership
from raytrec.elastic.report import RankReport
from raytrec.elastic.straggler_policy import StragglerWatch, gang_step_seconds

T4096 = Topology(world_size=4096, gang_size=8, ranks_per_host=16)  # 512 gangs of 8 ranks
T1024 = Topology(world_size=1024, gang_size=256, ranks_per_host=256)  # 4 gangs of 256
EVICT = StragglerEviction(factor=1.5, intervals=3)
ELASTIC = RULES_ELASTIC.replace(straggler_eviction=EVICT)


def job(topology: Topology = T4096, **elastic: object) -> JobState:
    m = Membership.initial(topology)
    return state(membership=m, max_gangs=m.num_gangs, elastic=ELASTIC.replace(**elastic))


def times(n: int, slow: dict[int, float], base: float = 0.1) -> dict[int, float]:
    """Step times of gangs 0..n-1, each a little different; ``slow``: gang -> its time."""
    return {g: slow.get(g, base * (1 + (g % 7) / 100)) for g in range(n)}


def watched(intervals: list[dict[int, float]], factor: float = 1.5) -> StragglerWatch:
    w = StragglerWatch()
    for step_s in intervals:
        w = w.observe(step_s, factor)
    return w


def decided(s: JobState, w: StragglerWatch) -> Drain | Continue:
    (d,) = decide(s, Observations(stragglers=w), 0.0)
    assert isinstance(d, Drain | Continue)
    return d


def test_straggler_eviction_a_gang_slow_for_the_configured_intervals_is_drained_and_replaced() -> (
    None
):
    w = watched([times(512, {137: 0.2})] * 3)
    d = decided(job(), w)
    assert isinstance(d, Drain) and d.gangs == (137,)
    assert d.max_gangs == 512  # the cap stays: the growth path asks for a replacement
    assert d.straggler is not None
    assert (d.straggler.gang, d.straggler.intervals, d.straggler.step_s) == (137, 3, 0.2)
    assert d.straggler.others_s == pytest.approx(0.103)  # the median of the 511 others
    assert "gang 137 is a persistent straggler" in d.reason and "3 intervals in a row" in d.reason


def test_straggler_eviction_a_gang_slow_for_fewer_intervals_is_left_alone() -> None:
    fast = times(512, {})
    for history in (
        [times(512, {137: 0.2})] * 2,  # slow twice
        [times(512, {137: 0.2})] * 2 + [fast] + [times(512, {137: 0.2})] * 2,  # not in a row
        [times(512, {137: 0.9})],  # very slow, once
    ):
        assert isinstance(decided(job(), watched(history)), Continue)


def test_straggler_eviction_needs_the_factor_over_the_others_median() -> None:
    # 1.4x the median is not slow at factor 1.5; 1.6x is.
    assert not watched([times(512, {5: 0.14}, base=0.1)]).slow
    assert [s.gang for s in watched([{g: 0.1 for g in range(512)} | {5: 0.16}]).slow] == [5]
    # A quarter of the job slow does not move the median: each of them is slow.
    half_slow = {g: (0.3 if g < 128 else 0.1) for g in range(512)}
    assert len(watched([half_slow]).slow) == 128


def test_straggler_eviction_one_gang_at_a_time_the_longest_run_first() -> None:
    w = watched([times(512, {9: 0.2})] + [times(512, {9: 0.2, 300: 0.5})] * 3)
    d = decided(job(), w)
    assert isinstance(d, Drain) and d.gangs == (9,)  # 4 intervals against 300's 3
    w = watched([times(512, {9: 0.2, 300: 0.5})] * 3)
    d = decided(job(), w)
    assert isinstance(d, Drain) and d.gangs == (300,)  # a tie: the slowest against its peers


def test_straggler_eviction_never_below_min_gangs() -> None:
    w = watched([times(4, {2: 1.0})] * 3)
    assert isinstance(decided(job(T1024, min_gangs=4), w), Continue)
    d = decided(job(T1024, min_gangs=3), w)
    assert isinstance(d, Drain) and d.gangs == (2,)
    two = dataclasses.replace(job(T1024), membership=job(T1024).membership.without([2, 3]))
    w2 = watched([{0: 0.1, 1: 1.0}] * 3)
    assert isinstance(decided(two, w2), Drain)  # 2 gangs: the other one is the median
    one_left = dataclasses.replace(two, membership=two.membership.without([0]))
    assert isinstance(decided(one_left, w2), Continue)  # never the last gang


def test_straggler_eviction_is_off_by_default_and_gives_way_to_a_requested_drain() -> None:
    w = watched([times(512, {137: 0.2})] * 3)
    assert ElasticConfig().straggler_eviction is None
    assert isinstance(decided(job(straggler_eviction=None), w), Continue)
    # A user's drain at the same boundary goes first; the straggler waits for the next one.
    (d,) = decide(job(), Observations(stragglers=w, drain=DrainRequest(gangs=1)), 0.0)
    assert isinstance(d, Drain) and d.gangs == (511,) and d.straggler is None


def test_straggler_eviction_forgets_gangs_that_left_or_did_not_report() -> None:
    w = watched([times(512, {137: 0.2})] * 2)
    gone = {g: t for g, t in times(512, {}).items() if g != 137}
    assert watched([gone], 1.5).slow == ()
    assert w.observe(gone, 1.5).slow == ()  # its run ended
    s = job()
    left = dataclasses.replace(s, membership=s.membership.without([137]))
    assert isinstance(decided(left, watched([times(512, {137: 0.2})] * 3)), Continue)
    assert StragglerWatch().observe({0: 1.0}, 1.5).slow == ()  # one gang: nothing to compare


def test_gang_step_seconds_is_the_slowest_ranks_own_time_per_step() -> None:
    m = Membership.initial(Topology(world_size=6, gang_size=2, ranks_per_host=2))
    trained = tuple((s, s) for s in range(1, 5))  # 4 steps
    reports = [
        # Gang 0: one rank waited 0.8 s for the straggler in syncs, 0.2 s for data.
        RankReport(rank=0, step=4, trained=trained, seconds=1.4, sync_s=0.8, data_wait_s=0.2),
        RankReport(rank=1, step=4, trained=trained, seconds=1.4, sync_s=1.0),
        RankReport(rank=2, step=4, trained=trained, seconds=1.4, sync_s=0.0),  # the straggler
        RankReport(rank=3, step=4, trained=trained, seconds=1.4, sync_s=1.0),
        RankReport(rank=4, step=4, skipped=True),  # gang 2 trained nothing: not measured
    ]
    got = gang_step_seconds(reports, m.gang_of_rank)
    assert got == pytest.approx({0: 0.1, 1: 0.35})


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"factor": 1.0}, r"straggler_eviction.factor=1.0: must be greater than 1"),
        ({"intervals": 0}, r"straggler_eviction.intervals=0: must be greater than 0"),
        ({"factr": 2.0}, r"straggler_eviction.factr"),
    ],
)
def test_straggler_eviction_settings_are_checked_naming_the_field(raw: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ElasticConfig(straggler_eviction=raw)  # type: ignore[arg-type]
