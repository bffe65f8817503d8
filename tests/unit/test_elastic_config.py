"""ElasticConfig and the fault plan: validation names field, value and what is allowed; the
plan answers which faults fire at which step for which rank."""

from __future__ import annotations

import json

import pytest

from raytrec.config import ConfigError
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.faults import FaultConfig, FaultKind, FaultSpec


def test_elastic_defaults_and_max_resolution() -> None:
    cfg = ElasticConfig()
    assert cfg.min_gangs == 1 and cfg.max_gangs is None and cfg.grow
    assert cfg.resolved_max_gangs(4) == 4
    assert ElasticConfig(min_gangs=2, max_gangs=6).resolved_max_gangs(4) == 6


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"min_gangs": 0}, r"elastic.min_gangs=0: must be greater than 0"),
        ({"min_gangs": True}, r"elastic.min_gangs=true: must be a valid integer"),
        (
            {"min_gangs": 3, "max_gangs": 2},
            r"elastic.max_gangs=2 is below elastic.min_gangs=3; allowed: None or an integer >= 3",
        ),
        ({"step_timeout_s": 0}, r"elastic.step_timeout_s=0: must be greater than 0"),
        ({"resource_wait_s": -1.0}, r"elastic.resource_wait_s=-1.0: must be greater than 0"),
        (
            {"step_timeout_s": 60, "collective_timeout_s": 60},
            r"elastic.collective_timeout_s=60 must be below elastic.step_timeout_s=60",
        ),
        (
            {"step_timeout_s": 30, "collective_timeout_s": 10, "poll_s": 30},
            r"elastic.poll_s=30 must be below elastic.step_timeout_s=30",
        ),
        ({"grow": "yes"}, r"elastic.grow='yes': must be a valid boolean"),
    ],
)
def test_elastic_config_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ElasticConfig(**kwargs)


def test_resolved_max_checks_the_initial_size() -> None:
    with pytest.raises(ConfigError, match=r"starts with 2 gangs, fewer than elastic.min_gangs=3"):
        ElasticConfig(min_gangs=3).resolved_max_gangs(2)
    with pytest.raises(ConfigError, match=r"elastic.max_gangs=3 is below the initial 4 gangs"):
        ElasticConfig(max_gangs=3).resolved_max_gangs(4)


PLAN = (
    "kill_rank@5:rank=3; kill_process@8:node=1, hang_rank@8:gang=2, "
    "slow_rank@10:node=0:stall_s=2.5:steps=3"
)


def test_parse_builds_the_same_plan_as_dicts_and_the_api() -> None:
    parsed = FaultConfig.parse(PLAN)
    dicts = [
        {"kind": "kill_rank", "step": 5, "rank": 3},
        {"kind": "kill_process", "step": 8, "node": 1, "steps": 1, "seed": 0},
        {"kind": "hang_rank", "step": 8, "gang": 2},
        {"kind": "slow_rank", "step": 10, "node": 0, "stall_s": 2.5, "steps": 3},
    ]
    api = FaultConfig(
        faults=(
            FaultSpec(kind=FaultKind.KILL_RANK, step=5, rank=3),
            FaultSpec(kind=FaultKind.KILL_PROCESS, step=8, node=1),
            FaultSpec(kind=FaultKind.HANG_RANK, step=8, gang=2),
            FaultSpec(kind=FaultKind.SLOW_RANK, step=10, node=0, stall_s=2.5, steps=3),
        )
    )
    assert parsed == FaultConfig.from_dicts(dicts) == api
    assert parsed.to_dicts() == dicts
    assert json.loads(json.dumps(parsed.to_dicts())) == dicts
    assert FaultConfig.from_dicts(parsed.to_dicts()) == parsed


