"""Where each rank sits in a 2D sparse-parallel job: its gang, its replica group and its host.

A job of ``world_size`` (T) ranks is split into ``num_gangs`` (G = T // L) gangs of
``gang_size`` (L) ranks. A gang holds one full model copy, its embedding tables sharded over
its L ranks; the G ranks holding the same shard position form a replica group and keep their
copies of that shard in sync. Rank ``r`` runs on host ``r // ranks_per_host``.

Two placements of that grid onto ranks are supported (see :class:`Layout`). This module is
pure arithmetic: lookups for one rank are closed-form, so it stays cheap at thousands of ranks.
"""

from __future__ import annotations

import dataclasses
import enum
import functools

__all__ = ["Layout", "RankPosition", "Topology", "TopologyError"]


class Layout(enum.StrEnum):
    """How gangs and replica groups are laid out over the global rank order."""

    #: TorchRec's 2D parallel (DMPCollection) layout: gang i = [i, G+i, 2G+i, ...], replica group
    #: k = [kG, ..., kG+G-1]. Replica syncs stay on one host's fast interconnect, but losing a
    #: host loses every copy of the shards placed there.
    REPLICAS_WITHIN_HOST = "replicas_within_host"
    #: Fault-tolerant layout: gang i = [iL, ..., iL+L-1], replica group k = [k, L+k, 2L+k, ...].
    #: Gangs are packed onto hosts, so losing a host only loses whole gangs and, with two or more
    #: gangs, every shard keeps a live copy in the surviving ones.
    REPLICAS_ACROSS_HOSTS = "replicas_across_hosts"


class TopologyError(ValueError):
    """An impossible job shape, or a rank/host/gang index outside the topology."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankPosition:
    """One rank's coordinates in the gang x replica-group grid and on the hosts."""

    rank: int
    gang: int
    gang_rank: int
    #: The replica group is the shard position, so it always equals ``gang_rank``.
    replica_group: int
    #: Position within the replica group, which is ordered by gang, so it equals ``gang``.
    replica_rank: int
    host: int


def _check_index(name: str, value: int, bound: int) -> int:
    # bool is an int subclass; True silently meaning rank 1 would hide caller bugs.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TopologyError(f"{name} must be an int, got {value!r}")
    if not 0 <= value < bound:
        raise TopologyError(f"{name}={value} is out of range, valid {name}s are 0..{bound - 1}")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class Topology:
    """The gang / replica-group / host layout of a job; validated on construction.

    ``layout`` also accepts the plain string value (e.g. from a config file).
    """

    world_size: int
    gang_size: int
    ranks_per_host: int
    layout: Layout = Layout.REPLICAS_ACROSS_HOSTS

    def __post_init__(self) -> None:
        for name in ("world_size", "gang_size", "ranks_per_host"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TopologyError(f"{name} must be an int, got {value!r}")
            if value < 1:
                raise TopologyError(f"{name} must be >= 1, got {value}")
        t, n, per_host = self.world_size, self.gang_size, self.ranks_per_host
        if n > t:
            raise TopologyError(f"gang_size={n} > world_size={t}")
        if t % n:
            raise TopologyError(f"world_size={t} is not divisible by gang_size={n}")
        if not isinstance(self.layout, Layout):
            allowed = ", ".join(repr(m.value) for m in Layout)
            try:
                layout = Layout(self.layout)
            except ValueError:
                raise TopologyError(
                    f"layout={self.layout!r} is not a known layout; allowed: {allowed}"
                ) from None
            object.__setattr__(self, "layout", layout)
        if t <= per_host:
            return  # A single host holds everything, so no group can straddle hosts.
        g = self.num_gangs
        if self.layout is Layout.REPLICAS_WITHIN_HOST:
            # Host boundaries fall on multiples of ranks_per_host and replica groups start on
            # multiples of G, so groups never straddle hosts exactly when G divides it.
            if per_host % g:
                raise TopologyError(
                    f"replicas_within_host needs each replica group (num_gangs={g} ranks) on one "
                    f"host, but ranks_per_host={per_host} is not a multiple of {g}"
                )
        elif per_host % n and n % per_host:
            raise TopologyError(
                f"replicas_across_hosts needs gangs packed onto hosts (whole gangs per host or "
                f"a gang on whole hosts), but neither of gang_size={n} and "
                f"ranks_per_host={per_host} divides the other"
            )

    @property
    def num_gangs(self) -> int:
        """G: the number of full model copies."""
        return self.world_size // self.gang_size

    @property
    def num_hosts(self) -> int:
        """Hosts the ranks occupy; the last one may be partly filled."""
        return -(-self.world_size // self.ranks_per_host)

    # cached_property writes the instance __dict__ directly, so it works on a frozen dataclass
    # (no slots) and stays out of __eq__/__hash__, which only look at the fields.
    @functools.cached_property
    def gangs(self) -> tuple[tuple[int, ...], ...]:
        """Gang g -> its global ranks, in gang-rank (shard position) order."""
        t, n, g = self.world_size, self.gang_size, self.num_gangs
        if self.layout is Layout.REPLICAS_WITHIN_HOST:
            return tuple(tuple(range(i, t, g)) for i in range(g))
        return tuple(tuple(range(i * n, (i + 1) * n)) for i in range(g))

    @functools.cached_property
    def replica_groups(self) -> tuple[tuple[int, ...], ...]:
        """Replica group k (shard position k) -> its global ranks, ordered by gang index."""
        t, n, g = self.world_size, self.gang_size, self.num_gangs
        if self.layout is Layout.REPLICAS_WITHIN_HOST:
            return tuple(tuple(range(k * g, (k + 1) * g)) for k in range(n))
        return tuple(tuple(range(k, t, n)) for k in range(n))

    def _gang_and_gang_rank(self, rank: int) -> tuple[int, int]:
        if self.layout is Layout.REPLICAS_WITHIN_HOST:
            gang_rank, gang = divmod(rank, self.num_gangs)
        else:
            gang, gang_rank = divmod(rank, self.gang_size)
        return gang, gang_rank

    def position(self, rank: int) -> RankPosition:
        """Where ``rank`` sits: gang, shard position, place in its replica group, host."""
        _check_index("rank", rank, self.world_size)
        gang, gang_rank = self._gang_and_gang_rank(rank)
        return RankPosition(
            rank=rank,
            gang=gang,
            gang_rank=gang_rank,
            replica_group=gang_rank,
            replica_rank=gang,
            host=rank // self.ranks_per_host,
        )

    def host_of(self, rank: int) -> int:
        """The host ``rank`` runs on."""
        return _check_index("rank", rank, self.world_size) // self.ranks_per_host

    def gang_hosts(self, gang: int) -> tuple[int, ...]:
        """Sorted distinct hosts that ``gang``'s ranks run on."""
        _check_index("gang", gang, self.num_gangs)
        return tuple(sorted({r // self.ranks_per_host for r in self.gangs[gang]}))

    def ranks_on_host(self, host: int) -> tuple[int, ...]:
        """The global ranks on ``host``, ascending."""
        _check_index("host", host, self.num_hosts)
        start = host * self.ranks_per_host
        return tuple(range(start, min(start + self.ranks_per_host, self.world_size)))
