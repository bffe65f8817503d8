"""What a rank tells the coordinator: typed values that cross the process boundary.

A :class:`RankReport` is one rank's account of one interval (``RankWorker.train``), or of what
it trained since its last report when an interval failed (``RankWorker.recover``). The
coordinator books its ``trained`` batches in the accounting (:mod:`~.accounting`), folds its
numbers into the metrics history (:func:`raytrec.observability.metrics.aggregate_interval`) and its
step
into the control state. :class:`RankInfo` says where a built rank runs.

When the job ends the coordinator hands the driver a :class:`RunSummary`: a :class:`RunRecord`
(what the job did: its metrics, events, final state and batch accounting), which
:class:`raytrec.result.Result` extends with the driver's own fields, and what only the driver
needs to build that result.

Pure values; picklable, so Ray ships them as they are.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from raytrec.elastic.events import EventLog

if TYPE_CHECKING:
    from raytrec.elastic.rank_protocol import StateDigest
    from raytrec.observability.metrics import IntervalMetrics
    from raytrec.observability.rec_metrics import MetricState

__all__ = ["RankInfo", "RankReport", "RunRecord", "RunSummary", "TrainedBatch", "record_fields"]

#: ``(step, batch id)``: the batch a rank trained at that job step (id None: the source cannot
#: name its batches).
TrainedBatch = tuple[int, int | None]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankReport:
    """One rank's report: the batches it trained, and the interval's numbers when it ran one."""

    rank: int
    step: int  # the rank's step count after the report's last batch
    trained: tuple[TrainedBatch, ...] = ()
    losses: tuple[float, ...] = ()
    rows: int = 0
    # ``(batch id, rows)`` of the trained batches holding fewer rows than the job's batch size
    # (a stream's last batch, rows skipped as bad): the ledger counts committed rows exactly.
    short: tuple[tuple[int, int], ...] = ()
    seconds: float = 0.0  # the rank's time in the call (its own clock)
    data_wait_s: float = 0.0
    sync_s: float = 0.0
    stall_s: float = 0.0  # injected stalls (the straggler simulator)
    #: The rank's metric state over the interval's rows
    #: (:class:`raytrec.observability.rec_metrics.RankMetrics`).
    metrics: MetricState | None = None
    #: A data problem found while preparing the next batches (bad input, the data ran out): the
    #: job stops at the boundary before them.
    stop: BaseException | None = None
    ready: int = 0  # batches prepared beyond ``step``
    idle_s: float | None = None  # since the rank's previous call ended
    #: The call was queued behind one that failed and did nothing.
    skipped: bool = False
    #: Made up by the coordinator for a rank that died: its batches follow from its stream order.
    lost: bool = False
    #: ``recover`` after a failed step: the step's embedding update happened, its dense update
    #: did not; the rank holds that step's dense gradients until the coordinator settles it
    #: (:func:`raytrec.elastic.dense.settle_failed_step`).
    abandoned_dense_update: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankInfo:
    """Where a built rank runs."""

    rank: int
    gang: int
    node_id: str  # Ray's node id
    address: str = ""  # the node's Ray address (IP)
    pid: int
    device: str


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
