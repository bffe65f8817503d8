"""The pipelined step (TorchRec's train pipeline under raytrec's 2D sync) on CPU ranks (gloo).

A 2 x 2 job trains the same batches with ``train_pipeline='off'`` and ``'sparse_dist'``:

* every loss and every final tensor (each rank's table shards and their optimizer state, the
  dense parameters) agree within ``torch.testing.assert_close``'s float32 tolerances, across
  syncs every 3 steps (the pipeline is drained at each);
* an evaluation's forward between intervals (outside the pipeline) scores alike, and the
  pipelined steps after it still agree;
* a step that fails in its dense all-reduce with two batches in flight (an injected replica
  plane failure) counts as started, the two in flight are named unstarted and untouched, and
  once they are trained first after the failed step is settled, every batch has been trained
  exactly once and the state equals the synchronous engine's under the same failure;
* an input source that fails while the pipeline fills starts no step: the inputs it took are
  named unstarted, and training on from them trains every batch once.

The same pipeline on one GPU (CUDA streams, NCCL) is tests/gpu/test_gpu_large.py's; on Ray, with a
rank killed while batches are in flight, tests/cluster/test_elastic_cluster.py's pipelined case.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from test_engine_2d import NUM_DENSE, SOURCE, job_config

from raytrec.config import ScalingConfig
from raytrec.data.source import Batch
from raytrec.engine.rank_engine import RankEngine, RankSpec
from raytrec.engine.stepping import StepBegins, StepFailed, StepInput, StepResult
from simulation.gloo_job import engine_for, make_plan_for, run_gang_job

pytestmark = pytest.mark.multiprocess

G, L = 2, 2
STEPS = 10
FAIL_AT = 4  # the step whose dense all-reduce fails: the first of a segment (sync_every=3)
CONFIG = job_config(
    embedding="rowwise_adagrad", sync_every=3, scaling=ScalingConfig(num_workers=G * L, gang_size=L)
)
RUNS = [(p, fail) for fail in (False, True) for p in ("off", "sparse_dist")]


class InjectedFailure(RuntimeError):
    pass


def _fail_dense_update_at(engine: RankEngine, step: int) -> None:
    """Makes the dense all-reduce of step ``step`` fail once, after backward (where a replica
    plane failure strikes: the embedding update has happened)."""
    replicas = engine.replicas
    average = replicas.average_dense_grads
    failed = False

    def failing() -> None:
        nonlocal failed
        if engine.step + 1 == step and not failed:
            failed = True
            raise InjectedFailure(f"replica plane failed at step {step}")
        average()

    replicas.average_dense_grads = failing  # type: ignore[method-assign]


def _state(engine: RankEngine) -> list[np.ndarray]:
    return [
        t.detach().cpu().float().numpy().copy()
        for t in engine.embedding_weights() + engine.embedding_optimizer_states()
    ] + [t.detach().cpu().float().numpy().copy() for t in engine.dense_state()]


def _train(engine: RankEngine, batches: list[Batch], *, fail: bool) -> dict[str, Any]:
    queue = [StepInput(b, batch_id=i) for i, b in enumerate(batches)]
    started: list[int | None] = []
    losses: list[float] = []
    report: dict[str, Any] = {}
    if fail:
        _fail_dense_update_at(engine, FAIL_AT)

    def from_queue() -> Iterator[StepInput]:
        while queue:
            yield queue.pop(0)

    def train(num_steps: int) -> None:
        upcoming = None
        for event in engine.train_steps(from_queue(), num_steps):
            if isinstance(event, StepBegins):
                upcoming = event
            elif isinstance(event, StepResult):
                assert upcoming is not None and event.step == upcoming.step == engine.step
                assert event.batch_id == upcoming.input.batch_id
                started.append(event.batch_id)
                losses.append(float(event.loss))

    try:
        train(STEPS)
    except StepFailed as failed:
        if not isinstance(failed.error, InjectedFailure):
            raise
        # The failed step's forward and backward ran: it counts, with its batch.
        assert failed.began is not None and failed.step == FAIL_AT
        started.append(failed.began.batch_id)
        report["unstarted"] = [i.batch_id for i in failed.unstarted]
        report["started_at_failure"] = list(started)
        # What the rank actor does: the failed step counts, its dense update is settled, and
        # the unstarted batches go back to the front of the feed.
        assert engine.abandon_failed_step()
        engine.settle_failed_step(finish=True)
        queue[:0] = failed.unstarted
        train(STEPS - engine.step)
    report.update(started=started, losses=losses, state=_state(engine), step=engine.step)
    pipeline = engine.parts.stepper.pipeline
    if pipeline is not None:
        report["pipelined_modules"] = len(pipeline._pipelined_modules)
    return report


def _score_then_train(engine: RankEngine, batches: list[Batch]) -> dict[str, Any]:
    """An evaluation between intervals (a forward outside the pipeline), then more steps."""
    logits = engine.score(batches[0])[0].detach().cpu().numpy().copy()
    inputs = iter([StepInput(b, batch_id=i) for i, b in enumerate(batches[:3])])
    events = engine.train_steps(inputs, 3)
    losses = [float(e.loss) for e in events if isinstance(e, StepResult)]
    return {"logits": logits, "losses": losses, "state": _state(engine)}


class SourceBroke(RuntimeError):
    pass


def _a_source_that_fails(engine: RankEngine, batches: list[Batch]) -> dict[str, Any]:
    """The inputs' source fails after four inputs, then training goes on from what is left."""
    items = [StepInput(b, batch_id=i) for i, b in enumerate(batches[:6])]
    trained: list[int | None] = []
    losses: list[float] = []
    out: dict[str, Any] = {"began": "none raised"}

    def source() -> Iterator[StepInput]:
        yield from items[:4]
        raise SourceBroke("the feed failed")

    def train(inputs: Iterator[StepInput]) -> None:
        for event in engine.run_steps(inputs):
            if isinstance(event, StepResult):
                trained.append(event.batch_id)
                losses.append(float(event.loss))

    left = items[4:]
    try:
        train(source())
    except SourceBroke:  # the synchronous engine: the source's error as it is, between steps
        out["began"] = None
    except StepFailed as failed:
        assert isinstance(failed.error, SourceBroke)
        out["began"] = None if failed.began is None else failed.began.batch_id
        out["unstarted"] = [i.batch_id for i in failed.unstarted]
        left = [*failed.unstarted, *left]
    out["trained_at_failure"] = list(trained)
    train(iter(left))
    out.update(trained=trained, losses=losses, state=_state(engine), step=engine.step)
    return out


