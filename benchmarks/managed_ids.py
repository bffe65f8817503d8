"""Managed ids against an oracle vocabulary and modulo folding, on a drifting planted teacher.

    .venv/bin/python -m benchmarks.managed_ids [--tiny] [--write docs/managed_ids.md]

The same model trains, one rank, in time order on the training days of drifting data (raw
63-bit ids, a live population that turns over; :mod:`raytrec.data.drifting`) and is scored on
the next day, held out, with its table rows given by: an oracle vocabulary with a row for
every id the training days hold; the ids folded modulo a row budget (``data.id_policy:
modulo``); and managed ids at the same budget (``tables[].ids.policy: managed``), which reads
"not available" where the config refuses the key. What each figure counts: docs/managed_ids.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import statistics
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from benchmarks.common import md_table, parse, parser, publish
from raytrec.config import ConfigError, TrainConfig
from raytrec.config.base import validate
from raytrec.data.drifting import DriftingData, DriftingTeacher, write_drifting_parquet

VARIANTS = ("oracle", "modulo", "managed")
LABELS = {"oracle": "oracle vocabulary", "modulo": "modulo", "managed": "managed"}
TARGET_GAP = 0.005  # managed ids' AUC within 0.5% of the oracle vocabulary's
#: Settings of --tiny: every code path in seconds (the test's), nothing measured.
TINY = {
    "days": 3,
    "rows_per_day": 3_000,
    "live_ids": 40,
    "budget": 60,
    "features": 2,
    "batch_size": 128,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Row:
    """One variant's outcome: its rows per table, test AUC and cost per step, or why none."""

    variant: str
    rows: str
    auc: float | None = None
    ms_per_step: float | None = None
    rows_per_s: float | None = None
    steps: int = 0
    why_not: str | None = None


def variant_config(
    a: argparse.Namespace, variant: str, train: str, test: str, ids_seen: Sequence[int], tmp: str
) -> TrainConfig:
    """The job of ``variant`` (raises ConfigError where the config refuses it)."""
    features = [f"cat_{i}" for i in range(a.features)]
    sizes = [n + 1 for n in ids_seen] if variant == "oracle" else [a.budget] * a.features
    tables: list[dict[str, Any]] = [
        {"name": f"t_{f}", "num_embeddings": n, "embedding_dim": a.dim, "features": [f]}
        for f, n in zip(features, sizes, strict=True)
    ]
    data: dict[str, Any] = {"source": "parquet", "path": train, "batch_size": a.batch_size}
    if variant == "oracle":
        # Every training id gets a row of its own (row 0: ids the training days never held).
        data["columns"] = {"categorical": dict.fromkeys(features, "vocabulary")}
    elif variant == "modulo":
        data["id_policy"] = "modulo"
    else:
        for t in tables:
            t["ids"] = {"policy": "managed", "budget": a.budget, "eviction": a.eviction}
    return validate(
        TrainConfig,
        {
            "model": {
                "arch": "dlrm",
                "tables": tables,
                "dense_arch_layers": [64, a.dim],
                "over_arch_layers": [64, 1],
            },
            "optimizer": {"embedding": "rowwise_adagrad", "dense": "adagrad"},
            "scaling": {"num_workers": 1, "gang_size": 1},
            "data": data,
            "eval": {"path": test},
            "log_every": a.log_every,
            "seed": a.seed,
            "storage_path": tmp,
            "name": f"managed-ids-{variant}",
        },
    )


