"""The chaos harness's short run: a job submitted to a multi-node ``ray start`` cluster on
127.0.0.1 loses a rank (a new gang joins on the freed CPUs) and then a whole node (its raylet
killed), and still trains every batch exactly once. The harness stops the job once the node
loss is booked and the survivors trained on (``--short``).

Runs ``python -m benchmarks.chaos --short`` as a user would and reads what it measured from the
job's own outputs (events, metrics rows, the ledger).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.cluster
@pytest.mark.timeout(420)
def test_job_survives_a_rank_kill_a_join_and_a_node_loss(tmp_path: pathlib.Path) -> None:
    out_file = tmp_path / "chaos.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # A collective timeout well above the death notices of a loaded machine (a survivor's
    # gang world that times out first makes a total loss: docs/fault_tolerance.md, "Limits").
    # What this test checks is every batch once through a kill, a join and a node loss.
    command = [sys.executable, "-m", "benchmarks.chaos", "--short", "--json", str(out_file)]
    done = subprocess.run(
        [*command, "--collective-timeout-s", "60"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert out_file.exists(), done.stdout + done.stderr
    data = json.loads(out_file.read_text())
    out, report = data["out"], data["report"]
    assert out["state"] == "STOPPED", out["status"] + out["logs_tail"]
    assert done.returncode == 0, done.stdout + done.stderr

    assert [f["kind"] for f in out["faults"]] == ["rank", "node"]
    kinds = [e["kind"] for e in out["events"]]
    assert kinds.count("gang_joined") >= 1, kinds
    # The lost node is named by Ray's node id: the one whose raylet the harness killed.
    (node_fault,) = [f for f in out["faults"] if f["kind"] == "node"]
    (died,) = [e for e in out["events"] if e["kind"] == "node_died"]
    assert node_fault["node_id"] and died["node_id"] == node_fault["node_id"], died
    assert died["address"].startswith("127.0.0.1"), died
    # Every fault was detected, and the survivors went on.
    losses = [m for m in report["marks"] if m["type"] == "loss"]
    assert len(losses) == 2 and all(m["detected_s"] >= 0 for m in losses), losses
    assert all(m.get("named", True) for m in losses), losses
    # No batch lost or trained twice, and every replica ended identical.
    assert report["lost"] == 0 and report["doubled"] == 0, out["summary"]["batches"]
    assert report["replica_check"] is True, out["summary"]["replica_check"]
    # Stopped on request at an interval boundary, past the node loss: the ledger and the
    # checkpoint to resume from are written.
    summary = out["summary"]
    assert summary["ended"] == "stopped" and summary["steps"] >= died["step"], summary
    assert summary["resume_from"], summary
