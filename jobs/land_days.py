"""Land day partitions of synthetic rows over time, for a growing source: ``python -m
jobs.land_days --root DIR --days N --rows-per-day R [--every-s S]``.

Writes the days at once under ``DIR/_staging`` (one teacher, ``row_id`` numbering the rows of
all days in order; the oracle AUC is printed), then moves them into place one at a time, as
``DIR/day=YYYY-MM-DD/part-0.parquet``, every ``--every-s`` seconds: each by a single rename, so a
job reading ``DIR`` with ``data.growing`` never sees a partial file. See
:mod:`raytrec.data.partitions`.
"""

from __future__ import annotations

import argparse
import sys
import time

from raytrec._quiet import quiet_known_warnings


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jobs.land_days", description=__doc__)
    p.add_argument("--root", required=True, help="the directory the job reads (data.path)")
    p.add_argument("--days", type=int, required=True, help="day partitions to land")
    p.add_argument("--rows-per-day", type=int, required=True)
    p.add_argument("--row-groups-per-day", type=int, default=2)
    p.add_argument("--every-s", type=float, default=30.0, help="seconds between two days")
    p.add_argument("--first-day", default="2026-11-27", help="the first partition's date")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-embeddings", type=int, default=10_000, help="id range per feature")
    a = p.parse_args(argv)
    quiet_known_warnings()
    from raytrec.data.partitions import stage_days  # after the warning filters

    try:
        lander, data = stage_days(
            a.root,
            days=a.days,
            rows_per_day=a.rows_per_day,
            row_groups_per_day=a.row_groups_per_day,
            seed=a.seed,
            num_embeddings=a.num_embeddings,
            first=a.first_day,
        )
    except ValueError as e:
        print(f"land_days: {e}", file=sys.stderr)
        return 2
    print(f"[raytrec] staged {a.days} days of {a.rows_per_day} rows; oracle AUC "
          f"{data.oracle_auc:.4f}", flush=True)  # fmt: skip
    for i in range(a.days):
        if i:
            time.sleep(a.every_s)
        print(f"[raytrec] landed {lander.land(i)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
