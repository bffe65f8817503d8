"""Sharded checkpoints on gloo: save from one gang of a 2 x 2 job, resume on other shapes.

One launch of 4 rank processes runs every phase in turn, each in fresh gang
worlds on a store of its own:

* ``A``: 2 gangs x 2 ranks, table-wise, fused Adagrad, dense Adagrad. Trains
  6 steps (sync every 2); gang 0 alone saves at steps 2, 4 and 6 (keeping 2)
  into a plain local path. Every rank records its state at step 4 (the
  reference the loads are compared with) and at step 6 (uninterrupted
  training).
* ``a``: 2 x 2 again (same shape): both gangs load step 4, then train steps 5
  and 6, which must match the uninterrupted run bit for bit. Then each bad
  checkpoint (missing, uncommitted, corrupt, incompatible) must raise a clear
  error and leave every live tensor as it was.
* ``b``: 1 gang x 2 (fewer gangs); ``c``: 4 gangs x 1 (gang size 1);
  ``d``: 2 x 2 column-wise (each table cut in two 128-column shards).
* ``R``: 2 x 2 table-wise with row-wise Adagrad, saved through a ``file://``
  URI; loaded by 4 x 1 table-wise (``Rc``) and 2 x 2 column-wise (``Rd``).

Each rank reports its shards with their global offsets (read through the
live state dicts, whose tensors are checked to be views of the FBGEMM
kernels' storage), so the test assembles full tables and compares every
weight and optimizer-state tensor bitwise with the state recorded before the
save, independently of the checkpoint code.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint import FileSystemReader
from torchrec.distributed.types import ShardingPlan

from raytrec.checkpoint.errors import CheckpointError
from raytrec.checkpoint.layout import MANIFEST, MARKER, CheckpointStore
from raytrec.checkpoint.state import load_checkpoint, save_checkpoint
from raytrec.config import (
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ScalingConfig,
    ShardingConfig,
    SyncConfig,
    TableConfig,
    TrainConfig,
)
from raytrec.data.synthetic import SyntheticCriteo
from raytrec.engine.rank_engine import RankEngine, RankSpec, StoreAddress
from raytrec.serving.model_spec import MODEL_SPEC
from simulation.gloo_job import engine_for, make_plan_for, run_gang_job, run_steps

pytestmark = pytest.mark.multiprocess

NUM_DENSE = 4
BATCH = 8
DIM = 256  # the planner cuts column-wise shards in 128-column blocks: 2 real shards
SIZES = (16, 24, 32, 20)
SOURCE = SyntheticCriteo(
    num_dense=NUM_DENSE,
    num_sparse=4,
    num_embeddings=SIZES,
    mean_length=2.5,
    max_length=5,
    empty_fraction=0.2,
    seed=7,
)
TABLES = {f"t{i}": n for i, n in enumerate(SIZES)}
EXTRA = {"samples_seen": 4 * 4 * BATCH, "data": {"epoch": 0, "next_step": 4}}


def config(*, gangs: int, gang_size: int, sharding: str, embedding: str) -> TrainConfig:
    tables = tuple(
        TableConfig(name=f"t{i}", num_embeddings=n, embedding_dim=DIM, features=(f,))
        for i, (n, f) in enumerate(zip(SIZES, SOURCE.sparse_features, strict=True))
    )
    return TrainConfig(
        model=ModelConfig(tables=tables, dense_arch_layers=(16, DIM), over_arch_layers=(8, 1)),
        optimizer=OptimizerConfig(
            embedding=embedding,  # type: ignore[arg-type]
            embedding_lr=0.1,
            dense="adagrad",
            dense_lr=0.05,
        ),
        sharding=ShardingConfig(sharding_type=sharding),  # type: ignore[arg-type]
        scaling=ScalingConfig(num_workers=gangs * gang_size, gang_size=gang_size),
        sync=SyncConfig(sync_every=2),
        data=DataConfig(batch_size=BATCH),
        seed=3,
    )


@dataclasses.dataclass(frozen=True)
class Phase:
    gangs: int
    gang_size: int
    sharding: str
    embedding: str

    @property
    def config(self) -> TrainConfig:
        return config(
            gangs=self.gangs,
            gang_size=self.gang_size,
            sharding=self.sharding,
            embedding=self.embedding,
        )


PHASES = {
    "A": Phase(2, 2, "table_wise", "adagrad"),
    "a": Phase(2, 2, "table_wise", "adagrad"),
    "b": Phase(1, 2, "table_wise", "adagrad"),
    "c": Phase(4, 1, "table_wise", "adagrad"),
    "d": Phase(2, 2, "column_wise", "adagrad"),
    "R": Phase(2, 2, "table_wise", "rowwise_adagrad"),
    "Rc": Phase(4, 1, "table_wise", "rowwise_adagrad"),
    "Rd": Phase(2, 2, "column_wise", "rowwise_adagrad"),
}
WORLD = 4  # rank processes in the launch; a phase with fewer ranks leaves the rest idle

# Bad checkpoints: name -> (how the copy of step 4 is spoiled, the error it must give).
BAD = {
    "missing": "the directory does not exist",
    "uncommitted": "incomplete: it has no commit marker (_COMMITTED), so its save never finished",
    "no_manifest": "incomplete: manifest.json is missing",
    "truncated": "corrupt: data file __0_0.distcp has",
    "garbage_metadata": "corrupt: its DCP metadata (.metadata) cannot be read",
    "garbage_data": "corrupt: reading its tensors failed",
    "table_missing": "table 't3': in this model but missing from the checkpoint",
    "num_embeddings": "table 't1' num_embeddings: saved 99, expected 24",
    "embedding_dim": "table 't0' embedding_dim: saved 128, expected 256",
    "optimizer": "embedding optimizer: saved 'sgd', expected 'adagrad'",
}


# -- rank side ----------------------------------------------------------------------------


def snapshot(engine: RankEngine) -> dict[str, Any]:
    """This rank's state: shards with global offsets, dense state, step and random state."""
    weight_ptrs = {w.data_ptr() for w in engine.embedding_weights()}
    state_ptrs = {s.data_ptr() for s in engine.embedding_optimizer_states()}

    def shards(st: ShardedTensor, ptrs: set[int], what: str) -> list[tuple[tuple[int, ...], Any]]:
        out = []
        for s in st.local_shards():
            # The state dicts must show the kernels' own storage, or a load would not reach it.
            assert s.tensor.data_ptr() in ptrs, what
            out.append((tuple(s.metadata.shard_offsets), s.tensor.detach().numpy().copy()))
        return out

    tables = {
        key.split(".")[-2]: shards(value, weight_ptrs, key)
        for key, value in engine.model.state_dict().items()
        if isinstance(value, ShardedTensor)
    }
    opt = {
        state_key: shards(value, state_ptrs, state_key)
        for states in engine.model.fused_optimizer.state_dict()["state"].values()
        for state_key, value in states.items()
    }
    dense = {name: p.detach().numpy().copy() for name, p in engine.dense_params.items()}
    dense_opt = {
        f"{name}/{k}": v.detach().numpy().copy()
        for name, p in engine.dense_params.items()
        for k, v in engine.dense_optimizer.state[p].items()
        if isinstance(v, torch.Tensor)
    }
    return {
        "tables": tables,
        "opt": opt,
        "dense": dense,
        "dense_opt": dense_opt,
        "step": engine.step,
        "rng": torch.get_rng_state().numpy().copy(),
    }


