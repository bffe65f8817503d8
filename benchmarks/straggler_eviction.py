"""Evicting a persistent straggler, measured on a local Ray cluster: one small job trained three
ways, with no straggler, with a persistent straggler left in place, and with the straggler
evicted and replaced (``elastic.straggler_eviction``).

    .venv/bin/python -m benchmarks.straggler_eviction [--steps 240] [--write docs/stragglers.md]

The straggler is injected (``testing.stragglers``, ``mode: persistent``): rank 1 (gang 1)
sleeps ``--stall-s`` before every step. A replacement gang gets new job ranks, so it does not
stall: it stands for a gang placed on a healthy host.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

from benchmarks.common import ROOT, dlrm, md_table, parse, parser, publish
from raytrec.elastic.config import ElasticConfig, StragglerEviction
from raytrec.sync.stragglers import StragglerSpec

#: 3 single-rank gangs of a tiny DLRM, local SGD every 4 steps with the dense parameters on the
#: schedule (the mode in which gangs run apart between syncs, so a gang's own step time shows).
GANGS, LOG_EVERY, BATCH_SIZE, CPUS_PER_RANK, SYNC_EVERY = 3, 16, 128, 0.25, 4
STRAGGLER_RANK = 1


def runs(a: argparse.Namespace) -> list[tuple[str, StragglerSpec | None, bool]]:
    """(label, the injected straggler, eviction on) of each run, in order."""
    slow = StragglerSpec(rate=1.0, stall_s=a.stall_s, mode="persistent", rank=STRAGGLER_RANK)
    return [
        ("no straggler", None, True),
        ("persistent straggler, not evicted", slow, False),
        ("persistent straggler, evicted", slow, True),
    ]


def train(a: argparse.Namespace, stragglers: StragglerSpec | None, evict: bool) -> Any:
    from raytrec import fit
    from raytrec.config import DataConfig, ScalingConfig, SyncConfig, TestingConfig, TrainConfig

    eviction = StragglerEviction(factor=a.factor, intervals=a.intervals) if evict else None
    config = TrainConfig(
        model=dlrm(8, 500, 8, width=32), data=DataConfig(batch_size=BATCH_SIZE),
        sync=SyncConfig(sync_every=SYNC_EVERY, dense="with_schedule"),
        scaling=ScalingConfig(num_workers=GANGS, gang_size=1, cpus_per_rank=CPUS_PER_RANK),
        elastic=ElasticConfig(straggler_eviction=eviction),
        testing=TestingConfig(stragglers=stragglers), num_steps=a.steps, log_every=LOG_EVERY,
        storage_path=str(ROOT / "runs" / "straggler_eviction"), name="straggler_eviction",
    )  # fmt: skip
    return fit(config, shutdown_ray=False, on_progress=lambda _m: None)


def measured(a: argparse.Namespace) -> str:
    from raytrec.cluster import connect
    from raytrec.elastic.events import GangJoined, GangRequested, StragglerEvicted

    # Room for a replacement gang next to the three.
    connect(num_cpus=(GANGS + 1) * CPUS_PER_RANK + (os.cpu_count() or 2))
    rows: list[list[str]] = []
    base: float | None = None
    for label, stragglers, evict in runs(a):
        r = train(a, stragglers, evict)
        if r.lost_batches or r.steps != a.steps:
            raise RuntimeError(f"{label}: {r.steps} steps, {r.lost_batches} batches lost")
        train_s = sum(m.seconds for m in r.history)
        base = train_s if base is None else base
        evicted = ", ".join(
            f"gang {e.gang_id} at step {e.step} ({e.step_s * 1e3:.0f} ms a step against "
            f"{e.others_s * 1e3:.0f} ms, {e.intervals} intervals)"
            for e in r.events.of(StragglerEvicted)
        )
        asked = [e.step for e in r.events.of(GangRequested)]
        joined = ", ".join(f"gang {e.gang_id} at step {e.step}" for e in r.events.of(GangJoined))
        if asked:
            joined = f"asked for at step {asked[0]}; " + (joined or "not built by the job's end")
        rows.append([label, "on" if evict else "off", f"{train_s:.1f} s", f"{train_s / base:.2f}x"])
        rate = r.committed_count * BATCH_SIZE / train_s
        rows[-1] += [f"{r.committed_count:,}", f"{rate:,.0f}", evicted or "none", joined or "none"]
        print(" | ".join(rows[-1]), flush=True)
    heads = "run | eviction | training time | vs no straggler | batches committed | rows/s"
    heads += " | evicted | replacement"
    return (
        f"{GANGS} gangs of 1 rank, {a.steps} steps of {BATCH_SIZE} rows per rank (synthetic "
        f"data), 8 tables x 500 rows x dim 8, local SGD every {SYNC_EVERY} steps with "
        f"dense='with_schedule', intervals of {LOG_EVERY} steps; the straggler: rank "
        f"{STRAGGLER_RANK} sleeps {a.stall_s:g} s before every step; eviction: "
        f"factor={a.factor:g}, intervals={a.intervals}. Training time: first step to last; every "
        "gang trains the job's steps, so a gang evicted trains fewer batches and rows/s compares "
        "the runs.\n\n" + md_table(heads, rows, left=2)
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__, "straggler_eviction", "docs/stragglers.md")
    p.add_argument("--steps", type=int, default=240, help="steps per run")
    p.add_argument("--stall-s", type=float, default=0.1, help="the straggler's sleep per step")
    p.add_argument("--factor", type=float, default=1.5, help="elastic.straggler_eviction.factor")
    p.add_argument("--intervals", type=int, default=3, help="...straggler_eviction.intervals")
    a = parse(p, argv)
    publish(a, measured(a), name="straggler_eviction")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
