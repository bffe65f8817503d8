"""benchmarks.managed_ids on its tiny settings, with ``fit`` replaced by a double that checks
what each variant would train on (no Ray, nothing timed): the oracle vocabulary gives every
training id a row, modulo folds at the budget (which the ids really overflow), both layouts are
accepted by today's Parquet reader, and the page gets one row per variant."""

from __future__ import annotations

import glob
import os
import pathlib
import types
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from benchmarks import managed_ids
from raytrec.config import TrainConfig
from raytrec.data.from_config import fit_vocabularies, parquet_spec
from raytrec.data.parquet import ParquetSource
from raytrec.observability.metrics import IntervalMetrics

AUC = {"oracle": 0.8, "modulo": 0.7, "managed": 0.79}


def _interval(step: int, eval_auc: float | None) -> IntervalMetrics:
    return IntervalMetrics(
        step=step, steps=5, loss=0.5, samples_per_s=1000.0, seconds=0.1, data_wait_fraction=0.0,
        sync_fraction=0.0, generation=0, gangs=1, elapsed_s=0.1 * step / 5, train_s=0.05,
        eval_auc=eval_auc,
    )  # fmt: skip


def _ids(root: str, feature: str) -> set[int]:
    files = sorted(glob.glob(os.path.join(root, "day=*", "*.parquet")))
    return set().union(
        *(pq.read_table(f).column(feature).combine_chunks().flatten().to_pylist() for f in files)
    )


def test_tiny_run_checks_each_variant_and_writes_the_table(tmp_path: pathlib.Path) -> None:
    seen: dict[str, TrainConfig] = {}
    folded: list[float] = []  # the share of held-out ids that share a row, folded at the budget

    def fit(config: TrainConfig, **kw: Any) -> Any:
        variant = config.name.removeprefix("managed-ids-")
        seen[variant] = config
        assert kw == {"shutdown_ray": False} and config.eval.path and config.data.path
        vocabularies = fit_vocabularies(config, config.data.path)
        spec = parquet_spec(config, vocabularies)
        for path in (config.data.path, config.eval.path):
            assert ParquetSource(paths=path, spec=spec).inspect()  # today's reader takes it
        if variant == "oracle":
            for table in config.model.tables:
                (feature,) = table.features
                ids = _ids(config.data.path, feature)
                assert {int(v) for v in vocabularies[feature]} == ids  # a row for every id
                assert table.num_embeddings == len(ids) + 1
        elif variant == "modulo":
            assert config.data.id_policy == "modulo" and not vocabularies
            for table in config.model.tables:
                assert table.num_embeddings == managed_ids.TINY["budget"]
                assert len(_ids(config.data.path, table.features[0])) > table.num_embeddings
            held_out = [sorted(_ids(config.eval.path, t.features[0])) for t in config.model.tables]
            budget = managed_ids.TINY["budget"]
            shares = [
                np.mean([sum(j % budget == i % budget for j in ids) > 1 for i in ids])
                for ids in held_out
            ]
            folded.append(float(np.mean(shares)))
        history = [_interval(5, None), _interval(10, None), _interval(15, AUC[variant])]
        return types.SimpleNamespace(history=history)

    page = tmp_path / "page.md"
    assert managed_ids.main(["--tiny", "--write", str(page)], fit=fit) == 0
    text = page.read_text()
    assert "## Measured" in text and "python -m benchmarks.managed_ids --tiny" in text
    assert {"oracle", "modulo"} <= set(seen)
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines()}
    # AUC, its share of the teacher's, against the oracle vocabulary, ms/step from train_s.
    assert (
        "| 0.8000 |" in rows["oracle vocabulary"]
        and "+0.00% | 10.00 | 1,000 | 15 |" in rows["oracle vocabulary"]
    )
    assert "| 60 | 0.7000 |" in rows["modulo"] and "-12.50% | 10.00 |" in rows["modulo"]
    if "managed" in seen:  # managed ids exist in this build
        assert "| 0.7900 |" in rows["managed"]
    else:
        assert "not available" in rows["managed"] and "unknown key" in text
    (share,) = folded
    assert f"Folded modulo 60: {share:.0%} of the held-out day's ids share their row" in text
    assert 0.2 < share < 0.9  # tiny sizes: live ids near the budget collide
