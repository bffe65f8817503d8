"""The engine's two dense-gradient tools on gloo, 2 gangs of 2 ranks, dense gradients averaged
every step:

- ``train_step(batch, dense=False)``: the batch's dense gradient is zero, and still every rank of
  the job applies the same dense update (the zero enters the gang's DDP average, so the gang's
  other ranks keep theirs). The updates are linear in the batches that count: from one start,
  the update with rank 0's batch alone plus the update without it is the update with all four.
- ``settle_failed_step(finish=True)``: a step whose dense all-reduce failed (after leaving
  garbage in its buffer: a failed collective writes nothing back, so the gradients are kept) is
  finished over the next generation's replica plane, and gives an ordinary step's update.
- A gang leaves a failed step together: when one rank's replica group fails and its peer's
  finishes, both stop at that step, and the gang's process group still works.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from raytrec.config import (
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ScalingConfig,
    TableConfig,
    TrainConfig,
)
from raytrec.data.synthetic import SyntheticCriteo
from raytrec.engine.rank_engine import RankEngine, RankSpec
from raytrec.engine.replica_plane import ReplicaPlaneError
from raytrec.engine.stepping import StepFailed, StepInput
from simulation.gloo_job import engine_for, make_plan_for, run_gang_job

pytestmark = pytest.mark.multiprocess

G, L = 2, 2
BATCH = 8
SOURCE = SyntheticCriteo(num_dense=4, num_sparse=2, num_embeddings=(16, 24), seed=5)
CONFIG = TrainConfig(
    model=ModelConfig(
        tables=tuple(
            TableConfig(name=f"t{i}", num_embeddings=n, embedding_dim=8, features=(f,))
            for i, (n, f) in enumerate(
                zip(SOURCE.embedding_sizes, SOURCE.sparse_features, strict=True)
            )
        ),
        dense_arch_layers=(8, 8),
        over_arch_layers=(4, 1),
    ),
    optimizer=OptimizerConfig(embedding="sgd", embedding_lr=0.1, dense="sgd", dense_lr=0.1),
    scaling=ScalingConfig(num_workers=G * L, gang_size=L),
    data=DataConfig(batch_size=BATCH),
    seed=3,
)


class _FailingWork:
    def wait(self, timeout: Any = None) -> None:
        raise RuntimeError("a member of the replica group died")

    def is_completed(self) -> bool:
        return True


class _FailingGroup:
    """A replica group whose all-reduce fails after leaving garbage in the buffer."""

    def allreduce(self, tensors: list[torch.Tensor]) -> _FailingWork:
        tensors[0].fill_(float("nan"))  # must never reach the gradients
        return _FailingWork()


def _dense(engine: RankEngine) -> list[np.ndarray]:
    return [p.detach().numpy().copy() for p in engine.dense_params.values()]


def worker(spec: RankSpec) -> dict[str, Any]:
    with engine_for(spec) as engine:
        engine.broadcast_state(src=0)
        batch = next(SOURCE.split(G * L)[spec.rank].batches(BATCH))
        dense0 = [p.detach().clone() for p in engine.dense_params.values()]
        tables0 = [w.detach().clone() for w in engine.embedding_weights()]

        def from_start(step: Callable[[], None]) -> list[np.ndarray]:
            with torch.no_grad():
                for p, v in zip(engine.dense_params.values(), dense0, strict=True):
                    p.copy_(v)
                for w, v in zip(engine.embedding_weights(), tables0, strict=True):
                    w.copy_(v)
            step()
            return [a - b.numpy() for a, b in zip(_dense(engine), dense0, strict=True)]

        def failed_then_finished() -> None:
            # The replica plane fails inside the step, as when a member dies: the embedding
            # update happened, the dense update did not, and its gradients are kept.
            assert engine.replica is not None
            engine.replica = dataclasses.replace(engine.replica, pg=_FailingGroup())
            try:
                engine.train_step(batch)
            except ReplicaPlaneError:
                pass
            else:
                raise AssertionError("the step's all-reduce should have failed")
            assert engine.abandon_failed_step()
            assert engine.abandon_failed_step()  # asked again: still held
            # The job re-forms (a new generation of the same gangs) and finishes the step.
            engine.join_replica_plane(generation=1, member_rank=spec.gang, size=G)
            engine.settle_failed_step(finish=True)

        tables_before = [w.detach().clone() for w in engine.embedding_weights()]
        out = {
            "all": from_start(lambda: engine.train_step(batch)),
            "none": from_start(lambda: engine.train_step(batch, dense=False)),
            "without0": from_start(lambda: engine.train_step(batch, dense=spec.rank != 0)),
            "only0": from_start(lambda: engine.train_step(batch, dense=spec.rank == 0)),
            "finished": from_start(failed_then_finished),
        }
        # dense=False still trains the embedding rows.
        engine.train_step(batch, dense=False)
        out["tables_moved"] = any(
            not torch.equal(a, b)
            for a, b in zip(engine.embedding_weights(), tables_before, strict=True)
        )
        out["together"] = one_group_fails(engine, spec)  # in the same launch: it takes a while
        out["released"] = released_by_abort(engine, spec)
        return out


@pytest.fixture(scope="module")
def results() -> dict[int, dict[str, Any]]:
    """One launch of the job; every test reads its ranks' results."""
    return run_gang_job(
        worker,
        num_gangs=G,
        gang_size=L,
        config=CONFIG,
        plan=make_plan_for(CONFIG, SOURCE.num_dense),
        num_dense=SOURCE.num_dense,
    )


