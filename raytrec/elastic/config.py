"""How an elastic job reacts to failures and to new resources.

:class:`ElasticConfig` bounds the job's size in whole gangs and sets the clocks of failure
handling: how long a rank may go without finishing a step before it counts as hung, how long the
job waits for resources while it has fewer than ``min_gangs`` gangs, and how often the
coordinator polls. Validated on construction; errors name the field, the value and what is
allowed.
"""

from __future__ import annotations

import dataclasses

from raytrec.errors import ConfigError

__all__ = ["ElasticConfig"]


def _check_int(field: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{field} must be an integer >= {minimum}, got {value!r}")


def _check_seconds(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(f"{field} must be a positive number of seconds, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ElasticConfig:
    """Size bounds and failure-handling clocks of an elastic job.

    - ``min_gangs``: below this many live gangs training pauses and the job waits for
      resources (at most ``resource_wait_s``), then fails.
    - ``max_gangs``: the job never grows past this many gangs; None means the initial number.
    - ``step_timeout_s``: a rank that finishes no step for this long is stalled; a stalled rank
      that did not itself report a collective timeout is the hung one.
    - ``collective_timeout_s``: how long a rank's collectives wait before giving up and
      reporting it; shorter than ``step_timeout_s`` so that by the time a rank counts as stalled
      its waiting peers have already reported.
    - ``poll_s``: the coordinator's heartbeat/poll period; a failure is acted on at most
      ``poll_s`` after it is observable (a hang: ``step_timeout_s + poll_s``).
    - ``resource_wait_s``: how long the job waits for placement of the gangs it needs (below
      ``min_gangs``, or a whole job after a total loss) before it fails.
    - ``grow``: request placement for new gangs up to ``max_gangs`` whenever the job is smaller;
      when False the job only replaces gangs to get back to ``min_gangs``.
    - ``restore_on_total_loss``: when a failure leaves some shard with no live copy (every gang
      lost a rank, or a host under ``replicas_within_host``), rebuild the whole job from its
      last checkpoint (or the one it resumed from) and train on; when False, or with no
      checkpoint, the job fails.
    """

    min_gangs: int = 1
    max_gangs: int | None = None
    step_timeout_s: float = 300.0
    collective_timeout_s: float = 120.0
    resource_wait_s: float = 600.0
    poll_s: float = 1.0
    grow: bool = True
    restore_on_total_loss: bool = True

    def __post_init__(self) -> None:
        _check_int("elastic.min_gangs", self.min_gangs, minimum=1)
        if self.max_gangs is not None:
            _check_int("elastic.max_gangs", self.max_gangs, minimum=1)
            if self.max_gangs < self.min_gangs:
                raise ConfigError(
                    f"elastic.max_gangs={self.max_gangs} is below elastic.min_gangs="
                    f"{self.min_gangs}; allowed: None or an integer >= {self.min_gangs}"
                )
        for field in ("step_timeout_s", "collective_timeout_s", "resource_wait_s", "poll_s"):
            _check_seconds(f"elastic.{field}", getattr(self, field))
        if self.collective_timeout_s >= self.step_timeout_s:
            raise ConfigError(
                f"elastic.collective_timeout_s={self.collective_timeout_s} must be below "
                f"elastic.step_timeout_s={self.step_timeout_s}, so that waiting ranks report "
                "their timeout before the hung rank is singled out"
            )
        if self.poll_s >= self.step_timeout_s:
            raise ConfigError(
                f"elastic.poll_s={self.poll_s} must be below elastic.step_timeout_s="
                f"{self.step_timeout_s}"
            )
        for field in ("grow", "restore_on_total_loss"):
            if not isinstance(getattr(self, field), bool):
                raise ConfigError(
                    f"elastic.{field} must be True or False, got {getattr(self, field)!r}"
                )

    def resolved_max_gangs(self, initial_gangs: int) -> int:
        """``max_gangs``, or the initial number of gangs when unset; checked against min."""
        _check_int("initial number of gangs", initial_gangs, minimum=1)
        if initial_gangs < self.min_gangs:
            raise ConfigError(
                f"the job starts with {initial_gangs} gangs, fewer than elastic.min_gangs="
                f"{self.min_gangs}; allowed: min_gangs <= {initial_gangs}"
            )
        if self.max_gangs is None:
            return initial_gangs
        if self.max_gangs < initial_gangs:
            raise ConfigError(
                f"elastic.max_gangs={self.max_gangs} is below the initial {initial_gangs} gangs; "
                f"allowed: None or an integer >= {initial_gangs}"
            )
        return self.max_gangs
