"""What the job did, as its coordinator reports it when the job ends.

The coordinator hands the driver a :class:`RunSummary`: a :class:`RunRecord` (what the job did:
its metrics, events, final state and batch accounting), which :class:`raytrec.result.Result`
extends with the driver's own fields, and what only the driver needs to build that result.

Pure values; picklable, so Ray ships them as they are.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from raytrec.elastic.events import EventLog

if TYPE_CHECKING:
    from raytrec.elastic.rank_protocol import StateDigest
    from raytrec.elastic.report import RankInfo
    from raytrec.observability.metrics import IntervalMetrics

__all__ = ["RunRecord", "RunSummary", "record_fields"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunRecord:
    """What the job did, as its coordinator reports it: the part of :class:`RunSummary` that
    :class:`raytrec.result.Result` holds as it is."""

    history: list[IntervalMetrics]  # one row per log_every steps
    final_state_path: str | None  # the final model, a torch.distributed.checkpoint directory
    steps: int
    wall_s: float
    # job rank -> content hashes of its final shard and dense state (equal within a replica group)
    state_digests: dict[int, StateDigest]
    first_batch_s: float = 0.0  # from the start of training until every rank held its batches
    # Failures, generations, heals and resizes, in order, each with its time and step
    # (raytrec.elastic.events): result.events.of(GangJoined), or iterate them.
    events: EventLog = dataclasses.field(default_factory=EventLog)
    generation: int = 0  # the last generation
    # Exactly-once accounting (replayable sources): batch ids trained into the final model as
    # merged [start, stop) ranges, their count with multiplicity, and those replayed.
    committed_batches: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    committed_count: int = 0
    replayed_batches: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    lost_batches: int = 0  # uncommitted batches of lost gangs that could not be replayed
    # Rows the committed batches hold, with multiplicity (None: the source names no batches).
    committed_rows: int | None = None
    # Parquet read by index: the streams made when the rows left were shared again among the
    # ranks after a membership change (the ids of committed batches name them), as JSON
    # (StreamTable.to_json()); None for other sources. IndexedParquetShard.with_table(...)
    # reads or locates any of them.
    reshared_streams: dict[str, Any] | None = None


def record_fields(record: RunRecord) -> dict[str, Any]:
    """The :class:`RunRecord` fields of ``record`` (a :class:`RunSummary`) by name, as they are
    (not copied): ``Result(**record_fields(summary), ...)``."""
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(RunRecord)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSummary(RunRecord):
    """What the coordinator hands the driver when the job ends."""

    ranks: list[RankInfo]
    # Why training stopped before num_steps (bad input, data ran out), else None. The state
    # trained up to ``steps`` is still synced, checked and saved.
    stopped_by: BaseException | None = None
    checkpoint: str | None = None  # the last checkpoint this run saved
