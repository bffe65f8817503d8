"""A multiprocess harness that runs a G x L job of :class:`RankEngine` ranks on gloo (for tests
and benchmarks).

:func:`run_gang_job` hosts the job's rendezvous store, spawns one process per
rank, calls ``worker_fn(spec, **kwargs)`` in each and returns every rank's
(picklable) result. It never hangs: a worker's exception comes back as its
formatted traceback, and a crash, a missing result or the deadline ends the
job, terminates the surviving processes and raises :class:`GangJobError`.

Worker functions must be module-level (they are pickled by reference into the
spawned processes). Results travel as ``pickle.dumps`` bytes, so numpy arrays
and plain Python values are the safe things to return.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.types import ShardingPlan

from raytrec._quiet import quiet_known_warnings
from raytrec.config import TrainConfig
from raytrec.engine import touched_rows
from raytrec.engine.plan import apply_embedding_optimizer, make_plan
from raytrec.engine.rank_engine import RankEngine, RankSpec, StoreAddress
from raytrec.engine.replica_plane import ReplicaPlane
from raytrec.engine.replica_sync import ReplicaSync
from raytrec.models import build_train_model

__all__ = [
    "GangJobError",
    "count_sync_collectives",
    "engine_for",
    "make_plan_for",
    "run_gang_job",
    "whole_sync_below",
]

_HOST = "127.0.0.1"
_POLL_S = 0.2
_GRACE_S = 5.0
_FOLLOWUP_S = 1.0


class GangJobError(RuntimeError):
    """A rank of a :func:`run_gang_job` job failed, died or ran past the deadline."""


def make_plan_for(config: TrainConfig, num_dense: int) -> ShardingPlan:
    """The job's single sharding plan, made for ``config.scaling.gang_size`` CPU ranks."""
    quiet_known_warnings()
    model = build_train_model(config.model, num_dense, torch.device("cpu"), config.seed)
    apply_embedding_optimizer(model, config.optimizer)
    return make_plan(
        model,
        gang_size=config.scaling.gang_size,
        device_type="cpu",
        sharding=config.sharding,
        tables=config.model.tables,
        batch_size=config.data.batch_size,
    )


@contextlib.contextmanager
def engine_for(spec: RankSpec, *, generation: int = 0) -> Iterator[RankEngine]:
    """A built engine that has joined its replica group (rank ``spec.gang``); closed on exit."""
    engine = RankEngine(spec)
    try:
        engine.build()
        engine.join_replica_plane(
            generation=generation, member_rank=spec.gang, size=spec.config.scaling.num_gangs
        )
        yield engine
    finally:
        engine.close()


@contextlib.contextmanager
def whole_sync_below(nbytes: int) -> Iterator[None]:
    """In this process, for the block: shards whose whole sync carries fewer than ``nbytes`` are
    synced whole whatever ``sync.rows`` says (0: a touched sync takes the touched path on the
    smallest tables), as :data:`raytrec.engine.touched_rows.WHOLE_SYNC_BELOW_BYTES` does."""
    before = touched_rows.WHOLE_SYNC_BELOW_BYTES
    touched_rows.WHOLE_SYNC_BELOW_BYTES = nbytes
    try:
        yield
    finally:
        touched_rows.WHOLE_SYNC_BELOW_BYTES = before


_WAITS = [0]  # replica-plane collectives this process waited for, once counting
_SYNC_COLLECTIVES: list[int] = []  # per ReplicaSync.sync, in order


def count_sync_collectives() -> list[int]:
    """From now on in this process, each :meth:`ReplicaSync.sync` appends to the returned list
    how many replica-plane collectives it ran (every one is waited for in
    :meth:`ReplicaPlane._wait`)."""
    wait, sync = ReplicaPlane._wait, ReplicaSync.sync
    if not getattr(wait, "counted", False):

        def counted_wait(plane: ReplicaPlane, work: Any) -> None:
            _WAITS[0] += 1
            wait(plane, work)

        def counted_sync(self: ReplicaSync, *args: Any, **kwargs: Any) -> None:
            before = _WAITS[0]
            sync(self, *args, **kwargs)
            _SYNC_COLLECTIVES.append(_WAITS[0] - before)

        counted_wait.counted = True  # type: ignore[attr-defined]
        ReplicaPlane._wait = counted_wait  # type: ignore[method-assign,assignment]
        ReplicaSync.sync = counted_sync  # type: ignore[method-assign]
    return _SYNC_COLLECTIVES


def _child(
    worker_fn: Callable[..., Any],
    spec: RankSpec,
    kwargs: dict[str, Any],
    results: Any,
) -> None:
    """Entry point of a rank process: reports ``(rank, ok, payload)`` on ``results``."""
    try:
        payload = pickle.dumps(worker_fn(spec, **kwargs))
        ok = True
    except BaseException:
        payload = traceback.format_exc().encode()
        ok = False
    results.put((spec.rank, ok, payload))
    results.close()
    results.join_thread()  # flush before exiting, so the parent always gets the report
    # Skip interpreter teardown (seconds with torchrec loaded): the report is out and the
    # worker has closed its engine.
    os._exit(0 if ok else 1)