def same_snapshot(a: dict[str, Any], b: dict[str, Any]) -> bool:
    def eq(x: Any, y: Any) -> bool:
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        if isinstance(x, list | tuple):
            return len(x) == len(y) and all(eq(p, q) for p, q in zip(x, y, strict=True))
        if isinstance(x, np.ndarray):
            return x.dtype == y.dtype and np.array_equal(x, y)
        return bool(x == y)

    return eq(a, b)


def phase_spec(spec: RankSpec, name: str, store: StoreAddress, plan: ShardingPlan) -> RankSpec:
    p = PHASES[name]
    return dataclasses.replace(
        spec,
        gang=spec.rank // p.gang_size,
        gang_rank=spec.rank % p.gang_size,
        gang_size=p.gang_size,
        config=p.config,
        plan=plan,
        store=store,
    )


def train(engine: RankEngine, rank: int, start_step: int, steps: int) -> list[float]:
    batches = SOURCE.split(WORLD)[rank].batches(BATCH, start_step=start_step)
    return run_steps(engine, batches, steps)


def bad_paths(bad_root: str) -> dict[str, str]:
    paths = {name: str(Path(bad_root) / name) for name in BAD}
    paths["missing"] = str(Path(bad_root) / "checkpoint_0000000099")  # never created
    return paths


