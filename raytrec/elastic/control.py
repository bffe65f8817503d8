"""The coordinator's small decisions at interval boundaries, as pure functions.

The big decisions have modules of their own: a failure (:func:`raytrec.elastic.policy.decide`:
re-form or total loss; :func:`raytrec.elastic.rollback.decide_total_loss`: rebuild or give
up), a hang (:func:`raytrec.elastic.policy.find_hung_ranks`), a drain
(:func:`raytrec.elastic.drain_policy.decide_drain`), a heal
(:func:`raytrec.elastic.heal.failed_heals`)
and a checkpoint (:func:`raytrec.checkpoint.config.save_decision`). The ones here are the rest of
what the control loop (:mod:`actors.coordinator`) asks at a boundary: which intervals it may
send ahead, how many gangs to ask the cluster for, whether to keep waiting for resources, and
whether a failure with every rank alive may be retried. Each is a function of values, tested
without a cluster.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

__all__ = [
    "Boundary",
    "Fail",
    "Proceed",
    "Wait",
    "gangs_to_request",
    "group_broke",
    "intervals_to_queue",
    "placement_decision",
    "resources_decision",
    "retry_transient",
    "survivors_apart",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Boundary:
    """What the coordinator knows at the boundary where the last collected interval ended."""

    step: int  # where the last collected interval ended
    end_step: int  # where the job's data ends
    every: int  # steps per interval (log_every)
    depth: int  # intervals in flight at most: the running one and those queued behind it
    ready: int  # batches every live rank said it holds prepared beyond ``step``
    #: Something has to run at the boundary: a placement is pending, a gang is being built, a
    #: drain is due, or a stop was asked for.
    work_at_boundary: bool
    live_gangs: int
    min_gangs: int


def intervals_to_queue(
    boundary: Boundary, in_flight_end: int | None, in_flight: int, save_due: Callable[[int], bool]
) -> list[tuple[int, int]]:
    """The ``(start, steps)`` intervals to send now, in order, behind ``in_flight`` intervals
    already sent (the last of them ending at ``in_flight_end``).

    An interval may be sent before the coordinator has seen the job reach its start only when
    nothing has to happen at that boundary: the job is not at its end, every rank said it holds
    the interval's batches (so a data problem stops every rank at the same boundary), no
    checkpoint is due there, nothing else has to run there and the job has its minimum gangs.
    """
    b = boundary
    out: list[tuple[int, int]] = []
    start = b.step if in_flight_end is None else in_flight_end
    while in_flight + len(out) < b.depth:
        n = min(b.every, b.end_step - start)
        if n <= 0 or b.ready - (start - b.step) < n:
            break
        if b.work_at_boundary or save_due(start) or b.live_gangs < b.min_gangs:
            break
        out.append((start, n))
        start += n
    return out


def gangs_to_request(
    *,
    live: int,
    outstanding: int,
    max_gangs: int,
    min_gangs: int,
    grow: bool,
) -> int:
    """How many gang placement groups to add to the cluster's pending demand: enough that the
    live gangs and those requested or being built reach ``max_gangs`` when the job grows, else
    ``min_gangs`` (one placement per gang, so an autoscaler adds a whole gang at a time)."""
    target = max_gangs if grow else min_gangs
    return max(0, target - live - outstanding)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Proceed:
    pass


@dataclasses.dataclass(frozen=True, kw_only=True)
class Wait:
    deadline: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fail:
    reason: str


def resources_decision(
    *, live: int, min_gangs: int, waiting_since: float, now: float, resource_wait_s: float
) -> Proceed | Wait | Fail:
    """Below ``min_gangs`` training pauses and waits for gangs until ``resource_wait_s`` after
    it started waiting, then the job fails saying so."""
    if live >= min_gangs:
        return Proceed()
    deadline = waiting_since + resource_wait_s
    if now <= deadline:
        return Wait(deadline=deadline)
    return Fail(
        reason=(
            f"{live} live gangs, fewer than elastic.min_gangs={min_gangs}, and no placement for "
            f"more came within elastic.resource_wait_s={resource_wait_s:g}s"
        )
    )


def placement_decision(
    *, ready: bool, waiting_since: float, now: float, resource_wait_s: float, asked: str
) -> Proceed | Wait | Fail:
    """A whole job's placement groups (at the start, or after a total loss): proceed when all
    are ready, else wait until ``resource_wait_s`` after the wait began, then fail naming what
    was asked."""
    if ready:
        return Proceed()
    deadline = waiting_since + resource_wait_s
    if now < deadline:
        return Wait(deadline=deadline)
    return Fail(
        reason=(
            f"the job's placement groups ({asked}) were not ready within "
            f"elastic.resource_wait_s={resource_wait_s:g}s: the cluster has not had the free "
            "resources for them (other jobs hold them, or an autoscaler could not add nodes)"
        )
    )


def retry_transient(failures_in_a_row: int, *, limit: int, errors: Sequence[str]) -> str | None:
    """Collectives failed with every rank alive (a stall longer than the collective timeout): the
    job re-forms as it was, unless that keeps happening. Returns why to fail, or None to
    retry."""
    if failures_in_a_row <= limit:
        return None
    return (
        f"collectives failed {failures_in_a_row} times in a row with every rank alive; last "
        f"errors: {list(errors)[:2]}"
    )


#: What gloo and NCCL say when a process group can no longer be used: a peer's connection
#: was reset or closed, or a collective timed out (gloo then closes the pair for good).
_BROKEN_GROUP = re.compile(
    r"\b(gloo|nccl|pair closure|connection (reset|closed|refused)|timed? ?out)\b", re.IGNORECASE
)


def group_broke(cause: BaseException) -> bool:
    """Whether a rank's own error says a process group it collects over failed (its transport
    or a timeout), rather than a fault of the call itself. A re-forming whose collective
    fails that way, with every rank alive, cannot tell which gang's group is unusable."""
    if isinstance(cause, TimeoutError | ConnectionError):
        return True
    return isinstance(cause, RuntimeError) and bool(_BROKEN_GROUP.search(str(cause)))


def survivors_apart(
    steps: Sequence[int], *, sync_every: int, lost_gangs: Sequence[int]
) -> str | None:
    """Survivors of a failure must stand within one sync period of each other to re-form (a
    hierarchical schedule lets groups run apart between job-wide syncs). Returns why not, or
    None."""
    if max(steps) - min(steps) <= sync_every:
        return None
    return (
        f"survivors stopped at steps {min(steps)}..{max(steps)} after losing gangs "
        f"{list(lost_gangs)}; re-forming needs them within one sync period (a hierarchical "
        "schedule lets groups run apart between job-wide syncs)"
    )
