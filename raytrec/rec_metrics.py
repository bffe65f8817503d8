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
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torchrec.metrics.auc import compute_auc
from torchrec.metrics.ne import compute_ne, get_ne_states

__all__ = ["InterpretedMetrics", "RankMetrics", "merge_metric_states"]

# TorchRec's default eta: clamps probabilities away from 0 and 1 in the log terms.
_ETA = 1e-12
_NE_KEYS = ("cross_entropy_sum", "weighted_num_samples", "pos_labels", "neg_labels")


@dataclasses.dataclass(frozen=True, kw_only=True)
class InterpretedMetrics:
    auc: float | None  # None when the rows held only one class
    ne: float | None
    rows: int


class RankMetrics:
    """One rank's metric states for the current interval."""

    def __init__(self, *, auc_window: int = 1 << 16) -> None:
        if auc_window < 1:
            raise ValueError(f"auc_window must be >= 1, got {auc_window!r}")
        self.auc_window = auc_window
        self.reset()

    def reset(self) -> None:
        self._ne = torch.zeros(len(_NE_KEYS), dtype=torch.float64)
        self._preds: list[torch.Tensor] = []
        self._labels: list[torch.Tensor] = []
        self._kept = 0
        self.rows = 0

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        preds = torch.sigmoid(logits.detach().float().reshape(1, -1)).cpu()
        labels = labels.detach().float().reshape(1, -1).cpu()
        states = get_ne_states(labels, preds, torch.ones_like(preds), _ETA)
        self._ne += torch.stack([states[k].double().sum() for k in _NE_KEYS])
        self.rows += preds.shape[1]
        self._preds.append(preds)
        self._labels.append(labels)
        self._kept += preds.shape[1]
        while self._kept - self._preds[0].shape[1] >= self.auc_window:  # keep the newest rows
            self._kept -= self._preds.pop(0).shape[1]
            self._labels.pop(0)

    def state(self) -> dict[str, Any]:
        """The interval's states as numpy (picklable, small) for the coordinator."""
        empty = np.zeros(0, np.float32)
        return {
            "ne": self._ne.numpy().copy(),
            "preds": torch.cat(self._preds, dim=1)[0].numpy() if self._preds else empty,
            "labels": torch.cat(self._labels, dim=1)[0].numpy() if self._labels else empty,
            "rows": self.rows,
        }


def merge_metric_states(states: Sequence[dict[str, Any]]) -> InterpretedMetrics:
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
    return InterpretedMetrics(auc=auc, ne=ne, rows=int(sum(s["rows"] for s in states)))
