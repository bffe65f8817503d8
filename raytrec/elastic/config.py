"""How an elastic job reacts to failures and to new resources.

:class:`ElasticConfig` bounds the job's size in whole gangs and sets the clocks of failure
handling: how long a rank may go without finishing a step before it counts as hung, how long the
job waits for resources while it has fewer than ``min_gangs`` gangs, and how often the
coordinator polls.
"""

from __future__ import annotations

from typing import Annotated

from annotated_types import Gt
from pydantic import model_validator

from raytrec.config.base import (
    ConfigError,
    ConfigModel,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
)

__all__ = ["ElasticConfig", "StragglerEviction"]


class StragglerEviction(ConfigModel):
    """Evicting a persistent straggler: a gang whose own step time stays above the other
    gangs' median by `factor` for `intervals` intervals in a row is drained (every row kept)
    and, where the cluster has room, replaced (docs/stragglers.md)."""

    factor: Annotated[float, Gt(1)] = 1.5
    """A gang is slow in an interval when its step time (the rank's time in the call, less
    its sync and data waits, per step; its slowest rank's) exceeds `factor` times the median
    of the other gangs'."""
    intervals: PositiveInt = 3
    """Intervals (`log_every` steps each) in a row a gang must be slow to be evicted; a gang
    slow fewer times is left alone."""


class ElasticConfig(ConfigModel):
    """Size bounds and failure-handling clocks of an elastic job."""

    min_gangs: PositiveInt = 1
    """Below this many live gangs training pauses and the job waits for resources (at most
    `resource_wait_s`), then fails."""
    max_gangs: PositiveInt | None = None
    """The job never grows past this many gangs; null: the initial number."""
    step_timeout_s: PositiveFloat = 300.0
    """A rank that finishes no step for this long is stalled; a stalled rank that did not
    itself report a collective timeout is the hung one."""
    collective_timeout_s: PositiveFloat = 120.0
    """How long a rank's collectives wait before giving up and reporting it; shorter than
    `step_timeout_s` so that by the time a rank counts as stalled its waiting peers have
    already reported."""
    resource_wait_s: PositiveFloat = 600.0
    """How long the job waits for placement of the gangs it needs (below `min_gangs`, or a
    whole job after a total loss) before it fails."""
    poll_s: PositiveFloat = 1.0
    """The coordinator's heartbeat/poll period; a failure is acted on at most `poll_s` after it
    is observable (a hang: `step_timeout_s + poll_s`), and a new gang's placement group is
    looked for this often, also while an interval runs."""
    domain_wait_s: NonNegativeFloat = 60.0
    """How long a gang joining the job (a replacement, or growth) waits for room in a failure
    domain no other gang holds (`scaling.failure_domain`) when the only room now is in one
    that another gang holds and some domain holds none; then it is placed in the shared one,
    with a `domain_shared` event. 0: it never waits."""
    grow: bool = True
    """Request placement for new gangs up to `max_gangs` whenever the job is smaller; false:
    the job only replaces gangs to get back to `min_gangs`."""
    restore_on_total_loss: bool = True
    """When a failure leaves some shard with no live copy (every gang lost a rank, or a host
    under `replicas_within_host`), rebuild the whole job from its last checkpoint (or the one
    it resumed from) and train on; false, or with no checkpoint, the job fails."""
    max_coordinator_restarts: NonNegativeInt = 3
    """How many times the driver starts a new coordinator when the coordinator's process dies
    (an OOM kill, a defect, its actor killed); the new one continues the same run from its
    newest checkpoint (from the start of the data without one). 0: the job fails with the
    coordinator, with its ledger and the checkpoint to resume from."""
    straggler_eviction: StragglerEviction | None = None
    """Evict a gang that stays slower than the others (off: null). Off by default: a slow
    interval on a shared or heterogeneous cluster is not a degraded host, and an eviction
    costs a job-wide sync and a new gang's build and heal."""

    @model_validator(mode="after")
    def _clocks_in_order(self) -> ElasticConfig:
        if self.max_gangs is not None and self.max_gangs < self.min_gangs:
            raise ConfigError(
                f"elastic.max_gangs={self.max_gangs} is below elastic.min_gangs="
                f"{self.min_gangs}; allowed: None or an integer >= {self.min_gangs}"
            )
        if self.collective_timeout_s >= self.step_timeout_s:
            raise ConfigError(
                f"elastic.collective_timeout_s={self.collective_timeout_s:g} must be below "
                f"elastic.step_timeout_s={self.step_timeout_s:g}, so that waiting ranks report "
                "their timeout before the hung rank is singled out"
            )
        if self.poll_s >= self.step_timeout_s:
            raise ConfigError(
                f"elastic.poll_s={self.poll_s:g} must be below elastic.step_timeout_s="
                f"{self.step_timeout_s:g}"
            )
        return self

    def resolved_max_gangs(self, initial_gangs: int) -> int:
        """``max_gangs``, or the initial number of gangs when unset; checked against min."""
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
