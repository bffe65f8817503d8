"""Elastic fault tolerance, the part that needs no Ray and no process groups.

- :mod:`~raytrec.elastic.config`: :class:`ElasticConfig` (gang bounds, timeouts, waits).
- :mod:`~raytrec.elastic.faults`: :class:`FaultConfig` / :class:`FaultSpec`, planned faults.
- :mod:`~raytrec.elastic.membership`: live gangs, generations and replica groups.
- :mod:`~raytrec.elastic.job_state`: observations folded into the policy's state.
- :mod:`~raytrec.elastic.policy`: :func:`decide` and :func:`apply`, decisions as values.
- :mod:`~raytrec.elastic.events`: the append-only event log returned with a run.
- :mod:`~raytrec.elastic.rows` and :mod:`~raytrec.elastic.ledger`: exactly-once row accounting.
- :mod:`~raytrec.elastic.dense`: where a failure leaves the dense parameters, and which replays
  update embedding rows only.
- :mod:`~raytrec.elastic.rollback`: a total loss (some shard without a live copy): rebuild from
  a checkpoint or fail, and where each rebuilt rank reads.
- :mod:`~raytrec.elastic.sim`: a simulated job that drives all of the above with a frozen clock.

Semantics, and what the runtime carries out today: docs/fault_tolerance.md.
"""

from __future__ import annotations

from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.events import EventLog
from raytrec.elastic.faults import FaultConfig, FaultKind, FaultSpec
from raytrec.elastic.job_state import ElasticState, observe
from raytrec.elastic.ledger import DataLedger, ExactlyOnce, ReplayPlan
from raytrec.elastic.membership import Gang, Membership, RankSlot, ReplicaMember
from raytrec.elastic.policy import (
    Continue,
    Decision,
    Fail,
    Grow,
    Reform,
    Unrecoverable,
    WaitForResources,
    apply,
    decide,
    placement_requests,
    request_placements,
)
from raytrec.elastic.rows import RowRanges

__all__ = [
    "Continue",
    "DataLedger",
    "Decision",
    "ElasticConfig",
    "ElasticState",
    "EventLog",
    "ExactlyOnce",
    "Fail",
    "FaultConfig",
    "FaultKind",
    "FaultSpec",
    "Gang",
    "Grow",
    "Membership",
    "RankSlot",
    "Reform",
    "ReplayPlan",
    "ReplicaMember",
    "RowRanges",
    "Unrecoverable",
    "WaitForResources",
    "apply",
    "decide",
    "observe",
    "placement_requests",
    "request_placements",
]
