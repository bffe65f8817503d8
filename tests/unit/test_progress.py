"""Driver progress: console lines or a bar, metrics.jsonl, TensorBoard scalars and the plot."""

from __future__ import annotations

import dataclasses
import io
import json
import pathlib
import struct
from typing import Any

import pytest

from raytrec.elastic.workers import PEER_RELEASED
from raytrec.observability.metrics import IntervalMetrics
from raytrec.observability.progress import (
    EVENTS_FILE,
    EVENTS_TAG,
    METRICS_FILE,
    PLOT_FILE,
    TAG_PREFIX,
    TENSORBOARD_DIR,
    ProgressReporter,
    format_event,
    format_line,
    row_dict,
    scalars,
    time_left,
)

TOTAL = 40


def metrics_rows(n: int = 4, every: int = 10) -> list[IntervalMetrics]:
    fields = {f.name for f in dataclasses.fields(IntervalMetrics)}
    out = []
    for i in range(1, n + 1):
        values = dict(
            step=every * i,
            steps=every,
            loss=0.7 - 0.01 * i,
            samples_per_s=1000.0 * i,
            seconds=1.5,
            data_wait_fraction=0.125,
            sync_fraction=0.0625,
            generation=0 if i < 3 else 1,
            gangs=2,
            elapsed_s=1.5 * i,
            auc=0.6 + 0.01 * i,
        )
        out.append(IntervalMetrics(**{k: v for k, v in values.items() if k in fields}))
    return out


def read_tensorboard(
    directory: pathlib.Path, *, text: bool = False
) -> dict[str, list[tuple[int, Any]]]:
    """Scalars (or, with ``text``, text summaries) from tensorboardX event files, read as
    TFRecords (length, crc, data, crc)."""
    from tensorboardX.proto import event_pb2

    out: dict[str, list[tuple[int, Any]]] = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                is_text = value.metadata.plugin_data.plugin_name == "text"
                if is_text != text:
                    continue
                got = value.tensor.string_val[0].decode() if text else value.simple_value
                out.setdefault(value.tag, []).append((event.step, got))
    return out


def test_time_left_is_the_pace_of_the_recent_intervals() -> None:
    def rows(*pairs: tuple[int, float]) -> list[dict[str, float]]:
        return [{"step": s, "elapsed_s": e} for s, e in pairs]

    # One interval: its own pace (start-up included, nothing better is known yet).
    assert time_left(rows((10, 15.0)), 40) == pytest.approx(45.0)
    assert time_left(rows((0, 1.0)), 40) is None
    assert time_left([], 40) is None
    # A slow first interval (start-up) no longer counts once a second one ends.
    assert time_left(rows((10, 100.0), (20, 110.0)), 40) == pytest.approx(20.0)
    # The last PACE_WINDOW intervals only: a slow patch long ago is forgotten.
    history = rows((10, 100.0), *((10 * k, 100.0 + 2.0 * (k - 1)) for k in range(2, 12)))
    assert time_left(history, 200) == pytest.approx(0.2 * (200 - 110))
    assert time_left(rows((30, 40.0), (40, 60.0)), 40) == 0.0
    assert time_left(rows((30, 40.0), (50, 60.0)), 40) == 0.0


def test_format_line_shows_progress_metrics_and_time() -> None:
    row = row_dict(metrics_rows()[0])
    line = format_line(row, TOTAL)
    assert line.startswith("[raytrec] step     10/40 ( 25%) | loss 0.6900 | ")
    assert "|     1,000 samples/s |" in line
    assert "| gen 0 | gangs 2 | data wait 12.5% | sync 6.2% |" in line
    assert line.endswith("| 0:02 elapsed, 0:04 left")  # 1.5 s for 10 of 40 steps: 4.5 s left
    if "auc" in row:
        assert "| auc 0.6100 |" in line
    long = format_line({"step": 1, "elapsed_s": 3700.0}, 3)
    assert long.endswith("| 1:01:40 elapsed, 2:03:20 left")
    assert format_line({"step": 5, "loss": None}, 10) == "[raytrec] step      5/10 ( 50%)"


def test_scalars_are_the_numeric_fields_but_the_step() -> None:
    row = {"step": 3, "loss": 0.5, "gangs": 2, "auc": None, "flag": True, "name": "x"}
    assert scalars(row) == {"loss": 0.5, "gangs": 2.0}


