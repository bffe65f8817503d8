"""The worker group on Ray: rank actors, placement groups and the node table.

:class:`RayWorkerGroup` implements :class:`raytrec.elastic.workers.WorkerGroup` for the
coordinator. Every rank is a :class:`~actors.rank.RankWorker` actor in its gang's placement
group; Ray's exceptions are turned into :class:`~raytrec.elastic.workers.RankLost` (the actor or
its node is gone) and :class:`~raytrec.elastic.workers.RankFailed` (the rank raised). Ranks
write the last step they finished into the job's store (``progress/<rank>``) as they train; the
coordinator reads all of them in one round trip (:meth:`RayWorkerGroup.progress`), which is how
a hung rank is found whatever the interval length.
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import socket
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar, cast

import ray
import ray.exceptions
import torch.distributed as dist
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.fault_injection import hooks_for
from actors.rank import RankWorker, progress_key
from raytrec.cluster.placement import PlacementSpec, rank_runtime_env
from raytrec.data.source import BatchShard
from raytrec.elastic.rank_protocol import RankProtocol
from raytrec.elastic.workers import NODE_DIED, Answer, NodeInfo, RankFailed, RankLost
from raytrec.engine.rank_engine import RankSpec, StoreAddress

__all__ = ["RayWorkerGroup"]

R = TypeVar("R")


@dataclasses.dataclass(frozen=True, eq=False)
class _Call(Answer[R]):
    """One call's future: the rank it went to, the method, and Ray's ObjectRef."""

    rank: int
    method: str
    ref: Any  # None: the rank was killed, and the call fails with RankLost


class _Remote:
    """A rank actor seen as a :class:`RankProtocol`: calling one of its methods sends the call
    (``.remote``) and answers with Ray's ObjectRef in place of the value, which
    :meth:`RayWorkerGroup.call` wraps into an :class:`Answer` of the method's type. A killed
    rank's handle (``actor`` None) sends nothing. The protocol is what mypy checks the call
    against; this is the one place where the ObjectRef stands in for the value."""

    def __init__(self, actor: Any) -> None:
        self._actor = actor
        self.method = ""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def send(*args: Any, **kwargs: Any) -> Any:
            self.method = name
            if self._actor is None:
                return None
            return getattr(self._actor, name).remote(*args, **kwargs)

        return send


class RayWorkerGroup:
    """Rank actors on Ray (module doc)."""

    def __init__(self) -> None:
        self._actors: dict[int, Any] = {}
        self._killed: set[int] = set()  # a call on one of them fails with RankLost
        self._socket: socket.socket | None = None
        self._server: dist.TCPStore | None = None
        self._store: dist.Store | None = None  # the server, seen under the job's secret

    def host_store(self) -> StoreAddress:
        """The job's rendezvous store, listening on this node's Ray address only (not on every
        interface: the socket is bound here and handed to the store), with a fresh secret that
        only the job's ranks receive (through Ray) and under which every key lies."""
        host = ray.util.get_node_ip_address()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.bind((host, 0))
        self._socket.listen(1024)
        port = self._socket.getsockname()[1]
        server = dist.TCPStore(
            host,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=300),
            master_listen_fd=self._socket.fileno(),
        )
        address = StoreAddress(host=host, port=port, secret=secrets.token_hex(16))
        self._server = server  # keeps the server running for as long as the job
        self._store = dist.PrefixStore(address.secret, server)
        return address

    def start_rank(
        self, spec: RankSpec, shard: BatchShard, *, placement: PlacementGroup, bundle: int
    ) -> None:
        assert self._store is not None, "host_store() first"
        # The rank overwrites it after every step it finishes; until then it has finished none.
        self._store.set(progress_key(spec.rank), "0")
        scaling = spec.config.scaling
        self._actors[spec.rank] = (
            ray.remote(RankWorker)
            .options(
                num_cpus=scaling.cpus_per_rank,
                num_gpus=1 if scaling.use_gpu else 0,
                # The running train, the one queued behind it, and abort_replica_planes beside a
                # blocked train (actors.rank).
                max_concurrency=3,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=placement, placement_group_bundle_index=bundle
                ),
                runtime_env=rank_runtime_env(scaling.rank_niceness),
            )
            .remote(spec, shard, hooks_for(spec.config))  # fault injection, when configured
        )

    def call(
        self, ranks: Sequence[int], invoke: Callable[[RankProtocol, int], R]
    ) -> dict[int, Answer[R]]:
        out: dict[int, Answer[R]] = {}
        for r in ranks:
            handle = _Remote(None if r in self._killed else self._actors[r])
            ref = invoke(cast(RankProtocol, handle), r)
            out[r] = _Call(r, handle.method, ref)
        return out

    def wait(
        self, futures: Sequence[Answer[Any]], *, num_returns: int, timeout: float
    ) -> list[Answer[Any]]:
        calls = [cast(_Call[Any], f) for f in futures]
        gone: list[Answer[Any]] = [f for f in calls if f.ref is None]  # killed: failed already
        by_ref = {f.ref: f for f in calls if f.ref is not None}
        wanted = min(num_returns, len(calls)) - len(gone)
        if not by_ref or wanted <= 0:
            return gone
        done, rest = ray.wait(list(by_ref), num_returns=wanted, timeout=timeout)
        if done and rest:
            # Ray returns no more than num_returns; the others already done come in the same
            # look, so a caller waking for the first of G answers does not wake G times.
            more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
            done += more
        return gone + [by_ref[ref] for ref in done]

    def result(self, future: Answer[R]) -> R:
        assert isinstance(future, _Call)
        if future.ref is None:
            raise RankLost(future.rank, "ActorDiedError: the actor was killed by ray.kill")
        try:
            return cast(R, ray.get(future.ref))
        except ray.exceptions.RayActorError as e:
            cause = _death_cause(e)
            raise RankLost(future.rank, cause, node_died=cause == NODE_DIED) from None
        except ray.exceptions.RayTaskError as e:
            raise RankFailed(future.rank, _cause(e)) from None

    def kill(self, rank: int) -> None:
        actor = self._actors.pop(rank, None)
        if actor is not None:
            self._killed.add(rank)
            with contextlib.suppress(Exception):
                ray.kill(actor)

    def progress(self, ranks: Sequence[int]) -> dict[int, int]:
        if self._store is None or not ranks:
            return {}
        values = self._store.multi_get([progress_key(r) for r in ranks])
        return {r: int(v) for r, v in zip(ranks, values, strict=True)}

    def place(self, spec: PlacementSpec, *, name: str = "") -> PlacementGroup:
        return placement_group(
            list(spec.bundles),
            strategy=spec.strategy,
            name=name,
            bundle_label_selector=[dict(s) for s in spec.selectors] or None,
        )

    def ready(
        self, placements: Sequence[PlacementGroup], *, timeout: float
    ) -> list[PlacementGroup]:
        if not placements:
            return []
        refs = {pg.ready(): pg for pg in placements}
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
        return [refs[ref] for ref in done]

    def release(self, placement: PlacementGroup) -> None:
        with contextlib.suppress(Exception):
            remove_placement_group(placement)

    def nodes(self) -> list[NodeInfo]:
        return [
            NodeInfo(
                node_id=n["NodeID"],
                address=str(n.get("NodeManagerAddress", "")),
                alive=bool(n.get("Alive")),
                resources={k: float(v) for k, v in n.get("Resources", {}).items()},
                labels=dict(n.get("Labels") or {}),
            )
            for n in ray.nodes()
        ]

    def available(self) -> dict[str, dict[str, float]]:
        from ray._private.state import available_resources_per_node

        return {
            node: {k: float(v) for k, v in free.items()}
            for node, free in available_resources_per_node().items()
        }

    def placed_nodes(self, placement: PlacementGroup) -> tuple[str, ...]:
        from ray.util.placement_group import placement_group_table

        table = placement_group_table(placement).get("bundles_to_node_id", {})
        return tuple(str(table[b]) for b in sorted(table))

    def draining_nodes(self) -> set[str]:
        # Ray's GCS keeps the nodes being drained (ray drain-node, the autoscaler's idle
        # termination, preemption notices); there is no public wrapper for it in Ray 2.60.
        from ray._private.state import state

        try:
            return set(state.get_draining_nodes())
        except Exception:  # an older GCS, or a moment without it: nothing is known to drain
            return set()

    def shutdown(self) -> None:
        for rank in list(self._actors):
            self.kill(rank)


def _death_cause(e: BaseException) -> str:
    """Why an actor died, in one line (:data:`NODE_DIED` when its node went)."""
    text = str(e)
    if "node has died" in text or "node was terminated" in text:
        return NODE_DIED
    lines = text.strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200] if lines else ''}"


def _cause(e: ray.exceptions.RayTaskError) -> BaseException:
    """The rank's own exception inside Ray's wrapper (a BadInputError keeps its fields)."""
    from raytrec.data.parquet import _find_bad_input

    bad = _find_bad_input(e)
    if bad is not None:
        return bad
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e
