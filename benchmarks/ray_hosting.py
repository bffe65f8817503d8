"""What running a rank inside a Ray worker process costs, with the machine's drift taken out.

    ./dev.sh bench ray_hosting [--rounds 12] [--chunk 300] [--settle-s 10]
        [--experiments hosts idle-cluster niceness]

``throughput_vs_torchrun.py`` runs torchrun and raytrec one after the other, a minute or more
apart, and on a shared machine that drifts by 10-20% over minutes a few percent of difference
is lost in the spread. This benchmark takes turns in short chunks instead, so every arm sees the
same machine. Both experiments train the torchrun baseline's own step
(:class:`_torchrun_dmp.BaselineWorker`: same DLRM, plan, data and optimizers, T = 2 ranks on
gloo over 127.0.0.1, one torch thread each); no raytrec code is in the step.

1. **Hosts.** Three pairs of processes are up at once, each pair one gloo world that built its
   worker once. Only one pair trains at a time; every round runs each pair for ``--chunk`` steps,
   starting from a different pair each round:

   * plain processes, spawned by ``multiprocessing`` (no Ray in them, like torchrun's workers);
   * Ray actors with ``max_concurrency=1``: Ray runs the call on the worker's main thread;
   * Ray actors with ``max_concurrency=2``, the way raytrec's rank actors run (a second thread
     serves ``abort_replica_planes`` beside a blocked ``train``): the call runs on a pool
     thread, while the worker's main thread runs Ray's task loop, which takes the GIL every
     10 ms to check for signals (``CoreWorker.CheckSignal`` in Ray's core worker).

   The local Ray cluster is up throughout, for the plain pair too, so this compares hosts only.
   Besides rows/s, each chunk records the training thread's voluntary context switches: a
   thread that has to wait for the GIL sleeps, and counts one.

2. **An idle Ray cluster on the machine.** The plain pair alone, its chunks alternating between
   no Ray cluster and an idle one: a local cluster on 127.0.0.1 started in a subprocess before
   the chunk, holding two idle actors shaped like rank actors and one like the coordinator,
   given ``--settle-s`` seconds after it is ready, and stopped after the chunk. This is the CPU
   that Ray's own processes (GCS, raylet, dashboard agent, log monitor, idle workers' task
   loops) take from training on a machine whose cores the ranks already fill.

3. **Ray's nice value.** Ray starts its worker processes at nice 15; torchrun's workers run at
   0. Plain processes (the reference) against two pairs of Ray actors shaped like rank actors
   (``max_concurrency=3``, pool thread): one left at Ray's nice 15, one set back to nice 0 when
   it starts (``os.setpriority``, which needs the privilege to lower a nice value: root or
   CAP_SYS_NICE). On two cores the ranks' threads often wait on the run queue (see
   ``docs/benchmarks.md``), and a nice-0 process that wakes (raylet, GCS, the driver) is
   preferred over a nice-15 rank. Not in the default run: ``--experiments niceness``.

Every arm's figure: rows/s over all its chunks, the median chunk, and the median over rounds of
the chunk's rows/s divided by the reference arm's in the same round (plain processes; no
cluster). Printed and written to ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import multiprocessing
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _docs import replace_section  # noqa: E402
from _torchrun_dmp import add_model_args, model_argv  # noqa: E402

SECTION = "## Hosting a rank in a Ray worker process"
PLAIN, MAIN, THREADED = (
    "plain processes",
    "Ray actor, main thread (max_concurrency=1)",
    "Ray actor, pool thread (max_concurrency=2)",
)
NO_CLUSTER, IDLE_CLUSTER = "no Ray cluster", "idle Ray cluster up"
NICE_15, NICE_0 = (
    "Ray actor, pool thread (max_concurrency=3), Ray's nice 15",
    "Ray actor, pool thread (max_concurrency=3), nice 0",
)
WORLD = 2

Chunk = tuple[float, int]  # (seconds, voluntary context switches of the training thread)


class Host:
    """One rank: joins its pair's gloo world, builds the baseline worker, trains on demand."""

    def __init__(self, rank: int, port: int, argv: list[str], nice: int | None = None) -> None:
        import torch
        import torch.distributed as dist

        if nice is not None:
            try:
                os.setpriority(os.PRIO_PROCESS, 0, nice)
            except PermissionError as e:
                raise RuntimeError(
                    f"cannot set nice {nice} (from {os.getpriority(os.PRIO_PROCESS, 0)}): "
                    "lowering a nice value needs root or CAP_SYS_NICE"
                ) from e

        sys.path.insert(0, str(HERE))  # in a Ray worker too
        from _torchrun_dmp import BaselineWorker, _parse

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
        )
        a = _parse([*argv, "--steps=1", "--warmup-steps=0", "--out=/dev/null"])
        self.worker = BaselineWorker(a, device=torch.device("cpu"))

    def run(self, steps: int) -> Chunk:
        """``steps`` steps between two barriers; their seconds and this thread's voluntary
        context switches."""
        import torch.distributed as dist

        tid = threading.get_native_id()
        dist.barrier()
        switches = _voluntary_switches(tid)
        start = time.perf_counter()
        for _ in range(steps):
            self.worker.step()
        dist.barrier()
        return time.perf_counter() - start, _voluntary_switches(tid) - switches


