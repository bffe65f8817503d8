"""What the coordinator may ask of a rank, typed end to end.

:class:`RankProtocol` lists the rank actor's methods (:class:`actors.rank.RankWorker` on Ray;
an in-process fake rank in tests) with their arguments and answers.
The coordinator calls ranks through :meth:`raytrec.elastic.workers.WorkerGroup.call` with a
function of a rank, ``group.call(ranks, lambda w, r: w.replay(ids[r]))``: mypy checks the
method's name, its arguments and its answer's type at every call site, and the answer comes back
as ``Answer[R]`` whose :meth:`~raytrec.elastic.workers.WorkerGroup.result` is an ``R``.

Pure declarations: no Ray, no torch.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol, TypedDict

if TYPE_CHECKING:
    from raytrec.checkpoint.config import CheckpointConfig
    from raytrec.data.parquet_streams import Stream
    from raytrec.data.source import BatchShard
    from raytrec.elastic.report import RankInfo, RankReport
    from raytrec.engine.publish_rows import PublishedRows
    from raytrec.observability.rec_metrics import MetricState
    from raytrec.sync.schedule import SyncPlan

__all__ = ["GenerationPlan", "LoadedCheckpoint", "RankProtocol", "ReformPlan", "StateDigest"]


class LoadedCheckpoint(TypedDict):
    """What a rank loaded: the checkpoint's step and generation, and what the job saved with
    it (its books: JSON values)."""

    step: int
    generation: int
    extra: dict[str, object]


class StateDigest(TypedDict):
    """Content hashes of a rank's shard state (embedding weights and optimizer state) and of
    its dense state: replicas agree when these do."""

    shards: str
    dense: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationPlan:
    """A rank's place in a new generation: member ``member_rank`` of ``size`` in replica plane
    ``generation`` (its gang's index among the live gangs), with the generation's sync plan."""

    generation: int
    member_rank: int
    size: int
    sync_plan: SyncPlan


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReformPlan:
    """What one rank carries out in one :meth:`RankProtocol.reform` call, in this order (a part
    left at its default is skipped): queue the replays, join the new generation, take the step,
    sync the replica plane, take a member's full state, take a member's dense state, settle the
    failed step. Parts that are collectives run on every rank of the call at once, so they need
    no barrier in between; what needs the coordinator between two parts (a commit after a sync,
    an event once a generation is joined) ends a plan."""

    #: Batches to train next, before the rank's own (a lost gang's uncommitted ones).
    replay: tuple[int, ...] | None = None
    #: Those of ``replay`` that update their embedding rows only.
    embedding_only: tuple[int, ...] = ()
    generation: GenerationPlan | None = None
    step: int | None = None
    #: A sync of the replica plane (embedding and optimizer state averaged).
    sync: bool = False
    #: With ``sync``: the replica-plane members that take the mean of the others' state
    #: instead of adding theirs (:mod:`raytrec.elastic.group_rollback`).
    rolled_back: tuple[int, ...] = ()
    #: The replica-plane member whose full state every member takes (a heal).
    broadcast_state_from: int | None = None
    #: (replica-plane member, its gang rank) whose dense state every member takes.
    dense_from: tuple[int, int] | None = None
    #: After a loss mid-step: finish the failed step's dense update (True) or drop it (False).
    finish_failed_step: bool | None = None


class RankProtocol(Protocol):
    """One rank of the job, as the coordinator drives it. Methods marked *collective* are called
    on every rank of a gang or of a replica plane at once; the others answer alone."""

    def build(self) -> RankInfo:
        """Builds the rank's engine (its gang's process group, model and optimizer)."""
        ...

    def join_replica_plane(self, generation: int, member_rank: int, size: int) -> None:
        """Joins generation ``generation``'s replica plane as member ``member_rank`` of
        ``size`` (its gang's index among the live gangs)."""
        ...

    def join_sync_plan(self, plan: SyncPlan) -> None:
        """Takes the generation's sync schedule (hierarchical levels and their groups)."""
        ...

    def reform(self, plan: ReformPlan) -> None:
        """Carries out ``plan``'s parts in order (:class:`ReformPlan`); its collectives run on
        every rank of the call."""
        ...

    def broadcast_state(self, src: int) -> None:
        """Collective over the replica plane: every member takes member ``src``'s state."""
        ...

    def broadcast_dense(self, src: int, gang_src: int = 0) -> None:
        """Collective over the replica plane: the dense state of member ``src``'s rank
        ``gang_src``, everywhere."""
        ...

    def settle_failed_step(self, finish: bool) -> None:
        """After a loss mid-step: finish the failed step's dense update, or drop it."""
        ...

    def set_step(self, step: int) -> None: ...

    def step(self) -> int:
        """The last step the rank finished."""
        ...

    def prepare(self, num_steps: int, *, first: bool = False) -> float:
        """Reads ``num_steps`` batches ahead; returns the seconds it waited for data."""
        ...

    def set_shard(
        self, shard: BatchShard, replay: list[int], embedding_only: list[int] | None = None
    ) -> None:
        """Reads ``shard`` from now on, after the batches ``replay`` (those in
        ``embedding_only`` update their embedding rows only)."""
        ...

    def set_streams(self, streams: dict[int, Stream]) -> None:
        """The job's re-shared streams (its own may end sooner now)."""
        ...

    def extend_stream(self, shard: BatchShard, keep: int) -> None:
        """Reads on in its own stream, now ``shard``'s: the same batches up to ``keep``, more
        after them (a loss's rows taken over); the batches from ``keep`` on start reading now."""
        ...

    def replay(self, batch_ids: list[int], embedding_only: list[int] | None = None) -> int:
        """Trains ``batch_ids`` next, before its own batches; returns how many it holds."""
        ...

    def train(
        self, num_steps: int, ready_steps: int = 0, *, seq: int = -1, after: int | None = None
    ) -> RankReport:
        """Collective over every live rank: trains an interval of ``num_steps`` steps (queued
        behind call ``after``); reports every batch it trained."""
        ...

    def abort_replica_planes(self) -> None:
        """Fails the rank's collectives now (a peer is gone)."""
        ...

    def recover(self) -> RankReport:
        """After a failed interval: what the rank trained since its last report."""
        ...

    def sync(self) -> None:
        """Collective over the replica plane: averages embedding and optimizer state."""
        ...

    def evaluate(
        self, shard: BatchShard, batch_ids: list[int | None], batch_size: int
    ) -> MetricState:
        """Collective over the gang: scores held-out batches; their metric states."""
        ...

    def prefetch_held_out(self, shard: BatchShard, batch_ids: list[int], batch_size: int) -> None:
        """Starts reading held-out batches ahead, in the background, for the next evaluation;
        returns at once (a source not read by index: nothing)."""
        ...

    def save_checkpoint(
        self,
        root: str,
        generation: int,
        extra: dict[str, object],
        retention: CheckpointConfig,
        num_gangs: int,
    ) -> tuple[int, str]:
        """Collective over one gang: writes a checkpoint; its step and location."""
        ...

    def load_checkpoint(
        self, uri: str, stream_start: int | None = None, *, init: bool = False
    ) -> LoadedCheckpoint:
        """Collective over a gang: loads a checkpoint, resharded to the gang's shape (with
        ``init``, its model only: the step counter stays at 0)."""
        ...

    def save(self, path: str) -> None:
        """Collective over one gang: writes the model for serving."""
        ...

    def unpublished_rows(self, dense: bool, every_row: bool = False) -> PublishedRows:
        """The rows that changed since the last publish (``every_row``: all), under global ids
        (with ``dense``, the dense state dict too)."""
        ...

    def rows_published(self) -> None:
        """The job published the model as it is now."""
        ...

    def state_digest(self) -> StateDigest: ...

    def close(self) -> None: ...
