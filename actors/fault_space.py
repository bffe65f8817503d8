"""Seeded random fault schedules run through the real control plane (deterministic simulation).

A :class:`Schedule` is a job's settings (gangs, gang size, layout, sync and log periods, steps,
checkpoints, growth, data source) and up to a few faults, each at a step or at one of a rank's
calls (its ``nth`` call of a :class:`~actors.rank.RankWorker` method): so a fault lands inside
an interval, at a sync, at a checkpoint save, at any stage of a join, inside any call of a
re-forming or of a rebuild after a total loss, at the final sync. :func:`generate` draws one from
a seed; :func:`run_schedule` runs the real :class:`~actors.coordinator.Coordinator` over the
fake worker group (:mod:`raytrec.testing.fake_group`) and a manual clock and classifies the outcome:

- ``pass``: the job finished (or stopped on request) with every batch it trained committed
  exactly once, every row of its data trained (Parquet read by index) and replicas identical;
  ``left over``: on re-shared rows, a loss in the last steps left replays beyond the end of the
  data untrained (a documented limit, counted in the lost batches);
- ``failed``: a documented, named failure (:class:`~raytrec.errors.JobFailedError`,
  :class:`~raytrec.errors.ConfigError`), with the exit code ``python -m jobs.train`` gives it;
- ``defect``: anything else: another exception, a call the fake refuses
  (:class:`~raytrec.testing.fake_group.FakeUsageError`), a broken invariant, or a hang (the clock,
  call or wall budget ran out).

Schedules are JSON, so a failing one is replayed from one line (:func:`reproducer`), after
:mod:`actors.fault_campaign` shrank it to the fewest faults that still fail.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from raytrec.data.synthetic import split_batch_id
from raytrec.elastic.rank_protocol import RankProtocol
from raytrec.elastic.workers import Answer
from raytrec.errors import ConfigError, JobFailedError
from raytrec.testing import fake_faults as ff
from raytrec.testing.fake_group import FakeUsageError, FakeWorkerGroup

if TYPE_CHECKING:
    from actors.coordinator import Coordinator
    from raytrec.elastic.report import RunSummary

__all__ = [
    "CALLS",
    "KINDS",
    "Outcome",
    "Schedule",
    "Settings",
    "generate",
    "reproducer",
    "run_schedule",
]

R = TypeVar("R")

#: Exit codes of ``python -m jobs.train`` for the named failures (jobs/train.py).
EXIT_CODES = {"JobFailedError": 1, "ConfigError": 2, "StopRequested": 4}

#: The rank calls a fault can land in (the coordinator's calls of RankWorker methods).
CALLS = (
    "build",
    "join_replica_plane",
    "join_sync_plan",
    "prepare",
    "train",
    "set_step",
    "step",
    "recover",
    "replay",
    "set_shard",
    "set_streams",
    "abort_replica_planes",
    "state_digest",
    "sync",
    "broadcast_state",
    "broadcast_dense",
    "settle_failed_step",
    "save_checkpoint",
    "load_checkpoint",
    "save",
)

#: The fault kinds a schedule holds.
KINDS = (
    "rank_dies",
    "rank_hangs",
    "slow_rank",
    "node_dies",
    "group_breaks",
    "heal_lies",
    "transient",
    "nodes_join",
    "node_drains",
    "drain",
    "stop",
)

BATCH_SIZE = 8
STEP_S = 0.1
BUILD_S = 1.0
ELASTIC = {"collective_timeout_s": 10.0, "step_timeout_s": 30.0, "poll_s": 1.0}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    """A job's shape for one schedule (all small: the fake's cost grows with ranks x steps)."""

    gangs: int = 3
    gang_size: int = 2
    layout: str = "replicas_across_hosts"
    sync_every: int = 4
    log_every: int = 2
    num_steps: int = 16
    checkpoint_every: int | None = None
    grow: bool = False
    min_gangs: int = 1
    max_gangs: int | None = None
    spare_nodes: int = 0
    data: str = "synthetic"  # or "reshared": Parquet read by index, rows shared again

    def __post_init__(self) -> None:
        if self.data not in ("synthetic", "reshared"):
            raise ValueError(f"Settings.data must be 'synthetic' or 'reshared', got {self.data!r}")
        if self.layout not in ("replicas_across_hosts", "replicas_within_host"):
            raise ValueError(f"Settings.layout is not a layout: {self.layout!r}")

    @property
    def world(self) -> int:
        return self.gangs * self.gang_size

    @property
    def ranks_per_host(self) -> int:
        return self.gang_size if self.layout == "replicas_across_hosts" else self.gangs

    @property
    def nodes(self) -> int:
        return self.world // self.ranks_per_host + self.spare_nodes


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Settings and faults (each a dict with a ``kind`` of :data:`KINDS`), as JSON."""

    settings: Settings
    faults: tuple[Mapping[str, Any], ...] = ()
    seed: int | None = None

    def to_json(self) -> str:
        out: dict[str, Any] = {
            "settings": dataclasses.asdict(self.settings),
            "faults": [dict(f) for f in self.faults],
        }
        if self.seed is not None:
            out["seed"] = self.seed
        return json.dumps(out, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        raw = json.loads(text)
        unknown = set(raw) - {"settings", "faults", "seed"}
        if unknown:
            raise ValueError(f"a schedule has keys settings, faults, seed; got {sorted(unknown)}")
        faults = tuple(raw.get("faults", ()))
        for f in faults:
            if f.get("kind") not in KINDS:
                raise ValueError(f"fault {f} has no kind of {KINDS}")
        return cls(Settings(**raw["settings"]), faults, raw.get("seed"))


def reproducer(schedule: Schedule) -> str:
    """One shell line that runs ``schedule`` again and prints its outcome."""
    return f"python -m jobs.fault_space --replay '{schedule.to_json()}'"


# -- generating -------------------------------------------------------------------------------


def generate(seed: int) -> Schedule:
    """A random schedule: the same ``seed`` gives the same schedule."""
    rng = random.Random(seed)
    gangs = rng.randint(2, 4)
    gang_size = rng.randint(1, 2)
    layout = rng.choice(["replicas_across_hosts"] * 3 + ["replicas_within_host"])
    sync_every = rng.choice([1, 2, 4])
    log_every = rng.choice([1, 2, 3, 4])
    num_steps = rng.randint(6, MAX_STEPS)
    grow = layout == "replicas_across_hosts" and rng.random() < 0.5
    max_gangs = gangs + rng.randint(0, 1) if grow else None
    settings = Settings(
        gangs=gangs,
        gang_size=gang_size,
        layout=layout,
        sync_every=sync_every,
        log_every=log_every,
        num_steps=num_steps,
        checkpoint_every=rng.choice([None, None, 2, 4, 5]),
        grow=grow,
        min_gangs=rng.choice([1, 1, 1, 2]) if gangs > 2 else 1,
        max_gangs=max_gangs,
        spare_nodes=rng.choice([0, 0, 1, 2]),
        data=rng.choice(["synthetic", "reshared"]),
    )
    faults = [_fault(rng, settings) for _ in range(rng.choice([0, 1, 1, 2, 2, 3, 4]))]
    storm = rng.random()
    if storm < 0.15 and settings.layout == "replicas_across_hosts":
        # A joiner's rank fails at one stage of its join.
        settings = dataclasses.replace(
            settings, grow=True, max_gangs=settings.gangs + 1, spare_nodes=1
        )
        kind = rng.choice(["rank_dies", "rank_dies", "rank_hangs", "drain", "stop", "heal_lies"])
        rank = settings.world + rng.randrange(settings.gang_size)
        on = rng.choice(_JOIN_CALLS)
        fault = {"kind": kind, "rank": rank} | ({} if kind == "heal_lies" else {"on": on})
        faults[:1] = [fault]
        if rng.random() < 0.5:  # after a loss, below min_gangs: the join is awaited
            settings = dataclasses.replace(settings, min_gangs=settings.gangs)
            faults[1:2] = [{"kind": "rank_dies", "rank": 0, "step": 2}]
    elif storm < 0.25:
        # Every rank hangs: a total loss, rebuilt from a checkpoint by new ranks, one of which
        # fails in the rebuild (or nodes are missing and the rebuild waits for them).
        settings = dataclasses.replace(settings, checkpoint_every=2)
        rank = settings.world + rng.randrange(settings.world)
        on = rng.choice(["build", "join_replica_plane", "load_checkpoint", "set_shard", "prepare"])
        second = rng.choice(
            [
                {"kind": "rank_dies", "rank": rank, "on": on},
                {"kind": "node_dies", "node": 0, "step": 3},
                {"kind": "stop", "rank": rank, "on": on},
            ]
        )
        faults[:2] = [{"kind": "rank_hangs", "step": 3}, second]
    elif storm < 0.32:
        # A control call fails, then a rank dies in the probe that follows.
        call = rng.choice(["sync", "set_step", "join_replica_plane", "state_digest"])
        faults[:2] = [
            {"kind": "rank_dies", "rank": 0, "on": call, "nth": rng.randint(1, 3)},
            {"kind": "rank_dies", "rank": settings.world - 1, "on": "step"},
        ]
    return Schedule(settings, tuple(faults), seed)


#: A joining gang's calls, stage by stage.
_JOIN_CALLS = (
    "build",
    "join_replica_plane",
    "set_step",
    "broadcast_state",
    "state_digest",
    "set_shard",
    "set_streams",
    "prepare",
)


def _fault(rng: random.Random, s: Settings) -> dict[str, Any]:
    kind = rng.choice(KINDS)
    # Ranks past the initial ones are joiners and the ranks of a rebuild.
    rank = rng.randrange(s.world)
    if rng.random() < 0.4:
        rank = s.world + rng.randrange(2 * s.gang_size * max(2, s.gangs))
    step = rng.randint(1, s.num_steps)
    node = rng.randrange(s.nodes + 1)
    at_call = rng.random() < 0.6
    call = {"on": rng.choice(CALLS), "nth": rng.choice([1, 1, 1, 2, 3])}
    if kind in ("rank_dies", "rank_hangs"):
        if kind == "rank_hangs" and not at_call and rng.random() < 0.2:
            return {"kind": kind, "step": step}  # every rank
        return {"kind": kind, "rank": rank, **(call if at_call else {"step": step})}
    if kind == "slow_rank":
        return {"kind": kind, "rank": rank, "step_s": rng.choice([0.5, 5.0, 40.0])}
    if kind in ("node_dies", "node_drains"):
        return {"kind": kind, "node": node, "step": step}
    if kind == "group_breaks":
        on = rng.choice(["sync", "broadcast_state", "broadcast_dense", "save_checkpoint"])
        return {"kind": kind, "rank": rank, "on": on, "nth": call["nth"]}
    if kind == "heal_lies":
        return {"kind": kind, "rank": rank}
    if kind == "transient":
        return {"kind": kind, "rank": rank, "step": step, "after_s": rng.choice([0.0, 10.0])}
    if kind == "nodes_join":
        return {"kind": kind, "at": round(rng.uniform(0.5, 6.0), 1), "count": rng.randint(1, 2)}
    # drain, stop: after a step, or as a call is made
    return {"kind": kind, **({"rank": rank, **call} if at_call else {"step": step})}


# -- running ----------------------------------------------------------------------------------


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


class _BudgetedGroup(FakeWorkerGroup):
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
            job, group = _build(schedule, run_dir, phases)
        except (ConfigError, ValueError) as e:
            return Outcome("defect", "bad schedule", f"{type(e).__name__}: {e}")
        group.budget = _Budget(clock_budget_s, call_budget, wall_budget_s)

        def over_time() -> None:
            if group.clock.now > clock_budget_s:
                raise Hang(f"the clock passed {clock_budget_s:g}s")

        group.clock.on_advance(over_time)
        summary: RunSummary | None = None
        try:
            summary = job.run()
        except (JobFailedError, ConfigError) as e:
            name = type(e).__name__
            return _done(
                "failed", name, _named(str(e)), t0, phases, job, exit_code=EXIT_CODES[name]
            )
        except Hang as e:
            return _done("defect", "hang", str(e), t0, phases, job)
        except FakeUsageError as e:
            return _done("defect", "FakeUsageError", _where(e), t0, phases, job)
        except Exception as e:
            return _done("defect", type(e).__name__, _where(e), t0, phases, job)
        problems = check_invariants(summary, group, job, schedule.settings)
        if problems:
            return _done("defect", "invariant", "; ".join(problems), t0, phases, job)
        stopped = summary.stopped_by
        name = "" if stopped is None else type(stopped).__name__
        if stopped is None and summary.lost_batches:
            detail = f"{summary.lost_batches} replays beyond the end of the data"
            return _done("pass", "left over", detail, t0, phases, job)
        code = EXIT_CODES.get(name, 0 if stopped is None else 1)
        return _done("pass", name, "" if stopped is None else str(stopped), t0, phases, job, code)


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
        job.step,
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


def _build(schedule: Schedule, run_dir: str, phases: list[str]) -> tuple[Coordinator, Any]:
    from actors.coordinator import Coordinator
    from raytrec.checkpoint.config import CheckpointConfig
    from raytrec.cluster.topology import Layout
    from raytrec.config import DataConfig, ScalingConfig, SyncConfig, TrainConfig
    from raytrec.elastic.config import ElasticConfig
    from raytrec.elastic.drain_policy import request_drain

    s = schedule.settings
    cfg = TrainConfig(
        scaling=ScalingConfig(
            num_workers=s.world,
            gang_size=s.gang_size,
            ranks_per_host=s.ranks_per_host,
            layout=Layout(s.layout),
        ),
        data=DataConfig(batch_size=BATCH_SIZE),
        sync=SyncConfig(sync_every=s.sync_every),
        elastic=ElasticConfig(
            grow=s.grow,
            min_gangs=s.min_gangs,
            max_gangs=s.max_gangs,
            resource_wait_s=60.0,
            collective_timeout_s=ELASTIC["collective_timeout_s"],
            step_timeout_s=ELASTIC["step_timeout_s"],
            poll_s=ELASTIC["poll_s"],
        ),
        checkpoint=CheckpointConfig(every_n_steps=s.checkpoint_every),
        num_steps=s.num_steps,
        log_every=s.log_every,
        storage_path=run_dir,
    )
    holder: list[Coordinator] = []

    def action(kind: str) -> Callable[[], object]:
        if kind == "drain":
            return lambda: request_drain(run_dir, gangs=1)
        return lambda: holder[0].request_stop()

    faults = [_to_fake(f, action) for f in schedule.faults]
    group = _BudgetedGroup(
        nodes=s.nodes,
        cpus_per_node=s.ranks_per_host,
        faults=[f for f in faults if f is not None],
        step_s=STEP_S,
        build_s=BUILD_S,
    )
    group.on_fire = lambda fault: phases.append(_phase(fault, s))
    shards: list[Any]
    if s.data == "reshared":
        shards = parquet_shards(s.world, s.num_steps)
        new_shard = None  # the coordinator's stream table hands joiners their rows
    else:
        shards = [ff.FakeShard(i) for i in range(s.world)]
        new_shard = ff.FakeShard
    coordinator = Coordinator(
        cfg,
        plan=None,  # only the ranks read it
        shards=shards,
        num_dense=13,
        run_dir=run_dir,
        new_shard=new_shard,
        group=group,
        clock=group.clock,
    )
    holder.append(coordinator)
    return coordinator, group


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
    if kind in ("drain", "stop"):
        if call is not None:
            return ff.AtCall(rank=f["rank"], action=action(kind), **call)
        return ff.AtStep(step=f["step"], action=action(kind))
    raise ValueError(f"no fault kind {kind!r}; allowed: {KINDS}")


# What the coordinator was doing when a fault fired: the innermost of these of its functions
# on the stack (module, function) names the phase.
_PHASES = {
    ("coordinator", "start"): "start",
    ("coordinator", "_dispatch"): "interval",
    ("coordinator", "_finish"): "final sync",
    ("coordinator", "run"): "first prepare",
    ("coordinator", "_train"): "boundary",
    ("coordinator", "_evaluate"): "evaluation",
    ("checkpoints", "maybe_save"): "checkpoint save",
    ("recovery", "collect"): "interval",
    ("recovery", "settle_queued"): "queued interval",
    ("recovery", "probe"): "probe",
    ("recovery", "recover"): "re-forming",
    ("total_loss", "_rebuild"): "total-loss rebuild",
    ("total_loss", "recover"): "total-loss rebuild",
    ("placement", "place_job"): "resource wait",
    ("growth", "wait_for_min_gangs"): "resource wait",
    ("growth", "_start_ready"): "join: building",
    ("growth", "_join_built"): "join",
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

_PARQUET: dict[int, Any] = {}  # rows -> the source over a tiny file of that many rows
MAX_STEPS = 24  # the most steps a generated schedule trains


def parquet_shards(world: int, num_steps: int) -> list[Any]:
    """``world`` shards of Parquet read by index over a tiny generated file (one per process
    and world size, in a temporary folder), with a few batches more per rank than the job
    takes."""
    from raytrec.data.generate import write_synthetic_parquet
    from raytrec.data.parquet import ParquetSource
    from raytrec.data.spec import criteo_spec

    rows = world * (max(num_steps, MAX_STEPS) + 2) * BATCH_SIZE
    source = _PARQUET.get(rows)
    if source is None:
        out = tempfile.mkdtemp(prefix=f"fault-space-data-{rows}-")
        write_synthetic_parquet(
            out, rows=rows, files=2, row_groups_per_file=2, seed=1, num_embeddings=50
        )
        source = ParquetSource(paths=out, spec=criteo_spec(50), read_mode="indexed")
        _PARQUET[rows] = source
    return list(source.split(world))


# -- the invariant ----------------------------------------------------------------------------


def check_invariants(
    summary: RunSummary, group: FakeWorkerGroup, job: Coordinator, s: Settings
) -> list[str]:
    """What is wrong with a finished job: every batch trained is in the final model once (the
    fake's record against the coordinator's committed ones), none lost, each stream's a gap-free
    prefix, replicas identical; with Parquet read by index, every row of the job's data trained
    (unless stopped early)."""
    problems: list[str] = []
    committed = [i for a, b in summary.committed_batches for i in range(a, b)]
    # A job stopped on request may hold replays not trained yet: its checkpoint books them
    # for a resume, and the summary counts them with the lost batches. So may a job on
    # re-shared rows that lost a gang in its last steps (a documented limit: replays the
    # others cannot even out, beyond the shortest rank's end).
    stopped = summary.stopped_by is not None
    pending = job.accounting.replay_pending() if stopped or s.data == "reshared" else 0
    if summary.lost_batches != pending:
        problems.append(f"{summary.lost_batches - pending} batches lost")
    if not summary.committed_count == len(committed) == len(set(committed)):
        problems.append(
            f"committed {summary.committed_count}, listed {len(committed)}, "
            f"distinct {len(set(committed))}"
        )
    if summary.final_state_path is not None:
        model = group.model_batches(summary.final_state_path)
        if model != collections.Counter(committed):
            extra = sorted((model - collections.Counter(committed)).elements())[:5]
            missing = sorted((collections.Counter(committed) - model).elements())[:5]
            problems.append(
                f"the final model differs from the committed batches: in the model only "
                f"{[split_batch_id(i) for i in extra]}, committed only "
                f"{[split_batch_id(i) for i in missing]}"
            )
    elif committed:
        problems.append("batches committed but no final model saved")
    # Those replays are the only batches a stream may miss before its committed ones.
    queued: list[int] = []
    if pending and job.accounting.streams is not None:
        queued = [i for r in job._live_ranks() for i in job.accounting.streams.position(r)[2]]
        if len(queued) != pending:
            problems.append(f"{pending} replays pending, {len(queued)} queued on the ranks")
    steps: dict[int, list[int]] = {}
    for i in [*committed, *queued]:
        shard, step = split_batch_id(i)
        steps.setdefault(shard, []).append(step)
    for shard, taken in steps.items():
        if sorted(taken) != list(range(len(taken))):
            problems.append(f"stream {shard} has gaps")
    replayed = {i for a, b in summary.replayed_batches for i in range(a, b)}
    if len(replayed - set(committed)) > pending:
        problems.append("replayed batches not committed")
    if len({d["dense"] for d in summary.digests.values()}) > 1:
        problems.append("dense states differ")
    table = job.streams.table
    if table is not None and not stopped and not pending and not problems:
        problems += _rows_once(table, committed, s)
    return problems


def _rows_once(table: Any, committed: list[int], s: Settings) -> list[str]:
    """Every row of the job's data (each initial rank's first ``num_steps`` batches) is in
    exactly one committed batch."""
    shard = table.shard(0)
    firsts: dict[str, int] = {}
    at = 0
    for path, groups in zip(shard.paths, shard.row_groups, strict=True):
        firsts[path] = at
        at += sum(groups)

    def rows(counts: Mapping[int, int], shard: Any) -> collections.Counter[int]:
        """The rows of the first ``counts[s]`` batches of each stream ``s``."""
        out: collections.Counter[int] = collections.Counter()
        plan = shard.plan(BATCH_SIZE)
        for sid, n in counts.items():
            for p in plan.stream_pieces(shard.stream(BATCH_SIZE, sid), 0, n):
                start = firsts[p.path] + p.file_row
                out.update(range(start, start + p.rows))
        return out

    # Committed batches are a gap-free prefix of each stream (checked before).
    taken = collections.Counter(split_batch_id(i)[0] for i in committed)
    # The plan's own streams: a join may have cut the initial ones short in the table.
    initial = dataclasses.replace(table.template, index=0, streams={})
    trained = rows(taken, shard)
    expected = rows(dict.fromkeys(range(s.world), s.num_steps), initial)
    if trained == expected:
        return []
    twice = sum(1 for n in trained.values() if n > 1)
    missing = len(set(expected) - set(trained))
    extra = len(set(trained) - set(expected))
    return [f"rows: {twice} trained twice, {missing} never, {extra} not the job's"]
