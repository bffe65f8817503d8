"""Exactly-once accounting of training rows across failures.

Each gang reads rows named by ids (``0 .. N-1`` within an epoch). Rows a gang consumed since
its last completed replica sync are *pending*: their effect lives only in that gang's copy of
the embedding shards. When the gang completes a sync, its copy is averaged into every replica,
so its pending rows become *committed*. When a gang is dropped, its pending rows (and any replay
rows it had been given but not yet read) go to a replay pool that is split among the surviving
gangs (:func:`raytrec.elastic.rows.split_balanced`: balanced by row count, whole ranges where
possible, deterministic). A survivor reads its replay share before fresh rows.

:meth:`DataLedger.check_exactly_once` proves, per epoch, that every id was committed exactly
once, returning the missing and the duplicated ids. Rows that went through replay are listed by
:meth:`DataLedger.replayed`. When the dense parameters are averaged across gangs every step
(rather than on the sync schedule), the lost gang had already put most of these rows' dense
gradients into every survivor: those are replayed for their embedding rows only
(:mod:`~raytrec.elastic.dense`, :meth:`~raytrec.elastic.accounting.BatchAccounting.plan_drop`).

Pending rows are kept as an unmerged list, so a row consumed twice by one gang shows up as a
duplicate at commit rather than being silently merged away.

:meth:`DataLedger.snapshot` and :meth:`DataLedger.rewind` take the ledger back to a sync
boundary (a checkpoint): what was committed after it is forgotten, because the model it was
committed into is gone and those rows will be trained again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from raytrec.elastic.rows import Range, RowRanges, coverage, layered, split_balanced

__all__ = ["DataLedger", "ExactlyOnce", "LedgerError", "ReplayPlan"]


class LedgerError(ValueError):
    """A ledger call that names an unknown gang, epoch or row."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExactlyOnce:
    """The result of an exactly-once check over one epoch."""

    epoch: int
    rows: int
    committed: int  # with multiplicity
    missing: RowRanges
    duplicated: RowRanges

    @property
    def ok(self) -> bool:
        return not self.missing and not self.duplicated and self.committed == self.rows


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplayPlan:
    """Where the rows of dropped gangs go: survivor gang id -> epoch -> rows to replay."""

    dropped: tuple[int, ...]
    shares: Mapping[int, Mapping[int, RowRanges]]
    # The survivors whose pending rows go too, and every row handed back (each once, by epoch).
    rolled_back: tuple[int, ...] = ()
    rows: tuple[tuple[int, Range], ...] = ()

    def rows_of(self, gang_id: int) -> int:
        return sum(r.count for r in self.shares.get(gang_id, {}).values())

    @property
    def total_rows(self) -> int:
        return sum(self.rows_of(g) for g in self.shares)


def _by_epoch(items: Iterable[tuple[int, Range]]) -> dict[int, RowRanges]:
    grouped: dict[int, list[Range]] = {}
    for epoch, r in items:
        grouped.setdefault(epoch, []).append(r)
    return {e: RowRanges(tuple(rs)) for e, rs in sorted(grouped.items())}


