"""End to end on a local Ray cluster (127.0.0.1): the main job trains and its replicas agree."""

from __future__ import annotations

import os
import pathlib
import sys

import pytest
import ray
import torch
from ray import cloudpickle
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torchrec.models.dlrm import DLRMTrain
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from jobs.train import build_config
from raytrec.api import Result, TrainingStopped, fit
from raytrec.config import ConfigError, ModelConfig, TrainConfig
from raytrec.data.synthetic import SyntheticCriteo
from raytrec.models import embedding_bag_configs

pytestmark = pytest.mark.cluster


def assert_replicas_agree(result: Result) -> None:
    topo = result.config.scaling.topology()
    digests = result.state_digests
    assert sorted(digests) == list(range(topo.world_size))
    for members in topo.replica_groups:
        assert len({digests[r]["shards"] for r in members}) == 1
    # Different shards really differ, so the check above can fail.
    if topo.gang_size > 1:
        assert len({digests[g[0]]["shards"] for g in topo.replica_groups}) == topo.gang_size
    assert len({d["dense"] for d in digests.values()}) == 1


def checkpoint_keys(path: str) -> set[str]:
    return set(FileSystemReader(path).read_metadata().state_dict_metadata)


def test_main_job_loss_goes_down(local_ray: None, tmp_path: str) -> None:
    # The main job's own configuration, shortened; 30 steps is not a multiple
    # of sync_every=4, so the job has to end on an extra sync.
    config = build_config(["--steps", "30", "--log-every", "10", "--storage-path", str(tmp_path)])
    assert config.scaling.num_gangs == 2 and config.scaling.gang_size == 2
    result = fit(config, shutdown_ray=False)
    losses = [m.loss for m in result.history]
    assert [m.step for m in result.history] == [10, 20, 30]
    assert losses[-1] < losses[0] - 0.05, losses
    assert all(m.samples_per_s > 0 and m.gangs == 2 for m in result.history)
    # Progressive-validation AUC and NE of every interval, over all 4 ranks' rows: the model
    # ranks rows better than chance by the end, and predicts better than the base rate.
    assert all(m.auc is not None and m.ne is not None for m in result.history)
    first, last = result.history[0], result.history[-1]
    assert last.auc > max(0.55, first.auc) and last.ne < min(1.0, first.ne), result.history
    assert_replicas_agree(result)
    assert result.final_state_path is not None
    keys = checkpoint_keys(result.final_state_path)
    assert "model.sparse_arch.embedding_bag_collection.embedding_bags.t_cat_0.weight" in keys
    assert os.path.exists(os.path.join(result.run_dir, "metrics.json"))


def small_model() -> ModelConfig:
    from raytrec.config import criteo_tables

    return ModelConfig(
        arch="dlrm_dcn", tables=criteo_tables(num_features=4, num_embeddings=500), dcn_num_layers=1
    )


def test_dlrm_dcn_trains_with_column_wise_sharding(local_ray: None, tmp_path: str) -> None:
    from raytrec.config import ScalingConfig, ShardingConfig

    config = TrainConfig(
        model=small_model(),
        sharding=ShardingConfig(sharding_type="column_wise"),
        scaling=ScalingConfig(num_workers=4, gang_size=2),
        num_steps=12,
        log_every=6,
        storage_path=str(tmp_path),
    )
    result = fit(config, shutdown_ray=False)
    assert len(result.history) == 2
    assert_replicas_agree(result)
    assert result.final_state_path is not None
    assert any("inter_arch.crossnet" in k for k in checkpoint_keys(result.final_state_path))


class TinyRecModel(nn.Module):
    """A user model: sum-pooled embeddings and dense features into one linear layer."""

    def __init__(self, cfg: ModelConfig, num_dense: int, device: torch.device, seed: int) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=embedding_bag_configs(cfg), device=torch.device("meta")
        )
        torch.manual_seed(seed)
        width = num_dense + cfg.embedding_dim * len(cfg.tables)
        self.tiny_head = nn.Linear(width, 1, device=device)

    def forward(self, batch):  # type: ignore[no-untyped-def]
        pooled = self.ebc(batch.sparse_features).values()
        logits = self.tiny_head(torch.cat([batch.dense_features, pooled], dim=1)).squeeze(-1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach(), batch.labels)


