"""The GPU path on one CUDA device: TorchRec's CUDA kernels under raytrec's engine, on NCCL.

Skipped without CUDA (CI has none); run on a GPU host with ``pytest -m gpu`` (see
docs/gpu.md for what was run where, and how). What one GPU can show:

* A step of the engine on ``cuda:0`` (FBGEMM's CUDA kernels, an NCCL gang world) computes
  what a plain single-process PyTorch model computes, step after step.
* Every fused embedding optimizer (SGD, Adagrad, row-wise Adagrad and Adam, which FBGEMM
  offers only on GPU) under every sharding type (table-wise, column-wise, and the row-wise
  kinds that TorchRec's planner offers only on GPU) trains, exposes the optimizer state the
  replica sync averages (Adam's two moments included), and goes through a sync on an NCCL
  replica plane (averaged and broadcast through NCCL on CUDA tensors).
* A checkpoint of a real GPU engine with Adam restores every tensor bit for bit.
* ``sync.rows: touched``'s premise on FBGEMM's CUDA kernels: every row whose weights or fused
  optimizer state a step changed is in the rank's touched set, for every fused optimizer and
  sharding type, UVM-cached and fp16 tables; and the touched-row average runs on CUDA tensors
  through NCCL (ids agreed by all-gather, as on NCCL it is).
* ``fit()`` runs GPU ranks as Ray actors (``num_gpus=1``) end to end.

What one GPU cannot show: an NCCL replica group of two or more members (NCCL refuses two
ranks on one device; the NCCL plane here has one member, so its average cannot change
anything), so averaging across replicas is exercised on CPU (gloo) with the same code by
tests/multiprocess/test_engine_2d.py and, for Adam-shaped state (dense Adam and AdamW moments
and step counts, FBGEMM's step counter), by tests/multiprocess/test_optimizer_matrix.py.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from test_engine_2d import BATCH, NUM_DENSE, SOURCE, ReferenceDLRM, job_config, max_diff
from torchrec.distributed.types import ShardingPlan

from raytrec.config import (
    ScalingConfig,
    TrainConfig,
)
from raytrec.data.source import Batch
from raytrec.engine.plan import apply_embedding_optimizer, make_plan
from raytrec.engine.rank_engine import RankEngine, RankSpec, StoreAddress
from raytrec.engine.replica_plane import ReplicaPlane
from raytrec.models import build_dlrm
from simulation.gloo_job import engine_for, run_gang_job, run_steps

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOL = 1e-5
STEPS = 3
OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")
SHARDINGS = ("table_wise", "column_wise", "row_wise", "table_row_wise")


def gpu_config(*, dense: str = "sgd", **kwargs: Any) -> TrainConfig:
    """test_engine_2d's job on one GPU rank (``kwargs`` as ``job_config`` takes them)."""
    kwargs.setdefault("embedding", "sgd")
    scaling = ScalingConfig(num_workers=1, gang_size=1, use_gpu=True)
    return job_config(dense=dense, sync_every=2, scaling=scaling, **kwargs)


def gpu_plan(config: TrainConfig) -> ShardingPlan:
    model = build_dlrm(config.model, NUM_DENSE, torch.device("cpu"), config.seed)
    apply_embedding_optimizer(model, config.optimizer)
    return make_plan(
        model,
        gang_size=1,
        device_type="cuda",
        sharding=config.sharding,
        tables=config.model.tables,
        batch_size=BATCH,
    )


def batches() -> Iterator[Batch]:
    return SOURCE.split(1)[0].batches(BATCH)


# -- rank side (a spawned process that owns cuda:0) ----------------------------------------


