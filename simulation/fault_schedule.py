"""Seeded random fault schedules: a job's settings and up to a few faults, as JSON.

A :class:`Schedule` is a job's settings (gangs, gang size, layout, sync and log periods, steps,
checkpoints, growth, data source) and up to a few faults, each at a step or at one of a rank's
calls (its ``nth`` call of a :class:`~actors.rank.RankWorker` method): so a fault lands inside
an interval, at a sync, at a checkpoint save, at any stage of a join, inside any call of a
re-forming or of a rebuild after a total loss, at the final sync. :func:`generate` draws one from
a seed; :func:`~simulation.fault_space.run_schedule` runs it. Schedules are JSON, so a failing
one is replayed from one line (:func:`reproducer`).
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Mapping
from typing import Any

__all__ = [
    "BATCH_SIZE",
    "CALLS",
    "KINDS",
    "MAX_STEPS",
    "Schedule",
    "Settings",
    "generate",
    "reproducer",
]

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
    "extend_stream",
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
    "coordinator_dies",
)

BATCH_SIZE = 8  # every schedule's batch size
MAX_STEPS = 24  # the most steps a generated schedule trains


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    """A job's shape for one schedule (all small: the fake's cost grows with ranks x steps)."""

    gangs: int = 3
    gang_size: int = 2
    layout: str = "replicas_across_hosts"
    sync_every: int = 4
    #: ``sync.levels``: lower levels of a hierarchical schedule, ``(period, gangs per group)``.
    levels: tuple[tuple[int, int], ...] = ()
    log_every: int = 2
    num_steps: int = 16
    checkpoint_every: int | None = None
    grow: bool = False
    min_gangs: int = 1
    max_gangs: int | None = None
    spare_nodes: int = 0
    data: str = "synthetic"  # or "reshared": Parquet read by index, rows shared again
    epochs: int = 1  # passes over the Parquet rows (data="reshared")
    max_coordinator_restarts: int = 3

    def __post_init__(self) -> None:
        object.__setattr__(self, "levels", tuple((int(p), int(n)) for p, n in self.levels))
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
    return f"python -m simulation --replay '{schedule.to_json()}'"


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
    if settings.data == "reshared":
        # Several passes: a loss's survivors read on to the end of their current epoch's part
        # (drawn apart, so each seed keeps its other settings).
        epochs = random.Random(f"{seed}/epochs").choice([1, 1, 2, 3])
        settings = dataclasses.replace(settings, epochs=epochs)
    if sync_every == 4 and gangs >= 3 and random.Random(f"{seed}/levels").random() < 0.5:
        # Groups of 2 gangs every 2 steps (drawn apart, so each seed keeps its other settings).
        settings = dataclasses.replace(settings, levels=((2, 2),))
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
    # The coordinator dies (drawn apart, so that the schedules of the other kinds stay as
    # each seed drew them before this kind was added).
    other = random.Random(f"coordinator_dies:{seed}")
    if other.random() < 0.15:
        settings = dataclasses.replace(
            settings, max_coordinator_restarts=other.choice([3, 3, 3, 1, 0])
        )
        faults += [_coordinator_dies(other, settings) for _ in range(other.choice([1, 1, 2]))]
    return Schedule(settings, tuple(faults), seed)


#: The calls a coordinator dies in: its start, a recovery, a checkpoint save, a heal, a join...
_LOSS_CALLS = (
    "build",
    "train",
    "recover",
    "replay",
    "save_checkpoint",
    "load_checkpoint",
    "broadcast_state",
    "state_digest",
    "set_shard",
    "extend_stream",
    "sync",
    "settle_failed_step",
    "abort_replica_planes",
    "save",
)


def _coordinator_dies(rng: random.Random, s: Settings) -> dict[str, Any]:
    if rng.random() < 0.4:
        return {"kind": "coordinator_dies", "step": rng.randint(1, s.num_steps)}
    rank = rng.randrange(s.world) if rng.random() < 0.7 else s.world + rng.randrange(s.world)
    on = rng.choice(_LOSS_CALLS)
    return {"kind": "coordinator_dies", "rank": rank, "on": on, "nth": rng.choice([1, 1, 2, 3])}


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
    kind = rng.choice(KINDS[:-1])  # coordinator_dies: drawn apart (generate)
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
