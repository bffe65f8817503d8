"""Seeded random fault schedules through the real coordinator over the fake worker group
(simulation.fault_space): thousands of them with no defect and every fault kind and phase
reached; the shrinker; the one-line reproducer's round trip."""

from __future__ import annotations

import dataclasses
import json
import resource
import shlex
from typing import Any

import pytest

from simulation.fault_campaign import campaign, shrink
from simulation.fault_schedule import Schedule, Settings, generate, reproducer
from simulation.fault_space import Outcome, run_schedule

SCHEDULES = 2000
#: The issue's bound (2,000 schedules in 3 minutes on this 2-core machine), as CPU seconds of
#: the campaign's two workers: wall time would fail a correct campaign on a loaded machine.
BUDGET_CPU_S = 2 * 180.0

#: Each fault kind, by the fake's name for it, that the campaign must have fired.
FAULTS = {
    "RankDies",
    "RankHangs",
    "SlowRank",
    "NodeDies",
    "GroupBreaks",
    "HealCorrupted",
    "RankFails",
    "NodesJoin",
    "NodeDrains",
    "AtStep",
    "AtCall",
    "CoordinatorDies",
    "CoordinatorLost",
    "CoordinatorRestarted",
}
#: Phases of the job that faults must have landed in.
PHASES = {
    "start",
    "interval",
    "sync step",
    "last steps",
    "checkpoint save",
    "join: building",
    "join: placed",
    "join: sync",
    "join: healing",
    "join: verifying",
    "join: handing off rows",
    "drain",
    "re-forming",
    "probe",
    "total-loss rebuild",
    "resource wait",
    "final sync",
    "late placement",
    "booking a step",
    "restart",
}


def _cpu_s() -> float:
    """CPU seconds of this process and of its children that have ended (the pool's workers,
    once the campaign closed it)."""
    own, ended = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + ended.ru_utime + ended.ru_stime


def test_thousands_of_schedules_end_without_a_defect() -> None:
    t0 = _cpu_s()
    result = campaign(SCHEDULES, seed=0, workers=2, shrink_defects=False)
    cpu = _cpu_s() - t0
    defects = [f"seed {s}: {o.name}: {o.detail}" for s, o in result.defects.values()]
    assert not defects, "\n".join(defects)
    assert sum(result.outcomes.values()) == SCHEDULES
    assert cpu < BUDGET_CPU_S, f"{SCHEDULES} schedules took {cpu:.0f} CPU seconds"
    # Both ends of the outcome space: jobs that finish, stop on request, or fail by name.
    assert result.outcomes["pass:"] > SCHEDULES // 2
    assert result.outcomes["pass:StopRequested"] > 20
    assert result.outcomes["failed:JobFailedError"] > 20
    fired = {p.split(" @ ")[0] for p in result.phases}
    assert fired >= FAULTS, f"fault kinds never fired: {FAULTS - fired}"
    landed = {q for p in result.phases for q in p.split(" @ ")[1].split(" / ")[0].split(" > ")}
    assert landed >= PHASES, f"phases never reached: {PHASES - landed}"
    assert result.settings["data=reshared"] > SCHEDULES // 4
    assert result.settings["data=synthetic"] > SCHEDULES // 4
    assert result.settings["layout=replicas_within_host"] > SCHEDULES // 10
    assert result.settings["sync.levels"] > SCHEDULES // 20
    # A joining gang's rank lost while it heals, on re-shared rows, is in the space.
    assert result.phases["RankDies @ join: healing / broadcast_state"] > 0
    # The coordinator lost, and followed by new ones or given up on (restarts spent).
    assert result.outcomes["failed:CoordinatorDied"] > 20
    assert result.phases["CoordinatorRestarted @ restart"] > 100
    lost_in = {p.split(" @ ")[1].split(" / ")[0] for p in result.phases if "CoordinatorDies" in p}
    assert lost_in >= {"start", "interval", "checkpoint save", "re-forming", "final sync"}


