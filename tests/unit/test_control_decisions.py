"""The control loop's decisions as values: drains, heals, growth, waiting, retries (pure, ms).

Each is what :class:`actors.coordinator.Coordinator` asks at a boundary; the coordinator's own
tests (tests/unit/test_control_plane.py with the fake worker group, and the cluster tests) check
that it carries them out.
"""

from __future__ import annotations

import json
import math
import pathlib

import pytest

from raytrec.cluster.topology import Topology
from raytrec.config import EvalConfig
from raytrec.elastic.boundary import JobState, Loss, Observations, PlacementSeen, decide
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.control import gangs_to_request
from raytrec.elastic.decisions import Continue, Decision, Fail, Reform, Wait
from raytrec.elastic.drain_policy import (
    REQUEST_FILE,
    DrainRequest,
    decide_drain,
    read_request,
    request_drain,
)
from raytrec.elastic.hangs import PAST_TIMEOUT_S, next_hang_check
from raytrec.elastic.heal import failed_heals, replicas_disagree
from raytrec.elastic.membership import Membership
from raytrec.errors import ConfigError
from raytrec.eval_plan import early_stop_decision, eval_due


def membership(gangs: int, gang_size: int = 2) -> Membership:
    topology = Topology(world_size=gangs * gang_size, gang_size=gang_size, ranks_per_host=2)
    return Membership.initial(topology)


# -- drains ---------------------------------------------------------------------------------


def test_a_user_request_gives_back_the_newest_gangs_and_lowers_the_cap() -> None:
    m = membership(4)
    d = decide_drain(m, DrainRequest(gangs=2), node_of_rank={}, max_gangs=4, min_gangs=1)
    assert d is not None and (d.gangs, d.max_gangs) == ((2, 3), 2)
    assert "giving back gangs [2, 3], 2 left" in d.reason


def test_a_drain_never_goes_below_min_gangs_nor_gives_back_the_last_gang() -> None:
    m = membership(3)
    d = decide_drain(m, DrainRequest(gangs=5), node_of_rank={}, max_gangs=3, min_gangs=2)
    assert d is not None and (d.gangs, d.max_gangs) == ((2,), 2)
    one = membership(1)
    d = decide_drain(one, DrainRequest(max_gangs=1), node_of_rank={}, max_gangs=1, min_gangs=1)
    assert d is None  # nothing to give back, and the cap is already 1


def test_a_lower_max_gangs_gives_back_the_gangs_beyond_it() -> None:
    m = membership(4)
    d = decide_drain(m, DrainRequest(max_gangs=3), node_of_rank={}, max_gangs=6, min_gangs=1)
    assert d is not None and (d.gangs, d.max_gangs) == ((3,), 3)
    # A cap above today's size only stops growth.
    d = decide_drain(m, DrainRequest(max_gangs=5), node_of_rank={}, max_gangs=6, min_gangs=1)
    assert d is not None and (d.gangs, d.max_gangs) == ((), 5)


def test_gangs_on_draining_nodes_go_even_below_min_gangs_but_one_stays() -> None:
    m = membership(3)  # gang g holds job ranks 2g, 2g+1
    nodes = {0: "a", 1: "a", 2: "b", 3: "b", 4: "c", 5: "c"}
    request = DrainRequest(nodes=frozenset({"c"}))
    d = decide_drain(m, request, node_of_rank=nodes, max_gangs=3, min_gangs=3)
    assert d is not None and (d.gangs, d.max_gangs) == ((2,), 3)  # the cap stays: replace it
    everywhere = DrainRequest(nodes=frozenset({"a", "b", "c"}))
    d = decide_drain(m, everywhere, node_of_rank=nodes, max_gangs=3, min_gangs=1)
    assert d is not None and d.gangs == (0, 1)


def test_drain_requests_through_the_run_directory(tmp_path: pathlib.Path) -> None:
    path = request_drain(str(tmp_path), gangs=1)
    assert path == str(tmp_path / REQUEST_FILE)
    request_drain(str(tmp_path), max_gangs=3)  # added to the one not read yet
    assert read_request(path, remove=False) == DrainRequest(gangs=1, max_gangs=3)
    assert read_request(path, remove=True) == DrainRequest(gangs=1, max_gangs=3)
    assert read_request(path, remove=True) == DrainRequest()  # taken
    with pytest.raises(ConfigError, match="gangs >= 1 or a max_gangs"):
        request_drain(str(tmp_path))
    with pytest.raises(ConfigError, match="not a run directory"):
        request_drain(str(tmp_path / "nope"), gangs=1)
    (tmp_path / REQUEST_FILE).write_text(json.dumps({"gang": 1}))
    with pytest.raises(ConfigError, match="must hold gangs and/or max_gangs"):
        read_request(path, remove=True)
    with pytest.raises(ConfigError, match="max_gangs must be an integer >= 1"):
        DrainRequest(max_gangs=0)


