"""``fit`` in a real Jupyter kernel, stopped with the notebook's *Interrupt the kernel*.

The test starts an IPython kernel (``jupyter_client`` + ``ipykernel``, as a notebook server does)
and starts one embedded Ray cluster in it. ``KernelManager.interrupt_kernel`` sends SIGINT to the
kernel's process group, which holds Ray's processes too, exactly as a notebook's stop button:

- one interrupt while ``fit`` trains: it stops at its next interval boundary and raises
  :class:`~raytrec.api.TrainingStopped`, whose result holds the final model and a checkpoint;
- two interrupts: ``fit`` stops at once (``KeyboardInterrupt``), and the coordinator's and the
  ranks' processes are gone;
- ``fit`` then trains to the end in the same kernel (the cluster survived the interrupts), and
  the model is exported, loaded and scored there;
- once the kernel is shut down, no process it started is left.

Each interrupt's time to the stop is printed (``pytest -s``).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import queue
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.cluster

SETUP = """
import json, os, time
import ray
import raytrec
from raytrec.api import TrainingStopped
from raytrec.cluster import connect
from raytrec.config import ModelConfig, ScalingConfig, SyncConfig, TestingConfig, TrainConfig
from raytrec.config import DataConfig, criteo_tables
from raytrec.checkpoint.config import CheckpointConfig
from raytrec.elastic.faults import FaultKind, FaultSpec

connect(num_cpus=1)
config = TrainConfig(
    model=ModelConfig(
        tables=criteo_tables(num_features=4, num_embeddings=200, embedding_dim=8),
        dense_arch_layers=(16, 8),
        over_arch_layers=(16, 1),
    ),
    scaling=ScalingConfig(num_workers=1, gang_size=1),  # one rank: the cheapest job
    sync=SyncConfig(sync_every=4),
    data=DataConfig(batch_size=32),
    # A boundary is due every 4 steps; none of the 400 is reached: the interrupts end the job.
    checkpoint=CheckpointConfig(every_n_steps=200),
    testing=TestingConfig(
        faults=(FaultSpec(kind=FaultKind.SLOW_RANK, step=1, rank=0, stall_s=0.2, steps=400),)
    ),
    num_steps=400,
    log_every=4,
    storage_path="runs",
)

def fit_pids():
    # The actors still alive (the job's coordinator and ranks while they live), given a few
    # seconds: ray.kill returns before the actor is gone.
    from ray._private.state import actors
    deadline = time.monotonic() + 10
    while True:
        alive = sorted(a["Pid"] for a in actors(actor_state_name="ALIVE").values())
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)

print("READY", ray.get_runtime_context().get_node_id())
"""

ONE_INTERRUPT = """
try:
    raytrec.fit(config.replace(name="once"))
except TrainingStopped as e:
    r = e.result
    print("STOPPED " + json.dumps({
        "cause": type(e.cause).__name__,
        "said": str(e.cause),
        "steps": r.steps,
        "final_state_path": r.final_state_path,
        "checkpoint": None if r.checkpoint is None else r.checkpoint.path,
        "history": [m.step for m in r.history],
        "left": fit_pids(),
    }))
"""

TWO_INTERRUPTS = """
try:
    raytrec.fit(config.replace(name="twice"))
except KeyboardInterrupt as e:
    print("KILLED " + json.dumps({"said": str(e), "left": fit_pids()}))
"""

TO_THE_END = """
from raytrec.data.generate import write_synthetic_parquet
from raytrec.serving.export import make_batch
import pyarrow.parquet as pq