def test_a_zero_dense_gradient_keeps_every_rank_alike_and_the_others_weight(
    results: dict[int, dict[str, Any]],
) -> None:
    ranks = sorted(results)
    for key in ("all", "none", "without0", "only0", "finished"):
        first = results[ranks[0]][key]
        for r in ranks[1:]:  # every rank applied the same dense update
            assert all(np.array_equal(a, b) for a, b in zip(first, results[r][key], strict=True))
    r0 = results[ranks[0]]
    assert all(not np.any(d) for d in r0["none"])
    assert any(np.any(d) for d in r0["only0"]) and any(np.any(d) for d in r0["without0"])
    for a, w, o in zip(r0["all"], r0["without0"], r0["only0"], strict=True):
        np.testing.assert_allclose(w + o, a, atol=1e-6)
    for a, f in zip(r0["all"], r0["finished"], strict=True):
        np.testing.assert_allclose(f, a, atol=1e-6)
    assert all(res["tables_moved"] for res in results.values())


def one_group_fails(engine: RankEngine, spec: RankSpec) -> dict[str, Any]:
    """Replica group 1's all-reduce fails inside a step while group 0's succeeds: rank 0 of each
    gang finishes the step, rank 1 does not. Runs on generation 2's planes (the worker's own
    variants used generation 1's) and re-forms as generation 3."""
    assert engine.replica is not None
    engine.join_replica_plane(generation=2, member_rank=spec.gang, size=G)
    engine.broadcast_state(src=0)
    source = SOURCE.split(G * L)[spec.rank].batches(BATCH)
    inputs = (StepInput(b) for b in source)
    for _ in engine.train_steps(inputs, 1):
        pass
    before = engine.step
    assert engine.replica is not None
    if spec.gang_rank == 1:
        engine.replica = dataclasses.replace(engine.replica, pg=_FailingGroup())
    started = time.monotonic()
    try:
        for _ in engine.train_steps(inputs, 3):
            pass
    except StepFailed as e:
        error = type(e.error).__name__
    else:
        raise AssertionError("the step should have failed")
    out: dict[str, Any] = {
        "error": error,
        "left_after_s": time.monotonic() - started,
        "holds_failed_step": engine.abandon_failed_step(),
        "steps": engine.step - before,  # after abandon_failed_step: a failed step counts then
        # The gang's process group is intact: a gang collective goes through.
        "gang_works": engine.gang_agrees(True),
    }
    # Re-forming, as the coordinator's settlement does: the rank that finished the step is
    # the source of the dense state, and the step held undone is dropped.
    engine.join_replica_plane(generation=3, member_rank=spec.gang, size=G)
    engine.broadcast_dense(src=0, gang_src=0)
    engine.settle_failed_step(finish=False)
    out["dense"] = _dense(engine)
    return out


def released_by_abort(engine: RankEngine, spec: RankSpec) -> dict[str, Any]:
    """Gang 1's ranks wait in a replica collective for gang 0, whose ranks are alive but do not
    come (as a rank that left the step on another error does not); the coordinator's abort, from
    another thread as the rank actor's control call, must end the wait at once, not at the
    collective timeout (120 s here). Generation 4's planes; generation 5 works after."""
    engine.join_replica_plane(generation=4, member_rank=spec.gang, size=G)
    plane = engine.replica
    assert plane is not None
    out: dict[str, Any] = {}
    if spec.gang == 1:
        timer = threading.Timer(0.5, engine.abort_replica_planes)
        timer.start()
        started = time.monotonic()
        try:
            plane.mean_(torch.ones(4))
        except ReplicaPlaneError:
            out["error"] = "ReplicaPlaneError"
        out["waited_s"] = time.monotonic() - started
        timer.join()
    else:
        time.sleep(3.0)  # then come, so that gang 1's abandoned collective ends too
        with contextlib.suppress(ReplicaPlaneError):
            plane.mean_(torch.ones(4))
    engine.join_replica_plane(generation=5, member_rank=spec.gang, size=G)
    assert engine.replica is not None
    ones = torch.ones(4) * (spec.gang + 1)
    engine.replica.mean_(ones)
    out["next_generation_mean"] = ones.tolist()
    return out


def test_an_abort_releases_a_collective_waiting_for_a_member_that_does_not_come(
    results: dict[int, dict[str, Any]],
) -> None:
    for rank, res in results.items():
        out = res["released"]
        if rank // L == 1:
            assert out.get("error") == "ReplicaPlaneError", out
            assert out["waited_s"] < 5.0, out  # the abort came at 0.5 s; the timeout is 120 s
        assert out["next_generation_mean"] == [1.5] * 4, out


def test_a_gang_leaves_a_step_together_when_one_ranks_replica_group_fails(
    results: dict[int, dict[str, Any]],
) -> None:
    """Without the gang's agreement, rank 0 would go on into the next step's collectives over
    the gang, wait there for rank 1 until the collective timeout, and the timed-out gloo pair
    would break the gang's process group although both ranks live."""
    together = {r: out["together"] for r, out in results.items()}
    for rank, out in together.items():
        finished = rank % L == 0
        assert out["error"] == ("GangPeerFailed" if finished else "ReplicaPlaneError"), out
        assert out["steps"] == 1, out  # the failed step counts on both (its embedding update ran)
        assert out["holds_failed_step"] is not finished, out
        assert out["gang_works"], out
        assert out["left_after_s"] < 10.0, out  # not the collective timeout
    first = together[0]["dense"]
    for out in together.values():  # one dense state everywhere again
        assert all(np.array_equal(a, b) for a, b in zip(first, out["dense"], strict=True))
