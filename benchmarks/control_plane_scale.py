"""How the coordinator's decisions and CPU time grow with the number of ranks (no Ray).

    .venv/bin/python -m benchmarks.control_plane_scale --write docs/benchmarks.md

The real coordinator drives the fake worker group (:mod:`simulation.doubles.fake_group`) on its
manual clock through :func:`storm`; what each column counts: docs/benchmarks.md, "Control plane".
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import itertools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from unittest import mock

import actors.coordinator
import actors.growth
import actors.job_training
import actors.recovery
from benchmarks.common import md_table, parse, parser, publish
from raytrec.config import DataConfig, ScalingConfig, SyncConfig, TrainConfig
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.decisions import Drain, Reform, TotalLoss
from raytrec.elastic.drain_policy import request_drain
from simulation.doubles import fake_faults as ff
from simulation.doubles.fake_group import FakeWorkerGroup

SHAPES = ((1024, 4), (4096, 4), (1024, 16), (4096, 16))  # (ranks, gang size)
EVENTS = ("loss", "heartbeat check", "heal", "drain")


class TimedGroup(FakeWorkerGroup):
    """The fake group, noting (wall, CPU, the fake's CPU time) when the coordinator observes."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.failed_at: tuple[float, float, float] | None = None  # the first failed call
        self.progress_at = self.builds_at = self.draining_at = (0.0, 0.0, 0.0)

    def _now(self) -> tuple[float, float, float]:
        return time.perf_counter(), time.process_time(), self.cpu_s

    def result(self, future: Any) -> Any:
        try:
            return super().result(future)
        except Exception:
            if self.failed_at is None:
                self.failed_at = self._now()
            raise

    def progress(self, ranks: Any) -> dict[int, int]:
        out = super().progress(ranks)
        self.progress_at = self._now()
        return out

    def wait(self, futures: Any, *, num_returns: int, timeout: float) -> list[Any]:
        done = super().wait(futures, num_returns=num_returns, timeout=timeout)
        if timeout == 0 and futures and len(done) == len(futures):
            self.builds_at = self._now()  # a gang's builds, checked at a boundary
        return done

    def draining_nodes(self) -> set[str]:
        out = super().draining_nodes()
        self.draining_at = self._now()
        return out


@dataclasses.dataclass
class Run:
    ranks: int
    gang_size: int
    # Event -> decision times in ms (CPU time), the slowest in wall time; both less the fake's.
    decisions: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    slowest_wall_ms: float = 0.0
    interval_cpu_ms: list[float] = dataclasses.field(default_factory=list)
    cpu_s: float = 0.0  # the coordinator's, whole run
    events: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    # (CPU time, the fake's CPU time) at each history row: one per interval.
    rows: list[tuple[float, float]] = dataclasses.field(default_factory=list)

    def note(self, event: str, since: tuple[float, float, float], group: TimedGroup) -> None:
        wall, cpu, fake = since
        fake_s = group.cpu_s - fake
        self.decisions.setdefault(event, []).append(1e3 * (time.process_time() - cpu - fake_s))
        wall_ms = 1e3 * (time.perf_counter() - wall - fake_s)
        self.slowest_wall_ms = max(self.slowest_wall_ms, wall_ms)


def then(module: Any, name: str, after: Callable[[Any], None]) -> Any:
    """Patches ``module.name`` to call ``after`` with each value it returns."""
    inner = getattr(module, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        value = inner(*args, **kwargs)
        after(value)
        return value

    return mock.patch.object(module, name, timed)


@contextlib.contextmanager
def timed_decisions(run: Run, group: TimedGroup) -> Iterator[None]:
    """Wraps the pure decisions where the coordinator's loop and its parts call them."""

    def on_decide(value: Any) -> None:
        if any(isinstance(d, Reform | TotalLoss) for d in value):  # the loss decided
            if group.failed_at is not None:
                run.note("loss", group.failed_at, group)
            group.failed_at = None
        if any(isinstance(d, Drain) and d.gangs for d in value):
            run.note("drain", group.draining_at, group)

    def on_hung(value: Any) -> None:
        run.note("hang" if value else "heartbeat check", group.progress_at, group)

    def on_interval(_value: Any) -> None:
        run.rows.append((time.process_time(), group.cpu_s))

    with (
        then(actors.job_training, "decide", on_decide),
        then(actors.recovery, "find_hung_ranks", on_hung),
        then(actors.growth, "failed_heals", lambda _v: run.note("heal", group.builds_at, group)),
        then(actors.job_training, "aggregate_interval", on_interval),
    ):
        yield


def storm(g: int, run_dir: str) -> list[ff.Fault]:
    """The failures, heals and drains of one run (module doc); gang ``k`` is on node ``k``."""
    return [
        ff.RankDies(rank=1 * g + 1, step=5),
        ff.NodeDies(node=3, step=9),
        ff.RankHangs(rank=5 * g, step=13),
        ff.RankFails(rank=7 * g, step=17),
        ff.NodeDrains(node=9, step=21),
        ff.AtStep(step=25, action=lambda: request_drain(run_dir, gangs=1)),
        ff.RankDies(rank=11 * g + 2, step=29),
        ff.RankDies(rank=13 * g, on="recover"),
    ]


def run_one(ranks: int, g: int) -> Run:
    gangs = ranks // g
    run = Run(ranks=ranks, gang_size=g)
    # The last run's garbage is not this one's cost; what is alive now (the imported modules)
    # lives as long as the process, and full collections would scan it again and again.
    gc.collect()
    gc.freeze()
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = TrainConfig(
            scaling=ScalingConfig(num_workers=ranks, gang_size=g, ranks_per_host=g),
            data=DataConfig(batch_size=8), sync=SyncConfig(sync_every=4), num_steps=40,
            log_every=2, storage_path=run_dir, elastic=ElasticConfig(
                collective_timeout_s=10, step_timeout_s=30, poll_s=1, max_gangs=gangs
            ),
        )  # fmt: skip
        group = TimedGroup(nodes=gangs + 2, cpus_per_node=g, faults=storm(g, run_dir), build_s=0.5)
        # plan: only the ranks read it
        coordinator = actors.coordinator.Coordinator(
            cfg, plan=None, shards=[ff.FakeShard(i) for i in range(ranks)], num_dense=13,
            run_dir=run_dir, new_shard=ff.FakeShard, group=group, clock=group.clock,
        )  # fmt: skip
        cpu0 = time.process_time()
        with timed_decisions(run, group):
            summary = coordinator.run()
        run.cpu_s = time.process_time() - cpu0 - group.cpu_s
    pairs = itertools.pairwise(run.rows)
    run.interval_cpu_ms = [1e3 * ((c1 - c0) - (f1 - f0)) for (c0, f0), (c1, f1) in pairs]
    run.events.update(summary.events.kinds())
    assert summary.lost_batches == 0 and summary.steps >= 40
    return run


def ms(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} / {max(values):.1f}" if values else "-"


def grew(small: list[float] | None, big: list[float] | None) -> str:
    return f"{statistics.median(big) / statistics.median(small):.1f}x" if small and big else "-"


def table(runs: list[Run]) -> str:
    by, rows = {(r.ranks, r.gang_size): r for r in runs}, []
    for r in runs:
        rows.append([f"{r.ranks:,} ({r.ranks // r.gang_size} x {r.gang_size})"])
        rows[-1] += [ms(r.decisions.get(e, [])) for e in EVENTS]
        rows[-1] += [f"{r.slowest_wall_ms:.1f}", ms(r.interval_cpu_ms), f"{r.cpu_s:.2f} s"]
    for g in sorted({r.gang_size for r in runs}):
        small, big = by[(1024, g)], by[(4096, g)]
        rows.append([f"4,096 / 1,024 (gangs of {g})"])
        rows[-1] += [grew(small.decisions.get(e), big.decisions.get(e)) for e in EVENTS]
        rows[-1] += ["-", grew(small.interval_cpu_ms, big.interval_cpu_ms)]
        rows[-1] += [f"{big.cpu_s / small.cpu_s:.1f}x"]
    heads = ["ranks (gangs x ranks)", *EVENTS, "slowest decision, wall", "CPU per interval"]
    return md_table(" | ".join([*heads, "run CPU"]), rows)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse(parser(__doc__, "control_plane_scale", "docs/benchmarks.md"), argv)
    runs = []
    for ranks, g in SHAPES:
        runs.append(run := run_one(ranks, g))
        print(f"{ranks} ranks, gangs of {g}: coordinator CPU {run.cpu_s:.2f} s", flush=True)
    publish(a, table(runs), name="control-plane-scale", heading="## Control plane")
    return 0


if __name__ == "__main__":
    sys.exit(main())
