"""What a finished job returns: :class:`Result` (its metrics, final model, batch accounting and
the checkpoints it kept), or :class:`TrainingStopped` carrying it when training stopped early.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import ray
import ray.train

from raytrec.checkpoint.config import CheckpointConfig
from raytrec.config import TrainConfig
from raytrec.data.from_config import DataInfo
from raytrec.elastic.report import RunRecord, RunSummary, record_fields
from raytrec.errors import EarlyStopped

__all__ = ["KeptCheckpoint", "Result", "TrainingStopped", "best_checkpoints", "result_of"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Result(RunRecord):
    """What a finished job returns: what the job did (:class:`RunRecord`: ``history``,
    ``steps``, ``events``, the batch accounting, ...) with the run's config, directory, data and
    checkpoints."""

    config: TrainConfig
    run_dir: str
    data: DataInfo = dataclasses.field(default_factory=lambda: DataInfo(kind="custom"))
    checkpoint: ray.train.Checkpoint | None = None  # the last checkpoint saved (Ray Train's type)
    # The checkpoints kept, each with the metrics of its step: best first by
    # checkpoint.checkpoint_score_attribute when one is set, else newest first (Ray Train's
    # Result.best_checkpoints).
    best_checkpoints: list[KeptCheckpoint] = dataclasses.field(default_factory=list)
    stopped_early: str | None = None  # why early stopping ended the job (eval.early_stopping_*)

    @property
    def held_out_oracle_auc(self) -> float | None:
        """The oracle AUC of generated data's held-out split (data.generated_held_out_rows)."""
        return self.data.held_out_oracle_auc

    @property
    def oracle_auc(self) -> float | None:
        """The AUC of the data's own click probabilities (generated data only): the ceiling."""
        return self.data.oracle_auc

    def ledger(self, *, stopped: str | None = None, failed: str | None = None) -> dict[str, Any]:
        """The run's ledger (also in the run directory as ``summary.json``): steps, rows,
        committed, replayed and lost batches, failures by kind, generations, the replica
        check, final and best metrics, and where every artifact is
        (raytrec.observability.summary)."""
        from raytrec.observability.summary import ledger

        return ledger(self, stopped=stopped, failed=failed)

    def metrics_dataframe(self) -> Any:
        import pandas as pd

        return pd.DataFrame([m.to_dict() for m in self.history])


class TrainingStopped(RuntimeError):
    """Training stopped before ``num_steps`` (bad input, or a rank's data ran out).

    The job stopped between two steps: the model trained up to :attr:`result`'s ``steps`` was
    synced, checked and saved (``result.final_state_path``), and its metrics were written.
    ``cause`` is the rank's own exception (a :class:`~raytrec.data.arrow_kjt.BadInputError`
    names the file, column and row).
    """

    def __init__(self, cause: BaseException, result: Result) -> None:
        said = str(cause).rstrip()
        if said and not said.endswith((".", "!", "?")):
            said += "."
        saved = (
            f"the model trained so far is saved at {result.final_state_path}"
            if result.final_state_path is not None
            else "nothing was trained, so no model was saved"
        )
        super().__init__(
            f"{said}\nTraining stopped after step {result.steps} of "
            f"{result.config.num_steps}; {saved}."
        )
        self.cause = cause
        self.result = result


@dataclasses.dataclass(frozen=True)
class KeptCheckpoint:
    """A checkpoint the run kept: where it is, the step it was saved at and that step's
    metrics (the training interval's, and the held-out evaluation's when one ran). Unpacks as
    Ray Train's ``(checkpoint, metrics)`` pair: ``best, metrics = result.best_checkpoints[0]``."""

    checkpoint: ray.train.Checkpoint
    step: int
    metrics: dict[str, float]

    @property
    def path(self) -> str:
        return str(self.checkpoint.path)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.checkpoint, self.metrics))

    def __getitem__(self, index: int) -> Any:
        return (self.checkpoint, self.metrics)[index]

    def __len__(self) -> int:
        return 2


def best_checkpoints(run_dir: str, config: CheckpointConfig) -> list[KeptCheckpoint]:
    """The run's committed checkpoints with the metrics of their step: best first by
    ``config.checkpoint_score_attribute``, else newest first."""
    from raytrec.checkpoint.config import checkpoint_root, ranked
    from raytrec.checkpoint.layout import CheckpointStore, read_manifest

    store = CheckpointStore(checkpoint_root(run_dir))
    refs = {ref.name: ref for ref in store.committed()}
    saved = [store.scored(ref, config.checkpoint_score_attribute) for ref in refs.values()]
    if config.checkpoint_score_attribute is None:
        order = sorted(saved, key=lambda c: -c.step)
    else:
        order = ranked(saved, config.checkpoint_score_order)
    return [
        KeptCheckpoint(
            checkpoint=ray.train.Checkpoint(refs[c.name].uri),
            step=refs[c.name].step,
            metrics=dict(read_manifest(refs[c.name].uri).extra.get("metrics", {})),
        )
        for c in order
    ]


def result_of(config: TrainConfig, summary: RunSummary, run_dir: str, info: DataInfo) -> Result:
    """The :class:`Result` of the coordinator's :class:`RunSummary`: its :class:`RunRecord` as it
    is, with the driver's own fields."""
    return Result(
        **record_fields(summary),
        config=config,
        run_dir=run_dir,
        data=info,
        checkpoint=None if summary.checkpoint is None else ray.train.Checkpoint(summary.checkpoint),
        best_checkpoints=best_checkpoints(run_dir, config.checkpoint),
        stopped_early=str(summary.stopped_by)
        if isinstance(summary.stopped_by, EarlyStopped)
        else None,
    )
