"""Managed ids in a 2D job (docs/managed_ids.md): 2 gangs x 2 ranks train on ids that drift
(new raw ids every few steps, old ones gone), a rank is killed and a replacement gang heals in.

One run serves every assertion: the maps are the same on every rank after every merge (each
merge compares the ranks' lineages, a hash chained through every map the rank held, and stops
the job if they differ; the final state digests compare the maps with the dense state), the
replica check passes, every batch is trained once, a resume on another shape keeps the maps, and
the exported model scores raw ids as the trained model does with the training side's map.
"""

from __future__ import annotations

import pytest
import torch
from test_checkpoint_fit import tensors
from test_elastic_cluster import assert_every_batch_once, assert_replicas_agree

from raytrec.api import Result, fit
from raytrec.checkpoint.config import CheckpointConfig
from raytrec.config import (
    DataConfig,
    IdsConfig,
    ModelConfig,
    ScalingConfig,
    SyncConfig,
    TableConfig,
    TestingConfig,
    TrainConfig,
)
from raytrec.data.source import Batch
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.events import GangDropped, GangJoined
from raytrec.elastic.faults import FaultKind, FaultSpec
from raytrec.engine.managed_ids import FREE, ManagedIds
from raytrec.engine.managed_rows import fresh_rows
from raytrec.models import build_model as build_arch
from raytrec.result import replica_check
from raytrec.serving import export as serving
from raytrec.serving.model_spec import ModelSpec
from raytrec.serving.raw_ids import read_maps, split_maps
from simulation.drifting_ids import DriftingCriteo

# The module's run (a kill, a heal) takes about 2 minutes on a quiet 2-core machine, several on
# a loaded one: its time counts against the first test.
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

STEPS = 12
SOURCE = DriftingCriteo(num_dense=4, num_sparse=2, num_embeddings=40, seed=5, drift_every=3)


def config(tmp: str, *, workers: int, gang: int, steps: int, sync_every: int) -> TrainConfig:
    tables = tuple(
        TableConfig(
            name=f"t_cat_{i}",
            num_embeddings=40,
            embedding_dim=8,
            features=(f"cat_{i}",),
            ids=IdsConfig(policy="managed", budget=32, eviction=eviction),  # type: ignore[arg-type]
        )
        for i, eviction in enumerate(("lru", "lfu"))
    )
    return TrainConfig(
        model=ModelConfig(tables=tables, dense_arch_layers=(16, 8), over_arch_layers=(16, 1)),
        scaling=ScalingConfig(num_workers=workers, gang_size=gang),
        sync=SyncConfig(sync_every=sync_every),
        data=DataConfig(batch_size=16),
        checkpoint=CheckpointConfig(checkpoint_at_end=True),
        elastic=ElasticConfig(
            min_gangs=workers // gang,  # training waits for the replacement gang
            collective_timeout_s=10,
            step_timeout_s=30,
            resource_wait_s=240,
            poll_s=0.2,
        ),
        testing=TestingConfig(
            faults=(FaultSpec(kind=FaultKind.KILL_RANK, step=5, rank=1),) if workers == 4 else ()
        ),
        num_steps=steps,
        log_every=2,
        storage_path=tmp,
    )


@pytest.fixture(scope="module")
def run(local_ray: None, tmp_path_factory: pytest.TempPathFactory) -> Result:
    tmp = str(tmp_path_factory.mktemp("managed"))
    return fit(
        config(tmp, workers=4, gang=2, steps=STEPS, sync_every=2),
        source=SOURCE,
        shutdown_ray=False,
    )


def test_maps_agree_after_a_kill_and_a_heal(run: Result) -> None:
    assert run.steps == STEPS, run.events
    assert "rank_died" in run.events.kinds()
    # The kill is the only loss: a merge whose maps differed between ranks would have failed
    # the job's step and dropped a gang more.
    assert len(run.events.of(GangDropped)) == 1, run.events
    assert len(run.events.of(GangJoined)) == 1  # the replacement healed in
    assert run.history[-1].gangs == 2
    check = replica_check(run)
    assert check["passed"], check
    # The maps are part of the dense digest: one value on all four ranks.
    assert len({d["dense"] for d in run.state_digests.values()}) == 1
    assert len(run.state_digests) == 4


def test_every_batch_once(run: Result) -> None:
    assert_every_batch_once(run)
    assert_replicas_agree(run)
    assert run.replayed_batches  # the killed gang's uncommitted batches


def maps_of(uri: str) -> dict[str, torch.Tensor]:
    return {k: v for k, v in read_maps(uri).items()}


