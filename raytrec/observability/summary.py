"""The run's ledger: what a finished (or stopped) job did, as ``summary.json`` in its run
directory and a few closing lines on the console.

Pure code over a :class:`~raytrec.result.Result`: steps, rows trained, the batch accounting
(committed, replayed, lost), failures by kind, generations, the replica check (recomputed here
from the ranks' final state digests), the final and best metrics, and where every artifact is.
"""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from raytrec.elastic.events import CoordinatorRestarted
from raytrec.observability.progress import EVENTS_FILE, METRICS_FILE, PLOT_FILE, TENSORBOARD_DIR

if TYPE_CHECKING:
    from raytrec.result import Result

__all__ = [
    "FAILURE_KINDS",
    "SUMMARY_FILE",
    "failure_line",
    "ledger",
    "ledger_lines",
    "write_ledger",
]

SUMMARY_FILE = "summary.json"
_EVAL_KEYS = ("eval_auc", "eval_ne", "eval_log_loss", "eval_rows")
#: Event kinds counted as failures (raytrec.elastic.events).
FAILURE_KINDS = (
    "rank_died",
    "node_died",
    "hang_detected",
    "heal_failed",
    "total_loss",
    "coordinator_lost",
)


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
        "failures": {k: kinds[k] for k in FAILURE_KINDS if kinds[k]},
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


def ledger_lines(summary: Mapping[str, Any], *, prefix: str = "[raytrec]") -> list[str]:
    """The closing lines: what was trained, the accounting, the check, where things are."""
    rows, batches, check = summary["rows"], summary["batches"], summary["replica_check"]
    failures = ", ".join(f"{n} {k}" for k, n in summary["failures"].items()) or "none"
    if check["passed"] is None:
        checked = check["why"]
    elif check["passed"]:
        checked = (
            f"passed ({check['distinct_shards']} shards x {check['copies_per_shard']} identical "
            f"copies, one dense state on {check['ranks']} ranks)"
        )
    else:
        checked = f"FAILED {check}"
    final = summary["final"]
    metrics = (
        "no interval finished"
        if final is None
        else ", ".join(
            f"{k.replace('_', ' ')} {final[k]:.4f}"
            for k in ("loss", "auc", "ne", "eval_auc", "eval_log_loss")
            if final.get(k) is not None
        )
    )
    art = summary["artifacts"]
    early = [f"{prefix} {summary['stopped_early']}"] if summary.get("stopped_early") else []
    best = summary["artifacts"].get("best_checkpoint")
    failed = [f"{prefix} {failure_line(summary)}"] if summary.get("failed") else []
    return [
        *early,
        f"{prefix} ledger: {summary['steps']} of {summary['num_steps']} steps, "
        f"{rows['trained']:,} rows trained, {summary['generations']} generation(s); "
        f"failures: {failures}",
        f"{prefix} batches: {batches['committed']} committed ({batches['committed_distinct']} "
        f"distinct), {batches['replayed']} replayed, {batches['lost']} lost; replica check: "
        f"{checked}",
        f"{prefix} final {metrics}; model: {art['final_model']}; checkpoint: "
        f"{art['checkpoint']}; summary: {art['summary']}",
        *([f"{prefix} best checkpoint: {best}"] if best else []),
        *failed,
    ]


def failure_line(summary: Mapping[str, Any]) -> str:
    """One line for a failed job: why, where it was, and the checkpoint to resume from."""
    resume = summary.get("resume_from") or "none (no checkpoint was saved: the job starts over)"
    return (
        f"failed at step {summary['steps']} of {summary['num_steps']}: {summary['failed']}; "
        f"resume from checkpoint: {resume}; ledger: {summary['artifacts']['summary']}"
    )


def write_ledger(summary: Mapping[str, Any]) -> str:
    """Writes ``summary.json`` into the run directory; returns its path."""
    path = str(summary["artifacts"]["summary"])
    with open(path, "w") as f:
        json.dump(summary, f, indent=1, default=str)
    return path
