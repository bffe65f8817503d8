"""The job's live ranks as the loop and its parts use them.

Which ranks are live and in which gang, building ranks, forming a generation (replica planes and
sync plan, one call per rank), booking what ranks trained, a job-wide sync and the final replica
check: the plumbing every part of the job goes through, kept apart from the loop that decides
when to use it (:mod:`actors.coordinator`). What it changes in the job's shared state is an
outcome handed to ``apply`` (:mod:`actors.job`).

Control calls (build, join, sync, prepare, recover: :class:`ControlCalls`) are not what hang
detection watches (that is :meth:`actors.recovery.FailureRecovery.collect`'s job): each waits up
to a timeout for every rank's answer, and a rank whose answer does not come counts as hung.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeVar

from actors.job import Booked, Committed, JobView, Outcome
from actors.nodes import JobNodes
from raytrec.config import SyncConfig
from raytrec.elastic.accounting import last_job_wide_sync
from raytrec.elastic.events import EventLog, GenerationStarted
from raytrec.elastic.heal import replicas_disagree
from raytrec.elastic.rank_protocol import GenerationPlan, RankProtocol, ReformPlan, StateDigest
from raytrec.elastic.report import RankInfo, RankReport
from raytrec.elastic.workers import (
    Answer,
    Clock,
    RankCallError,
    RankFailed,
    RankLost,
    RankTimedOut,
    WorkerGroup,
)
from raytrec.sync.schedule import SyncPlan, plan_sync

__all__ = ["ControlCalls", "JobRanks"]

R = TypeVar("R")


class JobRanks:
    """The live ranks of the job (module doc). ``now``: the event log's time;
    ``after_generation``: what runs once the live ranks joined each new generation (they have
    changed: the held-out batches each will score are read ahead)."""

    def __init__(
        self,
        state: JobView,
        *,
        sync: SyncConfig,
        calls: ControlCalls,
        nodes: JobNodes,
        events: EventLog,
        now: Callable[[], float],
        apply: Callable[[Outcome], None],
        after_generation: Callable[[], None] = lambda: None,
    ) -> None:
        self.state = state
        self.sync_config = sync
        self.calls = calls
        self.nodes = nodes
        self.events = events
        self.now = now
        self.apply = apply
        self.after_generation = after_generation
        self.infos: dict[int, RankInfo] = {}  # job rank -> what its build returned
        self._joined: SyncPlan | None = None  # the sync plan sent with the last generation

    def live(self) -> list[int]:
        """The live ranks, sorted."""
        return sorted(r for g in self.state.membership.gangs for r in g.job_ranks)

    def in_gang_order(self) -> list[int]:
        """The live ranks, gang by gang."""
        return [r for g in self.state.membership.gangs for r in g.job_ranks]

    def gang_of(self, rank: int) -> int:
        """The live gang of a live rank."""
        gang = self.state.membership.gang_of_rank(rank)
        assert gang is not None, f"rank {rank} is in no live gang"
        return gang

    def build(self, ranks: list[int]) -> list[RankInfo]:
        """Builds ``ranks``; the node of every rank that built is known even when another
        failed (recovery names the nodes of the ranks it drops)."""
        answers, error = self.calls.answers(ranks, lambda w, _r: w.build())
        for r, info in answers.items():
            self.infos[r] = info
            self.nodes.saw(info)
        if error is not None:
            raise error
        return sorted((self.infos[r] for r in ranks), key=lambda x: x.rank)

    def new_generation(
        self, reason: str, /, before: Mapping[int, ReformPlan] | None = None
    ) -> None:
        """Replica plane and sync plan of the current membership, on every live rank, in one
        call; ``before``: what a rank carries out in that call first (its replays)."""
        m = self.state.membership
        sync_plan = self._joined = self.sync_plan()

        def plan(r: int) -> ReformPlan:
            generation = GenerationPlan(
                generation=m.generation,
                member_rank=m.member_index(self.gang_of(r)),
                size=m.num_gangs,
                sync_plan=sync_plan,
            )
            first = (before or {}).get(r, ReformPlan())
            return dataclasses.replace(first, generation=generation)

        plans = {r: plan(r) for r in self.live()}
        self.calls.call(sorted(plans), lambda w, r: w.reform(plans[r]))
        self.events.append(
            GenerationStarted(
                at=self.now(),
                step=self.state.step,
                generation=m.generation,
                gang_ids=m.gang_ids,
                reason=reason,
            )
        )
        self.after_generation()

    def sync_plan(self) -> SyncPlan:
        """The generation's sync schedule over the live gangs, gangs on one host together."""
        locality = {
            g.gang_id: tuple(sorted({self.nodes.of_slot(s) for s in g.ranks}))
            for g in self.state.membership.gangs
        }
        return plan_sync(
            self.sync_config,
            generation=self.state.membership.generation,
            live_gangs=self.state.membership.gang_ids,
            locality=locality,
        )

    def joined_plan(self) -> SyncPlan:
        """The sync plan the current generation's ranks follow (the one sent to them)."""
        plan = self._joined
        if plan is None or plan.generation != self.state.membership.generation:
            plan = self.sync_plan()
        return plan

    def account(self, reports: list[RankReport], *, completed_through: int | None = None) -> None:
        """Books the ranks' trained batches; a job-wide sync among them commits."""
        plan = self.joined_plan()
        last_sync = last_job_wide_sync(
            reports,
            last_sync_step=self.state.membership.last_sync_step,
            # A lower level capped at one group of all live gangs syncs job-wide too.
            is_job_wide_sync=lambda s: plan.decide(s).job_wide,
            completed_through=completed_through,
        )
        step = max((r.step for r in reports), default=self.state.step)
        self.apply(Booked(step, last_sync, tuple(reports)))

    def sync_unless_synced(self) -> None:
        """A job-wide sync and its commit, unless the job synced at its step already."""
        if self.state.membership.last_sync_step != self.state.step:
            self.calls.call(self.live(), lambda w, _r: w.sync())
            self.apply(Committed())

    def prepare(self, ranks: list[int], n: int) -> None:
        """Has ``ranks`` read ``n`` batches ahead."""
        self.calls.call(ranks, lambda w, _r: w.prepare(n))

    def final_digests(self) -> dict[int, StateDigest]:
        """Checks that the final sync left every replica of every shard identical."""
        ranks = self.live()
        digests = dict(
            zip(ranks, self.calls.call(ranks, lambda w, _r: w.state_digest()), strict=True)
        )
        disagree = replicas_disagree(self.state.membership, digests)
        if disagree is not None:
            raise RuntimeError(disagree)
        return digests


