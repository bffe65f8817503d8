"""``num_steps=None``: the job's length from ``data.epochs`` passes over the data (pure, and one
split of small Parquet files without Ray)."""

from __future__ import annotations

import math
import pathlib

import pytest

from raytrec.api import fit
from raytrec.config import DataConfig, TrainConfig
from raytrec.config.file import load_config, parse_override
from raytrec.data.from_config import generated_rows
from raytrec.data.generate import write_synthetic_parquet
from raytrec.data.length import data_steps, resolve_num_steps
from raytrec.data.parquet import ParquetShard, ParquetSource
from raytrec.data.spec import criteo_spec
from raytrec.data.synthetic import SyntheticCriteo
from raytrec.errors import ConfigError
from raytrec.observability.progress import ProgressReporter


def test_a_given_num_steps_wins_and_none_takes_the_datas_length() -> None:
    assert resolve_num_steps(50, 900, source="s") == 50
    assert resolve_num_steps(50, None, source="s") == 50  # an endless source with num_steps
    assert resolve_num_steps(None, 900, source="s") == 900
    with pytest.raises(ConfigError, match=r"SyntheticCriteo has no known end: set num_steps"):
        resolve_num_steps(None, None, source="SyntheticCriteo")


def test_the_data_steps_of_each_source(tmp_path: pathlib.Path) -> None:
    write_synthetic_parquet(
        tmp_path, rows=1000, files=2, row_groups_per_file=2, seed=1, num_embeddings=50
    )
    source = ParquetSource(paths=str(tmp_path), spec=criteo_spec(50), epochs=3)
    shards = source.split(4)  # 250 rows per rank per epoch: 4 batches of at most 64
    assert data_steps(shards, 64) == 3 * math.ceil(250 / 64) == 12
    assert data_steps(shards, 250) == 3
    # Streaming: every rank the same padded share of each epoch, cut into batches.
    streaming = ParquetShard(
        iterator=None,
        index=0,
        num_shards=3,
        spec=criteo_spec(50),
        epochs=2,
        on_bad_rows="error",
        prefetch_batches=1,
        rows_per_epoch=334,
    )
    assert data_steps([streaming], 100) == 2 * 4
    assert data_steps(SyntheticCriteo().split(2), 64) is None


def test_an_endless_source_is_refused_before_ray_starts(tmp_path: pathlib.Path) -> None:
    endless = TrainConfig(num_steps=None, storage_path=str(tmp_path))
    with pytest.raises(ConfigError, match=r"data.source='synthetic'.*set num_steps"):
        fit(endless)
    with pytest.raises(ConfigError, match=r"the source SyntheticCriteo has no known end"):
        fit(endless, source=SyntheticCriteo())


def test_generated_data_needs_its_size_without_num_steps() -> None:
    with pytest.raises(ConfigError, match=r"set data.generated_rows or num_steps"):
        TrainConfig(num_steps=None, data=DataConfig(source="generated"))
    sized = TrainConfig(num_steps=None, data=DataConfig(source="generated", generated_rows=5000))
    assert generated_rows(sized) == 5000
    # Sized from num_steps as before when generated_rows is None.
    by_steps = TrainConfig(num_steps=10, data=DataConfig(source="generated", epochs=2))
    assert generated_rows(by_steps) == 5 * 4 * 256
    with pytest.raises(ConfigError, match=r"data.generated_rows=0: must be greater than 0"):
        DataConfig(generated_rows=0)


def test_config_files_and_overrides_take_null(tmp_path: pathlib.Path) -> None:
    file = tmp_path / "job.yaml"
    file.write_text("num_steps: null\ndata: {source: parquet, path: /x, epochs: 3}\n")
    assert load_config(str(file)).num_steps is None
    assert load_config(None, [parse_override("num_steps=null")]).num_steps is None
    with pytest.raises(ConfigError, match=r"num_steps=0: must be greater than 0"):
        TrainConfig(num_steps=0)


def test_a_reporter_can_start_without_a_total() -> None:
    import io

    out = io.StringIO()
    reporter = ProgressReporter(None, console=out, tty=False, tensorboard=False, plot=False)
    reporter({"step": 10, "end_step": 40, "loss": 0.5})  # a row names the job's end step
    assert reporter.total_steps == 40 and "10/40" in out.getvalue()