def _voluntary_switches(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    return 0


def _serve(conn: Connection, rank: int, port: int, argv: list[str]) -> None:
    """A plain process: builds a Host, then runs every step count it is sent (None ends)."""
    host = Host(rank, port, argv)
    conn.send("ready")
    while (steps := conn.recv()) is not None:
        conn.send(host.run(steps))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PlainPair:
    def __init__(self, argv: list[str]) -> None:
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no Ray, no torch state
        port = _free_port()
        self.conns: list[Connection] = []
        self.procs = []
        for rank in range(WORLD):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(theirs, rank, port, argv), daemon=True)
            proc.start()
            self.conns.append(mine)
            self.procs.append(proc)
        for conn in self.conns:
            if conn.recv() != "ready":
                raise RuntimeError("a plain rank failed to start")

    def run(self, steps: int) -> list[Chunk]:
        for conn in self.conns:
            conn.send(steps)
        return [conn.recv() for conn in self.conns]

    def close(self) -> None:
        for conn in self.conns:
            conn.send(None)
        for proc in self.procs:
            proc.join(timeout=30)


class ActorPair:
    def __init__(self, argv: list[str], *, max_concurrency: int, nice: int | None = None) -> None:
        import ray

        actor = ray.remote(num_cpus=1)(Host).options(max_concurrency=max_concurrency)
        port = _free_port()
        self.actors = [actor.remote(rank, port, argv, nice) for rank in range(WORLD)]
        self.run(1)

    def run(self, steps: int) -> list[Chunk]:
        import ray

        return ray.get([a.run.remote(steps) for a in self.actors])


IDLE_CLUSTER_SCRIPT = """
import sys, ray
sys.path.insert(0, {root!r})
from raytrec.cluster import connect
connect(None, num_cpus=2)

class Idle:
    def ready(self):
        return True

ranks = [ray.remote(num_cpus=1)(Idle).options(max_concurrency=2).remote() for _ in range(2)]
coordinator = ray.remote(num_cpus=0)(Idle).options(max_concurrency=2).remote()
ray.get([a.ready.remote() for a in [*ranks, coordinator]])
print("ready", flush=True)
sys.stdin.readline()
ray.shutdown()
"""


class IdleCluster:
    """A local Ray cluster with three idle actors, in its own process, while in the block."""

    def __init__(self, settle_s: float) -> None:
        self.settle_s = settle_s

    def __enter__(self) -> IdleCluster:
        script = IDLE_CLUSTER_SCRIPT.format(root=str(HERE.parent))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", script],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.proc.kill()
            raise RuntimeError("the idle Ray cluster did not start")
        time.sleep(self.settle_s)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=120)