#: Schedules that campaigns found defective, by the named scenario that keeps each fixed (in
#: tests/unit/test_control_plane.py, or the schedules themselves); each must replay as a pass.
_JOINERS = Settings(gang_size=1, num_steps=8, grow=True, min_gangs=3, max_gangs=4, spare_nodes=1)
FOUND = {
    "test_a_joining_gang_is_still_dropped_when_the_recovery_that_drops_it_starts_over": (
        # A fresh-seed campaign's: the never-healed copy was averaged in.
        Schedule(
            _JOINERS,
            (
                {"kind": "rank_dies", "on": "broadcast_state", "rank": 3},
                {"kind": "rank_dies", "rank": 0, "step": 2},
                {"kind": "rank_dies", "nth": 2, "on": "recover", "rank": 2},
            ),
            seed=7772847,
        ),
        # The same cause on re-shared rows: KeyError in RankStreams (the gang had no stream).
        Schedule(
            dataclasses.replace(_JOINERS, data="reshared"),
            (
                {"kind": "rank_dies", "rank": 0, "step": 2},
                {"kind": "rank_dies", "on": "state_digest", "rank": 3},
                {"kind": "rank_dies", "nth": 2, "on": "recover", "rank": 1},
            ),
        ),
    ),
    # Fresh-seed campaigns' (seeds 3013128500, 3013127240, 3013127132): a rank lost, or stuck,
    # as a restarted coordinator resumed (in load_checkpoint, in the build) escaped run() as a
    # bare RankCallError; the job is now rebuilt from the checkpoint as after a total loss.
    "a_rank_lost_as_the_job_resumes_from_a_checkpoint_rebuilds_it_from_there": (
        Schedule.from_json(
            '{"faults":[{"kind":"rank_dies","nth":1,"on":"load_checkpoint","rank":2},{"kind":"coordinator_dies","step":9}],"settings":{"checkpoint_every":5,"data":"synthetic","gang_size":2,"gangs":2,"grow":false,"layout":"replicas_across_hosts","log_every":2,"max_coordinator_restarts":3,"max_gangs":null,"min_gangs":1,"num_steps":9,"spare_nodes":0,"sync_every":4}}'
        ),
        Schedule.from_json(
            '{"faults":[{"kind":"rank_dies","nth":3,"on":"join_sync_plan","rank":0},{"kind":"coordinator_dies","step":21}],"settings":{"checkpoint_every":5,"data":"synthetic","gang_size":1,"gangs":4,"grow":true,"layout":"replicas_across_hosts","log_every":2,"max_coordinator_restarts":1,"max_gangs":5,"min_gangs":1,"num_steps":21,"spare_nodes":1,"sync_every":4}}'
        ),
        Schedule.from_json(
            '{"faults":[{"kind":"rank_hangs","nth":2,"on":"load_checkpoint","rank":1},{"kind":"coordinator_dies","step":18},{"kind":"coordinator_dies","step":20}],"settings":{"checkpoint_every":4,"data":"synthetic","gang_size":1,"gangs":4,"grow":false,"layout":"replicas_across_hosts","log_every":2,"max_coordinator_restarts":3,"max_gangs":null,"min_gangs":1,"num_steps":23,"spare_nodes":0,"sync_every":4}}'
        ),
    ),
    # A fresh-seed campaign's (seed 3689580803): after a resume (here, a new coordinator's),
    # a gang added later read the shard of its job rank, numbered from 0 again, which a gang
    # added before the checkpoint had read: its batches went into the model twice. It now
    # reads a shard no rank has read.
    "a_gang_added_after_a_resume_reads_a_shard_no_rank_has_read": (
        Schedule.from_json(
            '{"faults":[{"kind":"rank_dies","rank":0,"step":2},{"kind":"coordinator_dies","step":8}],"settings":{"checkpoint_every":2,"data":"synthetic","gang_size":1,"gangs":3,"grow":true,"layout":"replicas_across_hosts","log_every":2,"max_coordinator_restarts":3,"max_gangs":4,"min_gangs":3,"num_steps":19,"spare_nodes":1,"sync_every":4}}'
        ),
    ),
    # Hierarchical schedules: a gang lost after its group's lower-level sync (step 2) left half
    # of its rows in its group peer and took half of the peer's; the peer now rolls back. The
    # first campaign with sync.levels (seed 29) found the re-forming naming the rolled-back
    # gang by its place in the old generation's replica plane, not the new one's.
    "a_survivor_that_averaged_with_a_lost_gang_rolls_back": tuple(
        Schedule(
            Settings(gangs=4, gang_size=1, levels=((2, 2),), num_steps=8),
            ({"kind": "rank_dies", "rank": rank, "step": step},),
        )
        for rank, step in ((0, 2), (0, 3), (2, 3))
    ),
    # A fresh-seed campaign's (seed 1341052120): a gang lost in the re-forming's sync started
    # the recovery over, which planned the rollback on the new generation's groups and forgot
    # the one before's: both gangs that had averaged with a lost gang were averaged in. With 6
    # gangs two clean ones remain; with 4 none does, and the job is rebuilt from step 4's
    # checkpoint.
    "a_recovery_that_starts_over_still_rolls_back_what_the_one_before_had_to": tuple(
        Schedule(
            Settings(gangs=gangs, gang_size=1, levels=((2, 2),), num_steps=10, checkpoint_every=ck),
            (
                {"kind": "rank_dies", "rank": 3, "step": 7},
                {"kind": "rank_dies", "rank": 0, "on": "sync", "nth": 1},
            ),
        )
        for gangs, ck in ((6, None), (4, 4))
    ),
    # A fresh-seed campaign's (seed 126824284): a join's broadcast reaches every member, not
    # only the joined gang, but only the joined gang was compared with the peer afterwards. A
    # member of the rebuilt job (rank 10) took a copy that came out different; the stop that
    # followed during the hand-off left no sync to hide it, and the final replica check failed.
    # Every member is now compared, and one that differs is killed and its gang dropped.
    "a_member_whose_copy_of_a_joins_broadcast_differs_is_dropped": (
        Schedule.from_json(
            '{"faults":[{"kind":"rank_hangs","step":3},{"kind":"stop","on":"set_shard","rank":8},{"kind":"heal_lies","rank":10}],"seed":126824284,"settings":{"checkpoint_every":2,"data":"reshared","gang_size":2,"gangs":3,"grow":true,"layout":"replicas_across_hosts","levels":[],"log_every":2,"max_coordinator_restarts":3,"max_gangs":4,"min_gangs":1,"num_steps":15,"spare_nodes":2,"sync_every":4}}'
        ),
    ),
}


