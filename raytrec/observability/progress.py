"""What the driver shows and records while a job trains, from its metrics rows as they come.

:class:`ProgressReporter` is the ``on_progress`` callback of :func:`raytrec.fit`. Each
:class:`~raytrec.observability.metrics.IntervalMetrics` row (one per ``log_every`` steps) goes to:

- the console: a tqdm progress bar (steps, samples/s, loss, time left) when the console is a
  terminal, or one plain line per interval when it is not (``ray job submit`` logs, notebooks,
  files), so logs never fill with carriage returns;
- ``metrics.jsonl`` in the run directory: one JSON object per interval with every field of the
  row, appended as it arrives;
- TensorBoard scalars under ``tensorboard/`` in the run directory (tensorboardX), one tag per
  numeric field, and the job's events as they come: a text entry at their step (tag
  ``events/text_summary``) and a running count per lane of the plot's strip
  (``events/failures``, ``events/gangs``, ...: :mod:`raytrec.observability.incidents`);
- and, at :meth:`ProgressReporter.close`, ``metrics.png``
(:func:`raytrec.observability.plots.plot_run`).

Rows are handled generically (``dataclasses.fields`` or a mapping), so fields added to the
metrics later are recorded without changes here. The run directory may be given after the first
rows: rows are kept and written when :meth:`ProgressReporter.start` names it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from raytrec.observability.incidents import as_dict, mark_of

if TYPE_CHECKING:
    from raytrec.elastic.events import Event

__all__ = [
    "EVENTS_FILE",
    "EVENTS_TAG",
    "METRICS_FILE",
    "PLOT_FILE",
    "TENSORBOARD_DIR",
    "ProgressReporter",
    "event_dict",
    "format_event",
    "format_line",
    "row_dict",
    "scalars",
    "time_left",
]

METRICS_FILE = "metrics.jsonl"
EVENTS_FILE = "events.jsonl"
TENSORBOARD_DIR = "tensorboard"
PLOT_FILE = "metrics.png"
TAG_PREFIX = "train/"
EVENTS_TAG = "events"


def row_dict(row: Any) -> dict[str, Any]:
    """A metrics row (a dataclass such as IntervalMetrics, or a mapping) as a plain dict."""
    if dataclasses.is_dataclass(row) and not isinstance(row, type):
        return {f.name: getattr(row, f.name) for f in dataclasses.fields(row)}
    if isinstance(row, Mapping):
        return dict(row)
    raise TypeError(f"a metrics row must be a dataclass or a mapping, got {type(row).__name__}")


def scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The row's numeric fields (bools and None left out), as TensorBoard records them."""
    return {
        k: float(v)
        for k, v in row.items()
        if k not in ("step", "end_step") and isinstance(v, int | float) and not isinstance(v, bool)
    }


#: Intervals whose pace the time left is taken from.
PACE_WINDOW = 5


def time_left(rows: Sequence[Mapping[str, Any]], total: int) -> float | None:
    """Seconds to go at the pace of the last :data:`PACE_WINDOW` intervals (``rows``: the
    metrics rows so far, each with ``step`` and ``elapsed_s``). The first interval, which
    carries the job's start-up, counts only until a second one ends. None before any step."""
    timed = [r for r in rows if isinstance(r.get("elapsed_s"), int | float)]
    if not timed:
        return None
    last = timed[-1]
    step, elapsed = int(last["step"]), float(last["elapsed_s"])
    if len(timed) == 1:
        if step <= 0 or elapsed <= 0:
            return None
        return elapsed / step * max(total - step, 0)
    first = timed[-min(len(timed), PACE_WINDOW + 1)]
    steps = step - int(first["step"])
    if steps <= 0:
        return None
    return (elapsed - float(first["elapsed_s"])) / steps * max(total - step, 0)


def _duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = round(seconds)
    return (
        f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
    )


def _json_value(value: Any) -> Any:
    """numpy and torch scalars as Python numbers; anything else JSON cannot hold as text."""
    item = getattr(value, "item", None)
    return item() if callable(item) else str(value)


