"""A continuous job on a multi-node local cluster, submitted with `ray job submit`: day partitions
land while it trains, a rank is SIGKILLed and a node lost on the way, deltas are published
throughout, and it stops on request. Then it checks every row of every day committed once (by
row id, from the final checkpoint), the base plus every delta equal bit for bit to a full export
of the final model, a missing or a repeated delta refused; and measures each day's latency from
landing to its first rows trained.

    .venv/bin/python -m benchmarks.continuous [--days 7] [--rows-per-day 4096] [--write PAGE]

What it runs and what the columns mean: docs/continuous.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow.parquet as pq

import raytrec.cluster.local as lc
from benchmarks.chaos import RunDir, rank_pids
from benchmarks.common import ROOT, md_table, parse, parser, publish
from raytrec.data.partitions import DayLander, stage_days

HEADING = "## A continuous run, measured"
Json = dict[str, Any]
CONFIG = "examples/configs/continuous.yaml"
NODES = ("n0", "n1")  # a CPU each; a lost rank's gang comes back on its CPU


def run(a: argparse.Namespace, work: str) -> Json:
    data, serving, storage = (os.path.join(work, d) for d in ("days", "serving", "runs"))
    lander, generated = stage_days(
        data, days=a.days, rows_per_day=a.rows_per_day, num_embeddings=10_000, seed=a.seed
    )
    lander.land(0)  # the job starts on the first day
    log: list[str] = []
    with lc.local_cluster(head_cpus=1, temp_prefix="rtct-") as cluster:
        for name in NODES:  # one at a time, again when a loaded machine makes one time out
            for attempt in range(3):
                try:
                    cluster.add_node(name, num_cpus=1)
                    break
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    print(f"[continuous] node {name} did not start ({attempt + 1}/3): {e}")
            else:
                raise RuntimeError(f"worker node {name} did not start")
        job = f"continuous-{os.getpid()}"
        entrypoint = [
            "python", "-m", "jobs.train", "--config", CONFIG,
            "--storage-path", storage, "--set", f"data.path={data}",
            "--set", f"publish.dir={serving}", "--set", f"data.growing.poll_s={a.poll_s}",
            "--set", "elastic.collective_timeout_s=10", "--set", "elastic.step_timeout_s=20",
        ]  # fmt: skip
        cluster.submit(job, *entrypoint, cwd=str(ROOT), runtime_env="examples/runtime_env.yaml")
        run_dir = RunDir(storage)
        state = drive(a, cluster, job, run_dir, lander, log)
        logs = cluster.logs(job)
    return {
        "state": state.split("\n", 1)[0], "logs_tail": logs[-4000:], "log": log,
        "rows": run_dir.rows, "run_dir": run_dir.path, "serving": serving,
        "landed": lander.landed(), "oracle_auc": generated.oracle_auc,
    }  # fmt: skip


def drive(
    a: argparse.Namespace,
    cluster: lc.LocalCluster,
    job: str,
    run_dir: RunDir,
    lander: DayLander,
    log: list[str],
) -> str:
    """Lands the days, kills a rank, then a node, and stops the job once every day is trained."""
    ended: list[str] = []
    wait = threading.Thread(target=lambda: ended.append(cluster.wait(job, a.timeout_s)))
    wait.daemon = True
    wait.start()

    def say(text: str) -> None:
        log.append(f"{time.perf_counter() - a.started:6.1f}s step {run_dir.step}: {text}")
        print(f"[continuous] {log[-1]}", flush=True)

    started: float | None = None
    landed, killed, lost = 1, False, False
    held = a.days - 2  # the last two days land after the node's loss: training goes on after it
    while not ended:
        run_dir.poll()
        now = time.monotonic()
        if started is None and run_dir.rows:
            started = now
            say("training started")
        due = started is not None and now >= started + landed * a.land_every_s
        if due and landed < (a.days if lost else held):
            say(f"landed {lander.land(landed)}")
            landed += 1
        if not killed and landed >= 3:  # a rank's process SIGKILLed
            pid = next(p for n in cluster.nodes for p in rank_pids(n))
            os.kill(pid, signal.SIGKILL)
            killed = True
            say(f"SIGKILLed rank process {pid}")
        # Once a gang has joined since, a worker node that runs a rank is lost (a rank may run
        # on the head, which is never killed).
        node = next((n for n in reversed(cluster.nodes) if n.raylet_pid() and rank_pids(n)), None)
        if killed and not lost and _joined(run_dir) and node is not None:
            _kill_node(node)
            lost = True
            say(f"lost node {node.name} (its raylet and every process on it killed)")
        if lost and landed == a.days and _all_trained(run_dir, a.days) and _node_loss_over(run_dir):
            say("every day landed and trained: stopping the job on request (ray job stop)")
            cluster.ray("job", "stop", "--no-wait", "--address", cluster.dashboard, job)
            return cluster.wait(job, 240)
        if time.perf_counter() - a.started > a.timeout_s:
            say("timed out: stopping the job")
            cluster.ray("job", "stop", "--no-wait", "--address", cluster.dashboard, job)
            return cluster.wait(job, 240)
        time.sleep(0.2)
    return ended[0]


def _joined(run_dir: RunDir) -> bool:
    """A gang joined after the first rank loss."""
    kinds = [e["kind"] for e in _events(run_dir)]
    return "rank_died" in kinds and "gang_joined" in kinds[kinds.index("rank_died") :]


def _node_loss_over(run_dir: RunDir) -> bool:
    """The node's loss is booked (a rank of it died, or the node), and the job trained after."""
    events = _events(run_dir)
    kinds = [e["kind"] for e in events]
    first = kinds.index("gang_joined") if "gang_joined" in kinds else len(kinds)
    died = [e for e in events[first:] if e["kind"] in ("node_died", "rank_died")]
    return bool(died) and run_dir.step > int(died[0]["step"])


