"""The coordinator's side of the job's journal (:mod:`raytrec.elastic.journal`).

:class:`CoordinatorJournal` sees every outcome the loop applies (:meth:`Coordinator.apply
<actors.coordinator.Coordinator.apply>`, the one place the job's shared state changes) and
appends a record when it changed what exactly-once needs: the committed batches, the generation,
the checkpoint to go back to, where the data ends after a re-share, a rewind. It also carries out
the ``kill_coordinator`` faults of ``testing.faults``: at the first booking at or after the
fault's step it journals that the fault fired (so the coordinator that takes over does not fire
it again) and SIGKILLs its own process, as the OOM killer would.

The outcomes that change only the uncommitted part of the batch accounting
(:data:`~actors.job.AccountingOutcome`: ranks added or lost, gangs dropped from the books,
streams switched) are not journaled: a coordinator that takes over goes back to a checkpoint,
whose snapshot holds the accounting, and what they change in the counts (lost batches, replays)
reaches the journal with the next commit record.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

from actors.job import (
    AccountingOutcome,
    AccountingRewound,
    Booked,
    Committed,
    DataEnds,
    JobRecord,
    Outcome,
    PointSaved,
    Rebuilt,
    Rewound,
)
from raytrec.elastic.faults import FaultConfig, FaultKind
from raytrec.elastic.journal import (
    CheckpointRecorded,
    CommitRecorded,
    CoordinatorStartedRecorded,
    DataResharedRecorded,
    FaultFiredRecorded,
    GenerationRecorded,
    JournalWriter,
    RewoundRecorded,
    ranges,
    read_journal,
    replay,
)

__all__ = ["CoordinatorJournal"]


def _sigkill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class CoordinatorJournal:
    """Journals the job's transitions as the loop applies them (module doc). ``fsync``: each
    record is synced to disk; ``kill``: what a ``kill_coordinator`` fault does (SIGKILL this
    process)."""

    def __init__(
        self,
        run_dir: str,
        *,
        faults: FaultConfig,
        resume_from: str | None,
        fsync: bool = True,
        kill: Callable[[], None] = _sigkill_self,
    ) -> None:
        self.writer = JournalWriter(run_dir, fsync=fsync)
        past = replay(read_journal(run_dir))
        self.attempt = past.restarts
        self.kill = kill  # a simulation's in-process coordinator raises instead
        self._kills = {
            i: f.step
            for i, f in enumerate(faults.faults)
            if f.kind is FaultKind.KILL_COORDINATOR and i not in past.fired
        }
        self._generation: int | None = None
        self._committed: tuple[object, ...] | None = None
        self._end_step: int | None = None
        self.writer.append(
            CoordinatorStartedRecorded(
                step=0, attempt=self.attempt, pid=os.getpid(), resume_from=resume_from
            )
        )

    def applied(self, outcome: Outcome, job: JobRecord) -> None:
        """Journals what ``outcome``, just applied to ``job``, changed; fires a due fault."""
        if isinstance(outcome, AccountingOutcome):
            return  # nothing the journal keeps (module doc)
        m = job.membership
        match outcome:
            case PointSaved(point):
                # The checkpoint's accounting (DataLedger.snapshot): its committed ranges, each
                # layer once, so their lengths add up to the count with multiplicity.
                held = point.accounting.get("committed", {}).get("0", ())
                count = sum(int(b) - int(a) for a, b in held)
                self.writer.append(
                    CheckpointRecorded(step=point.step, uri=point.uri, committed_count=count)
                )
            case Rewound() | Rebuilt() | AccountingRewound():
                self.writer.append(RewoundRecorded(step=job.step))
            case DataEnds(end_step) if end_step != self._end_step:
                self._end_step = end_step
                self.writer.append(DataResharedRecorded(step=job.step, end_step=end_step))
        if m.generation != self._generation:
            self._generation = m.generation
            self.writer.append(
                GenerationRecorded(step=job.step, generation=m.generation, gangs=m.gang_ids)
            )
        if isinstance(outcome, Booked | Committed | Rewound | Rebuilt | AccountingRewound):
            self._commit(job)
        if isinstance(outcome, Booked):
            self._fire_due(outcome.step)

    def _commit(self, job: JobRecord) -> None:
        acc = job.accounting
        key = (acc.committed_count(), acc.lost_batches, job.membership.generation)
        if key == self._committed:
            return
        self._committed = key
        self.writer.append(
            CommitRecorded(
                step=job.step,
                generation=job.membership.generation,
                committed=ranges(acc.committed()),
                committed_count=acc.committed_count(),
                committed_rows=acc.committed_rows if acc.streams is not None else None,
                replayed=ranges(acc.replayed()),
                lost=acc.lost_batches + acc.replay_pending(),
            )
        )

    def _fire_due(self, step: int) -> None:
        for index, at in sorted(self._kills.items()):
            if step >= at:
                del self._kills[index]
                self.writer.append(FaultFiredRecorded(step=step, index=index))
                self.kill()
