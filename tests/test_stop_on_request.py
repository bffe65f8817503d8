"""A SIGTERM or SIGINT stops the job at its next interval boundary, not in the middle of a step.

``python -m jobs.train`` on its embedded local cluster gets SIGTERM while it trains: it syncs,
saves a checkpoint (checkpoints are configured, though none is due) and the final model, writes
its metrics, prints the "stopped on request" line and exits with code 4. A second signal would
stop it at once (exit code 130).
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.cluster


def test_sigterm_stops_at_the_next_boundary_with_a_checkpoint(tmp_path: pathlib.Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "jobs.train",
        "--config",
        "examples/configs/local_cpu.yaml",
        "--steps",
        "400",
        "--log-every",
        "4",
        "--storage-path",
        str(tmp_path),
        "--set",
        "checkpoint.every_n_steps=200",
        "--set",
        "testing.faults=[{kind: slow_rank, step: 1, rank: 0, stall_s: 0.2, steps: 400}]",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    job = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    out: list[str] = []
    try:
        assert job.stdout is not None
        deadline = time.monotonic() + 240
        for line in job.stdout:
            out.append(line)
            if "[raytrec] step      8/400" in line:
                job.send_signal(signal.SIGTERM)
                break
            assert time.monotonic() < deadline, "".join(out)
        rest, _ = job.communicate(timeout=180)
        out.append(rest)
    finally:
        if job.poll() is None:
            job.kill()
    text = "".join(out)
    assert job.returncode == 4, text
    assert "stopping at the next interval boundary" in text
    (line,) = [x for x in text.splitlines() if "[raytrec] stopped on request at step" in x]
    step = int(line.split("at step ")[1].split()[0])
    assert 8 <= step < 400 and step % 4 == 0, line
    (run_dir,) = tmp_path.glob("local-cpu-*")
    assert f"checkpoint: {run_dir}/checkpoints/" in line, line
    assert (run_dir / "final_model").is_dir()
    assert list((run_dir / "checkpoints").iterdir())
