"""The elastic policy: what to do about the job's membership, as a value.

:func:`decide_membership` is a pure function of the state (membership plus observations, see
:mod:`raytrec.elastic.job_state`), the clock and the :class:`ElasticConfig`. It returns one
decision of the union in :mod:`raytrec.elastic.decisions`:

- :class:`Reform`: drop every gang that lost a rank (dead rank, lost node, hang) and start a new
  generation among the survivors; several failures seen together make one Reform.
- :class:`TotalLoss`: no gang survives intact, so some shard has no live copy left; the
  job needs a checkpoint.
- :class:`Grow`: placed gangs join at a sync boundary, each healing from a live peer gang.
- :class:`Wait`: fewer than ``min_gangs`` gangs; training pauses until gangs are
  placed or the deadline passes.
- :class:`Fail`: still below ``min_gangs`` at the deadline.
- :class:`Continue`: nothing to change.

The controller carries a decision out and then calls :func:`apply`, which returns the next state
and the events to log. :func:`placement_requests` says how many gang placement groups to add to
the cluster's pending demand (one per wanted gang, so an autoscaler grows the job by whole gangs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.decisions import Continue, Fail, Grow, NewGang, Reform, TotalLoss, Wait
from raytrec.elastic.events import (
    Event,
    GangDropped,
    GangHealed,
    GangJoined,
    GangRequested,
    GenerationStarted,
    HangDetected,
    JobFailed,
    ResourcesWaited,
)
from raytrec.elastic.job_state import ElasticState

__all__ = [
    "PAST_TIMEOUT_S",
    "MembershipDecision",
    "apply",
    "decide_membership",
    "find_hung_ranks",
    "next_hang_check",
    "placement_requests",
    "request_placements",
]


#: What :func:`decide_membership` returns: the membership's part of the union.
MembershipDecision = Continue | Reform | TotalLoss | Grow | Wait | Fail


def _target_gangs(state: ElasticState, config: ElasticConfig) -> int:
    return state.max_gangs if config.grow else config.min_gangs


def find_hung_ranks(state: ElasticState, *, now: float, config: ElasticConfig) -> tuple[int, ...]:
    """Live ranks that count as hung at ``now``.

    A rank is stalled when it finished no step for ``step_timeout_s``. Peers blocked on a hung
    rank stall as well, but their collectives time out first (``collective_timeout_s`` is
    shorter) and they report it; the stalled ranks that stayed silent are the hung ones. If every
    stalled rank reported a timeout, none can be singled out and all of them count as hung.
    """
    if state.membership.num_gangs < config.min_gangs:
        return ()  # paused: nobody is expected to make progress
    stalled = {
        r
        for g in state.membership.gangs
        for r in g.job_ranks
        if now - state.progress.get(r, (0, now))[1] > config.step_timeout_s
    }
    silent = stalled - state.timed_out
    return tuple(sorted(silent or stalled))


#: How far past a rank's step timeout its heartbeat is read again (the rule is "silent for
#: longer than step_timeout_s").
PAST_TIMEOUT_S = 0.001


def next_hang_check(silent_since: Iterable[float], *, now: float, config: ElasticConfig) -> float:
    """Seconds until the heartbeats are worth reading again, given when each rank still training
    was last seen to finish a step: a poll, or less when a rank's silence passes
    ``step_timeout_s`` before then. A hang is then found ``step_timeout_s`` after the rank's
    step was last seen to move, not up to a poll later, which keeps it within
    ``step_timeout_s + poll_s`` of the rank's last finished step."""
    seen = min(silent_since, default=None)
    if seen is None:
        return config.poll_s
    until = seen + config.step_timeout_s - now
    return min(config.poll_s, max(until, 0.0) + PAST_TIMEOUT_S)


