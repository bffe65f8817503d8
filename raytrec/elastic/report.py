"""What a rank tells the coordinator: typed values that cross the process boundary.

A :class:`RankReport` is one rank's account of one interval (``RankWorker.train``), or of what
it trained since its last report when an interval failed (``RankWorker.recover``). The
coordinator books its ``trained`` batches in the accounting (:mod:`~.accounting`), folds its
numbers into the metrics history (:func:`raytrec.observability.metrics.aggregate_interval`) and its
step
into the control state. :class:`RankInfo` says where a built rank runs.

Pure values; picklable, so Ray ships them as they are.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raytrec.elastic.rank_protocol import StateDigest
    from raytrec.observability.metrics import IntervalMetrics
    from raytrec.observability.rec_metrics import MetricState

__all__ = ["RankInfo", "RankReport", "RunSummary", "TrainedBatch"]

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
class RunSummary:
    """What the coordinator hands the driver when the job ends."""

    history: list[IntervalMetrics]
    final_state_path: str | None
    steps: int
    wall_s: float
    ranks: list[RankInfo]
    digests: dict[int, StateDigest]  # job rank -> content hashes of its final state
    # Why training stopped before num_steps (bad input, data ran out), else None. The state
    # trained up to ``steps`` is still synced, checked and saved.
    stopped_by: BaseException | None = None
    first_batch_s: float = 0.0  # until every rank held its first interval's batches
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    generation: int = 0
    # Exactly-once accounting of batches (replayable sources): ids trained into the final model
    # (committed), counted with multiplicity, and those handed to survivors for replay.
    committed_batches: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    committed_count: int = 0
    # The rows the committed batches hold, counted with multiplicity (None: the source names
    # no batches, so nothing is committed by id).
    committed_rows: int | None = None
    replayed_batches: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    lost_batches: int = 0  # uncommitted batches of lost gangs that could not be replayed
    checkpoint: str | None = None  # the last checkpoint this run saved
    reshared_streams: dict[str, Any] | None = None  # StreamTable.to_json() of a re-shared source
