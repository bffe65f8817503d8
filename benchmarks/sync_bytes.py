"""Sync traffic: bytes and time of one replica sync, ``sync.rows: all`` against ``touched``,
measured on two gangs of one rank on gloo and modelled at production shapes; ``--crossover``:
a touched sync that never syncs whole (``touched, forced``) against ``all`` by table size.

    .venv/bin/python -m benchmarks.sync_bytes [--crossover] --write docs/benchmarks.md

What each figure counts: docs/benchmarks.md, "Sync traffic".
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

import torch

from benchmarks import common
from benchmarks.pipeline import MLPERF_ROWS
from raytrec import config as rc
from raytrec.engine import touched_rows
from raytrec.engine.rank_engine import RankSpec, StoreAddress
from raytrec.sync.traffic import expected_sync_bytes, touched_share
from simulation.gloo_job import engine_for, make_plan_for, run_gang_job, whole_sync_below

#: MLPerf DLRM-DCNv2's multi-hot sizes: ids per sample of each table, in MLPERF_ROWS' order.
MLPERF_HOT = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)
MODES = ("all", "touched")
#: ``touched`` with the whole-sync threshold at 0: the touched path at every size.
FORCED = "touched, forced"
NUM_DENSE = 4
#: Tables whose whole sync moves fewer bytes than this are timed ``--small-repeats`` times.
SMALL_BYTES = 16_000_000
#: One timed sync: (rows, share, repeat, mode, bytes one rank sent, seconds).
Result = tuple[int, float, int, str, int, float]


def job(rows: int, dim: int) -> rc.TrainConfig:
    table = rc.TableConfig(name="t0", num_embeddings=rows, embedding_dim=dim, features=("f0",))
    model = rc.ModelConfig(tables=(table,), dense_arch_layers=(8, dim), over_arch_layers=(4, 1))
    return rc.TrainConfig(
        model=model, optimizer=rc.OptimizerConfig(embedding="rowwise_adagrad"),
        scaling=rc.ScalingConfig(num_workers=2, gang_size=1),
        sync=rc.SyncConfig(rows="touched", sync_every=1),
    )  # fmt: skip


def measure_rank(spec: RankSpec, *, a: Any, stores: list[StoreAddress]) -> list[Result]:
    """Gang ``spec.gang`` (one rank): every table size in turn, each on an engine of its own."""
    results: list[Result] = []
    for rows, store in zip(a.rows, [spec.store, *stores], strict=True):
        cfg = job(rows, a.dim)
        plan = make_plan_for(cfg, NUM_DENSE)
        with engine_for(dataclasses.replace(spec, config=cfg, plan=plan, store=store)) as e:
            e.sync()  # the generation's first sync averages every row; from here sets are valid
            touched = e.state.touched
            assert touched is not None
            repeats = a.small_repeats if row_bytes(a.dim) * rows < SMALL_BYTES else a.repeats
            gen = torch.Generator().manual_seed(1000 * spec.rank + rows)
            for share in a.shares:
                for repeat in range(repeats):
                    # Each pair in a fresh order, so a slow spell of the machine hits every mode.
                    for mode in a.modes if repeat % 2 == 0 else a.modes[::-1]:
                        touched.mark(0, torch.randperm(rows, generator=gen)[: round(share * rows)])
                        kind = "all" if mode == "all" else "touched"
                        e.replicas.config = cfg.sync.model_copy(update={"rows": kind})
                        threshold = 0 if mode == FORCED else touched_rows.WHOLE_SYNC_BELOW_BYTES
                        e.replica.average_([torch.zeros(1)])  # type: ignore[union-attr]
                        with whole_sync_below(threshold):
                            took = common.timed(e.sync)[1]
                        sent = e.replicas.last_traffic.bytes_sent  # type: ignore[union-attr]
                        results.append((rows, share, repeat, mode, sent, took))
    return results


def row_bytes(dim: int) -> int:
    """fp32 weights and row-wise Adagrad's one fp32 per row."""
    return dim * 4 + 4


def measure(a: Any) -> list[Result]:
    """Both gangs' timed syncs; a sync ends when its slower rank is done: the larger time."""
    cfg = job(a.rows[0], a.dim)
    got = run_gang_job(
        measure_rank, num_gangs=2, gang_size=1, config=cfg, plan=make_plan_for(cfg, NUM_DENSE),
        num_dense=NUM_DENSE, timeout_s=3600, extra_stores=len(a.rows) - 1, a=a,
    )  # fmt: skip
    return [(*x[:5], max(x[5], y[5])) for x, y in zip(got[0], got[1], strict=True)]


def pick(results: Sequence[Result], rows: int, share: float, mode: str) -> list[Result]:
    return [r for r in results if r[0] == rows and r[1] == share and r[3] == mode]


def ms(results: Sequence[Result], spec: str) -> str:
    return common.spread([r[5] * 1e3 for r in results], spec, " ms")