@pytest.fixture(scope="module")
def user_model_run(
    local_ray: None, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Result, pathlib.Path]:
    """One job of a user's model class, its ranks at ``scaling.rank_niceness=3``, each
    writing its nice value to a file named by its process id (shared by the two tests below)."""
    from raytrec.config import ScalingConfig

    # Rank actors cannot import this test module; ship the factory by value,
    # as a notebook's classes are.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    tmp = tmp_path_factory.mktemp("user_model")
    seen = tmp / "nice"
    seen.mkdir()

    class NiceRecordingModel(TinyRecModel):
        def __init__(self, cfg: ModelConfig, num_dense: int, device: torch.device, seed: int):
            (seen / str(os.getpid())).write_text(str(os.getpriority(os.PRIO_PROCESS, 0)))
            super().__init__(cfg, num_dense, device, seed)

    config = TrainConfig(
        model=small_model(),
        scaling=ScalingConfig(num_workers=2, gang_size=1, rank_niceness=3),
        num_steps=8,
        log_every=4,
        storage_path=str(tmp),
    )
    return fit(config, model_factory=NiceRecordingModel, shutdown_ray=False), seen


def test_a_user_model_factory(user_model_run: tuple[Result, pathlib.Path]) -> None:
    result, _ = user_model_run
    assert_replicas_agree(result)
    assert result.final_state_path is not None
    keys = checkpoint_keys(result.final_state_path)
    assert {"tiny_head.weight", "tiny_head.bias", "ebc.embedding_bags.t_cat_0.weight"} <= keys
    assert not isinstance(TinyRecModel, DLRMTrain)


def test_rank_processes_run_at_the_configured_nice_value(
    user_model_run: tuple[Result, pathlib.Path],
) -> None:
    """Ray starts its workers 15 nicer than the raylet; ranks get ``scaling.rank_niceness``
    instead (as torchrun's workers run at the nice value they were started with)."""
    _, seen = user_model_run
    # The local cluster's raylet runs at this process's nice value; a rank adds 3 to it. (The
    # driver also builds the model once, to plan the sharding: its file is not a rank's.)
    expected = min(os.getpriority(os.PRIO_PROCESS, 0) + 3, 19)
    ranks = [int(f.read_text()) for f in seen.iterdir() if f.name != str(os.getpid())]
    assert ranks == [expected, expected]


def test_bad_configuration_fails_before_any_rank_starts(tmp_path: str) -> None:
    # A feature that no table serves: fails on the driver before Ray is touched.
    config = TrainConfig(model=small_model(), storage_path=str(tmp_path))
    source = SyntheticCriteo(num_sparse=5, num_embeddings=500)
    was_running = ray.is_initialized()
    with pytest.raises(ConfigError, match=r"sparse features \['cat_4'\] from the data source"):
        fit(config, source=source)
    assert ray.is_initialized() == was_running


