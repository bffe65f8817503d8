"""From your own Parquet columns to a model scoring new rows in one process.

The data here stands for a user's own click log: a string user id, a 1-based integer item id, a
list of string tags, two numeric columns, a 0/1 ``clicked`` column and no row id. Nothing is
renamed: ``data.columns`` maps the columns to the model's inputs, the user ids get a vocabulary
(fitted on the training files, saved with the model), the tags are hashed, and the item ids are
checked against their table (``id_policy="strict"``, the default). The job evaluates on held-out
files while it trains, keeps the best checkpoint by held-out AUC, and stops early when that AUC
stops improving; the best checkpoint is exported and scores new rows, an unseen user included,
in this process without Ray.

With ``--model deepfm`` the log has no numeric columns at all (only ids: string users, string
tags, integer items) and the model is a DeepFM (``columns.dense: []``), which needs none; DLRM
needs dense columns and refuses such data, naming DeepFM.

    ./dev.sh python examples/own_parquet.py --out /tmp/own_parquet
    ./dev.sh python examples/own_parquet.py --out /tmp/own_deepfm --model deepfm
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

USERS, ITEMS, TAGS = 300, 200, 40


def write_click_log(
    directory: str, *, rows: int, files: int, seed: int, dense: bool = True
) -> None:
    """A click log whose clicks follow a hidden per-user, per-item and per-tag taste (and age,
    with ``dense``: then it has ``age`` and ``price`` columns too)."""
    rng = np.random.default_rng(1234)  # the taste: the same for every split
    user_taste, item_taste, tag_taste = (rng.normal(0, 1.2, n) for n in (USERS, ITEMS, TAGS))
    rng = np.random.default_rng(seed)
    os.makedirs(directory, exist_ok=True)
    per_file = rows // files
    for k in range(files):
        users = rng.integers(0, USERS, per_file)
        items = rng.integers(1, ITEMS + 1, per_file)  # 1-based, as many catalogues are
        tags = [rng.choice(TAGS, size=rng.integers(0, 4), replace=False) for _ in users]
        age = rng.uniform(18, 70, per_file)
        price = rng.lognormal(2, 0.5, per_file)
        logit = (
            user_taste[users]
            + item_taste[items - 1]
            + np.array([tag_taste[t].sum() for t in tags])
            - (0.02 * (age - 40) if dense else 0.0)
        )
        clicked = (rng.random(per_file) < 1 / (1 + np.exp(-logit))).astype(np.int8)
        columns: dict[str, object] = {
            "user": [f"u{u}" for u in users],
            "item": items,
            "tags": [[f"tag-{t}" for t in ts] for ts in tags],
        }
        if dense:
            columns |= {"age": age, "price": price}
        table = pa.table({**columns, "clicked": clicked})
        pq.write_table(table, os.path.join(directory, f"part-{k}.parquet"), row_group_size=1024)


def config(out: str, *, steps: int, model: Literal["dlrm", "deepfm"] = "dlrm") -> object:
    """The job: ``model`` ``dlrm`` over ids and the two numeric columns, or ``deepfm`` over ids
    alone (no dense columns)."""
    from raytrec.checkpoint.config import CheckpointConfig
    from raytrec.config import (
        ColumnsConfig,
        DataConfig,
        EvalConfig,
        ModelConfig,
        ScalingConfig,
        TableConfig,
        TrainConfig,
    )

    return TrainConfig(
        model=ModelConfig(
            tables=(
                TableConfig(
                    name="t_users", num_embeddings=USERS + 1, embedding_dim=8, features=("user",)
                ),
                TableConfig(
                    name="t_items", num_embeddings=ITEMS + 1, embedding_dim=8, features=("item",)
                ),
                TableConfig(name="t_tags", num_embeddings=64, embedding_dim=8, features=("tags",)),
            ),
            arch=model,
            dense_arch_layers=(16, 8),
            over_arch_layers=(16, 1),
        ),
        scaling=ScalingConfig(num_workers=4, gang_size=2),
        data=DataConfig(
            source="parquet",
            path=os.path.join(out, "train"),
            batch_size=64,
            epochs=4,
            columns=ColumnsConfig(
                label="clicked",
                row_id=None,
                dense=("age", "price") if model == "dlrm" else (),
                categorical={"user": "vocabulary", "tags": "hash"},
            ),
        ),
        eval=EvalConfig(
            path=os.path.join(out, "held_out"), every_n_steps=10, early_stopping_patience=3
        ),
        checkpoint=CheckpointConfig(checkpoint_score_attribute="eval_auc", num_to_keep=1),
        num_steps=steps,
        log_every=10,
        storage_path=os.path.join(out, "runs"),
        name=f"own-parquet-{model}",
    )


def main(argv: Sequence[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/own_parquet", help="data, runs and the export")
    parser.add_argument("--rows", type=int, default=24_000, help="training rows")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument(
        "--model", choices=("dlrm", "deepfm"), default="dlrm", help="deepfm: no dense columns"
    )
    args = parser.parse_args(argv)
    dense = args.model == "dlrm"

    import raytrec
    from raytrec.serving.export import load_exported, score

    log = {"rows": args.rows, "files": 6, "seed": 1, "dense": dense}
    write_click_log(os.path.join(args.out, "train"), **log)
    log = {"rows": args.rows // 4, "files": 2, "seed": 2, "dense": dense}
    write_click_log(os.path.join(args.out, "held_out"), **log)
    job = config(args.out, steps=args.steps, model=args.model)
    result = raytrec.fit(job)  # type: ignore[arg-type]

    best = result.best_checkpoints[0]
    auc = best.metrics["eval_auc"]
    print(f"best checkpoint: {best.path}, step {best.step} (held-out AUC {auc:.4f})")
    if result.stopped_early:
        print(result.stopped_early)
    exported = raytrec.export(best.checkpoint, os.path.join(args.out, "exported"))
    model, info = load_exported(exported.path)  # one process, no Ray
    numbers = [{"age": 30.0, "price": 9.5}, {"age": 55.0, "price": 3.0}] if dense else [{}, {}]
    new_rows = [
        {"user": "u7", "item": 12, "tags": ["tag-3"], **numbers[0]},
        {"user": "someone-new", "item": 200, "tags": [], **numbers[1]},
    ]
    batch, _ = raytrec.make_batch(new_rows, info.spec)
    scores = score(model, batch).tolist()
    print(f"scores of two new rows (the second user is out of vocabulary): {scores}")
    return {"result": result, "export": exported, "scores": scores}


if __name__ == "__main__":
    main()
