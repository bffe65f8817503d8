"""An in-process worker group: the real control loop without Ray.

:class:`FakeWorkerGroup` implements :class:`~raytrec.elastic.workers.WorkerGroup` with fake ranks
(:class:`~simulation.doubles.fake_rank.FakeRank`) that "train" by taking batch ids from their
streams (replays first, as a real feed does) and return well-formed rank reports; no process,
no process group. Its clock (``ManualClock``) advances only when the coordinator sleeps or waits:
minutes of job time run in milliseconds and every timeout is exact.

What the fake models, and where:

- **Training** (:mod:`simulation.doubles.fake_training`): lockstep steps carried out as the clock
  passes them.
- **State** (:mod:`simulation.doubles.fake_model`): each gang holds one model copy. Syncs merge the
  gangs' copies, ``broadcast_state`` copies a member's, checkpoints save and load it, and
  ``state_digest`` hashes it, so heal verification and the final replica check behave as on real
  ranks; :meth:`FakeWorkerGroup.model_batches` says which batches the final model holds.
- **Faults**, from a schedule (:mod:`simulation.doubles.fake_faults`). A rank or node that dies as
  a step starts fails its call at once; the ranks waiting for it in that step's collectives fail
  when the coordinator aborts their replica planes, or after ``collective_timeout_s``. A hung
  rank's call never returns and its heartbeat stops.
- **Placement** (:mod:`simulation.doubles.fake_cluster`): a placement is ready once every bundle
  fits on a live node of ``cpus_per_node`` CPUs, not draining, that its node-id selector admits
  (first fit), which may be never.

Calls the coordinator must not make (a collective on part of a replica plane, a call on a rank
never started) raise :class:`FakeUsageError`: real ranks would hang or crash.
"""

from __future__ import annotations

import bisect
import collections
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

from raytrec.checkpoint.layout import checkpoint_name
from raytrec.elastic.rank_protocol import LoadedCheckpoint, RankProtocol
from raytrec.elastic.workers import NODE_DIED, Answer, RankFailed, RankLost
from simulation.doubles import fake_faults
from simulation.doubles.fake_cluster import FakeCluster
from simulation.doubles.fake_model import EMPTY, FakeUsageError, ModelCopy, mix, sync_copies
from simulation.doubles.fake_rank import (
    NEVER,
    FakeAnswer,
    FakeNode,
    FakePlacement,
    FakeRank,
    Op,
    OpKind,
    RankState,
    Run,
    stream_batches,
)
from simulation.doubles.fake_training import TrainingRuns

if TYPE_CHECKING:
    from raytrec.data.source import BatchShard
    from raytrec.engine.rank_engine import RankSpec, StoreAddress

__all__ = ["FakePlacement", "FakeUsageError", "FakeWorkerGroup"]

R = TypeVar("R")