@pytest.mark.parametrize(
    "schedule",
    [
        pytest.param(schedule, id=f"{scenario}-{i}")
        for scenario, schedules in FOUND.items()
        for i, schedule in enumerate(schedules)
    ],
)
def test_schedules_found_defective_replay_as_passes(schedule: Schedule) -> None:
    outcome = run_schedule(schedule)
    assert outcome.verdict == "pass", f"{outcome}: {reproducer(schedule)}"


def test_a_coordinator_lost_in_a_checkpoint_save_is_followed_from_the_one_before() -> None:
    # It dies as the second checkpoint (step 4) is saved: the next one resumes from step 2's
    # and trains the batches committed after it again, each counted once (the invariants).
    lost = {"kind": "coordinator_dies", "rank": 0, "on": "save_checkpoint", "nth": 2}
    settings = Settings(gangs=2, num_steps=8, checkpoint_every=2, data="reshared")
    outcome = run_schedule(Schedule(settings, (lost,)))
    assert outcome.key == "pass:", outcome
    assert outcome.phases == (
        "CoordinatorDies @ checkpoint save / save_checkpoint",
        "CoordinatorLost @ restart",
        "CoordinatorRestarted @ restart",
    )
    # Once more than elastic.max_coordinator_restarts allows: a named failure, exit code 1.
    given_up = run_schedule(
        Schedule(dataclasses.replace(settings, max_coordinator_restarts=0), (lost,))
    )
    assert (given_up.key, given_up.exit_code) == ("failed:CoordinatorDied", 1), given_up
    assert "max_coordinator_restarts=0" in given_up.detail
    assert "checkpoint_0000000002" in given_up.detail  # the one to resume from


