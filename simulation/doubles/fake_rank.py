"""Fake ranks: where they run, what each holds, and the rank protocol they answer.

:class:`FakeRank` implements :class:`~raytrec.elastic.rank_protocol.RankProtocol`. Calling one
of its methods does not carry the call out: it books it (an :class:`Op`), and the worker group
(:class:`~simulation.doubles.fake_group.FakeWorkerGroup`) carries out the call on every rank it went
to once it has dealt with the faults due at it (a rank that dies, hangs, or whose group breaks
at this call). A method a rank answers alone (``@alone``) runs its body then; the collectives
(``sync``, the broadcasts, checkpoints, ``save``) and ``train`` name the group function that
carries them out over all the call's ranks together.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, Protocol, TypeVar, cast

import numpy as np

from raytrec.cluster.domains import NODE_ID_LABEL, selects
from raytrec.data.parquet_streams import stream_length
from raytrec.data.synthetic import batch_id
from raytrec.elastic.rank_protocol import (
    LoadedCheckpoint,
    RankProtocol,
    ReformPlan,
    StateDigest,
)
from raytrec.elastic.report import RankInfo, RankReport, TrainedBatch
from raytrec.elastic.workers import NODE_DIED, Answer, NodeInfo, RankFailed, RankLost
from simulation.doubles.fake_model import FakeUsageError

if TYPE_CHECKING:
    from raytrec.checkpoint.config import CheckpointConfig
    from raytrec.data.parquet_streams import Stream
    from raytrec.data.source import BatchShard
    from raytrec.engine.publish_rows import PublishedRows
    from raytrec.engine.rank_engine import RankSpec
    from raytrec.observability.rec_metrics import MetricState
    from raytrec.sync.schedule import SyncPlan
    from simulation.doubles.fake_faults import ManualClock
    from simulation.doubles.fake_model import ModelCopy

__all__ = [
    "FakeAnswer",
    "FakeNode",
    "FakePlacement",
    "FakeRank",
    "Op",
    "OpKind",
    "RankHost",
    "RankState",
    "Run",
]

NEVER = math.inf

P = ParamSpec("P")
T = TypeVar("T")


# -- where ranks run --------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class FakeNode:
    index: int
    cpus: float
    free: float
    died_at: float = NEVER
    draining_at: float = NEVER

    @property
    def node_id(self) -> str:
        return f"fake-node-{self.index}"

    @property
    def labels(self) -> dict[str, str]:
        return {NODE_ID_LABEL: self.node_id}

    def info(self, now: float) -> NodeInfo:
        """The node as the node table shows it at ``now``."""
        return NodeInfo(
            node_id=self.node_id,
            address="127.0.0.1",
            alive=self.died_at > now,
            resources={"CPU": self.cpus},
            labels=self.labels,
        )


@dataclasses.dataclass(eq=False)
class FakePlacement:
    """A placement group: its bundles' CPUs, and the nodes they got once ready."""

    name: str
    cpus: tuple[float, ...]
    nodes: list[FakeNode] | None = None
    released: bool = False
    selectors: tuple[dict[str, str], ...] = ()  # per bundle: a label selector (node id only)

    def admits(self, bundle: int, node: FakeNode) -> bool:
        """Whether bundle ``bundle``'s label selector admits ``node``."""
        return not self.selectors or selects(self.selectors[bundle], node.labels)


# -- answers and rank state -------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class FakeAnswer(Answer[T]):
    """A call's answer, due at ``done_at`` (never: ``inf``); ``after``: a queued call ends no
    sooner than the one before it. ``blocked_from``: it waits in a collective from then on,
    until the replica planes are aborted or the collective times out."""

    rank: int
    due: float
    value: Any = None
    error: BaseException | None = None
    after: FakeAnswer[Any] | None = None
    blocked_from: float | None = None
    method: str = ""

    @property
    def done_at(self) -> float:
        return self.due if self.after is None else max(self.due, self.after.done_at)


