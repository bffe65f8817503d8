"""The hang rule: which ranks count as hung, and when the heartbeats are worth reading again.

A rank is hung when it finished no step for ``elastic.step_timeout_s``
(:func:`find_hung_ranks`). The coordinator reads the ranks' heartbeats (the last step each
finished, and when it saw that) while an interval runs, every ``elastic.poll_s`` or sooner
when a rank's silence is about to pass the timeout (:func:`next_hang_check`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.membership import Membership

__all__ = ["PAST_TIMEOUT_S", "find_hung_ranks", "next_hang_check"]


def find_hung_ranks(
    membership: Membership,
    progress: Mapping[int, tuple[int, float]],
    *,
    now: float,
    config: ElasticConfig,
) -> tuple[int, ...]:
    """The live ranks that finished no step for longer than ``step_timeout_s`` at ``now``.

    ``progress`` maps a job rank to (the last step it finished, when that was seen); a rank
    missing from it counts as seen at ``now``. Below ``min_gangs`` training is paused and
    nobody is expected to make progress, so no rank counts as hung.
    """
    if membership.num_gangs < config.min_gangs:
        return ()
    return tuple(
        sorted(
            r
            for g in membership.gangs
            for r in g.job_ranks
            if now - progress.get(r, (0, now))[1] > config.step_timeout_s
        )
    )


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