def test_which_faults_fire_when_and_where() -> None:
    plan = FaultConfig.parse(PLAN)
    assert [f.kind for f in plan.at_step(8)] == ["kill_process", "hang_rank"]
    assert plan.at_step(7) == ()
    # kill_rank@5 hits job rank 3 only, whatever its gang and node.
    assert [f.kind for f in plan.for_rank(5, rank=3, gang=1, node=1)] == ["kill_rank"]
    assert plan.for_rank(5, rank=4, gang=1, node=1) == ()
    # hang_rank@8 on gang 2 hits every rank of gang 2; kill_process@8 every rank on node 1.
    assert [f.kind for f in plan.for_rank(8, rank=9, gang=2, node=4)] == ["hang_rank"]
    assert [f.kind for f in plan.for_rank(8, rank=2, gang=1, node=1)] == ["kill_process"]
    assert plan.for_rank(8, rank=2, gang=1, node=0) == ()
    # slow_rank@10 for 3 steps on node 0: steps 10, 11, 12 and no other.
    slow = [s for s in range(20) if plan.for_rank(s, rank=0, gang=0, node=0)]
    assert slow == [10, 11, 12]


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (
            {"kind": "explode", "step": 1, "rank": 0},
            r"faults\[1\].kind='explode': must be "
            r"'kill_rank', 'kill_process', 'hang_rank', 'slow_rank'",
        ),
        (
            {"kind": "kill_rank", "step": 1},
            r"faults\[1\]: kill_rank needs exactly one target of rank, gang, "
            r"node; got none",
        ),
        (
            {"kind": "kill_rank", "step": 1, "rank": 0, "gang": 1},
            r"faults\[1\]: kill_rank needs exactly one target .*got rank=0, gang=1",
        ),
        (
            {"kind": "remove_node", "step": 1, "node": 2},
            r"faults\[1\]: remove_node is not carried out on Ray: a rank cannot take its node "
            r"out of the cluster\. To lose every rank of a node, use kill_rank or kill_process "
            r"with node=N",
        ),
        (
            {"kind": "kill_rank", "step": -1, "rank": 0},
            r"faults\[1\].step=-1: must be greater than or equal to 0",
        ),
        (
            {"kind": "hang_rank", "step": 1, "gang": -2},
            r"faults\[1\].gang=-2: must be greater than or equal to 0",
        ),
        (
            {"kind": "slow_rank", "step": 1, "rank": 0},
            r"faults\[1\]: slow_rank needs stall_s, a positive number of seconds",
        ),
        (
            {"kind": "slow_rank", "step": 1, "rank": 0, "stall_s": 1.0, "steps": 0},
            r"faults\[1\].steps=0: must be greater than 0",
        ),
        (
            {"kind": "kill_rank", "step": 1, "rank": 0, "stall_s": 1.0},
            r"faults\[1\]: kill_rank.stall_s=1.0 is only allowed for slow_rank",
        ),
        (
            {"kind": "hang_rank", "step": 1, "rank": 0, "steps": 2},
            r"faults\[1\]: hang_rank.steps=2 is only allowed for slow_rank, kill_process",
        ),
        (
            {"kind": "kill_rank", "step": 1, "rank": 0, "when": 3},
            r"unknown key 'faults\[1\].when'; allowed keys under 'faults\[1\]': kind, step, ",
        ),
        ({"kind": "kill_rank", "rank": 0}, r"faults\[1\].step is required"),
    ],
)
def test_fault_dict_errors_name_the_fault_and_field(raw: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        FaultConfig.from_dicts([{"kind": "kill_rank", "step": 0, "rank": 0}, raw])


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("kill_rank:rank=1", r"must look like '<kind>@<step>:<target>=<index>'"),
        ("kill_rank@x:rank=1", r"step='x' is not a number"),
        ("kill_rank@3:rank", r"'rank' is not key=value with key one of \['rank', 'gang'"),
        ("kill_rank@3:host=1", r"'host=1' is not key=value"),
        ("slow_rank@3:rank=1:stall_s=fast", r"stall_s='fast' is not a number"),
    ],
)
def test_fault_string_errors(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=r"faults\[0\]: .*" + match):
        FaultConfig.parse(text)


def test_targets_are_checked_against_the_job() -> None:
    plan = FaultConfig.parse("kill_rank@1:rank=7, hang_rank@2:node=4")
    plan.check_targets(num_ranks=8, num_gangs=2, num_nodes=5)
    with pytest.raises(ConfigError, match=r"faults\[1\].node=4 is out of range .*allowed: 0..3"):
        plan.check_targets(num_ranks=8, num_gangs=2, num_nodes=4)
    with pytest.raises(ConfigError, match=r"faults\[0\].rank=7 is out of range .*allowed: 0..6"):
        plan.check_targets(num_ranks=7, num_gangs=2, num_nodes=5)