def measured_table(a: Any, results: Sequence[Result]) -> str:
    heads = "rows x dim | touched per rank | bytes, all | bytes, touched | model | bytes ratio "
    heads += "| time, all | time, touched | time, all / touched (min to max) "
    heads += "| time, touched / all [95% CI]"
    lines = []
    for rows in a.rows:
        for share in a.shares:
            full, part = (pick(results, rows, share, m) for m in MODES)
            sent = [statistics.median(r[4] for r in x) for x in (full, part)]
            nbytes = row_bytes(a.dim)
            # Below the threshold a touched sync is a whole one.
            small = nbytes * rows < touched_rows.WHOLE_SYNC_BELOW_BYTES
            model = expected_sync_bytes(
                rows=rows, row_bytes=nbytes, members=2, share=None if small else share
            )
            ratios = [f[5] / t[5] for f, t in zip(full, part, strict=True)]
            spec = ".0f" if rows * nbytes >= SMALL_BYTES else ".2f"
            lines.append([
                f"{rows:,} x {a.dim}", f"{share:.0%}", f"{sent[0] / 1e6:.2f} MB",
                f"{sent[1] / 1e6:.3f} MB", f"{model / 1e6:.3f} MB", f"{sent[0] / sent[1]:.1f}x",
                ms(full, spec), ms(part, spec), common.spread(ratios, ".1f", "x"),
                common.ratio_ci([1 / r for r in ratios]),
            ])  # fmt: skip
    return common.md_table(heads, lines)


def crossover_table(a: Any, results: Sequence[Result]) -> str:
    """``touched, forced`` against ``all`` by size at one share; where touched starts to win."""
    heads = "rows x dim | bytes, whole sync | time, all | time, touched (forced) "
    heads += "| time, touched / all [95% CI]"
    lines, wins = [], []
    (share,) = a.shares
    for rows in a.rows:
        full, part = pick(results, rows, share, "all"), pick(results, rows, share, FORCED)
        ratios = [t[5] / f[5] for f, t in zip(full, part, strict=True)]
        nbytes = rows * row_bytes(a.dim)
        if common.bootstrap_median_ci(ratios)[1] < 1:
            wins.append(nbytes)
        row = [f"{rows:,} x {a.dim}", f"{nbytes / 1e6:.2f} MB", ms(full, ".2f"), ms(part, ".2f")]
        lines.append([*row, common.ratio_ci(ratios)])
    first = f"{min(wins) / 1e6:.2f} MB" if wins else "none of these sizes"
    return (
        common.md_table(heads, lines) + f"\n\nA forced touched sync at {share:.0%} of the rows "
        f"per rank is faster than the full average (the whole 95% interval below 1) from {first}; "
        f"the threshold in force (`WHOLE_SYNC_BELOW_BYTES`) is "
        f"{touched_rows.WHOLE_SYNC_BELOW_BYTES / 1e6:.1f} MB.\n"
    )


def production_table(gangs: int, gang_size: int, global_batch: int, periods: Sequence[int]) -> str:
    """Bytes per training step one GPU sends for syncs, every table row-wise sharded evenly."""
    lines = []
    for every in periods:
        full = part = 0.0
        for rows, hot in zip(MLPERF_ROWS, MLPERF_HOT, strict=True):
            shard = dict(rows=max(1, rows // gang_size), row_bytes=row_bytes(128), members=gangs)
            lookups = global_batch // gangs * every * hot  # one gang's, over the period
            full += expected_sync_bytes(**shard, share=None)
            part += expected_sync_bytes(**shard, share=touched_share(lookups, rows))
        lines.append([every, f"{full / every / 1e6:.1f}", f"{part / every / 1e6:.2f}"])
        lines[-1].append(f"{full / part:.1f}x")
    heads = "sync every | all: MB per step per GPU | touched: MB per step per GPU | ratio"
    return common.md_table(heads, lines)


def main(argv: Sequence[str] | None = None) -> None:
    p = common.parser(__doc__, "sync_bytes", "docs/benchmarks.md")
    p.add_argument("--rows", type=lambda x: list(map(int, x.split(","))), help="table sizes")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--shares", type=lambda x: list(map(float, x.split(","))))
    p.add_argument("--repeats", type=int, default=4, help="pairs per share and size")
    small = f"pairs per share and size for tables whose whole sync is under {SMALL_BYTES:,} bytes"
    p.add_argument("--small-repeats", type=int, default=40, help=small)
    cross = "time a touched sync that never syncs whole against all, by size, at 5%% touched"
    p.add_argument("--crossover", action="store_true", help=cross)
    a = common.parse(p, argv)
    if a.crossover:
        a.rows = a.rows or [1_000, 2_000, 4_000, 8_000, 16_000, 32_000, 64_000]
        a.shares, a.modes = a.shares or [0.05], ("all", FORCED)
        heading = "## Sync traffic: where touched rows start to pay"
        common.publish(a, crossover_table(a, measure(a)), name="sync_crossover", heading=heading)
        return
    a.rows = a.rows or [2_000, 6_000, 10_000, 250_000, 2_000_000]
    a.shares, a.modes = a.shares or [0.01, 0.05, 0.25, 1.0], MODES
    body = (
        f"{measured_table(a, measure(a))}\n\nModelled at production shapes (MLPerf DLRM-DCNv2 "
        "tables, dim 128, row-wise Adagrad, global batch 65,536; 1024 GPUs in 4 gangs of 256; "
        f"uniform ids):\n\n{production_table(4, 256, 65_536, (1, 8, 64, 512))}\n"
    )
    heading = "## Sync traffic: all rows against touched rows"
    common.publish(a, body, name="sync_bytes", heading=heading)


if __name__ == "__main__":
    main()