@dataclasses.dataclass(eq=False)
class RankState:
    """What one fake rank holds: its stream position and replays, its step and log, and how
    it fails."""

    spec: RankSpec
    node: FakeNode
    stream: int  # its shard's index: batch k is batch_id(stream, k)
    length: float = NEVER  # batches its stream holds (a re-shared source's are finite)
    pos: int = 0
    replay: collections.deque[int] = dataclasses.field(default_factory=collections.deque)
    step: int = 0
    in_flight: bool = False  # a failed step's embedding update happened; recover() settles it
    log: list[TrainedBatch] = dataclasses.field(default_factory=list)
    prepared: int = 0
    died_at: float = NEVER
    cause: str = ""
    hung_at: float = NEVER
    corrupt: bool = False
    member: int = -1  # its gang's index in the replica plane it joined
    generation: int = -1
    plan: SyncPlan | None = None  # the sync plan it joined
    step_s: float = 0.0
    last_end: float | None = None
    runs: list[Run] = dataclasses.field(default_factory=list)
    pending: list[FakeAnswer[Any]] = dataclasses.field(default_factory=list)
    # Held-out batch ids it was sent to read ahead, and those it scored (padding included), in
    # the order of the calls.
    read_ahead: list[int] = dataclasses.field(default_factory=list)
    scored: list[int] = dataclasses.field(default_factory=list)

    @property
    def gang(self) -> int:
        return self.spec.gang

    def take(self) -> int:
        if self.replay:
            return self.replay.popleft()
        if self.pos >= self.length:
            raise FakeUsageError(
                f"rank {self.spec.rank} asked to train batch {self.pos} of stream {self.stream}, "
                f"which holds {self.length}"
            )
        self.pos += 1
        return batch_id(self.stream, self.pos - 1)

    def lost(self) -> RankLost:
        return RankLost(self.spec.rank, self.cause, node_died=self.cause == NODE_DIED)


@dataclasses.dataclass(eq=False)
class Run:
    """One ``train`` call on the live ranks: ``n`` steps of ``step_s`` from ``start``, carried
    out as the clock passes them; ``done_at``: when each step done so far finished."""

    step0: int
    start: float
    done_at: list[float] = dataclasses.field(default_factory=list)
    end: float = NEVER
    failed: bool = False
    futures: dict[int, FakeAnswer[Any]] = dataclasses.field(default_factory=dict)
    states: list[RankState] = dataclasses.field(default_factory=list)
    gangs: dict[int, list[RankState]] = dataclasses.field(default_factory=dict)
    n: int = 0
    step_s: float = 0.0
    ready: int = 0
    begun: int = -1  # the last step whose start (and its faults) was carried out
    live: bool = True  # steps are still to be carried out
    after: Run | None = None  # the live run it is queued behind


def stream_batches(shard: object, batch_size: int) -> float:
    """Batches a shard's stream holds: a re-shared source's (Parquet read by index) are
    finite; the others' are endless."""
    stream = getattr(shard, "stream", None)
    if stream is None or not hasattr(shard, "num_shards"):
        return NEVER
    return stream_length(stream(batch_size))


# -- booked calls -----------------------------------------------------------------------------


class OpKind(enum.Enum):
    ALONE = "alone"  # each rank answers by itself
    GANG = "gang"  # a collective of one gang's ranks
    PLANE = "plane"  # a collective of one whole replica plane
    TRAIN = "train"  # the interval: every live rank, step by step
    PLAN = "plan"  # calls carried out in order in one call (``reform``): ``parts``


#: Carries out a collective over the call's ranks; the answer value of each.
Together = Callable[[list[RankState], Mapping[int, "Op"]], dict[int, Any]]


@dataclasses.dataclass(frozen=True, eq=False)
class Op:
    """A call booked on one rank: the method, its kind, and what carries it out (``run`` for a
    rank alone: its value, or a :class:`FakeAnswer` due later; ``together`` for a collective);
    ``args``/``kwargs``: the call's arguments, for collectives and ``train``."""

    method: str
    kind: OpKind
    run: Callable[[], Any] | None = None
    together: Together | None = None
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    parts: tuple[Op, ...] = ()


def alone(
    method: Callable[Concatenate[FakeRank, P], T],
) -> Callable[Concatenate[FakeRank, P], T]:
    """A method a rank answers by itself: calling it books the call; its body runs when the
    group carries the call out (module doc)."""

    @functools.wraps(method)
    def book(self: FakeRank, *args: P.args, **kwargs: P.kwargs) -> T:
        op = Op(method.__name__, OpKind.ALONE, run=lambda: method(self, *args, **kwargs))
        return cast(T, op)

    return book


def _booked(op: Op) -> Any:
    """The booked call, in place of the method's answer (the group wraps it into one)."""
    return op


# -- the rank protocol ------------------------------------------------------------------------