def run_variant(
    a: argparse.Namespace,
    variant: str,
    train: str,
    test: str,
    ids_seen: Sequence[int],
    tmp: str,
    fit: Callable[..., Any],
) -> Row:
    """Trains ``variant`` and scores it on the held-out day."""
    rows = "every training id + 1" if variant == "oracle" else f"{a.budget:,}"
    try:
        config = variant_config(a, variant, train, test, ids_seen, tmp)
    except ConfigError as e:
        # The first clause names the refused key (the rest repeats it for every table).
        return Row(variant=variant, rows=rows, why_not=" ".join(str(e).split(";")[0].split()))
    if variant == "oracle":
        sizes = [t.num_embeddings for t in config.model.tables]
        rows = f"{min(sizes):,} to {max(sizes):,}"
    result = fit(config, shutdown_ray=False)
    history = result.history
    scored = [m.eval_auc for m in history if m.eval_auc is not None]
    if not scored:
        raise SystemExit(f"managed_ids: the {variant} run evaluated nothing")
    # Medians over the intervals after the first (start-up): a shared machine's load spikes
    # would dominate a total.
    timed = history[1:] or history
    per_step = [1000.0 * (m.seconds if m.train_s is None else m.train_s) / m.steps for m in timed]
    return Row(
        variant=variant,
        rows=rows,
        auc=scored[-1],
        ms_per_step=statistics.median(per_step),
        rows_per_s=statistics.median(m.samples_per_s for m in timed),
        steps=sum(m.steps for m in history),
    )


def collisions(train: str, test: str, features: int, budget: int) -> tuple[float, float, float]:
    """What folding modulo ``budget`` does to the data, averaged over features: ids of the
    training days per row of the budget; the share of the held-out day's ids that share their
    row with another id of that day; the share that share it with an id of the training days
    only (an id no longer live, whose row holds its weight)."""
    import pyarrow.parquet as pq

    def ids(root: str, f: int) -> np.ndarray:
        files = sorted(glob.glob(os.path.join(root, "day=*", "*.parquet")))
        parts = [pq.read_table(p, columns=[f"cat_{f}"]).column(0) for p in files]
        return np.unique(np.concatenate([c.combine_chunks().flatten().to_numpy() for c in parts]))

    per_row, live, stale = [], [], []
    for f in range(features):
        old, new = ids(train, f), ids(test, f)
        per_row.append(len(old) / budget)
        new_rows = new % budget
        live.append(float(np.mean(np.bincount(new_rows, minlength=budget)[new_rows] > 1)))
        gone = np.setdiff1d(old, new)
        stale.append(float(np.mean(np.isin(new_rows, gone % budget))))
    return statistics.fmean(per_row), statistics.fmean(live), statistics.fmean(stale)


def render(
    a: argparse.Namespace,
    rows: Sequence[Row],
    train_data: DriftingData,
    test_data: DriftingData,
    folding: tuple[float, float, float],
) -> list[str]:
    teacher = teacher_of(a)
    oracle_auc = test_data.oracle_auc
    reference = next((r.auc for r in rows if r.variant == "oracle" and r.auc is not None), None)
    seen = statistics.fmean(test_data.ids_seen)
    lines = [
        f"- Data: {a.features} sparse features (one raw 63-bit id each) and 13 dense; "
        f"{a.live_ids:,} live ids per feature at any time, {a.turnover:.0%} of them replaced "
        f"per day (each id lives {1 / a.turnover:g} days), slot popularity a power law "
        f"(alpha {teacher.zipf_alpha}); {a.rows_per_day:,} rows a day. Trained on days 1..{a.days} "
        f"({train_data.rows:,} rows, in time order, one pass), scored on day {a.days + 1} "
        f"({test_data.rows:,} rows, about {seen:,.0f} distinct ids per feature).",
        f"- Ids per feature in the training days: "
        f"{min(train_data.ids_seen):,} to {max(train_data.ids_seen):,} "
        f"({statistics.fmean(train_data.ids_seen) / a.live_ids:.1f}x the live ids, "
        f"{folding[0]:.1f}x the budget of {a.budget:,} rows).",
        f"- Folded modulo {a.budget:,}: {folding[1]:.0%} of the held-out day's ids share their "
        f"row with another id of that day, {folding[2]:.0%} with an id that no longer appears.",
        f"- Model: DLRM, one table per feature of dim {a.dim}, MLPs 64 wide; row-wise Adagrad "
        f"embeddings, Adagrad dense; one rank, {a.batch_size} rows a step. The teacher's AUC (its "
        f"own click probabilities on the held-out day) is {oracle_auc:.4f}.",
        "",
    ]
    table = []
    for r in rows:
        if r.auc is None:
            table.append([LABELS[r.variant], r.rows, "not available", "-", "-", "-", "-", "-"])
            continue
        gap = f"{(r.auc - reference) / reference:+.2%}" if reference else "-"
        table.append(
            [
                LABELS[r.variant],
                r.rows,
                f"{r.auc:.4f}",
                f"{r.auc / oracle_auc:.3f}",
                gap,
                f"{r.ms_per_step:.2f}",
                f"{r.rows_per_s:,.0f}",
                f"{r.steps:,}",
            ]
        )
    heads = (
        "ids | rows per table | held-out AUC | AUC / teacher | AUC vs oracle vocabulary | "
        "ms / step | rows/s | steps"
    )
    lines.append(md_table(heads, table, left=2))
    refused = [r for r in rows if r.why_not is not None]
    for r in refused:
        lines.append(
            f"\n`{r.variant}` ids are not available in this build: the config says: {r.why_not}"
        )
    return lines