def decide_membership(
    state: ElasticState, *, now: float, config: ElasticConfig
) -> MembershipDecision:
    """The one decision for the state at ``now``; see the module doc for the order of checks."""
    m = state.membership
    if state.failed is not None:
        return Fail(reason=state.failed, config_key=state.failed_key or "")
    hung = find_hung_ranks(state, now=now, config=config)
    lost = state.lost_ranks | set(hung)
    if lost:
        broken = tuple(sorted({g for r in lost if (g := m.gang_of_rank(r)) is not None}))
        survivors = tuple(g for g in m.gang_ids if g not in set(broken))
        causes = _describe_losses(state, hung, now=now)
        if not survivors:
            shards = m.dead_shards(lost)
            if shards:
                what = (
                    f"replica groups {list(shards)} lost every copy of their shard"
                    f" ({len(shards)} of {m.gang_size} shard positions)"
                )
            else:
                what = (
                    "every shard still has a copy, but only in gangs that lost other ranks, and a "
                    "model copy is only recovered from an intact gang"
                )
            return TotalLoss(
                lost_shards=shards,
                lost_gangs=broken,
                lost_ranks=tuple(sorted(lost)),
                reason=(
                    f"{causes} broke all {m.num_gangs} gangs {list(m.gang_ids)}: {what}. No live "
                    f"copy is left to re-form from; recovering this job needs a checkpoint "
                    f"(elastic.restore_on_total_loss)"
                ),
            )
        return Reform(
            drop=broken,
            survivors=survivors,
            generation=m.generation + 1,
            lost_ranks=tuple(sorted(lost)),
            hung_ranks=hung,
            reason=(
                f"{causes}: dropping gangs {list(broken)}; {len(survivors)} gangs "
                f"{_short(survivors)} form generation {m.generation + 1}"
            ),
        )

    room = _target_gangs(state, config) - m.num_gangs
    if m.num_gangs < config.min_gangs:
        if state.ready and room > 0:
            return _grow(state, room, paused=True)
        deadline = (now if state.waiting_since is None else state.waiting_since) + (
            config.resource_wait_s
        )
        missing = config.min_gangs - m.num_gangs
        if now < deadline:
            return Wait(
                missing_gangs=missing,
                deadline=deadline,
                reason=(
                    f"{m.num_gangs} live gangs, below elastic.min_gangs={config.min_gangs}: "
                    f"training paused, waiting until t={deadline:.1f}s for {missing} more gang "
                    f"placement(s)"
                ),
            )
        since = deadline - config.resource_wait_s
        return Fail(
            reason=(
                f"only {m.num_gangs} live gangs, below elastic.min_gangs={config.min_gangs}, and "
                f"no gang could be placed within elastic.resource_wait_s="
                f"{config.resource_wait_s:g}s (waited from t={since:.1f}s to t={now:.1f}s); the "
                f"cluster lacks resources for {missing} gang(s) of {m.gang_size} ranks"
            ),
            config_key="elastic.resource_wait_s",
        )
    if state.ready and room > 0:
        if state.at_sync_boundary:
            return _grow(state, room, paused=False)
        return Continue(
            reason=(
                f"{len(state.ready)} placed gang(s) wait for the sync boundary at step "
                f"{state.next_sync_step}"
            ),
            join_at=state.next_sync_step,
        )
    return Continue(reason=f"{m.num_gangs} gangs healthy at step {state.step}")


def _grow(state: ElasticState, room: int, *, paused: bool) -> Grow:
    m = state.membership
    placements = state.ready[:room]
    gangs, _ = m.reserve(placements)
    peers = m.gang_ids
    new = tuple(NewGang(gang=g, heal_from=peers[i % len(peers)]) for i, g in enumerate(gangs))
    when = (
        f"training is paused below min_gangs, so the survivors sync now at step {state.step}"
        if paused
        else f"at the sync boundary of step {state.step}"
    )
    return Grow(
        gangs=new,
        join_step=state.step,
        generation=m.generation + 1,
        reason=(
            f"{len(new)} gang(s) placed: gangs {[n.gang.gang_id for n in new]} heal from "
            f"{[n.heal_from for n in new]} and join {when}, forming generation "
            f"{m.generation + 1} with {m.num_gangs + len(new)} gangs"
        ),
    )


def _describe_losses(state: ElasticState, hung: tuple[int, ...], *, now: float) -> str:
    parts = []
    if state.dead_nodes:
        lost_nodes = sorted(n for n in state.dead_nodes if state.membership.gangs_on_nodes([n]))
        if lost_nodes:
            parts.append(f"lost node(s) {_short(lost_nodes)}")
    if state.dead_ranks:
        parts.append(f"dead rank(s) {_short(sorted(state.dead_ranks))}")
    if hung:
        silent_s = max(now - state.progress[r][1] for r in hung)
        parts.append(f"hung rank(s) {_short(hung)} (no step finished for {silent_s:.1f}s)")
    return " and ".join(parts) or "lost ranks"


def _short(values: tuple[int, ...] | list[int], limit: int = 16) -> str:
    items = list(values)
    if len(items) <= limit:
        return str(items)
    return f"[{', '.join(map(str, items[:limit]))}, ... ({len(items)} in all)]"