class DataLedger:
    """Pending, committed and replay rows per gang; see the module doc."""

    def __init__(self, rows_per_epoch: int, gang_ids: Iterable[int]) -> None:
        if isinstance(rows_per_epoch, bool) or not isinstance(rows_per_epoch, int):
            raise LedgerError(f"rows_per_epoch must be an int, got {rows_per_epoch!r}")
        if rows_per_epoch < 1:
            raise LedgerError(f"rows_per_epoch must be >= 1, got {rows_per_epoch}")
        self.rows_per_epoch = rows_per_epoch
        self._pending: dict[int, list[tuple[int, Range]]] = {}
        self._replay: dict[int, dict[int, RowRanges]] = {}
        self._committed: dict[int, list[Range]] = {}
        self._replayed: dict[int, list[Range]] = {}
        self.add_gangs(gang_ids)

    # -- changes ------------------------------------------------------------------------------

    def add_gangs(self, gang_ids: Iterable[int]) -> None:
        """New gangs start with nothing pending and nothing to replay."""
        for g in gang_ids:
            if g in self._pending:
                raise LedgerError(f"gang {g} is already in the ledger")
            self._pending[g] = []
            self._replay[g] = {}

    def consume(self, gang_id: int, epoch: int, rows: RowRanges) -> None:
        """Gang ``gang_id`` trained on ``rows`` of ``epoch`` (not yet synced)."""
        self._gang(gang_id)
        if epoch < 0:
            raise LedgerError(f"epoch must be >= 0, got {epoch}")
        if rows.ranges and rows.ranges[-1][1] > self.rows_per_epoch:
            raise LedgerError(
                f"gang {gang_id} consumed rows up to {rows.ranges[-1][1] - 1}, but an epoch has "
                f"ids 0..{self.rows_per_epoch - 1}"
            )
        self._pending[gang_id].extend((epoch, r) for r in rows.ranges)
        due = self._replay[gang_id].get(epoch)
        if due is not None:
            left = due.difference(rows)
            if left:
                self._replay[gang_id][epoch] = left
            else:
                del self._replay[gang_id][epoch]

    def commit(self, gang_ids: Iterable[int]) -> int:
        """The gangs completed a replica sync: their pending rows are committed. Returns the
        number of rows committed."""
        n = 0
        for g in gang_ids:
            for epoch, r in self._pending_of(g):
                self._committed.setdefault(epoch, []).append(r)
                n += r[1] - r[0]
            self._pending[g] = []
        return n

    def drop(
        self, gang_ids: Iterable[int], survivors: Sequence[int], *, rolled_back: Iterable[int] = ()
    ) -> ReplayPlan:
        """Drops gangs; their pending and unread replay rows are split among ``survivors``
        (taken in the given order; the first ones get the extra row when the split is uneven).
        The pending rows of the survivors in ``rolled_back`` (their model copies were replaced,
        so what they trained since their last sync is in no replica) go into the split too.
        :meth:`plan_drop`, then :meth:`apply_drop`."""
        plan = self.plan_drop(gang_ids, survivors, rolled_back=rolled_back)
        self.apply_drop(plan)
        return plan

    def plan_drop(
        self, gang_ids: Iterable[int], survivors: Sequence[int], *, rolled_back: Iterable[int] = ()
    ) -> ReplayPlan:
        """What :meth:`drop` would do, the ledger unchanged."""
        dropped = tuple(sorted(set(gang_ids)))
        back = tuple(sorted(set(rolled_back)))
        for g in dropped:
            self._gang(g)
        for g in survivors:
            self._gang(g)
            if g in dropped:
                raise LedgerError(f"gang {g} cannot both be dropped and survive")
        for g in back:
            if g not in survivors:
                raise LedgerError(f"gang {g} rolls back but is not among the survivors")
        pool: dict[int, list[Range]] = {}
        for g in dropped:
            for epoch, r in self._pending[g]:
                pool.setdefault(epoch, []).append(r)
            for epoch, rows in self._replay[g].items():
                pool.setdefault(epoch, []).extend(rows.ranges)
        for g in back:
            for epoch, r in self._pending[g]:
                pool.setdefault(epoch, []).append(r)
        # A row a dropped gang read twice is replayed once: the pool is a set.
        items = [(epoch, r) for epoch in sorted(pool) for r in RowRanges(tuple(pool[epoch])).ranges]
        if items and not survivors:
            raise LedgerError(
                f"dropping gangs {list(dropped)} leaves no survivor to replay their "
                f"{sum(b - a for _, (a, b) in items)} pending rows"
            )
        shares: dict[int, Mapping[int, RowRanges]] = {}
        if survivors:
            for g, share in zip(survivors, split_balanced(items, len(survivors)), strict=True):
                shares[g] = _by_epoch(share)
        return ReplayPlan(dropped=dropped, shares=shares, rolled_back=back, rows=tuple(items))

    def apply_drop(self, plan: ReplayPlan) -> None:
        """Carries out a plan of :meth:`plan_drop`, made on the ledger as it is now."""
        for g in plan.rolled_back:
            self._pending[g] = []
        for g in plan.dropped:
            del self._pending[g], self._replay[g]
        for epoch, r in plan.rows:
            self._replayed.setdefault(epoch, []).append(r)
        for g, got in plan.shares.items():
            for epoch, rows in got.items():
                self._replay[g][epoch] = self._replay[g].get(epoch, RowRanges()).union(rows)

    def assign_replay(self, gang_id: int, epoch: int, rows: RowRanges) -> None:
        """Rows ``gang_id`` is to read before fresh ones (a replay share restored with it)."""
        self._gang(gang_id)
        if rows:
            self._replay[gang_id][epoch] = self._replay[gang_id].get(epoch, RowRanges()).union(rows)

    # -- back to a sync boundary ------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Committed and replayed rows per epoch as JSON (each multiset kept: a row committed
        twice stays twice). Taken at a sync boundary, where no gang has pending rows."""
        pending = {g: self.pending_rows(g) for g in self.gang_ids if self._pending[g]}
        if pending:
            raise LedgerError(
                f"a snapshot is taken at a sync boundary, but gangs {sorted(pending)} have "
                f"pending rows ({pending})"
            )

        def by_epoch(rows: dict[int, list[Range]]) -> dict[str, list[list[int]]]:
            return {str(e): [list(r) for r in layered(rs)] for e, rs in sorted(rows.items())}

        return {"committed": by_epoch(self._committed), "replayed": by_epoch(self._replayed)}

    def rewind(self, snapshot: Mapping[str, Any], gang_ids: Iterable[int]) -> None:
        """Back to ``snapshot``: its committed and replayed rows; ``gang_ids`` are the gangs
        now, each with nothing pending and nothing to replay (:meth:`assign_replay` adds that)."""

        def ranges(key: str) -> dict[int, list[Range]]:
            return {int(e): [(int(a), int(b)) for a, b in rs] for e, rs in snapshot[key].items()}

        self._committed = ranges("committed")
        self._replayed = ranges("replayed")
        self._pending, self._replay = {}, {}
        self.add_gangs(gang_ids)

    # -- queries ------------------------------------------------------------------------------

    @property
    def gang_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self._pending))

    def pending(self, gang_id: int) -> dict[int, RowRanges]:
        """Epoch -> rows the gang consumed since its last completed sync."""
        return _by_epoch(self._pending_of(gang_id))

    def pending_rows(self, gang_id: int) -> int:
        """Pending rows of the gang, counted with multiplicity."""
        return sum(b - a for _, (a, b) in self._pending_of(gang_id))

    def replay_due(self, gang_id: int) -> dict[int, RowRanges]:
        """Epoch -> replay rows assigned to the gang and not read yet."""
        self._gang(gang_id)
        return dict(sorted(self._replay[gang_id].items()))

    def committed(self, epoch: int) -> RowRanges:
        """Rows of ``epoch`` committed at least once."""
        return RowRanges(tuple(self._committed.get(epoch, ())))

    def committed_rows(self, epoch: int) -> int:
        """Rows of ``epoch`` committed, counted with multiplicity."""
        return sum(b - a for a, b in self._committed.get(epoch, ()))

    def replayed(self, epoch: int) -> RowRanges:
        """Rows of ``epoch`` that were handed back for replay after their gang was dropped."""
        return RowRanges(tuple(self._replayed.get(epoch, ())))

    def check_exactly_once(self, epoch: int) -> ExactlyOnce:
        """Whether every id of ``epoch`` was committed exactly once."""
        committed = self._committed.get(epoch, [])
        missing, duplicated = coverage(committed, total=self.rows_per_epoch)
        return ExactlyOnce(
            epoch=epoch,
            rows=self.rows_per_epoch,
            committed=sum(b - a for a, b in committed),
            missing=missing,
            duplicated=duplicated,
        )

    # -- helpers ------------------------------------------------------------------------------

    def _gang(self, gang_id: int) -> None:
        if gang_id not in self._pending:
            raise LedgerError(
                f"gang {gang_id} is not in the ledger; known gangs: {list(self.gang_ids)}"
            )

    def _pending_of(self, gang_id: int) -> list[tuple[int, Range]]:
        self._gang(gang_id)
        return self._pending[gang_id]
