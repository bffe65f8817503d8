"""The checkpoint code's own CUDA paths, on one GPU with NCCL (skipped without CUDA).

TorchRec's GPU kernels need the CUDA FBGEMM build, so this drives
:func:`save_checkpoint` / :func:`load_checkpoint` with a stand-in engine that
has the same surface as :class:`~raytrec.engine.rank_engine.RankEngine`: sharded
tables and row-wise optimizer state as CUDA ShardedTensors, dense parameters
on the GPU with Adam (whose state appears only after a step), and the CUDA
random generator. What it checks: the gang collectives over NCCL, fresh
tensors allocated on the right device, Adam's state created on load where
the optimizer keeps it, and every tensor and the CUDA random state restored
bit for bit.

The same check also runs on the CPU with gloo, everywhere: it keeps the stand-in in step with
what the checkpoint code asks of an engine, so that the CUDA run, which CI cannot make, does not
fail on a stand-in that has fallen behind.

Runs as a test (``pytest tests/gpu/test_checkpoint_cuda.py``) or as a script.
"""

from __future__ import annotations

import dataclasses
import io
import multiprocessing as mp
import os
import sys
import tempfile
import traceback
import types
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)

from raytrec.checkpoint.state import load_checkpoint, save_checkpoint
from raytrec.config import (
    ModelConfig,
    OptimizerConfig,
    ScalingConfig,
    TableConfig,
    TrainConfig,
)
from raytrec.serving.model_spec import ModelSpec

pytestmark = pytest.mark.multiprocess

PREFIX = "model.sparse_arch.embedding_bag_collection.embedding_bags"
TABLES = {"t0": 1000, "t1": 3000}
DIM = 64
CONFIG = TrainConfig(
    model=ModelConfig(
        tables=tuple(
            TableConfig(name=n, num_embeddings=r, embedding_dim=DIM, features=(f"f{i}",))
            for i, (n, r) in enumerate(TABLES.items())
        ),
        dense_arch_layers=(32, DIM),
    ),
    optimizer=OptimizerConfig(embedding="rowwise_adagrad", dense="adam"),
    scaling=ScalingConfig(num_workers=1, gang_size=1, use_gpu=True),
)


def sharded(t: torch.Tensor) -> ShardedTensor:
    """A one-shard ShardedTensor on this rank, as TorchRec builds them."""
    placement = f"rank:0/{t.device}"
    meta = ShardMetadata([0] * t.dim(), list(t.shape), placement)
    global_meta = ShardedTensorMetadata(
        [meta], t.shape, TensorProperties(dtype=t.dtype, requires_grad=False)
    )
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        [Shard(t, meta)], global_meta, process_group=dist.group.WORLD
    )


class KeyedAdam:
    """The surface of TorchRec's KeyedOptimizerWrapper that checkpointing uses."""

    def __init__(self, params: dict[str, torch.nn.Parameter]) -> None:
        self.params = params
        self.optimizer = torch.optim.Adam(params.values(), lr=0.01)
        self._optimizer = self.optimizer  # the wrapped optimizer, as TorchRec's wrapper holds it
        self.state = self.optimizer.state

    def state_dict(self) -> dict[str, Any]:
        return {
            "state": {k: dict(self.state[p]) for k, p in self.params.items() if p in self.state}
        }


@dataclasses.dataclass
class Spec:
    gang_rank: int = 0
    gang_size: int = 1
    num_dense: int = 4

    def model_spec(self) -> ModelSpec:
        return ModelSpec.for_config(CONFIG, self.num_dense)


