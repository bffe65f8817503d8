"""A simulated elastic job: the policy, membership and data ledger driven without Ray.

:class:`SimJob` steps a fake job with a frozen clock: it fires the planned faults, adds nodes
when the script says so, turns both into observations, asks :func:`~raytrec.elastic.policy.decide`
and applies each decision to the membership and the :class:`~raytrec.elastic.ledger.DataLedger`
the way the coordinator carries it out. Tests assert on the whole story (events, generations,
replica groups) and end with the exactly-once check of every epoch.

Model of time and data: a step takes ``step_s`` seconds; each live gang reads
``rows_per_step`` rows per step, its replay share first, then fresh rows from a shared cursor
over the epochs (a dynamic split, so the rows a dropped gang never read go to whoever reads
next). Replica syncs run every ``sync_every`` steps and commit every live gang's pending rows.
A hung rank (``hang_rank``, or ``slow_rank`` with ``stall_s >= collective_timeout_s``, whose
peers give up first) stops the job: every gang has read its batch for the step, no rank finishes
it, the other ranks report a collective timeout after ``collective_timeout_s`` and the policy
singles the silent rank out once ``step_timeout_s`` has passed. A placement group fits a gang on
one node with enough free rank slots, or on ``gang_size / ranks_per_host`` whole free nodes; a
dropped gang's slots on live nodes are freed, as when the coordinator removes its placement group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from raytrec.cluster.topology import Topology
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.events import EventLog
from raytrec.elastic.faults import FaultConfig, FaultKind
from raytrec.elastic.job_state import (
    CollectiveTimeout,
    ElasticState,
    NodeLost,
    Observation,
    PlacementReady,
    RankExited,
    StepDone,
    SyncDone,
    observe,
)
from raytrec.elastic.ledger import DataLedger
from raytrec.elastic.membership import Membership
from raytrec.elastic.policy import (
    Continue,
    Decision,
    Fail,
    Grow,
    Reform,
    Unrecoverable,
    WaitForResources,
    apply,
    decide,
    placement_requests,
    request_placements,
)
from raytrec.elastic.rows import RowRanges

__all__ = ["FrozenClock", "NodeArrival", "SimJob", "SimResult"]


class FrozenClock:
    """Time that moves only when told to."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError(f"time only moves forward, got {seconds}")
        self.now += seconds
        return self.now


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeArrival:
    """``count`` fresh nodes join the cluster once the job reaches ``step`` or ``at`` seconds."""

    count: int = 1
    step: int | None = None
    at: float | None = None

    def __post_init__(self) -> None:
        if (self.step is None) == (self.at is None):
            raise ValueError("NodeArrival needs exactly one of step, at")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimResult:
    state: ElasticState
    ledger: DataLedger
    events: EventLog
    decisions: tuple[tuple[int, float, Decision], ...]
    steps: int
    epochs: int
    outcome: Decision  # the final Continue (finished), Fail or Unrecoverable


