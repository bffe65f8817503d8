"""Chaos on a multi-node local cluster: what losing nodes and ranks costs a submitted job.

    .venv/bin/python -m benchmarks.chaos [--short] [--data parquet] [--write PAGE]

What it kills, when, and what each column counts: docs/fault_tolerance.md, "Chaos". Kill times
are put on the coordinator's clock from when each row was first seen: the delays are upper bounds.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import glob
import itertools
import json
import os
import pathlib
import random
import shutil
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

import raytrec.cluster.local as lc
from benchmarks.common import ROOT, md_table, parse, parser, publish, spread

HEADING = "## Chaos: node and rank losses on a local cluster"
#: The faults in order: the full run, and --short (the cluster test's). The node goes last: no
#: replacement node to start (on a loaded machine a new node can miss the GCS's startup deadline).
SCHEDULES = {False: ("rank",) * 5 + ("node",), True: ("rank", "node")}
#: Targets (s): the survivors' stall at a loss and at a join, a loss's over the rest of the run.
STALL_TARGETS = {"loss": 3.0, "join": 1.0, "rest": 5.0}
#: The head's CPUs (never killed): with Parquet one, for Ray Data's read tasks (too few for a gang).
HEAD_CPUS = {"synthetic": 0, "parquet": 1}
#: examples/configs/local_cpu.yaml's batch size, and the passes over the rows with --data parquet.
BATCH_SIZE, EPOCHS = 128, 4
Json = dict[str, Any]  # a metrics row, an event, a fault, a mark or a report, as JSON has it
NODES, GANG_SIZE = ("n0", "n1"), 2  # a worker node per gang, of a CPU per rank
LOG_EVERY = 2
FIRST_STEP = {False: 200, True: 60}  # no fault before this step (by --short): a no-fault pace
MAX_DELAY_S = 1.0  # a fault lands a random moment up to this long after it is due


@dataclasses.dataclass
class Fault:
    kind: str  # "rank" or "node"
    step: int  # the last step seen before the kill
    kill_mono: float  # time.monotonic() at the kill (the same clock on every process here)
    node: str  # the worker node's name
    node_id: str | None  # Ray's node id of the node (of the rank's node for a rank kill)
    title: str = ""  # a rank kill: the process's title (the rank method it was in)
    gone_mono: float | None = None  # a rank kill: when the process was gone (zombie or reaped)


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

    def read(self, name: str) -> str:
        """The file ``name`` of the run directory; "" while there is none."""
        if self.path is None:
            found = glob.glob(os.path.join(self.storage, "*", "metrics.jsonl"))
            self.path = os.path.dirname(found[0]) if found else None
        path = pathlib.Path(self.path or self.storage, name)
        return path.read_text() if self.path is not None and path.exists() else ""

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


def rank_pids(node: lc.WorkerNode) -> list[int]:
    return sorted(lc.session_pids(node.session, "ray::RankWorker"))  # title: class and method


def run(a: argparse.Namespace) -> Json:
    storage = tempfile.mkdtemp(prefix="rtchaos-", dir="/tmp")
    faults: list[Fault] = []
    with lc.local_cluster(head_cpus=HEAD_CPUS[a.data], temp_prefix="rtch-") as cluster:
        with concurrent.futures.ThreadPoolExecutor(len(NODES)) as pool:  # each takes seconds
            list(pool.map(lambda name: cluster.add_node(name, num_cpus=GANG_SIZE), NODES))
        cluster.nodes.sort(key=lambda n: n.name)
        job = f"chaos-{os.getpid()}"
        print(f"[chaos] cluster: {cluster.dashboard}, head in {cluster.temp_dir}", flush=True)
        entrypoint = [
            "python", "-m", "jobs.train", "--config", "examples/configs/local_cpu.yaml",
            "--num-workers", str(2 * GANG_SIZE), "--gang-size", str(GANG_SIZE),
            "--steps", str(a.steps), "--log-every", str(LOG_EVERY),
            "--storage-path", storage, "--set", "name=chaos",
            "--set", "checkpoint.every_n_steps=50",
            "--set", "elastic.min_gangs=1", "--set", "elastic.max_gangs=2",
            "--set", f"elastic.collective_timeout_s={a.collective_timeout_s}",
            "--set", f"elastic.step_timeout_s={2 * a.collective_timeout_s}",
        ]  # fmt: skip
        if a.data == "parquet":
            # Read by index in EPOCHS passes: a loss gives every survivor a new Ray Data stream.
            rows = -(-a.steps * 2 * GANG_SIZE * BATCH_SIZE // EPOCHS)
            entrypoint += ["--set", "data.source=generated", "--set", f"data.generated_rows={rows}"]
            entrypoint += ["--set", f"data.epochs={EPOCHS}"]
        cluster.submit(job, *entrypoint, cwd=str(ROOT), runtime_env="examples/runtime_env.yaml")
        run_dir = RunDir(storage)
        state = drive(a, cluster, job, run_dir, faults)
        logs = cluster.logs(job)
    summary = json.loads(run_dir.read("summary.json") or "{}")
    events = [json.loads(x) for x in run_dir.read("events.jsonl").splitlines() if x.strip()]
    shutil.rmtree(storage, ignore_errors=True)  # what the report needs is read
    return {
        "state": state.split("\n", 1)[0], "status": state, "logs_tail": logs[-6000:],
        "faults": [dataclasses.asdict(f) for f in faults], "rows": run_dir.rows, "events": events,
        "offset": run_dir.offset() if run_dir.rows else None, "summary": summary,
    }  # fmt: skip


def drive(
    a: argparse.Namespace, cluster: lc.LocalCluster, job: str, run_dir: RunDir, faults: list[Fault]
) -> str:
    """Carries out the faults while the job trains; returns its final state."""
    schedule = SCHEDULES[a.short]
    full_since: int | None = None  # the first step at which both gangs trained again
    # The generation at the last fault: rows of that generation or before are not "again" (a
    # slow detection leaves rows of the old two gangs coming in after the kill).
    fault_generation = -1
    ended: list[str] = []  # the job's final state, once `ray job status` shows one
    # The `ray` CLI takes seconds to start here: asked in a thread, so faults stay on time.
    threading.Thread(
        target=lambda: ended.append(cluster.wait(job, a.timeout_s)), daemon=True
    ).start()
    draw = random.Random(a.seed)  # which node and rank, and the moment: replayable
    kill_at: float | None = None  # when the due fault is carried out (a random moment)
    while not ended:
        ran_on = len(faults) == len(schedule) and ran_on_enough(a, run_dir, faults[-1])
        if ran_on or time.perf_counter() - a.started > a.timeout_s:
            # SIGTERM: the job stops at its next interval boundary and writes its summary.
            cluster.ray("job", "stop", "--no-wait", "--address", cluster.dashboard, job)
            return cluster.wait(job, 180)
        run_dir.poll()
        rows = run_dir.rows
        if rows and rows[-1]["gangs"] == 2 and rows[-1]["generation"] > fault_generation:
            full_since = run_dir.step if full_since is None else full_since
        else:
            full_since = None
        due = (
            len(faults) < len(schedule)
            and full_since is not None
            and run_dir.step >= max(FIRST_STEP[a.short], full_since + 2 * LOG_EVERY)
        )
        if due and kill_at is None:
            kill_at = time.monotonic() + draw.uniform(0.0, MAX_DELAY_S)
        if due and kill_at is not None and time.monotonic() >= kill_at:
            kill_at = None
            faults.append(fault := kill(cluster, schedule[len(faults)], faults, draw, run_dir.step))
            print(f"[chaos] step {fault.step}: killed a {fault.kind} on {fault.node}", flush=True)
            full_since, fault_generation = None, int(rows[-1]["generation"])
        time.sleep(0.01 if kill_at is not None else 0.1)
    run_dir.poll()
    return ended[0]


def ran_on_enough(a: argparse.Namespace, run_dir: RunDir, last: Fault) -> bool:
    """Whether the job has run long enough after the last fault: ``--run-on-s`` seconds, or with
    ``--short`` until ``node_died`` and two intervals past it (a fixed number of steps could end
    before the node loss on a loaded machine)."""
    if a.run_on_s is not None:
        why = f"{a.run_on_s:g} s after the last fault"
        done = time.monotonic() - last.kill_mono > a.run_on_s
    else:
        events = run_dir.read("events.jsonl").splitlines() if a.short else []
        died = [json.loads(x) for x in events if "node_died" in x]
        why = f"step {run_dir.step}: the node loss is booked"
        done = bool(died) and run_dir.step >= int(died[0]["step"]) + 2 * LOG_EVERY
    if done:
        print(f"[chaos] {why}; stopping the job", flush=True)
    return done


def kill(
    cluster: lc.LocalCluster, kind: str, faults: list[Fault], draw: random.Random, step: int
) -> Fault:
    """Kills a rank (off the last fault's node where it can), or the last node, its raylet first."""
    live = [n for n in cluster.nodes if rank_pids(n)]
    others = [n for n in live if not faults or n.name != faults[-1].node]
    node = live[-1] if kind == "node" else draw.choice(others or live)
    node_id = node.node_id()
    if kind == "rank":
        pid = draw.choice(rank_pids(node))
        fault = Fault(kind, step, time.monotonic(), node.name, node_id, lc.process_title(pid))
        os.kill(pid, signal.SIGKILL)
        watch_death(fault, pid)
        return fault
    raylet = node.raylet_pid()
    assert raylet is not None
    rest = [p for p in lc.session_pids(node.session) if p != raylet]
    fault = Fault(kind, step, time.monotonic(), node.name, node_id)
    for pid in (raylet, *rest):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    lc.stop_session(node.session, grace_s=2)  # what the node left (children)
    return fault


def analyse(out: Json) -> Json:
    rows, events, offset = out["rows"], out["events"], out["offset"]
    marks: list[Json] = []
    losses = [e for e in events if e["kind"] in ("rank_died", "node_died")]
    for f in out["faults"]:
        kill_at = f["kill_mono"] - offset
        after = [e for e in losses if e["at"] >= kill_at - 1e-3]
        # The job notices a lost node through its ranks' calls (rank_died naming the node);
        # Ray's node table shows the node dead later (node_died, after its health checks).
        on_node = [e for e in after if e["kind"] == "rank_died" and _same_node(e, f)]
        what = f"{f['kind']} killed ({f['node']})"
        if f.get("title"):  # "ray::RankWorker.train": the rank method it was in
            what = f"rank killed ({f['node']}, in {f['title'].rsplit('.', 1)[-1]})"
        mark = {"what": what, "step": f["step"], "type": "loss"}
        if f.get("gone_mono") is not None:
            mark["gone_s"] = f["gone_mono"] - f["kill_mono"]
        if on_node:
            hit = on_node[0]
            # When the coordinator learned of it; the log books it once the recovery starts.
            seen = hit["at"] if hit.get("noticed_at") is None else hit["noticed_at"]
            mark |= {"at": hit["at"], "step": hit["step"], "detected_s": seen - kill_at}
            mark["booked_s"] = hit["at"] - kill_at
        if f["kind"] == "node":
            died = next((e for e in after if e["kind"] == "node_died"), None)
            if died is not None:
                mark["node_died_s"] = died["at"] - kill_at
                mark["named"] = died.get("node_id") == f["node_id"]
        marks.append(mark)
    starts = [f["kill_mono"] - offset for f in out["faults"] if f["kind"] == "rank"]
    for e in (e for e in events if e["kind"] == "gang_joined"):
        start = max((s for s in starts if s <= e["at"]), default=None)
        mark = {"what": f"gang {e['gang_id']} joined", "step": e["step"], "type": "join"}
        mark |= {"at": e["at"], "to_join_s": None if start is None else e["at"] - start}
        marks.append(mark)
    marks.sort(key=lambda m: m.get("at", float("inf")))
    # The normal pace: seconds per step of the rows whose interval held no event.
    ats = [m["at"] for m in marks if "at" in m]
    pace = [
        (after["at"] - before["at"]) / after["steps"]
        for before, after in itertools.pairwise(rows)
        if not _holds(before, after, ats)
    ]
    step_s = statistics.median(pace) if pace else 0.0
    for m in (m for m in marks if "at" in m):
        before = [r for r in rows if r["at"] <= m["at"]]
        after = [r for r in rows if r["at"] > m["at"]]
        if before and after:
            m["stall_s"] = after[0]["at"] - before[-1]["at"] - after[0]["steps"] * step_s
    saves = [e["at"] for e in events if e["kind"] == "checkpoint_saved"]
    first_fault = out["faults"][0]["kill_mono"] - offset if out["faults"] else None
    summary = out["summary"]
    batches = summary.get("batches", {})
    return {
        "marks": marks, "step_s": step_s, "baseline": _rest_of_run(rows, marks, first_fault, saves),
        "lost": batches.get("lost"), "final": summary.get("final"),
        "doubled": None if not batches else batches["committed"] - batches["committed_distinct"],
        "replica_check": summary.get("replica_check", {}).get("passed"),
    }  # fmt: skip


def _holds(before: Json, after: Json, times: Sequence[float]) -> bool:
    """Whether one of ``times`` falls in the interval that ends with the row ``after``."""
    return any(before["at"] < t <= after["at"] for t in times)


def _rest_of_run(
    rows: list[Json], marks: list[Json], first_fault: float | None, saves: Sequence[float]
) -> dict[str, float] | None:
    """Adds to each loss mark the stall it causes over the rest of the run (``total_stall_s``)
    and the late data waits in it (``late_data_s``), as docs/fault_tolerance.md defines them;
    the pace, its noise and the data wait per step come from the rows before the first fault."""
    if first_fault is None:
        return None

    def other(before: Json, after: Json) -> bool:
        """A checkpoint save, or an evaluation at the interval's end, took time in it."""
        return _holds(before, after, saves) or after.get("eval_auc") is not None

    clean = [
        (before, after)
        for before, after in itertools.pairwise(rows)
        if after["at"] < first_fault and after["steps"] and not other(before, after)
    ]
    if len(clean) < 5:
        return None  # too few rows before the first fault to know the pace
    pace = statistics.median((b["at"] - a["at"]) / b["steps"] for a, b in clean)
    noise = max(b["at"] - a["at"] - b["steps"] * pace for a, b in clean)
    wait = statistics.median(b["data_wait_fraction"] * b["seconds"] / b["steps"] for _, b in clean)
    losses = [m for m in marks if m["type"] == "loss" and "at" in m]
    joins = [m["at"] for m in marks if m["type"] == "join" and "at" in m]
    for i, m in enumerate(losses):
        end = losses[i + 1]["at"] if i + 1 < len(losses) else float("inf")
        total, late, first = 0.0, 0.0, True
        for before, after in itertools.pairwise(rows):
            if not m["at"] < after["at"] <= end or not after["steps"]:
                continue
            excess = after["at"] - before["at"] - after["steps"] * pace
            if _holds(before, after, joins) or (not first and other(before, after)):
                continue
            if first or excess > noise:
                total += max(0.0, excess)
            if not first:
                data = after["data_wait_fraction"] * after["seconds"]
                late += max(0.0, data - after["steps"] * wait) if excess > noise else 0.0
            first = False
        m["total_stall_s"], m["late_data_s"] = total, late
    return {"pace_s": pace, "noise_s": noise}


def _same_node(event: Json, fault: Json) -> bool:
    """Whether a rank_died event names the fault's node ("<node id prefix> at <address>")."""
    prefix = str(event.get("node", "")).split(" ", 1)[0]
    return bool(prefix) and str(fault["node_id"] or "").startswith(prefix)


def table(report: Json) -> str:
    rows = []
    keys = ["gone_s", "detected_s", "booked_s", "node_died_s", "to_join_s", "stall_s"]
    keys += ["total_stall_s", "late_data_s"]
    for m in report["marks"]:
        rows.append([m["what"], m["step"], *(spread([m.get(k)]) for k in keys)])
        if m.get("named") is False:
            rows[-1][5] += " (**another node named**)"
    heads = "event | step | process gone after (s) | detected after (s) | booked after (s) "
    heads += "| node_died after (s) | to join (s) | survivors' stall (s) | stall over the rest (s) "
    return md_table(heads + "| late data waits (s)", rows)


def _verdict(value: float | None, target: float) -> str:
    met = value is not None and value < target
    return f"(target < {target:.0f} s: {'met' if met else '**missed**'})"


def describe(a: argparse.Namespace, out: Json, report: Json) -> str:
    final, base, marks = report["final"] or {}, report.get("baseline"), report["marks"]
    data = "synthetic data"
    if a.data == "parquet":
        data = f"Parquet read by index through Ray Data ({EPOCHS} epochs)"
    stalls = []
    for kind, label in (("loss", "a loss"), ("join", "a join")):
        got = [m["stall_s"] for m in marks if m["type"] == kind and "stall_s" in m]
        value = statistics.median(got) if got else None
        target = _verdict(value, STALL_TARGETS[kind])
        stalls.append(f"median survivors' stall at {label} {spread([value])} s {target}")
    losses = [m for m in marks if m["type"] == "loss"]
    detected = [m["detected_s"] for m in losses if "detected_s" in m]
    worst = max((m["total_stall_s"] for m in losses if "total_stall_s" in m), default=None)
    slowed = ""
    if base:
        slowed = (
            f" No-fault pace {base['pace_s']:.3f} s/step; an interval counts as slowed when it is "
            f"{base['noise_s']:.2f} s beyond it (the largest excess before the first fault)."
        )
    return f"""- Cluster: `ray start` head ({HEAD_CPUS[a.data]} CPUs) + {len(NODES)} worker nodes \
of {GANG_SIZE} CPUs on 127.0.0.1; job: 2 gangs x {GANG_SIZE} ranks, {data}, \
`examples/configs/local_cpu.yaml`, {a.steps} steps, `log_every={LOG_EVERY}`, a checkpoint every \
50 steps; normal pace {report["step_s"]:.3f} s/step.
- Job {out["state"].lower()}; rows lost: {report["lost"]} batches, doubled: {report["doubled"]} \
batches; replica check {"passed" if report["replica_check"] else "FAILED"}; final loss \
{final.get("loss", float("nan")):.4f}, AUC {final.get("auc") or float("nan"):.4f} at step \
{final.get("step")}.
- {stalls[0]}; {stalls[1]}.
- {len(detected)} of {len(losses)} losses detected, the slowest after \
{spread([max(detected, default=None)])} s; the largest stall a loss caused over the rest of the \
run {spread([worst])} s {_verdict(worst, STALL_TARGETS["rest"])}.{slowed}

{table(report)}"""


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__, "chaos", "docs/fault_tolerance.md")
    p.add_argument("--short", action="store_true", help="one rank loss, then the node")
    p.add_argument("--data", choices=("synthetic", "parquet"), default="synthetic")
    p.add_argument("--steps", type=int, default=None, help="default: 14000; --short: until stopped")
    p.add_argument("--seed", type=int, default=0, help="draws the nodes, ranks and moments")
    p.add_argument("--collective-timeout-s", type=float, default=10.0)
    p.add_argument("--timeout-s", type=float, default=900.0, help="stop the job after this")
    run_on = "stop the job this long after the last fault (default: let it finish)"
    p.add_argument("--run-on-s", type=float, help=run_on)
    p.add_argument("--json", type=pathlib.Path, help="write the raw outputs and report here")
    a = parse(p, argv)
    # --short stops by itself once its faults are dealt with (ran_on_enough): its steps are a cap.
    a.steps = a.steps or (100_000 if a.short else 14000)
    out = run(a)
    report = analyse(out) if out["rows"] else {"marks": []}
    if a.json:
        a.json.write_text(json.dumps({"out": out, "report": report}, indent=1, default=str))
    if not out["rows"]:
        print(out["status"], out["logs_tail"], sep="\n")
        return 1
    name = "chaos" if a.data == "synthetic" else f"chaos-{a.data}"
    publish(a, describe(a, out, report), name=name, heading=HEADING)
    # A job stopped by the harness (--run-on-s, --short) ends STOPPED, its summary written.
    done = out["state"] == "SUCCEEDED" or (out["state"] == "STOPPED" and out["summary"])
    return 0 if done else 1


if __name__ == "__main__":
    raise SystemExit(main())