def apply(
    state: ElasticState, decision: MembershipDecision, *, now: float, config: ElasticConfig
) -> tuple[ElasticState, tuple[Event, ...]]:
    """The state after ``decision`` was carried out, and the events that record it."""
    m, step = state.membership, state.step
    if isinstance(decision, Continue):
        return state, ()
    if isinstance(decision, Reform):
        events: list[Event] = []
        if decision.hung_ranks:
            silent = max(now - state.progress[r][1] for r in decision.hung_ranks)
            events.append(
                HangDetected(
                    at=now,
                    step=step,
                    job_ranks=decision.hung_ranks,
                    gang_ids=tuple(
                        sorted(
                            {g for r in decision.hung_ranks if (g := m.gang_of_rank(r)) is not None}
                        )
                    ),
                    last_step=min(state.progress[r][0] for r in decision.hung_ranks),
                    silent_s=silent,
                )
            )
        new_m = m.without(decision.drop)
        events += [
            GangDropped(at=now, step=step, gang_id=g, reason=decision.reason) for g in decision.drop
        ]
        events.append(
            GenerationStarted(
                at=now,
                step=step,
                generation=new_m.generation,
                gang_ids=new_m.gang_ids,
                reason=decision.reason,
            )
        )
        new = dataclasses.replace(
            state, membership=new_m, dead_ranks=frozenset(), timed_out=frozenset()
        )
        return dataclasses.replace(new, progress=new.restart_clocks(now)), tuple(events)
    if isinstance(decision, Grow):
        placements = tuple(tuple(s.node for s in n.gang.ranks) for n in decision.gangs)
        if state.ready[: len(placements)] != placements:
            raise ValueError("Grow does not match the ready placements; decide_membership() again")
        gangs, reserved = m.reserve(placements)
        if gangs != tuple(n.gang for n in decision.gangs):
            raise ValueError(
                "Grow names gangs other than the next free ids; decide_membership() again"
            )
        new_m = reserved.with_gangs(gangs, step=decision.join_step)
        events = []
        for n in decision.gangs:
            events.append(
                GangHealed(at=now, step=step, gang_id=n.gang.gang_id, peer_gang_id=n.heal_from)
            )
        for n in decision.gangs:
            events.append(
                GangJoined(at=now, step=step, gang_id=n.gang.gang_id, generation=new_m.generation)
            )
        events.append(
            GenerationStarted(
                at=now,
                step=step,
                generation=new_m.generation,
                gang_ids=new_m.gang_ids,
                reason=decision.reason,
            )
        )
        new = dataclasses.replace(
            state,
            membership=new_m,
            ready=state.ready[len(placements) :],
            waiting_since=None if new_m.num_gangs >= config.min_gangs else state.waiting_since,
        )
        return dataclasses.replace(new, progress=new.restart_clocks(now)), tuple(events)
    if isinstance(decision, Wait):
        if state.waiting_since is not None:
            return state, ()
        event = ResourcesWaited(
            at=now,
            step=step,
            live_gangs=m.num_gangs,
            min_gangs=config.min_gangs,
            deadline=decision.deadline,
        )
        return dataclasses.replace(state, waiting_since=now), (event,)
    if isinstance(decision, TotalLoss | Fail):
        if state.failed is not None:
            return state, ()  # already failed and logged
        failed = JobFailed(
            at=now,
            step=step,
            reason=decision.reason,
            needs_checkpoint=isinstance(decision, TotalLoss),
        )
        key = decision.config_key if isinstance(decision, Fail) else "elastic.restore_on_total_loss"
        return dataclasses.replace(state, failed=decision.reason, failed_key=key), (failed,)
    raise TypeError(f"not a decision: {decision!r}")


def placement_requests(state: ElasticState, config: ElasticConfig) -> int:
    """How many more gang placement groups to request now: enough that live, ready and
    outstanding gangs reach the target (``max_gangs`` when growing, else ``min_gangs``)."""
    if state.failed is not None:
        return 0
    have = state.membership.num_gangs + len(state.ready) + state.outstanding
    return max(0, _target_gangs(state, config) - have)


def request_placements(
    state: ElasticState, count: int, *, now: float
) -> tuple[ElasticState, tuple[Event, ...]]:
    """The state after the coordinator requested ``count`` gang placement groups."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if count == 0:
        return state, ()
    outstanding = state.outstanding + count
    event = GangRequested(at=now, step=state.step, count=count, outstanding=outstanding)
    return dataclasses.replace(state, outstanding=outstanding), (event,)
