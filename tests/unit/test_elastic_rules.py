"""Each membership rule of the elastic job, once, at production sizes (pure, milliseconds).

Each rule exists in one place: a loss, growth and the wait below ``min_gangs`` in
:mod:`raytrec.elastic.boundary` (asked through :func:`~raytrec.elastic.boundary.decide`), the
hang rule in :mod:`raytrec.elastic.hangs`. The tests are named after the rule they pin down.
"""

from __future__ import annotations

from test_decide import one, state

from raytrec.cluster.topology import Topology
from raytrec.elastic.boundary import JobState, Loss, Observations
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.decisions import Fail, Grow, Reform, Wait
from raytrec.elastic.hangs import find_hung_ranks
from raytrec.elastic.membership import Membership

T1024 = Topology(world_size=1024, gang_size=256, ranks_per_host=256)  # gang g on host g
T4096 = Topology(world_size=4096, gang_size=8, ranks_per_host=16)  # two gangs per host
ELASTIC = ElasticConfig(
    min_gangs=1, step_timeout_s=60, collective_timeout_s=20, resource_wait_s=300, poll_s=1
)


def job(topology: Topology, *, elastic: ElasticConfig = ELASTIC, **changes: object) -> JobState:
    membership = Membership.initial(topology)
    args = {"membership": membership, "max_gangs": membership.num_gangs, "elastic": elastic}
    return state(**{**args, **changes})


# -- a loss -----------------------------------------------------------------------------------


def test_a_loss_drops_every_gang_that_lost_a_rank_and_reforms_among_the_intact_ones() -> None:
    host = frozenset(r for r in range(4096) if T4096.host_of(r) == 100)  # gangs 200 and 201
    dead = host | {3 * 8 + 5}  # and one rank of gang 3
    d = one(job(T4096), Observations(loss=Loss(dead=dead)))
    assert isinstance(d, Reform)
    assert d.drop == (3, 200, 201) and d.generation == 1
    assert d.survivors == tuple(g for g in range(512) if g not in (3, 200, 201))
    # Every rank of a dropped gang is lost with it, not only the ones that died.
    assert d.lost_ranks == tuple(sorted({*range(24, 32), *range(1600, 1616)}))


def test_a_loss_at_1024_ranks_drops_the_gang_of_the_lost_host_only() -> None:
    dead = frozenset(r for r in range(1024) if T1024.host_of(r) == 2)
    d = one(job(T1024), Observations(loss=Loss(dead=dead)))
    assert isinstance(d, Reform)
    assert (d.drop, d.survivors, d.generation) == ((2,), (0, 1, 3), 1)
    assert d.lost_ranks == tuple(range(512, 768)) and d.hung_ranks == ()


def test_a_hung_rank_drops_its_gang_and_is_named_as_hung() -> None:
    d = one(job(T1024), Observations(loss=Loss(hung=frozenset({300}))))
    assert isinstance(d, Reform)
    assert d.drop == (1,) and d.survivors == (0, 2, 3) and d.hung_ranks == (300,)


# -- growth -----------------------------------------------------------------------------------


def test_grow_heals_every_new_gang_from_the_first_live_gang() -> None:
    # Gang 0 was dropped: the first live gang is gang 1, and every new gang heals from it.
    survivors = Membership.initial(T4096).without((0, 5))
    state = job(T4096, membership=survivors, max_gangs=512)
    built, _ = survivors.reserve([[900] * 8] * 2)
    d = one(state, Observations(built=built))
    assert isinstance(d, Grow)
    assert [n.gang.gang_id for n in d.gangs] == [512, 513]
    assert [n.heal_from for n in d.gangs] == [1, 1]
    assert d.join_step == 8 and d.generation == survivors.generation + 1


# -- the wait below min_gangs -----------------------------------------------------------------


def test_below_min_gangs_the_job_waits_up_to_and_at_the_deadline_then_fails() -> None:
    elastic = ELASTIC.replace(min_gangs=3)
    below = job(T1024, elastic=elastic, membership=Membership.initial(T1024).without((0, 3)))
    seen = Observations(waiting_since=5.0)  # deadline: 5 + resource_wait_s = 305
    before, at, after = one(below, seen, 304.9), one(below, seen, 305.0), one(below, seen, 305.001)
    assert before == at == Wait(deadline=305.0, missing_gangs=1, reason=at.reason)
    assert isinstance(after, Fail) and after.config_key == "elastic.resource_wait_s"
    assert "fewer than elastic.min_gangs=3" in after.reason
    assert "resource_wait_s=300s" in after.reason


# -- the hang rule ----------------------------------------------------------------------------


def test_a_rank_is_hung_once_silent_for_longer_than_step_timeout_s() -> None:
    m = Membership.initial(T1024)
    progress = {r: (11, 10.0) for r in range(1024)}
    progress[300] = (10, 5.0)  # its last step was seen at 5 s
    assert find_hung_ranks(m, progress, now=65.0, config=ELASTIC) == ()  # exactly 60 s
    assert find_hung_ranks(m, progress, now=65.5, config=ELASTIC) == (300,)
    assert find_hung_ranks(m, progress, now=70.5, config=ELASTIC) == tuple(range(1024))
    # A rank never seen counts as seen now.
    assert find_hung_ranks(m, {}, now=1e6, config=ELASTIC) == ()


def test_no_rank_is_hung_while_training_is_paused_below_min_gangs() -> None:
    m = Membership.initial(T1024).without((0, 3))
    paused = ELASTIC.replace(min_gangs=3)
    silent = {r: (0, 0.0) for g in m.gangs for r in g.job_ranks}
    assert find_hung_ranks(m, silent, now=1000.0, config=paused) == ()
    assert len(find_hung_ranks(m, silent, now=1000.0, config=ELASTIC)) == 512
