"""The coordinator's loop: one loop over explicit job states (:mod:`actors.job_states`).

``run`` is ``while not state.is_terminal(): state = self.step(state)``, as in Ray Train v2's
controller. Each step gathers what it observes (rank reports, deaths, heartbeats, placements,
requests, the clock), asks :func:`raytrec.elastic.boundary.decide` what to do (:meth:`decide`:
this module is the only place that asks), has the part that owns it carry the decision out
(recovery, total loss, growth, drains, checkpoints, evaluation) and returns the next state. A
rank call that fails anywhere comes back here as a :class:`~actors.job_states.Recovering` state
naming what was lost and the state to go back to once the job re-formed; no part retries on its
own, and a loss while re-forming or rebuilding is one more turn of this loop.

:class:`JobLoop` is the coordinator's own loop (:class:`~actors.coordinator.Coordinator` builds
the parts it names below and inherits it).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from actors.job import Committed, GangsDropped, IntervalOutcome
from actors.job_states import (
    AtBoundary,
    Done,
    Failed,
    Finishing,
    Forming,
    JobLoopState,
    Placing,
    Preparing,
    Rebuilding,
    Recovering,
    Running,
    Starting,
    Waiting,
)
from actors.job_training import TrainingSteps
from actors.total_loss import MAX_REBUILD_ATTEMPTS
from raytrec.elastic.boundary import MAX_TRANSIENT, Observations
from raytrec.elastic.decisions import (
    Continue,
    Decision,
    Fail,
    Reform,
    Stop,
    TotalLoss,
)
from raytrec.elastic.events import JobFailed
from raytrec.elastic.rank_protocol import StateDigest
from raytrec.elastic.run_record import RunSummary
from raytrec.elastic.workers import RankCallError, RankFailed
from raytrec.errors import ConfigError, EarlyStopped, JobFailedError, StopRequested

__all__ = ["JobLoop"]


class JobLoop(TrainingSteps):
    """The loop over the job's states (module doc)."""

    def run(self) -> RunSummary:
        """Trains ``num_steps`` steps and writes the final model; returns the summary.

        A rank trains an interval only with all of its batches in memory, and it prepares the
        next interval's batches before it reports the current one; so bad input or the end of
        a rank's data surfaces between steps, before any rank enters the next interval's
        collectives. Training stops there, and the model trained so far is synced, checked and
        saved like a finished one (``RunSummary.stopped_by`` says why).
        """
        self._started = self.clock.perf_counter()
        self._train_start, self._loop_timer, self._final, self._infos = None, None, None, []
        state: JobLoopState = Starting()
        while not state.is_terminal():
            state = self.step(state)
        if isinstance(state, Failed):
            raise state.error
        assert isinstance(state, Done)
        return state.summary

    def step(self, state: JobLoopState) -> JobLoopState:
        """Carries out ``state`` and returns the next one."""
        match state:
            case Starting():
                return self._starting(state)
            case Placing():
                return self._placing(state)
            case Forming():
                return self._forming(state)
            case Preparing():
                return self._preparing()
            case Running():
                return self._running(state)
            case AtBoundary():
                return self._at_boundary(state)
            case Waiting():
                return self._waiting(state)
            case Recovering():
                return self._recovering(state)
            case Rebuilding():
                return self._rebuilding(state)
            case Finishing():
                return self._finishing(state)
        raise AssertionError(f"no step for {state!r}")

    # -- the start ----------------------------------------------------------------------------

    def _starting(self, s: Starting) -> JobLoopState:
        """Hosts the store and asks for every gang's placement (a resume with the checkpoint's
        streams: as many as the cluster holds); once the ranks are started, a
        resumed job loads its checkpoint (a rank lost meanwhile: rebuilt from it, as after a
        total loss)."""
        if not s.placed:
            self._store_address = self.group.host_store()
            if self.checkpoints.resumes_streams(self.resume_from):
                # Placed again from a checkpoint: what the cluster holds now (a node may be
                # gone since the run began), down to min_gangs; growth adds the rest later.
                gangs = self.state.membership.gang_ids
                fewer = gangs[self.placement.gangs_to_place() :]
                if fewer:
                    self.apply(GangsDropped(fewer))
            starts = self.checkpoints.resume_streams(self.resume_from)

            def shard_of(rank: int) -> Any:
                if starts is None:
                    return self.shards[rank]
                return self.streams.shard_of(starts[rank].shard)

            job = self.placement.request_job(self.state.membership.gangs, shard_of)
            return Placing(job, then=Starting(placed=True, starts=starts))
        if self.resume_from is None and self.checkpoints.init_from is None:
            return Forming(attempts_left=self.state.max_gangs + 2)
        try:
            started = sorted(self.placement.started)
            self.checkpoints.start_from(self.resume_from, s.starts, started)
        except RankCallError as e:
            if self.resume_from is None or s.starts is None:
                raise
            loss = self.checkpoints.resume_lost(self.resume_from, e)
            self.total_loss.begin(loss, why=lambda _gang: loss.reason)
            return Rebuilding(loss, then=Preparing())
        return Preparing()

    def _placing(self, p: Placing) -> JobLoopState:
        """Waits for a whole job's placement groups while :func:`decide` says to wait (a
        ``placement_waiting`` event each time), then starts its ranks; refused (the wait's
        deadline, or a stop asked meanwhile), the job ends."""
        seen = self.placement.wait_ready(p.job)
        asked = self.boundary.stop_asked()
        (decision,) = self.decide(Observations(placement=seen, stop_requested=asked))
        match decision:
            case Continue():
                try:
                    self.placement.start_job(p.job)
                except RankCallError as e:
                    if p.rebuilding is None:
                        raise
                    return self._rebuild_failed(p.rebuilding, e)
                return p.then
            case Fail() | Stop():
                why = self.placement.give_up(p.job, decision)
                if p.rebuilding is None:
                    return Failed(ConfigError(why))
                return Failed(self.total_loss.refused(why))
        self.placement.waiting(p.job)
        return p

    def _forming(self, state: Forming) -> JobLoopState:
        """Builds the ranks and the first generation, and copies gang 0's state to every gang.
        A rank lost meanwhile is a loss like any other: its gang is dropped and the others start
        on (or, with no gang left, the job fails as a total loss does)."""
        if state.attempts_left <= 0:
            return Failed(JobFailedError("the job kept losing ranks while it started"))
        again = Forming(attempts_left=state.attempts_left - 1)
        try:
            if self.state.membership.generation == 0 and not self.ranks.infos:
                self.ranks.build(sorted(self.placement.started))
                self.ranks.new_generation("job started")
            self._call(self.ranks.live(), lambda w, _r: w.broadcast_state(0))  # gang 0's state
            differ = self.recovery.start_copies_differ()
        except RankCallError as e:
            return self._lost(e, again)
        if differ:
            # A gang whose copy of gang 0's state came out different is dropped (and
            # replaced), as a join's that does not heal is.
            return self._recover(IntervalOutcome(dead=differ), again)
        return Preparing()

    def _preparing(self) -> JobLoopState:
        """The ranks read the first interval's batches."""
        self.growth.request()
        self._infos = sorted((self.ranks.infos[r] for r in self.ranks.live()), key=lambda x: x.rank)
        t0 = self.clock.perf_counter()
        try:
            every = self.settings.log_every
            n = min(every, self.state.end_step - self.state.step)  # a resume: its step
            self._call(self.ranks.live(), lambda w, _r: w.prepare(n, first=True))
        except RankFailed as e:
            self._training_starts(t0)
            return Finishing(stopped_by=e.cause)
        except RankCallError as e:  # a rank lost (or stuck) before the first step
            return self._lost(e, Running(prepared=False, t0=t0))
        self._training_starts(t0)
        return Running(prepared=True)

    # -- losses -------------------------------------------------------------------------------

    def _recovering(self, r: Recovering) -> JobLoopState:
        """Drops every gang that lost a rank and re-forms the job among the survivors, as
        :func:`~raytrec.elastic.boundary.decide` says (or a total loss: :class:`Rebuilding`);
        a further loss meanwhile is recovered from with both losses."""
        cause, recovery = r.cause, self.recovery
        try:
            lost = bool(cause.dead or cause.hung)
            decision: Decision | None = None
            if not lost:
                # Collectives gave up but every rank is alive and answered: nobody is dropped;
                # the job re-forms as it was, unless that keeps happening.
                (decision,) = self.decide(Observations(loss=recovery.stall(cause)))
                recovery.transient += 1
                if isinstance(decision, Fail):
                    return Failed(JobFailedError(decision.reason))
            else:
                recovery.transient = 0
            failed = recovery.note_losses(cause)
            if lost:
                # No gang intact: a total loss (some shard may have no live copy).
                (decision,) = self.decide(Observations(loss=recovery.loss(cause, failed)))
                match decision:
                    case TotalLoss():
                        self.total_loss.begin(decision, why=lambda g: recovery.why(cause, g))
                        return Rebuilding(decision, then=r.then)
                    case Fail():
                        self.events.append(
                            JobFailed(
                                at=self._now(),
                                step=self.state.step,
                                reason=decision.reason,
                                needs_checkpoint=decision.needs_checkpoint,
                            )
                        )
                        return Failed(JobFailedError(decision.reason))
            assert isinstance(decision, Reform)
            failed = sorted(set(failed) | set(decision.drop))
            recovered = recovery.gather(failed, cause)
            steps = tuple(sorted({rep.step for rep in recovered}))
            seen = Observations(survivor_steps=steps, dropping=tuple(failed))
            (apart, *_) = self.decide(seen)
            if isinstance(apart, Fail):
                return Failed(JobFailedError(apart.reason))
            fail_step = recovery.book(failed, cause, recovered)
            # Under sync.levels, the survivors that averaged with a lost gang since the last
            # job-wide sync roll back; with none of them clean, a total loss (or a failure).
            rolled_back = recovery.rolled_back(failed, fail_step)
            if rolled_back:
                seen = dataclasses.replace(seen, rolled_back=rolled_back)
                match self.decide(seen)[0]:
                    case TotalLoss() as whole:
                        self.total_loss.begin(whole, why=lambda g: recovery.why(cause, g))
                        return Rebuilding(whole, then=r.then)
                    case Fail() as fail:
                        return Failed(JobFailedError(fail.reason))
            recovery.reform(failed, cause, recovered, fail_step=fail_step, rolled_back=rolled_back)
        except RankCallError as e:
            again = recovery.merged(cause, recovery.probe(e))
            if r.attempts_left <= 1:
                error = JobFailedError("the job kept losing ranks while it re-formed")
                error.__cause__ = e
                return Failed(error)
            return Recovering(again, r.then, attempts_left=r.attempts_left - 1)
        return r.then

    def _rebuilding(self, r: Rebuilding) -> JobLoopState:
        """Rebuilds the whole job from the checkpoint a total loss goes back to: what is left
        ended, a whole job placed (:class:`Placing`), the checkpoint loaded; lost (or stuck)
        again meanwhile, it starts over, up to ``MAX_REBUILD_ATTEMPTS`` times."""
        try:
            if r.placed is None:
                pending = self.total_loss.rebuild()
                return Placing(
                    pending.job, then=dataclasses.replace(r, placed=pending), rebuilding=r
                )
            self.total_loss.placed(r.placed)
        except RankCallError as e:
            return self._rebuild_failed(r, e)
        return r.then

    def _rebuild_failed(self, r: Rebuilding, e: RankCallError) -> Rebuilding | Failed:
        error = f"{type(e).__name__}: {str(e).strip()[:200]}"
        if r.attempt + 1 >= MAX_REBUILD_ATTEMPTS:
            failed = self.total_loss.give_up(error)
            failed.__cause__ = e
            return Failed(failed)
        return dataclasses.replace(r, attempt=r.attempt + 1, error=error, placed=None)

    # -- the end ------------------------------------------------------------------------------

    def _finishing(self, f: Finishing) -> JobLoopState:
        """Ends on a job-wide sync, checks the replicas, saves the final model and a checkpoint
        when due. A loss meanwhile is recovered from; then training goes on if the rebuilt job
        has steps left, and the job ends again."""
        if self._final is None:
            # A job stopped before its first step trained nothing: no model to save.
            trained = f.stopped_by is None or self.state.step > 0
            self._final = (os.path.join(self.run_dir, "final_model") if trained else None,)
        if f.resume and f.stopped_by is None and self.state.step < self.state.end_step:
            return Running(finishing=f.attempt)
        if f.attempt > MAX_TRANSIENT:
            return Failed(JobFailedError("the job kept losing ranks while it finished"))
        (final,) = self._final
        # A growing source's job ended by its rules is saved as a stopped one: resumable.
        grown = self.data_growth is not None and self.data_growth.ended is not None
        stopping = grown or isinstance(f.stopped_by, StopRequested | EarlyStopped)
        try:
            digests = self._finish(
                final, checkpoint=f.stopped_by is None or stopping, stopping=stopping
            )
        except RankCallError as e:  # lost at the very end: re-form, and train on if rebuilt
            return self._lost(e, Finishing(f.stopped_by, attempt=f.attempt + 1, resume=True))
        stopped_by = f.stopped_by
        if stopped_by is None and self.data_growth is None:  # a growing source has no end
            stopped_by = self.streams.ran_out(self.state.step, self.num_steps, self.settings.epochs)
        summary = self._summary(
            final=final, digests=digests, stopped_by=stopped_by, ranks=self._infos
        )
        return Done(summary)

    def _finish(
        self, final: str | None, *, checkpoint: bool, stopping: bool = False
    ) -> dict[int, StateDigest]:
        """Ends on a job-wide sync, checks the replicas, saves the final model (none when
        ``final`` is None) and a checkpoint when the policy says so (``stopping``: the job stops
        on request)."""
        if (
            self.state.step % self.settings.sync_every
            or self.state.membership.last_sync_step != self.state.step
        ):
            # End on a sync: every replica the same.
            self._call(self.ranks.live(), lambda w, _r: w.sync())
        self.apply(Committed())
        if checkpoint:
            self._save_if_due(Observations(save=True, final=True, stopping=stopping))
        self.boundary.publish(final=True)
        digests = self.ranks.final_digests()
        if final is not None:
            first_gang = self.state.membership.gangs[0]
            self._call(list(first_gang.job_ranks), lambda w, _r: w.save(final))
        return digests