class RankHost(Protocol):
    """What a fake rank asks of the worker group it runs in
    (:class:`~simulation.doubles.fake_group.FakeWorkerGroup`): the clock, its gang's model copy,
    answers due later, and the functions that carry out its collectives (:data:`Together`)."""

    clock: ManualClock
    build_s: float
    copies: dict[int, ModelCopy]

    def answer(
        self, rank: RankState, value: Any = None, *, due: float | None = None
    ) -> FakeAnswer[Any]: ...
    def abort_step(self, rank: RankState) -> None: ...
    def sync_all(self, states: list[RankState], ops: Mapping[int, Op]) -> dict[int, Any]: ...
    def broadcast_all(self, states: list[RankState], ops: Mapping[int, Op]) -> dict[int, Any]: ...
    def broadcast_dense_all(
        self, states: list[RankState], ops: Mapping[int, Op]
    ) -> dict[int, Any]: ...
    def save_checkpoint(self, states: list[RankState], ops: Mapping[int, Op]) -> dict[int, Any]: ...
    def load_checkpoint(self, states: list[RankState], ops: Mapping[int, Op]) -> dict[int, Any]: ...
    def save_model(self, states: list[RankState], ops: Mapping[int, Op]) -> dict[int, Any]: ...


class FakeRank:
    """One fake rank as the coordinator calls it (:class:`RankProtocol`; module doc)."""

    def __init__(self, group: RankHost, state: RankState) -> None:
        self._group = group
        self._s = state

    @alone
    def build(self) -> RankInfo:
        s, group = self._s, self._group
        info = RankInfo(
            rank=s.spec.rank, gang=s.spec.gang, node_id=s.node.node_id, pid=0, device="cpu"
        )
        return cast(RankInfo, group.answer(s, info, due=group.clock.now + group.build_s))

    @alone
    def join_replica_plane(self, generation: int, member_rank: int, size: int) -> None:
        self._s.generation, self._s.member = generation, member_rank

    @alone
    def join_sync_plan(self, plan: SyncPlan) -> None:
        self._s.plan = plan

    @alone
    def settle_failed_step(self, finish: bool) -> None:
        pass

    @alone
    def set_step(self, step: int) -> None:
        self._s.step = int(step)

    @alone
    def step(self) -> int:
        return self._s.step

    @alone
    def prepare(self, num_steps: int, *, first: bool = False) -> float:
        self._s.prepared = max(self._s.prepared, int(num_steps))
        return 0.0

    @alone
    def set_shard(
        self, shard: BatchShard, replay: list[int], embedding_only: list[int] | None = None
    ) -> None:
        s = self._s  # (no dense state in the fake: embedding-only replays train like others)
        index = getattr(shard, "index", None)
        if index is None:
            raise FakeUsageError(f"a fake rank reads shards with an index, not {shard!r}")
        s.stream, s.pos = int(index), 0
        s.length = stream_batches(shard, s.spec.config.data.batch_size)
        s.replay = collections.deque(replay)

    @alone
    def set_streams(self, streams: dict[int, Stream]) -> None:
        if self._s.stream in streams:  # its own stream may end sooner now
            self._s.length = stream_length(streams[self._s.stream])

    @alone
    def extend_stream(self, shard: BatchShard, keep: int) -> None:
        s = self._s
        if getattr(shard, "index", None) != s.stream or keep < s.pos:
            raise FakeUsageError(f"rank {s.spec.rank} reads on its stream {s.stream} only")
        s.length = stream_batches(shard, s.spec.config.data.batch_size)

    @alone
    def replay(self, batch_ids: list[int], embedding_only: list[int] | None = None) -> int:
        self._s.replay.extendleft(reversed(batch_ids))
        return len(batch_ids)

    @alone
    def abort_replica_planes(self) -> None:
        s, group = self._s, self._group
        now = group.clock.now
        group.abort_step(s)  # inside a step, its collectives fail now
        for f in s.pending:
            if f.blocked_from is not None and f.done_at > now:
                f.due = max(now, f.blocked_from)
                f.error = RankFailed(s.spec.rank, RuntimeError("replica plane aborted"))
                f.blocked_from = None

    @alone
    def recover(self) -> RankReport:
        s = self._s
        abandoned, s.in_flight = s.in_flight, False
        s.step += int(abandoned)
        trained, s.log = tuple(s.log), []
        return RankReport(
            rank=s.spec.rank,
            step=s.step,
            trained=trained,
            losses=(0.5,) * len(trained),
            abandoned_dense_update=abandoned,
        )

    @alone
    def state_digest(self) -> StateDigest:
        s = self._s
        copy = self._group.copies[s.gang]
        shards = f"{s.spec.gang_rank}:{copy.base.digest:x}:{copy.own_digest:x}"
        return StateDigest(shards=shards + (":off" if s.corrupt else ""), dense=f"{copy.dense:x}")

    @alone
    def unpublished_rows(self, dense: bool, every_row: bool = False) -> PublishedRows:
        raise FakeUsageError("the fake rank holds no tables to publish (publish.every_n_steps)")

    @alone
    def rows_published(self) -> None:
        raise FakeUsageError("the fake rank holds no tables to publish (publish.every_n_steps)")

    @alone
    def evaluate(
        self, shard: BatchShard, batch_ids: list[int | None], batch_size: int
    ) -> MetricState:
        """Books the batches it scores (as a real rank reads them: padding rounds score its
        first batch); scores no row."""
        pad = next((i for i in batch_ids if i is not None), 0)
        self._s.scored.extend(pad if i is None else i for i in batch_ids)
        return {"ne": np.zeros(4), "preds": np.zeros(0), "labels": np.zeros(0), "rows": 0}

    @alone
    def prefetch_held_out(self, shard: BatchShard, batch_ids: list[int], batch_size: int) -> None:
        self._s.read_ahead.extend(batch_ids)

    @alone
    def close(self) -> None:
        pass

    # -- collectives ------------------------------------------------------------------------

    def reform(self, plan: ReformPlan) -> None:
        """The plan's parts, booked as the calls they stand for (faults strike them by those
        names); the group carries them out in order and stops at the first that fails."""
        parts: list[Any] = []
        booked: Any = self  # its collectives answer the booked call, not None
        if plan.replay is not None:
            parts.append(self.replay(list(plan.replay), list(plan.embedding_only)))
        if (g := plan.generation) is not None:
            parts.append(self.join_replica_plane(g.generation, g.member_rank, g.size))
            parts.append(self.join_sync_plan(g.sync_plan))
        if plan.step is not None:
            parts.append(self.set_step(plan.step))
        if plan.sync:
            parts.append(booked.sync(plan.rolled_back))
        if plan.broadcast_state_from is not None:
            parts.append(booked.broadcast_state(plan.broadcast_state_from))
        if plan.dense_from is not None:
            parts.append(booked.broadcast_dense(*plan.dense_from))
        if plan.finish_failed_step is not None:
            parts.append(self.settle_failed_step(plan.finish_failed_step))
        return _booked(Op("reform", OpKind.PLAN, parts=tuple(cast(Op, p) for p in parts)))

    def sync(self, rolled_back: tuple[int, ...] = ()) -> None:
        """A job-wide sync; the replica-plane members ``rolled_back`` take the others' mean."""
        return _booked(Op("sync", OpKind.PLANE, together=self._group.sync_all, args=(rolled_back,)))

    def broadcast_state(self, src: int) -> None:
        return _booked(
            Op("broadcast_state", OpKind.PLANE, together=self._group.broadcast_all, args=(src,))
        )

    def broadcast_dense(self, src: int, gang_src: int = 0) -> None:
        together = self._group.broadcast_dense_all
        return _booked(Op("broadcast_dense", OpKind.PLANE, together=together, args=(src, gang_src)))

    def save_checkpoint(
        self,
        root: str,
        generation: int,
        extra: dict[str, object],
        retention: CheckpointConfig,
        num_gangs: int,
    ) -> tuple[int, str]:
        args = (root, generation, extra, retention, num_gangs)
        return _booked(
            Op("save_checkpoint", OpKind.GANG, together=self._group.save_checkpoint, args=args)
        )

    def load_checkpoint(
        self, uri: str, stream_start: int | None = None, *, init: bool = False
    ) -> LoadedCheckpoint:
        if init:
            raise NotImplementedError("the fake rank does not start from a checkpoint's model")
        args = (uri, stream_start)
        return _booked(
            Op("load_checkpoint", OpKind.PLANE, together=self._group.load_checkpoint, args=args)
        )

    def save(self, path: str) -> None:
        return _booked(Op("save", OpKind.GANG, together=self._group.save_model, args=(path,)))

    def train(
        self, num_steps: int, ready_steps: int = 0, *, seq: int = -1, after: int | None = None
    ) -> RankReport:
        kwargs = {"seq": seq, "after": after}
        return _booked(Op("train", OpKind.TRAIN, args=(num_steps, ready_steps), kwargs=kwargs))


_PROTOCOL: type[RankProtocol] = FakeRank  # mypy checks that the fake answers the protocol
