"""AUC and normalized entropy of the whole job, computed with TorchRec's metric functions.

TorchRec's ``RecMetricModule`` reduces metric state over one ``torch.distributed`` group; here
the default group of a rank is its gang, while a job-wide metric needs every gang. So each rank
keeps the raw states TorchRec's AUC and NE computations keep (for NE the four sums of
``torchrec.metrics.ne.get_ne_states``; for AUC the predictions and labels, up to a window), ships
them with its interval report, and the coordinator merges the states of all ranks and computes
the metrics with ``torchrec.metrics.auc.compute_auc`` and ``torchrec.metrics.ne.compute_ne``.
Merging states, not averaging per-rank metrics, gives exactly the metric over the union of rows.

The predictions are the model's on each batch *before* it trains on it (progressive
validation): on the first pass over the data they are out-of-sample.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TypedDict

import numpy as np
import torch
from torchrec.metrics.auc import compute_auc
from torchrec.metrics.ne import compute_logloss, compute_ne, get_ne_states

__all__ = ["InterpretedMetrics", "MetricState", "RankMetrics", "merge_metric_states"]

# TorchRec's default eta: clamps probabilities away from 0 and 1 in the log terms.
_ETA = 1e-12
_NE_KEYS = ("cross_entropy_sum", "weighted_num_samples", "pos_labels", "neg_labels")


@dataclasses.dataclass(frozen=True, kw_only=True)
class InterpretedMetrics:
    auc: float | None  # None when the rows held only one class
    ne: float | None
    rows: int
    # Mean binary cross-entropy in nats, as the training loss (TorchRec's logloss is in bits).
    log_loss: float | None = None


class MetricState(TypedDict):
    """A rank's metric states over the rows it scored (numpy: picklable, small): the NE sums
    (float64, in ``_NE_KEYS`` order), the rows' predictions and labels, and their count."""

    ne: np.ndarray
    preds: np.ndarray
    labels: np.ndarray
    rows: int


class RankMetrics:
    """One rank's metric states for the current interval.

    :meth:`update` runs every step, so it only keeps references to the step's logits and labels
    (left on their device: no copy or device sync per step); the sigmoid, the NE sums and the
    copy to the host happen once per interval, over all its rows at once, in :meth:`state`.
    Rows that fall out of the AUC window are folded into the NE sums on their device, a few
    windows' worth at a time (:meth:`_fold`).
    """

    def __init__(self, *, auc_window: int = 1 << 16, exact_preds: bool = False) -> None:
        if auc_window < 1:
            raise ValueError(f"auc_window must be >= 1, got {auc_window!r}")
        self.auc_window = auc_window
        # Predictions travel as float32 (half the bytes), which may tie rows whose float64
        # predictions differ; exact_preds keeps float64, for an AUC that matches a rank AUC.
        self.exact_preds = exact_preds
        self.reset()

    def reset(self) -> None:
        self._ne = torch.zeros(len(_NE_KEYS), dtype=torch.float64)
        self._logits: list[torch.Tensor] = []
        self._labels: list[torch.Tensor] = []
        self._kept = 0
        self.rows = 0

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        logits, labels = logits.detach().reshape(-1), labels.detach().reshape(-1)
        self.rows += logits.numel()
        self._logits.append(logits)
        self._labels.append(labels)
        self._kept += logits.numel()
        if self._kept >= _FOLD_AT * self.auc_window:
            self._fold()

    def _fold(self) -> None:
        """Folds the rows beyond the AUC window (the oldest) into the NE sums, all at once and
        where the rows are (a GPU's sums stay on it): no device sync, and a step pays for it only
        once in every few windows."""
        old_logits, old_labels = [], []
        while self._kept - self._logits[0].numel() >= self.auc_window:  # keep the newest rows
            self._kept -= self._logits[0].numel()
            old_logits.append(self._logits.pop(0))
            old_labels.append(self._labels.pop(0))
        if old_logits:
            sums = _ne_sums(torch.cat(old_logits), torch.cat(old_labels))[0]
            self._ne = self._ne.to(sums.device) + sums

    def state(self) -> MetricState:
        """The interval's states as numpy (picklable, small) for the coordinator."""
        if self._logits:
            self._fold()
        if not self._logits:
            empty = np.zeros(0, np.float32)
            return {"ne": self._ne.numpy().copy(), "preds": empty, "labels": empty, "rows": 0}
        logits, labels = torch.cat(self._logits), torch.cat(self._labels)
        sums, preds = _ne_sums(logits, labels)
        return {
            "ne": (self._ne.to(sums.device) + sums).cpu().numpy(),
            "preds": (preds[0] if self.exact_preds else preds[0].float()).cpu().numpy(),
            "labels": labels.float().cpu().numpy(),
            "rows": self.rows,
        }


#: Rows kept, in AUC windows, before the oldest beyond the window are folded into the NE sums.
_FOLD_AT = 4


def _ne_sums(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' NE sums (float64, in ``_NE_KEYS`` order) and their predictions ``[1, N]``, on
    the rows' device."""
    preds = torch.sigmoid(logits.double()).reshape(1, -1)
    labels64 = labels.double().reshape(1, -1)
    states = get_ne_states(labels64, preds, torch.ones_like(preds), _ETA)
    return torch.cat([states[k] for k in _NE_KEYS]), preds


def merge_metric_states(states: Sequence[MetricState]) -> InterpretedMetrics:
    """AUC and NE over the union of the ranks' rows (AUC over their windows)."""
    states = [s for s in states if s["rows"]]
    if not states:
        return InterpretedMetrics(auc=None, ne=None, rows=0)
    ne_sums = torch.from_numpy(np.sum([s["ne"] for s in states], axis=0))
    ce, n, pos, neg = (ne_sums[i : i + 1] for i in range(len(_NE_KEYS)))
    preds = torch.from_numpy(np.concatenate([s["preds"] for s in states])).reshape(1, -1)
    labels = torch.from_numpy(np.concatenate([s["labels"] for s in states])).reshape(1, -1)
    both = bool(pos.item() > 0 and neg.item() > 0)
    ne = float(compute_ne(ce, n, pos, neg, _ETA)[0]) if both else None
    has_both_in_window = bool(0 < labels.sum().item() < labels.numel())
    auc = (
        float(compute_auc(1, [preds], [labels], [torch.ones_like(preds)])[0])
        if has_both_in_window
        else None
    )
    log_loss = float(compute_logloss(ce, pos, neg, _ETA)[0]) * math.log(2) if n.item() else None
    rows = int(sum(s["rows"] for s in states))
    return InterpretedMetrics(auc=auc, ne=ne, rows=rows, log_loss=log_loss)
