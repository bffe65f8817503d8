"""Write Criteo-shaped synthetic Parquet: ``python -m jobs.make_data --out DIR --rows N ...``.

The rows come from :class:`raytrec.data.synthetic.SyntheticCriteo`, with the teacher's click
probability in a ``click_prob`` column; the oracle AUC (``AUC(click_prob, label)``) is printed and
written to ``DIR/_meta.json``. See :mod:`raytrec.data.generate`.
"""

from __future__ import annotations

import argparse
import sys

from raytrec._quiet import quiet_known_warnings


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jobs.make_data", description=__doc__)
    p.add_argument("--out", required=True, help="output directory (created if missing)")
    p.add_argument("--rows", type=int, required=True, help="total rows")
    p.add_argument("--files", type=int, default=1, help="Parquet files")
    p.add_argument("--row-groups-per-file", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-embeddings", type=int, default=10_000, help="id range per feature")
    a = p.parse_args(argv)
    quiet_known_warnings()
    from raytrec.data.generate import write_synthetic_parquet  # after the warning filters

    try:
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