def take_turns(
    arms: dict[str, Callable[[], list[Chunk]]], rounds: int, rows: int
) -> dict[str, list[list[Chunk]]]:
    """Every round runs every arm once, starting from a different arm each round."""
    names = list(arms)
    out: dict[str, list[list[Chunk]]] = {n: [] for n in names}
    for i in range(rounds):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            out[name].append(arms[name]())
        rates = ", ".join(f"{n} {_chunk_rows_per_s(out[n][-1], rows):,.0f}" for n in names)
        print(f"  round {i + 1}/{rounds} (rows/s): {rates}", flush=True)
    return out


def _chunk_rows_per_s(chunk: list[Chunk], rows: int) -> float:
    return rows / max(seconds for seconds, _ in chunk)  # the pair is done when both are


def summarize(out: dict[str, list[list[Chunk]]], reference: str, rows: int) -> list[dict[str, Any]]:
    base = [_chunk_rows_per_s(c, rows) for c in out[reference]]
    summary = []
    for name, chunks in out.items():
        rates = [_chunk_rows_per_s(c, rows) for c in chunks]
        seconds = [max(s for s, _ in c) for c in chunks]
        switches = [sum(v for _, v in c) / len(c) for c in chunks]
        ratios = [r / b for r, b in zip(rates, base, strict=True)]
        summary.append(
            {
                "arm": name,
                "rows_per_s": rows * len(chunks) / sum(seconds),
                "median_chunk": statistics.median(rates),
                "ratio": statistics.median(ratios),
                "ratios": ratios,
                "switches_per_s": sum(switches) / sum(seconds),
            }
        )
    return summary


