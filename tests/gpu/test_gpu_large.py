"""Large models on one GPU: UVM-cached tables, fp16 tables and the pipelined step.

Skipped without CUDA (CI has none); run on a GPU host with ``pytest -m gpu`` (docs/gpu.md).
One spawned rank owns ``cuda:0`` and runs, one engine after the other:

* A job whose planner gets less device memory than its largest table: the planner puts that
  table in UVM with an HBM cache (and refuses to keep it in HBM). After 5 SGD steps its weights
  and losses match the same job with every table in HBM (same start, same batches) within
  1e-5. A replica sync then goes through the cache: the engine reads the rows' true contents
  (the cache written back), the average is written to UVM and the cache emptied, and 3 more
  steps still match the HBM job. A checkpoint of either job loads into the other bit for bit.
* An fp16 table with row-wise Adagrad: fp16 weights, fp32 optimizer state, both through a sync.
* ``train_pipeline='sparse_dist'`` (TorchRec's TrainPipelineSparseDist on CUDA streams) against
  ``'off'`` on the same batches: losses and final state within ``torch.testing.assert_close``'s
  float32 tolerances (what TorchRec's own pipeline tests use); and a step that fails with two
  batches in flight (tests/multiprocess/test_pipeline.py's scenario): both in flight are left
  unstarted and, trained next, every batch is trained exactly once.
"""

from __future__ import annotations

import dataclasses
import itertools
import tempfile
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from test_engine_2d import BATCH, NUM_DENSE, SOURCE, job_config
from test_gpu import dense_arrays, full_tables, sharded_tables
from test_pipeline import FAIL_AT, RUNS, STEPS, _assert_same_run, _train
from torchrec.distributed.types import ShardingPlan

from raytrec.config import ConfigError, ScalingConfig, ShardingConfig, TrainConfig
from raytrec.config.model import TableConfig
from raytrec.engine.plan import job_plan
from raytrec.engine.rank_engine import RankEngine, RankSpec, StoreAddress
from raytrec.engine.replica_plane import ReplicaPlane
from raytrec.models import build_train_model
from simulation.gloo_job import run_gang_job

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOL = 1e-5
EBC = "model.sparse_arch.embedding_bag_collection"
BIG_ROWS = 200_000  # x 16 columns x 4 bytes: 12.8 MB, more than the budget below
BUDGET_GIB = 0.01  # 10.7 MB of device memory for the planner
ONE_GPU = ScalingConfig(num_workers=1, gang_size=1, use_gpu=True)


def _with_big_table(kernel: str, *, budget: float | None) -> TrainConfig:
    base = job_config(embedding="sgd", dim=16, embedding_lr=0.5, dense_lr=0.1, scaling=ONE_GPU)
    first = base.model.tables[0]
    cache = 0.2 if kernel == "fused_uvm_caching" else None
    big = first.model_copy(
        update={"num_embeddings": BIG_ROWS, "compute_kernel": kernel, "cache_load_factor": cache}
    )
    tables = (TableConfig.model_validate(big.model_dump()), *base.model.tables[1:])
    return base.replace(
        model=base.model.replace(tables=tables),
        sharding=ShardingConfig(device_memory_gib=budget),
    )


UVM = _with_big_table("fused_uvm_caching", budget=BUDGET_GIB)
HBM = _with_big_table("fused", budget=None)
FP16 = job_config(embedding="rowwise_adagrad", dim=16, scaling=ONE_GPU)
_HALF = FP16.model.tables[0].model_copy(update={"precision": "fp16"})
FP16 = FP16.replace(model=FP16.model.replace(tables=(_HALF, *FP16.model.tables[1:])))
PIPELINED = job_config(embedding="rowwise_adagrad", sync_every=3, scaling=ONE_GPU)


def plan_for(config: TrainConfig) -> ShardingPlan:
    """The job's plan for one GPU, within ``sharding.device_memory_gib`` when it is set."""
    budget = config.sharding.device_memory_gib
    memory = None if budget is None else int(budget * 2**30)
    return job_plan(config, NUM_DENSE, build_train_model, device_memory=memory)


# -- rank side ------------------------------------------------------------------------------


def _engine(spec: RankSpec, config: TrainConfig, plan: ShardingPlan, store: Any) -> RankEngine:
    engine = RankEngine(dataclasses.replace(spec, config=config, plan=plan, store=store))
    engine.build()
    engine.join_replica_plane(generation=0, member_rank=0, size=1)
    return engine


def _halving_plane(spec: RankSpec, name: str) -> ReplicaPlane:
    """A replica plane that says it has two members over an NCCL group of one: its average is
    a real NCCL all-reduce on the CUDA tensors, then a division by two."""
    store = dist.TCPStore(spec.store.host, spec.store.port, is_master=False)
    pg = dist.ProcessGroupNCCL(dist.PrefixStore(name, store), 0, 1, dist.ProcessGroupNCCL.Options())
    return ReplicaPlane(generation=0, replica_group=0, rank=0, size=2, pg=pg)


def _steps(engine: RankEngine, source: Any, n: int) -> list[float]:
    return [float(engine.train_step(next(source)).loss) for _ in range(n)]


