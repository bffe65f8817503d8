"""A rank's held-out batches (raytrec.eval_plan), read once in the rank's life and kept.

Every evaluation scores the same held-out batches, and reading one decodes its row group from
the start: seconds on a loaded machine, which every gang waits for at the evaluation's boundary.
So a rank keeps each batch it read, and the coordinator has it read the batches its next
evaluation will score ahead of time (:meth:`HeldOutBatches.read_ahead`), on a background thread,
after the job starts and after each membership change.

Each batch is one :class:`~concurrent.futures.Future`, claimed by whoever reads it first: the
background thread, or an evaluation that needs a batch the thread has not reached yet (it reads
it itself rather than wait behind the others). An evaluation that needs a batch being read waits
for that read instead of reading it twice. A read that failed in the background is not kept: the
evaluation that needs the batch reads it again itself, and raises what that read raises (a bad
row group names its file, as any read of it does).

Only a held-out set read by index (:class:`~raytrec.data.parquet_indexed.IndexedParquetShard`
without re-shared streams) is kept; other sources are read at each evaluation, as they come.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TypeGuard

from raytrec.data.parquet_indexed import IndexedParquetShard
from raytrec.data.source import Batch, BatchShard

__all__ = ["HeldOutBatches", "keeps_held_out"]

Key = tuple[object, ...]


def keeps_held_out(shard: BatchShard) -> TypeGuard[IndexedParquetShard]:
    """Whether a rank keeps (and so can read ahead) the held-out batches of ``shard``."""
    return isinstance(shard, IndexedParquetShard) and not shard.streams


def _key(shard: IndexedParquetShard, batch_id: int, batch_size: int) -> Key:
    return (
        shard.paths, shard.row_groups, shard.index, shard.num_shards, shard.epochs,
        shard.shuffle_seed, shard.shuffle_window_rows, shard.limit, batch_id, batch_size,
    )  # fmt: skip


class HeldOutBatches:
    """The held-out batches one rank read or is reading (module doc)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._batches: dict[Key, Future[Batch]] = {}
        self._queue: queue.SimpleQueue[tuple[BatchShard, int, int, Future[Batch]] | None] = (
            queue.SimpleQueue()
        )
        self._reader: threading.Thread | None = None
        self._closed = False

    def read_ahead(self, shard: BatchShard, batch_ids: Sequence[int], batch_size: int) -> None:
        """Starts reading batches ``batch_ids`` of ``shard`` in the background, those not read
        or being read yet, in their order; returns at once. Does nothing for a shard whose
        batches are not kept (:func:`keeps_held_out`)."""
        if not keeps_held_out(shard):
            return
        with self._lock:
            if self._closed:
                return
            for b in batch_ids:
                key = _key(shard, b, batch_size)
                if key not in self._batches:
                    future: Future[Batch] = Future()
                    self._batches[key] = future
                    self._queue.put((shard, b, batch_size, future))
            if self._reader is None:
                self._reader = threading.Thread(
                    target=self._read_queued, name="held-out-reader", daemon=True
                )
                self._reader.start()

    def get(self, shard: BatchShard, batch_id: int, batch_size: int) -> Batch:
        """Held-out batch ``batch_id``: the one kept, or the one being read once it is read,
        else read here (and kept). Raises what reading it raises."""
        if not keeps_held_out(shard):
            return shard.replay(batch_id, batch_size)
        key = _key(shard, batch_id, batch_size)
        with self._lock:
            future = self._batches.setdefault(key, Future())
            mine = self._claim(future)
        if mine:
            _read(shard, batch_id, batch_size, future)
        try:
            return future.result()
        except BaseException:
            with self._lock:  # not kept: the next evaluation reads it again
                if self._batches.get(key) is future:
                    del self._batches[key]
            if mine:
                raise
        # Read in the background, and that read failed: read it here, raising what it raises.
        return self.get(shard, batch_id, batch_size)

    def close(self) -> None:
        """Stops the background reads (one under way ends on its own: the thread is a daemon);
        a batch never read is read by the evaluation that needs it."""
        with self._lock:
            self._closed = True
        self._queue.put(None)

    def _claim(self, future: Future[Batch]) -> bool:
        """Whether the caller reads ``future``'s batch: no one started it (under the lock)."""
        if future.running() or future.done():
            return False
        return future.set_running_or_notify_cancel()

    def _read_queued(self) -> None:
        while (item := self._queue.get()) is not None:
            shard, batch_id, batch_size, future = item
            with self._lock:
                if self._closed:
                    return
                mine = self._claim(future)
            if mine:
                _read(shard, batch_id, batch_size, future)


def _read(shard: BatchShard, batch_id: int, batch_size: int, future: Future[Batch]) -> None:
    try:
        future.set_result(shard.replay(batch_id, batch_size))
    except BaseException as e:  # the caller of get() raises it, whichever thread read
        future.set_exception(e)