# -- control calls ----------------------------------------------------------------------------


class ControlCalls:
    """Calls on ranks through ``group`` that wait up to ``timeout_s`` for every answer;
    ``on_lost(rank, pending)``: a rank died while the ranks ``pending`` had not answered."""

    def __init__(
        self,
        group: WorkerGroup,
        clock: Clock,
        *,
        timeout_s: float,
        on_lost: Callable[[int, Collection[int]], None],
    ) -> None:
        self.group = group
        self.clock = clock
        self.timeout_s = timeout_s
        self.on_lost = on_lost

    def call(self, ranks: list[int], invoke: Callable[[RankProtocol, int], R]) -> list[R]:
        """Calls one method on ``ranks`` (``invoke``, as in :meth:`WorkerGroup.call`) and
        returns their answers in order; raises :class:`RankLost` or :class:`RankFailed` for
        the first rank whose call failed."""
        futures = self.group.call(ranks, invoke)
        self.wait_all(futures)
        return [self.group.result(futures[r]) for r in ranks]

    def answers(
        self, ranks: list[int], invoke: Callable[[RankProtocol, int], R]
    ) -> tuple[dict[int, R], RankCallError | None]:
        """Calls ``method`` on ``ranks``; returns the answers of those whose call returned, and
        the first error (a timeout, naming the ranks stuck, before any other), so a caller
        keeps what came back when some did not."""
        futures = self.group.call(ranks, invoke)
        error: RankCallError | None = None
        try:
            self.wait_all(futures)
        except RankTimedOut as e:
            error = e
        stuck = set(error.ranks) if isinstance(error, RankTimedOut) else set()
        answers: dict[int, R] = {}
        for r in ranks:
            if r in stuck:
                continue
            try:
                answers[r] = self.group.result(futures[r])
            except RankCallError as e:
                error = error or e
        return answers, error

    def wait_all(self, futures: Mapping[int, Answer[Any]]) -> None:
        """Waits for every answer of a control call; raises :class:`RankTimedOut` naming the
        ranks whose answer did not come (recovery counts them as hung)."""
        timeout = self.timeout_s
        deadline = self.clock.monotonic() + timeout
        pending = dict(futures)
        rank_of = {id(f): r for r, f in futures.items()}
        while pending:
            left = max(0.0, deadline - self.clock.monotonic())
            ready = self.group.wait(list(pending.values()), num_returns=1, timeout=left)
            if not ready:
                stuck = sorted(pending)
                method = next(iter(futures.values())).method
                raise RankTimedOut(
                    stuck,
                    f"{method} did not return on ranks {stuck} of {sorted(futures)} "
                    f"within {timeout:g}s",
                )
            for future in ready:
                rank = rank_of[id(future)]
                pending.pop(rank, None)
                try:
                    self.group.result(future)
                except RankLost:
                    # Its gang peers and the other gangs' replica collectives are released
                    # now; their calls then end at once (failed), not at the timeout.
                    self.on_lost(rank, set(pending))
                except RankFailed:
                    pass  # raised to the caller below, with the others' answers in
