"""Write MovieLens-100k as Parquet splits: ``python -m jobs.movielens --out DIR [--seed N]``.

Reads the ml-100k files shipped in RecBole's wheel (pinned in ``requirements/dev.lock``) from
the installed package's folder, or from ``--source DIR`` / ``$RAYTREC_ML100K_DIR``, and writes
``DIR/train``, ``DIR/validation`` and ``DIR/test``: a seeded random order of every rating cut
80/10/10, string ids and side features, ``label = rating >= 4``. See
:mod:`raytrec.data.movielens` and docs/movielens.md.
"""

from __future__ import annotations

import argparse
import sys

from raytrec.data.movielens import DEFAULT_SEED, write_ml100k_splits


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jobs.movielens", description=__doc__)
    p.add_argument("--out", required=True, help="output directory (created if missing)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="the split's random order")
    p.add_argument("--source", help="a folder of ml-100k.inter/.user/.item (default: the package)")
    a = p.parse_args(argv)
    try:
        splits = write_ml100k_splits(a.out, source=a.source, seed=a.seed)
    except FileNotFoundError as e:
        print(f"movielens: {e}", file=sys.stderr)
        return 2
    for name, path in splits.paths.items():
        share = splits.positive_share[name]
        print(f"[raytrec] {name}: {splits.rows[name]} rows ({share:.1%} positive) in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