def teacher_of(a: argparse.Namespace) -> DriftingTeacher:
    return DriftingTeacher(
        num_sparse=a.features, live_ids=a.live_ids, turnover=a.turnover, seed=a.seed
    )


def main(argv: Sequence[str] | None = None, *, fit: Callable[..., Any] | None = None) -> int:
    p = parser(__doc__, "managed_ids", "docs/managed_ids.md")
    p.add_argument("--days", type=int, default=12, help="training days (the next one is held out)")
    p.add_argument("--rows-per-day", type=int, default=100_000)
    p.add_argument("--live-ids", type=int, default=1_000, help="live ids per feature")
    p.add_argument("--turnover", type=float, default=0.25, help="share of live ids replaced a day")
    p.add_argument("--budget", type=int, default=1_500, help="rows per table (modulo, managed)")
    p.add_argument("--eviction", choices=("lru", "lfu"), default="lru", help="managed ids'")
    p.add_argument("--features", type=int, default=8, help="sparse features, one table each")
    p.add_argument("--dim", type=int, default=16, help="embedding dim")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--log-every", type=int, default=100, help="steps per metrics interval")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated, of " + "/".join(VARIANTS)
    )
    p.add_argument(
        "--tiny", action="store_true", help="tiny sizes: runs every path, measures nothing"
    )
    a = parse(p, argv)
    if a.tiny:
        for key, value in TINY.items():
            setattr(a, key, value)
        a.log_every = 5
    variants = [v for v in a.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        p.error(f"--variants: unknown {unknown}, choose from {list(VARIANTS)}")
    if fit is None:
        from raytrec.api import fit as train_fit  # Ray: only when a run trains
    else:
        train_fit = fit

    teacher = teacher_of(a)
    with tempfile.TemporaryDirectory(prefix="raytrec-managed-ids-") as tmp:
        train, test = os.path.join(tmp, "train"), os.path.join(tmp, "held_out")
        train_data = write_drifting_parquet(
            train, teacher=teacher, days=a.days, rows_per_day=a.rows_per_day
        )
        test_data = write_drifting_parquet(
            test, teacher=teacher, days=1, first_day=a.days, rows_per_day=a.rows_per_day
        )
        folding = collisions(train, test, a.features, a.budget)
        rows = [
            run_variant(a, v, train, test, train_data.ids_seen, tmp, train_fit) for v in variants
        ]
        import ray

        if ray.is_initialized():
            ray.shutdown()
    body = "\n".join(render(a, rows, train_data, test_data, folding))
    publish(a, body, name="managed-ids", heading="## Measured")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
