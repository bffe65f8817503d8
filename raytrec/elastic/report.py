"""What a rank tells the coordinator: typed values that cross the process boundary.

A :class:`RankReport` is one rank's account of one interval (``RankWorker.train``), or of what
it trained since its last report when an interval failed (``RankWorker.recover``). The
coordinator books its ``trained`` batches in the accounting (:mod:`~.accounting`), folds its
numbers into the metrics history (:func:`raytrec.observability.metrics.aggregate_interval`)
and its step into the control state. :class:`RankInfo` says where a built rank runs.

What the job did, as the coordinator hands it to the driver when it ends, is
:mod:`raytrec.elastic.run_record`.

Pure values; picklable, so Ray ships them as they are.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raytrec.observability.rec_metrics import MetricState

__all__ = ["RankInfo", "RankReport", "TrainedBatch"]

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
