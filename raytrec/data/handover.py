"""A new stream's first rows read in the rank's process while its Ray Data pipeline starts.

A rank opens a new stream at the job's start and every time the job's ranks change (the rows
left are shared again, :mod:`actors.reshare`). A new Ray Data pipeline delivers nothing until
its first read task has run, and that can take seconds (a new worker process imports torch and
the preprocessing before its first row) and on a loaded machine tens of seconds: every rank of
the job would wait for it at the first step after a loss or a join.

:func:`read_while_starting` covers that time. It starts the pipeline on a thread, gives the
stream's first read (its ``head``) from the rank's own process, and, until the pipeline's first
block arrives, goes on reading the pipeline's rows in process too, with the same read and
preprocessing functions (as a replayed batch is read). Both produce the same rows in the same
order, so once the pipeline has a block ready it skips the rows already read in process and
goes on from there. The pipeline starts after the head rather than where the handover happens
(which is not known when it starts): it reads nothing twice when it starts within the head's
time, and otherwise skips what the rank read after the head.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Generator, Iterable, Iterator

import pyarrow as pa

__all__ = ["read_while_starting"]

#: How long the pipeline's thread waits to hand over a block before it checks whether the
#: reader stopped.
_PUT_POLL_S = 0.1
#: Blocks the pipeline's thread holds ready beyond the one the reader takes next.
_READY_BLOCKS = 2


class _End:
    pass


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def read_while_starting(
    in_process: Iterator[pa.Table],
    start_pipeline: Callable[[], Iterator[pa.Table]],
    *,
    head: Iterable[pa.Table] = (),
    name: str = "raytrec-pipeline-start",
) -> Iterator[pa.Table]:
    """The tables of ``head``, then those of ``in_process`` until the pipeline that
    ``start_pipeline`` returns (started on a thread now) has its first block, then the
    pipeline's, from the first row not yet given out. ``in_process`` and the pipeline must give
    the same rows in the same order (module doc); a pipeline that ends before the rows read in
    process is an error. Closing the returned iterator stops the pipeline's thread at its next
    block."""
    ready: queue.Queue[pa.Table | _End | _Failed] = queue.Queue(maxsize=_READY_BLOCKS)
    stop = threading.Event()

    def run() -> None:
        blocks: Iterator[pa.Table] | None = None
        item: pa.Table | _End | _Failed
        try:
            blocks = start_pipeline()
            for block in blocks:
                if not _hand_over(block):
                    return
            item = _End()
        except BaseException as e:  # raised again by the reader, in its own thread
            item = _Failed(e)
        finally:
            close = getattr(blocks, "close", None)
            if stop.is_set() and close is not None:
                close()  # shuts the pipeline down here, in the thread that iterated it
        _hand_over(item)

    def _hand_over(item: pa.Table | _End | _Failed) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=_PUT_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()  # now, not at the first row asked for
    return _Reading(_read(head, in_process, ready, stop), stop)


class _Reading(Iterator[pa.Table]):
    """:func:`_read`'s tables; closing it stops the pipeline's thread even when no table was
    asked for yet (a generator that never started runs no ``finally`` on ``close``)."""

    def __init__(self, tables: Generator[pa.Table, None, None], stop: threading.Event) -> None:
        self._tables, self._stop = tables, stop

    def __next__(self) -> pa.Table:
        return next(self._tables)

    def close(self) -> None:
        self._tables.close()
        self._stop.set()


def _read(
    head: Iterable[pa.Table],
    in_process: Iterator[pa.Table],
    ready: queue.Queue[pa.Table | _End | _Failed],
    stop: threading.Event,
) -> Generator[pa.Table, None, None]:
    given = 0  # rows given out from the in-process reads of the pipeline's rows
    try:
        yield from head
        while ready.empty():
            try:
                table = next(in_process)
            except StopIteration:
                return  # every row was read in process: the pipeline is not needed
            given += table.num_rows
            yield table
        close = getattr(in_process, "close", None)
        if close is not None:
            close()
        while True:
            item = ready.get()
            if isinstance(item, _Failed):
                raise item.error
            if isinstance(item, _End):
                if given:
                    raise RuntimeError(
                        f"the data pipeline ended {given} rows before the rows already read "
                        "in process"
                    )
                return
            if given >= item.num_rows:
                given -= item.num_rows
                continue
            yield item.slice(given) if given else item
            given = 0
    finally:
        stop.set()
