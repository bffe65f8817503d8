"""Write Criteo-shaped synthetic Parquet: ``python -m jobs.make_data --out DIR --rows N ...``.

The rows come from :class:`raytrec.data.synthetic.SyntheticCriteo`, with the teacher's click
probability in a ``click_prob`` column; the oracle AUC (``AUC(click_prob, label)``) is printed and
written to ``DIR/_meta.json``. See :mod:`raytrec.data.generate`.

With ``--days N``: drifting data instead (:mod:`raytrec.data.drifting`), raw 63-bit ids whose live
population turns over day by day, written as ``DIR/day=YYYY-MM-DD/part-*.parquet``.
"""

from __future__ import annotations

import argparse
import sys

from raytrec._quiet import quiet_known_warnings


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jobs.make_data", description=__doc__)
    p.add_argument("--out", required=True, help="output directory (created if missing)")
    p.add_argument("--rows", type=int, help="total rows (needed without --days)")
    p.add_argument("--files", type=int, default=1, help="Parquet files (per day with --days)")
    p.add_argument("--row-groups-per-file", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-embeddings", type=int, default=10_000, help="id range per feature")
    drift = p.add_argument_group("drifting data (with --days)")
    drift.add_argument("--days", type=int, help="write this many day partitions of drifting data")
    drift.add_argument("--first-day", type=int, default=0, help="the first day's number")
    drift.add_argument("--rows-per-day", type=int, default=100_000)
    drift.add_argument("--live-ids", type=int, default=1_000, help="live ids per feature")
    drift.add_argument(
        "--turnover", type=float, default=0.25, help="share of live ids replaced a day"
    )
    drift.add_argument("--features", type=int, default=8, help="sparse features")
    drift.add_argument("--start-date", default="2026-01-01", help="day 0's date (YYYY-MM-DD)")
    a = p.parse_args(argv)
    if a.days is None and a.rows is None:
        p.error("--rows is needed (or --days for drifting data)")
    quiet_known_warnings()
    from raytrec.data.drifting import DriftingTeacher, write_drifting_parquet
    from raytrec.data.generate import write_synthetic_parquet  # after the warning filters

    try:
        if a.days is not None:
            teacher = DriftingTeacher(
                num_sparse=a.features, live_ids=a.live_ids, turnover=a.turnover, seed=a.seed
            )
            drifting = write_drifting_parquet(
                a.out,
                teacher=teacher,
                days=a.days,
                first_day=a.first_day,
                rows_per_day=a.rows_per_day,
                files_per_day=a.files,
                row_groups_per_file=a.row_groups_per_file,
                start_date=a.start_date,
            )
            print(
                f"[raytrec] wrote {drifting.rows} rows in {a.days} day partitions under {a.out}; "
                f"{max(drifting.ids_seen):,} ids per feature at most; "
                f"oracle AUC {drifting.oracle_auc:.4f}"
            )
            return 0
        data = write_synthetic_parquet(
            a.out,
            rows=a.rows,
            files=a.files,
            row_groups_per_file=a.row_groups_per_file,
            seed=a.seed,
            num_embeddings=a.num_embeddings,
        )
    except ValueError as e:
        print(f"make_data: {e}", file=sys.stderr)
        return 2
    print(
        f"[raytrec] wrote {data.rows} rows to {len(data.paths)} files under {a.out}; "
        f"oracle AUC {data.oracle_auc:.4f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
