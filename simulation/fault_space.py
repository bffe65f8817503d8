"""Fault schedules run through the real control plane (deterministic simulation).

:func:`run_schedule` runs a :class:`~simulation.fault_schedule.Schedule` (drawn from a seed by
:func:`~simulation.fault_schedule.generate`) through the real
:class:`~actors.coordinator.Coordinator` over the fake worker group
(:mod:`simulation.doubles.fake_group`) and a manual clock, and classifies how it ended:

- ``pass``: the job finished (or stopped on request) with every batch it trained committed
  exactly once, every row of its data trained (Parquet read by index) and replicas identical;
  ``left over``: on re-shared rows, a loss in the last steps left replays beyond the end of the
  data untrained (a documented limit, counted in the lost batches);
- ``failed``: a documented, named failure (:class:`~raytrec.errors.JobFailedError`,
  :class:`~raytrec.errors.ConfigError`), with the exit code ``python -m jobs.train`` gives it;
- ``defect``: anything else: another exception, a call the fake refuses
  (:class:`~simulation.doubles.fake_group.FakeUsageError`), a broken invariant, or a hang (the
  clock, call or wall budget ran out).

A failing schedule is replayed from one line (:func:`~simulation.fault_schedule.reproducer`),
after :mod:`simulation.fault_campaign` shrank it to the fewest faults that still fail.
"""

from __future__ import annotations

import atexit
import dataclasses
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from raytrec.elastic.events import CoordinatorLost, CoordinatorRestarted
from raytrec.elastic.journal import read_journal, replay
from raytrec.elastic.rank_protocol import RankProtocol
from raytrec.elastic.workers import Answer
from raytrec.errors import ConfigError, JobFailedError
from raytrec.restarts import CoordinatorSeat
from simulation.coordinator_loss import (
    CoordinatorDies,
    CoordinatorKilled,
    LosableGroup,
    kill_coordinator,
)
from simulation.doubles import fake_faults as ff
from simulation.doubles.fake_group import FakeUsageError
from simulation.fault_invariants import check_invariants
from simulation.fault_schedule import BATCH_SIZE, KINDS, MAX_STEPS, Schedule, Settings

if TYPE_CHECKING:
    from actors.coordinator import Coordinator
    from raytrec.elastic.run_record import RunSummary

__all__ = ["Hang", "Outcome", "parquet_shards", "run_schedule"]

R = TypeVar("R")

#: Exit codes of ``python -m jobs.train`` for the named failures (jobs/train.py).
EXIT_CODES = {"JobFailedError": 1, "CoordinatorDied": 1, "ConfigError": 2, "StopRequested": 4}

