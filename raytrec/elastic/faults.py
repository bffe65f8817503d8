"""Fault injection: which rank or node fails how, at which step.

A :class:`FaultSpec` is one fault: ``kill_rank`` (the rank's process exits), ``kill_process``
(the rank's process is SIGKILLed from another thread at a random moment, as the OOM killer
does: mid-step, often mid-collective), ``hang_rank`` (the rank stops making progress and never
returns), ``slow_rank`` (the rank stalls ``stall_s`` seconds in each of ``steps`` steps) or
``corrupt_heal`` (the rank's first heal from a peer at or after ``step`` leaves one of its
weights off by one, which the coordinator's heal check must catch) or ``kill_coordinator`` (the
coordinator SIGKILLs its own process at the first interval boundary at or after ``step``, once
per run; it has no target). A
fault is due at step ``step``: a rank carries it out as it starts that step (after ``step - 1``
completed steps; ``kill_rank@16`` dies before training step 16). Rank faults
target one job rank (``rank``), every rank of a gang (``gang``, a gang id) or every rank on a node
(``node``). A rank or gang that joins later is targeted by its id
with ``later``. A ``phase`` (``heal``, ``sync``, ``checkpoint``, ``eval``, ``join``, ``reform``)
makes a kill due as the rank enters that phase at or after ``step`` instead of at a step.

A :class:`FaultConfig` is a plan of several faults, built from the API, from config dicts
(``from_dicts``) or from short strings (``"kill_rank@12:rank=3"``,
``"slow_rank@5:gang=1:stall_s=2.5:steps=3"``). Which faults fire at a step is a pure function:
ranks ask :meth:`FaultConfig.for_rank` and :meth:`FaultConfig.for_phase`.

Removing a node is not a fault a plan can hold: a rank cannot take its node out of a Ray
cluster, so ``remove_node`` is refused with the way to do it (:data:`NOT_FAULTS`).
"""

from __future__ import annotations

import enum
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic import model_validator

from raytrec.config.base import (
    ConfigError,
    ConfigModel,
    Lax,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Seq,
    validate,
)

__all__ = ["FaultConfig", "FaultKind", "FaultSpec", "Phase"]


class FaultKind(enum.StrEnum):
    KILL_RANK = "kill_rank"
    KILL_PROCESS = "kill_process"
    HANG_RANK = "hang_rank"
    SLOW_RANK = "slow_rank"
    CORRUPT_HEAL = "corrupt_heal"
    KILL_COORDINATOR = "kill_coordinator"


class Phase(enum.StrEnum):
    """Where in a rank's work a phase fault fires: the rank method that carries it out."""

    HEAL = "heal"  # broadcast_state: a state copy between replicas (a heal, the job's start)
    SYNC = "sync"  # a replica sync: the coordinator's (sync) or the schedule's inside train
    CHECKPOINT = "checkpoint"  # save_checkpoint
    EVAL = "eval"  # evaluate
    JOIN = "join"  # join_replica_plane: a new generation's plane (a gang joins, or a re-form)
    REFORM = "reform"  # recover: a survivor's report after a failed interval


#: Kinds refused with what to do instead: nothing in the job could carry them out.
NOT_FAULTS = {
    "remove_node": (
        "remove_node is not carried out on Ray: a rank cannot take its node out of the "
        "cluster. To lose every rank of a node, use kill_rank or kill_process with node=N; to "
        "lose the node itself, remove it from the cluster (ray.cluster_utils.Cluster.remove_node "
        "in a test, `ray stop` on a real node)"
    ),
}