# -- heals ----------------------------------------------------------------------------------


def test_a_heal_is_checked_rank_by_rank_against_the_peer() -> None:
    m = membership(3)  # gangs 0, 1, 2; gang 2 (ranks 4, 5) healed from gang 0 (ranks 0, 1)
    good = {"shards": "s0", "dense": "d"}
    digests = {
        0: good,
        1: {"shards": "s1", "dense": "d"},
        4: good,
        5: {"shards": "s1", "dense": "d"},
    }
    assert failed_heals(m, peer=0, joined=[2], digests=digests) == {}
    digests[5] = {"shards": "s1", "dense": "other"}
    assert failed_heals(m, peer=0, joined=[2], digests=digests) == {2: (5,)}


def test_the_final_replica_check_names_what_differs() -> None:
    m = membership(2)  # replica group 0: ranks 0, 2; group 1: ranks 1, 3
    same = {0: {"shards": "a", "dense": "d"}, 2: {"shards": "a", "dense": "d"}}
    same |= {1: {"shards": "b", "dense": "d"}, 3: {"shards": "b", "dense": "d"}}
    assert replicas_disagree(m, same) is None
    assert replicas_disagree(m, same | {3: {"shards": "c", "dense": "d"}}) == (
        "replica group of ranks [1, 3] disagrees after the final sync"
    )
    assert replicas_disagree(m, same | {3: {"shards": "b", "dense": "x"}}) == (
        "dense parameters differ between ranks after the final step"
    )


# -- growth, waiting, retries ---------------------------------------------------------------


def test_placement_requests_fill_up_to_the_target() -> None:
    assert gangs_to_request(live=2, outstanding=1, max_gangs=4, min_gangs=1, grow=True) == 1
    assert gangs_to_request(live=1, outstanding=0, max_gangs=4, min_gangs=2, grow=False) == 1
    assert gangs_to_request(live=3, outstanding=0, max_gangs=4, min_gangs=2, grow=False) == 0
    assert gangs_to_request(live=4, outstanding=2, max_gangs=4, min_gangs=1, grow=True) == 0


def state(gangs: int = 1, *, min_gangs: int = 2, wait_s: float = 30.0, **kw: object) -> JobState:
    elastic = ElasticConfig(
        min_gangs=min_gangs,
        max_gangs=4,
        resource_wait_s=wait_s,
        step_timeout_s=30,
        collective_timeout_s=10,
    )
    args: dict[str, object] = {"step": 8, "end_step": 100, "max_gangs": 4, "sync_every": 2}
    args.update(kw)
    return JobState(membership=membership(gangs), elastic=elastic, **args)  # type: ignore[arg-type]


def test_waiting_for_resources_until_the_deadline() -> None:
    def wait(live: int, now: float) -> Decision:
        (d,) = decide(state(live), Observations(waiting_since=10.0), now)
        return d

    assert isinstance(wait(2, 100.0), Continue)
    waiting = wait(1, 40.0)
    assert isinstance(waiting, Wait) and waiting.deadline == 40.0
    failed = wait(1, 40.5)
    assert isinstance(failed, Fail) and "elastic.resource_wait_s=30s" in failed.reason
    assert failed.config_key == "elastic.resource_wait_s"


def test_a_whole_job_waits_for_its_placement_until_the_deadline() -> None:
    asked = "2 x {CPU: 2} on one node each"

    def placed(ready: bool, now: float) -> Decision:
        seen = Observations(placement=PlacementSeen(ready=ready, since=5.0, asked=asked))
        (d,) = decide(state(wait_s=6.0), seen, now)
        return d

    assert isinstance(placed(True, 50.0), Continue)
    waiting = placed(False, 10.9)
    assert isinstance(waiting, Wait) and waiting.deadline == 11.0
    failed = placed(False, 11.0)
    assert isinstance(failed, Fail)
    assert failed.reason.startswith(
        "the job's placement groups (2 x {CPU: 2} on one node each) were not ready within "
        "elastic.resource_wait_s=6s"
    )