class SimJob:
    """One simulated run; see the module doc."""

    def __init__(
        self,
        topology: Topology,
        *,
        config: ElasticConfig,
        sync_every: int,
        rows_per_epoch: int,
        rows_per_step: int,
        epochs: int = 1,
        faults: FaultConfig | None = None,
        arrivals: Sequence[NodeArrival] = (),
        step_s: float = 1.0,
        max_ticks: int = 100_000,
    ) -> None:
        self.topology = topology
        self.config = config
        self.rows_per_step = rows_per_step
        self.epochs = epochs
        self.faults = faults or FaultConfig()
        self.faults.check_targets(
            num_ranks=topology.world_size,
            num_gangs=topology.num_gangs,
            num_nodes=topology.num_hosts,
        )
        self.arrivals = list(arrivals)
        self.step_s = step_s
        self.max_ticks = max_ticks
        self.clock = FrozenClock()
        self.state = ElasticState.initial(
            topology, config=config, sync_every=sync_every, now=self.clock.now
        )
        self.ledger = DataLedger(rows_per_epoch, self.state.membership.gang_ids)
        self.log = EventLog()
        self.decisions: list[tuple[int, float, Decision]] = []
        self._cursor = (0, 0)  # (epoch, next fresh row id)
        self._hung: set[int] = set()  # job ranks that stopped making progress
        self._stalled = False  # the current step was started and is stuck on a hung rank
        self._slow: dict[int, float] = {}  # job rank -> stall of the coming step
        self._fired: set[int] = set()
        rph = topology.ranks_per_host
        self._free = {h: 0 for h in range(topology.num_hosts)}
        self._free[topology.num_hosts - 1] = rph * topology.num_hosts - topology.world_size
        self._next_node = topology.num_hosts
        self._pending_obs: list[Observation] = []

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> SimResult:
        outcome: Decision | None = None
        for _ in range(self.max_ticks):
            outcome = self._tick()
            if outcome is not None:
                break
        else:
            raise RuntimeError(f"the simulated job did not finish within {self.max_ticks} ticks")
        return SimResult(
            state=self.state,
            ledger=self.ledger,
            events=self.log,
            decisions=tuple(self.decisions),
            steps=self.state.step,
            epochs=self.epochs,
            outcome=outcome,
        )

    def _tick(self) -> Decision | None:
        """One poll of the control loop; returns the final decision once the job is over."""
        now, step = self.clock.now, self.state.step
        if step not in self._fired:
            self._fired.add(step)
            self._fire_faults(step)
        self._arrive(step, now)
        self._place(now)
        self._observe(self._pending_obs)
        self._pending_obs = []
        decision = decide(self.state, now=now, config=self.config)
        self.decisions.append((step, now, decision))
        self._carry_out(decision)
        self._apply(decision)
        if isinstance(decision, Fail | Unrecoverable):
            return decision
        self._request(now)
        if isinstance(decision, WaitForResources):
            self.clock.advance(self.config.poll_s)
        elif isinstance(decision, Continue):
            if self._finished():
                self._final_sync()
                return decision
            self._train_step()
        return None

    # -- carrying decisions out ---------------------------------------------------------------

    def _carry_out(self, decision: Decision) -> None:
        m = self.state.membership
        if isinstance(decision, Reform):
            self.ledger.drop(decision.drop, decision.survivors)
            self._stalled = False  # the survivors' aborted step is over
            for gid in decision.drop:
                for slot in m.gang(gid).ranks:
                    self._hung.discard(slot.job_rank)
                    self._slow.pop(slot.job_rank, None)
                    if slot.node in self._free and slot.node not in self.state.dead_nodes:
                        self._free[slot.node] += 1
        elif isinstance(decision, Grow):
            if not self.state.at_sync_boundary:
                # Paused below min_gangs: the survivors sync now so the new gangs copy a
                # state that every replica agrees on.
                self._sync(m.gang_ids)
            self.ledger.add_gangs(n.gang.gang_id for n in decision.gangs)

    def _apply(self, decision: Decision) -> None:
        self.state, events = apply(self.state, decision, now=self.clock.now, config=self.config)
        self.log.append(*events)

    def _observe(self, observations: list[Observation]) -> None:
        self.state, events = observe(self.state, observations)
        self.log.append(*events)

    def _request(self, now: float) -> None:
        n = placement_requests(self.state, self.config)
        self.state, events = request_placements(self.state, n, now=now)
        self.log.append(*events)

    # -- the cluster --------------------------------------------------------------------------

    def _fire_faults(self, step: int) -> None:
        m, now = self.state.membership, self.clock.now
        for node in self.faults.nodes_removed_at(step):
            if node in self._free:
                del self._free[node]
                self._pending_obs.append(NodeLost(node=node, at=now))
        if not self.faults.at_step(step):
            return
        for g in m.gangs:
            for slot in g.ranks:
                for f in self.faults.for_rank(
                    step, rank=slot.job_rank, gang=g.gang_id, node=slot.node
                ):
                    if f.kind in (FaultKind.KILL_RANK, FaultKind.KILL_PROCESS):
                        self._pending_obs.append(
                            RankExited(job_rank=slot.job_rank, at=now, cause="kill_rank fault")
                        )
                    elif f.kind is FaultKind.HANG_RANK or self._outlasts_peers(f.stall_s):
                        self._hung.add(slot.job_rank)
                    elif f.stall_s is not None:
                        self._slow[slot.job_rank] = f.stall_s

    def _outlasts_peers(self, stall_s: float | None) -> bool:
        """A stall that outlasts the peers' collective timeout looks like a hang to them."""
        return stall_s is not None and stall_s >= self.config.collective_timeout_s

    def _arrive(self, step: int, now: float) -> None:
        due = [
            a
            for a in self.arrivals
            if (a.step is not None and step >= a.step) or (a.at is not None and now >= a.at)
        ]
        for a in due:
            self.arrivals.remove(a)
            for _ in range(a.count):
                self._free[self._next_node] = self.topology.ranks_per_host
                self._next_node += 1

    def _place(self, now: float) -> None:
        size, rph = self.topology.gang_size, self.topology.ranks_per_host
        for _ in range(self.state.outstanding):
            if size <= rph:
                node = next((n for n in sorted(self._free) if self._free[n] >= size), None)
                if node is None:
                    return
                self._free[node] -= size
                nodes = (node,) * size
            else:
                whole = [n for n in sorted(self._free) if self._free[n] == rph][: size // rph]
                if len(whole) < size // rph:
                    return
                for n in whole:
                    self._free[n] = 0
                nodes = tuple(whole[k // rph] for k in range(size))
            self._pending_obs.append(PlacementReady(nodes=nodes, at=now))

    # -- training -----------------------------------------------------------------------------

    def _finished(self) -> bool:
        if self._cursor[0] < self.epochs:
            return False
        return not any(self.ledger.replay_due(g) for g in self.state.membership.gang_ids)

    def _take_rows(self, gang_id: int) -> dict[int, RowRanges]:
        want, got = self.rows_per_step, {}
        for epoch, due in self.ledger.replay_due(gang_id).items():
            take = []
            for a, b in due.ranges:
                if want == 0:
                    break
                n = min(b - a, want)
                take.append((a, a + n))
                want -= n
            if take:
                got[epoch] = RowRanges(tuple(take))
        n_rows = self.ledger.rows_per_epoch
        while want and self._cursor[0] < self.epochs:
            epoch, start = self._cursor
            n = min(want, n_rows - start)
            got[epoch] = got.get(epoch, RowRanges()).union(RowRanges.of((start, start + n)))
            want -= n
            self._cursor = (epoch + 1, 0) if start + n == n_rows else (epoch, start + n)
        return got

    def _train_step(self) -> None:
        m = self.state.membership
        if self._hung and self._stalled:
            self.clock.advance(self.config.poll_s)  # still stuck; poll again
            return
        for gid in m.gang_ids:
            for epoch, rows in self._take_rows(gid).items():
                self.ledger.consume(gid, epoch, rows)
        if self._hung:
            self._stall(m)
            return
        stall = max(self._slow.values(), default=0.0)
        self._slow.clear()
        at = self.clock.advance(self.step_s + stall)
        step = self.state.step + 1
        obs: list[Observation] = [
            StepDone(job_rank=r, step=step, at=at) for g in m.gangs for r in g.job_ranks
        ]
        self._observe(obs)
        if step % self.state.sync_every == 0:
            self._sync(m.gang_ids)

    def _stall(self, m: Membership) -> None:
        """Nobody finishes this step: the hung rank blocks its gang and, through the replica
        plane, every other gang; the others give up after collective_timeout_s and report it."""
        self._stalled = True
        self.clock.advance(self.config.collective_timeout_s)
        at = self.clock.now
        self._pending_obs += [
            CollectiveTimeout(job_rank=r, step=self.state.step + 1, at=at)
            for g in m.gangs
            for r in g.job_ranks
            if r not in self._hung
        ]

    def _sync(self, gang_ids: Sequence[int]) -> None:
        self.ledger.commit(gang_ids)
        self._observe([SyncDone(step=self.state.step, at=self.clock.now)])

    def _final_sync(self) -> None:
        if not self.state.at_sync_boundary or any(
            self.ledger.pending_rows(g) for g in self.state.membership.gang_ids
        ):
            self._sync(self.state.membership.gang_ids)