#: Faults a rank carries out on itself at a step.
RANK_FAULTS = (
    FaultKind.KILL_RANK,
    FaultKind.KILL_PROCESS,
    FaultKind.HANG_RANK,
    FaultKind.SLOW_RANK,
)
#: Faults that may fire at a phase instead of a step. (A hang inside a control call is found
#: only by the call's own timeout, which fails the job: not offered.)
PHASE_FAULTS = (FaultKind.KILL_RANK, FaultKind.KILL_PROCESS)
#: Faults that span ``steps`` steps (slowed ones; the window a process kill lands in).
_SPANNING = (FaultKind.SLOW_RANK, FaultKind.KILL_PROCESS)
_TARGETS = ("rank", "gang", "node")
_FIELDS = ("kind", "step", "rank", "gang", "node", "stall_s", "steps", "phase", "later", "seed")


class FaultSpec(ConfigModel):
    """One injected fault: which rank or node fails how, at which step."""

    kind: Lax[FaultKind]
    """`kill_rank` (the rank's process exits), `kill_process` (the rank's process is SIGKILLed
    from another thread at a random moment of a step drawn from `step` to `step + steps - 1`),
    `hang_rank` (the rank stops making progress), `slow_rank` (the rank stalls `stall_s`
    seconds in each of `steps` steps), `corrupt_heal` (the rank's first heal from a peer at
    or after `step` leaves one weight off by one) or `kill_coordinator` (the coordinator's
    process is SIGKILLed at the first interval boundary at or after `step`, once per run; no
    target)."""
    step: NonNegativeInt
    """The step before which a rank carries the fault out (`kill_rank` at 16 dies after 15
    completed steps)."""
    rank: NonNegativeInt | None = None
    """Target: one job rank."""
    gang: NonNegativeInt | None = None
    """Target: every rank of this gang id."""
    node: NonNegativeInt | None = None
    """Target: every rank on this host of the job's initial layout."""
    stall_s: PositiveFloat | None = None
    """`slow_rank` only: seconds of stall per affected step."""
    steps: PositiveInt = 1
    """`slow_rank`: how many consecutive steps, from `step` on, are slowed; `kill_process`:
    the window of steps the kill lands in."""
    phase: Lax[Phase] | None = None
    """`kill_rank`, `kill_process`: fire as the rank enters this phase (`heal`,
    `sync`, `checkpoint`, `eval`, `join`, `reform`) at or after `step`, once, instead of at
    step `step`."""
    later: bool = False
    """The `rank` or `gang` target joins the job later (an id beyond the initial job's)."""
    seed: NonNegativeInt = 0
    """`kill_process`: seeds the draw of the step and the moment (with the job rank)."""

    @model_validator(mode="before")
    @classmethod
    def _not_a_fault(cls, data: Any) -> Any:
        kind = data.get("kind") if isinstance(data, Mapping) else None
        if isinstance(kind, str) and kind in NOT_FAULTS:
            raise ConfigError(NOT_FAULTS[kind])
        return data

    @model_validator(mode="after")
    def _one_target(self) -> FaultSpec:
        set_targets = [t for t in _TARGETS if getattr(self, t) is not None]
        given = ", ".join(f"{t}={getattr(self, t)!r}" for t in set_targets)
        if self.kind is FaultKind.KILL_COORDINATOR:
            if set_targets:
                raise ConfigError(f"kill_coordinator has no target; got {given}")
        elif len(set_targets) != 1:
            raise ConfigError(
                f"{self.kind} needs exactly one target of rank, gang, node; got {given or 'none'}"
            )
        if self.kind is FaultKind.SLOW_RANK:
            if self.stall_s is None:
                raise ConfigError("slow_rank needs stall_s, a positive number of seconds")
        elif self.stall_s is not None:
            raise ConfigError(f"{self.kind}.stall_s={self.stall_s!r} is only allowed for slow_rank")
        if self.steps != 1 and self.kind not in _SPANNING:
            raise ConfigError(
                f"{self.kind}.steps={self.steps!r} is only allowed for slow_rank, kill_process"
            )
        if self.phase is not None:
            if self.kind not in PHASE_FAULTS:
                raise ConfigError(
                    f"{self.kind}.phase={self.phase.value!r} is only allowed for "
                    f"{', '.join(PHASE_FAULTS)}"
                )
            if self.steps != 1:
                raise ConfigError(f"{self.kind}.steps={self.steps!r} is not allowed with phase")
        if self.later and (not set_targets or set_targets[0] == "node"):
            raise ConfigError(f"{self.kind}.later=True needs a rank or gang target, not node")
        if self.seed and self.kind is not FaultKind.KILL_PROCESS:
            raise ConfigError(f"{self.kind}.seed={self.seed!r} is only allowed for kill_process")
        return self

    @property
    def target(self) -> tuple[str, int]:
        """``("rank" | "gang" | "node", index)``; ``("coordinator", 0)`` for
        ``kill_coordinator``."""
        if self.kind is FaultKind.KILL_COORDINATOR:
            return "coordinator", 0
        for t in _TARGETS:
            value = getattr(self, t)
            if value is not None:
                return t, value
        raise AssertionError("validated on construction")

    def fires_at(self, step: int) -> bool:
        return self.phase is None and self.step <= step < self.step + self.steps

    def kill_at(self, rank: int) -> tuple[int, float]:
        """``kill_process``: (the step job rank ``rank`` is killed in, the moment within it as
        a fraction of a step), drawn from ``seed`` and ``rank``."""
        draw = random.Random(f"kill_process/{self.seed}/{self.step}/{rank}")
        return self.step + draw.randrange(self.steps), draw.random()

    def hits_rank(self, *, rank: int, gang: int, node: int) -> bool:
        """Whether this fault targets the rank with job rank ``rank`` in ``gang`` on ``node``."""
        name, value = self.target
        return {"rank": rank, "gang": gang, "node": node}.get(name) == value

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> FaultSpec:
        return validate(cls, raw)

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """``"<kind>@<step>[:key=value]...[:later]"``, e.g. ``"kill_rank@40:node=2"``,
        ``"kill_process@30:gang=1:steps=20:seed=4"``, ``"kill_rank@0:gang=3:later:phase=heal"``."""
        head, *pairs = text.strip().split(":")
        kind, sep, step = head.partition("@")
        if not sep:
            raise ConfigError(f"fault {text!r} must look like '<kind>@<step>:<target>=<index>'")
        raw: dict[str, Any] = {"kind": kind.strip(), "step": _number(text, "step", step)}
        for pair in pairs:
            if pair.strip() == "later":  # a flag: the target joins later
                raw["later"] = True
                continue
            key, eq, value = pair.partition("=")
            key = key.strip()
            if not eq or key not in _FIELDS[2:]:
                raise ConfigError(
                    f"fault {text!r}: {pair!r} is not key=value with key one of {list(_FIELDS[2:])}"
                )
            raw[key] = value.strip() if key == "phase" else _number(text, key, value)
        return cls.from_dict(raw)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind.value, "step": self.step}
        name, value = self.target
        if self.kind is not FaultKind.KILL_COORDINATOR:
            out[name] = value
        if self.kind is FaultKind.SLOW_RANK:
            out.update(stall_s=self.stall_s, steps=self.steps)
        if self.kind is FaultKind.KILL_PROCESS:
            out.update(steps=self.steps, seed=self.seed)
        if self.phase is not None:
            out["phase"] = self.phase.value
        if self.later:
            out["later"] = True
        return out


