"""Faults and stalls a rank carries out on itself, for tests, demos and benchmarks
(``TrainConfig.testing``: ``faults`` and ``stragglers``).

:class:`FaultInjection` is the rank's :class:`~actors.rank.RankHooks` that act: as a step begins
it stalls (a straggler, a ``slow_rank``), exits (``kill_rank``), arms a SIGKILL from another
thread (``kill_process``) or hangs (``hang_rank``); as the rank enters a phase it carries out the
kills due there (each once); after a heal it leaves one weight off (``corrupt_heal``). Which
fault fires where is the pure plan of :mod:`raytrec.elastic.faults`. The launch site
(:class:`actors.worker_group.RayWorkerGroup`) passes these hooks only to a job that configures
faults or stalls (:func:`hooks_for`); the rank actor itself knows no fault.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import torch

from actors.rank import RankHooks, RankWorker
from raytrec.config import TrainConfig
from raytrec.elastic.faults import FaultKind, FaultSpec, Phase
from raytrec.observability.ray_errors import mark_ending

__all__ = ["FaultInjection", "hooks_for"]


def hooks_for(config: TrainConfig) -> RankHooks | None:
    """The hooks a rank of a job with ``config`` gets: :class:`FaultInjection` when it
    configures faults or stalls, else None (the rank's own, which do nothing)."""
    testing = config.testing
    if testing.faults or testing.stragglers is not None:
        return FaultInjection()
    return None


class FaultInjection(RankHooks):
    """Carries out the rank's share of ``testing.faults`` and ``testing.stragglers`` (module
    doc). Made at the launch site and shipped with the rank's constructor arguments; attached
    to the rank in the rank's process."""

    def __init__(self) -> None:
        self._rank: RankWorker | None = None
        self._heal_corrupted = False
        self._phase_fired: set[int] = set()  # phase faults (by index) carried out already
        self._step_began: float | None = None  # perf_counter() as the last step began
        self._step_s = 0.02  # the last step's duration: the scale of a process kill's moment

    def attach(self, rank: RankWorker) -> None:
        self._rank = rank

    @property
    def rank(self) -> RankWorker:
        assert self._rank is not None, "attach() first"
        return self._rank

    def step_begins(self, step: int) -> float:
        """Carries out the injected faults and stalls due before ``step``; returns seconds slept."""
        spec = self.rank.spec
        cfg = spec.config
        now = time.perf_counter()
        if self._step_began is not None:  # a gap between intervals is not a step's length
            self._step_s = min(now - self._step_began, 1.0)
        self._step_began = now
        slept = 0.0
        if cfg.testing.stragglers is not None:
            slept += cfg.testing.stragglers.stall_seconds(step, spec.rank)
        for fault in cfg.testing.fault_plan.for_rank(
            step, rank=spec.rank, gang=spec.gang, node=self._host()
        ):
            slept += self._carry_out(fault)
        if slept:
            time.sleep(slept)
        return slept

    def enters(self, phase: Phase) -> None:
        """Carries out the injected faults due as the rank enters ``phase`` (each once)."""
        spec = self.rank.spec
        plan = spec.config.testing.fault_plan
        due = plan.for_phase(
            phase, self.rank.engine.step, rank=spec.rank, gang=spec.gang, node=self._host()
        )
        slept = 0.0
        for i in sorted(set(due) - self._phase_fired):
            self._phase_fired.add(i)
            slept += self._carry_out(plan.faults[i])
        if slept:
            time.sleep(slept)

    def healed(self) -> None:
        """A ``corrupt_heal`` due for this rank (tests of the coordinator's heal check): its
        first heal at or after the fault's step leaves one weight off by one."""
        spec, engine = self.rank.spec, self.rank.engine
        if not self._heal_corrupted and spec.config.testing.fault_plan.corrupts_heal(
            engine.step, rank=spec.rank, gang=spec.gang
        ):
            self._heal_corrupted = True
            with torch.no_grad():
                engine.embedding_weights()[0].view(-1)[0] += 1.0
            engine.embeddings_written()

    def _host(self) -> int:
        # A node target names a host of the job's initial layout (job rank // ranks_per_host);
        # ranks that join later sit on hosts beyond it.
        spec = self.rank.spec
        scaling = spec.config.scaling
        return spec.rank // (scaling.ranks_per_host or scaling.gang_size)

    def _carry_out(self, fault: FaultSpec) -> float:
        """Carries out a rank fault; returns the seconds to stall."""
        if fault.kind in (FaultKind.KILL_RANK, FaultKind.KILL_PROCESS):
            # Ray's report of this death goes to the run's logs, not the console.
            step = self.rank.engine.step
            mark_ending(f"{fault.kind.value} fault, rank {self.rank.spec.rank}, step {step}")
        if fault.kind is FaultKind.KILL_RANK:
            os._exit(1)  # a crash: no cleanup, no goodbye
        if fault.kind is FaultKind.KILL_PROCESS:
            # SIGKILL from another thread a random part of a step from now, whatever this
            # rank is doing then (mid-collective, as often as not), as the OOM killer does.
            _, moment = fault.kill_at(self.rank.spec.rank)
            timer = threading.Timer(moment * self._step_s, _sigkill)
            timer.daemon = True
            timer.start()
            return 0.0
        if fault.kind is FaultKind.HANG_RANK:
            # Hung until the coordinator gives up on this rank and kills it; bounded so a
            # test never leaves a sleeper behind.
            return 10 * self.rank.spec.config.elastic.step_timeout_s
        return fault.stall_s or 0.0


def _sigkill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
