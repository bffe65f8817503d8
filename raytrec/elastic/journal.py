"""The job's journal: what exactly-once needs, written durably to the run directory (pure).

The coordinator appends one small record at each transition that matters for exactly-once: a
commit (the batch accounting's numbers and committed ranges), a new generation, a checkpoint
saved or restored, a re-share of the data, a rewind to a checkpoint, an injected fault fired.
The driver appends the coordinator's loss and restart. Records are JSON lines in
``journal.jsonl``, each written with one ``write`` and ``fsync``ed, so a record on disk is whole
or is the torn last line of a process killed mid-write, which :func:`read_journal` drops.

When the coordinator's process dies, the driver folds the journal (:func:`replay`) into a
:class:`JournalState`: the newest checkpoint to continue from, what was committed when it died
(the ledger of a job that cannot go on), the restarts so far and the faults already fired.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from raytrec.elastic.events import Event, EventLog
from raytrec.elastic.run_record import RunSummary

__all__ = [
    "JOURNAL_FILE",
    "CheckpointRecorded",
    "CommitRecorded",
    "CoordinatorLostRecorded",
    "CoordinatorRestartedRecorded",
    "CoordinatorStartedRecorded",
    "DataResharedRecorded",
    "FaultFiredRecorded",
    "GenerationRecorded",
    "JournalError",
    "JournalRecord",
    "JournalState",
    "JournalWriter",
    "RewoundRecorded",
    "journal_path",
    "ranges",
    "read_journal",
    "replay",
    "summary_from_journal",
]

JOURNAL_FILE = "journal.jsonl"

Ranges = tuple[tuple[int, int], ...]


class JournalError(RuntimeError):
    """A record inside the journal (not its last line) is unreadable: the file was damaged."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class JournalRecord:
    kind: ClassVar[str] = "record"
    step: int  # the job's completed steps when it was written

    def to_dict(self) -> dict[str, Any]:
        fields = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}
        return {"kind": self.kind, **fields}