def spoil(good: Path, bad_root: Path) -> None:
    """Copies of the step-4 checkpoint under ``bad_root``, each spoiled one way."""

    def copy(name: str) -> Path:
        dst = bad_root / name
        shutil.copytree(good, dst)
        return dst

    def edit_manifest(name: str, edit: Callable[[dict[str, Any]], None]) -> None:
        dst = copy(name)
        doc = json.loads((dst / MANIFEST).read_text())
        edit(doc)
        text = json.dumps(doc).encode()
        (dst / MANIFEST).write_bytes(text)
        digest = hashlib.sha256(text).hexdigest()
        (dst / MARKER).write_text(json.dumps({"step": doc["step"], "manifest_sha256": digest}))

    def garble(path: Path) -> None:
        path.write_bytes(np.random.default_rng(0).bytes(path.stat().st_size))

    (copy("uncommitted") / MARKER).unlink()
    (copy("no_manifest") / MANIFEST).unlink()
    data = copy("truncated") / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    garble(copy("garbage_metadata") / ".metadata")
    garble(copy("garbage_data") / "__1_0.distcp")

    def table(doc: dict[str, Any], name: str) -> dict[str, Any]:
        return next(t for t in doc["tables"] if t["name"] == name)

    edit_manifest("table_missing", lambda d: d["tables"].remove(table(d, "t3")))
    edit_manifest("num_embeddings", lambda d: table(d, "t1").update(num_embeddings=99))
    edit_manifest("embedding_dim", lambda d: table(d, "t0").update(embedding_dim=128))
    edit_manifest("optimizer", lambda d: d.update(embedding_optimizer="sgd"))


def try_bad_loads(engine: RankEngine, paths: dict[str, str]) -> dict[str, tuple[str, bool]]:
    """Each bad load: the error message, and whether the live state stayed bit for bit."""
    out = {}
    for name in BAD:
        before = snapshot(engine)
        try:
            load_checkpoint(engine, paths[name])
            message = "loaded without an error"
        except CheckpointError as e:
            message = str(e)
        out[name] = (message, same_snapshot(before, snapshot(engine)))
    return out