class StandInEngine:
    """Sharded tables + row-wise state + dense Adam on ``device``, seeded by ``seed``."""

    def __init__(self, seed: int, device: torch.device) -> None:
        g = torch.Generator(device=device).manual_seed(seed)
        self.device = device
        self.cfg, self.spec, self.step = CONFIG, Spec(), 0
        self.state = types.SimpleNamespace(ids=None)  # no managed ids (the engine's RankState)
        self.tables = {
            n: torch.randn(r, DIM, device=self.device, generator=g) for n, r in TABLES.items()
        }
        self.momentum = {
            n: torch.rand(r, device=self.device, generator=g) for n, r in TABLES.items()
        }
        self.dense_params = {
            "model.dense_arch.w": torch.nn.Parameter(
                torch.randn(32, 4, device=device, generator=g)
            ),
            "model.dense_arch.b": torch.nn.Parameter(torch.randn(32, device=device, generator=g)),
        }
        self.dense_optimizer = KeyedAdam(self.dense_params)
        # One step counter per fused-table kernel, as FBGEMM's fused Adam keeps (``iter``).
        self.counters = [torch.zeros(1, dtype=torch.int64, device=device)]
        engine = self

        class Fused:
            def state_dict(self) -> dict[str, Any]:
                return {
                    "state": {
                        f"{PREFIX}.{n}.weight": {f"{n}.momentum1": sharded(engine.momentum[n])}
                        for n in TABLES
                    }
                }

        class Model:
            fused_optimizer = Fused()

            def state_dict(self) -> dict[str, Any]:
                out: dict[str, Any] = {
                    f"{PREFIX}.{n}.weight": sharded(t) for n, t in engine.tables.items()
                }
                out |= {k: p.detach() for k, p in engine.dense_params.items()}
                return out

        self.model = Model()

    def write_back_caches(self) -> None:
        pass  # no UVM-cached table here

    def embeddings_written(self) -> None:
        pass

    def embedding_step_counters(self) -> list[torch.Tensor]:
        return self.counters

    def step_counters_written(self) -> None:
        pass

    def train_step(self) -> None:
        loss = sum((p**2).sum() for p in self.dense_params.values())
        loss.backward()  # type: ignore[union-attr]
        self.dense_optimizer.optimizer.step()
        with torch.no_grad():
            for n in TABLES:
                self.tables[n].mul_(0.5).add_(1.0)
                self.momentum[n].add_(0.25)
            for c in self.counters:
                c.add_(1)
        self.step += 1

    def everything(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Copies of every tensor of the state, and the device each lives on."""
        out = {f"w/{n}": t for n, t in self.tables.items()}
        out |= {f"m/{n}": t for n, t in self.momentum.items()}
        out |= {f"d/{k}": p.detach() for k, p in self.dense_params.items()}
        out |= {f"c/{i}": c for i, c in enumerate(self.counters)}
        for k, p in self.dense_optimizer.params.items():
            out |= {f"o/{k}/{s}": v for s, v in self.dense_optimizer.state[p].items()}
        copies = {k: v.detach().cpu().clone() for k, v in out.items()}
        return copies, {k: str(v.device) for k, v in out.items()}


def child(root: str, device_type: str, results: Any) -> None:
    try:
        device = torch.device(device_type, 0 if device_type == "cuda" else None)
        if device_type == "cuda":
            torch.cuda.set_device(device)
        rng = torch.cuda if device_type == "cuda" else torch
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
        saved_engine = StandInEngine(seed=1, device=device)
        for _ in range(3):
            saved_engine.train_step()
        rng.manual_seed(77)
        torch.rand(5, device=device)
        ref = save_checkpoint(saved_engine, root, generation=4, extra={"k": 1})  # type: ignore[arg-type]
        saved, saved_devices = saved_engine.everything()
        saved_rng = rng.get_rng_state()
        fresh = StandInEngine(seed=2, device=device)  # other values, and no Adam state yet
        assert not fresh.dense_optimizer.state
        rng.manual_seed(5)
        loaded = load_checkpoint(fresh, ref)  # type: ignore[arg-type]
        got, got_devices = fresh.everything()
        out = {
            "saved": saved,
            "got": got,
            "saved_devices": saved_devices,
            "got_devices": got_devices,
            "rng": torch.equal(rng.get_rng_state(), saved_rng),
            "meta": (loaded.step, loaded.generation, dict(loaded.extra)),
        }
        # As bytes: CPU tensors put on the queue as they are would travel as shared-memory
        # handles, gone once this process has exited.
        packed = io.BytesIO()
        torch.save(out, packed)
        results.put({"packed": packed.getvalue()})
        dist.destroy_process_group()
    except BaseException:
        results.put({"error": traceback.format_exc()})


def run_check(device_type: str) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        proc = ctx.Process(target=child, args=(os.path.join(tmp, "ckpt"), device_type, results))
        proc.start()
        out = results.get(timeout=240)
        proc.join(30)
    assert "error" not in out, out.get("error")
    return dict(torch.load(io.BytesIO(out["packed"])))


@pytest.mark.parametrize(
    ("device_type", "where"),
    [
        pytest.param(
            "cuda",
            "cuda:0",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
            id="cuda-nccl",
        ),
        pytest.param("cpu", "cpu", id="cpu-gloo"),
    ],
)
def test_save_and_load_restore_every_tensor_and_the_random_state(
    device_type: str, where: str
) -> None:
    out = run_check(device_type)
    saved, got = out["saved"], out["got"]
    assert saved.keys() == got.keys()
    for k in saved:
        assert saved[k].dtype == got[k].dtype and torch.equal(saved[k], got[k]), k
    # Adam's moments beside their parameters, its step count on the CPU, as Adam does.
    assert out["got_devices"] == out["saved_devices"]
    assert {d for k, d in out["got_devices"].items() if k.endswith("/step")} == {"cpu"}
    assert {d for k, d in out["got_devices"].items() if "exp_avg" in k} == {where}
    assert {d for k, d in out["got_devices"].items() if k.startswith("w/")} == {where}
    assert out["rng"] and out["meta"] == (3, 4, {"k": 1})


if __name__ == "__main__":
    test_save_and_load_restore_every_tensor_and_the_random_state("cuda", "cuda:0")
    print("ok: CUDA save/load with NCCL restored every tensor and the CUDA random state")
    sys.exit(0)
