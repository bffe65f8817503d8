"""The driver keeps a job through the loss of its coordinator.

:class:`CoordinatorSeat` holds the job's coordinator actor while ``fit`` follows it. When the
actor dies (its process killed, by the OOM killer, a defect that takes the process down or
``ray.kill``) and ``elastic.max_coordinator_restarts`` allows, the driver reads the run's journal
(:mod:`raytrec.elastic.journal`), releases what the lost coordinator held and starts a new one on
the same run directory, resuming from the newest checkpoint the journal names.

The rank actors are created by the coordinator, so Ray's ownership makes them die with it (fate
sharing): the new coordinator does not re-attach to them, it places and builds the job again
and loads the checkpoint, through the same resume that ``fit(resume_from_checkpoint=...)`` runs.
The checkpoint holds the batch accounting, so the batches committed after it are trained and
committed again and every batch is counted once in the ledger. Without a checkpoint the new
coordinator starts from the beginning of the data with a fresh model, which is exactly-once too.
The metrics rows and events of every coordinator go on in one stream, with ``coordinator_lost``
and ``coordinator_restarted`` between them, all on one clock: the seat's, which every coordinator
it starts is given (``origin``), so an event the driver books (a loss) and the rows and events of
the coordinators before and after it are times of the same clock.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import ray

from raytrec.driver import CoordinatorDied, drive
from raytrec.elastic.events import CoordinatorLost, CoordinatorRestarted, Event, EventLog
from raytrec.elastic.journal import (
    CoordinatorLostRecorded,
    CoordinatorRestartedRecorded,
    JournalState,
    JournalWriter,
    read_journal,
    replay,
)
from raytrec.elastic.run_record import RunSummary
from raytrec.elastic.workers import Clock, SystemClock

__all__ = ["CoordinatorSeat", "GiveUp", "Restart", "restart_decision"]


@dataclasses.dataclass(frozen=True)
class Restart:
    """Start coordinator ``attempt`` from checkpoint ``uri`` of ``step`` (None: from the
    start); ``rolled_back``: batches committed after it, trained again."""

    attempt: int
    uri: str | None
    step: int
    rolled_back: int


@dataclasses.dataclass(frozen=True)
class GiveUp:
    reason: str


def restart_decision(
    state: JournalState,
    *,
    restarts_done: int,
    max_restarts: int,
    resumed_from: str | None,
    stop_asked: bool,
) -> Restart | GiveUp:
    """Whether the driver starts a new coordinator after losing one, and from where (pure).
    ``resumed_from``: the checkpoint the run itself started from (when the lost coordinator
    journaled no checkpoint, not even that one)."""
    checkpoint = state.checkpoint
    uri = checkpoint.uri if checkpoint is not None else resumed_from
    resume = (
        f"; fit(..., resume_from_checkpoint={uri!r}) resumes from its checkpoint"
        if uri is not None
        else "; no checkpoint was saved, so a new run starts over"
    )
    if stop_asked:
        return GiveUp(f"the coordinator's process died after a stop was asked{resume}")
    if restarts_done >= max_restarts:
        return GiveUp(
            f"the coordinator's process died {restarts_done + 1} time(s), more than "
            f"elastic.max_coordinator_restarts={max_restarts} allows{resume}"
        )
    return Restart(
        attempt=restarts_done + 1,
        uri=uri,
        step=checkpoint.step if checkpoint is not None else 0,
        rolled_back=state.rolled_back,
    )


class CoordinatorSeat:
    """The job's coordinator, and the ones that take over when it dies (module doc).

    ``start(resume_from, attempt)`` creates a coordinator actor whose clock is this seat's:
    times measured from ``origin`` on ``clock`` (its monotonic time; the driver's and the
    coordinator's processes share it, on one node). ``release()`` gives back what a lost one
    held (its placement groups). Rows and events go to ``on_row``/``on_event``."""

    def __init__(
        self,
        start: Callable[[str | None, int], Any],
        *,
        run_dir: str,
        max_restarts: int,
        resume_from: str | None,
        on_row: Callable[[Any], None],
        on_event: Callable[[Event], None],
        release: Callable[[], None],
        clock: Clock | None = None,
        origin: float | None = None,
    ) -> None:
        self._start, self._release = start, release
        self._on_row, self._on_event = on_row, on_event
        self.run_dir, self.max_restarts, self.resumed_from = run_dir, max_restarts, resume_from
        self.restarts = 0
        self.clock: Clock = clock or SystemClock()
        self.origin = self.clock.monotonic() if origin is None else origin
        self._elapsed = 0.0  # when the current coordinator started, on the seat's clock
        self._generations_before = 0  # generations of the lost coordinators
        self.current = start(resume_from, 0)

    def now(self) -> float:
        """The seat's clock: seconds since ``origin``."""
        return round(self.clock.monotonic() - self.origin, 3)

    def row(self, row: Any) -> None:
        # A coordinator's elapsed_s counts from its own start: the time before it is added,
        # so that the time left, taken from the pace of the last rows, stays sound.
        self._on_row(dataclasses.replace(row, elapsed_s=row.elapsed_s + self._elapsed))

    def event(self, event: Event) -> None:
        self._on_event(event)

    def drive(self, stop: Any) -> RunSummary:
        """Follows the job (:func:`raytrec.driver.drive`) through every coordinator it takes;
        returns the last one's summary (see :meth:`merged`)."""
        while True:
            try:
                return drive(self.current, self.row, self.event, stop)
            except CoordinatorDied as e:
                if not e.restartable:
                    raise
                self.lost(e, stop_asked=stop.asked)

    def journal(self) -> JournalState:
        return replay(read_journal(self.run_dir))

    def lost(self, error: BaseException, *, stop_asked: bool) -> None:
        """The coordinator died: starts the next one (as :func:`restart_decision` says), or
        raises ``error`` with the reason when the job cannot go on."""
        state = self.journal()
        decision = restart_decision(
            state,
            restarts_done=self.restarts,
            max_restarts=self.max_restarts,
            resumed_from=self.resumed_from,
            stop_asked=stop_asked,
        )
        now = self.now()
        reason = " ".join(str(error).split())[:300]
        left = max(0, self.max_restarts - self.restarts - (isinstance(decision, Restart)))
        self._on_event(
            CoordinatorLost(
                at=now, step=state.step, attempt=self.restarts, reason=reason, restarts_left=left
            )
        )
        writer = JournalWriter(self.run_dir)
        writer.append(
            CoordinatorLostRecorded(step=state.step, attempt=self.restarts, reason=reason)
        )
        self.retire()
        if isinstance(decision, GiveUp):
            raise CoordinatorDied(f"{decision.reason} (the last loss: {reason})") from error
        self.restarts = decision.attempt
        self._generations_before = state.generations
        writer.append(
            CoordinatorRestartedRecorded(
                step=decision.step, attempt=decision.attempt, uri=decision.uri
            )
        )
        self._elapsed = self.now()
        self.current = self._start(decision.uri, decision.attempt)
        self._on_event(
            CoordinatorRestarted(
                at=self._elapsed,
                step=decision.step,
                attempt=decision.attempt,
                uri=decision.uri,
                checkpoint_step=decision.step,
                rolled_back_batches=decision.rolled_back,
            )
        )

    def retire(self) -> None:
        """Ends the current coordinator (if it still runs) and releases what it held."""
        if isinstance(self.current, ray.actor.ActorHandle):
            with contextlib.suppress(Exception):
                ray.kill(self.current)
        self._release()

    def merged(self, summary: RunSummary, seen_rows: list[Any], seen_events: list[Event]) -> Any:
        """``summary`` of the current coordinator with what the lost ones did before it: every
        metrics row and event the driver saw (on one clock) and every generation."""
        if not self.restarts:
            return summary
        return dataclasses.replace(
            summary,
            history=list(seen_rows),
            events=EventLog(seen_events),
            generation=self._generations_before + summary.generation,
            wall_s=self.now(),
        )
