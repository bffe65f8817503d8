"""Chaos on a multi-node local cluster: what losing nodes, ranks and the coordinator costs a
submitted job.

    .venv/bin/python -m benchmarks.chaos [--short] [--runs N] [--coordinator-kills] [--write PAGE]

What it kills, when, and what each column counts: docs/fault_tolerance.md, "Chaos". Kill times
are put on the coordinator's clock from when each row was first seen: the delays are upper
bounds. The reading of a run (:mod:`benchmarks.chaos_report`) is pure.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import glob
import json
import os
import pathlib
import random
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

import raytrec.cluster.local as lc
from benchmarks.chaos_report import analyse, describe, row_check, table
from benchmarks.common import ROOT, drop_options, parse, parser, publish

__all__ = ["analyse", "main", "table"]

HEADING = "## Chaos: node and rank losses on a local cluster"
#: The faults in order (docs/fault_tolerance.md, "Chaos"): the full run; --short (the cluster
#: test's: a rank, then the node, with no replacement node); --coordinator-kills. "node" starts a
#: replacement node once the node is gone (not with --short); "coord" SIGKILLs the coordinator's
#: process at a random moment, "coord-recovery" right after a rank's loss is booked (during the
#: recovery), "coord-save" while a checkpoint is being written.
SCHEDULES = {
    "full": ("rank", "node", "rank", "node", "rank"),
    "short": ("rank", "node"),
    "coordinator": ("coord", "coord-recovery", "coord", "coord-save", "coord"),
}
#: The head's CPUs (never killed): with Parquet one, for Ray Data's read tasks (too few for a gang).
HEAD_CPUS = {"synthetic": 0, "parquet": 1}
#: examples/configs/local_cpu.yaml's batch size, and the passes over the Parquet rows.
BATCH_SIZE, EPOCHS = 128, 3
Json = dict[str, Any]  # a metrics row, an event, a fault, a mark or a report, as JSON has it
NODES, GANG_SIZE = ("n0", "n1"), 2  # a worker node per gang, of a CPU per rank
LOG_EVERY = 2
FIRST_STEP = {False: 200, True: 60}  # no fault before this step (by --short): a no-fault pace
MAX_DELAY_S = 1.0  # a fault lands a random moment up to this long after it is due


@dataclasses.dataclass
class Fault:
    kind: str  # a kind of SCHEDULES
    step: int  # the last step seen before the kill
    kill_mono: float  # time.monotonic() at the kill (the same clock on every process here)
    node: str  # the worker node's name ("head" for the coordinator)
    node_id: str | None  # Ray's node id of the node (of the rank's node for a rank kill)
    title: str = ""  # a rank kill: the process's title (the rank method it was in)
    gone_mono: float | None = None  # a rank kill: when the process was gone (zombie or reaped)
    coord_mono: float | None = None  # coord-recovery: when the coordinator was killed
    replacement: str | None = None  # a node loss: the replacement node's name
    replacement_mono: float | None = None  # when its `ray start` began
    replacement_up_mono: float | None = None  # when `ray start` returned
    replacement_ranks_mono: float | None = None  # when its first rank process was started


def watch_death(fault: Fault, pid: int, limit_s: float = 60.0) -> None:
    """Sets ``fault.gone_mono`` once process ``pid`` is dead (polled every 5 ms, in a thread)."""
    import psutil

    def watch() -> None:
        end = time.monotonic() + limit_s
        while time.monotonic() < end:
            with contextlib.suppress(psutil.NoSuchProcess):  # gone: reaped
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    time.sleep(0.005)
                    continue
            fault.gone_mono = time.monotonic()
            return

    threading.Thread(target=watch, daemon=True).start()


class RunDir:
    """The job's run directory, read as it is written; remembers when each row was first seen."""

    def __init__(self, storage: str) -> None:
        self.storage = storage
        self.path: str | None = None
        self.rows: list[Json] = []
        self.seen: list[float] = []

    def find(self) -> str | None:
        if self.path is None:
            found = glob.glob(os.path.join(self.storage, "*", "metrics.jsonl"))
            self.path = os.path.dirname(found[0]) if found else None
        return self.path

    def read(self, name: str) -> str:
        """The file ``name`` of the run directory; "" while there is none."""
        path = pathlib.Path(self.find() or self.storage, name)
        return path.read_text() if self.path is not None and path.exists() else ""

    def events(self) -> list[Json]:
        return [json.loads(x) for x in self.read("events.jsonl").splitlines() if x.strip()]

    def saving(self) -> bool:
        """Whether a checkpoint is being written (its temporary directory exists)."""
        root = self.find()
        return root is not None and bool(glob.glob(os.path.join(root, "checkpoints", ".*.tmp-*")))

    def poll(self) -> None:
        now = time.monotonic()
        for line in self.read("metrics.jsonl").splitlines()[len(self.rows) :]:
            try:
                self.rows.append(json.loads(line))
            except json.JSONDecodeError:
                break  # half written: read again next time
            self.seen.append(now)

    @property
    def step(self) -> int:
        return int(self.rows[-1]["step"]) if self.rows else 0

    def offset(self) -> float:
        """time.monotonic() - the coordinator's clock, from above."""
        return min(s - float(r["at"]) for s, r in zip(self.seen, self.rows, strict=True))

    def offset_wall(self) -> float:
        """time.time() - the coordinator's clock, from above."""
        return self.offset() + time.time() - time.monotonic()


