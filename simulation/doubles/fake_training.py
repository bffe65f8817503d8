"""The fake ranks' training: a ``train`` call's steps, carried out as the clock passes them.

The live ranks train in lockstep (dense gradients are averaged every step), one step per
``step_s`` of clock time, at the pace of the slowest rank; syncs happen at the sync plan's steps
(a hierarchical schedule's lower levels average their groups). A call's steps happen as the
clock passes them, not when it is made: a rank that dies or is killed, or a replica plane
aborted, in the middle of a step fails that step for every rank of the call (the others take the
step's batch, update their embeddings and wait in a collective), and the steps after it never
happen. Faults scheduled at a step (:mod:`simulation.doubles.fake_faults`) strike as it starts. A
rank slower per step than the others by more than ``collective_timeout_s`` fails every step:
the others' collectives time out waiting for it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from raytrec.elastic.report import RankReport
from raytrec.elastic.workers import RankFailed
from simulation.doubles import fake_faults
from simulation.doubles.fake_model import (
    FakeUsageError,
    ModelCopy,
    average_group,
    mix,
    sync_copies,
)
from simulation.doubles.fake_rank import NEVER, FakeAnswer, FakeNode, Op, RankState, Run

if TYPE_CHECKING:
    from simulation.doubles.fake_faults import ManualClock

__all__ = ["TrainingRuns"]


class TrainingRuns:
    """The worker group's training (module doc), as a part of
    :class:`~simulation.doubles.fake_group.FakeWorkerGroup`: the group's state it works on is
    declared here."""

    clock: ManualClock
    copies: dict[int, ModelCopy]
    _ranks: dict[int, RankState]
    _nodes: list[FakeNode]
    _faults: list[fake_faults.Fault]
    _timed: list[tuple[float, Callable[[], object]]]
    _slow_until: dict[int, int]
    step_s: float
    _runs: dict[int, Run]
    _live: list[Run]
    _collective_timeout_s: float

    def answer(
        self, rank: RankState, value: Any = None, *, due: float | None = None
    ) -> FakeAnswer[Any]:
        raise NotImplementedError

    def _time_passed(self) -> None:
        raise NotImplementedError

    def _fired(self, fault: fake_faults.Fault | fake_faults.NodesJoin) -> None:
        raise NotImplementedError

    def _kill(self, rank: RankState, cause: str, *, at: float) -> None:
        raise NotImplementedError

    def _node_dies(self, node: FakeNode, at: float) -> None:
        raise NotImplementedError

    def abort_step(self, rank: RankState) -> None:
        """``rank``'s replica planes are aborted: inside a step, the step fails now for every
        rank of its call."""
        run = next((q for q in self._live if rank in q.states), None)
        if run is not None and run.begun == run.step0 + len(run.done_at) + 1:
            self._fail(run, run.begun, self.clock.now, set(), {})

    def _train(self, states: list[RankState], ops: Mapping[int, Op]) -> dict[int, FakeAnswer[Any]]:
        now = self.clock.now
        op = ops[states[0].spec.rank]
        n, ready = op.args
        seq, after = op.kwargs["seq"], op.kwargs["after"]
        prev = self._runs.get(after) if after is not None else None
        if prev is not None and prev.failed:
            # A queued call behind a failed one does nothing, once that one has ended.
            run = Run(step0=0, start=NEVER, failed=True, live=False)
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
        for r in states:  # a slow rank's slowness that ended (SlowRank.until_step)
            if step0 >= self._slow_until.get(r.spec.rank, step0 + 1):
                r.step_s = self.step_s
        step_s = max(r.step_s for r in states)
        run = Run(
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
            run.futures[r.spec.rank] = self.answer(r, due=start + run.n * step_s)
        self._live.append(run)
        self._time_passed()  # its first step may start now
        return run.futures

    def _next_at(self, run: Run) -> float:
        """When ``run``'s next event is due: a step starts, one ends, or a rank of it died."""
        if run.after is not None and run.after.live:
            return NEVER  # it starts once the one before it has ended
        i = len(run.done_at)
        t = run.start + i * run.step_s
        if i == run.n or run.begun <= run.step0 + i:
            return t  # it ends, or step i + 1 starts
        died = min(r.died_at for r in run.states)
        return max(t, min(run.start + (i + 1) * run.step_s, died))

    def _carry(self, run: Run) -> None:
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
            if not (hung or errors) and run.step_s - min(r.step_s for r in run.states) > (
                self._collective_timeout_s
            ):
                # The others wait for the slowest rank in the step's collectives for longer than
                # their timeout: they fail, and the slowest find them gone when they get there.
                errors = {
                    r.spec.rank: (
                        r.step_s + self._collective_timeout_s
                        if r.step_s < run.step_s
                        else run.step_s
                    )
                    for r in run.states
                }
            if hung or errors or any(r.died_at <= ts for r in run.states):
                self._fail(run, s, ts, hung, errors)
                for r in run.states:  # those waiting for the slowest: an abort releases them
                    future = run.futures[r.spec.rank]
                    if r.step_s < run.step_s and future.error is not None and future.due > ts:
                        future.blocked_from = ts + r.step_s
            return
        te = run.start + (i + 1) * run.step_s
        died = min(r.died_at for r in run.states)
        if died < te:  # a rank died during the step: the others wait for it in a collective
            self._fail(run, s, max(ts, died), set(), {})
            return
        for gang, ranks in run.gangs.items():
            copy = self.copies[gang]
            for r in ranks:
                b = r.take()
                r.log.append((s, b))
                copy.add(b)
            copy.dense = mix(copy.dense ^ s)
        for r in run.states:
            r.step = s
        run.done_at.append(te)
        for group in _groups_due(run.states[0], s, tuple(run.gangs)):
            members = [g for g in group if g in run.gangs]
            if len(members) == len(run.gangs):
                sync_copies([self.copies[g] for g in members])
            else:  # a lower level of a hierarchical schedule
                average_group([self.copies[g] for g in members])
            for r in run.states:  # an average is the same everywhere, an off weight included
                if r.gang in members:
                    r.corrupt = False
        self._fire_at(s, te)

    def _finish(self, run: Run, t: float) -> None:
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
                    # A rank faster than the pace waited for the slowest in collectives.
                    sync_s=max(0.0, run.step_s - r.step_s) * run.n,
                    ready=r.prepared,
                    idle_s=None if r.last_end is None else run.start - r.last_end,
                )
            r.last_end = t

    def _fail(self, run: Run, s: int, t: float, hung: set[int], errors: dict[int, float]) -> None:
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
                future.due, future.error, future.blocked_from = r.died_at, r.lost(), None
                continue
            if rank in hung:
                r.hung_at = t
                future.due, future.error, future.blocked_from = NEVER, None, None
                continue
            b = r.take()
            r.log.append((s, b))
            self.copies[r.gang].add(b)
            r.in_flight = True
            if rank in errors:
                cause = TimeoutError("a collective timed out")
                future.due, future.blocked_from = t + errors[rank], None
            else:
                cause = TimeoutError(f"collective timed out after {self._collective_timeout_s}s")
                future.due, future.blocked_from = t + self._collective_timeout_s, t
            future.error = RankFailed(rank, cause)
        self._fail_queued(run, t)

    def _fail_queued(self, run: Run, t: float) -> None:
        """The calls queued behind the skipped ``run`` are skipped too."""
        for queued in [q for q in self._live if q.after is run]:
            queued.live, queued.failed, queued.start = False, True, NEVER
            self._live.remove(queued)
            for r in queued.states:
                skipped = self._skipped(r, run, t)
                future = queued.futures[r.spec.rank]
                future.due, future.value, future.error = skipped.due, skipped.value, skipped.error
                future.after = skipped.after
            self._fail_queued(queued, t)

    def _skipped(self, rank: RankState, prev: Run, t: float) -> FakeAnswer[Any]:
        """A queued call behind the failed ``prev``: it trains nothing, once ``prev`` ended."""
        f = self.answer(rank, RankReport(rank=rank.spec.rank, step=rank.step, skipped=True), due=t)
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

    def _faults_at(self, s: int, t: float, run: Run) -> tuple[set[int], dict[int, float]]:
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


def _groups_due(rank: RankState, step: int, gangs: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """The groups of ``gangs`` that average after ``step``, by the sync plan ``rank`` joined."""
    plan = rank.plan
    if plan is not None and plan.generation == rank.generation:
        return plan.decide(step).groups
    sync = rank.spec.config.sync  # no plan joined: the job-wide schedule
    if step % sync.sync_every == 0 or step <= sync.warmup_steps:
        return (gangs,)
    return ()


def _drain(node: FakeNode, at: float) -> Callable[[], None]:
    def mark() -> None:
        node.draining_at = at

    return mark
