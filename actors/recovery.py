"""Failures while the job trains: finding them, and re-forming the job without the lost gangs.

:class:`FailureRecovery` is a part of the job with state of its own: each rank's last observed
progress (its heartbeat) and the count of failures in a row with every rank alive. It collects an
interval's reports and finds what went wrong while it waits (a rank or node died, a rank raised, a
rank hung: no step finished for ``elastic.step_timeout_s``,
:func:`~raytrec.elastic.hangs.find_hung_ranks`), waits out the intervals queued behind a failed
one, and carries out a re-form that the loop (:mod:`actors.job_loop`, state ``Recovering``)
decided: it records the losses (:meth:`~FailureRecovery.note_losses`), gathers what the survivors
trained (:meth:`~FailureRecovery.gather`) and re-forms among them
(:meth:`~FailureRecovery.reform`): it books what every rank trained, hands a lost gang's
uncommitted batches to the survivors and starts a new generation with a job-wide sync. A rank
call that fails meanwhile is raised to the loop, which recovers again with both losses
(:meth:`~FailureRecovery.merged`). It sees the job through :class:`RecoveryPorts`; the
membership it re-forms is an outcome (:mod:`actors.job`) the loop applies.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection
from typing import Any, Protocol

from actors.gang_placement import JobPlacement
from actors.job import (
    Committed,
    Dispatched,
    GangsDropped,
    GangsDroppedFromBooks,
    IntervalOutcome,
    RanksLost,
    Regenerated,
)
from actors.nodes import JobNodes
from actors.ports import (
    GenerationPorts,
    HasAccount,
    HasAnswers,
    HasAt,
    HasClock,
    HasGangOf,
    HasSyncPlan,
    HasView,
)
from actors.reshare import DataStreams
from raytrec.config import SyncConfig
from raytrec.elastic.boundary import MAX_TRANSIENT, Loss
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.control import group_broke
from raytrec.elastic.dense import settle_failed_step
from raytrec.elastic.events import (
    FailedStepSettled,
    GangDropped,
    HangDetected,
    RankDied,
)
from raytrec.elastic.group_rollback import rolled_back_gangs
from raytrec.elastic.hangs import find_hung_ranks, next_hang_check
from raytrec.elastic.heal import failed_heals
from raytrec.elastic.rank_protocol import ReformPlan
from raytrec.elastic.report import RankReport
from raytrec.elastic.workers import (
    PEER_RELEASED,
    RankFailed,
    RankLost,
    RankTimedOut,
    WorkerGroup,
)
from raytrec.sync.schedule import SyncPlan

__all__ = ["MAX_TRANSIENT", "FailureRecovery", "RecoveryPorts"]

# How early a wait may end before its timeout and still count as on time (Ray's wait takes
# whole milliseconds).
_WAKE_EARLY_S = 0.002
# Why a rank the coordinator killed itself is gone: its gang lost another rank.
_PEER_KILLED = PEER_RELEASED


class RecoveryPorts(
    GenerationPorts, HasGangOf, HasClock, HasAnswers, HasAccount, HasAt, HasSyncPlan, Protocol
):
    """The ports :class:`FailureRecovery` calls."""


class FailureRecovery:
    """Finds failures while an interval runs and re-forms the job after them (module doc).
    ``request_growth``: asks for the placement the job could still add."""

    def __init__(
        self,
        job: RecoveryPorts,
        *,
        elastic: ElasticConfig,
        sync: SyncConfig,
        group: WorkerGroup,
        placement: JobPlacement,
        nodes: JobNodes,
        streams: DataStreams,
        request_growth: Callable[[], None],
    ) -> None:
        self.job = job
        self.elastic = elastic
        self.sync = sync
        self.group = group
        self.placement = placement
        self.nodes = nodes
        self.streams = streams
        self.request_growth = request_growth
        # Job rank -> (the last step it reported finishing, when the coordinator saw it): the
        # hang rule's input.
        self.progress: dict[int, tuple[int, float]] = {}
        self.transient = 0  # re-forms in a row with no rank lost
        # Under sync.levels, until a re-forming's sync completes: the sync plan of the generation
        # whose lower-level syncs may have mixed lost gangs' copies into survivors', the job-wide
        # sync they followed, the furthest step reached, and every gang lost since
        # (a recovery that starts over still rolls back what the one before had to).
        self._mixed: tuple[SyncPlan, int, int, frozenset[int]] | None = None
        self.peers_killed: set[int] = set()  # ranks killed because their gang lost a rank

    def quiet_since(self, ranks: list[int], now: float) -> None:
        """Nothing was running on ``ranks`` until ``now``: their silence counts from now, not
        from their last report (a checkpoint, a join or a recovery may have run in between)."""
        for r in ranks:
            step = self.progress.get(r, (self.job.step(), now))[0]
            self.progress[r] = (step, now)

    def collect(
        self, dispatched: Dispatched, *, meanwhile: Callable[[], None] | None = None
    ) -> IntervalOutcome:
        """Waits for every rank's ``train`` report and sorts out what happened.

        While it waits it reads the ranks' heartbeats (the last step each finished): a rank
        that finishes no step for ``elastic.step_timeout_s`` is hung (the hang rule,
        :func:`~raytrec.elastic.hangs.find_hung_ranks`), however many steps the interval has.
        It wakes at least every ``elastic.poll_s``; ``meanwhile`` is called each time while no
        rank has failed (the coordinator starts building a gang whose placement became ready
        then, not only at the interval's end).
        """
        out = IntervalOutcome()
        pending = dict(dispatched.refs)
        rank_of = {id(x): r for r, x in pending.items()}
        deadline: float | None = None
        elastic = self.elastic
        wake = elastic.poll_s
        # When the heartbeats are next worth reading: not at every report (that would read
        # them once per rank per interval), only when a rank could have been silent too long.
        look_at = self.job.clock.monotonic() + wake
        while pending:
            blocked = self.job.clock.perf_counter()
            ready = self.group.wait(list(pending.values()), num_returns=1, timeout=wake)
            out.waited_s += self.job.clock.perf_counter() - blocked
            now = self.job.clock.monotonic()
            for future in ready:
                rank = rank_of.get(id(future))
                if rank is None or rank not in pending:
                    continue  # a lost gang's peer, already counted
                del pending[rank]
                try:
                    report: RankReport = self.group.result(future)
                    out.reports[rank] = report
                    self.progress[rank] = (report.step, now)
                except RankLost as e:
                    out.dead[rank] = e.cause
                    out.noticed[rank] = now
                    for peer in self.kill_gang_peers(rank, pending):
                        del pending[peer]
                        out.dead[peer] = _PEER_KILLED
                        out.noticed[peer] = now
                except RankFailed as e:
                    out.errored[rank] = str(e)
            if (out.dead or out.errored) and deadline is None:
                # Fail the survivors' blocked collectives now, and give everyone the
                # collective timeout to report; whoever is still running then is hung.
                deadline = now + 2 * elastic.collective_timeout_s + elastic.poll_s
                self.abort_planes(set(pending) - set(out.dead))
            if deadline is not None and now > deadline:
                out.hung = sorted(pending)
                out.silence = {r: self._silence(r, now) for r in out.hung}
                break
            if deadline is None and pending and now < look_at - _WAKE_EARLY_S:
                wake = look_at - now
            elif deadline is None and pending:
                hung = self._hung_ranks(pending, now)
                if hung:
                    out.hung = list(hung)
                    out.silence = {r: self._silence(r, now) for r in hung}
                    break
                wake = self._next_look(pending, now)
                look_at = now + wake
            else:
                wake = elastic.poll_s
            if deadline is None and pending and meanwhile is not None:
                meanwhile()
        return out

    def _next_look(self, pending: dict[int, Any], now: float) -> float:
        """Seconds until the heartbeats are read again
        (:func:`~raytrec.elastic.hangs.next_hang_check`)."""
        seen = (self.progress.get(r, (self.job.step(), now))[1] for r in pending)
        return next_hang_check(seen, now=now, config=self.elastic)

    def _hung_ranks(self, pending: dict[int, Any], now: float) -> tuple[int, ...]:
        """The ranks still training that count as hung at ``now``, by the hang rule, after
        reading their heartbeats. Ranks that already reported are not expected to progress."""
        for r, step in self.group.progress(list(pending)).items():
            if step > self.progress.get(r, (-1, now))[0]:
                self.progress[r] = (step, now)
        progress = {
            r: self.progress.get(r, (self.job.step(), now))
            if r in pending
            else (self.job.step(), now)
            for r in self.job.live_ranks()
        }
        return find_hung_ranks(self.job.view.membership, progress, now=now, config=self.elastic)

    def _silence(self, rank: int, now: float) -> tuple[int, float]:
        """(the last step ``rank`` finished, seconds since it did), as the coordinator saw it."""
        step, at = self.progress.get(rank, (self.job.step(), now))
        return step, round(now - at, 3)

    def settle_queued(self, inflight: deque[Dispatched], result: IntervalOutcome) -> None:
        """After a failed interval, waits out the intervals queued behind it.

        A rank whose own call failed skips the one queued behind it. A rank that finished the
        failed interval (its gang intact) has gone on into the next one, and may be waiting in
        a replica-plane collective for a lost peer: its planes are aborted so that it stops at
        once. What it trained comes back in its report (``result.later``) or from ``recover``,
        and is booked with the rest. Ranks of gangs that lost a rank are left alone: they are
        killed with their gang. A survivor whose queued call does not end counts as hung.
        """
        lost_gangs = {self.job.gang_of(r) for r in [*result.dead, *result.hung]}
        while inflight:
            d = inflight.popleft()
            refs = {r: x for r, x in d.refs.items() if self.job.gang_of(r) not in lost_gangs}
            self.abort_planes(set(refs))
            # A survivor may train the whole queued interval (nothing in it waits for the lost
            # gang): give it the interval's own hang timeout, as _collect does.
            timeout = max(
                2 * self.elastic.collective_timeout_s + self.elastic.poll_s,
                self.elastic.step_timeout_s * max(1, d.n),
            )
            ready = self.group.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)
            done = {id(f) for f in ready}
            now = self.job.clock.monotonic()
            for r, future in refs.items():
                if id(future) not in done:
                    result.hung.append(r)
                    result.silence[r] = self._silence(r, now)
                    continue
                try:
                    report = self.group.result(future)
                except RankLost as e:
                    result.dead[r] = e.cause
                    result.noticed.setdefault(r, now)
                except RankFailed as e:
                    result.errored.setdefault(r, str(e))
                else:
                    if not report.skipped:
                        result.later.append(report)
            lost_gangs |= {self.job.gang_of(r) for r in [*result.dead, *result.hung]}

    def kill_gang_peers(self, rank: int, pending: Collection[int]) -> list[int]:
        """Rank ``rank`` is dead: kills its gang peers among ``pending`` (the ranks whose call
        has not returned) and returns them. Their gang is dropped anyway; left alone they
        would sit in the gang's collectives with the dead rank until the collective timeout.
        A rank in no live gang (one still joining) has none."""
        gang = self.job.view.membership.gang_of_rank(rank)
        if gang is None:
            return []
        peers = [p for p in self.job.view.membership.gang(gang).job_ranks if p in pending]
        for peer in peers:
            self.group.kill(peer)
        self.peers_killed.update(peers)
        return peers

    def release(self, rank: int, pending: Collection[int]) -> None:
        """Rank ``rank`` died during a control call: its gang peers still in the call are
        killed and the other ranks' replica planes aborted, so that every call still pending
        ends at once rather than at the collective timeout (as :meth:`collect` does). A rank
        killed here itself (a peer) needs nothing more."""
        if rank in self.peers_killed:
            return
        killed = self.kill_gang_peers(rank, pending)
        self.abort_planes(set(pending) - set(killed) - {rank})

    def abort_planes(self, ranks: set[int]) -> None:
        # Fire and forget: the answer does not matter, only that blocked collectives fail.
        self.group.call(
            sorted(ranks & self.placement.started), lambda w, _r: w.abort_replica_planes()
        )

    def start_copies_differ(self) -> dict[int, str]:
        """After the start's broadcast of gang 0's state: the ranks whose state differs from
        gang 0's (killed here), with why, as :meth:`recover` takes them."""
        m = self.job.view.membership
        first, others = m.gangs[0].gang_id, [g.gang_id for g in m.gangs[1:]]
        ranks = self.job.live_ranks()
        digests = dict(
            zip(ranks, self.job.call(ranks, lambda w, _r: w.state_digest()), strict=True)
        )
        failed = failed_heals(m, peer=first, joined=others, digests=digests)
        why = f"its state differed from gang {first}'s after the start's broadcast"
        bad = {r: why for ranks in failed.values() for r in ranks}
        for r in bad:
            self.group.kill(r)
        return bad

    # -- failures ---------------------------------------------------------------------------

    def probe(self, error: BaseException) -> IntervalOutcome:
        """Which live ranks are dead or stuck, after ``error`` broke a control call."""
        out = IntervalOutcome()
        if isinstance(error, RankTimedOut):  # their call never came back: they count as hung
            now = self.job.clock.monotonic()
            members = set(self.job.live_ranks())
            out.hung = [r for r in error.ranks if r in members]
            out.silence = {r: self._silence(r, now) for r in out.hung}
        refs = self.group.call(self.job.live_ranks(), lambda w, _r: w.step())
        ready = self.group.wait(list(refs.values()), num_returns=len(refs), timeout=10)
        done = {id(f) for f in ready}
        now = self.job.clock.monotonic()
        for r, future in refs.items():
            if id(future) not in done:
                if r not in out.hung:
                    out.hung.append(r)
                    out.silence[r] = self._silence(r, now)
                continue
            try:
                self.group.result(future)
            except RankLost as e:
                out.dead[r] = _PEER_KILLED if r in self.peers_killed else e.cause
                out.noticed[r] = now
        out.hung = sorted(set(out.hung) - set(out.dead))
        if not out.failed:
            if isinstance(error, RankFailed) and group_broke(error.cause):
                # Every rank lives, but a collective of the re-forming failed: which gang's
                # process group is unusable is not known, so none is trusted. Every gang
                # counts as lost: a total loss (rebuilt from the last checkpoint, or a clear
                # failure without one).
                lost = f"a collective failed while the job re-formed, every rank alive ({error})"
                out.dead = {r: lost for r in self.job.live_ranks()}
                return out
            if not isinstance(error, RankLost):
                raise error  # nobody died: a real error of its own
            # An actor outside the membership died (a gang that was starting): re-form as is.
            out.errored[-1] = str(error)
        return out

    def fresh(self) -> None:
        """A new loss, not one found while re-forming after another: what a recovery before it
        left unfinished (a total loss, a failure) is forgotten."""
        self._mixed = None

    def merged(self, before: IntervalOutcome, probed: IntervalOutcome) -> IntervalOutcome:
        """What a probe found after a recovery broke, with the losses found before that are
        still members (a hung rank answers a probe; a peer the coordinator killed stays lost
        because its gang lost a rank, not because it was killed) and, unless booked, the
        reports that came back."""
        member = self.job.view.membership.gang_of_rank
        earlier = {r: c for r, c in before.dead.items() if member(r) is not None}
        probed.dead = {**probed.dead, **earlier}
        hung = {r for r in before.hung if member(r) is not None} | set(probed.hung)
        probed.hung = sorted(hung - set(probed.dead))
        probed.silence = {**before.silence, **probed.silence}
        probed.logged = before.logged
        probed.noticed = {**probed.noticed, **before.noticed}
        if not before.booked:  # what the survivors reported is not in the books yet
            probed.reports = {**before.reports, **probed.reports}
            probed.later = before.later + probed.later
        return probed

    def stall(self, result: IntervalOutcome) -> Loss:
        """A failure with every rank alive (collectives gave up, every rank answered: a stall
        longer than the collective timeout), as :func:`~raytrec.elastic.boundary.decide`
        reads it: the job re-forms as it was, unless that keeps happening."""
        errors = tuple(f"rank {r}: {e}" for r, e in sorted(result.errored.items()))
        return Loss(errors=errors, joining=tuple(self.job.view.joining))

    def note_losses(self, result: IntervalOutcome) -> list[int]:
        """Settles the deaths with the node table and records each death and hang (once);
        returns the gangs that lost a rank, with those still joining. A gang that was joining
        has no state of its own yet: if anything fails meanwhile, it goes too and is requested
        again. It stays marked joining until it is dropped (``GangsDropped``): a recovery cut
        short by another loss starts over and must drop it again, else its never-healed copy
        would be averaged into the model."""
        now = self.job.now()
        lost = set(result.dead) | set(result.hung)
        failed_gangs = sorted({self.job.gang_of(r) for r in lost} | self.job.view.joining)
        self.nodes.settle_deaths(result, now=now)
        for r, cause in sorted(result.dead.items()):
            if r in result.logged:
                continue
            result.logged.add(r)
            self.job.record(
                RankDied(
                    at=now,
                    step=self.job.step(),
                    job_rank=r,
                    gang_id=self.job.gang_of(r),
                    cause=cause,
                    node=self.nodes.rank_names([r])[0],
                    noticed_at=self.job.at(result.noticed[r]) if r in result.noticed else None,
                )
            )
        if set(result.hung) - result.logged:
            result.logged |= set(result.hung)
            silence = [result.silence.get(r, (self.job.step(), 0.0)) for r in result.hung]
            self.job.record(
                HangDetected(
                    at=now,
                    step=self.job.step(),
                    job_ranks=tuple(result.hung),
                    gang_ids=tuple(sorted({self.job.gang_of(r) for r in result.hung})),
                    last_step=min(step for step, _ in silence),
                    silent_s=max(silent for _, silent in silence),
                )
            )
        return failed_gangs

    def loss(self, result: IntervalOutcome, failed_gangs: list[int]) -> Loss:
        """The ranks lost (after :meth:`note_losses`), as
        :func:`~raytrec.elastic.boundary.decide` reads them: a gang still joining has no state
        of its own and counts as lost with the rest."""
        return Loss(
            dead=frozenset(result.dead),
            hung=frozenset(result.hung),
            peers_killed=frozenset(r for r, c in result.dead.items() if c == _PEER_KILLED),
            joining=tuple(failed_gangs),
        )

    def why(self, result: IntervalOutcome, gang: int) -> str:
        """What happened to a failed ``gang``, in words."""
        return _why(result, gang, self.job)

    def gather(self, failed_gangs: list[int], result: IntervalOutcome) -> list[RankReport]:
        """Aborts the survivors' replica planes and has each report what it trained since its
        last report (``recover``): the reports, whose steps say whether they can re-form."""
        failed = set(failed_gangs)
        m = self.job.view.membership
        survivor_ranks = [r for g in m.gangs if g.gang_id not in failed for r in g.job_ranks]
        self.abort_planes(set(survivor_ranks))
        return self._recover_ranks(survivor_ranks, result)

    def book(
        self, failed_gangs: list[int], result: IntervalOutcome, recovered: list[RankReport]
    ) -> int:
        """Books what every rank trained up to the failure (``recovered``: what :meth:`gather`
        brought back); returns the failed step, the furthest one a survivor reached (a failure
        reaches the members of a collective at slightly different moments: one may have
        finished a step its peers did not; a rank that is behind simply trained one batch less,
        its log says which)."""
        failed = set(failed_gangs)
        m = self.job.view.membership
        survivor_ranks = [r for g in m.gangs if g.gang_id not in failed for r in g.job_ranks]
        alive = set(survivor_ranks)
        fail_step = max(rep.step for rep in recovered)
        # What everyone trained in the failed interval: the survivors' own logs (a survivor
        # may even have finished it), and for the lost ranks, whose logs died with them, the
        # next batches in their stream order, one per step up to the failure.
        reports = [result.reports[r] for r in survivor_ranks if r in result.reports]
        reports += [rep for rep in result.later if rep.rank in alive] + recovered
        lost_ranks = [r for g in failed_gangs for r in self.job.view.membership.gang(g).job_ranks]
        lost = self.job.view.accounting.reports_of_lost(lost_ranks, fail_step=fail_step)
        self.job.apply(RanksLost(tuple(lost)))
        reports += lost
        # Syncs before the failed step completed on every gang; the one at it did not.
        self.job.account(reports, completed_through=fail_step - 1)
        result.booked = True
        return fail_step

    def reform(
        self,
        failed_gangs: list[int],
        result: IntervalOutcome,
        recovered: list[RankReport],
        *,
        fail_step: int,
        rolled_back: tuple[int, ...],
    ) -> None:
        """Drops ``failed_gangs`` and re-forms the job among the survivors, once :meth:`book`
        booked what they trained up to ``fail_step``: hands the lost gangs' unsynced batches
        (and the ``rolled_back`` survivors', :meth:`rolled_back`) to the survivors, starts a
        new generation, syncs and settles the failed step's dense update."""
        failed = set(failed_gangs)
        survivors = [g.gang_id for g in self.job.view.membership.gangs if g.gang_id not in failed]
        # Whose dense state the job goes on from, and which of the lost gangs' batches have
        # their dense gradient in it already (those are replayed for their embedding rows only).
        settled = settle_failed_step(
            recovered,
            every_step=self.sync.dense == "every_step",
            committed_through=self.job.view.membership.last_sync_step,
        )
        source_gang = self.job.gang_of(settled.source)
        source_slot = next(
            s
            for s in self.job.view.membership.gang(source_gang).ranks
            if s.job_rank == settled.source
        )
        # Under sync.levels, the survivors that averaged with a lost gang since the last
        # job-wide sync (``rolled_back``) take the others' mean and have their batches since
        # replayed.
        replay = self.drop(
            failed_gangs,
            survivors,
            dense_through=settled.dense_through,
            rolled_back=(rolled_back, settled.survivors_through),
        )
        acc = self.job.view.accounting
        for gid in failed_gangs:
            self.job.record(
                GangDropped(
                    at=self.job.now(),
                    step=self.job.step(),
                    gang_id=gid,
                    reason=_why(result, gid, self.job),
                )
            )
            self.placement.kill_gang(gid, lost=True)
        if failed_gangs:
            self.job.apply(GangsDropped(tuple(failed_gangs)))
            reason = f"lost gangs {failed_gangs}"
        else:
            self.job.apply(Regenerated())
            reason = "collectives timed out with every rank alive"
        # The replays are handed over once the books and the membership agree, first in the
        # call that joins the new generation, before any part that may cut this recovery
        # short: what is booked is sent even if it starts over (a re-share below hands each
        # rank its whole queue again).
        replays = {
            r: ReformPlan(replay=tuple(ids), embedding_only=tuple(acc.embedding_only(ids)))
            for r, ids in replay.items()
        }
        self.job.new_generation(reason, replays or None)
        # The re-formed job's first sync: every replica (and dense state) identical again, and
        # the survivors' batches so far are in the model: committed. The failed step's dense
        # update is then finished among the survivors, or dropped where the state taken has it.
        live = self.job.live_ranks()
        back = tuple(self.job.view.membership.member_index(g) for g in rolled_back)
        synced = ReformPlan(step=fail_step, sync=True, rolled_back=back)
        self.job.call(live, lambda w, _r: w.reform(synced))
        # Committed as soon as the sync is done: a loss in the call that follows must not
        # hand these batches out again (they are in every replica already).
        self.job.apply(Committed())
        self._mixed = None  # every copy is the clean survivors' mean now
        dense = ReformPlan(
            dense_from=(self.job.view.membership.member_index(source_gang), source_slot.gang_rank),
            finish_failed_step=settled.finish,
        )
        self.job.call(live, lambda w, _r: w.reform(dense))
        self.job.record(
            FailedStepSettled(
                at=self.job.now(),
                step=fail_step,
                dense_through=settled.dense_through,
                dense_from=settled.source,
                finished=settled.finish,
                embedding_only=len(acc.embedding_only(i for ids in replay.values() for i in ids)),
                rolled_back=rolled_back,
            )
        )
        # The lost gangs' rows not read yet are shared out (even with nothing to replay). The
        # survivors' feeds hold their replays already: where it can, the re-share leaves
        # their streams running (a new stream would read the replays again).
        self.streams.reshare(self.job.ranks_in_gang_order(), fed=True)
        self.streams.make_room_for_replays()
        self.request_growth()

    def rolled_back(self, lost: list[int], through: int) -> tuple[int, ...]:
        """The survivors that averaged with a lost gang at a lower level of the schedule since
        the last job-wide sync (:func:`~raytrec.elastic.group_rollback.rolled_back_gangs`),
        for a source that can replay their batches. A recovery that starts over before its
        sync completed goes on from the generation that trained, with every gang lost since."""
        if not self.sync.levels or self.job.view.accounting.streams is None:
            return ()
        if self._mixed is None:
            since = self.job.view.membership.last_sync_step
            self._mixed = (self.job.sync_plan(), since, through, frozenset(lost))
        plan, since, reached, gone = self._mixed
        reached, gone = max(reached, through), gone | set(lost)
        self._mixed = (plan, since, reached, gone)
        live = set(self.job.view.membership.gang_ids) - set(lost)
        mixed = rolled_back_gangs(plan, lost=gone, last_sync_step=since, through=reached)
        return tuple(g for g in mixed if g in live)

    def _recover_ranks(self, ranks: list[int], result: IntervalOutcome) -> list[RankReport]:
        """``recover`` on every survivor. Its report is the only record of what the rank trained
        since its last one (a second ``recover`` returns nothing): when another survivor is
        lost meanwhile, the reports that came back stay in ``result`` for the recovery that
        starts over."""
        # A rank that timed out or died: the others' reports still count.
        answers, error = self.job.answers(ranks, lambda w, _r: w.recover())
        recovered: list[RankReport] = [answers[r] for r in ranks if r in answers]
        if error is not None:
            result.later += recovered
            raise error
        return recovered

    def drop(
        self,
        gangs: list[int],
        survivors: list[int],
        *,
        dense_through: int | None = None,
        rolled_back: tuple[tuple[int, ...], int | None] = ((), None),
    ) -> dict[int, list[int]]:
        """The dropped gangs' uncommitted batches, split over the survivors' ranks; those trained
        at or before ``dense_through`` are replayed for their embedding rows only.
        ``rolled_back``: the survivors that roll back, whose uncommitted batches go too, and
        the step through which theirs are replayed for their embedding rows only."""
        plan = self.job.view.accounting.plan_drop(
            gangs,
            survivors,
            ranks_of=lambda g: self.job.view.membership.gang(g).job_ranks,
            dense_through=dense_through,
            rolled_back=rolled_back[0],
            rolled_back_dense_through=rolled_back[1],
        )
        self.job.apply(GangsDroppedFromBooks(plan))
        return plan.replays


def _why(result: IntervalOutcome, gang: int, job: HasView) -> str:
    ranks = job.view.membership.gang(gang).job_ranks
    dead = [r for r in ranks if r in result.dead]
    hung = [r for r in ranks if r in result.hung]
    if dead:
        return f"rank(s) {dead} died"
    if hung:
        return f"rank(s) {hung} hung"
    if gang in job.view.joining:
        return "it was joining and had not healed yet"
    return f"rank(s) {[r for r in ranks if r in result.errored]} failed"