def table(summary: list[dict[str, Any]], reference: str) -> str:
    lines = [
        f"| arm | rows/s, all chunks | median chunk | median per-round ratio to {reference} "
        "| per-round ratios | voluntary switches/s per training thread |",
        "|---|---:|---:|---:|---|---:|",
    ]
    for r in summary:
        ratios = ", ".join(f"{x:.3f}" for x in r["ratios"])
        ratio = "1 (reference)" if r["arm"] == reference else f"**{r['ratio']:.3f}**"
        lines.append(
            f"| {r['arm']} | {r['rows_per_s']:,.0f} | {r['median_chunk']:,.0f} | {ratio} | "
            f"{ratios if r['arm'] != reference else '-'} | {r['switches_per_s']:.0f} |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_model_args(p)
    p.add_argument("--rounds", type=int, default=12, help="turns of every arm, per experiment")
    p.add_argument("--chunk", type=int, default=300, help="steps per arm per round")
    p.add_argument("--warmup-steps", type=int, default=100, help="untimed steps per pair first")
    p.add_argument(
        "--settle-s", type=float, default=10.0, help="wait after the idle cluster is ready"
    )
    p.add_argument(
        "--experiments",
        nargs="+",
        default=["hosts", "idle-cluster"],
        choices=["hosts", "idle-cluster", "niceness"],
    )
    p.add_argument("--doc", default=str(HERE.parent / "docs" / "benchmarks.md"))
    p.add_argument("--no-doc", action="store_true", help="print only")
    a = p.parse_args(argv)
    if a.gpu:
        p.error("ray_hosting runs CPU ranks only")
    if a.rounds < 1 or a.chunk < 1:
        p.error("--rounds and --chunk must be >= 1")
    return a


def run_hosts(a: argparse.Namespace, argv: list[str]) -> dict[str, list[list[Chunk]]]:
    return _pairs_take_turns(
        a,
        argv,
        lambda: {
            MAIN: ActorPair(argv, max_concurrency=1).run,
            THREADED: ActorPair(argv, max_concurrency=2).run,
        },
    )


def run_niceness(a: argparse.Namespace, argv: list[str]) -> dict[str, list[list[Chunk]]]:
    return _pairs_take_turns(
        a,
        argv,
        lambda: {
            NICE_15: ActorPair(argv, max_concurrency=3).run,
            NICE_0: ActorPair(argv, max_concurrency=3, nice=0).run,
        },
    )


def _pairs_take_turns(
    a: argparse.Namespace,
    argv: list[str],
    actor_pairs: Callable[[], dict[str, Callable[[int], list[Chunk]]]],
) -> dict[str, list[list[Chunk]]]:
    """The plain pair (the reference) and the pairs of Ray actors ``actor_pairs`` makes, all up
    at once on a local Ray cluster, taking turns."""
    import ray

    from raytrec.cluster import connect

    plain = PlainPair(argv)  # spawned before Ray starts, so they inherit none of its settings
    connect(None, num_cpus=2 * WORLD)
    try:
        pairs = {PLAIN: plain.run, **actor_pairs()}
        for run in pairs.values():
            run(a.warmup_steps)
        arms = {n: functools.partial(run, a.chunk) for n, run in pairs.items()}
        return take_turns(arms, a.rounds, a.chunk * a.batch_size * WORLD)
    finally:
        plain.close()
        ray.shutdown()


def run_idle_cluster(a: argparse.Namespace, argv: list[str]) -> dict[str, list[list[Chunk]]]:
    plain = PlainPair(argv)
    try:
        plain.run(a.warmup_steps)

        def with_cluster() -> list[Chunk]:
            with IdleCluster(a.settle_s):
                return plain.run(a.chunk)

        arms = {NO_CLUSTER: functools.partial(plain.run, a.chunk), IDLE_CLUSTER: with_cluster}
        return take_turns(arms, a.rounds, a.chunk * a.batch_size * WORLD)
    finally:
        plain.close()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"  # for every process started from here
    rows = a.chunk * a.batch_size * WORLD
    began = time.perf_counter()
    experiments = {
        "hosts": ("rounds of {chunk} steps per pair", run_hosts, PLAIN),
        "idle-cluster": ("rounds of {chunk} steps per arm", run_idle_cluster, NO_CLUSTER),
        "niceness": ("rounds of {chunk} steps per pair", run_niceness, PLAIN),
    }
    sections = {}
    for name in a.experiments:
        what, run, reference = experiments[name]
        print(f"{name}: {a.rounds} {what.format(chunk=a.chunk)}")
        sections[name] = table(summarize(run(a, model_argv(a)), reference, rows), reference)
        print(sections[name])
    wall_s = time.perf_counter() - began
    if not a.no_doc:
        replace_section(Path(a.doc), doc_section(a, argv, sections, wall_s), heading=SECTION)
        print(f"written to {a.doc}")
    return 0


def doc_section(
    a: argparse.Namespace, argv: Sequence[str], tables: dict[str, str], wall_s: float
) -> str:
    import ray
    import torch

    cmd = shlex.join(["./dev.sh", "bench", "ray_hosting", *argv])
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    parts = [
        f"""{SECTION}

Generated by `benchmarks/ray_hosting.py` on {date} (whole run {wall_s / 60:.1f} min;
{os.cpu_count()} CPU cores, Python {platform.python_version()}, torch {torch.__version__},
ray {ray.__version__}):

    {cmd}

The torchrun baseline's step (`_torchrun_dmp.BaselineWorker`: the throughput benchmark's
model, data and optimizers, T = {WORLD} gloo ranks, one torch thread each, batch
{a.batch_size} per rank) in different hosts, taking turns in chunks of {a.chunk} steps,
{a.rounds} rounds, so the machine's drift hits every arm alike. A chunk's rows/s is its rows
over the slower rank's seconds between two barriers."""
    ]
    if "hosts" in tables:
        parts.append(
            f"""Hosts, all up at once, one pair training at a time, with a local Ray cluster up
throughout:

{tables["hosts"]}"""
        )
    if "idle-cluster" in tables:
        parts.append(
            f"""The plain pair with and without an idle Ray cluster on the machine (started before
the chunk, {a.settle_s:.0f} s to settle, stopped after it; two idle rank-shaped actors and one
coordinator-shaped one):

{tables["idle-cluster"]}"""
        )
    if "niceness" in tables:
        parts.append(
            f"""Ray's nice value for its workers: plain processes (nice 0) against rank-shaped Ray
actors at Ray's nice 15 and set back to 0, all up at once, with a local Ray cluster up
throughout:

{tables["niceness"]}"""
        )
    return "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    sys.exit(main())
