"""The chaos harness's reading of its runs (:mod:`benchmarks.chaos`), pure but for
:func:`row_check`: when each loss was detected and what it cost, the largest idle interval, the
data waits after re-shares, the time from a node's start to its gang's join, and the row-level
check of the final checkpoint. What each figure counts: docs/fault_tolerance.md, "Chaos".
"""

from __future__ import annotations

import argparse
import collections
import glob
import itertools
import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks.common import md_table, spread

Json = dict[str, Any]
#: An interval is slowed when it took this much longer than its steps at the no-fault pace.
SLOWED_S = 0.5
#: Targets (s), issue-level: the largest idle interval of a run, the data waits of the slowed
#: intervals after a re-share over a run, and a loss's stall over the rest of the run.
TARGETS = {"idle": 5.0, "reshare_data": 10.0, "rest": 5.0}
COORD_KINDS = {"coord": "at random", "coord-save": "in a checkpoint save"}


def analyse(out: Json) -> Json:
    rows, events, offset = out["rows"], out["events"], out["offset"]
    marks: list[Json] = []
    losses = [e for e in events if e["kind"] in ("rank_died", "node_died")]
    for f in out["faults"]:
        kill_at = f["kill_mono"] - offset
        if f["kind"] in COORD_KINDS:
            marks.append(_coordinator_mark(f, kill_at, events, COORD_KINDS[f["kind"]]))
            continue
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
        if f.get("coord_mono") is not None:  # coord-recovery: then the coordinator
            coord_at = f["coord_mono"] - offset
            marks.append(_coordinator_mark(f, coord_at, events, "in a recovery"))
    starts = [f["kill_mono"] - offset for f in out["faults"]]  # the loss a join makes good
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
        if after["steps"] and not _holds(before, after, ats)
    ]
    step_s = statistics.median(pace) if pace else 0.0
    for m in (m for m in marks if "at" in m):
        before = [r for r in rows if r["at"] <= m.get("killed_at", m["at"])]
        after = [r for r in rows if r["at"] > m["at"]]
        if before and after:
            m["stall_s"] = after[0]["at"] - before[-1]["at"] - after[0]["steps"] * step_s
    saves = [e["at"] for e in events if e["kind"] == "checkpoint_saved"]
    first_fault = out["faults"][0]["kill_mono"] - offset if out["faults"] else None
    summary = out["summary"]
    batches = summary.get("batches", {})
    baseline = _rest_of_run(rows, marks, first_fault, saves)
    return {
        "marks": marks, "step_s": step_s, "baseline": baseline,
        "lost": batches.get("lost"), "final": summary.get("final"),
        "doubled": None if not batches else batches["committed"] - batches["committed_distinct"],
        "replica_check": summary.get("replica_check", {}).get("passed"),
        "run": figures(out, marks, (baseline or {}).get("pace_s", step_s)),
    }  # fmt: skip


def _coordinator_mark(f: Json, kill_at: float, events: list[Json], when: str) -> Json:
    """A coordinator kill: when its loss was booked (``coordinator_lost``), when the new
    coordinator started (``restart_s``) and what it rolled back; ``stall_s`` (added by
    :func:`analyse`) runs from the last row before the kill to the new coordinator's first."""
    mark: Json = {"what": f"coordinator killed ({when})", "step": f["step"], "type": "coordinator"}
    mark["killed_at"] = kill_at
    lost = next(
        (e for e in events if e["kind"] == "coordinator_lost" and e["at"] >= kill_at - 1e-3), None
    )
    if lost is not None:
        mark |= {"at": lost["at"], "detected_s": lost["at"] - kill_at}
        restarted = next(
            (e for e in events if e["kind"] == "coordinator_restarted" and e["at"] >= lost["at"]),
            None,
        )
        if restarted is not None:
            mark["at"] = restarted["at"]
            mark["restart_s"] = restarted["at"] - kill_at
            mark["rolled_back"] = restarted.get("rolled_back_batches")
            mark["from_step"] = restarted.get("checkpoint_step")
    return mark


