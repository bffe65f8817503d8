"""Parquet read by index: every batch of every rank has a fixed place in the data, so it has an
id, it can be read again, and a stream can start at any step.

:class:`~raytrec.data.parquet_plan.BatchPlan` (pure) says which rows make step ``s`` of rank
``r``; that batch's id is :func:`~raytrec.data.synthetic.batch_id` ``(r, s)``, the ids the
coordinator's exactly-once accounting already uses for the synthetic source. Each rank reads its
own steps with a Ray Data pipeline of its own, started in the rank::

    read_datasource(one read task per piece of a row group, in step order)
      -> map_batches(preprocess)       # fused with the read: the streaming mode's CPU stage
      -> iter_batches(whole blocks)    # preserve_order: blocks come in task order

With a shuffle window (``shuffle_window_rows``) a read task is a gather instead
(:mod:`raytrec.data.parquet_gather`): it reads the ranges of row groups that hold the rows of one
window its batches need, at most the window's rows, and takes them in batch order.

A read task opens one file, decodes one row group up to the piece's last row (in record batches
of at most 16,384 rows, so memory stays bounded whatever the row group size) and adds each
row's step, and for error messages its file, row group and index in the file.
``read_concurrency`` bounds the tasks in flight per rank (the read-ahead); Ray Data schedules
them on the CPUs left beside the ranks. The rank regroups the blocks by step (a batch can span
two row groups, so two blocks), drops and counts rows marked as bad, and builds the batch from
the layout the workers wrote (the only conversion on the rank).

:meth:`IndexedParquetShard.replay` runs the same read function and preprocessing on one batch's
rows in the rank's own process (a pipeline's start-up would cost more than one batch), so a
replayed batch is bitwise the batch first read, and bad input in it is named the same way.

A new pipeline delivers nothing for seconds while its first read task starts (a new worker
imports torch); until then the stream's first rows are read in the rank's own process with the
same functions (:mod:`raytrec.data.handover`), so a rank given a new stream at a loss or a join
trains at once.

A batch all of whose rows were skipped as bad (``on_bad_rows="skip"``) stops the stream with a
:class:`~raytrec.data.arrow_kjt.BadInputError`: its step cannot train on no rows (the mean loss
would be NaN), and leaving the step out would shift every later batch's id.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import ray.exceptions

from raytrec.data.arrow_kjt import BadInputError, OnBadRows
from raytrec.data.handover import read_while_starting
from raytrec.data.parquet_gather import Gather
from raytrec.data.parquet_plan import BatchPlan, Piece, Read
from raytrec.data.parquet_streams import (
    Stream,
    stream_batch_size,
    stream_epoch,
    stream_length,
    streams_from_json,
)
from raytrec.data.preprocess import (
    DROP,
    FILE_ROW,
    PATH,
    ROW_GROUP,
    EpochConsumption,
    EpochLog,
    InternalColumns,
    find_bad_input,
    internal_columns_of,
    preprocess_rows,
    take_marked,
)
from raytrec.data.source import Batch, BatchShard
from raytrec.data.spec import FeatureSpec
from raytrec.data.synthetic import batch_id, split_batch_id

__all__ = ["IndexedParquetShard", "read", "read_gather", "read_piece"]

# The column of each row's step, from the read task to the rank.
STEP = "__rt_step"
# Rows per decoded record batch, so per block: bounds a read task's memory (~16 MB of Criteo rows).
_READ_ROWS = 16_384
#: Rows per table of a new stream's first read, in the rank's process: its first batches are
#: ready after that many rows are read and preprocessed, not a whole _READ_ROWS table.
_HEAD_ROWS = 2_048


@dataclasses.dataclass(eq=False, kw_only=True)
class IndexedParquetShard(BatchShard):
    """Rank ``index`` of ``num_shards`` reading ``paths`` by index (see the module doc); built by
    :meth:`raytrec.data.parquet.ParquetSource.split` with ``read_mode="indexed"``. Picklable, and
    any copy reads the same batches (the plan is a pure function of its fields).

    ``row_groups``: the row count of each row group of each file, from the footers.
    ``source_spec``: the user's spec, applied by the preprocessing on Ray Data's workers.
    ``in_process``: read and preprocess in this process, one piece after the other, instead of
    in a Ray Data pipeline: the same functions on the same rows, so the same batches (for tests
    and debugging without a cluster).

    Streams: stream ``r < num_shards`` is rank ``r``'s own batches of the plan (only its first
    ``limit`` when given: the job's share of the data); ``streams`` holds the streams made when
    the job's ranks changed and the rows left were shared among them again
    (:func:`~raytrec.data.parquet_recut.recut`). ``index`` names the stream this shard reads.
    Batch ``k`` of stream ``s`` has id :func:`~raytrec.data.synthetic.batch_id` ``(s, k)``;
    :meth:`replay` reads any batch of any of these streams.
    """

    index: int
    num_shards: int
    filesystem: pafs.FileSystem
    paths: tuple[str, ...]
    row_groups: tuple[tuple[int, ...], ...]
    source_spec: FeatureSpec
    epochs: int
    shuffle_seed: int | None
    on_bad_rows: OnBadRows
    read_concurrency: int
    shuffle_window_rows: int | None = None
    in_process: bool = False
    limit: int | None = None
    streams: dict[int, Stream] = dataclasses.field(default_factory=dict)
    last_row_ids: np.ndarray | None = dataclasses.field(default=None, init=False)
    current_epoch: int = dataclasses.field(default=-1, init=False)
    _log: list[EpochLog] = dataclasses.field(default_factory=list, init=False, repr=False)
    _plans: dict[int, BatchPlan] = dataclasses.field(default_factory=dict, init=False, repr=False)

    replayable = True

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.num_shards and self.index not in self.streams:
            raise ValueError(
                f"index must be in [0, {self.num_shards}) or a stream of streams "
                f"{sorted(self.streams)}, got {self.index!r}"
            )

    @property
    def columns(self) -> InternalColumns:
        """The internal layout the pipeline writes and the rank reads its batches from."""
        return internal_columns_of(self.source_spec)

    def plan(self, batch_size: int) -> BatchPlan:
        """The job's assignment of rows for batches of ``batch_size`` rows (at most)."""
        plan = self._plans.get(batch_size)
        if plan is None:
            plan = BatchPlan(
                paths=self.paths,
                row_groups=self.row_groups,
                num_shards=self.num_shards,
                batch_size=batch_size,
                epochs=self.epochs,
                shuffle_seed=self.shuffle_seed,
                shuffle_window_rows=self.shuffle_window_rows,
            )
            self._plans[batch_size] = plan
        return plan

    def stream(self, batch_size: int, stream_id: int | None = None) -> Stream:
        """The batches of stream ``stream_id`` (default: this shard's own, ``index``)."""
        sid = self.index if stream_id is None else stream_id
        if sid in self.streams:
            return self.streams[sid]
        if not 0 <= sid < self.num_shards:
            raise ValueError(
                f"stream {sid} is not one of this job's: ranks 0..{self.num_shards - 1} and "
                f"re-shared streams {sorted(self.streams)}"
            )
        return self.plan(batch_size).stream(sid, limit=self.limit)

    def with_stream(self, index: int, streams: dict[int, Stream]) -> IndexedParquetShard:
        """This job's data read as stream ``index`` of ``streams`` (after a re-share)."""
        return dataclasses.replace(self, index=index, streams=dict(streams))

    def with_table(self, table: Mapping[str, Any], *, limit: int) -> IndexedParquetShard:
        """This shard with a job's re-shared streams (``Result.reshared_streams``) and its share
        of the plan (``limit``: the job's ``num_steps``), to locate any batch it trained (the
        files of a growing source: the table's, in the order the job found them)."""
        shard = self.with_files_json(table["files"]) if "files" in table else self
        return dataclasses.replace(shard, limit=limit, streams=streams_from_json(table["made"]))

    def frozen_streams(self, batch_size: int) -> dict[int, Stream]:
        """The initial ranks' streams as the plan of these files cuts them (kept when files
        are added, which changes the plan's cuts)."""
        return {sid: self.stream(batch_size, sid) for sid in range(self.num_shards)}

    def with_files(
        self, paths: Sequence[str], row_groups: Sequence[tuple[int, ...]]
    ) -> IndexedParquetShard:
        """This shard over ``paths`` (a growing source's files, old ones first)."""
        return dataclasses.replace(self, paths=tuple(paths), row_groups=tuple(row_groups))

    def files_to_json(self) -> dict[str, Any]:
        return {"paths": list(self.paths), "row_groups": [list(g) for g in self.row_groups]}

    def with_files_json(self, files: Mapping[str, Any]) -> IndexedParquetShard:
        groups = [tuple(int(n) for n in g) for g in files["row_groups"]]
        return self.with_files([str(p) for p in files["paths"]], groups)

    def batch_pieces(self, batch_id: int, batch_size: int) -> list[Piece]:
        """Where the rows of batch ``batch_id`` (of any stream of this job) are in the files."""
        sid, step = split_batch_id(batch_id)
        return self.plan(batch_size).stream_pieces(self.stream(batch_size, sid), step, step + 1)

    def batches(self, batch_size: int, *, start_step: int = 0) -> Iterator[Batch]:
        """Yields this rank's batches from step ``start_step`` on, over every epoch, then ends.

        Every rank has ``plan(batch_size).steps_per_epoch`` batches per epoch, each of at most
        ``batch_size`` rows (fewer where rows were skipped as bad). Each rank's stream is
        independent of the others'.
        """
        return (b for _, b in self.identified_batches(batch_size, start_step=start_step))

    def identified_batches(
        self, batch_size: int, *, start_step: int = 0, ahead: bool = False
    ) -> Iterator[tuple[int | None, Batch]]:
        """As :meth:`batches`, each batch with its id. ``ahead``: the batches are asked for
        later (a stream's continuation, :meth:`BatchFeed.continue_with
        <raytrec.data.feed.BatchFeed.continue_with>`): the pipeline starts now and reads them
        all, so it is delivering when they are due (otherwise it starts at the first batch
        asked for, with the first read in this process)."""
        # Validate eagerly (a generator body would only run on the first next()).
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step!r}")
        plan, stream = self.plan(batch_size), self.stream(batch_size)
        if not ahead:
            return self._stream(plan, stream, start_step)
        blocks = self._pipeline(plan, stream, start_step, ahead=True)
        return _Closing(self._stream(plan, stream, start_step, blocks), blocks)

    def replay(self, batch_id: int, batch_size: int) -> Batch:
        """Batch ``batch_id`` (of any stream of this job) read again: bitwise the batch that
        :meth:`identified_batches` yielded under this id."""
        return self.replay_many([batch_id], batch_size)[0]

    def replay_many(self, batch_ids: Sequence[int], batch_size: int) -> list[Batch]:
        """Batches ``batch_ids`` read again, as :meth:`replay` reads each, in their order. The
        consecutive batches of a stream among them are read in one pass: a read decodes its
        row group from the start, and a lost gang's batches handed to one rank are mostly
        consecutive steps of one stream, in one row group."""
        plan = self.plan(batch_size)
        wanted = sorted({split_batch_id(i) for i in batch_ids})
        read_back: dict[int, Batch] = {}
        for run in _consecutive(wanted):
            sid, first, end = run[0][0], run[0][1], run[-1][1] + 1
            stream = self.stream(batch_size, sid)
            if first < 0 or end > stream_length(stream):
                bad = first if first < 0 else end - 1
                raise ValueError(
                    f"batch id {batch_id(sid, bad)} (stream {sid}, batch {bad}) is not one of "
                    f"this job's: stream {sid} has {stream_length(stream)} batches"
                )
            cutter = _StepCutter(first, functools.partial(stream_batch_size, stream))
            done: list[tuple[int, pa.Table]] = []
            for unit in plan.stream_reads(stream, first, end):
                for table in read(self.filesystem, unit, self.source_spec.required_columns()):
                    done += cutter.feed(self._preprocess(table))
            cutter.finish(end)
            for step, rows in done:
                log = EpochLog(stream_epoch(stream, step), has_ids=False)  # a replay: no read
                read_back[batch_id(sid, step)] = self._convert(plan, stream, sid, step, rows, log)[
                    0
                ]
        return [read_back[i] for i in batch_ids]

    def consumed(self) -> tuple[EpochConsumption, ...]:
        """Per epoch started so far, what this shard yielded (no ``padding`` in this mode, and
        nothing ``discarded``: a stream that starts at a later step does not read the earlier
        ones)."""
        return tuple(log.freeze() for log in self._log)

    # -- reading -----------------------------------------------------------------------------

    def _stream(
        self,
        plan: BatchPlan,
        stream: Stream,
        start_step: int,
        blocks: Iterator[pa.Table] | None = None,
    ) -> Iterator[tuple[int | None, Batch]]:
        cutter = _StepCutter(start_step, functools.partial(stream_batch_size, stream))
        # The stream's last batch of each epoch: where the epoch's log is complete.
        last_of: dict[int, int] = {}
        at = 0
        for part in stream:
            at += part.count
            last_of[part.epoch] = at - 1
        try:
            if blocks is None:
                blocks = self._pipeline(plan, stream, start_step)
            for block in blocks:
                for step, rows in cutter.feed(block):
                    epoch = stream_epoch(stream, step)
                    if epoch != self.current_epoch:
                        self._log.append(
                            EpochLog(epoch, has_ids=self.source_spec.row_id is not None)
                        )
                        self.current_epoch = epoch
                    log = self._log[-1]
                    batch, self.last_row_ids = self._convert(
                        plan, stream, self.index, step, rows, log
                    )
                    log.complete = step == last_of[epoch]
                    yield batch_id(self.index, step), batch
        except ray.exceptions.RayError as e:
            bad = find_bad_input(e)
            if bad is None:
                raise
            raise bad from e
        cutter.finish(max(start_step, stream_length(stream)))

    def _pipeline(
        self, plan: BatchPlan, stream: Stream, start_step: int, *, ahead: bool = False
    ) -> Iterator[pa.Table]:
        """The preprocessed blocks of the stream's batches from ``start_step`` on, in order
        (``ahead``: see :meth:`identified_batches`)."""
        length = stream_length(stream)
        if start_step >= length:
            return iter(())
        pieces = plan.stream_reads(stream, start_step, length)
        columns = self.source_spec.required_columns()

        def in_process(reads: list[Read], rows: int = _READ_ROWS) -> Iterator[pa.Table]:
            return (
                self._preprocess(table)
                for piece in reads
                for table in read(self.filesystem, piece, columns, rows=rows)
            )

        if self.in_process or len(pieces) == 1:
            return in_process(pieces)
        if ahead:  # read when due: by then the pipeline has had time to start
            return read_while_starting(
                in_process(pieces), functools.partial(self._ray_pipeline, pieces)
            )
        # The first read in this process while the pipeline of the others starts (it takes
        # seconds), and more until it delivers: a rank given a new stream trains at once.
        rest = pieces[1:]
        return read_while_starting(
            in_process(rest),
            functools.partial(self._ray_pipeline, rest),
            head=in_process(pieces[:1], rows=_HEAD_ROWS),
        )

    def _ray_pipeline(self, pieces: list[Read]) -> Iterator[pa.Table]:
        """The preprocessed blocks of ``pieces``, in order, read by a Ray Data pipeline."""
        import ray.data  # here, not at the top: a rank on other data never pays its import (~1 s)

        from raytrec.data.executor_pace import pace
        from raytrec.data.parquet_pieces import PieceSource

        columns = self.source_spec.required_columns()
        source = PieceSource(pieces, functools.partial(read, self.filesystem, columns=columns))
        # The same task pool for both stages: Ray Data then fuses them into one task per piece,
        # so no block crosses the object store in between.
        tasks = ray.data.TaskPoolStrategy(size=self.read_concurrency)
        ds = ray.data.read_datasource(
            source,
            compute=tasks,
            override_num_blocks=len(pieces),  # one task per piece: no splitting of its output
        ).map_batches(
            functools.partial(
                _preprocess_piece, spec=self.source_spec, on_bad_rows=self.on_bad_rows
            ),
            batch_format="pyarrow",
            batch_size=None,  # whole blocks: the conversion is vectorized, bigger is cheaper
            zero_copy_batch=True,
            compute=tasks,
        )
        ctx = ds.context  # this dataset's own copy
        ctx.execution_options.preserve_order = True
        # A BadInputError leaves the map task as itself, not as Ray's UserCodeException.
        ctx.raise_original_map_exception = True
        ctx.enable_progress_bars = False  # the job prints its own progress
        ctx.enable_operator_progress_bars = False
        pace(ctx)  # no scheduling loop spinning beside the training thread
        # Read-ahead is the tasks in flight; one block more here keeps the rank's thread fed. (The
        # streaming mode's prefetch_batches counts batches; a block holds up to _READ_ROWS rows.)
        blocks: Iterator[pa.Table] = ds.iter_batches(
            batch_size=None, batch_format="pyarrow", prefetch_batches=1
        )
        return blocks

    def _preprocess(self, table: pa.Table) -> pa.Table:
        return _preprocess_piece(table, spec=self.source_spec, on_bad_rows=self.on_bad_rows)

    def _convert(
        self,
        plan: BatchPlan,
        stream: Stream,
        sid: int,
        step: int,
        rows: pa.Table,
        log: EpochLog,
    ) -> tuple[Batch, np.ndarray | None]:
        """Batch ``step`` of stream ``sid``'s rows (internal layout, marked rows included) as a
        batch, logged in ``log``; and the batch's row ids."""
        layout = self.columns
        kept = take_marked(rows, log, row_id=layout.row_id)
        if kept.num_rows == 0:
            raise _no_rows_left(plan.stream_pieces(stream, step, step + 1), sid, step, rows)
        batch, row_ids = layout.decode(kept)  # checked on the worker: nothing can be bad
        log.batches += 1
        log.rows += kept.num_rows
        if row_ids is not None:
            log.ids.add(row_ids)
        return batch, row_ids


