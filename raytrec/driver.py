"""The driver's side of a running job: following the coordinator.

:func:`drive` runs the job and passes its metrics rows and events on as they come;
:class:`StopOnSignal` turns SIGTERM and SIGINT into a stop at the next interval boundary (or at
once, the second time); when the job fails, :func:`job_failure` names what ended it and
:func:`close_failed` writes its ledger, metrics and traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
import ray.exceptions
import ray.train

from raytrec.config import ConfigError
from raytrec.elastic.events import Event
from raytrec.elastic.journal import read_journal, replay, summary_from_journal
from raytrec.elastic.run_record import RunSummary
from raytrec.errors import JobFailedError, StopRequested
from raytrec.observability.metrics import IntervalMetrics
from raytrec.observability.progress import ProgressReporter
from raytrec.observability.summary import ledger_lines, write_ledger
from raytrec.result import Result

__all__ = [
    "CoordinatorDied",
    "Seen",
    "StopOnSignal",
    "close_failed",
    "drive",
    "interrupted",
    "job_failure",
    "release_placement_groups",
    "summary_after",
]


class Seen:
    """Passes the job's metrics rows and events on, keeping them: the driver's own record of a
    job whose coordinator died."""

    def __init__(
        self,
        on_row: Callable[[IntervalMetrics], None],
        on_event: Callable[[Event], None] | None,
    ) -> None:
        self.rows: list[IntervalMetrics] = []
        self.events: list[Event] = []
        self._on_row, self._on_event = on_row, on_event
        self.started = time.perf_counter()

    def row(self, row: IntervalMetrics) -> None:
        self.rows.append(row)
        self._on_row(row)

    def event(self, event: Event) -> None:
        self.events.append(event)
        if self._on_event is not None:
            self._on_event(event)


def interrupted(e: BaseException) -> bool:
    return isinstance(e, KeyboardInterrupt)


def job_failure(e: BaseException) -> BaseException:
    """The exception ``fit`` raises for what ended the job: raytrec's own errors and an
    interrupt as they are; anything else (a defect) as a :class:`JobFailedError` naming it."""
    if isinstance(e, JobFailedError | ConfigError | KeyboardInterrupt | StopRequested):
        return e
    cause = getattr(e, "cause", None) if isinstance(e, ray.exceptions.RayTaskError) else e
    what = f"{type(cause).__name__}: {cause}" if cause is not None else str(e)
    failure = JobFailedError(
        f"the job's coordinator failed with {' '.join(what.split())[:500]} (a defect: its "
        "traceback is in error.txt in the run directory)"
    )
    failure.__cause__ = e
    return failure


def summary_after(coordinator: Any, seen: Seen, *, wait_s: float, run_dir: str) -> RunSummary:
    """The coordinator's :meth:`~actors.coordinator.Coordinator.summary_so_far`, or, when it
    cannot answer (it died), what the run's journal says it committed
    (:func:`~raytrec.elastic.journal.summary_from_journal`) with the metrics rows and events
    the driver saw."""
    with contextlib.suppress(Exception):
        return ray.get(coordinator.summary_so_far.remote(), timeout=wait_s)
    state = replay(read_journal(run_dir))
    wall_s = time.perf_counter() - seen.started
    return summary_from_journal(state, seen.rows, seen.events, wall_s=wall_s)


def close_failed(
    result: Result, failure: BaseException, reporter: Any, *, own_reporter: bool
) -> None:
    """Writes a failed job's ledger (``summary.json``, with why it ended and the checkpoint to
    resume from), its metrics and the traceback of a defect, and prints the ledger's lines;
    ``failure`` gets the result (``failure.result``)."""
    import traceback

    from raytrec.checkpoint.config import checkpoint_root
    from raytrec.checkpoint.layout import CheckpointStore

    if result.checkpoint is None:
        # The coordinator could not say: the newest checkpoint committed on disk.
        with contextlib.suppress(Exception):
            ref = CheckpointStore(checkpoint_root(result.run_dir)).latest()
            if ref is not None:
                result = dataclasses.replace(result, checkpoint=ray.train.Checkpoint(ref.uri))
    with open(os.path.join(result.run_dir, "metrics.json"), "w") as f:
        json.dump([m.to_dict() for m in result.history], f, indent=1)
    if failure.__cause__ is not None and not isinstance(failure, KeyboardInterrupt):
        with open(os.path.join(result.run_dir, "error.txt"), "w") as f:
            f.write("".join(traceback.format_exception(failure.__cause__)))
    reason = "interrupted" if interrupted(failure) else f"{type(failure).__name__}: {failure}"
    reason = " ".join(reason.split())
    if isinstance(failure, StopRequested):
        ledger = result.ledger(stopped=reason)
    else:
        ledger = result.ledger(failed=reason)
    write_ledger(ledger)
    if isinstance(reporter, ProgressReporter):
        if own_reporter:
            reporter.close(events=result.events)  # metrics file, TensorBoard and the plot
        for line in ledger_lines(ledger):
            print(line, flush=True)
    # The run's result travels with the exception (JobFailedError.result, ConfigError.result).
    failure.result = result  # type: ignore[attr-defined]


def drive(
    coordinator: Any,
    on_progress: Callable[[IntervalMetrics], None],
    on_event: Callable[[Event], None] | None,
    stop: StopOnSignal,
) -> RunSummary:
    """Runs the job, passing on its metrics rows (and, with ``on_event``, its events) as they
    come; returns the coordinator's summary. The first SIGTERM or SIGINT (``ray job stop``,
    Ctrl-C) asks the job to stop at its next interval boundary; a second one stops at once."""
    run_ref = coordinator.run.remote()
    stop.training = True  # from here on, a signal stops at a boundary (and stays so)
    return follow(coordinator, run_ref, on_progress, on_event, stop)


class StopOnSignal:
    """SIGTERM and SIGINT while ``fit`` runs in the main thread (elsewhere it does nothing).

    Before training (Ray starting, data being written, ranks being placed) a signal raises
    :class:`StopRequested` there, and ``fit`` unwinds: an embedded cluster it started is shut
    down whole. While training, the first signal sets ``asked`` (the job stops at its next
    interval boundary) and the second raises KeyboardInterrupt (the job is killed)."""

    def __init__(self) -> None:
        self.asked = False
        self.again = ""  # why the second signal stopped the job at once
        self.training = False
        self._saved: dict[int, Any] = {}

    def _handle(self, signum: int, _frame: Any) -> None:
        if not self.training:
            raise StopRequested(f"stopped on request (signal {signum}) before training started")
        if self.asked:
            self.again = f"signal {signum} again: stopping at once"
            raise KeyboardInterrupt(self.again)
        self.asked = True
        print(
            f"[raytrec] signal {signum}: stopping at the next interval boundary "
            "(send it again to stop at once)",
            flush=True,
        )

    def restore(self) -> None:
        """Takes the signals back (after a library, Ray's driver, installed its own)."""
        for sig in self._saved:
            signal.signal(sig, self._handle)

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._saved[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *_: Any) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)


