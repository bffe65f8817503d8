"""A rank's batch feed: a background thread that keeps the next batches ready.

Training pulls batches in chunks. :meth:`BatchFeed.prepare` waits until the next ``n`` batches
are in memory (or the source failed or ended), so a rank learns about bad input or the end of
its data *before* it enters the chunk's collectives: the coordinator asks every rank to prepare,
and only when all are ready does any of them train. A rank that would otherwise fail half way
through a chunk would leave its gang (and its replica group) blocked in a collective until the
timeout; this way the whole job stops at a step boundary with its state intact.

Meanwhile the thread keeps the buffer filled up to the last ``prepare``'s ``n`` plus ``prefetch``
batches, so loading the next chunk overlaps training on this one.

:meth:`BatchFeed.continue_with` changes what comes after a point of the source without closing
it: the rank's stream grew after a loss (:func:`raytrec.data.parquet_recut.take_over`), and what
the feed holds before that point, replays included, stays where it is; the new source starts
reading a while before the point is reached.

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
from collections.abc import Callable, Iterator
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
        self._name = name
        self._thread: threading.Thread | None = None
        # What an item the thread pulled while the source was changed must pass to be kept.
        self._changes = 0
        self._keep: Callable[[T], bool] = lambda _item: True
        self._running = False  # the thread pulls (it stops at the source's end, or an error)
        if background:
            self._start_thread()

    @property
    def background(self) -> bool:
        return self._thread is not None

    def _start_thread(self) -> None:
        self._running = True
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # Every way out says so under the lock, with what stopped it: continue_with starts a
        # thread again only when none pulls (two would pull one generator at once).
        while True:
            with self._cond:
                while len(self._buffer) >= self._want and not self._closed:
                    self._cond.wait()
                closed = self._closed
                if closed:
                    self._running = False
                source, changes = self._source, self._changes
            if closed:  # here, by the only thread that pulls it: a pipeline behind it stops
                _close(source)
                return
            try:
                item = next(source)
            except StopIteration:
                with self._cond:
                    if self._changes != changes:
                        continue  # the source was continued meanwhile: pull the new one
                    self._ended = True
                    self._running = False  # with _ended: continue_with sees both or neither
                    self._cond.notify_all()
                return
            except BaseException as e:  # delivered to the training thread by prepare()
                with self._cond:
                    self._error, self._running = e, False
                    self._cond.notify_all()
                return
            with self._cond:
                if self._changes == changes or self._keep(item):
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

    def continue_with(
        self,
        keep: Callable[[T], bool],
        then: Callable[[], Iterator[T]],
        *,
        soon: Callable[[T], bool] | None = None,
    ) -> None:
        """From the first item of the source that ``keep`` refuses on, the items of ``then()``
        instead. Those buffered that ``keep`` refuses are dropped (the items it keeps must come
        before the others in the source); the source is closed where the feed reaches the
        first it refuses, or its end. ``then`` is called (its reading starts) at the first item
        kept that ``soon`` takes, so that it is delivering when its items are due without
        reading beside the source all along; at once without ``soon``. A source that failed
        stays failed."""
        with self._cond:
            if self._error is not None or self._closed:
                return
            self._buffer = collections.deque(item for item in self._buffer if keep(item))
            first = None if self._ended else self._source
            now = soon is None or first is None or any(soon(item) for item in self._buffer)
            self._source = _Continued(first, keep, then, soon=None if now else soon)
            self._keep, self._changes, self._ended = keep, self._changes + 1, False
            if self._thread is not None and not self._running:
                self._start_thread()  # it had stopped at the source's end
            self._cond.notify_all()

    def buffered(self) -> int:
        with self._cond:
            return len(self._buffer)

    def close(self) -> None:
        """Stops the thread at its next batch boundary (it is a daemon: it never blocks exit),
        where it closes the source; an inline feed closes its source now (a generator's
        ``close``). So a data pipeline behind it shuts down then rather than whenever, or
        during, the process's exit."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            pulled = self._running  # else no thread pulls the source: it is closed here
        if not pulled:
            _close(self._source)


class _Continued(Iterator[T]):
    """The items of ``first`` while ``keep`` takes them, then those of ``then()``: called at
    the first item of ``first`` that ``soon`` takes (now, without ``soon``), or when
    ``first`` has no more."""

    def __init__(
        self,
        first: Iterator[T] | None,
        keep: Callable[[T], bool],
        then: Callable[[], Iterator[T]],
        *,
        soon: Callable[[T], bool] | None,
    ) -> None:
        self._first, self._keep, self._soon = first, keep, soon
        self._make: Callable[[], Iterator[T]] | None = then
        self._then: Iterator[T] | None = None
        if soon is None:
            self._start()

    def _start(self) -> Iterator[T]:
        if self._make is not None:
            self._then, self._make = self._make(), None
        assert self._then is not None
        return self._then

    def __next__(self) -> T:
        if self._first is not None:
            try:
                item = next(self._first)
            except StopIteration:
                self._close_first()
            else:
                if self._keep(item):
                    if self._make is not None and self._soon is not None and self._soon(item):
                        self._start()
                    return item
                self._close_first()
        return next(self._start())

    def _close_first(self) -> None:
        first, self._first = self._first, None
        _close(first)

    def close(self) -> None:
        self._close_first()
        self._make = None
        _close(self._then)


def _close(source: object) -> None:
    """Closes ``source`` if it can be (a generator: its ``finally`` runs now)."""
    close = getattr(source, "close", None)
    if callable(close):
        close()