def read(
    fs: pafs.FileSystem, unit: Read, columns: Sequence[str], *, rows: int = _READ_ROWS
) -> Iterator[pa.Table]:
    """The rows of a piece or a gather, as :func:`read_piece` and :func:`read_gather` give them,
    in tables of at most ``rows`` rows."""
    if isinstance(unit, Gather):
        return read_gather(fs, unit, columns, rows=rows)
    return read_piece(fs, unit, columns, rows=rows)


def read_gather(
    fs: pafs.FileSystem, unit: Gather, columns: Sequence[str], *, rows: int = _READ_ROWS
) -> Iterator[pa.Table]:
    """The rows of ``unit`` in its order, with each row's step and place (as
    :func:`read_piece`), in tables of at most ``rows`` rows. Holds the rows of its reads at
    once: at most one shuffle window."""
    tables = []
    for r in unit.reads:
        piece = Piece(r.path, r.row_group, r.start, r.stop, r.file_row, 0, (r.rows,))
        tables += [t.drop_columns([STEP]) for t in read_piece(fs, piece, columns)]
    # Each file's path is its own one-value dictionary: one dictionary for the take.
    taken = pa.concat_tables(tables).unify_dictionaries().take(pa.array(unit.take))
    taken = taken.append_column(STEP, pa.array(unit.steps()))
    for start in range(0, taken.num_rows, rows):
        yield taken.slice(start, rows)


