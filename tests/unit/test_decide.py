"""The one decision function, :func:`raytrec.elastic.boundary.decide`, as a pure function
(milliseconds): every value of the union is reachable, and when several observations come
together the precedence of its module doc holds. What each rule decides in detail is tested
with the rule (test_elastic_rules, test_control_decisions, test_elastic_rollback,
test_checkpoint_pure); the coordinator carrying the decisions out, in test_control_plane."""

from __future__ import annotations

import dataclasses

from raytrec.checkpoint.config import CheckpointConfig
from raytrec.cluster.topology import Layout, Topology
from raytrec.elastic.boundary import (
    MAX_TRANSIENT,
    EvalState,
    JobState,
    Loss,
    Observations,
    PlacementSeen,
    decide,
)
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.decisions import (
    Checkpoint,
    Continue,
    Decision,
    Drain,
    Evaluate,
    Fail,
    Grow,
    Reform,
    RollbackPoint,
    Stop,
    TotalLoss,
    Wait,
)
from raytrec.elastic.drain_policy import DrainRequest
from raytrec.elastic.membership import Membership


def elastic(**changes: object) -> ElasticConfig:
    args: dict[str, object] = {
        "min_gangs": 2,
        "max_gangs": 6,
        "step_timeout_s": 30,
        "collective_timeout_s": 10,
        "resource_wait_s": 60,
    }
    return ElasticConfig(**{**args, **changes})  # type: ignore[arg-type]


ELASTIC = elastic()
TOPO = Topology(world_size=8, gang_size=2, ranks_per_host=2)  # gang g: ranks 2g, 2g+1
POINT = RollbackPoint(uri="/runs/a/checkpoints/checkpoint_0000000004", step=4, accounting={})


def state(**changes: object) -> JobState:
    s = JobState(
        membership=Membership.initial(TOPO),
        step=8,
        end_step=100,
        max_gangs=6,
        elastic=ELASTIC,
        sync_every=4,
    )
    return dataclasses.replace(s, **changes)  # type: ignore[arg-type]


def one(s: JobState, seen: Observations, now: float = 0.0) -> Decision:
    (d,) = decide(s, seen, now)
    return d


def built(s: JobState, n: int) -> Observations:
    gangs, _ = s.membership.reserve([[0] * TOPO.gang_size] * n)
    return Observations(built=gangs)


# -- every value is reachable ----------------------------------------------------------------


def test_nothing_observed_is_continue() -> None:
    assert decide(state(), Observations(), 0.0) == (Continue(reason="nothing to do at step 8"),)


def test_a_dead_rank_drops_its_gang() -> None:
    d = one(state(), Observations(loss=Loss(dead=frozenset({3}))))
    assert isinstance(d, Reform) and d.drop == (1,) and d.survivors == (0, 2, 3)
    assert d.generation == 1 and d.lost_ranks == (2, 3)


def test_a_gang_still_joining_goes_with_any_failure() -> None:
    d = one(state(), Observations(loss=Loss(hung=frozenset({0}), joining=(3,))))
    assert isinstance(d, Reform) and d.drop == (0, 3) and d.hung_ranks == (0,)


def test_every_gang_lost_with_a_checkpoint_is_a_total_loss_rebuilt_from_it() -> None:
    loss = Loss(dead=frozenset({0, 2, 4, 6}))
    d = one(state(point=POINT), Observations(loss=loss))
    assert isinstance(d, TotalLoss) and d.point == POINT
    assert d.lost_gangs == (0, 1, 2, 3) and d.lost_ranks == (0, 2, 4, 6)
    assert d.reason.endswith("(4 completed steps to redo)")


