"""The run's ledger: what a finished (or stopped) job did, as ``summary.json`` in its run
directory and a few closing lines on the console.

Pure code over the ledger, a JSON-ready dict that :meth:`raytrec.result.Result.ledger` builds:
steps, rows trained, the batch accounting (committed, replayed, lost), failures by kind,
generations, the replica check, the final and best metrics, and where every artifact is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["SUMMARY_FILE", "failure_line", "ledger_lines", "write_ledger"]

SUMMARY_FILE = "summary.json"


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