def job_worker(
    spec: RankSpec,
    *,
    stores: list[StoreAddress],
    plans: dict[str, ShardingPlan],
    root_a: str,
    root_r: str,
    bad_root: str,
) -> dict[str, Any]:
    rank, out = spec.rank, {}
    coordination = stores[-1]
    phase_stores = dict(zip(["a", "b", "c", "d", "R", "Rc", "Rd"], stores, strict=False))
    phase_stores["A"] = spec.store

    def build(name: str) -> Any:
        return engine_for(phase_spec(spec, name, phase_stores[name], plans[name]))

    # A: train, gang 0 saves at steps 2, 4, 6 (keeping the last 2).
    with build("A") as e:
        torch.manual_seed(100 + rank)  # a distinct random state per rank, to see it restored
        torch.rand(3)
        for step in (2, 4, 6):
            train(e, rank, step - 2, 2)
            if step == 4:
                out["A4"] = snapshot(e)
            if e.spec.gang == 0:
                ref = save_checkpoint(
                    e, root_a, generation=1, extra={**EXTRA, "at": step}, num_to_keep=2
                )
                assert ref.step == step
        out["A6"] = snapshot(e)
    # Only gang 0's ranks wrote, and only 2 checkpoints are kept.
    out["A_listing"] = [r.step for r in CheckpointStore(root_a).committed()]
    a4 = f"{root_a}/checkpoint_0000000004"

    # a: the same shape; load, continue 2 steps, then the bad checkpoints.
    client = dist.TCPStore(coordination.host, coordination.port, is_master=False)
    if rank == 0:
        spoil(Path(a4), Path(bad_root))
        client.set("spoiled", "1")
    with build("a") as e:
        loaded = load_checkpoint(e, a4)
        out["a_loaded"] = snapshot(e)
        out["a_meta"] = (loaded.step, loaded.generation, loaded.extra)
        train(e, rank, 4, 2)
        out["a_continued"] = snapshot(e)
        client.wait(["spoiled"])
        out["bad"] = try_bad_loads(e, bad_paths(bad_root))
        out["a_after_bad"] = snapshot(e)

    # b, c, d: fewer gangs, gang size 1, column-wise.
    for name in ("b", "c", "d"):
        if rank < PHASES[name].gangs * PHASES[name].gang_size:
            with build(name) as e:
                load_checkpoint(e, a4)
                out[name] = snapshot(e)

    # R: row-wise Adagrad through a file:// URI; loaded table-wise at gang size 1 and column-wise.
    with build("R") as e:
        train(e, rank, 0, 4)
        out["R4"] = snapshot(e)
        if e.spec.gang == 0:
            save_checkpoint(e, root_r, generation=0)
    r4 = f"{root_r}/checkpoint_0000000004"
    with build("Rc") as e:
        before = snapshot(e)
        try:
            load_checkpoint(e, a4)  # saved with Adagrad: refused, nothing touched
            out["Rc_refused"] = ("loaded without an error", False)
        except CheckpointError as err:
            out["Rc_refused"] = (str(err), same_snapshot(before, snapshot(e)))
        load_checkpoint(e, r4)
        out["Rc"] = snapshot(e)
    with build("Rd") as e:
        load_checkpoint(e, r4)
        out["Rd"] = snapshot(e)
    return out


# -- test side: assembling full tables ----------------------------------------------------------


def gather(
    snaps: list[dict[str, Any]], kind: str, shape_of: Callable[[str], tuple[int, ...]]
) -> dict[str, np.ndarray]:
    """Full tensors from the shards of one gang's ranks; every element must be covered once."""
    full: dict[str, np.ndarray] = {}
    seen: dict[str, np.ndarray] = {}
    for snap in snaps:
        for name, shards in snap[kind].items():
            if name not in full:
                full[name] = np.zeros(shape_of(name), dtype=np.float32)
                seen[name] = np.zeros(shape_of(name), dtype=np.int64)
            for offsets, values in shards:
                index = tuple(slice(o, o + n) for o, n in zip(offsets, values.shape, strict=True))
                full[name][index] = values
                seen[name][index] += 1
    for name, counts in seen.items():
        assert (counts == 1).all(), f"{kind} {name}: not covered exactly once"
    return full


def table_shape(name: str) -> tuple[int, int]:
    return (TABLES[name], DIM)


def adagrad_shape(name: str) -> tuple[int, int]:
    return table_shape(name.split(".")[0])  # "t0.momentum1": per element, like the table


def rowwise_shape(blocks: int) -> Callable[[str], tuple[int]]:
    return lambda name: (TABLES[name.split(".")[0]] * blocks,)


def gangs_of(results: dict[int, Any], phase: str, key: str | None = None) -> list[list[Any]]:
    """``results[rank][key]`` (``key`` defaults to the phase) grouped by the phase's gangs."""
    p, key = PHASES[phase], key or phase
    return [[results[g * p.gang_size + r][key] for r in range(p.gang_size)] for g in range(p.gangs)]


def assert_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray], what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), (what, k)


