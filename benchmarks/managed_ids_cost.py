"""The cost of managed ids' remap per step, against the same step without it, in one process.

    .venv/bin/python -m benchmarks.managed_ids_cost [--tiny] [--write docs/managed_ids.md]

One rank's engine (gloo, one gang of one rank) of the model of ``benchmarks.managed_ids`` (a
DLRM, one managed table per feature) trains batches of the drifting data
(:mod:`raytrec.data.drifting`: raw 63-bit ids, in time order). Each repeat takes the next
batch and times, in an order that alternates between repeats (A B, then B A):

- **step with the remap**: ``RankEngine.train_step`` on the raw batch, the rank's real path
  (the managed tables observe the batch's ids and map them to rows, then forward, backward and
  the optimizers' step);
- **remap** then **step without it**: the same batch mapped by ``RankModel.remapped`` (what
  the step above runs first), timed alone, then ``train_step`` on the mapped batch with the
  engine's managed ids detached (forward, backward, update only).

Every ``--sync-every`` steps (``sync.sync_every``, where the job merges) the merge runs as the
engine runs it after a job-wide sync (``merge_ids``: the rank's observations coalesced and
applied, the renewed rows given fresh weights; one rank, so no collective) and is timed too,
counted per step as its time over ``--sync-every``. The machine's load changes the times of
the two sides alike within a repeat; the medians over the repeats and the median of the
per-repeat ratios are reported. What each figure counts: docs/managed_ids.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from benchmarks.common import md_table, parser, publish, rank_engine
from benchmarks.managed_ids import add_data_options, parse_tiny, teacher_of, variant_config
from raytrec.data.drifting import DriftingTeacher

#: Settings of --tiny: every code path in seconds (the test's), nothing measured.
TINY = {
    "batch_sizes": "32,48",
    "repeats": 6,
    "warmup": 2,
    "features": 2,
    "budget": 60,
    "live_ids": 40,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Timings:
    """One batch size's seconds per repeat (the same batch on every side of a repeat), and of
    each merge."""

    batch_size: int
    with_remap: list[float]
    remap: list[float]
    without: list[float]
    merge: list[float]


def batches(
    teacher: DriftingTeacher, batch_size: int, rows_per_day: int, seed: int
) -> Iterator[Batch]:
    """The drifting data's rows in time order, ``batch_size`` a batch, as the Parquet path
    delivers them to a managed table: one raw int64 id per feature and row."""
    rng = np.random.default_rng(seed)
    keys = list(teacher.sparse_features)
    start = 0
    while True:
        times = (start + np.arange(batch_size)) / rows_per_day
        dense, ids, labels, _ = teacher.rows(times, rng)
        start += batch_size
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=keys,
            values=torch.from_numpy(np.ascontiguousarray(ids.reshape(-1))),
            lengths=torch.ones(len(keys) * batch_size, dtype=torch.int32),
        )
        yield Batch(
            dense_features=torch.from_numpy(dense),
            sparse_features=kjt,
            labels=torch.from_numpy(labels),
        )


def _clock(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def measure(a: argparse.Namespace, engine: Any, batch_size: int) -> Timings:
    """Repeats of the two sides on ``engine`` at ``batch_size`` rows a batch."""
    from raytrec.engine.managed_rows import merge_ids

    model = engine.state  # the RankModel: its managed ids map the raw batches
    stepper = engine.parts.stepper
    plain = dataclasses.replace(model, ids=None)  # the same model, its managed ids detached
    source = batches(teacher_of(a), batch_size, a.rows_per_day, a.seed + batch_size)
    out = Timings(batch_size=batch_size, with_remap=[], remap=[], without=[], merge=[])

    def with_remap(batch: Batch) -> None:
        out.with_remap.append(_clock(lambda: engine.train_step(batch))[1])

    def without(batch: Batch) -> None:
        step = engine.step + 1
        mapped, took = _clock(lambda: model.remapped(batch, step))
        out.remap.append(took)
        stepper._model = plain
        try:
            out.without.append(_clock(lambda: engine.train_step(mapped))[1])
        finally:
            stepper._model = model

    for k in range(a.warmup + a.repeats):
        batch = next(source)
        sides = (with_remap, without) if k % 2 == 0 else (without, with_remap)
        for side in sides:
            side(batch)
            if engine.step % a.sync_every == 0:  # the job-wide sync's merge
                _, took = _clock(lambda: merge_ids(model, None, engine.step))
                out.merge.append(took)
        if k < a.warmup:  # start-up: dropped
            for xs in (out.with_remap, out.remap, out.without, out.merge):
                xs.clear()
    return out


def ms(x: float) -> str:
    return f"{1000 * x:.2f}"


def render(a: argparse.Namespace, results: Sequence[Timings]) -> list[str]:
    lines = [
        f"- Model: the benchmark's DLRM, {a.features} managed tables (one per feature) of "
        f"{a.budget:,} rows x dim {a.dim} (`eviction: {a.eviction}`), MLPs 64 wide, row-wise "
        f"Adagrad embeddings, Adagrad dense; one rank (gloo, CPU). Data: the drifting data "
        f"({a.live_ids:,} live ids per feature, {a.turnover:.0%} replaced a day, "
        f"{a.rows_per_day:,} rows a day), batches in time order.",
        f"- {a.repeats} repeats per batch size after {a.warmup} dropped, the two sides in "
        f"alternating order on the same batch; a merge every {a.sync_every} steps "
        f"({a.sync_every} = `sync.sync_every`), {sum(len(r.merge) for r in results)} timed.",
        "",
    ]
    table = []
    for r in results:
        merge = statistics.median(r.merge) if r.merge else 0.0
        per_step = statistics.median(r.remap) + merge / a.sync_every
        plain = statistics.median(r.without)
        ratios = [w / p for w, p in zip(r.with_remap, r.without, strict=True)]
        remap_ratios = [x / p for x, p in zip(r.remap, r.without, strict=True)]
        table.append(
            [
                f"{r.batch_size:,}",
                ms(plain),
                ms(statistics.median(r.with_remap)),
                ms(statistics.median(x + y for x, y in zip(r.remap, r.without, strict=True))),
                f"{statistics.median(ratios):.3f}",
                ms(statistics.median(r.remap)),
                f"{statistics.median(remap_ratios):.1%}",
                ms(merge) if r.merge else "-",
                ms(per_step),
                f"{per_step / plain:.1%}",
            ]
        )
    heads = (
        "rows a step | step without remap, ms | step with remap, ms | remap + step without, ms | "
        "with / without | "
        "remap, ms | remap / step without | merge, ms | remap + merge per step, ms | "
        "per step / step without"
    )
    lines.append(md_table(heads, table))
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__, "managed_ids_cost", "docs/managed_ids.md")
    p.add_argument("--batch-sizes", default="512,4096", help="comma-separated rows a step")
    p.add_argument("--repeats", type=int, default=400, help="timed repeats per batch size")
    p.add_argument("--warmup", type=int, default=10, help="repeats dropped first")
    p.add_argument("--sync-every", type=int, default=4, help="steps between merges")
    add_data_options(p)
    a = parse_tiny(p, argv, TINY)
    sizes = [int(x) for x in a.batch_sizes.split(",") if x]
    # The benchmark's managed job (its data paths are never read here).
    a.batch_size, a.log_every = max(sizes), 100
    config = variant_config(a, "managed", "-", "-", [], "-")
    config = config.replace(sync=config.sync.model_copy(update={"sync_every": a.sync_every}))
    num_dense = teacher_of(a).num_dense

    from raytrec.api import _plan
    from raytrec.models import build_dlrm

    engine, close = rank_engine(config, _plan(config, num_dense, build_dlrm), num_dense)
    try:
        results = [measure(a, engine, n) for n in sizes]
    finally:
        close()
    publish(
        a, "\n".join(render(a, results)), name="managed-ids-cost", heading="### Cost of the remap"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
