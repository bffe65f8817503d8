"""An in-process worker group: the real control loop without Ray.

:class:`FakeWorkerGroup` implements :class:`~raytrec.elastic.workers.WorkerGroup` with fake
ranks that "train" by taking batch ids from their streams (replays first, as a real feed does)
and returning well-formed :class:`~raytrec.elastic.report.RankReport`\\ s; no process, no process
group. Its clock (:class:`~raytrec.elastic.fake_faults.ManualClock`) advances only when the
coordinator sleeps or waits, so a test of minutes of job time runs in milliseconds and every
timeout is exact.

What the fake models, and how:

- **Training.** The live ranks train in lockstep (dense gradients are averaged every step), one
  step per ``step_s`` of clock time, at the pace of the slowest rank. Job-wide syncs happen at
  ``sync.sync_every`` (hierarchical lower levels are not modelled). A ``train`` call's steps
  happen as the clock passes them, not when it is made: a rank that dies or is killed, or a
  replica plane aborted, in the middle of a step fails that step for every rank of the call,
  and the steps after it never happen.
- **State.** Each gang holds one model copy: the batches trained into it (a committed base shared
  by every replica after a sync, plus its own batches since) and a dense state. Syncs merge the
  gangs' batches, ``broadcast_state`` copies a member's, checkpoints save and load it, and
  ``state_digest`` hashes it, so heal verification and the final replica check behave as on real
  ranks; :meth:`FakeWorkerGroup.model_batches` says which batches the final model holds.
- **Faults**, from a schedule (:mod:`raytrec.elastic.fake_faults`, with the clock and the fake
  shards). A rank or node that dies as a step starts fails its call at
  once; the ranks waiting for it in that step's collectives fail when the coordinator aborts
  their replica planes, or after ``collective_timeout_s``. A hung rank's call never returns and
  its heartbeat stops.
- **Placement.** Nodes of ``cpus_per_node`` CPUs; a placement is ready once every bundle fits on
  a live node that is not draining (first fit), which may be never.

Calls the coordinator must not make (a collective on part of a replica plane, a call on a rank
never started) raise :class:`FakeUsageError`: on real ranks they would hang or crash.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from raytrec.data.parquet_plan import stream_length
from raytrec.data.synthetic import batch_id
from raytrec.elastic import fake_faults
from raytrec.elastic.report import RankInfo, RankReport, TrainedBatch
from raytrec.elastic.workers import NODE_DIED, NodeInfo, RankFailed, RankLost

if TYPE_CHECKING:
    from raytrec.data.source import BatchShard
    from raytrec.engine.rank import RankSpec, StoreAddress
    from raytrec.placement import PlacementSpec

__all__ = ["FakePlacement", "FakeUsageError", "FakeWorkerGroup"]

_MASK = (1 << 64) - 1
_NEVER = math.inf


class FakeUsageError(AssertionError):
    """The coordinator made a call that would hang or crash on real ranks."""


# -- model state ------------------------------------------------------------------------------


def _mix(value: int) -> int:
    """A 64-bit hash of an int (splitmix64's finalizer); sums of it hash multisets."""
    z = (value + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


@dataclasses.dataclass(frozen=True)
class _Base:
    """Batches committed into every replica at a sync: a chain, so a sync costs what it adds."""

    parent: _Base | None
    added: tuple[int, ...]
    digest: int

    def batches(self) -> collections.Counter[int]:
        out: collections.Counter[int] = collections.Counter()
        node: _Base | None = self
        while node is not None:
            out.update(node.added)
            node = node.parent
        return out


_EMPTY = _Base(None, (), 0)


@dataclasses.dataclass
class _Copy:
    """One gang's model copy: the committed base, its own batches since, its dense state."""

    base: _Base
    own: list[int]
    own_digest: int
    dense: int

    def add(self, batch: int) -> None:
        self.own.append(batch)
        self.own_digest = (self.own_digest + _mix(batch)) & _MASK

    def clone(self) -> _Copy:
        return _Copy(self.base, list(self.own), self.own_digest, self.dense)

    def batches(self) -> collections.Counter[int]:
        out = self.base.batches()
        out.update(self.own)
        return out


def _synced(copies: Sequence[_Copy]) -> None:
    """A job-wide sync: every copy ends up with the same base (all batches of all copies)."""
    bases = {c.base.digest for c in copies}
    if len(bases) != 1:
        raise FakeUsageError("replicas averaged from different states (a heal was missed)")
    added = tuple(b for c in copies for b in c.own)
    digest = (copies[0].base.digest + sum(c.own_digest for c in copies)) & _MASK
    base = _Base(copies[0].base, added, digest)
    denses = sorted({c.dense for c in copies})
    dense = denses[0] if len(denses) == 1 else _mix(hash(tuple(denses)) & _MASK)
    for c in copies:
        c.base, c.own, c.own_digest, c.dense = base, [], 0, dense


# -- the cluster ------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _Node:
    index: int
    cpus: float
    free: float
    died_at: float = _NEVER
    draining_at: float = _NEVER

    @property
    def node_id(self) -> str:
        return f"fake-node-{self.index}"


@dataclasses.dataclass(eq=False)
class FakePlacement:
    """A placement group: its bundles' CPUs, and the nodes they got once ready."""

    name: str
    cpus: tuple[float, ...]
    nodes: list[_Node] | None = None
    released: bool = False


# -- ranks and calls --------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _Future:
    """A call's answer, due at ``done_at`` (never: ``inf``); ``after``: a queued call ends no
    sooner than the one before it. ``blocked_from``: it waits in a collective from then on,
    until the replica planes are aborted or the collective times out."""

    rank: int
    due: float
    value: Any = None
    error: BaseException | None = None
    after: _Future | None = None
    blocked_from: float | None = None

    @property
    def done_at(self) -> float:
        return self.due if self.after is None else max(self.due, self.after.done_at)


@dataclasses.dataclass(eq=False)
class _Rank:
    spec: RankSpec
    node: _Node
    stream: int  # its shard's index: batch k is batch_id(stream, k)
    length: float = _NEVER  # batches its stream holds (a re-shared source's are finite)
    pos: int = 0
    replay: collections.deque[int] = dataclasses.field(default_factory=collections.deque)
    step: int = 0
    in_flight: bool = False  # a failed step's embedding update happened; recover() settles it
    log: list[TrainedBatch] = dataclasses.field(default_factory=list)
    prepared: int = 0
    died_at: float = _NEVER
    cause: str = ""
    hung_at: float = _NEVER
    corrupt: bool = False
    member: int = -1  # its gang's index in the replica plane it joined
    generation: int = -1
    step_s: float = 0.0
    last_end: float | None = None
    runs: list[_Run] = dataclasses.field(default_factory=list)
    pending: list[_Future] = dataclasses.field(default_factory=list)

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


@dataclasses.dataclass(eq=False)
class _Run:
    """One ``train`` call on the live ranks: ``n`` steps of ``step_s`` from ``start``, carried
    out as the clock passes them; ``done_at``: when each step done so far finished."""

    step0: int
    start: float
    done_at: list[float] = dataclasses.field(default_factory=list)
    end: float = _NEVER
    failed: bool = False
    futures: dict[int, _Future] = dataclasses.field(default_factory=dict)
    states: list[_Rank] = dataclasses.field(default_factory=list)
    gangs: dict[int, list[_Rank]] = dataclasses.field(default_factory=dict)
    n: int = 0
    step_s: float = 0.0
    ready: int = 0
    begun: int = -1  # the last step whose start (and its faults) was carried out
    live: bool = True  # steps are still to be carried out
    after: _Run | None = None  # the live run it is queued behind


def _lost(rank: _Rank) -> RankLost:
    return RankLost(rank.spec.rank, rank.cause, node_died=rank.cause == NODE_DIED)


class FakeWorkerGroup:
    """Fake ranks on fake nodes, driven by a :class:`~raytrec.elastic.fake_faults.ManualClock`
    (module doc).

    ``nodes`` nodes of ``cpus_per_node`` CPUs each to start with; ``step_s``: seconds a step
    takes; ``build_s``: seconds a rank takes to build. ``faults``: the schedule.
    """

    def __init__(
        self,
        *,
        nodes: int,
        cpus_per_node: float,
        faults: Iterable[fake_faults.Fault | fake_faults.NodesJoin] = (),
        clock: fake_faults.ManualClock | None = None,
        step_s: float = 0.1,
        build_s: float = 1.0,
    ) -> None:
        self.clock = clock or fake_faults.ManualClock()
        self.clock.on_advance(self._time_passed)
        self.cpus_per_node = cpus_per_node
        self.step_s = step_s
        self.build_s = build_s
        self._nodes: list[_Node] = []
        self._add_nodes(nodes)
        schedule = list(faults)
        self._arrivals = sorted(
            (f for f in schedule if isinstance(f, fake_faults.NodesJoin)), key=lambda f: f.at
        )
        self._faults: list[fake_faults.Fault] = [
            f for f in schedule if not isinstance(f, fake_faults.NodesJoin)
        ]
        self._slow = {f.rank: f.step_s for f in self._faults if isinstance(f, fake_faults.SlowRank)}
        # (rank, method) -> the faults due at one of its calls, and how many it has made.
        self._call_faults: dict[tuple[int, str], list[fake_faults.CallFault]] = {}
        for f in self._faults:
            if isinstance(f, fake_faults.CallFault) and f.on is not None:
                assert f.rank is not None, f"{f} names no rank"
                self._call_faults.setdefault((f.rank, f.on), []).append(f)
        self._faults = [f for f in self._faults if not _at_call(f)]
        self._calls: collections.Counter[tuple[int, str]] = collections.Counter()
        # The faults carried out (and nodes that joined), in order; ``on_fire`` is told of each.
        self.fired: list[fake_faults.Fault | fake_faults.NodesJoin] = []
        self.on_fire: Callable[[fake_faults.Fault | fake_faults.NodesJoin], None] | None = None
        self._timed: list[tuple[float, Callable[[], object]]] = []  # (when, what), to fire
        self._pending: list[FakePlacement] = []
        self._ranks: dict[int, _Rank] = {}
        self._copies: dict[int, _Copy] = {}  # gang id -> its model copy
        self._runs: dict[int, _Run] = {}  # train call seq -> its run
        self._live: list[_Run] = []  # runs with steps still to carry out, in call order
        self._collective_timeout_s = _NEVER
        self.checkpoints: dict[str, tuple[_Copy, int, int, dict[str, Any]]] = {}
        self.saved_models: dict[str, collections.Counter[int]] = {}
        self.killed: list[int] = []  # ranks the coordinator killed, in order
        self.cpu_s = 0.0  # the fake's own CPU time (a benchmark subtracts it)

    # -- what tests read --------------------------------------------------------------------

    def model_batches(self, path: str) -> collections.Counter[int]:
        """The batches in the model saved at ``path`` (``RankWorker.save``), with multiplicity."""
        return self.saved_models[path]

    def node_of(self, rank: int) -> int:
        """The fake node index rank ``rank`` runs on."""
        return self._ranks[rank].node.index

    # -- WorkerGroup ------------------------------------------------------------------------

    def host_store(self) -> StoreAddress:
        from raytrec.engine.rank import StoreAddress

        return StoreAddress(host="127.0.0.1", port=0, secret="fake")

    def start_rank(
        self, spec: RankSpec, shard: BatchShard, *, placement: FakePlacement, bundle: int
    ) -> None:
        t0 = time.process_time()
        if placement.nodes is None:
            raise FakeUsageError(f"rank {spec.rank} started in a placement that is not ready")
        if spec.rank in self._ranks:
            raise FakeUsageError(f"rank {spec.rank} started twice")
        node = placement.nodes[bundle]
        self._collective_timeout_s = spec.config.elastic.collective_timeout_s
        rank = _Rank(
            spec=spec,
            node=node,
            stream=int(getattr(shard, "index", spec.rank)),
            length=_length(shard, spec.config.data.batch_size),
            step_s=self._slow.get(spec.rank, self.step_s),
        )
        for f in self._faults:
            if isinstance(f, fake_faults.SlowRank) and f.rank == spec.rank:
                self._fired(f)
        if node.died_at <= self.clock.now:
            rank.died_at, rank.cause = node.died_at, NODE_DIED
        self._ranks[spec.rank] = rank
        if spec.gang not in self._copies:  # every gang starts from a model of its own
            self._copies[spec.gang] = _Copy(_EMPTY, [], 0, _mix(spec.gang + 1))
        self.cpu_s += time.process_time() - t0

    def call(
        self,
        ranks: Sequence[int],
        method: Callable[..., Any],
        args_of: Callable[[int], tuple[Any, ...]] = lambda _r: (),
        **kwargs: Any,
    ) -> dict[int, _Future]:
        t0 = time.process_time()
        name = method.__name__
        for r in ranks:
            if r not in self._ranks:
                raise FakeUsageError(f"{name} called on rank {r}, which was never started")
        states = [self._ranks[r] for r in ranks]
        now = self.clock.now
        out: dict[int, _Future] = {}
        hung: set[int] = set()
        broke = False
        if self._call_faults:
            for rank in states:
                for f in self._due_at_call(rank.spec.rank, name):
                    if isinstance(f, fake_faults.RankDies):
                        self._kill(rank, "ActorDiedError: the rank's process exited", at=now)
                    elif isinstance(f, fake_faults.RankHangs):
                        hung.add(rank.spec.rank)
                    elif isinstance(f, fake_faults.GroupBreaks):
                        broke = name in _COLLECTIVES
                    else:
                        f.action()
            self._time_passed()  # a run a rank died in stops now
        if name == "train":
            out = self._train(states, args_of, **kwargs)
        elif hung:
            out = self._hang(name, states, hung, args_of, kwargs)
        elif broke:
            error = RuntimeError("Application timeout caused pair closure")
            out = {
                r.spec.rank: _Future(r.spec.rank, now, error=RankFailed(r.spec.rank, error))
                for r in states
            }
        elif name in _COLLECTIVES:
            out = self._collective(name, states, args_of, kwargs)
        else:
            for rank in states:
                out[rank.spec.rank] = self._answer(rank, name, args_of(rank.spec.rank), kwargs)
        for rank in states:
            rank.pending = [f for f in rank.pending if f.done_at > now]
            rank.pending.append(out[rank.spec.rank])
        self.cpu_s += time.process_time() - t0
        return out

    def _due_at_call(self, rank: int, name: str) -> list[fake_faults.CallFault]:
        """The faults due at this call of ``rank``'s (its calls of ``name`` counted)."""
        key = (rank, name)
        todo = self._call_faults.get(key)
        if not todo:
            return []
        self._calls[key] += 1
        due = [f for f in todo if f.nth == self._calls[key]]
        for f in due:
            todo.remove(f)
            self._fired(f)
        return due

    def _fired(self, fault: fake_faults.Fault | fake_faults.NodesJoin) -> None:
        self.fired.append(fault)
        if self.on_fire is not None:
            self.on_fire(fault)

    def _hang(
        self,
        name: str,
        states: list[_Rank],
        hung: set[int],
        args_of: Callable[[int], tuple[Any, ...]],
        kwargs: dict[str, Any],
    ) -> dict[int, _Future]:
        """A call that never returns on the ``hung`` ranks; in a collective, the others wait
        for them until the collective times out, then fail."""
        now = self.clock.now
        out: dict[int, _Future] = {}
        for r in states:
            rank = r.spec.rank
            if r.died_at <= now:
                out[rank] = self._future(r)
            elif rank in hung:
                r.hung_at = min(r.hung_at, now)
                out[rank] = _Future(rank, _NEVER)
            elif name in _COLLECTIVES:
                cause = TimeoutError(f"{name} timed out after {self._collective_timeout_s}s")
                out[rank] = _Future(
                    rank,
                    now + self._collective_timeout_s,
                    error=RankFailed(rank, cause),
                    blocked_from=now,
                )
            else:
                out[rank] = self._answer(r, name, args_of(rank), kwargs)
        return out

    def wait(
        self, futures: Sequence[_Future], *, num_returns: int, timeout: float
    ) -> list[_Future]:
        t0 = time.process_time()
        if not futures:
            return []
        self._time_passed()
        deadline = self.clock.now + timeout
        while True:  # a call may end later than it was due when a fault strikes meanwhile
            now = self.clock.now
            due = sorted(f.done_at for f in futures)
            target = due[min(num_returns, len(due)) - 1]
            self._advance(min(max(target, now), deadline))
            t = self.clock.now
            done = [f for f in futures if f.done_at <= t]
            if len(done) >= min(num_returns, len(futures)) or t >= deadline:
                break
        self.cpu_s += time.process_time() - t0
        return done

    def result(self, future: _Future) -> Any:
        if future.done_at > self.clock.now:
            raise FakeUsageError(f"result() of rank {future.rank}'s call before it is done")
        if future.error is not None:
            raise _fresh(future.error)
        if future.after is not None and isinstance(future.after.error, RankLost):
            raise _fresh(future.after.error)  # a call queued on a rank that died
        return future.value

    def kill(self, rank: int) -> None:
        state = self._ranks.get(rank)
        if state is None or state.died_at <= self.clock.now:
            return
        self.killed.append(rank)
        self._kill(state, "ActorDiedError: the actor was killed by ray.kill", at=self.clock.now)
        self._time_passed()  # its run, if any, stops now

    def progress(self, ranks: Sequence[int]) -> dict[int, int]:
        t0 = time.process_time()
        self._time_passed()
        now = self.clock.now
        out = {r: self._progress(self._ranks[r], now) for r in ranks if r in self._ranks}
        self.cpu_s += time.process_time() - t0
        return out

    def place(self, spec: PlacementSpec, *, name: str = "") -> FakePlacement:
        placement = FakePlacement(name=name, cpus=tuple(b.get("CPU", 0.0) for b in spec.bundles))
        self._pending.append(placement)
        self._schedule()
        return placement

    def ready(self, placements: Sequence[FakePlacement], *, timeout: float) -> list[FakePlacement]:
        deadline = self.clock.now + timeout
        while True:
            self._schedule()
            done = [p for p in placements if p.nodes is not None and not p.released]
            if len(done) == len(placements):
                return done
            later = [a.at for a in self._arrivals if a.at <= deadline]
            self._advance(min(later) if later else deadline)
            if not later:
                self._schedule()
                return [p for p in placements if p.nodes is not None and not p.released]

    def release(self, placement: FakePlacement) -> None:
        if placement.released:
            return
        placement.released = True
        if placement in self._pending:
            self._pending.remove(placement)
        if placement.nodes is not None:
            for node, cpus in zip(placement.nodes, placement.cpus, strict=True):
                node.free += cpus
        self._schedule()

    def nodes(self) -> list[NodeInfo]:
        now = self.clock.now
        return [
            NodeInfo(node_id=n.node_id, address="127.0.0.1", alive=n.died_at > now)
            for n in self._nodes
        ]

    def draining_nodes(self) -> set[str]:
        now = self.clock.now
        return {n.node_id for n in self._nodes if n.draining_at <= now < n.died_at}

    # -- time -------------------------------------------------------------------------------

    def _advance(self, t: float) -> None:
        if t == _NEVER:
            raise FakeUsageError("waiting forever: no call can return and no timeout was given")
        self.clock.advance_to(t)

    def _time_passed(self) -> None:
        """Carries out, in time order, every event due by now: nodes joining, timed actions
        (drains, requests), and the steps of the runs in flight."""
        now = self.clock.now
        while True:
            arrival = self._arrivals[0].at if self._arrivals else _NEVER
            action = min((t for t, _ in self._timed), default=_NEVER)
            run, at = None, _NEVER
            for r in self._live:
                t = self._next_at(r)
                if t < at:
                    run, at = r, t
            first = min(arrival, action, at)
            if first > now:
                return
            if run is not None and at == first:
                self._carry(run)
            elif arrival == first:
                joined = self._arrivals.pop(0)
                self._add_nodes(joined.count)
                self._fired(joined)
            else:
                i = min(range(len(self._timed)), key=lambda k: self._timed[k][0])
                _, act = self._timed.pop(i)
                act()

    def _progress(self, rank: _Rank, now: float) -> int:
        for run in reversed(rank.runs):
            if run.start <= now:
                return run.step0 + bisect.bisect_right(run.done_at, now)
        return rank.step

    # -- the cluster ------------------------------------------------------------------------

    def _add_nodes(self, count: int) -> None:
        start = len(self._nodes)
        for i in range(start, start + count):
            self._nodes.append(_Node(index=i, cpus=self.cpus_per_node, free=self.cpus_per_node))

    def _schedule(self) -> None:
        """Gives every pending placement whose bundles all fit its nodes (first fit, in the
        order requested), as Ray does; nodes that are dead or draining take no bundle."""
        now = self.clock.now
        usable = [n for n in self._nodes if n.died_at > now and n.draining_at > now]
        still: list[FakePlacement] = []
        for p in self._pending:
            taken: list[_Node] = []
            for cpus in p.cpus:
                node = next((n for n in usable if n.free >= cpus), None)
                if node is None:
                    break
                node.free -= cpus
                taken.append(node)
            if len(taken) == len(p.cpus):
                p.nodes = taken
            else:
                for node, cpus in zip(taken, p.cpus, strict=False):
                    node.free += cpus
                still.append(p)
        self._pending = still

    def _node_dies(self, node: _Node, at: float) -> None:
        node.died_at = min(node.died_at, at)
        node.free = 0.0
        for rank in self._ranks.values():
            if rank.node is node and rank.died_at > at:
                self._kill(rank, NODE_DIED, at=at)

    def _kill(self, rank: _Rank, cause: str, *, at: float) -> None:
        """The rank is gone from ``at``: its calls not answered by then fail with RankLost."""
        if rank.died_at <= at:
            return
        rank.died_at, rank.cause = at, cause
        for f in rank.pending:
            if f.done_at > at:
                f.due, f.after, f.error, f.blocked_from = at, None, _lost(rank), None

    # -- calls ------------------------------------------------------------------------------

    def _future(self, rank: _Rank, value: Any = None, *, due: float | None = None) -> _Future:
        now = self.clock.now
        if rank.died_at <= now:
            return _Future(rank.spec.rank, now, error=_lost(rank))
        at = now if due is None else due
        if rank.died_at <= at:
            return _Future(rank.spec.rank, rank.died_at, error=_lost(rank))
        return _Future(rank.spec.rank, at, value=value)

    def _answer(
        self, rank: _Rank, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> _Future:
        """A call on one rank that needs none of its peers."""
        spec = rank.spec
        if rank.died_at <= self.clock.now:
            return self._future(rank)
        if name == "build":
            info = RankInfo(
                rank=spec.rank, gang=spec.gang, node_id=rank.node.node_id, pid=0, device="cpu"
            )
            return self._future(rank, info, due=self.clock.now + self.build_s)
        if name == "join_replica_plane":
            rank.generation, rank.member = args[0], args[1]
            return self._future(rank)
        if name == "prepare":
            rank.prepared = max(rank.prepared, int(args[0]))
            return self._future(rank, 0.0)
        if name == "set_step":
            rank.step = int(args[0])
            return self._future(rank)
        if name == "step":
            return self._future(rank, rank.step)
        if name == "recover":
            abandoned, rank.in_flight = rank.in_flight, False
            rank.step += int(abandoned)
            trained, rank.log = tuple(rank.log), []
            report = RankReport(
                rank=spec.rank,
                step=rank.step,
                trained=trained,
                losses=(0.5,) * len(trained),
                abandoned_dense_update=abandoned,
            )
            return self._future(rank, report)
        if name == "replay":
            rank.replay.extendleft(reversed(args[0]))
            return self._future(rank, len(args[0]))
        if name == "set_shard":
            shard, replay = args[0], args[1]  # and the embedding-only ids (no dense in the fake)
            rank.stream, rank.pos = int(shard.index), 0
            rank.length = _length(shard, spec.config.data.batch_size)
            rank.replay = collections.deque(replay)
            return self._future(rank)
        if name == "abort_replica_planes":
            now = self.clock.now
            # Inside a step, its collectives fail now: the step fails for every rank of it.
            run = next((q for q in self._live if rank in q.states), None)
            if run is not None and run.begun == run.step0 + len(run.done_at) + 1:
                self._fail(run, run.begun, now, set(), {})
            for f in rank.pending:
                if f.blocked_from is not None and f.done_at > now:
                    f.due = max(now, f.blocked_from)
                    f.error = RankFailed(spec.rank, RuntimeError("replica plane aborted"))
                    f.blocked_from = None
            return self._future(rank)
        if name == "state_digest":
            copy = self._copies[spec.gang]
            shards = f"{spec.gang_rank}:{copy.base.digest:x}:{copy.own_digest:x}"
            return self._future(
                rank,
                {"shards": shards + (":off" if rank.corrupt else ""), "dense": f"{copy.dense:x}"},
            )
        if name == "set_streams":  # its own stream may end sooner now
            if rank.stream in args[0]:
                rank.length = stream_length(args[0][rank.stream])
            return self._future(rank)
        if name in ("join_sync_plan", "close", "settle_failed_step"):
            return self._future(rank)
        raise FakeUsageError(f"the fake rank has no method {name}")

    def _collective(
        self,
        name: str,
        states: list[_Rank],
        args_of: Callable[[int], tuple[Any, ...]],
        kwargs: dict[str, Any],
    ) -> dict[int, _Future]:
        """A call every rank of a group takes part in: all answer, or none does."""
        now = self.clock.now
        dead = [r for r in states if r.died_at <= now]
        if dead:
            return {
                r.spec.rank: (
                    self._future(r)
                    if r.died_at <= now
                    else _Future(
                        r.spec.rank,
                        now,
                        error=RankFailed(r.spec.rank, RuntimeError(f"{name}: a peer is gone")),
                    )
                )
                for r in states
            }
        gangs: dict[int, list[_Rank]] = {}
        for r in states:
            gangs.setdefault(r.gang, []).append(r)
        if name in ("save_checkpoint", "save"):
            if len(gangs) != 1:
                raise FakeUsageError(f"{name} is a collective of one gang, called on {list(gangs)}")
        else:
            self._check_plane(name, states, gangs)
        copies = {g: self._copies[g] for g in gangs}
        out: dict[int, Any] = {}
        if name == "sync":
            _synced(list(copies.values()))
            for r in states:  # an average is the same everywhere, an off weight included
                r.corrupt = False
        elif name in ("broadcast_state", "broadcast_dense"):
            src = int(args_of(states[0].spec.rank)[0])
            [source] = [g for g, ranks in gangs.items() if ranks[0].member == src]
            for g, copy in copies.items():
                if g == source:
                    continue
                if name == "broadcast_dense":
                    copy.dense = copies[source].dense
                else:
                    self._copies[g] = copies[source].clone()
            if name == "broadcast_state":
                for r in states:
                    if r.gang != source and not r.corrupt:
                        lie = next(
                            (
                                f
                                for f in self._faults
                                if isinstance(f, fake_faults.HealCorrupted)
                                and f.rank == r.spec.rank
                            ),
                            None,
                        )
                        if lie is not None:
                            r.corrupt = True
                            self._fired(lie)
        elif name == "save_checkpoint":
            [(gang, ranks)] = gangs.items()
            root, generation, extra = args_of(ranks[0].spec.rank)[:3]
            step = ranks[0].step
            uri = f"{root}/checkpoint_{step:06d}"
            self.checkpoints[uri] = (copies[gang].clone(), step, int(generation), dict(extra))
            out = {r.spec.rank: (step, uri) for r in ranks}
        elif name == "load_checkpoint":
            for r in states:
                uri, *rest = args_of(r.spec.rank)
                saved, step, generation, extra = self.checkpoints[uri]
                self._copies[r.gang] = saved.clone()
                start = rest[0] if rest and rest[0] is not None else step
                r.step, r.pos, r.replay, r.log, r.in_flight = (
                    step,
                    start,
                    collections.deque(),
                    [],
                    False,
                )
                out[r.spec.rank] = {"step": step, "generation": generation, "extra": extra}
        elif name == "save":
            [(gang, ranks)] = gangs.items()
            self.saved_models[str(args_of(ranks[0].spec.rank)[0])] = copies[gang].batches()
        return {r.spec.rank: self._future(r, out.get(r.spec.rank)) for r in states}

    def _check_plane(self, name: str, states: list[_Rank], gangs: dict[int, list[_Rank]]) -> None:
        """The ranks of a replica-plane collective must be every member of one plane."""
        generations = {r.generation for r in states}
        members = sorted({r.member for r in states})
        sizes = {len(ranks) for ranks in gangs.values()}
        if (
            len(generations) != 1
            or members != list(range(len(gangs)))
            or len(sizes) != 1
            or sizes.pop() != states[0].spec.gang_size
        ):
            raise FakeUsageError(
                f"{name} on ranks that are not one whole replica plane: generations "
                f"{sorted(generations)}, members {members} of gangs {sorted(gangs)}"
            )

    # -- training ---------------------------------------------------------------------------
    #
    # A ``train`` call is carried out as the clock passes its steps, not when it is made: a
    # rank killed mid-interval (by the coordinator, a node loss, a fault at another call) stops
    # the run at the step in progress, and the steps after it never happen.

    def _train(
        self,
        states: list[_Rank],
        args_of: Callable[[int], tuple[Any, ...]],
        *,
        seq: int = -1,
        after: int | None = None,
    ) -> dict[int, _Future]:
        now = self.clock.now
        n, ready = args_of(states[0].spec.rank)
        prev = self._runs.get(after) if after is not None else None
        if prev is not None and prev.failed:
            # A queued call behind a failed one does nothing, once that one has ended.
            run = _Run(step0=0, start=_NEVER, failed=True, live=False)
            self._runs[seq] = run
            for r in states:
                run.futures[r.spec.rank] = self._skipped(r, prev, now)
            return run.futures
        if prev is not None and prev.live:  # it starts where the one before it ends
            step0, start = prev.step0 + prev.n, prev.start + prev.n * prev.step_s
        else:
            steps = {r.step for r in states}
            if len(steps) != 1:
                raise FakeUsageError(f"train on ranks at different steps {sorted(steps)}")
            step0, start = steps.pop(), now if prev is None else max(now, prev.end)
        step_s = max(r.step_s for r in states)
        run = _Run(
            step0=step0, start=start, states=states, n=int(n), step_s=step_s, ready=int(ready)
        )
        run.after = prev if prev is not None and prev.live else None
        self._runs[seq] = run
        old = self._runs.pop(seq - 4, None)
        if old is not None:  # nothing is queued behind it any more; ranks keep its timeline
            old.futures.clear()
        for r in states:
            run.gangs.setdefault(r.gang, []).append(r)
            r.runs = [*r.runs[-2:], run]
            run.futures[r.spec.rank] = self._future(r, due=start + run.n * step_s)
        self._live.append(run)
        self._time_passed()  # its first step may start now
        return run.futures

    def _next_at(self, run: _Run) -> float:
        """When ``run``'s next event is due: a step starts, one ends, or a rank of it died."""
        if run.after is not None and run.after.live:
            return _NEVER  # it starts once the one before it has ended
        i = len(run.done_at)
        t = run.start + i * run.step_s
        if i == run.n or run.begun <= run.step0 + i:
            return t  # it ends, or step i + 1 starts
        died = min(r.died_at for r in run.states)
        return max(t, min(run.start + (i + 1) * run.step_s, died))

    def _carry(self, run: _Run) -> None:
        """Carries out ``run``'s next event (:meth:`_next_at`)."""
        i = len(run.done_at)
        ts = run.start + i * run.step_s  # not summed step by step: the calls end on time
        if i == run.n:
            self._finish(run, ts)
            return
        s = run.step0 + i + 1
        if run.begun < s:
            run.begun = s
            hung, errors = self._faults_at(s, ts, run)
            if hung or errors or any(r.died_at <= ts for r in run.states):
                self._fail(run, s, ts, hung, errors)
            return
        te = run.start + (i + 1) * run.step_s
        died = min(r.died_at for r in run.states)
        if died < te:  # a rank died during the step: the others wait for it in a collective
            self._fail(run, s, max(ts, died), set(), {})
            return
        for gang, ranks in run.gangs.items():
            copy = self._copies[gang]
            for r in ranks:
                b = r.take()
                r.log.append((s, b))
                copy.add(b)
            copy.dense = _mix(copy.dense ^ s)
        for r in run.states:
            r.step = s
        run.done_at.append(te)
        sync = run.states[0].spec.config.sync
        if s % sync.sync_every == 0 or s <= sync.warmup_steps:
            _synced([self._copies[g] for g in run.gangs])
            for r in run.states:
                r.corrupt = False
        self._fire_at(s, te)

    def _finish(self, run: _Run, t: float) -> None:
        """Every step of ``run`` is done (at ``t``): each rank reports what it trained."""
        run.live, run.end = False, t
        self._live.remove(run)
        for r in run.states:
            r.prepared = max(r.prepared - run.n, run.ready)
            trained, r.log = tuple(r.log), []
            future = run.futures[r.spec.rank]
            if future.error is None:
                future.value = RankReport(
                    rank=r.spec.rank,
                    step=r.step,
                    trained=trained,
                    losses=(0.5,) * run.n,
                    rows=run.n * r.spec.config.data.batch_size,
                    seconds=t - run.start,
                    ready=r.prepared,
                    idle_s=None if r.last_end is None else run.start - r.last_end,
                )
            r.last_end = t

    def _fail(self, run: _Run, s: int, t: float, hung: set[int], errors: dict[int, float]) -> None:
        """Step ``s`` of ``run`` fails at ``t``: dead ranks' calls fail when they died, hung
        ones' never return, and the others take the step's batch, update their embeddings and
        wait in a collective for the rest."""
        run.live, run.failed, run.end = False, True, t
        self._live.remove(run)
        now = self.clock.now
        for r in run.states:
            rank, future = r.spec.rank, run.futures[r.spec.rank]
            future.after, future.value = None, None
            if r.died_at <= now:  # its call fails when it dies
                future.due, future.error, future.blocked_from = r.died_at, _lost(r), None
                continue
            if rank in hung:
                r.hung_at = t
                future.due, future.error, future.blocked_from = _NEVER, None, None
                continue
            b = r.take()
            r.log.append((s, b))
            self._copies[r.gang].add(b)
            r.in_flight = True
            if rank in errors:
                cause = TimeoutError("a collective timed out")
                future.due, future.blocked_from = t + errors[rank], None
            else:
                cause = TimeoutError(f"collective timed out after {self._collective_timeout_s}s")
                future.due, future.blocked_from = t + self._collective_timeout_s, t
            future.error = RankFailed(rank, cause)
        self._fail_queued(run, t)

    def _fail_queued(self, run: _Run, t: float) -> None:
        """The calls queued behind the skipped ``run`` are skipped too."""
        for queued in [q for q in self._live if q.after is run]:
            queued.live, queued.failed, queued.start = False, True, _NEVER
            self._live.remove(queued)
            for r in queued.states:
                skipped = self._skipped(r, run, t)
                future = queued.futures[r.spec.rank]
                future.due, future.value, future.error = skipped.due, skipped.value, skipped.error
                future.after = skipped.after
            self._fail_queued(queued, t)

    def _skipped(self, rank: _Rank, prev: _Run, t: float) -> _Future:
        """A queued call behind the failed ``prev``: it trains nothing, once ``prev`` ended."""
        f = self._future(rank, RankReport(rank=rank.spec.rank, step=rank.step, skipped=True), due=t)
        f.after = prev.futures.get(rank.spec.rank)
        return f

    def _fire_at(self, step: int, t: float) -> None:
        """Schedules the drains and actions due once ``step`` is done (at ``t``)."""
        for f in [
            f
            for f in self._faults
            if isinstance(f, fake_faults.NodeDrains | fake_faults.AtStep) and f.step == step
        ]:
            self._faults.remove(f)
            if isinstance(f, fake_faults.NodeDrains):
                if f.node < len(self._nodes):  # else no such node (yet): nothing drains
                    self._fired(f)
                    self._timed.append((t, _drain(self._nodes[f.node], t)))
                continue
            self._fired(f)
            self._timed.append((t, f.action))

    def _faults_at(self, s: int, t: float, run: _Run) -> tuple[set[int], dict[int, float]]:
        """Carries out the faults due as step ``s`` of ``run`` starts (at ``t``): deaths at
        once; the ranks that hang, and those whose collective fails after some seconds."""
        here = {r.spec.rank for r in run.states}
        due = [
            f
            for f in self._faults
            if isinstance(
                f,
                fake_faults.RankDies
                | fake_faults.NodeDies
                | fake_faults.RankHangs
                | fake_faults.RankFails,
            )
            and f.step == s
        ]
        hung: set[int] = set()
        errors: dict[int, float] = {}
        for f in due:
            if isinstance(f, fake_faults.NodeDies):
                self._faults.remove(f)
                if f.node < len(self._nodes):  # else no such node (yet): nothing dies
                    self._fired(f)
                    self._node_dies(self._nodes[f.node], t)
            elif isinstance(f, fake_faults.RankHangs) and (f.rank is None or f.rank in here):
                self._faults.remove(f)
                self._fired(f)
                hung |= here if f.rank is None else {f.rank}
            elif isinstance(f, fake_faults.RankDies) and f.rank in here:
                self._faults.remove(f)
                self._fired(f)
                self._kill(self._ranks[f.rank], "ActorDiedError: the rank's process exited", at=t)
            elif isinstance(f, fake_faults.RankFails) and f.rank in here:
                self._faults.remove(f)
                self._fired(f)
                errors[f.rank] = f.after_s
        return hung, errors


def _fresh(error: BaseException) -> BaseException:
    """A new exception for each ``result()``, as Ray's ``get`` raises: one raised again and again
    would collect a traceback per raise, and keep every frame in them alive."""
    if isinstance(error, RankLost):
        return RankLost(error.rank, error.cause, node_died=error.node_died)
    if isinstance(error, RankFailed):
        return RankFailed(error.rank, error.cause)
    return error


def _length(shard: object, batch_size: int) -> float:
    """Batches a shard's stream holds: a re-shared source's (Parquet read by index) are
    finite; the others' are endless."""
    stream = getattr(shard, "stream", None)
    if stream is None or not hasattr(shard, "num_shards"):
        return _NEVER
    return stream_length(stream(batch_size))


def _at_call(fault: fake_faults.Fault | fake_faults.NodesJoin) -> bool:
    return isinstance(fault, fake_faults.CallFault) and fault.on is not None


def _drain(node: _Node, at: float) -> Callable[[], None]:
    def mark() -> None:
        node.draining_at = at

    return mark


#: Calls that are collectives over a replica plane or a gang.
_COLLECTIVES = frozenset(
    {"sync", "broadcast_state", "broadcast_dense", "save_checkpoint", "load_checkpoint", "save"}
)
