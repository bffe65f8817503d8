"""From a node's start to its gang's join: where the seconds go, on a local multi-node cluster.

    .venv/bin/python -m benchmarks.join_time [--gang-size L] [--log-every N] [--write PAGE]

A head (no CPUs) and two worker nodes of L CPUs on 127.0.0.1; the training job (2 gangs x L
ranks, synthetic data, ``examples/configs/local_cpu.yaml``) submitted with ``ray job submit``.
Once it trains, node n1 is killed (every process of it); once the loss is booked and the
replacement gang's placement group requested, a new node is started, and its time to the
replacement gang's ``gang_joined`` is broken down from: this process's polls of Ray's node and
placement group tables (it is a driver of the cluster), Ray's records of the new rank actors'
tasks and worker processes (the state API, as ``ray list tasks`` shows them) and the job's
events. The breakdown (:func:`breakdown`) is pure.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

import raytrec.cluster.local as lc
from benchmarks.chaos import RunDir, kill_node
from benchmarks.common import ROOT, drop_options, md_table, parse, parser, publish

__all__ = ["breakdown", "main", "table"]

HEADING = "## Node start to gang join"
Json = dict[str, Any]
#: The milestones of a join, in order, and what each one is (the table's rows).
MILESTONES = (
    ("node_start", "`ray start` of the new node began"),
    ("raylet_start", "its raylet started (Ray's node table)"),
    ("registered", "the node is in Ray's node table, alive"),
    ("ray_start_done", "`ray start` returned"),
    ("placed", "the replacement gang's placement group is ready"),
    ("requested", "the coordinator created the gang's rank actors"),
    ("launch", "Ray requested their worker processes' startup"),
    ("launched", "their worker processes started"),
    ("worker_ready", "the worker processes were ready to be used"),
    ("constructed", "the actors were constructed (torch, TorchRec imported)"),
    ("build_running", "`build` began"),
    ("built", "`build` returned (gang world, model, sharding)"),
    ("join_started", "the join began at an interval boundary (`gang_placed`)"),
    ("joined", "`gang_joined`: sync, generation, heal broadcast done"),
)


def breakdown(seen: Json, tasks: Sequence[Json], workers: Sequence[Json], offset: float) -> Json:
    """Each milestone's time (s, wall clock) of a join: ``seen`` the harness's own times
    (``node_start``, ``registered``, ``ray_start_done``, ``placed``, ``node_id``, and the job's
    ``gang_placed`` / ``gang_joined`` events), ``tasks`` and ``workers`` Ray's state records of
    the new node's rank actors, ``offset`` the wall clock minus the coordinator's clock. Where a
    gang has several ranks the last one's time counts: the gang waits for it."""
    out: Json = {k: seen.get(k) for k in ("node_start", "registered", "ray_start_done", "placed")}
    out["raylet_start"] = seen.get("raylet_start")
    builds = [
        t for t in tasks if t.get("node_id") == seen["node_id"] and t["name"].endswith(".build")
    ]

    def last(values: Sequence[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return max(known) if known and len(known) == len(values) else None

    def event(task: Json, state: str) -> float | None:
        ms = [e["created_ms"] for e in task.get("events") or [] if e.get("state") == state]
        return ms[0] / 1000 if ms else None

    # ``build`` is called as the actors are created, and handed to each once it is constructed.
    out["requested"] = last([t["creation_time_ms"] / 1000 for t in builds])
    by_id = {w["worker_id"]: w for w in workers}
    ws = [by_id.get(t.get("worker_id")) for t in builds]
    for key, field in (
        ("launch", "worker_launch_time_ms"),
        ("launched", "worker_launched_time_ms"),
    ):
        out[key] = last([w[field] / 1000 if w and w[field] > 0 else None for w in ws])
    out["worker_ready"] = last([w["start_time_ms"] / 1000 if w else None for w in ws])
    out["constructed"] = last([event(t, "SUBMITTED_TO_WORKER") for t in builds])
    out["build_running"] = last([event(t, "RUNNING") for t in builds])
    out["built"] = last([event(t, "FINISHED") for t in builds])
    out["join_started"] = seen["gang_placed"] + offset if "gang_placed" in seen else None
    out["joined"] = seen["gang_joined"] + offset if "gang_joined" in seen else None
    return out


def table(times: Json) -> str:
    """The milestones in the order they came (one not seen last): since the node's start, and
    since the milestone before."""
    t0, rows, before = times["node_start"], [], None
    order = {key: i for i, (key, _) in enumerate(MILESTONES)}
    for key, what in sorted(
        MILESTONES, key=lambda m: (times.get(m[0]) is None, times.get(m[0]) or 0, order[m[0]])
    ):
        at = times.get(key)
        since = "-" if at is None else f"{at - t0:.2f}"
        step = "-" if at is None or before is None else f"{at - before:+.2f}"
        rows.append((what, since, step))
        before = at if at is not None else before
    return md_table("milestone | since the node's start (s) | since the one before (s)", rows)


def entrypoint(a: argparse.Namespace, storage: str) -> list[str]:
    return [
        "python", "-m", "jobs.train", "--config", "examples/configs/local_cpu.yaml",
        "--num-workers", str(2 * a.gang_size), "--gang-size", str(a.gang_size),
        "--steps", "1000000", "--log-every", str(a.log_every),
        "--storage-path", storage, "--set", "name=join",
        "--set", "elastic.min_gangs=1", "--set", "elastic.max_gangs=2",
        "--set", "elastic.collective_timeout_s=10", "--set", "elastic.step_timeout_s=20",
        "--set", "eval.every_n_steps=null",
    ]  # fmt: skip


def run(a: argparse.Namespace) -> Json:
    storage = tempfile.mkdtemp(prefix="rtjoin-", dir="/tmp")
    try:
        return measure(a, storage)
    finally:
        shutil.rmtree(storage, ignore_errors=True)


def measure(a: argparse.Namespace, storage: str) -> Json:
    seen: Json = {}
    load = [os.getloadavg()[0]]
    with lc.local_cluster(head_cpus=0, temp_prefix="rtjn-") as cluster:
        for name in ("n0", "n1"):
            cluster.add_node(name, num_cpus=a.gang_size)
        job = f"join-{os.getpid()}"
        cluster.submit(job, *entrypoint(a, storage), cwd=str(ROOT), runtime_env=a.runtime_env)
        print(f"[join] cluster {cluster.dashboard}; job {job} submitted", flush=True)
        run_dir = RunDir(storage)
        with lc.connected(cluster):
            follow(a, cluster, run_dir, seen)
            time.sleep(3)  # Ray's task events reach the GCS about once a second
            from ray.util.state import list_nodes, list_tasks, list_workers

            on_node: Any = {"filters": [("node_id", "=", seen["node_id"])], "detail": True}
            on_node["address"] = cluster.dashboard  # this machine may run other clusters
            build = [("name", "=", "RankWorker.build")]  # not cut off by later calls
            tasks = [
                t.__dict__
                for t in list_tasks(**(on_node | {"filters": on_node["filters"] + build}))
            ]
            workers = [w.__dict__ for w in list_workers(**on_node, limit=1000)]
            for n in list_nodes(**on_node, raise_on_missing_output=False):
                seen["raylet_start"] = n.start_time_ms / 1000 if n.start_time_ms else None
        load.append(os.getloadavg()[0])
    times = breakdown(seen, tasks, workers, offset=run_dir.offset_wall())
    return {"times": times, "load": load, "seen": seen, "tasks": tasks, "workers": workers}


def follow(a: argparse.Namespace, cluster: lc.LocalCluster, run_dir: RunDir, seen: Json) -> None:
    """Kills n1 once the job trains, starts a new node once the loss is booked, and notes when
    the new node registered, the replacement gang's placement group became ready and the job
    recorded the join; returns at ``gang_joined`` (or raises after ``--timeout-s``)."""
    import ray
    from ray.util.placement_group import placement_group_table

    end = time.monotonic() + a.timeout_s
    killed_at: int | None = None  # the events seen when n1 was killed
    known: set[str] = set()
    created_before: set[str] = set()
    while time.monotonic() < end:
        run_dir.poll()
        events = run_dir.events()
        if killed_at is None and run_dir.step >= a.kill_at_step:
            created_before = {p for p, t in placement_group_table().items() if created(t)}
            known = {n["NodeID"] for n in ray.nodes()}
            kill_node(cluster.nodes[1])
            killed_at = len(events)
            print(f"[join] step {run_dir.step}: killed node n1", flush=True)
        after = events[killed_at:] if killed_at is not None else []
        kinds = [e["kind"] for e in after]
        if "node_start" not in seen and "gang_dropped" in kinds and "gang_requested" in kinds:
            seen["node_start"] = time.time()
            grow = threading.Thread(target=add_node, args=(cluster, a.gang_size, seen))
            grow.start()
            print(f"[join] step {run_dir.step}: the loss is booked; starting node r0", flush=True)
        if "node_start" in seen and "registered" not in seen:
            new = [n for n in ray.nodes() if n["NodeID"] not in known and n["Alive"]]
            if new:
                seen["registered"], seen["node_id"] = time.time(), new[0]["NodeID"]
        if "registered" in seen and "placed" not in seen:
            ready = [p for p, t in placement_group_table().items() if created(t)]
            if set(ready) - created_before:
                seen["placed"] = time.time()
        if "node_start" in seen:
            for e in after:
                if e["kind"] in ("gang_placed", "gang_joined") and e["kind"] not in seen:
                    seen[e["kind"]] = float(e["at"])
        if "gang_joined" in seen:
            return
        time.sleep(0.1)
    raise TimeoutError(f"no gang joined in {a.timeout_s} s: {run_dir.read('events.jsonl')}")


def created(table: Json) -> bool:
    return bool(table.get("state") == "CREATED")


def add_node(cluster: lc.LocalCluster, cpus: int, seen: Json) -> None:
    """Starts node r0 (in a thread: `ray start` takes seconds); notes when it returned."""
    cluster.add_node("r0", num_cpus=cpus)
    seen["ray_start_done"] = time.time()


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__, "join_time", "docs/fault_tolerance.md")
    p.add_argument("--gang-size", type=int, default=1, help="ranks per gang (CPUs per node)")
    p.add_argument("--log-every", type=int, default=10, help="steps per interval")
    p.add_argument("--kill-at-step", type=int, default=100, help="kill node n1 at this step")
    p.add_argument("--timeout-s", type=float, default=900.0, help="give up after this")
    p.add_argument("--json", type=pathlib.Path, help="write the raw times here")
    a = parse(p, argv)
    a.runtime_env = "examples/runtime_env.yaml"
    out = run(a)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1, default=str))
    load = "/".join(f"{x:.1f}" for x in out["load"])
    ranks = f"{a.gang_size} rank" + ("s" if a.gang_size > 1 else "")
    body = f"2 gangs x {ranks}, {a.log_every} steps per interval; load average "
    body += f"{load} (start/end).\n\n{table(out['times'])}\n"
    a.argv = drop_options(a.argv, "--json")  # the command shown makes the same table
    publish(a, body, name="join-time", heading=HEADING)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