def follow(
    coordinator: Any,
    run_ref: Any,
    on_progress: Callable[[IntervalMetrics], None],
    on_event: Callable[[Event], None] | None,
    stop: StopOnSignal,
) -> RunSummary:
    seen = seen_events = 0
    stop_sent = False
    try:
        while True:
            if stop.asked and not stop_sent:
                coordinator.request_stop.remote()
                stop_sent = True
            done = _wait(run_ref, stop, stop_sent, seconds=1.0)
            rows = ray.get(coordinator.progress.remote(seen))
            for row in rows:
                on_progress(row)
            seen += len(rows)
            if on_event is not None:
                events = ray.get(coordinator.events_since.remote(seen_events))
                for event in events:
                    on_event(event)
                seen_events += len(events)
            if done:
                return ray.get(run_ref)
    except KeyboardInterrupt as e:
        if stop.again and not str(e):
            # Raised inside a call into Ray, the handler's exception comes out as Ray's own bare
            # KeyboardInterrupt: it is given back its words.
            raise KeyboardInterrupt(stop.again) from None
        raise
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, JobFailedError | ConfigError):
            raise cause from None  # the coordinator's own words, not Ray's wrapper
        raise
    except ray.exceptions.RayActorError as e:
        # Its process was killed (out of memory, ray.kill, a crash) or its node went away:
        # fit starts a new one while elastic.max_coordinator_restarts allows (raytrec.restarts).
        died = CoordinatorDied(f"the coordinator actor died: {e}")
        # One that failed while it was made would fail again: not one to restart.
        died.restartable = not e.actor_init_failed
        raise died from e


def _wait(run_ref: Any, stop: StopOnSignal, stop_sent: bool, *, seconds: float) -> bool:
    """Waits up to ``seconds`` for the job to end (True when it has), in slices of 0.1 s: a
    signal's handler runs in this thread only between two calls into Ray (inside one, Ray looks
    for signals once a second), and two signals that come before it runs reach it as one, so a
    second interrupt sent within a second of the first would not stop the job at once. Returns
    early when a first signal asks for a stop, so that the coordinator hears of it at once."""
    deadline = time.monotonic() + seconds
    while True:
        done, _ = ray.wait([run_ref], timeout=0.1)
        if done:
            return True
        if (stop.asked and not stop_sent) or time.monotonic() >= deadline:
            return False


def release_placement_groups(prefix: str) -> None:
    """Removes the placement groups still held whose name starts with ``prefix`` (a run's)."""
    from ray.util.placement_group import get_placement_group, placement_group_table

    for info in placement_group_table().values():
        name = info.get("name") or ""
        if name.startswith(prefix) and info.get("state") != "REMOVED":
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(get_placement_group(name))


class CoordinatorDied(JobFailedError):
    """The coordinator actor is gone. ``fit`` raises it when no new coordinator may take over
    (``elastic.max_coordinator_restarts``; see docs/fault_tolerance.md)."""

    restartable = True  # False: it failed as it was made (a new one would too)