def read_piece(
    fs: pafs.FileSystem, piece: Piece, columns: Sequence[str], *, rows: int = _READ_ROWS
) -> Iterator[pa.Table]:
    """The rows of ``piece`` with the columns ``columns``, and for each row its step, file, row
    group and index in the file; in tables of at most ``rows`` rows."""
    steps = np.repeat(np.arange(piece.step, piece.step + len(piece.counts)), piece.counts)
    try:
        with fs.open_input_file(piece.path) as f:
            reader = pq.ParquetFile(f)
            at = 0  # the row group's row where the next record batch starts
            for rb in reader.iter_batches(
                batch_size=rows,
                row_groups=[piece.row_group],
                columns=list(columns),
                use_threads=False,  # one task per CPU: Ray Data already runs them in parallel
            ):
                lo, hi = max(piece.start - at, 0), min(piece.stop - at, rb.num_rows)
                if hi > lo:
                    first = at + lo - piece.start  # the piece's row at the table's start
                    yield _annotate(rb.slice(lo, hi - lo), piece, first, steps)
                at += rb.num_rows
                if at >= piece.stop:
                    return
    except (pa.ArrowException, OSError) as e:
        detail = f"reading rows {piece.start}..{piece.stop} failed ({type(e).__name__}: {e})"
        raise BadInputError(
            "corrupt_file", detail, file=piece.path, row_group=piece.row_group
        ) from e
    raise BadInputError(  # the footer promised more rows than the row group holds
        "corrupt_file",
        f"row group {piece.row_group} ended before row {piece.stop}",
        file=piece.path,
        row_group=piece.row_group,
    )


