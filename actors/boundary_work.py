"""What the loop observes at an interval boundary, and the model published there.

The loop (:mod:`actors.job_loop`) asks :func:`raytrec.elastic.boundary.decide` at each boundary
with the job's state and what was observed there; this part holds what those observations need
that is not the job's shared record: a stop asked for (:meth:`stop_asked`: the driver's signal, or
``raytrec.stop``), drain requests (:meth:`drain_seen`), each gang's step times (:meth:`observe`,
for the straggler rule), whether a checkpoint, an evaluation or a publish is due at a later
boundary (:meth:`work_due`, so no interval is queued past it), and publishing the model for
serving (:mod:`actors.publishing`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from actors.drain import GangDrain
from actors.job import JobView
from actors.nodes import JobNodes
from actors.publishing import JobPublishing, PublishingPorts
from raytrec.config import PublishConfig
from raytrec.elastic.boundary import JobState, Observations, evaluation_due, save_due
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.drain_policy import stop_requested
from raytrec.elastic.report import RankReport
from raytrec.elastic.straggler_policy import StragglerWatch, gang_step_seconds
from raytrec.elastic.workers import Clock

__all__ = ["BoundaryWork"]


class BoundaryWork:
    """What the loop observes at a boundary (module doc). ``job_state``: the job's state as
    :func:`~raytrec.elastic.boundary.decide` reads it."""

    def __init__(
        self,
        state: JobView,
        *,
        elastic: ElasticConfig,
        publish: PublishConfig,
        run_dir: str,
        clock: Clock,
        job_state: Callable[[], JobState],
        drains: GangDrain,
        nodes: JobNodes,
        ports: PublishingPorts | None = None,
    ) -> None:
        self.state = state
        self.elastic = elastic
        self.run_dir = run_dir
        self.clock = clock
        self.job_state = job_state
        self.drains = drains
        self.nodes = nodes
        # The model published for serving (``publish``), through the job's ports.
        self.publishing = (
            JobPublishing(ports, config=publish, run_dir=run_dir)
            if ports is not None and publish.every_n_steps is not None
            else None
        )
        self.stop = threading.Event()  # a stop was asked for (Coordinator.request_stop)
        self.stragglers = StragglerWatch()  # gangs slower than the others, interval by interval

    def stop_asked(self) -> bool:
        """Whether the job was asked to stop: ``request_stop`` (the driver's signal), or
        ``raytrec.stop`` from another process (a file in the run directory)."""
        if not self.stop.is_set() and stop_requested(self.run_dir):
            self.stop.set()
        return self.stop.is_set()

    def work_due(self, step: int) -> bool:
        """Whether a checkpoint or an evaluation is due at the boundary at ``step`` (the rules
        :func:`~raytrec.elastic.boundary.decide` applies when the job gets there)."""
        state = self.job_state()
        due = save_due(state, step=step, now=self.clock.monotonic()) is not None
        publish = self.publishing is not None and self.publishing.due(step)
        return due or publish or evaluation_due(state, step)

    def observe(self, reports: list[RankReport]) -> None:
        """Books each gang's step time in the interval ``reports`` account for, when
        ``elastic.straggler_eviction`` is set
        (:class:`~raytrec.elastic.straggler_policy.StragglerWatch`)."""
        eviction = self.elastic.straggler_eviction
        if eviction is not None:
            step_s = gang_step_seconds(reports, self.state.membership.gang_of_rank)
            self.stragglers = self.stragglers.observe(step_s, eviction.factor)

    def drain_seen(self, *, take: bool) -> Observations:
        """What is asked to be given back, and the straggler record (``take``: a user's
        request is consumed: it is being carried out)."""
        return Observations(
            drain=self.drains.request(take=take),
            node_of_rank=self.nodes.of_rank,
            stragglers=self.stragglers,
        )

    def publish(self, *, final: bool = False) -> None:
        """Publishes the model for serving when due here (``final``: the job's end, where the
        last write is also waited for)."""
        if self.publishing is None:
            return
        if self.publishing.due(self.state.step, final=final):
            self.publishing.publish()
        if final:
            self.publishing.finish()