def test_main_job_streams_parquet_through_ray_data(
    local_ray: None, tmp_path: str, capfd: pytest.CaptureFixture[str]
) -> None:
    import json

    from jobs.train import main
    from raytrec.data.generate import write_synthetic_parquet

    data = write_synthetic_parquet(
        os.path.join(tmp_path, "data"),
        rows=4096,
        files=2,
        row_groups_per_file=2,
        seed=1,
        num_embeddings=1000,
    )
    runs = os.path.join(tmp_path, "runs")
    # 2 ranks x 128 rows x 16 steps = one epoch of 4096 rows; the fixture's
    # 4 CPUs leave 2 for Ray Data's read and preprocessing tasks.
    argv = ["--data", os.path.dirname(data.paths[0]), "--num-workers", "2", "--gang-size", "1"]
    argv += ["--batch-size", "128", "--steps", "16", "--log-every", "8"]
    argv += ["--num-embeddings", "1000", "--storage-path", runs]
    assert main(argv) == 0
    terminal = capfd.readouterr()
    (run_dir,) = os.listdir(runs)
    # The terminal shows raytrec's lines; the ranks' Ray Data execution plans are in the run's
    # logs/ (and the torch warnings of the ranks and read tasks would be too).
    assert "[raytrec] done: 16 steps" in terminal.out, terminal.out
    for line in (terminal.out + terminal.err).splitlines():
        assert line.startswith("[raytrec]") or not line.strip(), line
    with open(os.path.join(runs, run_dir, "logs", "workers.log")) as f:
        workers = f.read()
    assert "(RankWorker pid=" in workers and "Execution plan of Dataset" in workers, workers
    with open(os.path.join(runs, run_dir, "metrics.json")) as f:
        history = json.load(f)
    assert [m["step"] for m in history] == [8, 16]
    assert history[-1]["loss"] < history[0]["loss"]
    # One more interval than the epoch holds: the ranks say their data ran out before it.
    from raytrec.config import DataConfig, ScalingConfig, criteo_tables

    config = TrainConfig(
        model=ModelConfig(tables=criteo_tables(num_embeddings=1000)),
        scaling=ScalingConfig(num_workers=2, gang_size=1),
        data=DataConfig(source="parquet", path=os.path.dirname(data.paths[0]), batch_size=128),
        num_steps=24,
        log_every=8,
        storage_path=runs,
    )
    with pytest.raises(TrainingStopped, match="data source ran out after 16 steps") as stop:
        fit(config, shutdown_ray=False)
    assert stop.value.result.steps == 16


def test_bad_input_stops_between_steps_and_keeps_what_was_trained(
    local_ray: None, tmp_path: str
) -> None:
    import json

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raytrec.config import DataConfig, ScalingConfig
    from raytrec.data.arrow_kjt import BadInputError
    from raytrec.data.generate import write_synthetic_parquet

    data_dir = os.path.join(tmp_path, "data")
    write_synthetic_parquet(
        data_dir, rows=8 * 512, files=8, row_groups_per_file=1, seed=3, num_embeddings=500
    )
    # A NaN in a dense column of the last file, row_id 4000.
    last = os.path.join(data_dir, "part-00007.parquet")
    table = pq.read_table(last)
    dense = table.column("dense_4").to_numpy().copy()
    row = 4000 - 7 * 512
    dense[row] = np.nan
    pq.write_table(
        table.set_column(table.schema.get_field_index("dense_4"), "dense_4", pa.array(dense)), last
    )

    config = TrainConfig(
        model=small_model(),
        scaling=ScalingConfig(num_workers=2, gang_size=1),
        data=DataConfig(source="parquet", path=data_dir, batch_size=64, prefetch_batches=0),
        num_steps=32,
        log_every=4,
        storage_path=os.path.join(tmp_path, "runs"),
    )
    with pytest.raises(TrainingStopped) as stop:
        fit(config, shutdown_ray=False)
    cause, result = stop.value.cause, stop.value.result
    assert isinstance(cause, BadInputError)
    assert (cause.reason, cause.column, cause.row_id) == ("nan", "dense_4", 4000)
    assert cause.file is not None and cause.file.endswith("part-00007.parquet")
    assert "part-00007.parquet" in str(stop.value) and "row_id 4000" in str(stop.value)
    assert f".\nTraining stopped after step {result.steps} of 32; the model trained so far" in str(
        stop.value
    )
    # Stopped between intervals, with what was trained before synced, checked and saved.
    assert result.steps < 32 and result.steps % 4 == 0
    assert [m.step for m in result.history] == list(range(4, result.steps + 1, 4))
    assert_replicas_agree(result)
    assert result.final_state_path is not None
    assert "tiny" not in checkpoint_keys(result.final_state_path)
    assert any(k.endswith("t_cat_0.weight") for k in checkpoint_keys(result.final_state_path))
    with open(os.path.join(result.run_dir, "metrics.json")) as f:
        assert len(json.load(f)) == len(result.history)