def _failure_report(rank: int, payload: bytes, results: Any, procs: list[BaseProcess]) -> str:
    """The first failure's traceback, then any other rank's that arrives within a moment.

    The first report is usually the cause; the others (peers whose collectives broke)
    help when it is not.
    """
    report = [f"rank {rank} failed:\n{payload.decode()}"]
    deadline = time.monotonic() + _FOLLOWUP_S
    while (left := deadline - time.monotonic()) > 0:
        try:
            other, ok, data = results.get(timeout=left)
        except queue.Empty:
            break
        if not ok:
            report.append(f"rank {other} also failed:\n{data.decode()}")
    exited = [f"{p.name} (code {p.exitcode})" for p in procs if p.exitcode not in (None, 1)]
    if exited:  # e.g. a peer that died without a report and broke the collectives
        report.append(f"processes that exited otherwise: {', '.join(exited)}")
    return "\n".join(report)


def _stop(procs: list[BaseProcess]) -> None:
    """Terminates, then kills, the given processes that are still alive; reaps them all."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + _GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(_GRACE_S)


def run_gang_job(
    worker_fn: Callable[..., Any],
    *,
    num_gangs: int,
    gang_size: int,
    config: TrainConfig,
    plan: ShardingPlan,
    num_dense: int,
    timeout_s: float = 120.0,
    extra_stores: int = 0,
    may_die: frozenset[int] = frozenset(),
    **kwargs: Any,
) -> dict[int, Any]:
    """Runs ``worker_fn(spec, **kwargs)`` on every rank of a ``num_gangs x gang_size`` job.

    Rank ``r`` is in gang ``r // gang_size`` with gang rank ``r % gang_size``.
    Returns ``{rank: result}``; raises :class:`GangJobError` (with the failing
    rank's traceback where there is one) if any rank raises, exits without a
    result, or the job is not done within ``timeout_s`` seconds.

    A gang world cannot be re-formed on a store it has already used, so a
    worker that builds several engines in turn (one launch, several configs)
    asks for ``extra_stores``: it then also gets ``stores=[StoreAddress, ...]``,
    one fresh store per further engine, to put in ``dataclasses.replace(spec,
    store=...)``.

    Ranks in ``may_die`` may end without a result (a test kills them): their result is None.
    """
    world = num_gangs * gang_size
    timeout = timedelta(seconds=timeout_s)
    stores = [
        dist.TCPStore(_HOST, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        for _ in range(1 + extra_stores)
    ]
    address = StoreAddress(host=_HOST, port=stores[0].port)
    if extra_stores:
        kwargs["stores"] = [StoreAddress(host=_HOST, port=s.port) for s in stores[1:]]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs: list[BaseProcess] = []
    out: dict[int, Any] = {}
    try:
        for rank in range(world):
            spec = RankSpec(
                rank=rank,
                gang=rank // gang_size,
                gang_rank=rank % gang_size,
                gang_size=gang_size,
                config=config,
                plan=plan,
                num_dense=num_dense,
                store=address,
                timeout_s=timeout_s,
            )
            proc = ctx.Process(
                target=_child,
                args=(worker_fn, spec, kwargs, results),
                name=f"rank{rank}",
                daemon=True,
            )
            proc.start()
            procs.append(proc)
        deadline = time.monotonic() + timeout_s
        dead_since: dict[int, float] = {}
        while len(out) < world:
            try:
                rank, ok, payload = results.get(timeout=_POLL_S)
            except queue.Empty:
                now = time.monotonic()
                for rank, p in enumerate(procs):
                    if rank in out or p.exitcode is None:
                        continue
                    if rank in may_die:
                        out[rank] = None
                        continue
                    # Exited without a report (a segfault, os._exit): allow a moment for a
                    # report still in the pipe, then fail.
                    if now - dead_since.setdefault(rank, now) > _GRACE_S:
                        raise GangJobError(
                            f"rank {rank} exited with code {p.exitcode} without a result"
                        ) from None
                if now > deadline:
                    missing = sorted(set(range(world)) - set(out))
                    raise GangJobError(
                        f"job not done after {timeout_s:.0f}s; ranks {missing} gave no result"
                    ) from None
                continue
            if not ok:
                raise GangJobError(_failure_report(rank, payload, results, procs))
            out[rank] = pickle.loads(payload)
        for p in procs:
            p.join(_GRACE_S)
        failed = {
            p.name: p.exitcode
            for rank, p in enumerate(procs)
            if p.exitcode not in (0, None) and rank not in may_die
        }
        if failed:
            raise GangJobError(f"ranks exited non-zero after reporting: {failed}")
        return out
    finally:
        _stop(procs)
        results.close()
        results.cancel_join_thread()
        del stores


def run_steps(engine: RankEngine, batches: Iterator[Any], num_steps: int) -> list[float]:
    """Trains ``num_steps`` steps on ``engine``, syncing after each as its schedule decides."""
    losses = []
    for _ in range(num_steps):
        losses.append(float(engine.train_step(next(batches)).loss))
        decision = engine.decide(engine.step)
        if decision.due:
            engine.sync(decision)
    return losses