def _events(run_dir: RunDir) -> list[Json]:
    return [json.loads(x) for x in run_dir.read("events.jsonl").splitlines() if x.strip()]


def _all_trained(run_dir: RunDir, days: int) -> bool:
    """Every day found (the first was there at the start) and every row found trained."""
    grown = [e for e in _events(run_dir) if e["kind"] == "files_landed"]
    found = 1 + sum(len(e["paths"]) for e in grown)
    last = run_dir.rows[-1] if run_dir.rows else None
    ends = [e["end_step"] for e in grown]
    return found == days and last is not None and last["step"] >= max(ends, default=0)


def _kill_node(node: lc.WorkerNode) -> None:
    raylet = node.raylet_pid()
    for pid in [raylet, *(p for p in lc.session_pids(node.session) if p != raylet)]:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    lc.stop_session(node.session, grace_s=2)


# -- the checks ------------------------------------------------------------------------------


def check(out: Json, a: argparse.Namespace, work: str) -> Json:
    """Exactly once by row id, the deltas against a full export, and the refusals."""
    import torch

    from raytrec.checkpoint.layout import read_manifest
    from raytrec.config.file import load_config
    from raytrec.data.committed import committed_pieces
    from raytrec.serving.deltas import DELTAS, DeltaError
    from raytrec.serving.export import STATE_FILE, export, load_exported, load_model

    run_dir = pathlib.Path(out["run_dir"])
    summary = json.loads((run_dir / "summary.json").read_text())
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x]
    checkpoint = summary["resume_from"]
    extra = read_manifest(checkpoint).extra
    accounting = extra["accounting"]
    table = accounting["streams_table"]
    committed = [(int(x), int(y)) for x, y in accounting["committed"]["0"]]  # with multiplicity
    ids = {p: pq.read_table(p, columns=["row_id"])["row_id"].to_numpy() for p in out["landed"]}
    batch_size: int = load_config(str(ROOT / CONFIG)).data.batch_size
    pieces = committed_pieces(table, committed, batch_size=batch_size, limit=summary["num_steps"])
    found = [ids[p.path][p.file_row : p.file_row + p.rows] for p in pieces]
    rows = np.sort(np.concatenate(found))
    total = a.days * a.rows_per_day
    exactly_once = bool(len(rows) == total and np.array_equal(rows, np.arange(total)))
    per_file = summary["rows"]["per_file"] or {}
    # The deltas: base + every delta against a full export of the final model.
    serving = pathlib.Path(out["serving"])
    full = os.path.join(work, "full")
    export(summary["artifacts"]["final_model"], full, program=False, quiet=True)
    expected = torch.load(os.path.join(full, STATE_FILE), weights_only=True)
    model, info = load_exported(serving)
    state = model.state_dict()
    equal = state.keys() == expected.keys() and all(
        torch.equal(state[k], v) for k, v in expected.items()
    )
    deltas = sorted(p.name for p in (serving / DELTAS).iterdir() if not p.name.startswith("."))
    refusals = []
    for broken, change in (("gap", "missing"), ("twice", "repeated")):
        copy = pathlib.Path(work, broken)
        shutil.copytree(serving, copy)
        if change == "missing":
            shutil.rmtree(copy / DELTAS / deltas[0])
        else:
            shutil.copytree(copy / DELTAS / deltas[0], copy / DELTAS / f"{len(deltas) + 1:06d}")
        try:
            load_model(copy)
            refusals.append(f"{change}: NOT refused")
        except DeltaError as e:
            refusals.append(f"{change}: refused ({e})")
    return {
        "summary": summary, "events": events, "exactly_once": exactly_once,
        "rows_committed": len(rows), "rows_total": total, "per_file": per_file,
        "checkpoint_step": extra.get("step"), "published_step": info.step, "deltas": len(deltas),
        "deltas_equal_export": bool(equal), "refusals": refusals,
    }  # fmt: skip


