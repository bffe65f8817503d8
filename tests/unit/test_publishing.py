"""The coordinator's side of publishing (:mod:`actors.publishing`) against a fake job whose gang
of two ranks holds one model's tables cut by rows or by columns: the base, then deltas, applied
in order, equal the model bit for bit; a job that finds a base goes on with its sequence."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_serving import IDS, dlrm_state, save_final_model, trained_like_model
from torchrec.models.dlrm import DLRMTrain

from actors.publishing import JobPublishing, assemble_rows
from raytrec.config.train import PublishConfig
from raytrec.elastic.events import ModelPublished
from raytrec.engine.publish_rows import PublishedRows, ShardRows
from raytrec.serving.deltas import DELTAS, DeltaError
from raytrec.serving.export import load_exported


class FakeRank:
    """Rank ``index`` of 2: rows (``by="rows"``) or columns (``"cols"``) of every table."""

    def __init__(self, model: DLRMTrain, index: int, by: str) -> None:
        self.model, self.index, self.by = model, index, by
        self.changed: dict[str, set[int]] = {}

    def tables(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in dlrm_state(self.model).items() if "embedding_bags" in k}

    def unpublished_rows(self, dense: bool, every_row: bool = False) -> PublishedRows:
        shards = []
        for key, table in self.tables().items():
            half_rows, half_cols = table.shape[0] // 2, table.shape[1] // 2
            rows = range(table.shape[0])
            col0, cols = 0, table.shape[1]
            if self.by == "rows":
                rows = range(self.index * half_rows, (self.index + 1) * half_rows)
            else:
                col0, cols = self.index * half_cols, half_cols
            mine = set(rows) if every_row else self.changed.get(key, set()) & set(rows)
            ids = torch.tensor(sorted(mine), dtype=torch.int64)
            values = table[ids, col0 : col0 + cols].clone()
            shards.append(ShardRows(key=key, col_offset=col0, ids=ids, rows=values))
        state = {k: v.clone() for k, v in dlrm_state(self.model).items() if "embedding" not in k}
        return PublishedRows(shards=tuple(shards), dense=state if dense else {})

    def rows_published(self) -> None:
        self.changed = {}

    def save(self, path: str) -> None:
        if self.index == 0:
            save_final_model(self.model, Path(path))


def fake_job(ranks: list[FakeRank], step: list[int], events: list[Any]) -> Any:
    return SimpleNamespace(
        call=lambda rs, invoke: [invoke(ranks[r], r) for r in rs],
        sync=lambda: None,
        step=lambda: step[0],
        view=SimpleNamespace(membership=SimpleNamespace(gangs=[SimpleNamespace(job_ranks=(0, 1))])),
        live_ranks=lambda: [0, 1],
        clock=SimpleNamespace(monotonic=time.monotonic),
        record=events.append,
        now=lambda: 0.0,
    )


def train(model: DLRMTrain, ranks: list[FakeRank], seed: int) -> None:
    """Changes a few rows of every table (marked on both ranks) and every dense tensor."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, value in dlrm_state(model).items():
            if "embedding_bags" in key:
                ids = torch.randperm(value.shape[0], generator=g)[:5]
                value[ids] += torch.randn(5, value.shape[1], generator=g)
                for rank in ranks:
                    rank.changed.setdefault(key, set()).update(ids.tolist())
            else:
                value += 1.0


def assert_published_is(model: DLRMTrain, serving: Path, step: int) -> None:
    loaded, info = load_exported(serving)
    assert info.step == step
    expected = dlrm_state(model)
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, expected[key]), key


@pytest.mark.parametrize("by", ["rows", "cols"])
def test_base_then_deltas_equal_the_model_and_a_found_base_goes_on(tmp_path: Path, by: str) -> None:
    model = trained_like_model()
    ranks = [FakeRank(model, 0, by), FakeRank(model, 1, by)]
    step, events = [4], []
    job = fake_job(ranks, step, events)
    config = PublishConfig(every_n_steps=4, dir=str(tmp_path / "serving"))
    publishing = JobPublishing(job, config=config, run_dir=str(tmp_path))
    serving = tmp_path / "serving"
    assert publishing.due(4) and not publishing.due(3)
    publishing.publish()
    assert not (serving / DELTAS).exists() and not publishing.due(4)
    for s in (8, 12):
        train(model, ranks, seed=s)
        step[0] = s
        assert publishing.due(s)
        publishing.publish()
    publishing.finish()
    assert_published_is(model, serving, 12)
    assert [(e.step, e.delta, e.rows) for e in events if isinstance(e, ModelPublished)] == [
        (4, 0, 0),
        (8, 1, 4 * 5),
        (12, 2, 4 * 5),
    ]
    # A new coordinator (a resumed job) finds the base: the next delta, with every row.
    again = JobPublishing(job, config=config, run_dir=str(tmp_path))
    train(model, ranks, seed=16)
    step[0] = 16
    again.publish()
    again.finish()
    assert_published_is(model, serving, 16)
    rows = torch.load(serving / DELTAS / "000003" / "rows.pt", weights_only=True)
    assert all(t["ids"].tolist() == list(range(IDS)) for t in rows.values())


def test_a_row_without_all_its_columns_is_refused() -> None:
    ids = torch.tensor([1, 2])
    left = ShardRows(key="t", col_offset=0, ids=ids, rows=torch.zeros(2, 4))
    right = ShardRows(key="t", col_offset=4, ids=ids[:1], rows=torch.ones(1, 4))
    parts = [PublishedRows(shards=(left,), dense={}), PublishedRows(shards=(right,), dense={})]
    with pytest.raises(DeltaError, match=r"table t: rows \[2\] came without all their columns"):
        assemble_rows(parts)
    right = ShardRows(key="t", col_offset=4, ids=ids, rows=torch.ones(2, 4))
    parts[1] = PublishedRows(shards=(right,), dense={})
    got_ids, got_rows = assemble_rows(parts)["t"]
    assert got_ids.tolist() == [1, 2]
    assert torch.equal(got_rows, torch.cat([torch.zeros(2, 4), torch.ones(2, 4)], dim=1))
