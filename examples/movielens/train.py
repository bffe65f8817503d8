"""DeepFM on MovieLens-100k, end to end: Parquet splits, training on 2 gangs x 2 ranks with the
best checkpoint kept by validation AUC, that checkpoint evaluated once on the test split,
exported, loaded in one process without Ray and scoring test rows. See docs/movielens.md.

    ./dev.sh python examples/movielens/train.py --out data/ml-100k
    ./dev.sh python examples/movielens/train.py --out data/ml-100k --set sync.sync_every=4

``--set KEY=VALUE`` (repeatable) overrides a key of ``--config`` (default: ``deepfm.yaml`` beside
this script), as for ``python -m jobs.train``. The splits are written under ``--out`` unless
they are there already (``python -m jobs.movielens`` writes them alone).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from typing import Any

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deepfm.yaml")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/ml-100k", help="the splits, runs and the export")
    parser.add_argument("--config", default=CONFIG, help="the job's YAML config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    parser.add_argument("--source", help="a folder of the ml-100k files (default: the package)")
    parser.add_argument(
        "--no-test", action="store_true", help="tuning: evaluate on the validation split only"
    )
    args = parser.parse_args(argv)

    import pyarrow.parquet as pq

    import raytrec
    from raytrec.config import TrainConfig
    from raytrec.config.file import load_config
    from raytrec.data.movielens import SPLITS, write_ml100k_splits

    splits = {name: os.path.join(args.out, name) for name in SPLITS}
    if not all(os.path.isdir(p) for p in splits.values()):
        write_ml100k_splits(args.out, source=args.source)
    config: TrainConfig = load_config(
        args.config,
        [
            ("data.path", splits["train"]),
            ("eval.path", splits["validation"]),
            ("storage_path", os.path.join(args.out, "runs")),
            *args.overrides,
        ],
    )
    result = raytrec.fit(config)

    best = result.best_checkpoints[0]
    exported = raytrec.export(best.checkpoint, os.path.join(result.run_dir, "exported"))
    validation = raytrec.evaluate(exported.path, splits["validation"], quiet=True)
    summary: dict[str, Any] = {
        "overrides": args.overrides,
        "steps": result.config.num_steps,
        "best_step": best.step,
        "validation_auc": round(validation.auc, 4),
        "validation_log_loss": round(validation.log_loss, 4),
    }
    if args.no_test:
        print(f"[movielens] {json.dumps(summary)}")
        return {"result": result, "export": exported, **summary}
    test = raytrec.evaluate(exported.path, splits["test"], quiet=True)
    summary |= {"test_auc": round(test.auc, 4), "test_log_loss": round(test.log_loss, 4)}
    model = raytrec.load_model(exported.path)  # one process, no Ray
    rows = pq.read_table(splits["test"]).slice(0, 5)
    scores = raytrec.score(model, raytrec.make_batch(rows, exported.spec)[0]).tolist()
    print(f"[movielens] {json.dumps(summary)}")
    print(f"[movielens] scores of the first test rows: {[round(s, 4) for s in scores]}")
    return {"result": result, "export": exported, "scores": scores, **summary}


if __name__ == "__main__":
    main()