result = raytrec.fit(config.replace(name="end", num_steps=8, testing=TestingConfig()))
info = raytrec.export(result, "exported", program=False)
model = raytrec.load_model("exported")
write_synthetic_parquet("rows", rows=64, files=1, row_groups_per_file=1, num_embeddings=200)
batch, ids = make_batch(pq.read_table("rows"), info.spec)
p = raytrec.score(model, batch)
print("DONE " + json.dumps({
    "steps": result.steps,
    "exported_from": info.source_kind,
    "scores": p.tolist(),
    "ids": ids.tolist(),
    "left": fit_pids(),
}))
"""


class Kernel:
    """A kernel running in ``cwd``, and the output of the cell it runs."""

    def __init__(self, cwd: pathlib.Path) -> None:
        from jupyter_client.manager import KernelManager

        path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(cwd=str(cwd), env={**os.environ, "PYTHONPATH": path})
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)
        self.pid = self.km.provisioner.process.pid  # type: ignore[union-attr]

    def run(
        self,
        code: str,
        *,
        timeout: float,
        on_line: Callable[[str], None] | None = None,
    ) -> str:
        """Runs ``code`` and returns what it printed (stdout and stderr, and any traceback);
        ``on_line`` sees each line as it comes."""
        msg_id = self.kc.execute(code)
        text: list[str] = []
        deadline = time.monotonic() + timeout
        pending = ""
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"the cell ran past {timeout} s:\n{''.join(text)}"
            try:
                msg = self.kc.get_iopub_msg(timeout=min(left, 5))
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                text.append(content["text"])
                pending += content["text"]
                *lines, pending = pending.split("\n")
                for line in lines:
                    if on_line is not None:
                        on_line(line)
            elif kind == "error":
                text.append("\n".join(content["traceback"]))
            elif kind == "status" and content["execution_state"] == "idle":
                return "".join(text)

    def processes(self) -> dict[int, float]:
        """The kernel and every process under it, with their start times."""
        root = psutil.Process(self.pid)
        return {p.pid: p.create_time() for p in [root, *root.children(recursive=True)]}

    def shutdown(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)


def running(pids: dict[int, float]) -> dict[int, str]:
    """Those of ``pids`` (pid: start time) still running: a zombie or a reused pid is not."""
    left = {}
    for pid, started in pids.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                left[pid] = " ".join(p.cmdline())[:200]
        except psutil.Error:
            continue
    return left


def gone(pids: dict[int, float], *, within_s: float) -> dict[int, str]:
    deadline = time.monotonic() + within_s
    while running(pids) and time.monotonic() < deadline:
        time.sleep(0.25)
    return running(pids)


def reported(text: str, tag: str) -> dict[str, Any]:
    lines = [line for line in text.splitlines() if line.startswith(tag + " ")]
    assert len(lines) == 1, text
    return dict(json.loads(lines[0][len(tag) + 1 :]))


class Interrupter:
    """Interrupts the kernel once the job has printed the interval line of step ``at_step``,
    ``times`` times ``gap_s`` apart; ``stopped()`` is the time from the first interrupt."""

    def __init__(self, kernel: Kernel, *, at_step: int, times: int, gap_s: float = 0.5) -> None:
        self.kernel, self.at_step, self.times, self.gap_s = kernel, at_step, times, gap_s
        self.sent_at: float | None = None
        self.step = 0
        self.job_processes: dict[int, float] = {}

    def __call__(self, line: str) -> None:
        if self.sent_at is not None or not line.startswith("[raytrec] step"):
            return
        if int(line.split()[2].split("/")[0]) < self.at_step:
            return
        self.step = int(line.split()[2].split("/")[0])
        # The coordinator's and the ranks' processes ("ray::Coordinator", "ray::RankWorker").
        self.job_processes = {
            pid: started
            for pid, started in self.kernel.processes().items()
            if any(n in _cmdline(pid) for n in ("ray::Coordinator", "ray::RankWorker"))
        }
        self.sent_at = time.monotonic()
        for i in range(self.times):
            if i:
                time.sleep(self.gap_s)
            self.kernel.km.interrupt_kernel()

    def stopped(self) -> float:
        assert self.sent_at is not None, "the job never reached the step to interrupt at"
        return time.monotonic() - self.sent_at


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


@pytest.fixture
def kernel(tmp_path: pathlib.Path) -> Iterator[Kernel]:
    k = Kernel(tmp_path)
    try:
        yield k
    finally:
        if k.km.is_alive():  # the test failed: its kernel and Ray's processes are ended
            started = k.processes()
            k.km.shutdown_kernel(now=True)
            for pid in gone(started, within_s=10):
                with contextlib.suppress(psutil.Error):
                    psutil.Process(pid).kill()


def test_interrupting_the_kernel_stops_fit_and_leaves_nothing_behind(
    kernel: Kernel, tmp_path: pathlib.Path
) -> None:
    setup = kernel.run(SETUP, timeout=180)
    assert "READY" in setup, setup

    # One interrupt: the job stops at its next boundary, with its model and a checkpoint.
    once = Interrupter(kernel, at_step=4, times=1)
    text = kernel.run(ONE_INTERRUPT, timeout=300, on_line=once)
    took = once.stopped()
    stop = reported(text, "STOPPED")
    print(
        f"\none interrupt after step {once.step}: fit raised TrainingStopped at step "
        f"{stop['steps']}, {took:.1f} s later",
        file=sys.stderr,
    )
    assert "signal 2: stopping at the next interval boundary" in text, text
    assert stop["cause"] == "StopRequested", stop
    assert once.step < stop["steps"] < 400 and stop["steps"] % 4 == 0, stop
    assert stop["history"][-1] == stop["steps"], stop
    assert stop["final_state_path"] and os.path.isdir(stop["final_state_path"]), stop
    assert stop["checkpoint"] and os.path.isdir(stop["checkpoint"]), stop
    assert pathlib.Path(stop["checkpoint"]).name == f"checkpoint_{stop['steps']:010d}", stop
    assert once.job_processes, "the job's processes were not seen while it trained"
    assert not stop["left"], stop
    assert not gone(once.job_processes, within_s=30)

    # Two interrupts: at once, and the job's processes are gone.
    twice = Interrupter(kernel, at_step=4, times=2)
    text = kernel.run(TWO_INTERRUPTS, timeout=300, on_line=twice)
    took = twice.stopped()
    print(
        f"two interrupts {twice.gap_s} s apart after step {twice.step}: fit raised "
        f"KeyboardInterrupt {took:.1f} s after the first",
        file=sys.stderr,
    )
    killed = reported(text, "KILLED")
    assert "signal 2 again: stopping at once" in killed["said"], killed
    assert twice.job_processes, "the job's processes were not seen while it trained"
    assert not killed["left"], killed
    assert not gone(twice.job_processes, within_s=30)

    # The same kernel, the same cluster: a job trains to the end, and its model scores rows.
    text = kernel.run(TO_THE_END, timeout=300)
    done = reported(text, "DONE")
    assert done["steps"] == 8 and done["exported_from"] == "final_model", done
    assert done["ids"] == list(range(64))
    scores = done["scores"]
    assert len(scores) == 64 and all(0 < p < 1 for p in scores), scores
    assert len(set(scores)) > 1, scores
    assert not done["left"], done

    # Shut down: nothing the kernel started (Ray's processes included) is left.
    started = kernel.processes()
    assert any("raylet" in _cmdline(pid) for pid in started), "Ray was not under the kernel"
    kernel.shutdown()
    left = gone(started, within_s=30)
    for pid in left:  # ours to end, so the next test starts clean
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()
    assert not left, f"processes of the kernel still running after its shutdown: {left}"