def test_the_maps_admit_and_evict_with_the_drift(run: Result) -> None:
    assert run.final_state_path is not None
    maps = maps_of(run.final_state_path)
    for table in ("t_cat_0", "t_cat_1"):
        assert int(maps[f"managed_ids.{table}.version"]) == STEPS  # merged at the last sync
        live = maps[f"managed_ids.{table}.sorted_raw_ids"]
        assert int((live != torch.iinfo(torch.int64).max).sum()) == 31  # budget 32, full
    # The last window's most popular raw ids are in the map; the first window's that the drift
    # replaced are gone (LRU evicts them as newer ids come).
    last = SOURCE.make_batch(0, STEPS - 1, 64).sparse_features.values()[:64]
    first = SOURCE.make_batch(0, 0, 64).sparse_features.values()[:64]
    held = set(maps["managed_ids.t_cat_0.sorted_raw_ids"].tolist())
    assert set(last.tolist()) & held
    assert set(first.tolist()) - held


def test_renewed_rows_start_fresh(run: Result) -> None:
    """The rows the last merge (at the last step, nothing trained after it) gave to new ids
    hold the fresh weights of that merge, and their Adagrad state is zero."""
    assert run.checkpoint is not None
    state = tensors(run.checkpoint.path)
    ebc = "sparse_arch.embedding_bag_collection.embedding_bags"
    renewed_rows = 0
    for table in ("t_cat_0", "t_cat_1"):
        weight = state[f"model.model.{ebc}.{table}.weight"]
        moment = state[f"embedding_optimizer.state.model.{ebc}.{table}.weight.{table}.momentum1"]
        fresh = fresh_rows(run.config.seed, table, STEPS, torch.arange(40), (40, 8))
        renewed = (weight == fresh).all(dim=1)
        renewed_rows += int(renewed.sum())
        assert bool((moment[renewed] == 0).all())
        assert not bool(renewed[31:].any())  # the default row and the rows past the budget
        live = state[f"managed_ids.{table}.rows"][
            state[f"managed_ids.{table}.sorted_raw_ids"] != torch.iinfo(torch.int64).max
        ]
        assert set(torch.nonzero(renewed).view(-1).tolist()) <= set(live.tolist())
    assert renewed_rows  # new ids came with the drift up to the last step


def test_a_resume_on_another_shape_keeps_the_maps(run: Result, tmp_path: str) -> None:
    assert run.checkpoint is not None
    saved = maps_of(run.checkpoint.path)
    # One gang of one rank (another shape and plan); no job-wide sync in its two steps, so no merge:
    # its final maps are the checkpoint's.
    # Through TorchRec's train pipeline this time: batches are mapped as the pipeline takes them.
    resumed_config = config(str(tmp_path), workers=1, gang=1, steps=STEPS + 2, sync_every=100)
    second = fit(
        resumed_config.replace(train_pipeline="sparse_dist"),
        source=SOURCE,
        resume_from_checkpoint=run.checkpoint,
        shutdown_ray=False,
    )
    assert second.steps == STEPS + 2
    assert second.final_state_path is not None
    resumed = maps_of(second.final_state_path)
    assert saved.keys() == resumed.keys() and saved
    for key, value in saved.items():
        assert torch.equal(value, resumed[key]), key
    assert replica_check(second)["passed"]


def test_load_model_scores_raw_ids_as_the_trained_model(run: Result, tmp_path: str) -> None:
    assert run.final_state_path is not None
    out = str(tmp_path / "export")
    serving.export(run.final_state_path, out, quiet=True)
    served = serving.load_model(out)
    program = serving.load_program(out)  # the torch.export program carries the maps too
    # Raw ids of the last window (mostly in the map) and of the first (mostly evicted: the
    # default row).
    rows = [SOURCE.make_batch(0, STEPS - 1, 32), SOURCE.make_batch(0, 0, 32)]
    # The training side: the engine's map (TorchRec's MCH remap), loaded from the final model,
    # then the plain model with the same weights.
    spec = ModelSpec.for_config(run.config, SOURCE.num_dense)
    ids = ManagedIds(spec.model)
    state = serving.read_unsharded_state(run.final_state_path)[0]
    for key, value in ids.named_state().items():
        value.copy_(read_maps(run.final_state_path)[f"managed_ids.{key}"])
    plain = build_arch(spec.model, spec.num_dense, torch.device("cpu"), seed=0)
    plain.load_state_dict(split_maps(state)[0], strict=True, assign=True)
    plain.eval()
    defaults = 0
    for batch in rows:
        mapped = ids.remap(batch.sparse_features, step=None)
        want = serving.score(plain, Batch(batch.dense_features, mapped, batch.labels))
        got = serving.score(served, batch)
        assert torch.equal(got, want)
        from_program = program(batch.dense_features, batch.sparse_features)
        assert torch.allclose(torch.sigmoid(from_program.reshape(-1).double()), want)
        defaults += int((mapped.values() == 31).sum())
    assert defaults  # some ids scored through the default row
    row_ids = ids.row_ids()["t_cat_0"]
    assert int(row_ids[31]) == FREE  # the default row holds no id