def test_a_process_kill_lands_once_at_a_seeded_step_of_its_window() -> None:
    plan = FaultConfig.parse("kill_process@30:gang=1:steps=20:seed=4")
    (f,) = plan.faults
    assert f.to_dict() == {"kind": "kill_process", "step": 30, "gang": 1, "steps": 20, "seed": 4}
    assert FaultSpec.from_dict(f.to_dict()) == f
    for rank in (2, 3):
        step, moment = f.kill_at(rank)
        assert 30 <= step < 50 and 0.0 <= moment < 1.0
        assert f.kill_at(rank) == (step, moment)  # the same draw every time: replayable
        fired = [s for s in range(100) if plan.for_rank(s, rank=rank, gang=1, node=1)]
        assert fired == [step]
    # Ranks of the gang draw apart, and another seed draws another schedule.
    draws = {f.kill_at(r) for r in range(8)}
    assert len(draws) == 8
    other = FaultSpec.from_dict({**f.to_dict(), "seed": 5})
    assert [other.kill_at(r) for r in range(8)] != [f.kill_at(r) for r in range(8)]


def test_phase_faults_fire_at_their_phase_not_at_a_step() -> None:
    plan = FaultConfig.parse(
        "kill_rank@10:rank=1:phase=sync, kill_process@0:gang=3:later:phase=heal, kill_rank@5:rank=0"
    )
    assert [f.phase for f in plan.faults] == ["sync", "heal", None]
    assert plan.faults[1].later and plan.faults[1].to_dict()["later"] is True
    # A phase fault never fires at a step.
    assert all(
        f.phase is None
        for s in range(50)
        for f in plan.for_rank(s, rank=1, gang=0, node=0) + plan.for_rank(s, rank=0, gang=0, node=0)
    )
    # At its phase, from its step on; only the rank targeted.
    sync = plan.faults[0].phase
    assert sync is not None
    assert plan.for_phase(sync, 9, rank=1, gang=0, node=0) == ()
    assert plan.for_phase(sync, 10, rank=1, gang=0, node=0) == (0,)
    assert plan.for_phase(sync, 40, rank=1, gang=0, node=0) == (0,)
    assert plan.for_phase(sync, 40, rank=2, gang=1, node=1) == ()
    heal = plan.faults[1].phase
    assert heal is not None
    assert plan.for_phase(heal, 0, rank=6, gang=3, node=3) == (1,)
    # A gang that joins later is targeted with `later`, beyond the initial job only.
    plan.check_targets(num_ranks=4, num_gangs=2, num_nodes=2)
    with pytest.raises(ConfigError, match=r"faults\[1\].later=True but gang=3 is in the initial"):
        plan.check_targets(num_ranks=8, num_gangs=4, num_nodes=4)
    with pytest.raises(ConfigError, match=r"faults\[0\].gang=3 is out of range .*allowed: 0..1"):
        FaultConfig.parse("kill_rank@0:gang=3").check_targets(num_ranks=4, num_gangs=2, num_nodes=2)


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (
            {"kind": "slow_rank", "step": 1, "rank": 0, "stall_s": 1.0, "phase": "sync"},
            r"faults\[0\]: slow_rank.phase='sync' is only allowed for kill_rank, kill_process",
        ),
        (
            {"kind": "kill_rank", "step": 1, "rank": 0, "phase": "lunch"},
            r"faults\[0\].phase='lunch': must be 'heal', 'sync', 'checkpoint', 'eval', 'join'",
        ),
        (
            {"kind": "hang_rank", "step": 1, "rank": 0, "phase": "heal"},
            r"faults\[0\]: hang_rank.phase='heal' is only allowed for kill_rank, kill_process",
        ),
        (
            {"kind": "kill_process", "step": 1, "rank": 0, "steps": 5, "phase": "eval"},
            r"faults\[0\]: kill_process.steps=5 is not allowed with phase",
        ),
        (
            {"kind": "kill_rank", "step": 1, "node": 0, "later": True},
            r"faults\[0\]: kill_rank.later=True needs a rank or gang target, not node",
        ),
        (
            {"kind": "kill_rank", "step": 1, "rank": 0, "seed": 3},
            r"faults\[0\]: kill_rank.seed=3 is only allowed for kill_process",
        ),
    ],
)
def test_phase_later_and_seed_errors_name_the_field(raw: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        FaultConfig.from_dicts([raw])