@dataclasses.dataclass(frozen=True)
class Job:
    results: dict[int, Any]
    root_a: str
    root_r: str


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Job:
    base = tmp_path_factory.mktemp("ckpt")
    plans = {name: make_plan_for(p.config, NUM_DENSE) for name, p in PHASES.items()}
    root_a, root_r = str(base / "a" / "checkpoints"), f"file://{base}/r/checkpoints"
    os.makedirs(base / "bad")
    results = run_gang_job(
        job_worker,
        num_gangs=2,
        gang_size=2,
        config=PHASES["A"].config,
        plan=plans["A"],
        num_dense=NUM_DENSE,
        timeout_s=240,
        extra_stores=len(PHASES),  # one per further phase, and one to coordinate
        plans=plans,
        root_a=root_a,
        root_r=root_r,
        bad_root=str(base / "bad"),
    )
    return Job(results=results, root_a=root_a, root_r=root_r)


def reference(job: Job, snap: str = "A4") -> dict[str, Any]:
    """Full tables, Adagrad state and dense state of gang 0 at the save of step 4."""
    gang0 = gangs_of(job.results, "A", snap)[0]
    return {
        "tables": gather(gang0, "tables", table_shape),
        "opt": gather(gang0, "opt", adagrad_shape),
        "dense": gang0[0]["dense"],
        "dense_opt": gang0[0]["dense_opt"],
    }


def assert_loaded(job: Job, phase: str, ref: dict[str, Any], key: str | None = None) -> None:
    """Every gang of ``phase`` holds exactly the saved state."""
    for g, snaps in enumerate(gangs_of(job.results, phase, key)):
        what = f"{phase} gang {g}"
        assert_equal(gather(snaps, "tables", table_shape), ref["tables"], what)
        assert_equal(gather(snaps, "opt", adagrad_shape), ref["opt"], what)
        for snap in snaps:
            assert_equal(snap["dense"], ref["dense"], what)
            assert_equal(snap["dense_opt"], ref["dense_opt"], what)
            assert snap["step"] == 4


# -- tests ---------------------------------------------------------------------------------


def test_one_gang_writes_and_keeps_the_last_two(job: Job) -> None:
    assert job.results[0]["A_listing"] == [4, 6]
    path = Path(job.root_a) / "checkpoint_0000000004"
    doc = json.loads((path / MANIFEST).read_text())
    # Gang 0's two ranks wrote one data file each; gang 1 wrote nothing. Gang rank 0 added
    # the model's spec (listed in the manifest like the data).
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [".metadata", "__0_0.distcp", "__1_0.distcp", MODEL_SPEC, MANIFEST, MARKER]
    )
    assert doc["files"].keys() == {".metadata", "__0_0.distcp", "__1_0.distcp", MODEL_SPEC}
    assert (doc["step"], doc["generation"], doc["gang_size"], doc["num_gangs"]) == (4, 1, 2, 2)
    assert (doc["sharding_type"], doc["embedding_optimizer"], doc["dense_optimizer"]) == (
        "table_wise",
        "adagrad",
        "adagrad",
    )
    assert [(t["name"], t["num_embeddings"], t["embedding_dim"]) for t in doc["tables"]] == [
        (name, n, DIM) for name, n in TABLES.items()
    ]
    assert doc["extra"] == {**EXTRA, "at": 4}
    # Every piece of state is stored once: each table (and its Adagrad state) as the one shard
    # its owner wrote, each dense tensor once although all 4 ranks hold it.
    md = FileSystemReader(str(path)).read_metadata()
    pieces: dict[str, list[str]] = {}
    for index, info in md.storage_data.items():
        pieces.setdefault(index.fqn, []).append(info.relative_path)
    prefix = "model.model.sparse_arch.embedding_bag_collection.embedding_bags"
    for name in TABLES:
        assert len(pieces[f"{prefix}.{name}.weight"]) == 1, name
        assert (
            len(pieces[f"embedding_optimizer.state.{prefix[6:]}.{name}.weight.{name}.momentum1"])
            == 1
        )
    dense = [k for k in pieces if k.startswith("model.") and "sparse_arch" not in k]
    assert len(dense) == 8 and all(len(pieces[k]) == 1 for k in dense)
    assert {k for k in pieces if k.startswith("rng.")} == {
        f"rng.rank{r}.{kind}" for r in range(2) for kind in ("torch", "python", "numpy")
    }


