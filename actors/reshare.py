"""The coordinator's re-sharing of the rows left to train when the job's ranks change.

Parquet read by index (:class:`~raytrec.data.parquet_indexed.IndexedParquetShard`) gives the job
a fixed set of rows: per epoch, every initial rank's first ``num_steps`` batches of the plan.
When a gang is lost, the rows its ranks had not taken yet would otherwise never be read; when a
gang joins, it would have nothing to read. So at every membership change the coordinator takes
the rows no live rank has trained, from every stream (live ranks' at their position, lost ranks'
at the batch after the last one they took, whose uncommitted ones are replayed by id), and cuts
them again among the ranks of the new membership (:func:`~raytrec.data.parquet_recut.recut`).
Each rank then reads a new stream, with an id of its own, so every batch keeps a unique id and
can still be replayed; the table of these streams travels to every rank (any rank may have to
replay any batch) and into checkpoints. Where it can, a change leaves streams running instead:
a join hands the joining ranks the ends of the others' streams (cut short), and a loss appends
the rows left to the survivors' streams after their current parts (longer, under the same ids:
the batches a survivor has not reached yet are the only ones that change).

Every rank gets the same number of batches to train (replays counted), so the ranks, which
train in lockstep, all reach the end of the data at the same step: the job's last step
(``end_step``), later than ``num_steps`` after a loss and sooner after a gain. Over the job,
every row is trained into the model exactly once.

Sources that cannot cut their rows again (the synthetic one, endless; Parquet streamed through
``streaming_split``) are not re-shared: their ranks keep their streams (a joining gang continues
a lost rank's synthetic stream instead).

A part of the job with state of its own (the table of streams), which also rewinds the streams
to a checkpoint (a resume, or a rebuild after a total loss). It sees the job through
:class:`StreamsPorts`; the end step and the accounting it changes are outcomes
(:class:`~actors.job.DataEnds`, :class:`~actors.job.AccountingRewound`,
:class:`~actors.job.StreamSwitched`, ...) the loop applies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from actors.job import (
    AccountingRewound,
    DataEnds,
    RanksAdded,
    StreamsContinued,
    StreamsRetired,
    StreamSwitched,
)
from actors.ports import HasEvents, HasRankCalls, HasRanksInGangOrder, HasShared
from raytrec.data.growing import first_batch_from, shareable
from raytrec.data.parquet_indexed import IndexedParquetShard
from raytrec.data.parquet_recut import hand_off, recut, take_over
from raytrec.data.parquet_streams import (
    Stream,
    remaining_rows,
    stream_length,
    streams_from_json,
    streams_to_json,
)
from raytrec.data.source import BatchShard
from raytrec.elastic.accounting import BatchAccounting
from raytrec.elastic.events import DataReshared
from raytrec.elastic.rollback import StreamStart, plan_streams
from raytrec.errors import JobFailedError

__all__ = ["DataStreams", "StreamTable", "StreamsPorts"]


class StreamTable:
    """The job's streams of a re-shareable source: the initial ranks' own (from the plan, the
    first ``num_steps`` batches) and those made by re-sharing, by id."""

    def __init__(
        self, template: IndexedParquetShard, *, batch_size: int, growing: bool = False
    ) -> None:
        self.template = template
        self.batch_size = batch_size
        self.made: dict[int, Stream] = {}
        self.next_id = template.num_shards
        self.growing = growing  # files are added while the job runs: they are saved too

    def stream(self, sid: int) -> Stream:
        made = self.made.get(sid)
        # An initial rank's stream comes from the template's plan (built once, cached there).
        return made if made is not None else self.template.stream(self.batch_size, sid)

    def length(self, sid: int) -> int:
        return stream_length(self.stream(sid))

    def shard(self, sid: int) -> IndexedParquetShard:
        """The shard a rank reads stream ``sid`` with (it can replay every stream so far)."""
        return self.template.with_stream(sid, self.made)

    def placeholder(self, _rank: int) -> IndexedParquetShard:
        """The shard a rank of a gang being built starts with: nothing to read until it joins
        and is given its share."""
        return dataclasses.replace(self.template, index=0, limit=0, streams=dict(self.made))

    def add(self, streams: Sequence[Stream]) -> list[int]:
        ids = list(range(self.next_id, self.next_id + len(streams)))
        self.made.update(zip(ids, streams, strict=True))
        self.next_id += len(streams)
        return ids

    def grow(self, paths: Sequence[str], row_groups: Sequence[tuple[int, ...]]) -> tuple[int, int]:
        """Adds files after the job's others (:mod:`raytrec.data.growing`); returns their rows'
        range of the row space. The initial ranks' streams, cut from the plan of the files
        before, are kept as they were cut."""
        self.made = self.template.frozen_streams(self.batch_size) | self.made
        before = self.template.plan(self.batch_size).rows_per_epoch
        self.template = self.template.with_files(
            self.template.paths + tuple(paths), self.template.row_groups + tuple(row_groups)
        )
        return before, self.template.plan(self.batch_size).rows_per_epoch

    def to_json(self) -> dict[str, Any]:
        made = streams_to_json(self.made)
        saved = {"num_shards": self.template.num_shards, "next_id": self.next_id, "made": made}
        if self.growing:
            saved["files"] = self.template.files_to_json()
        return saved

    def load(self, saved: Mapping[str, Any]) -> None:
        """Back to a checkpoint's table (its streams are the ones its positions name)."""
        self.made = streams_from_json(saved["made"])
        self.next_id = int(saved["next_id"])
        if "files" in saved:  # a growing source: the files in the order the job found them
            self.template = self.template.with_files_json(saved["files"])