def figures(out: Json, marks: list[Json], pace: float) -> Json:
    """The run's figures for the issue's targets: losses detected, the largest idle interval
    (beyond its steps at ``pace``; a coordinator's restart apart, it has its own mark), the data
    waits of the slowed intervals after the first re-share, node start to gang join."""
    rows, events, offset = out["rows"], out["events"], out["offset"]
    restarts = [m["at"] for m in marks if m["type"] == "coordinator" and "at" in m]
    reshares = [e["at"] for e in events if e["kind"] == "data_reshared"]
    first_fault = out["faults"][0]["kill_mono"] - offset if out["faults"] else float("inf")
    clean = [b for a, b in itertools.pairwise(rows) if b["steps"] and b["at"] < first_fault]
    wait = statistics.median(
        [b["data_wait_fraction"] * b["seconds"] / b["steps"] for b in clean] or [0.0]
    )
    idle: list[tuple[float, int, float, float]] = []  # (idle s, step, data wait beyond, at)
    for before, after in itertools.pairwise(rows):
        if not after["steps"] or _holds(before, after, restarts) or after["step"] < before["step"]:
            continue
        data = after["data_wait_fraction"] * after["seconds"] - after["steps"] * wait
        idle.append(
            (after["at"] - before["at"] - after["steps"] * pace, after["step"], data, after["at"])
        )
    slowed = [i for i in idle if i[0] > SLOWED_S and reshares and i[3] > reshares[0]]
    worst = max(idle, default=(None, None, None, None))
    held = ""  # what the largest idle interval held: events, an evaluation
    if worst[3] is not None:
        (before,) = [a for a, b in itertools.pairwise(rows) if b["at"] == worst[3]][:1]
        kinds = sorted({e["kind"] for e in events if before["at"] < e["at"] <= worst[3]})
        row = next(r for r in rows if r["at"] == worst[3])
        held = ", ".join(kinds + (["evaluation"] if row.get("eval_auc") is not None else []))
    losses = [m for m in marks if m["type"] == "loss"]
    joins = sorted(e["at"] for e in events if e["kind"] == "gang_joined")
    nodes = []
    for f in out["faults"]:
        if f.get("replacement_mono") is None:
            continue
        start = f["replacement_mono"] - offset
        joined = next((at for at in joins if at > start), None)
        up, ranks = f.get("replacement_up_mono"), f.get("replacement_ranks_mono")
        nodes.append(
            {
                "node": f["replacement"],
                "up_s": None if up is None else up - f["replacement_mono"],
                "ranks_s": None if ranks is None else ranks - f["replacement_mono"],
                "to_join_s": None if joined is None else joined - start,
            }
        )
    return {
        "losses": len(losses), "detected": sum("detected_s" in m for m in losses),
        "largest_idle_s": worst[0], "largest_idle_step": worst[1], "largest_idle_data_s": worst[2],
        "largest_idle_held": held,
        "reshare_data_s": sum(max(0.0, d) for _, _, d, _ in slowed),
        "slowed_after_reshare": len(slowed),
        "worst_loss_s": max((m.get("total_stall_s", 0.0) for m in losses), default=None),
        "nodes": nodes,
        "loss_to_join_s": [m["to_join_s"] for m in marks if m.get("to_join_s") is not None],
        "load": out.get("load"), "rows": out.get("row_check"),
    }  # fmt: skip


def _holds(before: Json, after: Json, times: Sequence[float]) -> bool:
    """Whether one of ``times`` falls in the interval that ends with the row ``after``."""
    return any(before["at"] < t <= after["at"] for t in times)


def _rest_of_run(
    rows: list[Json], marks: list[Json], first_fault: float | None, saves: Sequence[float]
) -> dict[str, float] | None:
    """Adds to each loss mark the stall it causes over the rest of the run (``total_stall_s``)
    and the late data waits in it (``late_data_s``), as docs/fault_tolerance.md defines them;
    the pace, its noise and the data wait per step come from the rows before the first fault.
    Intervals holding a join or a checkpoint save count too: their cost is the loss's."""
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
    cut = [m for m in marks if m["type"] in ("loss", "coordinator") and "at" in m]
    for i, m in enumerate(cut):
        if m["type"] != "loss":
            continue
        end = cut[i + 1]["at"] if i + 1 < len(cut) else float("inf")
        total, late, first = 0.0, 0.0, True
        for before, after in itertools.pairwise(rows):
            if not m["at"] < after["at"] <= end or not after["steps"]:
                continue
            excess = after["at"] - before["at"] - after["steps"] * pace
            if first or excess > SLOWED_S:
                total += max(0.0, excess)
            if not first and excess > SLOWED_S:
                late += max(
                    0.0, after["data_wait_fraction"] * after["seconds"] - after["steps"] * wait
                )
            first = False
        m["total_stall_s"], m["late_data_s"] = total, late
    return {"pace_s": pace, "noise_s": noise}


def _same_node(event: Json, fault: Json) -> bool:
    """Whether a rank_died event names the fault's node ("<node id prefix> at <address>")."""
    prefix = str(event.get("node", "")).split(" ", 1)[0]
    return bool(prefix) and str(fault["node_id"] or "").startswith(prefix)


