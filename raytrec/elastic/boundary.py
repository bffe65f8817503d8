"""The one decision function: what the job does at a boundary of the coordinator's loop.

:func:`decide` is pure: it takes the job's state (:class:`JobState`), what was observed at the
boundary (:class:`Observations`) and the clock, and returns an ordered tuple of decisions from
the union in :mod:`raytrec.elastic.decisions`, to be carried out in that order (a
``(Continue(...),)`` when nothing applies). Each rule exists once, as a pure function tested
alone: here, a loss (drop every gang that lost a rank, re-form among the intact ones), growth
(built gangs heal from the first live gang), the wait below ``min_gangs`` (wait while
``now <= deadline``, then fail) and the gangs a job placed again from a checkpoint asks for
(:func:`gangs_to_place`); elsewhere, a total loss
(:func:`raytrec.elastic.rollback.decide_total_loss`), a drain
(:func:`raytrec.elastic.drain_policy.decide_drain`), a persistent straggler's eviction
(:func:`raytrec.elastic.straggler_policy.decide_eviction`), a checkpoint
(:func:`raytrec.checkpoint.config.save_decision`), an evaluation and early stopping
(:func:`raytrec.eval_plan.eval_due`, :func:`raytrec.eval_plan.early_stop_decision`).

Precedence, when several observations are passed together:

1. the job's placement groups (at the start, after a total loss): ``Continue``, ``Wait`` or
   ``Fail``, alone;
2. a loss (ranks dead or hung, or a failure with every rank alive): ``Reform``, ``TotalLoss``
   or ``Fail``, alone: nothing else runs at a boundary where something was lost;
3. survivors too far apart to re-form: ``Fail``, alone; every survivor averaged with a lost gang
   at a lower level of a hierarchical schedule (:mod:`raytrec.elastic.group_rollback`):
   ``TotalLoss`` or ``Fail``, alone;
4. a stop (a rank could not prepare what comes next, then a user's request): ``Stop``, alone;
5. a drain (asked for, else a persistent straggler's eviction), then gangs built and waiting
   to join: ``Drain`` then ``Grow``;
6. fewer gangs than ``elastic.min_gangs`` (counting the drain and the joins before it):
   ``Wait``, or ``Fail`` alone at the deadline;
7. an evaluation due, early stopping after one (``Stop``, alone), a checkpoint due:
   ``Evaluate``, ``Checkpoint``.

An evaluation's score and a join's heal are observed only once they have run, so the
coordinator decides again after carrying out an ``Evaluate`` (early stopping, the checkpoint
that an evaluation-ranked job saves) and after a ``Drain`` (what growth then sees).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from raytrec.checkpoint.config import CheckpointConfig, save_decision
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.decisions import (
    Checkpoint,
    Continue,
    Decision,
    Evaluate,
    Fail,
    Grow,
    NewGang,
    Reform,
    RollbackPoint,
    Stop,
    TotalLoss,
    Wait,
)
from raytrec.elastic.drain_policy import DrainRequest, decide_drain
from raytrec.elastic.group_rollback import no_clean_survivor
from raytrec.elastic.membership import Gang, Membership
from raytrec.elastic.rollback import decide_total_loss, describe_total_loss
from raytrec.elastic.straggler_policy import StragglerWatch, decide_eviction
from raytrec.eval_plan import early_stop_decision, eval_due

__all__ = [
    "MAX_TRANSIENT",
    "EvalState",
    "JobState",
    "Loss",
    "Observations",
    "PlacementSeen",
    "decide",
    "evaluation_due",
    "gangs_to_place",
    "save_due",
]

#: Re-forms in a row after collective timeouts with every rank alive, before the job gives up.
MAX_TRANSIENT = 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalState:
    """The held-out evaluation's schedule and scores so far."""

    every: int | None  # eval.every_n_steps
    batches: int  # held-out batches; none: no evaluation runs
    last_step: int = 0  # the step last evaluated (the start counts as evaluated)
    metric: str = "eval_auc"  # eval.early_stopping_metric
    patience: int | None = None  # eval.early_stopping_patience
    min_delta: float = 0.0  # eval.early_stopping_min_delta
    #: (step, early_stopping_metric) of every evaluation, in order.
    scores: tuple[tuple[int, float | None], ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobState:
    """The job's state values :func:`decide` reads."""

    membership: Membership
    step: int
    end_step: int  # where the job's data ends
    max_gangs: int
    elastic: ElasticConfig
    sync_every: int = 1
    #: Failures in a row with every rank alive, before the one observed now.
    transient: int = 0
    within_host: bool = False  # layout replicas_within_host
    replayable: bool = True  # the data source can rebuild its batches by id
    point: RollbackPoint | None = None  # the checkpoint a total loss goes back to
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    last_save: tuple[int, float] = (0, 0.0)  # (step, clock) of the last save (or start)
    evaluation: EvalState | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Loss:
    """What failed in an interval or a control call."""

    dead: frozenset[int] = frozenset()
    hung: frozenset[int] = frozenset()
    #: The dead ranks the coordinator killed because their gang lost a rank.
    peers_killed: frozenset[int] = frozenset()
    #: Gangs added but not healed yet: they go with any failure.
    joining: tuple[int, ...] = ()
    #: With no rank lost: each rank's error.
    errors: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlacementSeen:
    """The job's placement groups: all ready or not, waited for since ``since``."""

    ready: bool
    since: float
    asked: str  # what was asked, in words


@dataclasses.dataclass(frozen=True, kw_only=True)
class Observations:
    """What was observed at a boundary; each field left at its default was not."""

    placement: PlacementSeen | None = None
    loss: Loss | None = None
    #: After a loss: the steps the survivors stopped at, and the gangs being dropped.
    survivor_steps: tuple[int, ...] = ()
    dropping: tuple[int, ...] = ()
    #: After a loss, with the survivors' steps: the survivors that averaged with a lost gang at a
    #: lower level since the last job-wide sync (:func:`~.group_rollback.rolled_back_gangs`).
    rolled_back: tuple[int, ...] = ()
    #: Why a rank could not prepare the next interval (bad input, the end of its data).
    data_stop: str | None = None
    stop_requested: bool = False
    drain: DrainRequest = dataclasses.field(default_factory=DrainRequest)
    node_of_rank: Mapping[int, str] = dataclasses.field(default_factory=dict)
    #: Gangs slower than the others in the last intervals (a persistent straggler is evicted).
    stragglers: StragglerWatch | None = None
    #: Gangs whose every rank is built, waiting to join.
    built: tuple[Gang, ...] = ()
    #: Since when training waited for gangs below min_gangs (this boundary's start, at first).
    waiting_since: float | None = None
    #: An interval ended with nothing queued behind it: an evaluation may be due.
    evaluate: bool = False
    #: An evaluation just ran: early stopping may apply.
    evaluated: bool = False
    #: A checkpoint may be due; ``final``: at the job's end; ``stopping``: on request.
    save: bool = False
    final: bool = False
    stopping: bool = False


def decide(state: JobState, seen: Observations, now: float) -> tuple[Decision, ...]:
    """The decisions for ``seen`` at ``now``, in the order to carry them out (module doc)."""
    if seen.placement is not None:
        if seen.stop_requested and not seen.placement.ready:  # no need to wait on
            asked = seen.placement.asked
            return (
                Stop(cause="request", reason=f"stopped on request while it waited for {asked}"),
            )
        return (_placement(seen.placement, state.elastic, now),)
    if seen.loss is not None:
        return (_loss(state, seen.loss),)
    if seen.survivor_steps:
        apart = _survivors_apart(state, seen.survivor_steps, seen.dropping)
        if apart is not None:
            return (apart,)
        mixed = _no_clean_survivor(state, seen)
        if mixed is not None:
            return (mixed,)
    if seen.data_stop is not None:
        return (Stop(cause="data", reason=seen.data_stop),)
    if seen.stop_requested:
        return (Stop(cause="request", reason=f"stopped on request at step {state.step}"),)
    out: list[Decision] = []
    live = state.membership.num_gangs
    drain = decide_drain(
        state.membership,
        seen.drain,
        node_of_rank=seen.node_of_rank,
        max_gangs=state.max_gangs,
        min_gangs=state.elastic.min_gangs,
    )
    if drain is None and seen.stragglers is not None:
        drain = decide_eviction(
            state.membership,
            seen.stragglers,
            config=state.elastic.straggler_eviction,
            max_gangs=state.max_gangs,
            min_gangs=state.elastic.min_gangs,
        )
    if drain is not None:
        out.append(drain)
        live -= len(drain.gangs)
    if seen.built:
        out.append(_grow(state, seen.built))
        live += len(seen.built)
    if seen.waiting_since is not None and live < state.elastic.min_gangs:
        wait = _resources(state, live, since=seen.waiting_since, now=now)
        if isinstance(wait, Fail):
            return (wait,)
        out.append(wait)
    if seen.evaluate and evaluation_due(state, state.step):
        out.append(Evaluate(step=state.step))
    if seen.evaluated:
        early = _early_stop(state)
        if early is not None:
            return (early,)
    if seen.save:
        save = save_due(state, step=state.step, now=now, final=seen.final, stopping=seen.stopping)
        if save is not None:
            out.append(save)
    return tuple(out) or (Continue(reason=f"nothing to do at step {state.step}"),)


# -- the rules ----------------------------------------------------------------------------------


def _placement(p: PlacementSeen, elastic: ElasticConfig, now: float) -> Continue | Wait | Fail:
    """A whole job's placement groups: go on when all are ready, else wait until
    ``resource_wait_s`` after the wait began, then fail naming what was asked."""
    if p.ready:
        return Continue(reason="the job's placement groups are ready")
    deadline = p.since + elastic.resource_wait_s
    if now < deadline:
        return Wait(deadline=deadline, reason=f"waiting for placement groups ({p.asked})")
    return Fail(
        reason=(
            f"the job's placement groups ({p.asked}) were not ready within "
            f"elastic.resource_wait_s={elastic.resource_wait_s:g}s: the cluster has not had the "
            "free resources for them (other jobs hold them, or an autoscaler could not add "
            "nodes)"
        ),
        config_key="elastic.resource_wait_s",
    )


def _loss(state: JobState, loss: Loss) -> Reform | TotalLoss | Fail:
    """Drop every gang that lost a rank and re-form among the intact ones; with none intact, a
    total loss (rebuild from the checkpoint, or fail). A failure with every rank alive (a stall
    longer than the collective timeout) re-forms the job as it was, unless that keeps
    happening."""
    m = state.membership
    lost = loss.dead | loss.hung
    if not lost:
        transient = state.transient + 1
        if transient > MAX_TRANSIENT:
            return Fail(
                reason=(
                    f"collectives failed {transient} times in a row with every rank alive; "
                    f"last errors: {list(loss.errors)[:2]}"
                ),
                config_key="elastic.collective_timeout_s",
            )
        drop = tuple(sorted(loss.joining))
        return Reform(
            drop=drop,
            survivors=tuple(g for g in m.gang_ids if g not in drop),
            generation=m.generation + 1,
            lost_ranks=(),
            hung_ranks=(),
            reason="collectives timed out with every rank alive",
        )
    gangs = {g for r in lost if (g := m.gang_of_rank(r)) is not None} | set(loss.joining)
    drop = tuple(sorted(gangs))
    survivors = tuple(g for g in m.gang_ids if g not in gangs)
    if survivors:
        return Reform(
            drop=drop,
            survivors=survivors,
            generation=m.generation + 1,
            lost_ranks=tuple(sorted(lost | {r for g in drop for r in m.gang(g).job_ranks})),
            hung_ranks=tuple(sorted(loss.hung)),
            reason=(
                f"lost ranks {sorted(lost)}: dropping gangs {list(drop)}; {len(survivors)} "
                f"gangs form generation {m.generation + 1}"
            ),
        )
    own = tuple(sorted(r for r in lost if r not in loss.peers_killed))
    dead_shards = m.dead_shards(own)
    text = describe_total_loss(
        within_host=state.within_host, lost_ranks=own, failed_gangs=drop, dead_shards=dead_shards
    )
    return decide_total_loss(
        loss=text,
        point=state.point,
        restore=state.elastic.restore_on_total_loss,
        checkpoint=state.checkpoint,
        replayable=state.replayable,
        step=state.step,
        lost_shards=dead_shards,
        lost_ranks=own,
        lost_gangs=drop,
    )


def _survivors_apart(state: JobState, steps: Sequence[int], dropping: Sequence[int]) -> Fail | None:
    """Survivors of a failure must stand within one sync period of each other to re-form (a
    hierarchical schedule lets groups run apart between job-wide syncs)."""
    if max(steps) - min(steps) <= state.sync_every:
        return None
    return Fail(
        reason=(
            f"survivors stopped at steps {min(steps)}..{max(steps)} after losing gangs "
            f"{list(dropping)}; re-forming needs them within one sync period (a hierarchical "
            "schedule lets groups run apart between job-wide syncs)"
        ),
        config_key="sync.levels",
    )


def _no_clean_survivor(state: JobState, seen: Observations) -> TotalLoss | Fail | None:
    """Every survivor of a loss rolls back (it averaged with a lost gang at a lower level since
    the last job-wide sync): no live copy is free of the lost gangs' unsynced work, so the job
    is rebuilt from its checkpoint as after a total loss, or fails naming what would allow it."""
    m = state.membership
    survivors = [g for g in m.gang_ids if g not in seen.dropping]
    why = no_clean_survivor(
        survivors=survivors, rolled_back=seen.rolled_back, last_sync_step=m.last_sync_step
    )
    if why is None:
        return None
    return decide_total_loss(
        loss=f"lost gangs {list(seen.dropping)}: {why}",
        point=state.point,
        restore=state.elastic.restore_on_total_loss,
        checkpoint=state.checkpoint,
        replayable=state.replayable,
        step=max(seen.survivor_steps),
        lost_gangs=tuple(seen.dropping),
    )


def _grow(state: JobState, built: Sequence[Gang]) -> Grow:
    """Built gangs join at this boundary, each healing from the first live gang."""
    m = state.membership
    peer = m.gangs[0].gang_id
    return Grow(
        gangs=tuple(NewGang(gang=g, heal_from=peer) for g in built),
        join_step=state.step,
        generation=m.generation + 1,
        reason=f"gangs {[g.gang_id for g in built]} joined",
    )


def _resources(state: JobState, live: int, *, since: float, now: float) -> Wait | Fail:
    """Below ``min_gangs`` training pauses and waits for gangs until ``resource_wait_s`` after
    it started waiting, then the job fails saying so."""
    elastic = state.elastic
    deadline = since + elastic.resource_wait_s
    missing = elastic.min_gangs - live
    if now <= deadline:
        return Wait(
            deadline=deadline,
            missing_gangs=missing,
            reason=(
                f"{live} live gangs, below elastic.min_gangs={elastic.min_gangs}: waiting until "
                f"t={deadline:.1f}s for {missing} more"
            ),
        )
    return Fail(
        reason=(
            f"{live} live gangs, fewer than elastic.min_gangs={elastic.min_gangs}, and no "
            f"placement for more came within elastic.resource_wait_s="
            f"{elastic.resource_wait_s:g}s"
        ),
        config_key="elastic.resource_wait_s",
    )


def gangs_to_place(*, initial: int, fitting: int, min_gangs: int) -> int:
    """How many gangs a job placed again from a checkpoint (a resume, a new coordinator's, a
    rebuild after a total loss) asks for: its initial number, or as many as the cluster's live
    nodes hold when that is fewer, and never fewer than ``min_gangs`` (the placement then
    waits up to ``resource_wait_s`` and fails, as training below ``min_gangs`` does). The job
    grows back later as growth allows."""
    return max(min_gangs, min(initial, fitting))


def evaluation_due(state: JobState, step: int) -> bool:
    """Whether the held-out evaluation runs at the boundary at ``step``."""
    e = state.evaluation
    return (
        e is not None
        and e.batches > 0
        and eval_due(step, every=e.every, last_eval_step=e.last_step, end_step=state.end_step)
    )


def _early_stop(state: JobState) -> Stop | None:
    e = state.evaluation
    if e is None or e.patience is None or state.step >= state.end_step:
        return None
    early = early_stop_decision(
        e.scores, metric=e.metric, patience=e.patience, min_delta=e.min_delta
    )
    if early is None:
        return None
    return Stop(
        cause="early_stop",
        reason=early.reason,
        metric=e.metric,
        best=early.best,
        best_step=early.best_step,
    )


def save_due(
    state: JobState, *, step: int, now: float, final: bool = False, stopping: bool = False
) -> Checkpoint | None:
    """A checkpoint at the boundary at ``step``, when the checkpoint policy wants one there
    (never at step 0, never twice at one step)."""
    last_step, last_clock = state.last_save
    e = state.evaluation
    decision = save_decision(
        state.checkpoint,
        step=step,
        now_s=now,
        last_save_step=last_step,
        last_save_s=last_clock,
        sync_every=1,  # a sync is done right here when one is due
        final_step=state.end_step if final else None,
        stopping=stopping,
        evaluated=e is not None and e.last_step == step,
    )
    if not decision.save or step == 0 or last_step == step:
        return None
    return Checkpoint(reason=decision.reason)