@dataclasses.dataclass(frozen=True, kw_only=True)
class CoordinatorStartedRecorded(JournalRecord):
    """A coordinator took the run: ``attempt`` 0 is the first, ``pid`` its process."""

    kind: ClassVar[str] = "coordinator_started"
    attempt: int
    pid: int
    resume_from: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommitRecorded(JournalRecord):
    """A job-wide sync committed what was trained up to ``step`` (the accounting after it)."""

    kind: ClassVar[str] = "commit"
    generation: int
    committed: Ranges  # committed batch ids, merged [start, stop) ranges
    committed_count: int  # with multiplicity
    committed_rows: int | None
    replayed: Ranges
    lost: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationRecorded(JournalRecord):
    kind: ClassVar[str] = "generation"
    generation: int
    gangs: tuple[int, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointRecorded(JournalRecord):
    """A checkpoint of ``step`` is committed at ``uri`` (saved, or the one the job started
    from); ``committed_count``: the batches it holds."""

    kind: ClassVar[str] = "checkpoint"
    uri: str
    committed_count: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataResharedRecorded(JournalRecord):
    """The rows left were shared again among the live ranks: the job's data now ends at
    ``end_step``."""

    kind: ClassVar[str] = "data_reshared"
    end_step: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewoundRecorded(JournalRecord):
    """The job went back to the checkpoint of ``step`` (a rebuild or a resume); what was
    committed after it is trained again (the commit record after it holds the accounting)."""

    kind: ClassVar[str] = "rewound"


@dataclasses.dataclass(frozen=True, kw_only=True)
class FaultFiredRecorded(JournalRecord):
    """The injected fault ``index`` of ``testing.faults`` fired (it fires once per run)."""

    kind: ClassVar[str] = "fault_fired"
    index: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class CoordinatorLostRecorded(JournalRecord):
    kind: ClassVar[str] = "coordinator_lost"
    attempt: int
    reason: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class CoordinatorRestartedRecorded(JournalRecord):
    """Coordinator ``attempt`` continues the run from checkpoint ``uri`` (None: from the start
    of the data with a fresh model)."""

    kind: ClassVar[str] = "coordinator_restarted"
    attempt: int
    uri: str | None


_KINDS: dict[str, type[JournalRecord]] = {
    cls.kind: cls
    for cls in (
        CoordinatorStartedRecorded,
        CommitRecorded,
        GenerationRecorded,
        CheckpointRecorded,
        DataResharedRecorded,
        RewoundRecorded,
        FaultFiredRecorded,
        CoordinatorLostRecorded,
        CoordinatorRestartedRecorded,
    )
}
_RANGES = ("committed", "replayed")


def _plain(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def from_dict(raw: dict[str, Any]) -> JournalRecord:
    cls = _KINDS[raw["kind"]]
    fields = {f.name: raw[f.name] for f in dataclasses.fields(cls) if f.name in raw}
    for name in _RANGES:
        if name in fields:
            fields[name] = tuple((int(a), int(b)) for a, b in fields[name])
    if "gangs" in fields:
        fields["gangs"] = tuple(fields["gangs"])
    return cls(**fields)


def journal_path(run_dir: str) -> str:
    return os.path.join(run_dir, JOURNAL_FILE)


class JournalWriter:
    """Appends records to a run's journal, each with one ``write`` and (``fsync``) an
    ``fsync``. A record written survives the writer's process without it; the ``fsync`` keeps
    it through a crash of the machine too."""

    def __init__(self, run_dir: str, *, fsync: bool = True) -> None:
        os.makedirs(run_dir, exist_ok=True)
        self.path = journal_path(run_dir)
        self.fsync = fsync

    def append(self, record: JournalRecord) -> None:
        line = (json.dumps(record.to_dict(), separators=(",", ":")) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)


def read_journal(run_dir: str) -> list[JournalRecord]:
    """The run's records in order (none when there is no journal). A torn last line (a process
    killed mid-write) is dropped; an unreadable line before it raises :class:`JournalError`."""
    try:
        with open(journal_path(run_dir), "rb") as f:
            lines = f.read().split(b"\n")
    except FileNotFoundError:
        return []
    out: list[JournalRecord] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(from_dict(json.loads(line)))
        except (ValueError, KeyError, TypeError) as e:
            if i == len(lines) - 1:  # no newline after it: the torn end of a killed write
                break
            raise JournalError(
                f"{journal_path(run_dir)}: record {i + 1} is unreadable ({e}); the journal "
                "was damaged"
            ) from None
    return out


@dataclasses.dataclass(frozen=True)
class JournalState:
    """What the journal says of a run, folded from its records (:func:`replay`)."""

    step: int = 0  # the job's step at its last record
    commit: CommitRecorded | None = None  # the accounting at the last commit
    checkpoint: CheckpointRecorded | None = None  # the newest checkpoint committed
    generations: int = 0  # generations started, over every coordinator of the run
    attempt: int = 0  # the newest coordinator's attempt
    restarts: int = 0  # coordinators started after a loss
    fired: frozenset[int] = frozenset()  # indices of the faults already fired

    @property
    def rolled_back(self) -> int:
        """Batches committed after the newest checkpoint: a restart from it trains them again."""
        done = self.commit.committed_count if self.commit is not None else 0
        return max(0, done - (self.checkpoint.committed_count if self.checkpoint else 0))


def replay(records: Iterable[JournalRecord]) -> JournalState:
    """Folds ``records`` (in order) into the run's :class:`JournalState`."""
    s = JournalState()
    for r in records:
        s = dataclasses.replace(s, step=r.step)
        match r:
            case CommitRecorded():
                s = dataclasses.replace(s, commit=r)
            case CheckpointRecorded():
                s = dataclasses.replace(s, checkpoint=r)
            case GenerationRecorded():
                s = dataclasses.replace(s, generations=s.generations + 1)
            case FaultFiredRecorded(index=index):
                s = dataclasses.replace(s, fired=s.fired | {index})
            case CoordinatorStartedRecorded(attempt=attempt):
                s = dataclasses.replace(s, attempt=attempt)
            case CoordinatorRestartedRecorded():
                s = dataclasses.replace(s, restarts=s.restarts + 1)
    return s


def summary_from_journal(
    state: JournalState, history: list[Any], events: list[Event], *, wall_s: float
) -> RunSummary:
    """What a job whose coordinator is gone had committed, from its journal: the ledger's
    batches and rows, and the checkpoint to resume from; ``history``, ``events``: what the
    driver saw. No final model, no replica check."""
    commit = state.commit
    return RunSummary(
        history=list(history),
        final_state_path=None,
        steps=state.step if commit is None else commit.step,
        wall_s=wall_s,
        ranks=[],
        state_digests={},
        events=EventLog(events),
        generation=max(0, state.generations - 1),
        committed_batches=[] if commit is None else list(commit.committed),
        committed_count=0 if commit is None else commit.committed_count,
        committed_rows=None if commit is None else commit.committed_rows,
        replayed_batches=[] if commit is None else list(commit.replayed),
        lost_batches=0 if commit is None else commit.lost,
        checkpoint=None if state.checkpoint is None else state.checkpoint.uri,
    )


def ranges(pairs: Sequence[tuple[int, int]]) -> Ranges:
    """Batch id ranges as a record holds them."""
    return tuple((int(a), int(b)) for a, b in pairs)