def host(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    return [t.detach().cpu().numpy().copy() for t in tensors]


def sharded_tables(engine: RankEngine) -> dict[str, Any]:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return {
        key.split(".")[-2]: value
        for key, value in engine.model.state_dict().items()
        if isinstance(value, ShardedTensor)
    }


def dense_arrays(engine: RankEngine) -> dict[str, np.ndarray]:
    return {n: p.detach().cpu().numpy().copy() for n, p in engine.dense_params.items()}


def full_tables(engine: RankEngine) -> dict[str, np.ndarray]:
    """The rank's tables (it holds every shard: a gang of one)."""
    out = {}
    for name, st in sharded_tables(engine).items():
        table = np.full(tuple(st.size()), np.nan, dtype=np.float32)
        for shard in st.local_shards():
            (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            table[r0 : r0 + nr, c0 : c0 + nc] = shard.tensor.detach().cpu().numpy()
        assert not np.isnan(table).any(), name
        out[name] = table
    return out


def parity_run(
    spec: RankSpec, tables: dict[str, np.ndarray], dense_init: dict[str, np.ndarray]
) -> dict[str, Any]:
    with engine_for(spec) as engine:
        with torch.no_grad():
            # Dense layers initialised on the GPU draw from CUDA's generator: start from the
            # reference's (CPU) values instead.
            assert engine.dense_params.keys() == dense_init.keys()
            for name, p in engine.dense_params.items():
                p.copy_(torch.from_numpy(dense_init[name]))
            for name, st in sharded_tables(engine).items():
                for shard in st.local_shards():
                    assert shard.tensor.is_cuda, name
                    (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                    values = torch.from_numpy(tables[name][r0 : r0 + nr, c0 : c0 + nc])
                    shard.tensor.copy_(values)
        dense = [dense_arrays(engine)]
        got = [full_tables(engine)]
        source = batches()
        losses = []
        for _ in range(STEPS):
            losses.append(float(engine.train_step(next(source)).loss))
            engine.sync()
            dense.append(
                {n: p.detach().cpu().numpy().copy() for n, p in engine.dense_params.items()}
            )
            got.append(full_tables(engine))
        return {"losses": losses, "dense": dense, "tables": got}


def nccl_plane(spec: RankSpec) -> ReplicaPlane:
    store = dist.TCPStore(spec.store.host, spec.store.port, is_master=False)
    opts = dist.ProcessGroupNCCL.Options()
    pg = dist.ProcessGroupNCCL(dist.PrefixStore("test-plane", store), 0, 1, opts)
    return ReplicaPlane(generation=0, replica_group=0, rank=0, size=1, pg=pg, backend="nccl")


def variant_run(spec: RankSpec) -> dict[str, Any]:
    """Trains two steps (the second syncs), then checks the state the sync covers."""
    with engine_for(spec) as engine:
        init_states = host(engine.embedding_optimizer_states())
        losses = run_steps(engine, batches(), 2)  # sync_every=2: the second step syncs on NCCL
        weights, states = engine.embedding_weights(), engine.embedding_optimizer_states()
        before = host(weights + states)
        # A job-wide plane of one member skips the collective; build one on NCCL anyway, so
        # the averaging and broadcast code runs on CUDA tensors through NCCL.
        assert engine.replica is not None and engine.replica.pg is None
        nccl = nccl_plane(spec)
        nccl.average_(weights + states)
        nccl.broadcast_(weights + states, src=0)
        after = host(engine.embedding_weights() + engine.embedding_optimizer_states())
        return {
            "losses": losses,
            # FBGEMM's step counters where the optimizer reads them (fused Adam): one step each.
            "counters": [int(c.item()) for c in engine.embedding_step_counters()],
            "weight_shapes": [tuple(w.shape) for w in weights],
            "state_shapes": [tuple(s.shape) for s in states],
            "devices": sorted({str(t.device) for t in weights + states}),
            "states_moved": [
                bool(np.abs(a - b).max() > 0)
                for a, b in zip(init_states, host(states), strict=True)
            ],
            "sync_kept": all(np.array_equal(a, b) for a, b in zip(before, after, strict=True)),
            "backend": dist.get_backend(),
        }


def touched_run(spec: RankSpec) -> dict[str, Any]:
    """Steps with ``sync.rows: touched`` and a one-member plane (whose sync is skipped, so the
    touched sets keep growing): the rows each step changed, against the rows the engine
    recorded; then the touched-row average over a one-member NCCL plane."""
    from raytrec.engine.touched_rows import average_rows

    with engine_for(spec) as engine:
        touched = engine.state.touched
        assert touched is not None
        source = batches()
        missed, changed = 0, 0
        run_steps(engine, source, 1)  # Adam's moments exist from here on
        for _ in range(3):
            before = [host(list(shard)) for shard in engine.state.table_shards()]
            run_steps(engine, source, 1)
            after = [host(list(shard)) for shard in engine.state.table_shards()]
            for k, (old, new) in enumerate(zip(before, after, strict=True)):
                rows = np.zeros(old[0].shape[0], dtype=bool)
                for a, b in zip(old, new, strict=True):
                    rows |= (a != b).reshape(a.shape[0], -1).any(1)
                seen = np.zeros_like(rows)
                seen[touched.rows(k, 0, optimizer_state=True).cpu().numpy()] = True
                missed += int((rows & ~seen).sum())
                changed += int(rows.sum())
        state = [t for shard in engine.state.table_shards() for t in shard]
        kept = host(state)
        ids = [touched.rows(k, 0, optimizer_state=True) for k in touched.shards]
        traffic = average_rows(nccl_plane(spec), engine.state.table_shards(), ids, max_share=1.0)
        return {
            "missed": missed,
            "changed": changed,
            "rows": sum(w.shape[0] for w in engine.embedding_weights()),
            "averaged": traffic.rows,
            "touched": sum(int(i.numel()) for i in ids),
            "kept": all(np.array_equal(a, b) for a, b in zip(kept, host(state), strict=True)),
        }


def checkpoint_run(spec: RankSpec, root: str) -> dict[str, Any]:
    from raytrec.checkpoint.state import load_checkpoint, save_checkpoint

    with engine_for(spec) as engine:
        source = batches()
        run_steps(engine, source, 2)
        # Weights, fused state and fused Adam's step counters.
        saved = host(engine.shard_state())
        saved_dense = host(engine.dense_state())
        ref = save_checkpoint(engine, root, generation=0, extra={"step": engine.step})
        run_steps(engine, source, 2)  # move everything away from the saved state
        moved = host(engine.shard_state())
        loaded = load_checkpoint(engine, ref)
        back = host(engine.shard_state())
        back_dense = host(engine.dense_state())
        same = [np.array_equal(a, b) for a, b in zip(saved, back, strict=True)]
        return {
            "same": same,
            "dense_same": [
                np.array_equal(a, b) for a, b in zip(saved_dense, back_dense, strict=True)
            ],
            "moved": [not np.array_equal(a, b) for a, b in zip(saved, moved, strict=True)],
            "step": (loaded.step, engine.step),
        }


def gpu_worker(
    spec: RankSpec,
    *,
    tables: dict[str, np.ndarray],
    dense_init: dict[str, np.ndarray],
    variants: list[tuple[str, TrainConfig, ShardingPlan]],
    touched: list[tuple[str, TrainConfig, ShardingPlan]],
    stores: list[StoreAddress],
    checkpoint_dir: str,
) -> dict[str, Any]:
    out: dict[str, Any] = {"parity": parity_run(spec, tables, dense_init), "variants": {}}
    for (name, config, plan), store in zip(variants, stores, strict=False):
        variant_spec = dataclasses.replace(spec, config=config, plan=plan, store=store)
        out["variants"][name] = variant_run(variant_spec)
    out["touched"] = {}
    for (name, config, plan), store in zip(touched, stores[len(variants) :], strict=False):
        touched_spec = dataclasses.replace(spec, config=config, plan=plan, store=store)
        out["touched"][name] = touched_run(touched_spec)
    adam_name = "adam-row_wise"
    config, plan = next((c, p) for n, c, p in variants if n == adam_name)
    ckpt_spec = dataclasses.replace(spec, config=config, plan=plan, store=stores[-1])
    out["checkpoint"] = checkpoint_run(ckpt_spec, checkpoint_dir)
    return out


# -- the job: one spawned GPU rank runs everything --------------------------------------------


PARITY_CONFIG = gpu_config(embedding_lr=1.0, dense_lr=0.5)


def variant_config(embedding: str, sharding: str) -> TrainConfig:
    # Column-wise shards are cut in blocks of 128 columns: dim 256 gives two shards.
    dim = 256 if sharding == "column_wise" else 8
    return gpu_config(embedding=embedding, sharding=sharding, dim=dim, dense="adam")


VARIANTS = {f"{o}-{s}": variant_config(o, s) for o in OPTIMIZERS for s in SHARDINGS}


def touched_config(embedding: str, sharding: str, kernel: str, precision: str) -> TrainConfig:
    base = variant_config(embedding, sharding)
    # Tables far larger than the ids the batches hold, so most rows stay untouched.
    table: dict[str, Any] = {
        "compute_kernel": kernel,
        "precision": precision,
        "num_embeddings": 1000,
    }
    if kernel == "fused_uvm_caching":
        table["cache_load_factor"] = 0.2
    tables = tuple(t.model_copy(update=table) for t in base.model.tables)
    return base.model_copy(
        update={
            "model": base.model.model_copy(update={"tables": tables}),
            "sync": base.sync.model_copy(update={"rows": "touched"}),
        }
    )


TOUCHED = {
    f"{o}-{s}-fused-fp32": touched_config(o, s, "fused", "fp32")
    for o in OPTIMIZERS
    for s in SHARDINGS
} | {
    "rowwise_adagrad-table_wise-fused_uvm_caching-fp32": touched_config(
        "rowwise_adagrad", "table_wise", "fused_uvm_caching", "fp32"
    ),
    "adam-row_wise-fused_uvm_caching-fp32": touched_config(
        "adam", "row_wise", "fused_uvm_caching", "fp32"
    ),
    "adam-row_wise-fused_uvm-fp32": touched_config("adam", "row_wise", "fused_uvm", "fp32"),
    "rowwise_adagrad-table_wise-fused-fp16": touched_config(
        "rowwise_adagrad", "table_wise", "fused", "fp16"
    ),
    "rowwise_adagrad-column_wise-fused_uvm_caching-fp16": touched_config(
        "rowwise_adagrad", "column_wise", "fused_uvm_caching", "fp16"
    ),
}


@pytest.fixture(scope="module")
def job() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(11)
    init = {
        t.name: (0.5 * torch.randn((t.num_embeddings, t.embedding_dim), generator=gen)).numpy()
        for t in PARITY_CONFIG.model.tables
    }
    variants = [(name, config, gpu_plan(config)) for name, config in VARIANTS.items()]
    touched = [(name, config, gpu_plan(config)) for name, config in TOUCHED.items()]
    with tempfile.TemporaryDirectory() as root:
        results = run_gang_job(
            gpu_worker,
            num_gangs=1,
            gang_size=1,
            config=PARITY_CONFIG,
            plan=gpu_plan(PARITY_CONFIG),
            num_dense=NUM_DENSE,
            timeout_s=600.0,
            extra_stores=len(variants) + len(touched) + 1,
            tables=init,
            dense_init={
                n: p.detach().numpy().copy()
                for n, p in ReferenceDLRM(PARITY_CONFIG, init).dense_named().items()
            },
            variants=variants,
            touched=touched,
            checkpoint_dir=root,
        )
    plans = dict((n, p) for n, _, p in variants + touched)
    return {"init": init, "result": results[0], "plans": plans}


def test_gpu_step_matches_single_process_reference(job: dict[str, Any]) -> None:
    """SGD on ``cuda:0`` (FBGEMM's CUDA kernels) against nn.EmbeddingBag on the CPU."""
    run = job["result"]["parity"]
    ref = ReferenceDLRM(PARITY_CONFIG, job["init"])
    assert max(max_diff(run["tables"][0], job["init"]).values()) == 0.0
    ref_dense0 = {n: p.detach().numpy().copy() for n, p in ref.dense_named().items()}
    assert max(max_diff(run["dense"][0], ref_dense0).values()) == 0.0
    source = batches()
    for step in range(1, STEPS + 1):
        ref_loss = ref.sgd_step([next(source)], embedding_lr=1.0, dense_lr=0.5, embedding_scale=1.0)
        assert abs(run["losses"][step - 1] - ref_loss[0]) <= TOL, step
        diff = max_diff(run["tables"][step], ref.tables())
        assert max(diff.values()) <= TOL, (step, diff)
        ref_dense = {n: p.detach().numpy() for n, p in ref.dense_named().items()}
        diff = max_diff(run["dense"][step], ref_dense)
        assert max(diff.values()) <= TOL, (step, diff)
    moved = max_diff(ref.tables(), job["init"])
    assert min(moved.values()) > 100 * TOL, moved  # the comparison can fail


@pytest.mark.parametrize("name", list(VARIANTS))
def test_fused_optimizer_and_sharding_train_on_gpu(job: dict[str, Any], name: str) -> None:
    embedding, sharding = name.split("-")
    run = job["result"]["variants"][name]
    plan = job["plans"][name].plan["model.sparse_arch.embedding_bag_collection"]
    assert {ps.sharding_type for ps in plan.values()} == {sharding}
    assert all(np.isfinite(run["losses"]))
    assert run["devices"] == ["cuda:0"]
    assert run["backend"] == "nccl"
    weights, states = run["weight_shapes"], run["state_shapes"]
    if sharding == "column_wise":
        assert {w[1] for w in weights} == {128}
    if embedding == "sgd":
        assert states == []
    elif embedding == "adagrad":
        assert states == weights
    elif embedding == "rowwise_adagrad":
        assert states == [(w[0],) for w in weights]
    else:  # Adam: first and second moment, element-wise, per shard
        assert states == [w for w in weights for _ in range(2)]
    assert any(run["states_moved"]) or embedding == "sgd"
    assert run["sync_kept"]
    # Fused Adam's step counter (FBGEMM's iter) is state raytrec moves; the others read none.
    if embedding == "adam":
        assert run["counters"] and set(run["counters"]) == {2}
    else:
        assert run["counters"] == []


@pytest.mark.parametrize("name", list(TOUCHED))
def test_touched_rows_cover_every_row_a_gpu_step_changes(job: dict[str, Any], name: str) -> None:
    """``sync.rows: touched`` averages only the rows some member touched, which equals the full
    average only if FBGEMM's CUDA kernels change no other row: checked per step, weights and
    fused state, on what the engine recorded."""
    run = job["result"]["touched"][name]
    kernel = name.split("-")[2]
    plan = job["plans"][name].plan["model.sparse_arch.embedding_bag_collection"]
    assert {ps.compute_kernel for ps in plan.values()} == {kernel}
    assert run["changed"] > 0  # the check can fail: steps changed rows
    assert run["missed"] == 0, run
    assert 0 < run["touched"] < run["rows"], run  # a real subset, not every row
    assert run["averaged"] == run["touched"]
    assert run["kept"]  # a mean over one member changes nothing, on NCCL as on gloo


def test_gpu_checkpoint_restores_adam_bit_for_bit(job: dict[str, Any]) -> None:
    run = job["result"]["checkpoint"]
    assert all(run["moved"]), "training after the save did not change the state"
    assert all(run["same"]) and all(run["dense_same"])
    assert run["step"] == (2, 2)


@pytest.mark.cluster
def test_fit_trains_gpu_ranks_as_ray_actors(tmp_path: Any) -> None:
    import ray

    from jobs.train import build_config
    from raytrec.api import fit
    from raytrec.cluster import connect

    config = build_config(
        ["--steps", "60", "--log-every", "20", "--storage-path", str(tmp_path)]
        + [
            arg
            for key in (
                "scaling.num_workers=1",
                "scaling.gang_size=1",
                "scaling.use_gpu=true",
                "optimizer.embedding=adam",
                "optimizer.embedding_lr=0.01",
                "sharding.sharding_type=row_wise",
                "data.source=synthetic",
            )
            for arg in ("--set", key)
        ]
    )
    connect(num_cpus=4)
    try:
        result = fit(config, shutdown_ray=False)
    finally:
        ray.shutdown()
    losses = [m.loss for m in result.history]
    assert [m.step for m in result.history] == [20, 40, 60]
    assert losses[-1] < losses[0], losses
    # The rank's placement group asked for a GPU: without one it would never have been placed.
    assert result.config.scaling.use_gpu