class JournalTail:
    """What the job's journal gained since the last look (it grows all run: read from where
    the last look ended)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.at = os.path.getsize(path) if os.path.exists(path) else 0

    def new(self) -> str:
        with open(self.path, "rb") as f:
            f.seek(self.at)
            text = f.read()
        self.at += len(text)
        return text.decode(errors="replace")


def rank_pids(node: lc.WorkerNode) -> list[int]:
    """The node's rank processes: those titled ``ray::RankWorker`` (class and method) whose
    parent is the node's raylet. Others with that title are not ranks: a rank's child between
    its fork and its exec (the title is the parent's until then), or a killed rank's zombie,
    which init has not reaped yet; a kill of one would find nothing for the job to detect."""
    import psutil

    raylet = node.raylet_pid()
    out = []
    for pid in lc.session_pids(node.session, "ray::RankWorker"):
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).ppid() == raylet:
                out.append(pid)
    return sorted(out)


def entrypoint(a: argparse.Namespace, storage: str) -> list[str]:
    """The job's command line: 2 gangs x GANG_SIZE ranks, ``a.steps`` steps, a checkpoint every
    ``a.checkpoint_every`` steps and at the end (the row-level check reads it); with Parquet,
    generated rows read by index in EPOCHS passes (a loss appends the rows left to the
    survivors' streams, read by a new Ray Data pipeline after their current epoch's part)."""
    rows = -(-a.steps * 2 * GANG_SIZE * BATCH_SIZE // EPOCHS)
    parquet = ["--set", "data.source=generated", "--set", f"data.generated_rows={rows}"]
    parquet += ["--set", f"data.path={a.data_dir}/train"]  # written once, read by every run
    parquet += ["--set", f"data.epochs={EPOCHS}"]
    return [
        "python", "-m", "jobs.train", "--config", "examples/configs/local_cpu.yaml",
        "--num-workers", str(2 * GANG_SIZE), "--gang-size", str(GANG_SIZE),
        "--steps", str(a.steps), "--log-every", str(LOG_EVERY),
        "--storage-path", storage, "--set", "name=chaos",
        "--set", f"checkpoint.every_n_steps={a.checkpoint_every}",
        "--set", "checkpoint.checkpoint_at_end=true",
        "--set", "elastic.min_gangs=1", "--set", "elastic.max_gangs=2",
        "--set", f"elastic.collective_timeout_s={a.collective_timeout_s}",
        "--set", f"elastic.step_timeout_s={2 * a.collective_timeout_s}",
        "--set", f"elastic.max_coordinator_restarts={len(a.schedule)}",
        *(parquet if a.data == "parquet" else []),
    ]  # fmt: skip


def run(a: argparse.Namespace) -> Json:
    storage = tempfile.mkdtemp(prefix="rtchaos-", dir="/tmp")
    faults: list[Fault] = []
    load = [os.getloadavg()[0]]
    command = entrypoint(a, storage)
    with lc.local_cluster(head_cpus=HEAD_CPUS[a.data], temp_prefix="rtch-") as cluster:
        with concurrent.futures.ThreadPoolExecutor(len(NODES)) as pool:  # each takes seconds
            list(pool.map(lambda name: cluster.add_node(name, num_cpus=GANG_SIZE), NODES))
        cluster.nodes.sort(key=lambda n: n.name)
        job = f"chaos-{os.getpid()}-{a.run_index}"
        print(f"[chaos] cluster: {cluster.dashboard}, head in {cluster.temp_dir}", flush=True)
        cluster.submit(job, *command, cwd=str(ROOT), runtime_env="examples/runtime_env.yaml")
        run_dir = RunDir(storage)
        state = drive(a, cluster, job, run_dir, faults)
        logs = cluster.logs(job)
        load.append(os.getloadavg()[0])
        checked, found = None, run_dir.find()
        if a.data == "parquet" and found is not None:
            checked = row_check(found, command[3:], EPOCHS)
    summary = json.loads(run_dir.read("summary.json") or "{}")
    events = run_dir.events()
    shutil.rmtree(storage, ignore_errors=True)  # what the report needs is read
    return {
        "state": state.split("\n", 1)[0], "status": state, "logs_tail": logs[-6000:],
        "faults": [dataclasses.asdict(f) for f in faults], "rows": run_dir.rows, "events": events,
        "offset": run_dir.offset() if run_dir.rows else None, "summary": summary,
        "row_check": checked, "load": load,
    }  # fmt: skip


def drive(
    a: argparse.Namespace, cluster: lc.LocalCluster, job: str, run_dir: RunDir, faults: list[Fault]
) -> str:
    """Carries out the faults while the job trains; returns its final state."""
    full_since: int | None = None  # the first step at which both gangs trained again
    # The generation and row count at the last fault: rows of that generation or before are not
    # "again" (a slow detection leaves rows of the old two gangs coming in after the kill).
    fault_generation, fault_rows = -1, 0
    ended: list[str] = []  # the job's final state, once `ray job status` shows one
    # The `ray` CLI takes seconds to start here: asked in a thread, so faults stay on time, and
    # seldom, so that it takes little CPU from the job.
    threading.Thread(
        target=lambda: ended.append(cluster.wait(job, a.timeout_s, poll_s=10)), daemon=True
    ).start()
    draw = random.Random(a.seed)  # which node and rank, and the moment: replayable
    kill_at: float | None = None  # when the due fault is carried out (a random moment)
    while not ended:
        ran_on = len(faults) == len(a.schedule) and ran_on_enough(a, run_dir, faults[-1])
        if ran_on or time.perf_counter() - a.run_started > a.timeout_s:
            # SIGTERM: the job stops at its next interval boundary and writes its summary.
            cluster.ray("job", "stop", "--no-wait", "--address", cluster.dashboard, job)
            return cluster.wait(job, 180)
        run_dir.poll()
        rows = run_dir.rows
        again = len(rows) > fault_rows + 1 and rows[-1]["gangs"] == 2
        if again and (rows[-1]["generation"] > fault_generation or faults[-1].kind[:5] == "coord"):
            full_since = run_dir.step if full_since is None else full_since
        else:
            full_since = None
        due = (
            len(faults) < len(a.schedule)
            and full_since is not None
            and run_dir.step >= max(FIRST_STEP[a.short], full_since + 2 * LOG_EVERY)
        )
        kind = a.schedule[len(faults)] if len(faults) < len(a.schedule) else ""
        if due and kill_at is None:
            kill_at = time.monotonic() + draw.uniform(0.0, MAX_DELAY_S)
        if due and kill_at is not None and time.monotonic() >= kill_at:
            if kind == "coord-save" and not run_dir.saving():
                time.sleep(0.005)  # until a checkpoint is being written
                continue
            kill_at = None
            faults.append(fault := kill(a, cluster, kind, faults, draw, run_dir))
            print(f"[chaos] step {fault.step}: killed a {fault.kind} on {fault.node}", flush=True)
            full_since, fault_generation = None, int(rows[-1]["generation"])
            fault_rows = len(rows)
        time.sleep(0.005 if kill_at is not None else 0.1)
    run_dir.poll()
    return ended[0]


def ran_on_enough(a: argparse.Namespace, run_dir: RunDir, last: Fault) -> bool:
    """Whether the job has run long enough after the last fault: ``--run-on-s`` seconds, or with
    ``--short`` until ``node_died`` and two intervals past it (a fixed number of steps could end
    before the node loss on a loaded machine); else never (the job runs to its end)."""
    if a.run_on_s is not None:
        why = f"{a.run_on_s:g} s after the last fault"
        done = time.monotonic() - last.kill_mono > a.run_on_s
    elif a.short:
        died = [e for e in run_dir.events() if e["kind"] == "node_died"]
        why = f"step {run_dir.step}: the node loss is booked"
        done = bool(died) and run_dir.step >= int(died[0]["step"]) + 2 * LOG_EVERY
    else:
        return False
    if done:
        print(f"[chaos] {why}; stopping the job", flush=True)
    return done


def kill(
    a: argparse.Namespace,
    cluster: lc.LocalCluster,
    kind: str,
    faults: list[Fault],
    draw: random.Random,
    run_dir: RunDir,
) -> Fault:
    """Kills a rank (off the last fault's node where it can), the last node (its raylet first;
    a replacement node is started after), or the coordinator's process."""
    step = run_dir.step
    if kind in ("coord", "coord-save"):
        fault = Fault(kind, step, time.monotonic(), "head", None)
        kill_coordinator(cluster)
        return fault
    live = [n for n in cluster.nodes if rank_pids(n)]
    others = [n for n in live if not faults or n.name != faults[-1].node]
    node = live[-1] if kind == "node" else draw.choice(others or live)
    node_id = node.node_id()
    if kind in ("rank", "coord-recovery"):
        pid = draw.choice(rank_pids(node))
        journal = JournalTail(os.path.join(run_dir.find() or "", "journal.jsonl"))
        fault = Fault(kind, step, time.monotonic(), node.name, node_id, lc.process_title(pid))
        os.kill(pid, signal.SIGKILL)
        watch_death(fault, pid)
        if kind == "coord-recovery":
            # In the recovery: once it journaled the generation without the lost gang (its
            # sync, commit and re-share follow).
            end = time.monotonic() + 60
            while time.monotonic() < end and '"kind":"generation"' not in journal.new():
                time.sleep(0.005)
            fault.coord_mono = time.monotonic()
            kill_coordinator(cluster)
        return fault
    fault = Fault(kind, step, time.monotonic(), node.name, node_id)
    kill_node(node)
    if not a.short:
        fault.replacement = f"r{sum(f.kind == 'node' for f in faults)}"
        threading.Thread(target=replace, args=(cluster, fault), daemon=True).start()
    return fault


def kill_node(node: lc.WorkerNode) -> None:
    """Kills every process of ``node`` at once, its raylet first, as in a host crash."""
    raylet = node.raylet_pid()
    assert raylet is not None
    rest = [p for p in lc.session_pids(node.session) if p != raylet]
    for pid in (raylet, *rest):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    lc.stop_session(node.session, grace_s=2)  # what the node left (children)


def replace(cluster: lc.LocalCluster, fault: Fault) -> None:
    """Starts the replacement node of a lost one (in a thread: `ray start` takes seconds)."""
    assert fault.replacement is not None
    fault.replacement_mono = time.monotonic()
    for attempt in range(3):  # a `ray start` that fails (a port taken meanwhile) is tried again
        try:
            cluster.add_node(fault.replacement, num_cpus=GANG_SIZE)
            break
        except (RuntimeError, OSError) as e:
            print(f"[chaos] replacement node {fault.replacement} did not start: {e}", flush=True)
            if attempt == 2:
                return
    fault.replacement_up_mono = time.monotonic()
    took = fault.replacement_up_mono - fault.replacement_mono
    print(f"[chaos] replacement node {fault.replacement} is up after {took:.1f} s", flush=True)
    import psutil

    node = next(n for n in cluster.nodes if n.name == fault.replacement)
    end = time.monotonic() + 600
    while time.monotonic() < end and not (pids := rank_pids(node)):
        time.sleep(0.1)
    with contextlib.suppress(psutil.Error, ValueError):
        started = min(psutil.Process(p).create_time() for p in pids)
        fault.replacement_ranks_mono = time.monotonic() - (time.time() - started)


def kill_coordinator(cluster: lc.LocalCluster) -> None:
    """SIGKILLs the coordinator actor's process (on the head: the driver's node)."""
    pids = lc.session_pids(cluster.session, "ray::Coordinator")
    if not pids:
        raise RuntimeError("no coordinator process on the head node")
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__, "chaos", "docs/fault_tolerance.md")
    p.add_argument("--short", action="store_true", help="one rank loss, then the node")
    kills = "SIGKILL the coordinator: 3 at random moments, one in a recovery, one in a save"
    p.add_argument("--coordinator-kills", action="store_true", help=kills)
    p.add_argument("--data", choices=("synthetic", "parquet"), default="parquet")
    p.add_argument("--runs", type=int, default=1, help="runs of the same schedule, one by one")
    p.add_argument("--steps", type=int, default=None, help="default: 4500; --short: 20000")
    p.add_argument("--checkpoint-every", type=int, default=300, help="steps between checkpoints")
    p.add_argument("--seed", type=int, default=0, help="draws the nodes, ranks and moments")
    p.add_argument("--collective-timeout-s", type=float, default=10.0)
    p.add_argument("--timeout-s", type=float, default=1200.0, help="stop a job after this")
    run_on = "stop the job this long after the last fault (default: let it finish)"
    p.add_argument("--run-on-s", type=float, help=run_on)
    p.add_argument("--json", type=pathlib.Path, help="write the raw outputs and reports here")
    a = parse(p, argv)
    # --short stops by itself once its faults are dealt with (ran_on_enough): its steps are a cap.
    a.steps = a.steps or (20000 if a.short else 4500)
    a.schedule = SCHEDULES["short" if a.short else "coordinator" if a.coordinator_kills else "full"]
    runs: list[Json] = []
    a.data_dir = tempfile.mkdtemp(prefix="rtchaos-data-", dir="/tmp")
    for i in range(a.runs):
        a.run_index, a.run_started = i, time.perf_counter()
        out = run(a)
        report = analyse(out) if out["rows"] else {"marks": []}
        runs.append({"out": out, "report": report})
        if a.json:  # after every run: a long campaign keeps what it measured
            a.json.write_text(json.dumps({"runs": runs}, indent=1, default=str))
        if not out["rows"]:
            print(out["status"], out["logs_tail"], sep="\n")
        else:
            print(table(report), flush=True)
        a.seed += 1  # the next run draws other moments, ranks and nodes
    a.seed -= a.runs
    shutil.rmtree(a.data_dir, ignore_errors=True)
    name = (
        "chaos-coordinator"
        if a.coordinator_kills
        else "chaos-short"
        if a.short
        else "chaos-parquet"
    )
    a.argv = drop_options(a.argv, "--json")  # where the raw outputs went: not the measurement
    publish(a, describe(a, runs), name=name, heading=HEADING)
    # A job stopped by the harness (--run-on-s, --short) ends STOPPED, its summary written.
    done = [
        r["out"]["state"] == "SUCCEEDED" or (r["out"]["state"] == "STOPPED" and r["out"]["summary"])
        for r in runs
    ]
    return 0 if all(done) else 1


if __name__ == "__main__":
    raise SystemExit(main())