# How the console line shows the fields it knows; other fields are in the file and TensorBoard.
_LINE_FIELDS: tuple[tuple[str, Callable[[Any], str]], ...] = (
    ("loss", lambda v: f"loss {v:.4f}"),
    ("auc", lambda v: f"auc {v:.4f}"),
    ("ne", lambda v: f"ne {v:.4f}"),
    ("samples_per_s", lambda v: f"{v:>9,.0f} samples/s"),
    ("generation", lambda v: f"gen {v}"),
    ("gangs", lambda v: f"gangs {v}"),
    ("data_wait_fraction", lambda v: f"data wait {100 * v:.1f}%"),
    ("sync_fraction", lambda v: f"sync {100 * v:.1f}%"),
    ("eval_auc", lambda v: f"eval auc {v:.4f}"),
    ("eval_log_loss", lambda v: f"eval log loss {v:.4f}"),
)


def format_line(
    row: Mapping[str, Any],
    total_steps: int,
    *,
    earlier: Sequence[Mapping[str, Any]] = (),
    prefix: str = "[raytrec]",
) -> str:
    """One console line for an interval: step, known metrics, elapsed time and time left (at
    the pace of ``earlier`` rows and this one)."""
    step = int(row["step"])
    parts = [f"{prefix} step {step:>6}/{total_steps} ({100 * step / max(total_steps, 1):3.0f}%)"]
    parts += [fmt(row[k]) for k, fmt in _LINE_FIELDS if row.get(k) is not None]
    elapsed = row.get("elapsed_s")
    if isinstance(elapsed, int | float):
        left = time_left([*earlier[-PACE_WINDOW:], row], total_steps)
        parts.append(f"{_duration(float(elapsed))} elapsed, {_duration(left)} left")
    return " | ".join(parts)


def event_dict(event: Event | Mapping[str, Any]) -> dict[str, Any]:
    """An event as the JSON-ready dict written to ``events.jsonl``: an event value's
    ``to_dict()`` (:mod:`raytrec.elastic.events`), or a mapping as it is."""
    return as_dict(event)


def format_event(event: Mapping[str, Any], *, prefix: str = "[raytrec]") -> str:
    """``[raytrec] event at 12.3s, step 120: rank_died job_rank=3 ...`` (long values cut)."""
    rest = []
    for key, value in event.items():
        if key in ("kind", "at", "step"):
            continue
        text = str(value)
        rest.append(f"{key}={text if len(text) <= 120 else text[:117] + '...'}")
    head = f"{prefix} event at {float(event.get('at', 0.0)):.1f}s, step {event.get('step')}"
    return f"{head}: {event.get('kind')} " + " ".join(rest)