def latencies(out: Json, checked: Json) -> list[Json]:
    """Per day that landed while the job ran: landing -> found -> the end of the interval that
    trained its first rows (a metrics row's time, on the coordinator's clock made wall-clock by
    the event's ``found_at``)."""
    rows = out["rows"]
    table = []
    for e in checked["events"]:
        if e["kind"] != "files_landed":
            continue
        first = e["first_step"]
        trained = None if first is None else next((r for r in rows if r["step"] >= first), None)
        times = zip(e["paths"], e["landed_at"], e["found_at"], strict=True)
        for path, landed_at, found_at in times:
            offset = max(e["found_at"]) - e["at"]  # wall clock - coordinator clock (above)
            table.append({
                "day": pathlib.Path(path).parent.name, "found_s": found_at - landed_at,
                "trained_s": None if trained is None else trained["at"] + offset - landed_at,
                "step": e["step"], "first_step": "-" if first is None else first,
            })  # fmt: skip
    return table


def describe(out: Json, checked: Json, lat: list[Json]) -> str:
    s = checked["summary"]
    kinds = [e["kind"] for e in checked["events"]]
    faults = [x for x in out["log"] if "SIGKILL" in x or "lost node" in x]
    lines = [
        f"- Final state of the submitted job: {out['state']}; {s['steps']} steps; stopped: "
        f"{s.get('stopped')}.",
        f"- Faults: {'; '.join(faults)}; events: {kinds.count('rank_died')} rank_died, "
        f"{kinds.count('node_died')} node_died, "
        f"{kinds.count('gang_joined')} gang_joined, {kinds.count('files_landed')} files_landed, "
        f"{kinds.count('model_published')} model_published.",
        f"- Exactly once by row id: {checked['exactly_once']} ({checked['rows_committed']} rows "
        f"committed, {checked['rows_total']} in the {len(out['landed'])} days); rows per file in "
        f"the ledger: {sorted(set(checked['per_file'].values()))}; batches committed "
        f"{s['batches']['committed']} (distinct {s['batches']['committed_distinct']}), lost "
        f"{s['batches']['lost']}.",
        f"- Base + {checked['deltas']} deltas equal to a full export of the final model, bit for "
        f"bit: {checked['deltas_equal_export']} (published step {checked['published_step']}, "
        f"final checkpoint step {checked['checkpoint_step']}).",
        *(f"- A {r}" for r in checked["refusals"]),
        "",
        md_table(
            "day | found at step | first step with its rows | found after (s) "
            "| first rows trained after (s)",
            [
                (
                    x["day"],
                    x["step"],
                    x["first_step"],
                    f"{x['found_s']:.1f}",
                    "-" if x["trained_s"] is None else f"{x['trained_s']:.1f}",
                )
                for x in lat
            ],
        ),
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__, "continuous", "docs/continuous.md")
    p.add_argument("--days", type=int, default=7, help="day partitions (the first at the start)")
    p.add_argument("--rows-per-day", type=int, default=4096)
    p.add_argument("--land-every-s", type=float, default=12.0, help="seconds between days")
    p.add_argument("--poll-s", type=float, default=1.0, help="data.growing.poll_s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=900.0, help="stop the job after this")
    p.add_argument("--keep", action="store_true", help="keep the data, run and serving dirs")
    a = parse(p, argv)
    work = tempfile.mkdtemp(prefix="rtcont-", dir="/tmp")
    print(f"[continuous] working in {work}", flush=True)
    try:
        out = run(a, work)
        if not out["rows"] or out["run_dir"] is None:
            print(out["state"], out["logs_tail"], sep="\n")
            return 1
        checked = check(out, a, work)
        body = describe(out, checked, latencies(out, checked))
        publish(a, body, name="continuous", heading=HEADING)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    ok = checked["exactly_once"] and checked["deltas_equal_export"]
    return 0 if ok and all("NOT" not in r for r in checked["refusals"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
