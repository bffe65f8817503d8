"""The job's journal (raytrec.elastic.journal) and the driver's restarts of a lost coordinator
(raytrec.restarts), without Ray: records round-trip in order, a torn last line is dropped, the
coordinator journals what a fake job commits, and a coordinator that keeps dying ends the job
with its ledger (from the journal) and the checkpoint to resume from."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import pytest
from test_control_plane import job

from raytrec.checkpoint.config import CheckpointConfig
from raytrec.config import TrainConfig
from raytrec.data.from_config import DataInfo
from raytrec.driver import CoordinatorDied
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.events import CoordinatorLost, CoordinatorRestarted
from raytrec.elastic.faults import FaultConfig, FaultSpec
from raytrec.elastic.journal import (
    CheckpointRecorded,
    CommitRecorded,
    CoordinatorStartedRecorded,
    FaultFiredRecorded,
    GenerationRecorded,
    JournalError,
    JournalWriter,
    journal_path,
    read_journal,
    replay,
    summary_from_journal,
)
from raytrec.errors import ConfigError
from raytrec.restarts import CoordinatorSeat, GiveUp, Restart, restart_decision
from raytrec.result import result_of
from simulation.doubles.fake_faults import RankDies

COMMIT = CommitRecorded(
    step=8,
    generation=1,
    committed=((0, 8), (1 << 40, (1 << 40) + 8)),
    committed_count=16,
    committed_rows=512,
    replayed=(),
    lost=0,
)
CHECKPOINT = CheckpointRecorded(step=8, uri="/runs/x/checkpoints/checkpoint_8", committed_count=16)


def test_records_round_trip_in_order_and_a_torn_last_line_is_dropped(tmp_path: str) -> None:
    writer = JournalWriter(str(tmp_path))
    records = [
        CoordinatorStartedRecorded(step=0, attempt=0, pid=123, resume_from=None),
        GenerationRecorded(step=0, generation=1, gangs=(0, 1)),
        COMMIT,
        CHECKPOINT,
        FaultFiredRecorded(step=10, index=0),
    ]
    for r in records:
        writer.append(r)
    assert read_journal(str(tmp_path)) == records
    with open(journal_path(str(tmp_path)), "ab") as f:
        f.write(b'{"kind":"commit","step":12,"generation"')  # killed mid-write
    assert read_journal(str(tmp_path)) == records
    state = replay(records)
    assert (state.step, state.commit, state.checkpoint) == (10, COMMIT, CHECKPOINT)
    assert state.fired == {0} and state.generations == 1 and state.rolled_back == 0
    # A damaged record before the last one is an error, not silently skipped.
    with open(journal_path(str(tmp_path)), "ab") as f:
        f.write(b"\n" + b'{"kind":"checkpoint","step":12}\n')
    with pytest.raises(JournalError, match="record 6 is unreadable"):
        read_journal(str(tmp_path))
    assert read_journal(f"{tmp_path}/none") == []


def test_the_journal_cost_per_record_is_small(tmp_path: str) -> None:
    """One commit record (write + fsync) per interval; the figure is printed for the docs."""
    writer = JournalWriter(str(tmp_path))
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        writer.append(COMMIT)
    per = (time.perf_counter() - t0) / n
    print(f"journal: {1e3 * per:.3f} ms per fsynced commit record")
    assert len(read_journal(str(tmp_path))) == n
    assert per < 0.25  # far below an interval (seconds); a loaded disk gets a wide margin


def test_a_fake_jobs_journal_holds_its_commits_generations_and_checkpoints(
    tmp_path: str,
) -> None:
    """The coordinator's journal, through a job with a lost gang and checkpoints: its last
    commit is the summary's accounting; every checkpoint saved is journaled with what it
    holds; each generation is journaled once."""
    j = job(tmp_path, RankDies(rank=3, step=5), checkpoint=CheckpointConfig(every_n_steps=4))
    summary = j.run()  # every batch once
    records = read_journal(str(tmp_path))
    state = replay(records)
    assert state.commit is not None
    assert list(state.commit.committed) == summary.committed_batches
    assert state.commit.committed_count == summary.committed_count
    assert state.commit.step == summary.steps
    saved = [r for r in records if isinstance(r, CheckpointRecorded)]
    assert [r.step for r in saved] == [
        e.step for e in summary.events if e.kind == "checkpoint_saved"
    ]
    assert state.checkpoint is not None and state.checkpoint.uri == summary.checkpoint
    generations = [r.generation for r in records if isinstance(r, GenerationRecorded)]
    assert generations == sorted(set(generations)) and generations[-1] == summary.generation


def test_kill_coordinator_is_a_fault_without_a_target() -> None:
    plan = FaultConfig.parse("kill_coordinator@10")
    assert plan.coordinator_kills() == (10,) and plan.to_dicts() == [
        {"kind": "kill_coordinator", "step": 10}
    ]
    assert plan.for_rank(10, rank=0, gang=0, node=0) == ()
    plan.check_targets(num_ranks=2, num_gangs=2, num_nodes=1)
    with pytest.raises(ConfigError, match="kill_coordinator has no target"):
        FaultSpec.parse("kill_coordinator@10:rank=1")
    with pytest.raises(ConfigError, match="max_coordinator_restarts"):
        ElasticConfig(max_coordinator_restarts=-1)


def test_restart_decisions() -> None:
    state = replay([COMMIT, CHECKPOINT, GenerationRecorded(step=10, generation=2, gangs=(0,))])
    later = CommitRecorded(**{**COMMIT.__dict__, "step": 10, "committed_count": 20})
    state = replay([COMMIT, CHECKPOINT, later])
    go = restart_decision(
        state, restarts_done=0, max_restarts=1, resumed_from=None, stop_asked=False
    )
    assert go == Restart(attempt=1, uri=CHECKPOINT.uri, step=8, rolled_back=4)
    # Without a checkpoint: from the start, every committed batch trained again.
    assert restart_decision(
        replay([later]), restarts_done=0, max_restarts=1, resumed_from=None, stop_asked=False
    ) == Restart(attempt=1, uri=None, step=0, rolled_back=20)
    done = restart_decision(
        state, restarts_done=1, max_restarts=1, resumed_from=None, stop_asked=False
    )
    assert isinstance(done, GiveUp) and "max_coordinator_restarts=1" in done.reason
    assert CHECKPOINT.uri in done.reason
    stopped = restart_decision(
        state, restarts_done=0, max_restarts=3, resumed_from=None, stop_asked=True
    )
    assert isinstance(stopped, GiveUp) and "stop was asked" in stopped.reason


def test_a_coordinator_that_keeps_dying_ends_the_job_with_its_ledger_and_checkpoint(
    tmp_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every coordinator dies (the driver's follow raises CoordinatorDied): two restarts from
    the journal's checkpoint, then the job fails naming it, with the journal's accounting."""
    run_dir = str(tmp_path)
    writer = JournalWriter(run_dir)
    writer.append(COMMIT)
    writer.append(CHECKPOINT)
    started: list[tuple[str | None, int]] = []
    events: list[Any] = []

    def start(resume_from: str | None, attempt: int) -> str:
        started.append((resume_from, attempt))
        return f"coordinator-{attempt}"

    def dies(coordinator: Any, *_: Any) -> Any:
        raise CoordinatorDied(f"the coordinator actor died: {coordinator} was SIGKILLed")

    monkeypatch.setattr("raytrec.restarts.drive", dies)
    seat = CoordinatorSeat(
        start,
        run_dir=run_dir,
        max_restarts=2,
        resume_from=None,
        on_row=lambda row: None,
        on_event=events.append,
        release=lambda: None,
    )

    class Stop:
        asked = False

    with pytest.raises(CoordinatorDied) as failed:
        seat.drive(Stop())
    assert started == [(None, 0), (CHECKPOINT.uri, 1), (CHECKPOINT.uri, 2)]
    assert "died 3 time(s)" in str(failed.value) and CHECKPOINT.uri in str(failed.value)
    assert [type(e) for e in events] == [
        CoordinatorLost,
        CoordinatorRestarted,
        CoordinatorLost,
        CoordinatorRestarted,
        CoordinatorLost,
    ]
    assert [e.restarts_left for e in events if isinstance(e, CoordinatorLost)] == [1, 0, 0]
    state = seat.journal()
    assert state.restarts == 2
    # The ledger of the failed job: the journal's commit, and the checkpoint to resume from.
    summary = summary_from_journal(state, [], events, wall_s=1.0)
    config = TrainConfig(
        num_steps=16,
        storage_path=run_dir,
        checkpoint=CheckpointConfig(every_n_steps=4),
        elastic=ElasticConfig(max_coordinator_restarts=2),
    )
    ledger = result_of(config, summary, run_dir, DataInfo(kind="synthetic")).ledger(
        failed=str(failed.value)
    )
    assert ledger["ended"] == "failed" and ledger["resume_from"] == CHECKPOINT.uri
    assert ledger["batches"]["committed"] == 16 and ledger["rows"]["trained"] == 512
    assert ledger["failures"]["events"] == {"coordinator_lost": 3}
    assert ledger["failures"]["count"] == 3 and ledger["coordinator_restarts"] == 2
    assert os.path.exists(journal_path(run_dir))