def row_check(run_dir: str, argv: Sequence[str], epochs: int) -> Json:
    """Every row of the job's generated Parquet, counted in the batches its final checkpoint
    holds as committed (located through the checkpoint's table of re-shared streams), against
    how often the job's plan holds it: its ranks' initial streams, ``epochs`` passes cut at the
    job's ``num_steps`` (rows past it are no part of the job). Rows trained fewer times than
    that (lost) and more (doubled); ``outside``: rows of the files the plan leaves out.
    ``argv``: the job's ``jobs.train`` arguments."""
    import numpy as np
    import pyarrow.parquet as pq

    from jobs.train import build_config
    from raytrec.checkpoint.config import checkpoint_root
    from raytrec.checkpoint.layout import CheckpointStore, read_manifest
    from raytrec.data.from_config import generate, parquet_spec
    from raytrec.data.parquet import IndexedParquetShard, ParquetSource
    from raytrec.data.parquet_streams import stream_length

    config = build_config(list(argv))
    config = config.replace(data=config.data.replace(id_policy="modulo"))  # as the job reads it
    latest = CheckpointStore(checkpoint_root(run_dir)).latest()
    if latest is None:
        return {"checkpoint_step": None}
    accounting = read_manifest(latest.uri).extra["accounting"]
    committed = [(int(a), int(b)) for rs in accounting["committed"].values() for a, b in rs]
    table = accounting.get("streams_table") or {"made": {}}
    source = ParquetSource(
        paths=generate(config)[0],  # the job's files, found where it wrote them
        spec=parquet_spec(config),
        read_mode="indexed",
        epochs=config.data.epochs,
        shuffle_seed=config.data.shuffle_seed,
        shuffle_window_rows=config.data.shuffle_window_rows,
    )
    shard = source.split(int(table.get("num_shards", config.scaling.world_size)))[0]
    assert isinstance(shard, IndexedParquetShard) and config.num_steps is not None
    shard = shard.with_table(table, limit=config.num_steps)
    size = config.data.batch_size
    pieces = [p for a, b in committed for i in range(a, b) for p in shard.batch_pieces(i, size)]
    plan = shard.plan(size)
    planned = [
        p
        for sid in range(shard.num_shards)
        for stream in [plan.stream(sid, limit=config.num_steps)]
        for p in plan.stream_pieces(stream, 0, stream_length(stream))
    ]
    root = generate(config)[0]
    files = sorted(
        {p.path for p in pieces} | set(glob.glob(f"{root}/**/*.parquet", recursive=True))
    )
    ids = {f: pq.read_table(f, columns=["row_id"])["row_id"].to_numpy() for f in files}
    every = np.sort(np.concatenate(list(ids.values())))

    def counted(of: list[Any]) -> tuple[Any, int]:
        """How often each row of ``every`` is in the pieces ``of``; rows the files lack."""
        found = [ids[p.path][p.file_row : p.file_row + p.rows] for p in of]
        rows, times = np.unique(np.concatenate(found) if found else every[:0], return_counts=True)
        at = np.minimum(np.searchsorted(every, rows), len(every) - 1)
        known = every[at] == rows
        counts = np.zeros(len(every), dtype=np.int64)
        np.add.at(counts, at[known], times[known])
        return counts, int(times[~known].sum())

    counts, unknown = counted(pieces)
    due, _ = counted(planned)
    return {
        "checkpoint_step": latest.step, "rows": len(every), "trained": int(counts.sum()),
        "due": int(due.sum()), "outside": int(np.maximum(epochs - due, 0).sum()),
        "lost": int(np.maximum(due - counts, 0).sum()),
        # Rows trained more often than the plan holds them, and rows the files do not hold.
        "doubled": int(np.maximum(counts - due, 0).sum() + unknown),
    }  # fmt: skip


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


def coordinator_table(report: Json) -> str:
    rows = [
        [m["what"], m["step"], spread([m.get("detected_s")]), spread([m.get("restart_s")]),
         spread([m.get("stall_s")]), m.get("from_step", "-"), m.get("rolled_back", "-")]
        for m in report["marks"] if m["type"] == "coordinator"
    ]  # fmt: skip
    heads = "coordinator kill | step | coordinator_lost after (s) | new coordinator after (s) "
    heads += "| training stalled (s) | resumed from step | batches rolled back"
    return md_table(heads, rows)


