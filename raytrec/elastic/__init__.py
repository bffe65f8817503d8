"""Elastic fault tolerance, the part that needs no Ray and no process groups.

- :mod:`~raytrec.elastic.config`: :class:`ElasticConfig` (gang bounds, timeouts, waits).
- :mod:`~raytrec.elastic.faults`: :class:`FaultConfig` / :class:`FaultSpec`, planned faults.
- :mod:`~raytrec.elastic.membership`: live gangs, generations and replica groups.
- :mod:`~raytrec.elastic.decisions`: the one union of decisions (continue, re-form, total loss,
  grow, wait, drain, checkpoint, evaluate, stop, fail).
- :mod:`~raytrec.elastic.boundary`: :func:`decide`, the one function that returns them, at
  every boundary of the coordinator's loop, with the membership rules (a loss re-forms among
  the intact gangs, growth, the wait below ``min_gangs``).
- :mod:`~raytrec.elastic.hangs`: the hang rule (no step finished for ``step_timeout_s``).
- :mod:`~raytrec.elastic.straggler_policy`: the persistent-straggler rule (a gang slower than the
  others' median for ``straggler_eviction.intervals`` intervals in a row is drained, replaced).
- :mod:`~raytrec.elastic.events`: the append-only event log returned with a run.
- :mod:`~raytrec.elastic.rows` and :mod:`~raytrec.elastic.ledger`: exactly-once row accounting.
- :mod:`~raytrec.elastic.dense`: where a failure leaves the dense parameters, and which replays
  update embedding rows only.
- :mod:`~raytrec.elastic.rollback`: a total loss (some shard without a live copy): rebuild from
  a checkpoint or fail, and where each rebuilt rank reads.

Semantics, and what the runtime carries out today: docs/fault_tolerance.md.
"""

from __future__ import annotations

from raytrec.elastic.boundary import JobState, Observations, decide
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.decisions import (
    Checkpoint,
    Continue,
    Decision,
    Drain,
    Evaluate,
    Fail,
    Grow,
    Reform,
    Stop,
    TotalLoss,
    Wait,
)
from raytrec.elastic.events import EventLog
from raytrec.elastic.faults import FaultConfig, FaultKind, FaultSpec
from raytrec.elastic.ledger import DataLedger, ExactlyOnce, ReplayPlan
from raytrec.elastic.membership import Gang, Membership, RankSlot, ReplicaMember
from raytrec.elastic.rows import RowRanges

__all__ = [
    "Checkpoint",
    "Continue",
    "DataLedger",
    "Decision",
    "Drain",
    "ElasticConfig",
    "Evaluate",
    "EventLog",
    "ExactlyOnce",
    "Fail",
    "FaultConfig",
    "FaultKind",
    "FaultSpec",
    "Gang",
    "Grow",
    "JobState",
    "Membership",
    "Observations",
    "RankSlot",
    "Reform",
    "ReplayPlan",
    "ReplicaMember",
    "RowRanges",
    "Stop",
    "TotalLoss",
    "Wait",
    "decide",
]