def test_a_coordinator_that_failed_as_it_was_made_is_not_restarted(
    tmp_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[int] = []

    def fails_to_start(*_: Any) -> Any:
        died = CoordinatorDied("the coordinator actor died: its constructor raised")
        died.restartable = False
        raise died

    monkeypatch.setattr("raytrec.restarts.drive", fails_to_start)
    seat = CoordinatorSeat(
        lambda _uri, attempt: started.append(attempt),
        run_dir=str(tmp_path),
        max_restarts=3,
        resume_from=None,
        on_row=lambda row: None,
        on_event=lambda e: None,
        release=lambda: None,
    )

    class Stop:
        asked = False

    with pytest.raises(CoordinatorDied, match="constructor raised"):
        seat.drive(Stop())
    assert started == [0] and seat.restarts == 0


def test_the_driver_books_a_coordinators_loss_on_the_coordinators_clock(
    tmp_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every coordinator counts its times from the seat's origin, so the loss the seat books
    is at the time it happened on the clock of the rows before and after it (before, the seat
    counted from its own start and the first coordinator from its own: the loss came out late
    by that coordinator's start-up)."""
    from simulation.doubles.fake_faults import ManualClock

    @dataclasses.dataclass(frozen=True)
    class Row:
        at: float
        elapsed_s: float

    clock = ManualClock()
    clock.advance_to(100.0)
    rows: list[Row] = []
    events: list[Any] = []

    def start(_resume_from: str | None, attempt: int) -> str:
        clock.advance_to(clock.now + 20.0)  # the coordinator's process starting
        return f"coordinator-{attempt}"

    def dies_after_30_s(coordinator: str, on_row: Any, *_: Any) -> str:
        if coordinator == "coordinator-1":  # its row at 131 on the seat's clock
            on_row(Row(at=clock.now + 1.0 - 100.0, elapsed_s=1.0))
            return "summary"
        clock.advance_to(clock.now + 30.0)
        raise CoordinatorDied("the coordinator actor died: SIGKILLed")

    monkeypatch.setattr("raytrec.restarts.drive", dies_after_30_s)
    seat = CoordinatorSeat(
        start,
        run_dir=str(tmp_path),
        max_restarts=1,
        resume_from=None,
        on_row=rows.append,
        on_event=events.append,
        release=lambda: None,
        clock=clock,
        origin=100.0,
    )

    class Stop:
        asked = False

    assert seat.drive(Stop()) == "summary"
    lost, restarted = events
    assert isinstance(lost, CoordinatorLost) and lost.at == 50.0  # 20 s start-up + 30 s
    assert isinstance(restarted, CoordinatorRestarted) and restarted.at == 50.0
    # The new coordinator's rows are on that clock already; its elapsed_s goes on from when
    # it started.
    assert rows == [Row(at=71.0, elapsed_s=51.0)]