def _annotate(rb: pa.RecordBatch, piece: Piece, first: int, steps: np.ndarray) -> pa.Table:
    """``rb`` (the piece's rows from its row ``first`` on) with each row's step and place."""
    n = rb.num_rows
    # The path is one value for the whole piece: a dictionary column costs one index per row.
    path = pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), pa.array([piece.path]))
    start = piece.file_row + first
    extra = {
        PATH: path,
        FILE_ROW: pa.array(np.arange(start, start + n, dtype=np.int64)),
        ROW_GROUP: pa.array(np.full(n, piece.row_group, np.int32)),
        STEP: pa.array(steps[first : first + n]),
    }
    return pa.Table.from_arrays(
        [*rb.columns, *extra.values()], names=[*rb.schema.names, *extra.keys()]
    )


def _preprocess_piece(table: pa.Table, *, spec: FeatureSpec, on_bad_rows: OnBadRows) -> pa.Table:
    """The workers' stage: :func:`~raytrec.data.preprocess.preprocess`, each row keeping its
    step (bad rows, moved after the good ones, too)."""
    out, source_rows = preprocess_rows(table, spec=spec, on_bad_rows=on_bad_rows)
    steps = table.column(STEP)
    if source_rows is not None:
        steps = steps.take(pa.array(source_rows))
    return out.append_column(STEP, steps)