def test_a_loss_that_reaches_every_survivor_through_a_lower_level_is_a_total_loss(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Groups {0, 1} and {2, 3} average at step 6; ranks 0 and 2 die at step 7. Gangs 1 and 3
    # each hold half of a lost gang's rows: no copy is clean, so the job is rebuilt from the
    # checkpoint of step 4 (its invariants hold), or fails naming the missing checkpoint.
    from actors.total_loss import TotalLossRecovery

    reasons: list[str] = []
    begin = TotalLossRecovery.begin

    def noted(self: TotalLossRecovery, decision: Any, *, why: Any) -> None:
        reasons.append(decision.reason)
        begin(self, decision, why=why)

    monkeypatch.setattr(TotalLossRecovery, "begin", noted)
    settings = Settings(gangs=4, gang_size=1, levels=((2, 2),), num_steps=8, checkpoint_every=4)
    deaths = tuple({"kind": "rank_dies", "rank": r, "step": 7} for r in (0, 2))
    outcome = run_schedule(Schedule(settings, deaths))
    assert outcome.key == "pass:", outcome
    assert len(reasons) == 1 and "every surviving gang [1, 3]" in reasons[0], reasons
    assert "checkpoint of step 4" in reasons[0]
    failed = run_schedule(Schedule(dataclasses.replace(settings, checkpoint_every=None), deaths))
    assert failed.key == "failed:JobFailedError" and "no live copy" in failed.detail, failed


def test_a_campaign_starts_at_a_fresh_seed_and_prints_its_seeds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from simulation.__main__ import main

    firsts = []
    for _ in range(2):
        assert main(["--schedules", "2", "--no-shrink"]) == 0
        out = capsys.readouterr().out.splitlines()
        first = int(out[0].split("seeds ")[1].split()[0])
        # Said as it starts and again in the summary, with how to run the same schedules.
        again = f"seeds {first} to {first + 1}; again: --seed {first} --schedules 2"
        assert out[0] == f"fault_space: {again}" and f"({again})" in out[1]
        firsts.append(first)
    assert firsts[0] != firsts[1]  # 32 random bits each: equal once in 4 billion runs
    assert main(["--schedules", "2", "--seed", "7"]) == 0
    assert capsys.readouterr().out.startswith("fault_space: seeds 7 to 8;")


def test_the_same_seed_gives_the_same_schedule_and_outcome() -> None:
    a, b = generate(7), generate(7)
    assert a == b and a.to_json() == b.to_json() and generate(8) != a
    first, second = run_schedule(a), run_schedule(b)
    assert dataclasses.replace(first, wall_s=0) == dataclasses.replace(second, wall_s=0)


def test_the_shrinker_keeps_only_the_fault_that_fails_and_simplifies_the_settings() -> None:
    culprit = {"kind": "rank_dies", "rank": 3, "on": "recover", "nth": 1}
    noise = [
        {"kind": "slow_rank", "rank": 1, "step_s": 0.5},
        {"kind": "node_dies", "node": 0, "step": 4},
        {"kind": "stop", "step": 9},
    ]
    schedule = Schedule(
        Settings(gangs=4, data="reshared", grow=True, max_gangs=5, spare_nodes=2),
        (noise[0], culprit, *noise[1:]),
        seed=11,
    )
    runs: list[Schedule] = []

    def run(s: Schedule) -> Outcome:  # fails whenever the culprit is there, whatever else
        runs.append(s)
        bad = culprit in s.faults
        return Outcome("defect", "KeyError", "4") if bad else Outcome("pass")

    shrunk, outcome = shrink(schedule, run(schedule), run=run)
    assert shrunk.faults == (culprit,)
    assert outcome.key == "defect:KeyError"
    s = shrunk.settings
    assert (s.data, s.grow, s.max_gangs, s.spare_nodes, s.gang_size) == (
        "synthetic",
        False,
        None,
        0,
        1,
    )
    assert shrunk.seed == 11 and len(runs) < 30


def test_a_reproducer_replays_the_schedule_it_prints(capsys: pytest.CaptureFixture[str]) -> None:
    from simulation.__main__ import main

    schedule = Schedule(
        Settings(gangs=2, gang_size=2, grow=True, max_gangs=3, spare_nodes=1, data="reshared"),
        ({"kind": "rank_dies", "rank": 4, "on": "broadcast_state", "nth": 1},),
    )
    line = reproducer(schedule)
    argv = shlex.split(line)
    assert argv[:4] == ["python", "-m", "simulation", "--replay"]
    assert Schedule.from_json(argv[4]) == schedule
    assert main(argv[3:]) == 0
    out = capsys.readouterr().out
    assert out.startswith("pass") and "RankDies @ join: healing / broadcast_state" in out


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"settings": {}, "faults": [{"kind": "meteor"}]}', "has no kind of"),
        ('{"settings": {"data": "csv"}}', "Settings.data must be"),
        ('{"settings": {}, "extra": 1}', "got ['extra']"),
    ],
)
def test_a_bad_schedule_is_refused_naming_what(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        Schedule.from_json(text)


def test_a_defect_is_classified_with_where_it_was_raised(monkeypatch: Any) -> None:
    from actors import recovery

    def broken(self: Any, *args: Any, **kwargs: Any) -> None:
        raise KeyError(4)

    monkeypatch.setattr(recovery.FailureRecovery, "reform", broken)
    outcome = run_schedule(Schedule(Settings(), ({"kind": "rank_dies", "rank": 1, "step": 3},)))
    assert outcome.verdict == "defect" and outcome.name == "KeyError"
    assert "test_fault_space.py" in outcome.detail
    assert json.loads(Schedule(Settings()).to_json())["faults"] == []