def _verdict(value: float | None, target: float) -> str:
    met = value is not None and value < target
    return f"target < {target:.0f} s: {'met' if met else '**missed**'}"


def _node_join(node: Json) -> str:
    """A replacement node's start to its gang's join, with when `ray start` returned and when
    the gang's first rank process was started: "41.2 (up 9.5, ranks 20.1)"."""
    parts = [f"{k} {spread([node.get(f'{k}_s')])}" for k in ("up", "ranks")]
    return f"{spread([node.get('to_join_s')])} ({', '.join(parts)})"


def _runs_table(runs: list[Json]) -> str:
    rows = []
    for i, r in enumerate(runs):
        f, out = r["report"].get("run", {}), r["out"]
        checked = f.get("rows") or {}
        # A stopped job had rows left to train: its untrained rows are not lost.
        lost = checked.get("lost") if out["state"] == "SUCCEEDED" else "- (stopped)"
        check = "-" if not checked else f"{lost} / {checked.get('doubled')}"
        load = "/".join(f"{x:.1f}" for x in f.get("load") or [])
        idle = f.get("largest_idle_s")
        where = "" if idle is None else f" (step {f['largest_idle_step']}"
        where += f": {f['largest_idle_held']})" if f.get("largest_idle_held") else ")"
        rows.append([
            i + 1, load, out["state"].lower(), f"{f.get('detected')} of {f.get('losses')}",
            spread([idle]) + where, spread([f.get("reshare_data_s")]),
            spread([f.get("worst_loss_s")]),
            ", ".join(_node_join(n) for n in f.get("nodes", [])) or "-",
            spread(f.get("loss_to_join_s") or []), check,
            "passed" if r["report"].get("replica_check") else "**failed**",
        ])  # fmt: skip
    heads = "run | load (start/end) | job | losses detected | largest idle interval (s) "
    heads += "| data waits after re-shares (s) | worst loss over the rest (s) "
    heads += "| node start to gang join (node up, rank processes started) (s) "
    heads += "| loss to gang join (s) "
    heads += "| rows lost / doubled | replica check"
    return md_table(heads, rows)


def describe(a: argparse.Namespace, runs: list[Json]) -> str:
    figs = [r["report"].get("run", {}) for r in runs]
    idle = [x for x in (f.get("largest_idle_s") for f in figs) if x is not None]
    data = [x for x in (f.get("reshare_data_s") for f in figs) if x is not None]
    worst_idle, worst_data = max(idle, default=None), max(data, default=None)
    kinds = collections.Counter(a.schedule)
    source = "Parquet read by index through Ray Data (3 epochs)"
    source = source if a.data == "parquet" else "synthetic data"
    runs_word = f"{len(runs)} run{'s' if len(runs) > 1 else ''}"
    text = (
        f"- Cluster: `ray start` head + 2 worker nodes of 2 CPUs on 127.0.0.1; job "
        f"(`ray job submit`): 2 gangs x 2 ranks, {source}, "
        f"`examples/configs/local_cpu.yaml`, {a.steps} steps, a checkpoint every "
        f"{a.checkpoint_every} steps. Faults per run, in order: {', '.join(a.schedule)} "
        f"({', '.join(f'{n} {k}' for k, n in kinds.items())}); a lost node is replaced by a "
        f"new one{' (not with --short)' if a.short else ''}.\n"
        f"- {runs_word}: largest idle interval worst {spread([worst_idle])} s, median "
        f"{spread([statistics.median(idle) if idle else None])} s "
        f"(every run, {_verdict(worst_idle, TARGETS['idle'])}); data waits in slowed "
        f"intervals after a re-share worst {spread([worst_data])} s, median "
        f"{spread([statistics.median(data) if data else None])} s "
        f"({_verdict(worst_data, TARGETS['reshare_data'])}).\n\n{_runs_table(runs)}"
    )
    worst = max(runs, key=lambda r: r["report"].get("run", {}).get("largest_idle_s") or 0.0)
    if worst["report"]["marks"]:
        text += f"\n\nEvery fault and join of run {runs.index(worst) + 1} (the worst idle "
        text += f"interval):\n\n{table(worst['report'])}"
    if any(m["type"] == "coordinator" for r in runs for m in r["report"]["marks"]):
        for i, r in enumerate(runs):
            summary = r["out"]["summary"]
            text += f"\n\nThe coordinator's losses in run {i + 1} (the ledger: "
            text += f"`coordinator_restarts` {summary.get('coordinator_restarts')}, `failures` "
            text += f"{(summary.get('failures') or {}).get('events')}):\n\n"
            text += coordinator_table(r["report"])
    return text