def test_every_gang_lost_without_a_checkpoint_fails_naming_the_setting() -> None:
    d = one(state(), Observations(loss=Loss(dead=frozenset({0, 2, 4, 6}))))
    assert isinstance(d, Fail) and d.needs_checkpoint
    assert d.config_key == "checkpoint.every_n_steps"
    off = elastic(restore_on_total_loss=False)
    d = one(state(elastic=off, point=POINT), Observations(loss=Loss(dead=frozenset({0, 2, 4, 6}))))
    assert isinstance(d, Fail) and d.config_key == "elastic.restore_on_total_loss"


def test_a_host_lost_within_host_names_the_shards_without_a_copy() -> None:
    within = Topology(
        world_size=8, gang_size=2, ranks_per_host=4, layout=Layout.REPLICAS_WITHIN_HOST
    )
    s = state(membership=Membership.initial(within), within_host=True, point=POINT)
    lost = frozenset(r for r in range(8) if within.host_of(r) == 1)
    d = one(s, Observations(loss=Loss(dead=lost)))
    assert [{within.host_of(r) for r in grp} for grp in within.replica_groups] == [{0}, {1}]
    assert isinstance(d, TotalLoss) and d.lost_shards == (1,)


def test_peers_the_coordinator_killed_are_not_counted_as_lost_shards() -> None:
    # Gangs 0 and 1 lost rank 0 and rank 3; their peers 1 and 2 were killed by the coordinator.
    s = state(membership=Membership.initial(Topology(world_size=4, gang_size=2, ranks_per_host=2)))
    loss = Loss(dead=frozenset({0, 1, 2, 3}), peers_killed=frozenset({1, 2}))
    d = one(s, Observations(loss=loss))
    assert isinstance(d, Fail) and d.reason.startswith("lost ranks [0, 3]: gangs [0, 1] failed")
    assert "lost every copy" not in d.reason  # shard 0 lives on rank 2, shard 1 on rank 1


def test_failures_with_every_rank_alive_are_retried_then_fail() -> None:
    seen = Observations(loss=Loss(errors=("rank 0: timeout",)))
    retry = one(state(transient=MAX_TRANSIENT - 1), seen)
    assert isinstance(retry, Reform) and retry.drop == () and retry.generation == 1
    fail = one(state(transient=MAX_TRANSIENT), seen)
    assert isinstance(fail, Fail) and fail.config_key == "elastic.collective_timeout_s"


def test_placement_continue_wait_fail() -> None:
    def placed(ready: bool, now: float) -> Decision:
        return one(
            state(), Observations(placement=PlacementSeen(ready=ready, since=0, asked="x")), now
        )

    assert isinstance(placed(True, 0.0), Continue)
    assert placed(False, 59.9) == Wait(deadline=60.0, reason="waiting for placement groups (x)")
    fail = placed(False, 60.0)
    assert isinstance(fail, Fail) and fail.config_key == "elastic.resource_wait_s"


def test_stops_name_their_cause() -> None:
    assert one(state(), Observations(data_stop="rank 3: the data ran out")) == Stop(
        cause="data", reason="rank 3: the data ran out"
    )
    assert one(state(), Observations(stop_requested=True)) == Stop(
        cause="request", reason="stopped on request at step 8"
    )
    # Asked while a whole job's placement waits (a total-loss rebuild): no need to wait on;
    # once placed, the stop comes at the next boundary like any other.
    waiting = PlacementSeen(ready=False, since=0, asked="2 x {CPU: 2}")
    assert one(state(), Observations(placement=waiting, stop_requested=True)) == Stop(
        cause="request", reason="stopped on request while it waited for 2 x {CPU: 2}"
    )
    placed = dataclasses.replace(waiting, ready=True)
    assert isinstance(one(state(), Observations(placement=placed, stop_requested=True)), Continue)


def test_a_drain_and_a_grow() -> None:
    d = one(state(), Observations(drain=DrainRequest(gangs=1)))
    assert d == Drain(gangs=(3,), max_gangs=3, reason=d.reason)
    s = state()
    g = one(s, built(s, 2))
    assert isinstance(g, Grow) and [n.gang.gang_id for n in g.gangs] == [4, 5]
    assert {n.heal_from for n in g.gangs} == {0} and g.join_step == 8 and g.generation == 1


