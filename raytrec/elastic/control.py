"""Scheduling helpers of the coordinator's loop, as pure functions: not decisions.

What the job does at a boundary is decided in one place,
:func:`raytrec.elastic.boundary.decide`, as a value of the union in
:mod:`raytrec.elastic.decisions`. What is here only shapes how the loop carries on: which
intervals it may send ahead (:func:`intervals_to_queue`), how many gang placement groups to keep
pending (:func:`gangs_to_request`) and whether a rank's error says its process group broke
(:func:`group_broke`, which turns a failure with every rank alive into a loss). Each is a
function of values, tested without a cluster.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raytrec.config import SyncConfig

__all__ = [
    "Boundary",
    "gangs_to_request",
    "group_broke",
    "intervals_to_queue",
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


def queue_depth(sync: SyncConfig) -> int:
    """Intervals in flight at once: the running one and one queued behind it, unless the gangs
    may drift apart between syncs (hierarchical levels with dense state synced on the schedule):
    then a survivor of a failure could be a whole interval further on than the others, and the
    job sends the next interval only after the last one."""
    hierarchical = bool(sync.levels) and sync.dense != "every_step"
    return 1 if hierarchical else 2


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