STEP_S = 0.1
BUILD_S = 1.0
ELASTIC = {"collective_timeout_s": 10.0, "step_timeout_s": 30.0, "poll_s": 1.0}


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How a schedule ended: ``verdict`` ``pass``, ``failed`` or ``defect``; ``name``: the
    named failure or the defect's kind; ``detail``: its message; ``phases``: where each fault
    that fired landed."""

    verdict: str
    name: str = ""
    detail: str = ""
    exit_code: int = 0
    phases: tuple[str, ...] = ()
    steps: int = 0
    wall_s: float = 0.0

    @property
    def key(self) -> str:
        """What two failing schedules must share to count as the same failure."""
        return f"{self.verdict}:{self.name}"


class Hang(BaseException):
    """The job ran past its budget of clock time, calls or wall time (BaseException: no
    handler of the coordinator's may take it for a failure of its own)."""


class _Budget:
    def __init__(self, clock_s: float, calls: int, wall_s: float) -> None:
        self.clock_s, self.calls, self.wall_s = clock_s, calls, wall_s
        self.made = 0
        self.deadline = time.monotonic() + wall_s

    def tick(self) -> None:
        self.made += 1
        if self.made > self.calls:
            raise Hang(f"more than {self.calls} rank calls")
        if self.made % 64 == 0 and time.monotonic() > self.deadline:
            raise Hang(f"more than {self.wall_s:g}s of wall time")


class _BudgetedGroup(LosableGroup):
    budget: _Budget

    def call(
        self, ranks: Sequence[int], invoke: Callable[[RankProtocol, int], R]
    ) -> dict[int, Answer[R]]:
        self.budget.tick()
        return super().call(ranks, invoke)


def run_schedule(
    schedule: Schedule,
    *,
    clock_budget_s: float = 200_000.0,
    call_budget: int = 20_000,
    wall_budget_s: float = 20.0,
) -> Outcome:
    """Runs ``schedule`` through the real coordinator over the fake and classifies how it ended
    (module doc)."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fault-space-") as run_dir:
        phases: list[str] = []
        try:
            seat, group = _build(schedule, run_dir, phases)
        except (ConfigError, ValueError) as e:
            return Outcome("defect", "bad schedule", f"{type(e).__name__}: {e}")
        group.budget = _Budget(clock_budget_s, call_budget, wall_budget_s)

        def over_time() -> None:
            if group.clock.now > clock_budget_s:
                raise Hang(f"the clock passed {clock_budget_s:g}s")

        group.clock.on_advance(over_time)
        summary: RunSummary | None = None
        try:
            summary = _follow(seat)
        except (JobFailedError, ConfigError) as e:
            name = type(e).__name__
            return _done("failed", name, _named(str(e)), t0, phases, seat.current, EXIT_CODES[name])
        except Hang as e:
            return _done("defect", "hang", str(e), t0, phases, seat.current)
        except FakeUsageError as e:
            return _done("defect", "FakeUsageError", _where(e), t0, phases, seat.current)
        except Exception as e:
            return _done("defect", type(e).__name__, _where(e), t0, phases, seat.current)
        job = seat.current
        problems = check_invariants(summary, group, job, schedule.settings)
        problems += journal_agrees(summary, job, seat.restarts)
        if problems:
            return _done("defect", "invariant", "; ".join(problems), t0, phases, job)
        stopped = summary.stopped_by
        name = "" if stopped is None else type(stopped).__name__
        if stopped is None and summary.lost_batches:
            detail = f"{summary.lost_batches} replays beyond the end of the data"
            return _done("pass", "left over", detail, t0, phases, job)
        code = EXIT_CODES.get(name, 0 if stopped is None else 1)
        return _done("pass", name, "" if stopped is None else str(stopped), t0, phases, job, code)


def _follow(seat: CoordinatorSeat) -> RunSummary:
    """Runs the job's coordinator; when it dies, the next one as the driver would start it
    (:meth:`~raytrec.restarts.CoordinatorSeat.lost`), until one ends the job."""
    while True:
        try:
            return seat.current.run()
        except CoordinatorKilled as e:
            seat.lost(e, stop_asked=seat.current.boundary.stop_asked())


def journal_agrees(summary: RunSummary, job: Coordinator, restarts: int) -> list[str]:
    """The run's journal against the job's own ledger: its last commit counts the batches the
    summary does, and it names every restart."""
    state = replay(read_journal(job.run_dir))
    problems: list[str] = []
    journaled = state.commit.committed_count if state.commit is not None else 0
    if journaled != summary.committed_count:
        problems.append(
            f"the journal counts {journaled} committed, the summary {summary.committed_count}"
        )
    if state.restarts != restarts:
        problems.append(f"the journal names {state.restarts} restarts, the run made {restarts}")
    return problems


def _done(
    verdict: str,
    name: str,
    detail: str,
    t0: float,
    phases: list[str],
    job: Coordinator,
    exit_code: int = 0,
) -> Outcome:
    return Outcome(
        verdict,
        name,
        detail,
        exit_code,
        tuple(phases),
        job.state.step,
        round(time.monotonic() - t0, 4),
    )


def _named(message: str) -> str:
    """A failure's message without the numbers that differ between schedules."""
    return " ".join(message.split())[:300]


def _where(e: BaseException) -> str:
    """The exception and the innermost frame of this project that raised it."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "site-packages" not in f.filename]
    at = f" at {frames[-1].filename.rsplit('/', 2)[-1]}:{frames[-1].lineno}" if frames else ""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}{at}"


def _build(schedule: Schedule, run_dir: str, phases: list[str]) -> tuple[CoordinatorSeat, Any]:
    from actors.coordinator import Coordinator
    from raytrec.checkpoint.config import CheckpointConfig
    from raytrec.cluster.topology import Layout
    from raytrec.config import DataConfig, ScalingConfig, SyncConfig, TestingConfig, TrainConfig
    from raytrec.elastic.config import ElasticConfig
    from raytrec.elastic.drain_policy import request_drain
    from raytrec.elastic.faults import FaultKind, FaultSpec
    from raytrec.preflight import indexed_resume_shards

    s = schedule.settings
    cfg = TrainConfig(
        scaling=ScalingConfig(
            num_workers=s.world,
            gang_size=s.gang_size,
            ranks_per_host=s.ranks_per_host,
            layout=Layout(s.layout),
        ),
        data=DataConfig(batch_size=BATCH_SIZE),
        sync=SyncConfig(sync_every=s.sync_every, levels=s.levels),
        elastic=ElasticConfig(
            grow=s.grow,
            min_gangs=s.min_gangs,
            max_gangs=s.max_gangs,
            resource_wait_s=60.0,
            collective_timeout_s=ELASTIC["collective_timeout_s"],
            step_timeout_s=ELASTIC["step_timeout_s"],
            poll_s=ELASTIC["poll_s"],
            max_coordinator_restarts=s.max_coordinator_restarts,
        ),
        checkpoint=CheckpointConfig(every_n_steps=s.checkpoint_every),
        num_steps=s.num_steps,
        log_every=s.log_every,
        storage_path=run_dir,
        # A coordinator_dies fault at a step: the coordinator's own kill_coordinator fault.
        testing=TestingConfig(
            faults=tuple(
                FaultSpec(kind=FaultKind.KILL_COORDINATOR, step=f["step"])
                for f in schedule.faults
                if f["kind"] == "coordinator_dies" and "on" not in f
            )
        ),
    )
    holder: list[CoordinatorSeat] = []

    def action(kind: str) -> Callable[[], object]:
        if kind == "drain":
            return lambda: request_drain(run_dir, gangs=1)
        return lambda: holder[0].current.request_stop()

    faults = [_to_fake(f, action) for f in schedule.faults]
    group = _BudgetedGroup(
        nodes=s.nodes,
        cpus_per_node=s.ranks_per_host,
        faults=[f for f in faults if f is not None],
        step_s=STEP_S,
        build_s=BUILD_S,
    )
    group.on_fire = lambda fault: phases.append(_phase(fault, s))
    source: Any = None
    if s.data == "reshared":
        source = parquet_source(s.world, s.num_steps, s.epochs)
        shards = list(source.split(s.world))
        new_shard = None  # the coordinator's stream table hands joiners their rows
    else:
        shards = [ff.FakeShard(i) for i in range(s.world)]
        new_shard = ff.FakeShard

    def killed_at_step() -> None:
        phases.append("CoordinatorDies @ booking a step")
        kill_coordinator()

    origin = group.clock.monotonic()  # every coordinator's times, and the seat's, from here

    def start(resume_from: str | None, attempt: int) -> Coordinator:
        """Coordinator ``attempt`` of the run, resuming from ``resume_from`` (as the driver's
        ``start_coordinator`` of raytrec/api.py)."""
        splits = shards
        if resume_from is not None and source is not None:
            splits = list(source.split(indexed_resume_shards(resume_from, cfg, source) or s.world))
        coordinator = Coordinator(
            cfg,
            plan=None,  # only the ranks read it
            shards=splits,
            num_dense=13,
            run_dir=run_dir,
            new_shard=new_shard,
            resume_from=resume_from,
            group=group,
            clock=group.clock,
            clock_origin=origin,
        )
        coordinator.journal.kill = killed_at_step
        return coordinator

    seat = CoordinatorSeat(
        start,
        run_dir=run_dir,
        max_restarts=s.max_coordinator_restarts,
        resume_from=None,
        on_row=lambda row: None,
        on_event=lambda event: (
            phases.append(f"{type(event).__name__} @ restart")
            if isinstance(event, CoordinatorLost | CoordinatorRestarted)
            else None
        ),
        release=group.coordinator_lost,
        clock=group.clock,
        origin=origin,
    )
    holder.append(seat)
    return seat, group


def _to_fake(
    f: Mapping[str, Any], action: Callable[[str], Callable[[], object]]
) -> ff.Fault | ff.NodesJoin | None:
    kind = f["kind"]
    call = {"on": f["on"], "nth": f.get("nth", 1)} if "on" in f else None
    if kind == "rank_dies":
        return ff.RankDies(rank=f["rank"], **(call or {"step": f["step"]}))
    if kind == "rank_hangs":
        if call is not None:
            return ff.RankHangs(rank=f["rank"], **call)
        return ff.RankHangs(rank=f.get("rank"), step=f["step"])
    if kind == "slow_rank":
        return ff.SlowRank(rank=f["rank"], step_s=f["step_s"])
    if kind == "node_dies":
        return ff.NodeDies(node=f["node"], step=f["step"])
    if kind == "node_drains":
        return ff.NodeDrains(node=f["node"], step=f["step"])
    if kind == "group_breaks":
        return ff.GroupBreaks(rank=f["rank"], on=f["on"], nth=f.get("nth", 1))
    if kind == "heal_lies":
        return ff.HealCorrupted(rank=f["rank"])
    if kind == "transient":
        return ff.RankFails(rank=f["rank"], step=f["step"], after_s=f.get("after_s", 0.0))
    if kind == "nodes_join":
        return ff.NodesJoin(at=f["at"], count=f.get("count", 1))
    if kind == "coordinator_dies":
        if call is None:
            return None  # at a step: the coordinator's own kill_coordinator fault
        return CoordinatorDies(rank=f["rank"], action=kill_coordinator, **call)
    if kind in ("drain", "stop"):
        if call is not None:
            return ff.AtCall(rank=f["rank"], action=action(kind), **call)
        return ff.AtStep(step=f["step"], action=action(kind))
    raise ValueError(f"no fault kind {kind!r}; allowed: {KINDS}")


# What the coordinator was doing when a fault fired: the innermost of these of its functions
# on the stack (module, function) names the phase.
_PHASES = {
    ("job_loop", "_starting"): "start",
    ("job_loop", "_forming"): "start",
    ("job_training", "_dispatch"): "interval",
    ("job_loop", "_finishing"): "final sync",
    ("job_loop", "_preparing"): "first prepare",
    ("job_training", "_running"): "boundary",
    ("job_training", "_at_boundary"): "boundary",
    ("job_training", "_evaluate"): "evaluation",
    ("checkpoints", "save"): "checkpoint save",
    ("recovery", "collect"): "interval",
    ("recovery", "settle_queued"): "queued interval",
    ("recovery", "probe"): "probe",
    ("job_loop", "_recovering"): "re-forming",
    ("job_loop", "_rebuilding"): "total-loss rebuild",
    ("job_loop", "_placing"): "resource wait",
    ("job_training", "_waiting"): "resource wait",
    ("growth", "start_ready"): "join: building",
    ("growth", "join"): "join",
    ("growth", "_verify_heals"): "join: verifying",
    ("drain", "apply"): "drain",
}
_JOIN_STAGES = {
    "sync": "join: sync",
    "join_replica_plane": "join: placed",
    "join_sync_plan": "join: placed",
    "set_step": "join: placed",
    "broadcast_state": "join: healing",
    "state_digest": "join: verifying",
    "set_shard": "join: handing off rows",
    "set_streams": "join: handing off rows",
    "prepare": "join: handing off rows",
}


def _phase(fault: ff.Fault | ff.NodesJoin, s: Settings) -> str:
    """Where ``fault`` fired, from the coordinator's frames on the stack."""
    kind = type(fault).__name__
    on = getattr(fault, "on", None)
    if isinstance(fault, ff.NodesJoin | ff.SlowRank):
        return f"{kind} @ {'late placement' if isinstance(fault, ff.NodesJoin) else 'start'}"
    if on is None:
        step = getattr(fault, "step", None)
        if step is None:
            return f"{kind} @ heal"
        where = "interval"
        if step > s.num_steps - s.log_every:
            where = "last steps"
        elif step % s.sync_every == 0:
            where = "sync step"
        return f"{kind} @ {where}"
    frame = sys._getframe(1)
    found: list[str] = []  # innermost first
    while frame is not None:
        module = frame.f_code.co_filename.rsplit("/", 1)[-1].removesuffix(".py")
        name = _PHASES.get((module, frame.f_code.co_name))
        if name is not None:
            found.append(_JOIN_STAGES.get(on, "join") if name == "join" else name)
        frame = frame.f_back  # type: ignore[assignment]
    phase = found[0] if found else "other"
    # A join, a build or a probe inside a wait for resources or a rebuild says so.
    outer = [p for p in ("resource wait", "total-loss rebuild") if p in found[1:]]
    if outer and outer[0] != phase:
        phase = f"{outer[0]} > {phase}"
    return f"{kind} @ {phase} / {on}"


# -- data -------------------------------------------------------------------------------------

_PARQUET: dict[tuple[int, int], Any] = {}  # (rows, epochs) -> the source over a tiny file
_DATA_ROOT: list[str] = []  # the folder they are written in, made once per campaign


def data_root() -> str:
    """The temporary folder that the schedules' Parquet files go in, removed when the process
    that made it exits. A campaign makes it before it forks its workers, which exit without
    running exit handlers; so their files are removed with their parent's folder."""
    if not _DATA_ROOT:
        _DATA_ROOT.append(tempfile.mkdtemp(prefix="fault-space-data-"))
        atexit.register(shutil.rmtree, _DATA_ROOT[0], ignore_errors=True)
    return _DATA_ROOT[0]


def parquet_shards(world: int, num_steps: int, epochs: int = 1) -> list[Any]:
    """``world`` shards of :func:`parquet_source`."""
    return list(parquet_source(world, num_steps, epochs).split(world))


def parquet_source(world: int, num_steps: int, epochs: int = 1) -> Any:
    """Parquet read by index over a tiny generated file (one per process, world size and
    number of epochs, in :func:`data_root`), read ``epochs`` times, with a few batches more per
    rank than the job takes."""
    from raytrec.data.generate import write_synthetic_parquet
    from raytrec.data.parquet import ParquetSource
    from raytrec.data.spec import criteo_spec

    rows = world * -(-(max(num_steps, MAX_STEPS) + 2) // epochs) * BATCH_SIZE
    source = _PARQUET.get((rows, epochs))
    if source is None:
        out = tempfile.mkdtemp(prefix=f"{rows}-{epochs}-", dir=data_root())
        write_synthetic_parquet(
            out, rows=rows, files=2, row_groups_per_file=2, seed=1, num_embeddings=50
        )
        source = ParquetSource(paths=out, spec=criteo_spec(50), read_mode="indexed", epochs=epochs)
        _PARQUET[(rows, epochs)] = source
    return source