def test_transient_failures_are_retried_up_to_a_limit() -> None:
    errors = ("rank 0: timeout", "rank 1: timeout", "more")
    seen = Observations(loss=Loss(errors=("x",)))
    # The 3rd failure in a row (2 before it) is retried: the job re-forms as it was.
    (retry,) = decide(state(2, transient=2), seen, 0.0)
    assert isinstance(retry, Reform) and retry.drop == () and retry.survivors == (0, 1)
    (why,) = decide(state(2, transient=3), Observations(loss=Loss(errors=errors)), 0.0)
    assert isinstance(why, Fail) and "4 times in a row" in why.reason and "more" not in why.reason


def test_survivors_must_stand_within_one_sync_period() -> None:
    (close,) = decide(state(3), Observations(survivor_steps=(8, 9), dropping=(1,)), 0.0)
    assert isinstance(close, Continue)
    (why,) = decide(state(3), Observations(survivor_steps=(4, 9), dropping=(1,)), 0.0)
    assert isinstance(why, Fail) and "steps 4..9" in why.reason


# -- reading the heartbeats -------------------------------------------------------------------


def test_the_heartbeats_are_read_again_just_after_a_rank_could_count_as_stalled() -> None:
    config = ElasticConfig(step_timeout_s=30, collective_timeout_s=10, poll_s=1)
    # Ranks last seen to move at 0 s and 5 s: at 10 s nobody is near the timeout, a poll.
    assert next_hang_check([0.0, 5.0], now=10.0, config=config) == 1.0
    # At 29.5 s the rank seen at 0 s passes 30 s of silence in 0.5 s: look then, not at 30.5.
    assert next_hang_check([0.0, 5.0], now=29.5, config=config) == 0.5 + PAST_TIMEOUT_S
    assert next_hang_check([], now=29.5, config=config) == 1.0


# -- early stopping ------------------------------------------------------------------------------


def test_early_stopping_after_patience_evaluations_without_improvement() -> None:
    scores = [(4, 0.70), (8, 0.75), (12, 0.749), (16, 0.751)]
    # 0.751 improves on 0.75, but not by more than 0.01: two evaluations without improvement.
    assert early_stop_decision(scores, metric="eval_auc", patience=3, min_delta=0.01) is None
    stop = early_stop_decision(scores, metric="eval_auc", patience=2, min_delta=0.01)
    assert stop is not None and (stop.best_step, stop.best) == (8, 0.75)
    assert "eval_auc did not improve on its best (0.7500, at step 8)" in stop.reason
    assert early_stop_decision(scores, metric="eval_auc", patience=2, min_delta=0.0) is None


def test_early_stopping_on_a_loss_wants_it_lower() -> None:
    rising = [(4, 0.50), (8, 0.52), (12, 0.55)]
    stop = early_stop_decision(rising, metric="eval_log_loss", patience=2, min_delta=0.0)
    assert stop is not None and stop.best_step == 4
    falling = [(4, 0.55), (8, 0.52), (12, 0.50)]
    assert early_stop_decision(falling, metric="eval_ne", patience=1, min_delta=0.0) is None


def test_a_missing_score_is_no_improvement() -> None:
    scores = [(4, 0.7), (8, None), (12, math.nan)]
    stop = early_stop_decision(scores, metric="eval_auc", patience=2, min_delta=0.0)
    assert stop is not None and stop.best_step == 4


def test_early_stopping_needs_periodic_evaluations() -> None:
    with pytest.raises(ConfigError, match=r"early_stopping_patience needs eval\.every_n_steps"):
        EvalConfig(early_stopping_patience=2)
    with pytest.raises(ConfigError, match=r"eval\.early_stopping_metric='auc': must be 'eval_auc'"):
        EvalConfig(every_n_steps=4, early_stopping_patience=2, early_stopping_metric="auc")  # type: ignore[arg-type]


def test_evaluations_fall_at_each_multiple_and_at_the_end() -> None:
    steps, last = [], 0  # the start counts as evaluated
    for step in range(25, 1001, 25):
        if eval_due(step, every=200, last_eval_step=last, end_step=1000):
            steps.append(step)
            last = step
    assert steps == [200, 400, 600, 800, 1000]
    assert eval_due(30, every=None, last_eval_step=0, end_step=30)
    assert not eval_due(30, every=None, last_eval_step=30, end_step=30)  # never twice
