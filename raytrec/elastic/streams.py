"""Which batches each rank trains next, as the coordinator sees it.

A rank takes batches from its feed in a fixed order: batches handed to it for replay first (the
ones handed last first, as its feed pushes them to its front), then its own stream (batch ``k``
of its shard is ``stream_id(shard, k)``). The coordinator mirrors that order here, fed by the
ranks' reports of what they trained. When a rank dies in the middle of an interval its report
is lost with it, but the batches it took are still known: the next ones in this order, one per
step it was given. Those are what its gang consumed since its last sync, and what the survivors
replay.

A removed rank's shard is remembered with its position (:meth:`RankStreams.retired`): batches
before it were all taken, so a rank that continues that shard later starts there.

Pure code: no Ray, no torch.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

__all__ = ["RankStreams", "StreamError", "StreamPositions"]


class StreamError(RuntimeError):
    """A rank reported a batch other than the one its stream order says comes next."""


class StreamPositions(Protocol):
    """:class:`RankStreams`, read only: where each rank stands."""

    def position(self, rank: int) -> tuple[int, int, tuple[int, ...]]: ...
    def retired(self) -> dict[int, int]: ...
    def shards(self) -> set[int]: ...


class RankStreams:
    """Per rank: queued replay ids, then its own stream (see the module doc)."""

    def __init__(self, stream_id: Callable[[int, int], int]) -> None:
        self._stream_id = stream_id
        self._shard: dict[int, int] = {}
        self._next: dict[int, int] = {}  # own-stream batches taken so far
        self._replay: dict[int, collections.deque[int]] = {}
        self._retired: dict[int, int] = {}  # shard of a removed rank -> its next own batch

    def add_rank(self, rank: int, *, shard: int) -> None:
        if rank in self._shard:
            raise StreamError(f"rank {rank} is already tracked")
        self._shard[rank] = shard
        self._next[rank] = 0
        self._replay[rank] = collections.deque()
        self._retired.pop(shard, None)  # live again

    def remove_rank(self, rank: int) -> None:
        self._retired[self._shard[rank]] = self._next[rank]
        del self._shard[rank], self._next[rank], self._replay[rank]

    def switch(self, rank: int, *, shard: int) -> None:
        """The rank reads stream ``shard`` from its first batch on, after its queued replays;
        its old stream is retired where it stands."""
        self._retired[self._shard[rank]] = self._next[rank]
        self._retired.pop(shard, None)
        self._shard[rank] = shard
        self._next[rank] = 0

    def restart(self, rank: int, *, at: int, replay: Iterable[int] = ()) -> None:
        """The rank's own stream restarts at batch ``at``, after ``replay`` (a resume or a
        rollback to a checkpoint)."""
        self._next[rank] = at
        self._replay[rank].clear()
        self._replay[rank].extend(replay)

    def position(self, rank: int) -> tuple[int, int, tuple[int, ...]]:
        """``(shard, next own batch, queued replay ids)`` of a tracked rank."""
        return self._shard[rank], self._next[rank], tuple(self._replay[rank])

    def retired(self) -> dict[int, int]:
        """Shard -> next own batch, for the shards of removed ranks."""
        return dict(self._retired)

    def shards(self) -> set[int]:
        """Every shard a rank reads or read (a rank added later must read another)."""
        return set(self._shard.values()) | set(self._retired)

    def retire(self, positions: Mapping[int, int]) -> None:
        """Remembers shards no rank continues (restored from a snapshot)."""
        self._retired.update(positions)

    def queue_replay(self, rank: int, ids: Iterable[int]) -> None:
        """Queues ``ids`` ahead of the replays queued before, as a rank's feed does
        (``BatchFeed.push_front``: a replay goes to the front of what the rank holds)."""
        self._replay[rank].extendleft(reversed(list(ids)))

    def trained(self, rank: int, ids: Sequence[int | None]) -> None:
        """The rank reports the batches it trained, in order."""
        for batch_id in ids:
            expected = self.peek(rank, 1)[0]
            if batch_id is not None and batch_id != expected:
                raise StreamError(
                    f"rank {rank} trained batch {batch_id}, its stream order says {expected}"
                )
            self._advance(rank)

    def take(self, rank: int, count: int) -> list[int]:
        """The next ``count`` batches of a rank that can no longer report them (it died)."""
        ids = self.peek(rank, count)
        for _ in range(count):
            self._advance(rank)
        return ids

    def peek(self, rank: int, count: int) -> list[int]:
        queued = list(self._replay[rank])[:count]
        start = self._next[rank]
        own = [self._stream_id(self._shard[rank], start + k) for k in range(count - len(queued))]
        return queued + own

    def _advance(self, rank: int) -> None:
        if self._replay[rank]:
            self._replay[rank].popleft()
        else:
            self._next[rank] += 1
