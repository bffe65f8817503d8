"""The run's ledger: what a finished (or stopped) job did, as ``summary.json`` in its run
directory and a few closing lines on the console.

Pure code over the ledger, a JSON-ready dict that :meth:`raytrec.result.Result.ledger` builds:
steps (and, when the job took more or fewer than its data's steps, why: gangs missing or extra,
batches replayed), rows trained, the batch accounting (committed, replayed, lost), failures as a
user counts them with every failure event by kind (:mod:`raytrec.observability.incidents`),
generations, the replica check, the final and best metrics, and where every artifact is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from raytrec.observability.incidents import describe_failures

__all__ = ["SUMMARY_FILE", "failure_line", "ledger_lines", "steps_said", "write_ledger"]

SUMMARY_FILE = "summary.json"


def ledger_lines(summary: Mapping[str, Any], *, prefix: str = "[raytrec]") -> list[str]:
    """The closing lines: what was trained, the accounting, the check, where things are."""
    rows, batches, check = summary["rows"], summary["batches"], summary["replica_check"]
    failures = describe_failures(summary["failures"]["each"])
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
        f"{prefix} ledger: {steps_said(summary)}, {rows['trained']:,} rows trained, "
        f"{summary['generations']} generation{'s' if summary['generations'] != 1 else ''}; "
        f"failures: {failures}",
        f"{prefix} batches: {batches['committed']} committed ({batches['committed_distinct']} "
        f"distinct), {batches['replayed']} replayed, {batches['lost']} lost; replica check: "
        f"{checked}",
        f"{prefix} final {metrics}; model: {art['final_model']}; checkpoint: "
        f"{art['checkpoint']}; summary: {art['summary']}",
        *([f"{prefix} best checkpoint: {best}"] if best else []),
        *failed,
    ]


def _steps_why(account: Mapping[str, Any]) -> list[str]:
    """``a gang was missing for 300 steps``, ``8 batches replayed``, ... (what applies)."""
    why = []
    for key, most, one, many in (
        ("gang_steps_missing", "most_gangs_missing", "a gang was missing", "gangs were missing"),
        ("gang_steps_extra", "most_gangs_extra", "an extra gang trained", "extra gangs trained"),
    ):
        n = account.get(key) or 0
        if n and account.get(most, 1) <= 1:
            why.append(f"{one} for {n:,} steps")
        elif n:
            why.append(f"{many} for {n:,} gang-steps, up to {account[most]} at once")
    replayed = account.get("batches_replayed") or 0
    if replayed:
        why.append(f"{replayed:,} batch{'es' if replayed != 1 else ''} replayed")
    return why


def steps_said(summary: Mapping[str, Any]) -> str:
    """The ledger's steps. A finished job: ``300 steps``, or when it took more or fewer than
    its data's, ``300 steps of data in 377 steps (a gang was missing for 150 steps; 8 batches
    replayed)``, and ``(the data held 250 of the 300 steps asked for)`` when it ran out first.
    One that ended early: ``120 of 400 steps``, ``of`` the step its data was to end at, with
    why that moved when it did."""
    steps, asked = summary["steps"], summary["num_steps"]
    account = summary.get("step_account") or {}
    why = _steps_why(account)
    end = account.get("end_step") or asked
    if summary["ended"] == "finished":
        data_steps = account.get("data_steps", asked)
        notes = []
        if data_steps < asked and steps >= end:  # not an early stop: the data ran out
            notes.append(f"the data held {data_steps} of the {asked} steps asked for")
        if steps == data_steps:
            head = f"{steps} steps"
        else:
            head, notes = f"{data_steps} steps of data in {steps} steps", notes + why
        return head + (f" ({'; '.join(notes)})" if notes else "")
    moved = end != asked and why
    return f"{steps} of {end} steps" + (f" ({'; '.join(why)})" if moved else "")


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