def _number(text: str, key: str, value: str) -> int | float:
    try:
        return float(value) if key == "stall_s" else int(value)
    except ValueError:
        raise ConfigError(f"fault {text!r}: {key}={value.strip()!r} is not a number") from None


class FaultConfig(ConfigModel):
    """A plan of faults, in the order given."""

    faults: Seq[FaultSpec] = ()
    """The faults."""

    @classmethod
    def from_dicts(cls, raw: Iterable[Mapping[str, Any]]) -> FaultConfig:
        return validate(cls, {"faults": list(raw)})

    @classmethod
    def parse(cls, texts: str | Sequence[str]) -> FaultConfig:
        """Faults as strings; one string may hold several separated by ``;`` or ``,``."""
        items = [texts] if isinstance(texts, str) else list(texts)
        parts = [p for t in items for p in t.replace(";", ",").split(",") if p.strip()]
        return cls(faults=tuple(_at(i, FaultSpec.parse, p) for i, p in enumerate(parts)))

    def to_dicts(self) -> list[dict[str, Any]]:
        return [f.to_dict() for f in self.faults]

    def at_step(self, step: int) -> tuple[FaultSpec, ...]:
        """Every fault due at ``step`` (carried out as a rank starts that step)."""
        return tuple(f for f in self.faults if f.fires_at(step))

    def corrupts_heal(self, step: int, *, rank: int, gang: int) -> bool:
        """Whether a ``corrupt_heal`` fault at or before ``step`` targets this rank."""
        return any(
            f.kind is FaultKind.CORRUPT_HEAL
            and f.step <= step
            and f.target[0] != "node"
            and f.hits_rank(rank=rank, gang=gang, node=-1)
            for f in self.faults
        )

    def for_rank(self, step: int, *, rank: int, gang: int, node: int) -> tuple[FaultSpec, ...]:
        """The rank faults (kill, hang, slow) that job rank ``rank`` of ``gang`` on ``node``
        carries out on itself at ``step``; a ``kill_process`` only at the step drawn for it
        (:meth:`FaultSpec.kill_at`)."""
        return tuple(
            f
            for f in self.at_step(step)
            if f.kind in RANK_FAULTS
            and f.hits_rank(rank=rank, gang=gang, node=node)
            and (f.kind is not FaultKind.KILL_PROCESS or f.kill_at(rank)[0] == step)
        )

    def for_phase(
        self, phase: Phase, step: int, *, rank: int, gang: int, node: int
    ) -> tuple[int, ...]:
        """Indices of the faults due as job rank ``rank`` of ``gang`` on ``node`` enters
        ``phase`` at ``step`` (each fires once: the rank remembers which did)."""
        return tuple(
            i
            for i, f in enumerate(self.faults)
            if f.phase is phase and f.step <= step and f.hits_rank(rank=rank, gang=gang, node=node)
        )

    def coordinator_kills(self) -> tuple[int, ...]:
        """The steps of the ``kill_coordinator`` faults, in the order given."""
        return tuple(f.step for f in self.faults if f.kind is FaultKind.KILL_COORDINATOR)

    def check_targets(self, *, num_ranks: int, num_gangs: int, num_nodes: int) -> None:
        """Every target exists in a job of the given size (initial ranks, gangs, nodes); a
        target with ``later`` is beyond it (it joins later). ``corrupt_heal`` targets a gang or
        rank that joins later, so any id is allowed."""
        bounds = {"rank": num_ranks, "gang": num_gangs, "node": num_nodes}
        for i, f in enumerate(self.faults):
            if f.kind in (FaultKind.CORRUPT_HEAL, FaultKind.KILL_COORDINATOR):
                continue
            name, value = f.target
            if f.later:
                if value < bounds[name]:
                    raise ConfigError(
                        f"faults[{i}].later=True but {name}={value} is in the initial job "
                        f"(0..{bounds[name] - 1}); a later {name} has an id from "
                        f"{bounds[name]} on"
                    )
                continue
            if value >= bounds[name]:
                raise ConfigError(
                    f"faults[{i}].{name}={value} is out of range for this job; allowed: "
                    f"0..{bounds[name] - 1}"
                )


def _at(i: int, build: Any, raw: Any) -> FaultSpec:
    try:
        spec: FaultSpec = build(raw)
    except ConfigError as e:
        raise ConfigError(f"faults[{i}]: {e}") from None
    return spec
