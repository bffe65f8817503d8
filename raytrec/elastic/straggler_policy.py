"""Evicting a persistent straggler, as a decision value.

A gang on a degraded host (a slow disk, a throttled GPU, a noisy neighbour) slows the groups it
syncs with at every sync, and a sync schedule cannot hide it; it is never slow enough to count
as hung (``elastic.step_timeout_s``). With ``elastic.straggler_eviction`` set, the coordinator
measures every gang's own step time in each interval and evicts a gang that stays slower than
the others: it is drained (its work committed, its rows left shared among the others, as any
drain) and the job's gang cap is left as it was, so the growth path asks for a replacement
where the cluster has room.

- :func:`gang_step_seconds`: a gang's step time in one interval, from its ranks' reports: the
  rank's time in the ``train`` call less its sync and data waits, per step trained; the gang's
  slowest rank's. The waits of fast gangs for a slow one are in their sync time, so only the
  slow gang's own time grows (under ``sync.dense="with_schedule"``; with ``"every_step"``
  every rank waits for the straggler inside each step and no gang stands out).
- :class:`StragglerWatch`: each gang's run of consecutive slow intervals: a gang is slow in an
  interval when its step time exceeds ``factor`` times the median of the other gangs'.
- :func:`decide_eviction`: the gang to evict, or None: the longest run (at least
  ``intervals``), one gang at a time, never below ``elastic.min_gangs``.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Iterable, Mapping

from raytrec.elastic.config import StragglerEviction
from raytrec.elastic.decisions import Drain, SlowGang
from raytrec.elastic.membership import Membership
from raytrec.elastic.report import RankReport

__all__ = ["StragglerWatch", "decide_eviction", "gang_step_seconds"]


def gang_step_seconds(
    reports: Iterable[RankReport], gang_of: Callable[[int], int | None]
) -> dict[int, float]:
    """Each gang's own seconds a step in the interval ``reports`` account for (module doc);
    gangs with no rank that trained a step are left out."""
    out: dict[int, float] = {}
    for r in reports:
        gang = gang_of(r.rank)
        if gang is None or r.skipped or r.lost or not r.trained:
            continue
        own = max(0.0, r.seconds - r.sync_s - r.data_wait_s) / len(r.trained)
        out[gang] = max(out.get(gang, 0.0), own)
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class StragglerWatch:
    """Gangs slow in the last intervals, each with its run of slow intervals in a row."""

    slow: tuple[SlowGang, ...] = ()

    def observe(self, step_s: Mapping[int, float], factor: float) -> StragglerWatch:
        """The watch after one more interval with these gangs' step times: a gang slower than
        ``factor`` times the others' median extends its run, any other gang's run ends (a gang
        that did not report, too). Fewer than two gangs: nothing to compare, every run ends."""
        if len(step_s) < 2:
            return StragglerWatch()
        runs = {s.gang: s.intervals for s in self.slow}
        slow = []
        for gang, own in sorted(step_s.items()):
            others = statistics.median(v for g, v in step_s.items() if g != gang)
            if own > factor * others:
                slow.append(
                    SlowGang(
                        gang=gang, step_s=own, others_s=others, intervals=runs.get(gang, 0) + 1
                    )
                )
        return StragglerWatch(slow=tuple(slow))


def decide_eviction(
    membership: Membership,
    watch: StragglerWatch,
    *,
    config: StragglerEviction | None,
    max_gangs: int,
    min_gangs: int,
) -> Drain | None:
    """The persistent straggler to evict now, as a :class:`Drain` of that one gang that keeps
    the job's gang cap (so it is replaced), or None: eviction off, no live gang slow for
    ``config.intervals`` intervals in a row, or the job at ``min_gangs`` (it never goes below,
    and never gives back its last gang). Of several, the longest run goes, then the slowest
    against its peers."""
    if config is None:
        return None
    live = set(membership.gang_ids)
    due = [s for s in watch.slow if s.gang in live and s.intervals >= config.intervals]
    if not due or len(live) - 1 < max(min_gangs, 1):
        return None
    worst = max(due, key=lambda s: (s.intervals, s.step_s / max(s.others_s, 1e-12), -s.gang))
    return Drain(
        gangs=(worst.gang,),
        max_gangs=max_gangs,
        straggler=worst,
        reason=(
            f"gang {worst.gang} is a persistent straggler: {worst.step_s:.3g} s a step against "
            f"the other gangs' median {worst.others_s:.3g} s for {worst.intervals} intervals in "
            f"a row (elastic.straggler_eviction: factor={config.factor:g}, "
            f"intervals={config.intervals}); evicting it, {len(live) - 1} left, a replacement "
            "asked for"
        ),
    )