def test_plain_lines_file_tensorboard_and_plot(tmp_path: pathlib.Path) -> None:
    rows = metrics_rows()
    stream = io.StringIO()
    reporter = ProgressReporter(TOTAL, run_dir=str(tmp_path), console=stream, tty=False)
    for row in rows:
        reporter(row)
    plot = reporter.close(events=[{"step": 25, "kind": "rank_lost", "rank": 1}])

    # The console: where the run goes, then one plain line per interval, no carriage returns
    # (job logs stay readable).
    first, *lines = stream.getvalue().splitlines()
    assert first == (
        f"[raytrec] run directory: {tmp_path} (python -m jobs.drain {tmp_path} --gangs 1 gives "
        "a gang back)"
    )
    dicts = [dataclasses.asdict(r) for r in rows]
    assert lines == [format_line(r, TOTAL, earlier=dicts[:i]) for i, r in enumerate(dicts)]
    assert "\r" not in stream.getvalue()

    # metrics.jsonl: every field of every row.
    written = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert written == [dataclasses.asdict(r) for r in rows]

    # TensorBoard: one scalar per numeric field per interval, at the row's step.
    board = read_tensorboard(tmp_path / TENSORBOARD_DIR)
    expected_tags = {TAG_PREFIX + k for k in scalars(dataclasses.asdict(rows[0]))}
    assert set(board) == expected_tags
    assert board[TAG_PREFIX + "loss"] == [(r.step, pytest.approx(r.loss, rel=1e-6)) for r in rows]
    assert board[TAG_PREFIX + "generation"] == [(r.step, float(r.generation)) for r in rows]

    assert plot == str(tmp_path / PLOT_FILE)
    raw = pathlib.Path(plot).read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n" and len(raw) > 20_000
    assert reporter.close() == plot  # closing twice is harmless


def test_rows_before_the_run_directory_are_written_when_it_is_known(
    tmp_path: pathlib.Path,
) -> None:
    rows = metrics_rows(3)
    reporter = ProgressReporter(TOTAL, console=io.StringIO(), tty=False, tensorboard=False)
    reporter(rows[0])
    reporter(rows[1])
    reporter.start(str(tmp_path))
    reporter(rows[2])
    reporter.close()
    written = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert [w["step"] for w in written] == [10, 20, 30]
    assert not (tmp_path / TENSORBOARD_DIR).exists()
    with pytest.raises(RuntimeError, match="already writes to"):
        reporter.start(str(tmp_path))


def test_fields_added_to_the_metrics_later_are_recorded(tmp_path: pathlib.Path) -> None:
    @dataclasses.dataclass(frozen=True)
    class Row:
        step: int
        loss: float
        elapsed_s: float
        recall_at_10: float

    reporter = ProgressReporter(20, run_dir=str(tmp_path), console=io.StringIO(), plot=False)
    reporter(Row(step=10, loss=0.5, elapsed_s=2.0, recall_at_10=0.25))
    reporter({"step": 20, "loss": 0.4, "elapsed_s": 4.0, "recall_at_10": 0.5})
    assert reporter.close() is None
    written = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert [w["recall_at_10"] for w in written] == [0.25, 0.5]
    board = read_tensorboard(tmp_path / TENSORBOARD_DIR)
    assert board[TAG_PREFIX + "recall_at_10"] == [(10, 0.25), (20, 0.5)]
    with pytest.raises(TypeError, match="must be a dataclass or a mapping"):
        reporter(3)


def test_terminal_gets_a_progress_bar(tmp_path: pathlib.Path) -> None:
    stream = io.StringIO()
    reporter = ProgressReporter(TOTAL, console=stream, tty=True, tensorboard=False, plot=False)
    for row in metrics_rows():
        reporter(row)
    reporter.close()
    out = stream.getvalue()
    assert "\r" in out  # redrawn in place
    assert "10/40 steps" in out and "40/40 steps" in out
    assert "loss=0.6600" in out and "samples/s=4,000" in out and "left=0:00" in out
    assert "left=0:04" in out  # after the first interval: 1.5 s per 10 steps, 30 to go
    assert out.count("[raytrec] step") == 4  # the per-interval lines are printed above it


