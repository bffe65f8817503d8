"""Typed events from the coordinator to the user (pure, milliseconds): every event type survives
the trip across Ray (pickle) unchanged, the log reads by type and in order, the driver's
:class:`Result` holds the coordinator's record as it is, and JSON appears only where events leave
the process (``events.jsonl``)."""

from __future__ import annotations

import dataclasses
import io
import json
import pathlib
import pickle
from typing import Any

import pytest

import raytrec.elastic.events as events_module
from raytrec.config import TrainConfig
from raytrec.data.from_config import DataInfo
from raytrec.elastic.events import (
    Event,
    EventLog,
    GangDropped,
    GangJoined,
    GenerationStarted,
    RankDied,
)
from raytrec.elastic.run_record import RunRecord, RunSummary
from raytrec.errors import EarlyStopped
from raytrec.observability.metrics import IntervalMetrics
from raytrec.observability.progress import EVENTS_FILE, ProgressReporter, format_event
from raytrec.result import result_of

EVENT_TYPES = sorted(
    (
        c
        for c in vars(events_module).values()
        if isinstance(c, type) and issubclass(c, Event) and c is not Event
    ),
    key=lambda c: c.__name__,
)
# A value of each field type the events use, told apart from the defaults.
VALUES: dict[str, Any] = {
    "int": 7,
    "float": 2.5,
    "str": "x",
    "bool": True,
    "int | None": 3,
    "str | None": "y",
    "float | None": 1.5,
    "tuple[int, ...]": (1, 2),
    "tuple[str, ...]": ("a at 127.0.0.1",),
    "tuple[float, ...]": (1.5, 2.5),
}


def one_of(kind: type[Event], at: float = 1.0) -> Event:
    """An event of ``kind`` with every field set (at ``at``, step 4)."""
    fields = {
        f.name: VALUES[str(f.type)]
        for f in dataclasses.fields(kind)
        if f.name not in ("at", "step")
    }
    return kind(at=at, step=4, **fields)


def test_every_event_type_crosses_a_process_boundary_unchanged() -> None:
    assert len(EVENT_TYPES) == len(set(c.kind for c in EVENT_TYPES)) >= 20  # one kind each
    for kind in EVENT_TYPES:
        event = one_of(kind)
        back = pickle.loads(pickle.dumps(event))
        assert back == event and type(back) is kind and back.kind == kind.kind
        row = json.loads(json.dumps(event.to_dict()))
        assert row["kind"] == kind.kind and (row["at"], row["step"]) == (1.0, 4)
    log = EventLog(one_of(kind, at=float(i)) for i, kind in enumerate(EVENT_TYPES))
    back_log = pickle.loads(pickle.dumps(log))
    assert back_log == log and back_log is not log and len(back_log) == len(EVENT_TYPES)


def test_the_log_reads_by_type_in_order_and_by_position() -> None:
    died = RankDied(at=1.0, step=5, job_rank=3, gang_id=1, cause="killed")
    dropped = GangDropped(at=1.5, step=5, gang_id=1, reason="rank(s) [3] died")
    started = GenerationStarted(at=2.0, step=5, generation=1, gang_ids=(0,), reason="lost gang 1")
    joined = GangJoined(at=9.0, step=12, gang_id=2, generation=2)
    log = EventLog([died, dropped, started, joined])
    assert log.of(GangJoined) == (joined,) and log.of(RankDied)[0].job_rank == 3
    assert list(log) == [died, dropped, started, joined] and log[-1] is joined
    assert log[1:3] == (dropped, started)
    assert log.kinds() == ["rank_died", "gang_dropped", "generation_started", "gang_joined"]
    assert [e.step for e in log] == [5, 5, 5, 12]
    assert log != EventLog([died]) and log == EventLog(log)
    assert "GangJoined(at=9.0, step=12, gang_id=2, generation=2)" in repr(log)
    with pytest.raises(ValueError, match="earlier than the last one"):
        EventLog([joined, died])


def summary(**changes: Any) -> RunSummary:
    row = IntervalMetrics(
        step=8,
        steps=8,
        loss=0.5,
        samples_per_s=1.0,
        seconds=1.0,
        data_wait_fraction=0.0,
        sync_fraction=0.0,
        generation=1,
        gangs=1,
        elapsed_s=1.0,
    )
    fields: dict[str, Any] = dict(
        history=[row],
        final_state_path="/runs/a/final_model",
        steps=8,
        wall_s=3.5,
        state_digests={0: {"shards": "s", "dense": "d"}},
        first_batch_s=0.25,
        events=EventLog([GangDropped(at=1.0, step=5, gang_id=1, reason="r")]),
        generation=1,
        committed_batches=[(0, 8)],
        committed_count=8,
        replayed_batches=[(4, 6)],
        lost_batches=1,
        committed_rows=256,
        reshared_streams={"streams": []},
        ranks=[],
        checkpoint="/runs/a/checkpoints/checkpoint_0000000008",
    )
    return RunSummary(**{**fields, **changes})


def test_the_result_holds_the_coordinator_s_record_as_it_is(tmp_path: pathlib.Path) -> None:
    done = summary(stopped_by=EarlyStopped("eval_auc did not improve"))
    # Every record field set apart from its default, so a field left out would show.
    for f in dataclasses.fields(RunRecord):
        if f.default_factory is not dataclasses.MISSING:
            assert getattr(done, f.name) != f.default_factory(), f.name
        elif f.default is not dataclasses.MISSING:
            assert getattr(done, f.name) != f.default, f.name
    result = result_of(TrainConfig(num_steps=8), done, str(tmp_path), DataInfo(kind="synthetic"))
    for f in dataclasses.fields(RunRecord):
        assert getattr(result, f.name) is getattr(done, f.name), f.name
    assert result.events.of(GangDropped)[0].gang_id == 1
    assert result.checkpoint is not None
    assert result.checkpoint.path == "/runs/a/checkpoints/checkpoint_0000000008"
    assert result.stopped_early == "eval_auc did not improve"
    assert (result.run_dir, result.data.kind, result.best_checkpoints) == (
        str(tmp_path),
        "synthetic",
        [],
    )
    failed = summary(stopped_by=ValueError("bad row"), checkpoint=None)
    stopped = result_of(TrainConfig(num_steps=8), failed, str(tmp_path), DataInfo(kind="custom"))
    assert stopped.stopped_early is None and stopped.checkpoint is None


def test_events_become_json_where_they_leave_the_process(tmp_path: pathlib.Path) -> None:
    stream = io.StringIO()
    reporter = ProgressReporter(8, run_dir=str(tmp_path), console=stream, tty=False, plot=False)
    died = RankDied(at=12.34, step=20, job_rank=3, gang_id=1, cause="killed", node="n at 1.2.3.4")
    reporter.event(died)
    reporter.close()
    written = [json.loads(x) for x in (tmp_path / EVENTS_FILE).read_text().splitlines()]
    assert written == [
        {
            "kind": "rank_died",
            "at": 12.34,
            "step": 20,
            "job_rank": 3,
            "gang_id": 1,
            "cause": "killed",
            "node": "n at 1.2.3.4",
            "noticed_at": None,
        }
    ]
    assert stream.getvalue().splitlines()[-1] == format_event(written[0])