def _snapshot(engine: RankEngine) -> dict[str, Any]:
    return {"tables": full_tables(engine), "dense": dense_arrays(engine)}


def _set_state(engine: RankEngine, state: dict[str, Any]) -> None:
    """Writes ``state``'s tables and dense layers into ``engine`` (through the state dict's
    shards, then :meth:`RankEngine.embeddings_written`, as a checkpoint load does)."""
    with torch.no_grad():
        for name, st in sharded_tables(engine).items():
            for shard in st.local_shards():
                (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                rows = state["tables"][name][r0 : r0 + nr, c0 : c0 + nc]
                shard.tensor.copy_(torch.from_numpy(rows))
        for name, p in engine.dense_params.items():
            p.copy_(torch.from_numpy(state["dense"][name]))
    engine.embeddings_written()


def _uvm_or_hbm(
    spec: RankSpec,
    config: TrainConfig,
    plan: ShardingPlan,
    store: Any,
    start: dict[str, Any],
    label: str,
) -> dict[str, Any]:
    engine = _engine(spec, config, plan, store)
    try:
        if start:  # the other job's starting tables and dense layers
            _set_state(engine, start)
        out: dict[str, Any] = {"start": _snapshot(engine)}
        source = SOURCE.split(1)[0].batches(BATCH)
        out["losses"] = _steps(engine, source, 5)
        out["trained"] = _snapshot(engine)
        real = engine.replica
        engine.replica = _halving_plane(spec, f"halve-{label}")
        engine.sync()  # every table's rows halved, through the engine's own read and write
        engine.replica = real
        out["synced"] = _snapshot(engine)
        out["losses_after_sync"] = _steps(engine, source, 3)
        out["final"] = _snapshot(engine)
        out["cache_rows"] = [int(t.lxu_cache_weights.shape[0]) for t in engine.state.tables]
        return out
    finally:
        engine.close()


def _save(engine_args: tuple[Any, ...], start: dict[str, Any], root: str) -> dict[str, Any]:
    from raytrec.checkpoint.state import save_checkpoint

    engine = _engine(*engine_args)
    try:
        _set_state(engine, start)
        _steps(engine, SOURCE.split(1)[0].batches(BATCH), 2)  # rows in the cache, dirty
        saved = _snapshot(engine)
        ref = save_checkpoint(engine, root, generation=0, extra={})
        return {"saved": saved, "uri": ref.uri}
    finally:
        engine.close()


def _load(engine_args: tuple[Any, ...], uri: str) -> dict[str, Any]:
    from raytrec.checkpoint.state import load_checkpoint

    engine = _engine(*engine_args)
    try:
        load_checkpoint(engine, uri)
        return _snapshot(engine)
    finally:
        engine.close()


def _fp16(spec: RankSpec, plan: ShardingPlan, store: Any) -> dict[str, Any]:
    engine = _engine(spec, FP16, plan, store)
    try:
        losses = _steps(engine, SOURCE.split(1)[0].batches(BATCH), 4)
        engine.replica = _halving_plane(spec, "fp16")
        before = [w.float().clone() for w in engine.embedding_weights()]
        engine.sync(optimizer_state=True)
        after = [w.float() for w in engine.embedding_weights()]
        pairs = zip(after, before, strict=True)
        return {
            "losses": losses,
            "weights": sorted(str(w.dtype) for w in engine.embedding_weights()),
            "states": sorted({str(s.dtype) for s in engine.embedding_optimizer_states()}),
            "halved": max(float((a - b / 2).abs().max()) for a, b in pairs),
        }
    finally:
        engine.close()


def _pipelined(spec: RankSpec, plan: ShardingPlan, stores: list[Any]) -> dict[Any, Any]:
    batches = list(itertools.islice(SOURCE.split(1)[0].batches(8), STEPS))
    out = {}
    for (pipeline, fail), store in zip(RUNS, stores, strict=True):
        engine = _engine(spec, PIPELINED.replace(train_pipeline=pipeline), plan, store)
        try:
            start = [t.detach().cpu().numpy().copy() for t in engine.dense_state()]
            out[pipeline, fail] = _train(engine, batches, fail=fail) | {"dense0": start}
        finally:
            engine.close()
    return out


def large_worker(
    spec: RankSpec, *, plans: dict[str, ShardingPlan], stores: list[StoreAddress], root: str
) -> dict[str, Any]:
    s = iter([spec.store, *stores])
    out: dict[str, Any] = {}
    uvm = (spec, UVM, plans["uvm"])
    hbm = (spec, HBM, plans["hbm"])
    out["uvm"] = _uvm_or_hbm(*uvm, next(s), {}, "uvm")
    out["hbm"] = _uvm_or_hbm(*hbm, next(s), out["uvm"]["start"], "hbm")
    start = out["uvm"]["start"]
    from_uvm = _save((*uvm, next(s)), start, f"{root}/from_uvm")
    from_hbm = _save((*hbm, next(s)), start, f"{root}/from_hbm")
    out["uvm_into_hbm"] = (from_uvm["saved"], _load((*hbm, next(s)), from_uvm["uri"]))
    out["hbm_into_uvm"] = (from_hbm["saved"], _load((*uvm, next(s)), from_hbm["uri"]))
    out["fp16"] = _fp16(spec, plans["fp16"], next(s))
    out["pipelined"] = _pipelined(spec, plans["pipelined"], [next(s) for _ in RUNS])
    semi = _engine(spec, PIPELINED.replace(train_pipeline="semi_sync"), plans["pipelined"], next(s))
    try:
        batches = list(itertools.islice(SOURCE.split(1)[0].batches(8), STEPS))
        out["semi_sync"] = _train(semi, batches, fail=False)
    finally:
        semi.close()
    return out


# -- the job ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def job() -> dict[str, Any]:
    plans = {
        "uvm": plan_for(UVM),
        "hbm": plan_for(HBM),
        "fp16": plan_for(FP16),
        "pipelined": plan_for(PIPELINED),
    }
    with tempfile.TemporaryDirectory() as root:
        results = run_gang_job(
            large_worker,
            num_gangs=1,
            gang_size=1,
            config=UVM,
            plan=plans["uvm"],
            num_dense=NUM_DENSE,
            timeout_s=600.0,
            extra_stores=8 + len(RUNS),
            plans=plans,
            root=root,
        )
    return {"plans": plans, "result": results[0]}


def _max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k].astype(np.float64) - b[k]).max()) for k in a)