class _StepCutter:
    """Regroups a rank's preprocessed blocks, in order, into its steps' rows. A step is
    complete when it holds as many rows (kept and marked) as the plan gives it."""

    def __init__(self, first_step: int, size_of: Callable[[int], int]) -> None:
        self.step, self.size_of = first_step, size_of
        self.parts: list[pa.Table] = []
        self.have = 0

    def feed(self, table: pa.Table) -> list[tuple[int, pa.Table]]:
        if table.num_rows == 0:
            return []
        steps = table.column(STEP).to_numpy()
        if table.column(DROP).null_count < table.num_rows:
            # Marked rows follow their block's good rows: put each back with its step's rows.
            order = np.argsort(steps, kind="stable")
            table, steps = table.take(pa.array(order)), steps[order]
        starts = np.flatnonzero(np.r_[True, steps[1:] != steps[:-1]])
        done: list[tuple[int, pa.Table]] = []
        for a, b in zip(starts.tolist(), [*starts[1:].tolist(), len(steps)], strict=True):
            step = int(steps[a])
            if step != self.step:
                raise RuntimeError(f"rows of step {step} came while step {self.step} was due")
            self.parts.append(table.slice(a, b - a))
            self.have += b - a
            size = self.size_of(step)
            if self.have > size:
                raise RuntimeError(f"step {step} got {self.have} rows, its batch has {size}")
            if self.have == size:
                parts, self.parts, self.have = self.parts, [], 0
                done.append((step, parts[0] if len(parts) == 1 else pa.concat_tables(parts)))
                self.step += 1
        return done

    def finish(self, end_step: int) -> None:
        """The input ended: every step up to ``end_step`` must have been complete."""
        if self.parts or self.step != end_step:
            raise RuntimeError(
                f"the read ended at step {self.step} ({self.have} rows into it), "
                f"expected the end of step {end_step - 1}"
            )