def pipeline_job(spec: RankSpec, stores: list[Any]) -> dict[tuple[str, bool], Any]:
    torch.manual_seed(0)
    batches = list(itertools.islice(SOURCE.split(G * L)[spec.rank].batches(8), STEPS))
    out = {}
    for (pipeline, fail), store in zip(RUNS, [spec.store, *stores], strict=True):
        config = CONFIG.replace(train_pipeline=pipeline)
        run = dataclasses.replace(spec, config=config, store=store)
        with engine_for(run) as engine:
            out[pipeline, fail] = _train(engine, batches, fail=fail)
            if not fail:
                out[pipeline, fail]["then"] = _score_then_train(engine, batches)
                out[pipeline, fail]["source_failed"] = _a_source_that_fails(engine, batches)
    return out


@pytest.fixture(scope="module")
def results() -> dict[int, dict[tuple[str, bool], Any]]:
    return run_gang_job(
        pipeline_job,
        num_gangs=G,
        gang_size=L,
        config=CONFIG,
        plan=make_plan_for(CONFIG, NUM_DENSE),
        num_dense=NUM_DENSE,
        extra_stores=len(RUNS) - 1,
    )


def _assert_same_run(a: dict[str, Any], b: dict[str, Any]) -> None:
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]))
    assert len(a["state"]) == len(b["state"])
    for x, y in zip(a["state"], b["state"], strict=True):
        torch.testing.assert_close(torch.from_numpy(x), torch.from_numpy(y))


def test_pipelined_steps_train_what_synchronous_steps_train(
    results: dict[int, dict[tuple[str, bool], Any]],
) -> None:
    for rank, runs in results.items():
        sync, piped = runs["off", False], runs["sparse_dist", False]
        assert piped["pipelined_modules"] == 1, "the sharded EBC's input dist is pipelined"
        assert sync["started"] == piped["started"] == list(range(STEPS)), rank
        assert sync["step"] == piped["step"] == STEPS
        _assert_same_run(sync, piped)
        assert len(piped["losses"]) == STEPS
        # An evaluation detaches the pipeline from the model; the next steps attach it again.
        then_sync, then_piped = sync["then"], piped["then"]
        torch.testing.assert_close(
            torch.from_numpy(then_sync["logits"]), torch.from_numpy(then_piped["logits"])
        )
        _assert_same_run(then_sync, then_piped)


def test_a_failed_step_leaves_its_in_flight_batches_unstarted(
    results: dict[int, dict[tuple[str, bool], Any]],
) -> None:
    for rank, runs in results.items():
        sync, piped = runs["off", True], runs["sparse_dist", True]
        # The failed step (batch FAIL_AT - 1) began; the pipeline held the next two, which
        # nothing trained; the synchronous engine holds none.
        assert piped["started_at_failure"] == list(range(FAIL_AT)), rank
        assert piped["unstarted"] == [FAIL_AT, FAIL_AT + 1], rank
        assert sync["unstarted"] == []
        # Trained afterwards, first: every batch once, in order.
        assert sync["started"] == piped["started"] == list(range(STEPS)), rank
        _assert_same_run(sync, piped)
        # The failed step counted: the run still ends at STEPS steps, none of them taken twice.
        assert piped["step"] == STEPS


def test_a_source_failing_while_the_pipeline_fills_starts_no_step(
    results: dict[int, dict[tuple[str, bool], Any]],
) -> None:
    for rank, runs in results.items():
        sync = runs["off", False]["source_failed"]
        piped = runs["sparse_dist", False]["source_failed"]
        # The pipeline holds inputs 2 and 3 when it pulls a fifth for the step of input 2, and
        # the source fails: that step never began; 2 and 3 are unstarted.
        assert piped["began"] is None and sync["began"] is None, rank
        assert piped["trained_at_failure"] == [0, 1], rank
        assert piped["unstarted"] == [2, 3], rank
        assert sync["trained_at_failure"] == [0, 1, 2, 3], rank
        # Trained on from the unstarted inputs: every batch once, in order, as synchronously.
        assert piped["trained"] == sync["trained"] == list(range(6)), rank
        assert piped["step"] == sync["step"]
        _assert_same_run(sync, piped)