class StreamsPorts(HasRankCalls, HasEvents, HasShared, HasRanksInGangOrder, Protocol):
    """The ports :class:`DataStreams` calls."""


class DataStreams:
    """Where every rank reads (module doc): the table of re-shared streams of a re-shareable
    source, re-sharing the rows left when the ranks change, and rewinding the streams to a
    checkpoint. ``shards``: the job's initial data shards; ``new_shard``: job rank -> the shard
    of a rank added later (None: the source makes none); ``stream_id``: names a batch (None:
    the source cannot)."""

    def __init__(
        self,
        job: StreamsPorts,
        table: StreamTable | None,
        *,
        shards: Sequence[BatchShard] = (),
        new_shard: Callable[[int], BatchShard] | None = None,
        stream_id: Callable[[int, int], int] | None = None,
        batch_size: int = 0,
    ) -> None:
        self.job = job
        self.table = table
        self.shards = shards
        self.new_shard = new_shard
        self.stream_id = stream_id
        self.batch_size = batch_size

    def reshare(
        self,
        ranks: Sequence[int],
        *,
        joining: Sequence[int] = (),
        landed: tuple[int, int] | None = None,
        fed: bool = False,
    ) -> list[int]:
        """Shares the rows no rank has trained among ``ranks`` (gang order; ``joining``: those
        of them that join now and are not booked yet); returns the ranks given a new stream.

        At a join where the others have as many batches left and no rows are orphaned, they
        keep reading their streams, cut short, and the joining ranks get the rows of their ends
        (:func:`~raytrec.data.parquet_recut.hand_off`): only the joining ranks are returned.
        Otherwise every row left is cut again among all of ``ranks`` and every one is given its
        new stream, after the replays queued for it (read again: a new stream starts a new
        feed). Empty when nothing was re-shared (the source cannot be, or every live rank
        already has as many batches left and no rows are orphaned): queued replays are then
        still to be sent. ``landed``: rows of files just found (:meth:`grow`), cut among the
        ranks with the others left. ``fed``: every rank's feed already holds the replays queued
        for it (a loss: the re-form handed them over); the ranks then read on to the end of
        the part of their stream they are in, and the rows after that are dealt out and
        appended to their streams (:func:`~raytrec.data.parquet_recut.take_over`), so no
        pipeline stops and the replays are not read again."""
        table = self.table
        streams = self.job.view.accounting.streams
        if table is None or streams is None:
            return []
        remaining: dict[int, list[tuple[int, int]]] = {}

        def add(sid: int, at: int) -> None:
            for epoch, runs in remaining_rows(table.stream(sid), at).items():
                remaining.setdefault(epoch, []).extend(runs)

        queued, left = [], set()
        for r in ranks:
            if r in joining:
                queued.append(0)
                continue
            sid, at, replay = streams.position(r)
            add(sid, at)
            queued.append(len(replay))
            left.add(len(replay) + table.length(sid) - at)
        retired = streams.retired()
        orphaned = False
        for sid, at in retired.items():
            orphaned |= at < table.length(sid)
            add(sid, at)
        if landed is not None:
            remaining.setdefault(0, []).append(landed)
        elif not joining and not orphaned and len(left) == 1:
            # Every row left is some live rank's, and all have as many batches left: their
            # streams stay as they are (and so do the ids of the batches still to come).
            self.job.apply(DataEnds(self.job.view.step + left.pop()))
            return []
        if landed is None and joining and not orphaned and self._hand_off(ranks, joining):
            return list(joining)
        if fed and landed is None and not joining and self._take_over(ranks, retired):
            return list(ranks)
        shared = recut(remaining, queued=queued, batch_size=table.batch_size)
        if landed is not None and shared.left_over:
            # grow() adds files only when no replay is queued and the rows give every rank a
            # batch (growing.shareable), where recut leaves nothing over.
            raise JobFailedError(f"{shared.left_over} rows of new files could not be shared")
        ids = table.add(shared.streams)
        # Every old stream's rows are given out: none is continued where it stopped.
        self.job.apply(StreamsRetired({sid: table.length(sid) for sid in retired}))
        replays: dict[int, list[int]] = {}
        for r, sid in zip(ranks, ids, strict=True):
            if r in joining:
                self.job.apply(RanksAdded({r: sid}, self.job.view.step))
                replays[r] = []
            else:
                old, _, queued_ids = streams.position(r)
                replays[r] = list(queued_ids)
                self.job.apply(StreamSwitched(r, shard=sid, old_ends_at=table.length(old)))
        new_stream = dict(zip(ranks, ids, strict=True))
        acc = self.job.view.accounting
        self.job.call(
            list(ranks),
            lambda w, r: w.set_shard(
                table.shard(new_stream[r]), replays[r], acc.embedding_only(replays[r])
            ),
        )
        # Equal for every rank, unless the rows left cannot even out the replays queued (a loss
        # at the very end of the data): the job then ends with the shortest rank, and the
        # replays beyond it stay untrained, counted in Result.lost_batches.
        batches = min(q + stream_length(s) for q, s in zip(queued, shared.streams, strict=True))
        self._ends_after(batches, len(ranks), _rows(remaining), left_over=shared.left_over)
        return list(ranks)

    def grow(
        self, paths: Sequence[str], row_groups: Sequence[tuple[int, ...]]
    ) -> tuple[int, int] | None:
        """Adds new files to the job's data and shares their rows, with the rows left, among
        the live ranks (every one gets a new stream); returns the rows added and the first
        of the new streams' batches (counted from now) that trains some of them, or None when the
        files wait for a later boundary: replays are queued (they come before any new stream,
        and rows could be left over), or the rows are too few to give every rank a batch."""
        table, acc = self.table, self.job.view.accounting
        streams = acc.streams
        assert table is not None and streams is not None, "a growing source is read by index"
        ranks = self.job.ranks_in_gang_order()
        rows_left = 0
        for r in ranks:
            sid, at, replay = streams.position(r)
            if replay:
                return None
            rows_left += sum(
                b - a for runs in remaining_rows(table.stream(sid), at).values() for a, b in runs
            )
        rows = sum(sum(g) for g in row_groups)
        if not shareable(rows + rows_left, ranks=len(ranks), batch_size=table.batch_size):
            return None
        landed = table.grow(paths, row_groups)
        self.reshare(ranks, landed=landed)
        new = [table.stream(sid) for sid in range(table.next_id - len(ranks), table.next_id)]
        firsts = [j for s in new if (j := first_batch_from(s, landed[0])) is not None]
        return rows, min(firsts)

    def _hand_off(self, ranks: Sequence[int], joining: Sequence[int]) -> bool:
        """The join of :meth:`reshare` that leaves the others' streams running; False when the
        rows left do not allow it."""
        table, streams = self.table, self.job.view.accounting.streams
        assert table is not None and streams is not None
        staying = [r for r in ranks if r not in joining]
        positions = {r: streams.position(r) for r in staying}
        plan = hand_off(
            [(table.stream(sid), at, len(q)) for sid, at, q in positions.values()],
            joining=len(joining),
            batch_size=table.batch_size,
        )
        if plan is None:
            return False
        for (sid, _, _), stream in zip(positions.values(), plan.kept, strict=True):
            table.made[sid] = stream  # the same batches, ending sooner
        new_stream = dict(zip(joining, table.add(plan.streams), strict=True))
        self.job.apply(RanksAdded(new_stream, self.job.view.step))
        # The others learn the new streams (any rank may have to replay any batch).
        made = dict(table.made)
        self.job.call(staying, lambda w, _r: w.set_streams(made))
        self.job.call(list(joining), lambda w, r: w.set_shard(table.shard(new_stream[r]), [], []))
        self._ends_after(plan.batches, len(joining), plan.rows, handed_off=True)
        return True

    def _take_over(self, ranks: Sequence[int], retired: Mapping[int, int]) -> bool:
        """The loss of :meth:`reshare` that leaves the survivors' streams running, longer;
        False when the rows left do not allow it."""
        table, streams = self.table, self.job.view.accounting.streams
        assert table is not None and streams is not None
        orphaned: dict[int, list[tuple[int, int]]] = {}
        for sid, at in retired.items():
            for epoch, runs in remaining_rows(table.stream(sid), at).items():
                orphaned.setdefault(epoch, []).extend(runs)
        positions = {r: streams.position(r) for r in ranks}
        plan = take_over(
            [(table.stream(sid), at, len(q)) for sid, at, q in positions.values()],
            orphaned,
            batch_size=table.batch_size,
        )
        if plan is None:
            return False
        keep = {}
        for r, stream, end in zip(ranks, plan.streams, plan.keep, strict=True):
            sid = positions[r][0]
            table.made[sid] = stream  # the same batches up to ``end``, more after them
            keep[r] = end
        self.job.apply(StreamsRetired({sid: table.length(sid) for sid in retired}))
        self.job.call(
            list(ranks), lambda w, r: w.extend_stream(table.shard(positions[r][0]), keep[r])
        )
        self._ends_after(plan.batches, len(ranks), _rows(orphaned), taken_over=True)
        return True

    def _ends_after(self, batches: int, ranks: int, rows: int, **how: Any) -> None:
        """The data now ends ``batches`` steps from here; a ``data_reshared`` event says so
        (``how``: its ``left_over``, ``handed_off`` or ``taken_over``)."""
        self.job.apply(DataEnds(self.job.view.step + batches))
        self.job.record(
            DataReshared(
                at=self.job.now(),
                step=self.job.view.step,
                ranks=ranks,
                rows=rows,
                batches=batches,
                end_step=self.job.view.end_step,
                **how,
            )
        )

    def rewind_to(
        self,
        snapshot: Mapping[str, Any],
        *,
        order: Sequence[int],
        gang_ids: Sequence[int],
        step: int,
    ) -> dict[int, StreamStart]:
        """The batch accounting back to ``snapshot`` (a checkpoint's) for gangs ``gang_ids``, and
        where each rank of ``order`` (gang order) reads from there on; add the ranks with
        ``add_rank`` (placing them does), then :meth:`_continue_streams`."""
        spare = [getattr(shard, "index", t) for t, shard in enumerate(self.shards)]
        if self.table is not None and "streams_table" in snapshot:
            self.table.load(snapshot["streams_table"])
            # More ranks than saved streams and spare shards: the others start with nothing to
            # read, and the re-share that follows gives every rank its part of the rows left.
            live = {int(s) for s, _, _ in snapshot["streams"]["live"]}
            have = len(live) + len([s for s in spare if s not in live])
            spare += self.table.add([()] * max(0, len(order) - have))
        plan = plan_streams(
            snapshot["streams"], num_ranks=len(order), spare_shards=spare, step=step
        )
        rewound = BatchAccounting.rewound(
            snapshot, gang_ids=gang_ids, stream_id=self.stream_id, batch_size=self.batch_size
        )
        self.job.apply(AccountingRewound(rewound))
        return dict(zip(order, plan, strict=True))

    def continue_streams(
        self, starts: Mapping[int, StreamStart], *, gang_of: Callable[[int], int], step: int
    ) -> None:
        """Books each rank as reading from ``starts`` at job step ``step``."""
        gangs = {r: gang_of(r) for r in starts}
        self.job.apply(StreamsContinued(dict(starts), gangs, step))

    def queue_replays(self, starts: Mapping[int, StreamStart]) -> None:
        """Hands each rank the unread replay batches of the stream it continues."""
        replay = {r: list(s.replay) for r, s in starts.items() if s.replay}
        acc = self.job.view.accounting
        if replay:
            self.job.call(
                sorted(replay), lambda w, r: w.replay(replay[r], acc.embedding_only(replay[r]))
            )

    def shard_of(self, index: int) -> BatchShard:
        """The data shard with this index: one of the job's initial shards, or a new one."""
        if self.table is not None:
            return self.table.shard(index)
        for t, shard in enumerate(self.shards):
            if getattr(shard, "index", t) == index:
                return shard
        if self.new_shard is None:
            raise JobFailedError(f"no data shard {index} to continue after a rebuild")
        return self.new_shard(index)

    def ran_out(self, step: int, num_steps: int, epochs: int) -> RuntimeError | None:
        """Why a job that ended at ``step`` trained fewer than ``num_steps`` steps: its data
        held fewer batches per rank (every row trained once); None when it did not."""
        table = self.table
        per_rank = None if table is None else table.template.plan(table.batch_size).num_steps
        if per_rank is None or per_rank >= num_steps:
            return None
        return RuntimeError(
            f"the data source ran out after {step} steps: its {epochs} epoch(s) hold "
            f"{per_rank} batches per rank, fewer than num_steps={num_steps} (every row was "
            "trained once); lower num_steps or raise data.epochs"
        )

    def make_room_for_replays(self) -> None:
        """Replays come before a rank's own batches: after a loss in the last steps the job
        goes on until every live rank has trained the replays it holds (an endless source;
        a re-shared one sets its end when it shares the rows out)."""
        streams = self.job.view.accounting.streams
        if streams is None or self.table is not None:
            return
        most = max((len(streams.position(r)[2]) for r in self.job.live_ranks()), default=0)
        self.job.apply(DataEnds(max(self.job.view.end_step, self.job.view.step + most)))


def _rows(runs_by_epoch: Mapping[int, Sequence[tuple[int, int]]]) -> int:
    return sum(b - a for runs in runs_by_epoch.values() for a, b in runs)