class FakeWorkerGroup(FakeCluster, TrainingRuns):
    """Fake ranks on fake nodes, driven by a :class:`~simulation.doubles.fake_faults.ManualClock`
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
        self._nodes: list[FakeNode] = []
        self._add_nodes(nodes)
        schedule = list(faults)
        self._arrivals = sorted(
            (f for f in schedule if isinstance(f, fake_faults.NodesJoin)), key=lambda f: f.at
        )
        self._faults: list[fake_faults.Fault] = [
            f for f in schedule if not isinstance(f, fake_faults.NodesJoin)
        ]
        self._slow = {f.rank: f.step_s for f in self._faults if isinstance(f, fake_faults.SlowRank)}
        self._slow_until = {
            f.rank: f.until_step
            for f in self._faults
            if isinstance(f, fake_faults.SlowRank) and f.until_step is not None
        }
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
        self._ranks: dict[int, RankState] = {}
        self.copies: dict[int, ModelCopy] = {}  # gang id -> its model copy
        self._runs: dict[int, Run] = {}  # train call seq -> its run
        self._live: list[Run] = []  # runs with steps still to carry out, in call order
        self._collective_timeout_s = NEVER
        self.checkpoints: dict[str, tuple[ModelCopy, int, int, dict[str, Any]]] = {}
        self.saved_models: dict[str, collections.Counter[int]] = {}
        self.killed: list[int] = []  # ranks the coordinator killed, in order
        self.cpu_s = 0.0  # the fake's own CPU time (a benchmark subtracts it)

    # -- what tests read --------------------------------------------------------------------

    def model_batches(self, path: str) -> collections.Counter[int]:
        """The batches in the model saved at ``path`` (``RankWorker.save``), with multiplicity."""
        return self.saved_models[path]

    def held_out(self, rank: int) -> tuple[list[int], list[int]]:
        """The held-out batch ids rank ``rank`` was sent to read ahead, and those it scored
        (padding rounds included), in the order of the calls."""
        s = self._ranks[rank]
        return list(s.read_ahead), list(s.scored)

    def node_of(self, rank: int) -> int:
        """The fake node index rank ``rank`` runs on."""
        return self._ranks[rank].node.index

    # -- WorkerGroup ------------------------------------------------------------------------

    def host_store(self) -> StoreAddress:
        from raytrec.engine.rank_engine import StoreAddress

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
        rank = RankState(
            spec=spec,
            node=node,
            stream=int(getattr(shard, "index", spec.rank)),
            length=stream_batches(shard, spec.config.data.batch_size),
            step_s=self._slow.get(spec.rank, self.step_s),
        )
        for f in self._faults:
            if isinstance(f, fake_faults.SlowRank) and f.rank == spec.rank:
                self._fired(f)
        if node.died_at <= self.clock.now:
            rank.died_at, rank.cause = node.died_at, NODE_DIED
        self._ranks[spec.rank] = rank
        if spec.gang not in self.copies:  # every gang starts from a model of its own
            self.copies[spec.gang] = ModelCopy(EMPTY, [], 0, mix(spec.gang + 1))
        self.cpu_s += time.process_time() - t0

    def call(
        self, ranks: Sequence[int], invoke: Callable[[RankProtocol, int], R]
    ) -> dict[int, Answer[R]]:
        t0 = time.process_time()
        for r in ranks:
            if r not in self._ranks:
                raise FakeUsageError(f"a call on rank {r}, which was never started")
        states = [self._ranks[r] for r in ranks]
        ops: dict[int, Op] = {
            r: cast(Op, invoke(cast(RankProtocol, FakeRank(self, self._ranks[r])), r))
            for r in ranks
        }
        if not ops:
            return {}
        if next(iter(ops.values())).kind is OpKind.PLAN:
            out = self._plan(states, ops)
        else:
            out = self._carry_out(states, ops)
        self.cpu_s += time.process_time() - t0
        return cast(dict[int, Answer[R]], out)

    def _plan(self, states: list[RankState], ops: Mapping[int, Op]) -> dict[int, FakeAnswer[Any]]:
        """A ``reform`` call: its parts carried out in order as the calls they stand for, as if
        the coordinator had made them one after the other; the first part that fails or does
        not end at once on some rank ends the call (the coordinator would have stopped there).
        A rank's answer is its answer to the last part it took part in."""
        out = {r.spec.rank: self.answer(r) for r in states}
        for name in _PLAN_ORDER:
            part = {r: p for r, op in ops.items() for p in op.parts if p.method == name}
            if not part:
                continue
            answers = self._carry_out([s for s in states if s.spec.rank in part], part)
            out.update(answers)
            now = self.clock.now
            if any(a.done_at > now or a.error is not None for a in answers.values()):
                break
            self._time_passed()  # what the coordinator's wait between the calls did
        return out

    def _carry_out(
        self, states: list[RankState], ops: Mapping[int, Op]
    ) -> dict[int, FakeAnswer[Any]]:
        """One call of one method on ``states``: its faults, then its answers."""
        [name] = {op.method for op in ops.values()}
        kind = next(iter(ops.values())).kind
        now = self.clock.now
        out: dict[int, FakeAnswer[Any]] = {}
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
                        broke = kind in (OpKind.GANG, OpKind.PLANE)
                    else:
                        f.action()
            self._time_passed()  # a run a rank died in stops now
        if kind is OpKind.TRAIN:
            out = self._train(states, ops)
        elif hung:
            out = self._hang(states, hung, ops)
        elif broke:
            error = RuntimeError("Application timeout caused pair closure")
            out = {
                r.spec.rank: FakeAnswer(r.spec.rank, now, error=RankFailed(r.spec.rank, error))
                for r in states
            }
        elif kind is OpKind.ALONE:
            out = {r.spec.rank: self._alone(r, ops[r.spec.rank]) for r in states}
        else:
            out = self._collective(states, ops)
        for rank in states:
            answer = out[rank.spec.rank]
            answer.method = name
            rank.pending = [f for f in rank.pending if f.done_at > now]
            rank.pending.append(answer)
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
        self, states: list[RankState], hung: set[int], ops: Mapping[int, Op]
    ) -> dict[int, FakeAnswer[Any]]:
        """A call that never returns on the ``hung`` ranks; in a collective, the others wait
        for them until the collective times out, then fail."""
        now = self.clock.now
        out: dict[int, FakeAnswer[Any]] = {}
        for r in states:
            rank, op = r.spec.rank, ops[r.spec.rank]
            if r.died_at <= now:
                out[rank] = self.answer(r)
            elif rank in hung:
                r.hung_at = min(r.hung_at, now)
                out[rank] = FakeAnswer(rank, NEVER)
            elif op.kind is not OpKind.ALONE:
                cause = TimeoutError(f"{op.method} timed out after {self._collective_timeout_s}s")
                out[rank] = FakeAnswer(
                    rank,
                    now + self._collective_timeout_s,
                    error=RankFailed(rank, cause),
                    blocked_from=now,
                )
            else:
                out[rank] = self._alone(r, op)
        return out

    def wait(
        self, answers: Sequence[Answer[Any]], *, num_returns: int, timeout: float
    ) -> list[Answer[Any]]:
        t0 = time.process_time()
        if not answers:
            return []
        futures = [cast(FakeAnswer[Any], f) for f in answers]
        self._time_passed()
        deadline = self.clock.now + timeout
        while True:  # a call may end later than it was due when a fault strikes meanwhile
            now = self.clock.now
            due = sorted(f.done_at for f in futures)
            target = due[min(num_returns, len(due)) - 1]
            self._advance(min(max(target, now), deadline))
            t = self.clock.now
            done: list[Answer[Any]] = [f for f in futures if f.done_at <= t]
            if len(done) >= min(num_returns, len(futures)) or t >= deadline:
                break
        self.cpu_s += time.process_time() - t0
        return done

    def result(self, answer: Answer[R]) -> R:
        future = cast(FakeAnswer[R], answer)
        if future.done_at > self.clock.now:
            raise FakeUsageError(f"result() of rank {future.rank}'s call before it is done")
        if future.error is not None:
            raise _fresh(future.error)
        if future.after is not None and isinstance(future.after.error, RankLost):
            raise _fresh(future.after.error)  # a call queued on a rank that died
        return cast(R, future.value)

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

    # -- time -------------------------------------------------------------------------------

    def _advance(self, t: float) -> None:
        if t == NEVER:
            raise FakeUsageError("waiting forever: no call can return and no timeout was given")
        self.clock.advance_to(t)

    def _time_passed(self) -> None:
        """Carries out, in time order, every event due by now: nodes joining, timed actions
        (drains, requests), and the steps of the runs in flight."""
        now = self.clock.now
        while True:
            arrival = self._arrivals[0].at if self._arrivals else NEVER
            action = min((t for t, _ in self._timed), default=NEVER)
            run, at = None, NEVER
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

    def _progress(self, rank: RankState, now: float) -> int:
        for run in reversed(rank.runs):
            if run.start <= now:
                return run.step0 + bisect.bisect_right(run.done_at, now)
        return rank.step

    def _kill(self, rank: RankState, cause: str, *, at: float) -> None:
        """The rank is gone from ``at``: its calls not answered by then fail with RankLost."""
        if rank.died_at <= at:
            return
        rank.died_at, rank.cause = at, cause
        for f in rank.pending:
            if f.done_at > at:
                f.due, f.after, f.error, f.blocked_from = at, None, rank.lost(), None

    # -- calls ------------------------------------------------------------------------------

    def answer(
        self, rank: RankState, value: Any = None, *, due: float | None = None
    ) -> FakeAnswer[Any]:
        """``rank``'s answer ``value``, due now or at ``due``; it fails if the rank is dead by
        then."""
        now = self.clock.now
        if rank.died_at <= now:
            return FakeAnswer(rank.spec.rank, now, error=rank.lost())
        at = now if due is None else due
        if rank.died_at <= at:
            return FakeAnswer(rank.spec.rank, rank.died_at, error=rank.lost())
        return FakeAnswer(rank.spec.rank, at, value=value)

    def _alone(self, rank: RankState, op: Op) -> FakeAnswer[Any]:
        """A call ``rank`` answers by itself (:func:`~simulation.doubles.fake_rank.alone`)."""
        if rank.died_at <= self.clock.now:
            return self.answer(rank)
        assert op.run is not None
        value = op.run()
        return value if isinstance(value, FakeAnswer) else self.answer(rank, value)

    def _collective(
        self, states: list[RankState], ops: Mapping[int, Op]
    ) -> dict[int, FakeAnswer[Any]]:
        """A call every rank of a group takes part in: all answer, or none does."""
        now = self.clock.now
        op = ops[states[0].spec.rank]
        dead = [r for r in states if r.died_at <= now]
        if dead:
            return {
                r.spec.rank: (
                    self.answer(r)
                    if r.died_at <= now
                    else FakeAnswer(
                        r.spec.rank,
                        now,
                        error=RankFailed(r.spec.rank, RuntimeError(f"{op.method}: a peer is gone")),
                    )
                )
                for r in states
            }
        gangs = _by_gang(states)
        if op.kind is OpKind.GANG:
            if len(gangs) != 1:
                raise FakeUsageError(
                    f"{op.method} is a collective of one gang, called on {list(gangs)}"
                )
        else:
            self._check_plane(op.method, states, gangs)
        assert op.together is not None
        values = op.together(states, ops)
        return {r.spec.rank: self.answer(r, values.get(r.spec.rank)) for r in states}

    # -- collectives (each returns the ranks' answer values) ---------------------------------

    def sync_all(self, states: list[RankState], ops: Mapping[int, Op]) -> dict[int, Any]:
        back = ops[states[0].spec.rank].args[0]  # rolled back: their copies add nothing
        gangs = _by_gang(states).items()
        out = {i for i, (_, ranks) in enumerate(gangs) if ranks[0].member in back}
        sync_copies([self.copies[g] for g, _ in gangs], without=out)
        for r in states:  # an average is the same everywhere, an off weight included
            r.corrupt = False
        return {}

    def broadcast_all(self, states: list[RankState], ops: Mapping[int, Op]) -> dict[int, Any]:
        """``broadcast_state``: every gang takes the source member's copy; a rank whose heal
        lies (``HealCorrupted``) ends up off."""
        source = self._source(states, ops)
        for g in _by_gang(states):
            if g != source:
                self.copies[g] = self.copies[source].clone()
        for r in states:
            if r.gang != source and not r.corrupt:
                lie = next(
                    (
                        f
                        for f in self._faults
                        if isinstance(f, fake_faults.HealCorrupted) and f.rank == r.spec.rank
                    ),
                    None,
                )
                if lie is not None:
                    r.corrupt = True
                    self._fired(lie)
        return {}

    def broadcast_dense_all(self, states: list[RankState], ops: Mapping[int, Op]) -> dict[int, Any]:
        source = self._source(states, ops)
        for g in _by_gang(states):
            self.copies[g].dense = self.copies[source].dense
        return {}

    def save_checkpoint(self, states: list[RankState], ops: Mapping[int, Op]) -> dict[int, Any]:
        [(gang, ranks)] = _by_gang(states).items()
        root, generation, extra = ops[ranks[0].spec.rank].args[:3]
        step = ranks[0].step
        uri = f"{root}/{checkpoint_name(step)}"  # where a real save commits it
        self.checkpoints[uri] = (self.copies[gang].clone(), step, int(generation), dict(extra))
        return {r.spec.rank: (step, uri) for r in ranks}

    def load_checkpoint(self, states: list[RankState], ops: Mapping[int, Op]) -> dict[int, Any]:
        out: dict[int, Any] = {}
        for r in states:
            uri, start = ops[r.spec.rank].args
            saved, step, generation, extra = self.checkpoints[uri]
            self.copies[r.gang] = saved.clone()
            r.step, r.replay, r.log, r.in_flight = step, collections.deque(), [], False
            r.pos = step if start is None else start
            out[r.spec.rank] = LoadedCheckpoint(step=step, generation=generation, extra=extra)
        return out

    def save_model(self, states: list[RankState], ops: Mapping[int, Op]) -> dict[int, Any]:
        [(gang, ranks)] = _by_gang(states).items()
        self.saved_models[str(ops[ranks[0].spec.rank].args[0])] = self.copies[gang].batches()
        return {}

    def _source(self, states: list[RankState], ops: Mapping[int, Op]) -> int:
        """The gang of the member a broadcast names as its source."""
        src = int(ops[states[0].spec.rank].args[0])
        [source] = [g for g, ranks in _by_gang(states).items() if ranks[0].member == src]
        return source

    def _check_plane(
        self, name: str, states: list[RankState], gangs: dict[int, list[RankState]]
    ) -> None:
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


#: The order in which a ``reform`` call carries out its parts (:class:`ReformPlan`).
_PLAN_ORDER = (
    "replay",
    "join_replica_plane",
    "join_sync_plan",
    "set_step",
    "sync",
    "broadcast_state",
    "broadcast_dense",
    "settle_failed_step",
)


def _fresh(error: BaseException) -> BaseException:
    """A new exception for each ``result()``, as Ray's ``get`` raises: one raised again and again
    would collect a traceback per raise, and keep every frame in them alive."""
    if isinstance(error, RankLost):
        return RankLost(error.rank, error.cause, node_died=error.node_died)
    if isinstance(error, RankFailed):
        return RankFailed(error.rank, error.cause)
    return error


def _at_call(fault: fake_faults.Fault | fake_faults.NodesJoin) -> bool:
    return isinstance(fault, fake_faults.CallFault) and fault.on is not None


def _by_gang(states: list[RankState]) -> dict[int, list[RankState]]:
    gangs: dict[int, list[RankState]] = {}
    for r in states:
        gangs.setdefault(r.gang, []).append(r)
    return gangs