def test_close_marks_given_events_and_derives_generation_changes(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import raytrec.observability.plots

    drawn: list[list[dict]] = []
    monkeypatch.setattr(
        raytrec.observability.plots,
        "plot_run",
        lambda rows, events, path, title="": drawn.append(events),
    )

    @dataclasses.dataclass(frozen=True)
    class RankDied:  # an event value, as the elastic event log holds them
        step: int
        job_rank: int

        def to_dict(self) -> dict:
            return {"kind": "rank_died", "step": self.step, "job_rank": self.job_rank}

    rows = metrics_rows()  # generation 0 until step 20, then 1
    reporter = ProgressReporter(TOTAL, run_dir=str(tmp_path), console=io.StringIO(), tty=False)
    for row in rows:
        reporter(row)
    reporter.close(events=[RankDied(step=25, job_rank=1)])
    assert drawn == [
        [
            {"kind": "rank_died", "step": 25, "job_rank": 1},
            {"step": 20, "kind": "generation", "generation": 1},  # from the rows
        ]
    ]

    # Given generation events, none are derived from the rows.
    drawn.clear()
    other = ProgressReporter(TOTAL, run_dir=str(tmp_path / "b"), console=io.StringIO(), tty=False)
    for row in rows:
        other(row)
    other.close(events=[{"step": 22, "kind": "generation_started", "generation": 1}])
    assert drawn == [[{"step": 22, "kind": "generation_started", "generation": 1}]]


def test_events_are_shown_as_they_come_and_written_to_events_jsonl(tmp_path: pathlib.Path) -> None:
    stream = io.StringIO()
    reporter = ProgressReporter(TOTAL, run_dir=str(tmp_path), console=stream, tty=False)
    rows = metrics_rows()
    died = {"kind": "rank_died", "at": 12.34, "step": 20, "job_rank": 3, "cause": "x" * 200}
    reshared = {"kind": "data_reshared", "at": 13.0, "step": 20, "ranks": 2, "end_step": 48}
    reporter(rows[0])
    reporter.event(died)
    reporter.event(reshared)
    lines = stream.getvalue().splitlines()[1:]  # after the run directory's line
    assert lines[1] == format_event(died)
    assert lines[1].startswith("[raytrec] event at 12.3s, step 20: rank_died job_rank=3 cause=")
    assert lines[1].endswith("x" * 117 + "...")
    assert lines[2] == "[raytrec] event at 13.0s, step 20: data_reshared ranks=2 end_step=48"
    written = [json.loads(x) for x in (tmp_path / EVENTS_FILE).read_text().splitlines()]
    assert written == [died, reshared]
    reporter.close()


def test_events_go_to_tensorboard_as_text_and_running_counts(tmp_path: pathlib.Path) -> None:
    """What the plot marks, TensorBoard gets as it happens: a text at the event's step and a
    running count per lane; bookkeeping and a rank raytrec ended on purpose are left out."""
    reporter = ProgressReporter(TOTAL, run_dir=str(tmp_path), console=io.StringIO(), tty=False)
    for row in metrics_rows():
        reporter(row)
    killed = {"kind": "rank_died", "at": 1.0, "step": 20, "job_rank": 3, "gang_id": 1}
    for event in (
        {"kind": "generation_started", "at": 0.5, "step": 0, "generation": 0},
        {**killed, "cause": "ActorDiedError: exited"},
        {**killed, "job_rank": 2, "cause": PEER_RELEASED},
        {"kind": "gang_dropped", "at": 1.1, "step": 20, "gang_id": 1, "reason": "x"},
        {"kind": "data_reshared", "at": 1.2, "step": 20, "ranks": 2, "end_step": 48},
        {"kind": "generation_started", "at": 1.3, "step": 20, "generation": 1},
        {"kind": "gang_joined", "at": 2.0, "step": 30, "gang_id": 2, "generation": 2},
        {"kind": "rank_died", "at": 3.0, "step": 35, "job_rank": 0, "gang_id": 0, "cause": "y"},
        {"kind": "total_loss", "at": 3.1, "step": 35, "checkpoint_step": 30},  # not one more
    ):
        reporter.event(event)
    reporter.close()
    board = read_tensorboard(tmp_path / TENSORBOARD_DIR)
    assert board[f"{EVENTS_TAG}/failures"] == [(20, 1.0), (35, 2.0)]
    assert board[f"{EVENTS_TAG}/gangs"] == [(20, 1.0), (30, 2.0)]
    assert board[f"{EVENTS_TAG}/generations"] == [(20, 1.0)]
    # tensorboardX files a text under "<tag>/text_summary".
    texts = read_tensorboard(tmp_path / TENSORBOARD_DIR, text=True)[f"{EVENTS_TAG}/text_summary"]
    assert [(step, text.split(":")[0]) for step, text in texts] == [
        (20, "rank 3 died"),
        (20, "gang 1 dropped"),
        (20, "gen 1"),
        (30, "gang 2 joined"),
        (35, "rank 0 died"),
        (35, "total loss"),
    ]
    assert "cause=ActorDiedError" in texts[0][1]


def test_a_stop_says_why_in_sentences_and_what_was_saved() -> None:
    from types import SimpleNamespace

    from raytrec.api import TrainingStopped

    config = SimpleNamespace(num_steps=32)
    trained = SimpleNamespace(steps=8, config=config, final_state_path="/runs/x/final_model")
    stop = TrainingStopped(ValueError("dense_4 at row_id 4000 is not finite"), trained)  # type: ignore[arg-type]
    assert str(stop) == (
        "dense_4 at row_id 4000 is not finite.\nTraining stopped after step 8 of 32; the model "
        "trained so far is saved at /runs/x/final_model."
    )
    nothing = SimpleNamespace(steps=0, config=config, final_state_path=None)
    assert str(TrainingStopped(ValueError("bad row."), nothing)).endswith(
        "bad row.\nTraining stopped after step 0 of 32; nothing was trained, so no model was saved."
    )