class _Closing(Iterator[tuple[int | None, Batch]]):
    """``batches``, and closing it closes ``blocks`` too: a pipeline started ahead runs before
    the first batch is asked for, when closing the generator that reads it does nothing."""

    def __init__(
        self, batches: Iterator[tuple[int | None, Batch]], blocks: Iterator[pa.Table]
    ) -> None:
        self._batches, self._blocks = batches, blocks

    def __next__(self) -> tuple[int | None, Batch]:
        return next(self._batches)

    def close(self) -> None:
        for it in (self._batches, self._blocks):
            close = getattr(it, "close", None)
            if callable(close):
                close()


def _consecutive(ids: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Sorted ``(stream, step)`` pairs in runs of consecutive steps of one stream."""
    runs: list[list[tuple[int, int]]] = []
    for sid, step in ids:
        if runs and runs[-1][-1] == (sid, step - 1):
            runs[-1].append((sid, step))
        else:
            runs.append([(sid, step)])
    return runs


def _no_rows_left(pieces: list[Piece], sid: int, step: int, rows: pa.Table) -> BadInputError:
    where = ", ".join(
        f"{p.path} rows {p.file_row}..{p.file_row + p.rows - 1} (row group {p.row_group})"
        for p in pieces
    )
    detail = (
        f"batch {step} of stream {sid} has no rows left: all {rows.num_rows} were skipped as bad "
        f"({where}); a batch read by index keeps its step, and no step trains on no rows "
        "(clean the data: drop or fix those rows)"
    )
    first = pieces[0]
    return BadInputError(
        "no_rows_left", detail, file=first.path, row_group=first.row_group, row=first.file_row
    )
