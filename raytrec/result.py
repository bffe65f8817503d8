"""What a finished job returns: :class:`Result` (its metrics, final model, batch accounting and
the checkpoints it kept), or :class:`TrainingStopped` carrying it when training stopped early;
and the run's ledger built from it (:func:`ledger`: ``summary.json``, written and printed by
:mod:`raytrec.observability.summary`).
"""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Iterator, Sequence
from typing import Any

import ray
import ray.train

from raytrec.checkpoint.config import CheckpointConfig
from raytrec.config import TrainConfig
from raytrec.data.from_config import DataInfo
from raytrec.elastic.events import CoordinatorRestarted
from raytrec.elastic.run_record import RunRecord, RunSummary, record_fields
from raytrec.errors import EarlyStopped
from raytrec.observability.incidents import FAILURE_EVENT_KINDS, failure_report
from raytrec.observability.progress import EVENTS_FILE, METRICS_FILE, PLOT_FILE, TENSORBOARD_DIR
from raytrec.observability.summary import SUMMARY_FILE

__all__ = [
    "FAILURE_KINDS",
    "KeptCheckpoint",
    "Result",
    "TrainingStopped",
    "best_checkpoints",
    "ledger",
    "result_of",
]


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
        (:func:`ledger`)."""
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


_EVAL_KEYS = ("eval_auc", "eval_ne", "eval_log_loss", "eval_rows")
#: Event kinds that record a failure, counted by kind in ``failures.events``.
FAILURE_KINDS = FAILURE_EVENT_KINDS


def replica_check(result: Result) -> dict[str, Any]:
    """Whether every replica of every shard ended identical, recomputed from the ranks' final
    state digests."""
    topo = result.config.scaling.topology()
    digests = result.state_digests
    if not digests:
        return {"passed": None, "why": "no final state digests (nothing was trained)"}
    # Every shard position must show one digest, held by every live gang: gang_size distinct
    # shard digests, each on the same number of ranks, and one dense state everywhere.
    shards = collections.Counter(d["shards"] for d in digests.values())
    dense = {d["dense"] for d in digests.values()}
    copies = sorted(set(shards.values()))
    passed = len(dense) == 1 and len(shards) == topo.gang_size and len(copies) == 1
    return {
        "passed": passed,
        "ranks": len(digests),
        "distinct_shards": len(shards),
        "copies_per_shard": copies[0] if len(copies) == 1 else copies,
        "distinct_dense_states": len(dense),
    }


def step_account(result: Result) -> dict[str, Any]:
    """Why the job took more (or fewer) steps than its data's: ``data_steps`` (the committed
    batches over the configured ranks: the steps the data took at full strength; ``num_steps``
    for a source that names no batches), ``end_step`` (where the data ended as last known),
    ``gang_steps_missing`` and ``gang_steps_extra`` (steps of each gang fewer or more than the
    configured number, from the metrics rows: a step with a gang missing trains that gang's
    batches fewer), the most gangs missing or extra at once, and ``batches_replayed``."""
    full = result.config.scaling.num_gangs
    ranks = result.config.scaling.world_size
    missing = sum(max(0, full - m.gangs) * m.steps for m in result.history)
    extra = sum(max(0, m.gangs - full) * m.steps for m in result.history)
    ends = [m.end_step for m in result.history if m.end_step is not None]
    committed = result.committed_count
    data_steps = committed // ranks if committed % ranks == 0 else round(committed / ranks, 2)
    return {
        "data_steps": data_steps if committed else result.config.num_steps,
        "end_step": ends[-1] if ends else result.config.num_steps,
        "gang_steps_missing": missing,
        "most_gangs_missing": max((full - m.gangs for m in result.history), default=0),
        "gang_steps_extra": extra,
        "most_gangs_extra": max((m.gangs - full for m in result.history), default=0),
        "batches_replayed": sum(b - a for a, b in result.replayed_batches),
    }


def _best(history: Sequence[Any], key: str, *, higher: bool) -> dict[str, Any] | None:
    rows = [m for m in history if getattr(m, key, None) is not None]
    if not rows:
        return None
    pick = (max if higher else min)(rows, key=lambda m: getattr(m, key))
    return {"value": getattr(pick, key), "step": pick.step}


def ledger(
    result: Result, *, stopped: str | None = None, failed: str | None = None
) -> dict[str, Any]:
    """The ledger of ``result`` as a JSON-ready dict; ``stopped``: why the job ended early
    with its model saved; ``failed``: why it ended without one."""
    history = result.history
    kinds = collections.Counter(result.events.kinds())
    account = step_account(result)
    distinct = sum(b - a for a, b in result.committed_batches)
    replayed = sum(b - a for a, b in result.replayed_batches)
    last = history[-1] if history else None
    run_dir = result.run_dir
    artifacts = {
        "run_dir": run_dir,
        "summary": os.path.join(run_dir, SUMMARY_FILE),
        "metrics": os.path.join(run_dir, METRICS_FILE),
        "events": os.path.join(run_dir, EVENTS_FILE),
        "plot": os.path.join(run_dir, PLOT_FILE),
        "tensorboard": os.path.join(run_dir, TENSORBOARD_DIR),
        "final_model": result.final_state_path,
        "checkpoint": None if result.checkpoint is None else result.checkpoint.path,
        # The best kept checkpoint by checkpoint.checkpoint_score_attribute (None: not ranked).
        "best_checkpoint": result.best_checkpoints[0].path
        if result.best_checkpoints and result.config.checkpoint.checkpoint_score_attribute
        else None,
    }
    stepped = sum(m.rows for m in history)
    return {
        "name": result.config.name,
        "ended": "failed" if failed else "stopped" if stopped else "finished",
        "steps": result.steps,
        "num_steps": result.config.num_steps,
        "step_account": account,
        "stopped": stopped,
        "failed": failed,
        "stopped_early": result.stopped_early,
        # The checkpoint a failed or stopped job resumes from (fit(resume_from_checkpoint=...)).
        "resume_from": artifacts["checkpoint"],
        "wall_s": round(result.wall_s, 3),
        "rows": {
            # Rows in the model: those of the committed batches, counted with multiplicity
            # (for a source that names no batches, the rows the ranks stepped through).
            "trained": stepped if result.committed_rows is None else result.committed_rows,
            # Rows the ranks stepped through in reported intervals, replays included.
            "stepped": stepped,
            "per_epoch": result.data.rows_per_epoch,
            "epochs": result.config.data.epochs if result.data.kind != "synthetic" else None,
            # A growing source (data.growing): each file's rows in committed batches.
            "per_file": _rows_per_file(result),
        },
        "batches": {
            "committed": result.committed_count,
            "committed_distinct": distinct,
            "replayed": replayed,
            "lost": result.lost_batches,
            # Committed before a coordinator's loss and after the checkpoint the next one
            # resumed from: trained and committed again, counted once in "committed".
            "rolled_back": sum(
                e.rolled_back_batches for e in result.events.of(CoordinatorRestarted)
            ),
        },
        "coordinator_restarts": kinds["coordinator_restarted"],
        # As a user counts them (count, each), with every failure event by kind (events) and
        # the ranks raytrec ended because their gang lost a rank (ranks_released).
        "failures": failure_report(result.events),
        "gangs_dropped": kinds["gang_dropped"],
        "gangs_joined": kinds["gang_joined"],
        "gangs_drained": kinds["gang_drained"],
        "generations": result.generation + 1,
        "replica_check": replica_check(result),
        "final": None
        if last is None
        else {
            "step": last.step,
            "loss": last.loss,
            "auc": last.auc,
            "ne": last.ne,
            **{k: getattr(last, k) for k in _EVAL_KEYS if getattr(last, k) is not None},
        },
        "best": {
            "loss": _best(history, "loss", higher=False),
            "auc": _best(history, "auc", higher=True),
            "ne": _best(history, "ne", higher=False),
            "eval_auc": _best(history, "eval_auc", higher=True),
            "eval_ne": _best(history, "eval_ne", higher=False),
            "eval_log_loss": _best(history, "eval_log_loss", higher=False),
        },
        "artifacts": artifacts,
    }


def _rows_per_file(result: Result) -> dict[str, int] | None:
    table = result.reshared_streams
    if table is None or "files" not in table or result.config.num_steps is None:
        return None
    from raytrec.data.committed import rows_per_file

    return rows_per_file(
        table,
        result.committed_batches,
        batch_size=result.config.data.batch_size,
        limit=result.config.num_steps,
    )