class ProgressReporter:
    """Console progress, ``metrics.jsonl``, TensorBoard scalars and a closing PNG plot.

    Call it with each metrics row; call :meth:`start` with the run directory (before or after
    the first rows) and :meth:`close` at the end, with the run's events to mark on the plot.
    """

    def __init__(
        self,
        total_steps: int | None,
        *,
        run_dir: str | None = None,
        console: TextIO | None = None,
        tty: bool | None = None,
        tensorboard: bool = True,
        plot: bool = True,
        title: str = "",
    ) -> None:
        self.total_steps = total_steps  # None: fit sets it once the data's length is known
        self.console = console if console is not None else sys.stdout
        isatty = getattr(self.console, "isatty", None)
        self.tty = tty if tty is not None else bool(isatty and isatty())
        self.tensorboard = tensorboard
        self.plot = plot
        self.title = title
        self.rows: list[dict[str, Any]] = []
        self.run_dir: str | None = None
        self.plot_path: str | None = None
        self._bar: Any = None
        self._file: TextIO | None = None
        self._writer: Any = None
        self._marked: dict[str, int] = {}  # TensorBoard's running count of events per lane
        self._closed = False
        if run_dir is not None:
            self.start(run_dir)

    # -- the run directory -------------------------------------------------------------------

    def start(self, run_dir: str) -> None:
        """Opens the metrics file and TensorBoard writer in ``run_dir``; writes earlier rows."""
        if self.run_dir is not None:
            raise RuntimeError(f"this reporter already writes to {self.run_dir}")
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        self._file = open(os.path.join(run_dir, METRICS_FILE), "a")  # noqa: SIM115 (closed in close)
        if self.tensorboard:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(logdir=os.path.join(run_dir, TENSORBOARD_DIR))
        for row in self.rows:
            self._record(row)
        print(
            f"[raytrec] run directory: {run_dir} (python -m jobs.drain {run_dir} --gangs 1 "
            "gives a gang back)",
            file=self.console,
            flush=True,
        )

    # -- rows --------------------------------------------------------------------------------

    def __call__(self, row: Any) -> None:
        data = row_dict(row)
        self.rows.append(data)
        self._show(data)
        if self.run_dir is not None:
            self._record(data)

    def _show(self, row: dict[str, Any]) -> None:
        end = row.get("end_step")
        if isinstance(end, int) and end != self.total_steps:  # the rows were shared again
            self.total_steps = end
            if self._bar is not None:
                self._bar.total = end
        total = self.total_steps if self.total_steps is not None else int(row["step"])
        line = format_line(row, total, earlier=self.rows[:-1])
        if not self.tty:
            print(line, file=self.console, flush=True)
            return
        from tqdm import tqdm

        if self._bar is None:
            # Time left comes from the rows' training time, not from tqdm's own clock, which
            # would count the cluster's start-up.
            self._bar = tqdm(
                total=total,
                file=self.console,
                dynamic_ncols=True,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} steps [{elapsed}{postfix}]",
            )
        self._bar.update(int(row["step"]) - self._bar.n)
        postfix = {"loss": f"{row['loss']:.4f}"} if row.get("loss") is not None else {}
        if row.get("samples_per_s") is not None:
            postfix["samples/s"] = f"{row['samples_per_s']:,.0f}"
        if isinstance(row.get("elapsed_s"), int | float):
            left = time_left(self.rows[-PACE_WINDOW - 1 :], total)
            postfix["left"] = _duration(left)
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.write(line, file=self.console)

    def _record(self, row: dict[str, Any]) -> None:
        assert self._file is not None
        self._file.write(json.dumps(row, default=_json_value) + "\n")
        self._file.flush()
        if self._writer is not None:
            for key, value in scalars(row).items():
                self._writer.add_scalar(TAG_PREFIX + key, value, global_step=int(row["step"]))
            self._writer.flush()

    # -- events ------------------------------------------------------------------------------

    def event(self, event: Event | Mapping[str, Any]) -> None:
        """Shows one of the job's events (a failure, a generation, a heal, a re-share: an
        :class:`~raytrec.elastic.events.Event`, or its ``to_dict()``) as a line, and appends it
        to ``events.jsonl``."""
        row = event_dict(event)
        line = format_event(row)
        if self._bar is not None:
            self._bar.write(line, file=self.console)
        else:
            print(line, file=self.console, flush=True)
        if self.run_dir is not None:
            with open(os.path.join(self.run_dir, EVENTS_FILE), "a") as f:
                f.write(json.dumps(row, default=_json_value) + "\n")
        if self._writer is not None:
            self._board_event(row)

    def _board_event(self, row: dict[str, Any]) -> None:
        """The event in TensorBoard, if the plot would mark it: its text at its step, and the
        running tally of its lane (as the plot's strip counts them)."""
        mark = mark_of(row)
        if mark is None:
            return
        self._writer.add_text(EVENTS_TAG, mark.text, global_step=mark.step)
        if mark.counts:
            self._marked[mark.lane] = self._marked.get(mark.lane, 0) + 1
            self._writer.add_scalar(
                f"{EVENTS_TAG}/{mark.lane}", self._marked[mark.lane], global_step=mark.step
            )
        self._writer.flush()

    # -- the end -----------------------------------------------------------------------------

    def close(self, events: Iterable[Event | Mapping[str, Any]] = ()) -> str | None:
        """Closes the outputs and writes the PNG plot with ``events`` (and generation changes)
        marked; returns the plot's path (None without a run directory, rows or ``plot``)."""
        if self._closed:
            return self.plot_path
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()
        if self._writer is not None:
            self._writer.close()
        if self.plot and self.run_dir is not None and self.rows:
            from raytrec.observability.plots import GENERATION_KINDS, generation_events, plot_run

            marked = [event_dict(e) for e in events]
            if not any(e.get("kind") in GENERATION_KINDS for e in marked):
                marked += generation_events(self.rows)
            self.plot_path = plot_run(
                self.rows, marked, os.path.join(self.run_dir, PLOT_FILE), title=self.title
            )
        return self.plot_path

    def __enter__(self) -> ProgressReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
