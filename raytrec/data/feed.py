"""A rank's batch feed: a background thread that keeps the next batches ready.

Training pulls batches in chunks. :meth:`BatchFeed.prepare` waits until the next ``n`` batches
are in memory (or the source failed or ended), so a rank learns about bad input or the end of
its data *before* it enters the chunk's collectives: the coordinator asks every rank to prepare,
and only when all are ready does any of them train. A rank that would otherwise fail half way
through a chunk would leave its gang (and its replica group) blocked in a collective until the
timeout; this way the whole job stops at a step boundary with its state intact.

Meanwhile the thread keeps the buffer filled up to the last ``prepare``'s ``n`` plus ``prefetch``
batches, so loading the next chunk overlaps training on this one.

With ``background=False`` there is no thread: :meth:`~BatchFeed.prepare` pulls the batches itself.
Same guarantees, no overlap. That is the better choice on CPU ranks: there the thread only
competes with training for the rank's cores, and it runs at moments of its own, so it delays
one rank now, another later, and every delay stalls the whole gang in its next collective
(measured in docs/benchmarks.md). On a GPU rank the CPU is idle while the GPU computes, and the
thread fills that time.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterator
from typing import Generic, TypeVar

__all__ = ["BatchFeed", "DataExhausted"]

T = TypeVar("T")


class DataExhausted(RuntimeError):
    """The source ended before the batches asked for."""


class BatchFeed(Generic[T]):
    """Pulls ``source`` on a daemon thread into a bounded buffer; see the module doc."""

    def __init__(
        self,
        source: Iterator[T],
        *,
        prefetch: int,
        background: bool = True,
        name: str = "raytrec-feed",
    ) -> None:
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch!r}")
        self._source = source
        self._prefetch = prefetch
        self._want = prefetch  # the thread fills the buffer up to this many batches
        self._buffer: collections.deque[T] = collections.deque()
        self._error: BaseException | None = None
        self._ended = False
        self._closed = False
        self._cond = threading.Condition()
        self.taken = 0  # batches handed to training so far
        self.wait_s = 0.0  # time prepare() spent waiting for (or, inline, pulling) batches
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    @property
    def background(self) -> bool:
        return self._thread is not None

    def _run(self) -> None:
        while True:
            with self._cond:
                while len(self._buffer) >= self._want and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
            try:
                item = next(self._source)
            except StopIteration:
                with self._cond:
                    self._ended = True
                    self._cond.notify_all()
                return
            except BaseException as e:  # delivered to the training thread by prepare()
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
                return
            with self._cond:
                self._buffer.append(item)
                self._cond.notify_all()

    def prepare(self, n: int, *, timeout_s: float | None = None) -> float:
        """Waits until ``n`` batches are buffered; returns the seconds waited.

        Raises the source's own exception if it failed before the ``n``-th batch, and
        :class:`DataExhausted` if it ended before it.
        """
        start = time.perf_counter()
        if self._thread is None:
            self._pull(n)
            waited = time.perf_counter() - start
            self.wait_s += waited
            return waited
        deadline = None if timeout_s is None else start + timeout_s
        with self._cond:
            # Read ahead by one chunk of this size (plus prefetch) from now on.
            self._want = n + self._prefetch
            self._cond.notify_all()
            while len(self._buffer) < n:
                if self._error is not None:
                    raise self._error
                if self._ended:
                    raise DataExhausted(
                        f"the data source ended after {self.taken + len(self._buffer)} batches"
                    )
                left = None if deadline is None else deadline - time.perf_counter()
                if left is not None and left <= 0:
                    raise TimeoutError(f"waited {timeout_s}s for {n} batches")
                self._cond.wait(timeout=left)
        waited = time.perf_counter() - start
        self.wait_s += waited
        return waited

    def _pull(self, n: int) -> None:
        """Inline: pulls the source until ``n`` batches are buffered (no read-ahead beyond)."""
        if self._error is not None:
            raise self._error
        while len(self._buffer) < n:
            if self._ended:
                raise DataExhausted(
                    f"the data source ended after {self.taken + len(self._buffer)} batches"
                )
            try:
                item = next(self._source)
            except StopIteration:
                self._ended = True
                continue
            except BaseException as e:
                self._error = e  # raised again by every later prepare(), as the thread's is
                raise
            self._buffer.append(item)

    def take(self) -> T:
        """The next buffered batch (call :meth:`prepare` first)."""
        with self._cond:
            if not self._buffer:
                raise RuntimeError("take() without a prepared batch; call prepare(n) first")
            item = self._buffer.popleft()
            self.taken += 1
            self._cond.notify_all()
            return item

    def push_front(self, items: list[T]) -> None:
        """Puts ``items`` ahead of everything buffered (batches handed over for replay)."""
        with self._cond:
            self._buffer.extendleft(reversed(items))
            self._cond.notify_all()

    def buffered(self) -> int:
        with self._cond:
            return len(self._buffer)

    def close(self) -> None:
        """Stops the thread at its next batch boundary (it is a daemon: it never blocks exit).
        An inline feed closes its source now (a generator's ``close``), so a data pipeline
        behind it shuts down here rather than whenever, or during, the process's exit."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        close = getattr(self._source, "close", None)
        if self._thread is None and callable(close):
            close()
