"""A SIGTERM or SIGINT stops ``python -m jobs.train`` cleanly, and leaves no process behind.

Ctrl-C in a terminal (SIGINT to the job's whole process group, Ray's processes included) while
the job trains: it stops at its next interval boundary, not in the middle of a step: it syncs,
saves a checkpoint (checkpoints are configured, though none is due) and the final model, writes
its metrics, prints the "stopped on request" line and exits with code 4. SIGTERM (``ray job
stop``, ``kill``) sent while the embedded cluster starts ends the job with code 4 too, nothing
trained. Either way every process the job started (Ray's included: raylet, GCS, dashboard and
runtime-env agents, workers) is gone once it has exited.

Both signals reach the same handler (``raytrec.driver.StopOnSignal``), which these tests check
with one signal each. A second signal while training stops ``fit`` at once:
``tests/cluster/test_kernel_interrupt.py`` holds that, and SIGINT from a notebook's *Interrupt the
kernel*, in ``fit`` itself; the exit code 130 that ``jobs.train`` then ends with is not run here.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.cluster


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(entry))
    return kids


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().replace("\0", " ").strip()
    except OSError:
        return ""


class Descendants:
    """Every process the job started (children of children too), sampled as it runs: a process
    re-parented to init once its parent died stays on the list."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.seen: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            kids, todo = _children(), [self.root]
            while todo:
                pid = todo.pop()
                for kid in kids.get(pid, []):
                    if kid not in self.seen:
                        self.seen[kid] = _cmdline(kid)
                    todo.append(kid)

    def ray_started(self) -> bool:
        return any("raylet" in c or "gcs_server" in c for c in self.seen.values())

    def alive(self) -> dict[int, str]:
        """Those still running (a zombie or a pid reused by another program does not count)."""
        left = {}
        for pid, cmd in self.seen.items():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z" and _cmdline(pid) == cmd:
                left[pid] = cmd
        return left

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def assert_none_left(tree: Descendants) -> None:
    """Every process the job started is gone (given a few seconds, as Ray's own exit takes)."""
    tree.stop()
    assert tree.seen, "the job started no process: the sampling saw nothing"
    deadline = time.monotonic() + 30
    while tree.alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    left = tree.alive()
    for pid in left:  # ours to end, so the next test starts clean
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the job still running after it exited: {left}"


def test_sigterm_while_the_cluster_starts_ends_the_job_and_all_its_processes(
    tmp_path: pathlib.Path,
) -> None:
    cmd = [
        sys.executable,
        "-m",
        "jobs.train",
        "--config",
        "examples/configs/local_cpu.yaml",
        "--steps",
        "400",
        "--storage-path",
        str(tmp_path),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    job = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    tree = Descendants(job.pid)
    try:
        deadline = time.monotonic() + 240
        while not tree.ray_started():
            assert job.poll() is None and time.monotonic() < deadline, "Ray never started"
            time.sleep(0.05)
        job.send_signal(signal.SIGTERM)
        text, _ = job.communicate(timeout=180)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 4, text
    assert "stopped on request (signal 15) before training started" in text, text
    assert "[raytrec] step" not in text
    assert_none_left(tree)


def test_ctrl_c_stops_at_the_next_boundary_with_a_checkpoint(tmp_path: pathlib.Path) -> None:
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
    # A session of its own, as a terminal gives a command: Ctrl-C signals its process group.
    job = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    tree = Descendants(job.pid)
    out: list[str] = []
    try:
        assert job.stdout is not None
        deadline = time.monotonic() + 240
        for line in job.stdout:
            out.append(line)
            if "[raytrec] step      8/400" in line:
                os.killpg(job.pid, signal.SIGINT)
                break
            assert time.monotonic() < deadline, "".join(out)
        rest, _ = job.communicate(timeout=180)
        out.append(rest)
    finally:
        if job.poll() is None:
            job.kill()
    text = "".join(out)
    assert job.returncode == 4, text
    assert "signal 2: stopping at the next interval boundary" in text
    (line,) = [x for x in text.splitlines() if "[raytrec] stopped on request at step" in x]
    step = int(line.split("at step ")[1].split()[0])
    assert 8 <= step < 400 and step % 4 == 0, line
    (run_dir,) = tmp_path.glob("local-cpu-*")
    assert f"checkpoint: {run_dir}/checkpoints/" in line, line
    assert (run_dir / "final_model").is_dir()
    assert list((run_dir / "checkpoints").iterdir())
    assert_none_left(tree)