def test_evaluate_early_stop_and_checkpoint() -> None:
    ev = EvalState(every=4, batches=3, last_step=4, metric="eval_auc", patience=1)
    assert one(state(evaluation=ev), Observations(evaluate=True)) == Evaluate(step=8)
    assert isinstance(one(state(), Observations(evaluate=True)), Continue)  # none configured
    worse = dataclasses.replace(ev, last_step=8, scores=((4, 0.7), (8, 0.6)))
    stop = one(state(evaluation=worse), Observations(evaluated=True))
    assert isinstance(stop, Stop) and stop.cause == "early_stop" and stop.best_step == 4
    assert stop.best == 0.7 and stop.metric == "eval_auc"
    ckpt = CheckpointConfig(every_n_steps=4)
    assert isinstance(one(state(checkpoint=ckpt), Observations(save=True)), Checkpoint)
    saved = state(checkpoint=ckpt, last_save=(8, 0.0))
    assert isinstance(one(saved, Observations(save=True)), Continue)  # never twice at a step


# -- precedence ------------------------------------------------------------------------------


def test_a_loss_at_a_boundary_comes_alone() -> None:
    s = state(checkpoint=CheckpointConfig(every_n_steps=4))
    seen = dataclasses.replace(
        built(s, 1),
        loss=Loss(dead=frozenset({0})),
        drain=DrainRequest(gangs=1),
        stop_requested=True,
        save=True,
    )
    (d,) = decide(s, seen, 0.0)
    assert isinstance(d, Reform) and d.drop == (0,)


def test_a_data_stop_comes_before_a_requested_one_and_before_a_drain() -> None:
    seen = Observations(data_stop="bad row", stop_requested=True, drain=DrainRequest(gangs=1))
    assert decide(state(), seen, 0.0) == (Stop(cause="data", reason="bad row"),)
    seen = Observations(stop_requested=True, drain=DrainRequest(gangs=1))
    assert [type(d) for d in decide(state(), seen, 0.0)] == [Stop]


def test_a_drain_then_a_grow_then_the_wait_they_leave() -> None:
    s = state(elastic=elastic(min_gangs=4))
    seen = dataclasses.replace(
        built(s, 1), drain=DrainRequest(nodes=frozenset({"a"})), waiting_since=0.0
    )
    seen = dataclasses.replace(seen, node_of_rank={0: "a", 1: "a", 2: "a", 3: "a"})
    out = decide(s, seen, 10.0)
    assert [type(d) for d in out] == [Drain, Grow, Wait]
    drain, _, wait = out
    assert isinstance(drain, Drain) and drain.gangs == (0, 1)
    # 4 gangs, 2 drained and 1 joined: 3, one short of min_gangs.
    assert isinstance(wait, Wait) and wait.missing_gangs == 1 and wait.deadline == 60.0


def test_at_the_deadline_a_fail_comes_alone() -> None:
    s = state(elastic=elastic(min_gangs=6))
    out = decide(s, dataclasses.replace(built(s, 1), waiting_since=0.0), 61.0)
    assert [type(d) for d in out] == [Fail]


def test_an_early_stop_leaves_no_checkpoint_but_an_evaluation_comes_before_one() -> None:
    ckpt = CheckpointConfig(every_n_steps=4)
    ev = EvalState(every=4, batches=3, last_step=4, patience=1, scores=((4, 0.7), (8, 0.6)))
    seen = Observations(evaluated=True, save=True)
    assert [type(d) for d in decide(state(evaluation=ev, checkpoint=ckpt), seen, 0.0)] == [Stop]
    seen = Observations(evaluate=True, save=True)
    out = decide(state(evaluation=dataclasses.replace(ev, scores=()), checkpoint=ckpt), seen, 0.0)
    assert [type(d) for d in out] == [Evaluate, Checkpoint]
