"""The model published while a job trains: a 2 x 1 fit publishing every 4 of 12 steps writes a
base and deltas that, applied in order, equal bit for bit a full export of the final model; a
missing or repeated delta is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_serving import CONFIG, IDS

from raytrec.api import Result, fit
from raytrec.config import DataConfig, ModelConfig, ScalingConfig, TrainConfig, criteo_tables
from raytrec.config.train import PublishConfig
from raytrec.data.generate import write_synthetic_parquet
from raytrec.elastic.events import ModelPublished
from raytrec.serving.deltas import DELTAS, DeltaError
from raytrec.serving.export import STATE_FILE, export, load_exported, load_model

pytestmark = pytest.mark.cluster

#: Rows per table, far more than the data's ids (IDS): a sync and a delta carry the rows the
#: job touched only (the shards are over the whole-sync threshold, 2 MB).
ROWS = 20_000


@pytest.fixture(scope="module")
def run(local_ray: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    tmp = tmp_path_factory.mktemp("published")
    train = tmp / "train"
    write_synthetic_parquet(train, rows=1536, files=2, row_groups_per_file=2, num_embeddings=IDS)
    model = CONFIG.model.model_dump()
    model["tables"] = criteo_tables(num_features=4, num_embeddings=ROWS, embedding_dim=8)
    config = TrainConfig(
        model=ModelConfig(**model),
        scaling=ScalingConfig(num_workers=2, gang_size=1),
        data=DataConfig(source="parquet", path=str(train), batch_size=64),
        publish=PublishConfig(every_n_steps=4, dir=str(tmp / "serving")),
        num_steps=12,
        log_every=4,
        storage_path=str(tmp / "runs"),
    )
    result = fit(config, shutdown_ray=False)
    return {"result": result, "tmp": tmp, "serving": tmp / "serving"}


def test_base_and_deltas_equal_the_final_model_bit_for_bit(run: dict[str, object]) -> None:
    result, tmp, serving = run["result"], run["tmp"], run["serving"]
    assert isinstance(result, Result) and isinstance(tmp, Path) and isinstance(serving, Path)
    assert sorted(p.name for p in (serving / DELTAS).iterdir()) == ["000001", "000002"]
    steps = [json.loads((serving / DELTAS / n / "manifest.json").read_text())["step"] for n in
             ("000001", "000002")]  # fmt: skip
    assert steps == [8, 12]
    published = result.events.of(ModelPublished)
    assert [(e.step, e.delta) for e in published] == [(4, 0), (8, 1), (12, 2)]
    assert all(0 < e.rows <= 4 * IDS and e.stall_s > 0 for e in published[1:])
    print("stall per publish (s):", [round(e.stall_s, 3) for e in published])
    export(result, tmp / "full", program=False, quiet=True)
    expected = torch.load(tmp / "full" / STATE_FILE, weights_only=True)
    model, info = load_exported(serving)
    assert info.step == 12
    state = model.state_dict()
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key
    base = torch.load(serving / STATE_FILE, weights_only=True)
    tables = [k for k in expected if "embedding_bags" in k]
    assert len(tables) == 4 and all(expected[k].shape == (ROWS, 8) for k in tables)
    assert any(not torch.equal(base[k], expected[k]) for k in tables)  # it trained after 4
    # A delta holds the rows the job touched, not whole tables.
    rows = torch.load(serving / DELTAS / "000002" / "rows.pt", weights_only=True)
    assert rows and all(0 < t["ids"].numel() <= IDS for t in rows.values())


def test_a_missing_or_repeated_delta_is_refused(run: dict[str, object], tmp_path: Path) -> None:
    serving = run["serving"]
    assert isinstance(serving, Path)
    gap = tmp_path / "gap"
    shutil.copytree(serving, gap)
    shutil.rmtree(gap / DELTAS / "000001")
    with pytest.raises(DeltaError, match="delta 1 is missing"):
        load_model(gap)
    twice = tmp_path / "twice"
    shutil.copytree(serving, twice)
    shutil.copytree(twice / DELTAS / "000001", twice / DELTAS / "000003")
    with pytest.raises(DeltaError, match="delta 1 is published more than once"):
        load_model(twice)