def test_replicas_agreed_at_the_save(job: Job) -> None:
    """Saved at a sync boundary: gang 1's copy equals gang 0's, so one copy is the job's state."""
    gangs = gangs_of(job.results, "A", "A4")
    for kind, shape in (("tables", table_shape), ("opt", adagrad_shape)):
        assert_equal(gather(gangs[0], kind, shape), gather(gangs[1], kind, shape), kind)


def test_same_shape_resume_is_bitwise(job: Job) -> None:
    ref = reference(job)
    assert_loaded(job, "a", ref, "a_loaded")
    for rank in range(WORLD):
        assert job.results[rank]["a_meta"] == (4, 1, {**EXTRA, "at": 4})
        # Rank r takes the random state saved by gang rank r % 2 of the writing gang.
        assert np.array_equal(
            job.results[rank]["a_loaded"]["rng"], job.results[rank % 2]["A4"]["rng"]
        )
    assert not np.array_equal(job.results[0]["A4"]["rng"], job.results[1]["A4"]["rng"])


def test_training_continues_as_if_never_interrupted(job: Job) -> None:
    for rank in range(WORLD):
        continued, uninterrupted = job.results[rank]["a_continued"], job.results[rank]["A6"]
        assert continued["step"] == uninterrupted["step"] == 6
        assert same_snapshot(
            {k: continued[k] for k in ("tables", "opt", "dense", "dense_opt")},
            {k: uninterrupted[k] for k in ("tables", "opt", "dense", "dense_opt")},
        ), rank
    # And the two steps did change the state (the comparison above can fail).
    moved = reference(job, "A6")
    assert not np.array_equal(moved["tables"]["t0"], reference(job)["tables"]["t0"])


def test_fewer_gangs(job: Job) -> None:
    assert_loaded(job, "b", reference(job))


def test_gang_size_one(job: Job) -> None:
    assert_loaded(job, "c", reference(job))
    for rank in range(WORLD):  # each rank now holds every table whole
        assert {n: len(s) for n, s in job.results[rank]["c"]["tables"].items()} == dict.fromkeys(
            TABLES, 1
        )


def test_table_wise_to_column_wise(job: Job) -> None:
    assert_loaded(job, "d", reference(job))
    for rank in range(WORLD):  # every table really is cut in two 128-column shards
        for shards in job.results[rank]["d"]["tables"].values():
            assert [v.shape[1] for _, v in shards] == [128]


@pytest.mark.parametrize("name", list(BAD))
def test_bad_checkpoints_are_refused_and_change_nothing(job: Job, name: str) -> None:
    for rank in range(WORLD):
        message, unchanged = job.results[rank]["bad"][name]
        assert BAD[name] in message, (rank, message)
        assert unchanged, (rank, name)
        assert same_snapshot(job.results[rank]["a_after_bad"], job.results[rank]["a_continued"])


def test_rowwise_adagrad_reshards(job: Job) -> None:
    gangs = gangs_of(job.results, "R", "R4")
    saved_tables = gather(gangs[0], "tables", table_shape)
    saved_state = gather(gangs[0], "opt", rowwise_shape(1))
    assert all(v.shape == (TABLES[k.split(".")[0]],) for k, v in saved_state.items())
    # Gang size 1, table-wise: the same layout, bit for bit.
    for snaps in gangs_of(job.results, "Rc"):
        assert_equal(gather(snaps, "tables", table_shape), saved_tables, "Rc")
        assert_equal(gather(snaps, "opt", rowwise_shape(1)), saved_state, "Rc")
    # Column-wise: one accumulator per row and column block; each block takes the saved one.
    for snaps in gangs_of(job.results, "Rd"):
        assert_equal(gather(snaps, "tables", table_shape), saved_tables, "Rd")
        got = gather(snaps, "opt", rowwise_shape(2))
        assert_equal(got, {k: np.concatenate([v, v]) for k, v in saved_state.items()}, "Rd")
    message, unchanged = job.results[0]["Rc_refused"]
    assert "embedding optimizer: saved 'adagrad', expected 'rowwise_adagrad'" in message
    assert unchanged