def test_the_planner_caches_a_table_larger_than_its_budget() -> None:
    plan = plan_for(UVM).plan[EBC]
    assert plan["t0"].compute_kernel == "fused_uvm_caching"  # type: ignore[index]
    assert {plan[t].compute_kernel for t in plan if t != "t0"} == {"fused"}  # type: ignore[index]
    in_hbm = _with_big_table("fused", budget=BUDGET_GIB)
    with pytest.raises(ConfigError, match="insufficient storage"):
        plan_for(in_hbm)


def test_a_uvm_cached_table_trains_and_syncs_like_one_in_hbm(job: dict[str, Any]) -> None:
    uvm, hbm = job["result"]["uvm"], job["result"]["hbm"]
    assert max(uvm["cache_rows"]) > 0, "no table had a cache"
    assert _max_diff(uvm["start"]["tables"], hbm["start"]["tables"]) == 0.0
    np.testing.assert_allclose(uvm["losses"], hbm["losses"], atol=TOL, rtol=0)
    for stage in ("trained", "synced", "final"):
        assert _max_diff(uvm[stage]["tables"], hbm[stage]["tables"]) <= TOL, stage
        assert _max_diff(uvm[stage]["dense"], hbm[stage]["dense"]) <= TOL, stage
    # The sync halved the true rows (not the stale UVM copy) and the next lookups saw that.
    for name, table in uvm["trained"]["tables"].items():
        np.testing.assert_allclose(uvm["synced"]["tables"][name], table / 2, atol=1e-7, rtol=0)
    np.testing.assert_allclose(uvm["losses_after_sync"], hbm["losses_after_sync"], atol=TOL)
    assert _max_diff(uvm["trained"]["tables"], uvm["start"]["tables"]) > 100 * TOL


def test_checkpoints_move_between_uvm_and_hbm_bit_for_bit(job: dict[str, Any]) -> None:
    for key in ("uvm_into_hbm", "hbm_into_uvm"):
        saved, loaded = job["result"][key]
        assert _max_diff(saved["tables"], loaded["tables"]) == 0.0, key
        assert _max_diff(saved["dense"], loaded["dense"]) == 0.0, key


def test_fp16_tables_keep_fp32_optimizer_state_through_a_sync(job: dict[str, Any]) -> None:
    run = job["result"]["fp16"]
    assert all(np.isfinite(run["losses"]))
    assert "torch.float16" in run["weights"] and "torch.float32" in run["weights"]
    assert run["states"] == ["torch.float32"]
    assert run["halved"] <= 1e-3  # fp16 rounding of a mean taken in fp32


def test_the_pipelined_engine_trains_what_the_synchronous_one_trains(job: dict[str, Any]) -> None:
    runs = job["result"]["pipelined"]
    plain, piped = runs["off", False], runs["sparse_dist", False]
    for a, b in zip(plain["dense0"], piped["dense0"], strict=True):
        assert np.array_equal(a, b)
    assert piped["pipelined_modules"] == 1
    assert plain["started"] == piped["started"] == list(range(STEPS))
    _assert_same_run(plain, piped)


def test_a_failure_with_batches_in_flight_counts_every_batch_once(job: dict[str, Any]) -> None:
    runs = job["result"]["pipelined"]
    plain, piped = runs["off", True], runs["sparse_dist", True]
    assert piped["unstarted"] == [FAIL_AT, FAIL_AT + 1]
    assert plain["started"] == piped["started"] == list(range(STEPS))
    _assert_same_run(plain, piped)


def test_the_semi_sync_pipeline_trains_every_batch_once(job: dict[str, Any]) -> None:
    run = job["result"]["semi_sync"]
    assert run["started"] == list(range(STEPS))
    assert all(np.isfinite(run["losses"])) and run["step"] == STEPS
