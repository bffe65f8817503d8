"""Giving gangs back on purpose (a drain), as a decision value.

A job shrinks not only when something dies: an autoscaler scaling an idle node down, a
spot-instance preemption notice, or a user asking for fewer gangs. A drain gives whole gangs back
at the next interval boundary without losing a row: the job syncs first (the drained gangs' work
is committed into every replica), the rows they had not trained yet are shared again among the
others, and their placement groups are released.

Requests come from three places, folded into one :class:`DrainRequest`:

- a user: :func:`raytrec.drain` (or ``python -m jobs.drain RUN_DIR``) writes
  :data:`REQUEST_FILE` into the run directory, asking for ``gangs`` fewer gangs or a lower
  ``max_gangs``; the coordinator reads and removes it at the next boundary;
- the cluster: nodes Ray marks as draining (``ray drain-node``, an autoscaler's idle
  termination, a preemption notice); every gang with a rank there goes;
- the job never goes below ``elastic.min_gangs`` on a user's request, and never gives back its
  last gang.

:func:`decide_drain` is pure: which gangs go, and the job's new ``max_gangs``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping

from raytrec.elastic.decisions import Drain
from raytrec.elastic.membership import Membership
from raytrec.errors import ConfigError

__all__ = ["REQUEST_FILE", "Drain", "DrainRequest", "decide_drain", "read_request", "request_drain"]

#: The file in a run directory through which a user asks a running job to give gangs back.
REQUEST_FILE = "drain_request.json"
#: Its presence asks the job in the run directory to stop at its next interval boundary.
STOP_FILE = "stop_request"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrainRequest:
    """What the job was asked to give back (module doc)."""

    #: Give back this many gangs (and lower ``max_gangs`` by as many, so it does not grow back).
    gangs: int = 0
    #: From now on at most this many gangs.
    max_gangs: int | None = None
    #: Ray node ids marked for removal: every gang with a rank on one of them goes.
    nodes: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if isinstance(self.gangs, bool) or not isinstance(self.gangs, int) or self.gangs < 0:
            raise ConfigError(f"drain: gangs must be an integer >= 0, got {self.gangs!r}")
        m = self.max_gangs
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ConfigError(f"drain: max_gangs must be an integer >= 1 or null, got {m!r}")

    def __bool__(self) -> bool:
        return bool(self.gangs or self.max_gangs is not None or self.nodes)

    def merged(self, other: DrainRequest) -> DrainRequest:
        caps = [m for m in (self.max_gangs, other.max_gangs) if m is not None]
        return DrainRequest(
            gangs=self.gangs + other.gangs,
            max_gangs=min(caps) if caps else None,
            nodes=self.nodes | other.nodes,
        )


def decide_drain(
    membership: Membership,
    request: DrainRequest,
    *,
    node_of_rank: Mapping[int, str],
    max_gangs: int,
    min_gangs: int,
) -> Drain | None:
    """Which gangs to give back for ``request``, or None when there is nothing to do.

    Gangs on draining nodes go first (all of them, even below ``min_gangs``: the nodes are
    leaving, and a drained gang loses no row where a dead one would need replays), then, for a
    user's request, the newest gangs until the job is down to what was asked, never below
    ``min_gangs``. The last gang is never given back.
    """
    if not request:
        return None
    live = membership.gang_ids
    on_nodes = [
        g.gang_id
        for g in membership.gangs
        if any(node_of_rank.get(r) in request.nodes for r in g.job_ranks)
    ]
    chosen = on_nodes[: max(0, len(live) - 1)]
    want = len(live) - request.gangs if request.gangs else len(live)
    if request.max_gangs is not None:
        want = min(want, request.max_gangs)
    want = max(want, min_gangs, 1)
    for gid in reversed(live):  # the newest first
        if len(live) - len(chosen) <= want:
            break
        if gid not in chosen:
            chosen.append(gid)
    cap = max_gangs
    if request.max_gangs is not None:
        cap = min(cap, request.max_gangs)
    if request.gangs:
        cap = min(cap, len(live) - request.gangs)
    cap = max(cap, min_gangs, 1)
    if not chosen and cap == max_gangs:
        return None
    parts = []
    if on_nodes:
        parts.append(f"gangs {sorted(on_nodes)} run on nodes marked for removal")
    if request.gangs or request.max_gangs is not None:
        asked = f"{request.gangs} fewer gangs" if request.gangs else ""
        if request.max_gangs is not None:
            asked += (" and " if asked else "") + f"max_gangs={request.max_gangs}"
        parts.append(f"asked for {asked}")
    return Drain(
        gangs=tuple(sorted(chosen)),
        max_gangs=cap,
        reason=(
            f"{'; '.join(parts)}: giving back gangs {sorted(chosen)}, "
            f"{len(live) - len(chosen)} left (at most {cap} from now on)"
        ),
    )


def request_drain(run_dir: str, *, gangs: int = 0, max_gangs: int | None = None) -> str:
    """Asks the job running in ``run_dir`` to give back ``gangs`` gangs, or to keep at most
    ``max_gangs``, at its next interval boundary; returns the request file's path. A request
    not yet read is added to."""
    request = DrainRequest(gangs=gangs, max_gangs=max_gangs)
    if not request:
        raise ConfigError("drain: ask for gangs >= 1 or a max_gangs")
    if not os.path.isdir(run_dir):
        raise ConfigError(f"drain: {run_dir} is not a run directory")
    path = os.path.join(run_dir, REQUEST_FILE)
    pending = read_request(path, remove=True)
    if pending:
        request = pending.merged(request)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"gangs": request.gangs, "max_gangs": request.max_gangs}, f)
    os.replace(tmp, path)  # the job never reads half a file
    return path


def request_stop(run_dir: str) -> str:
    """Asks the job running in ``run_dir`` to stop at its next interval boundary, as a first
    SIGTERM does (it syncs, checkpoints when checkpoints are configured and saves its model);
    returns the request file's path. For a job in another thread or process."""
    if not os.path.isdir(run_dir):
        raise ConfigError(f"stop: {run_dir} is not a run directory")
    path = os.path.join(run_dir, STOP_FILE)
    with open(path, "w") as f:
        f.write("stop at the next interval boundary\n")
    return path


def stop_requested(run_dir: str) -> bool:
    """Whether :func:`request_stop` asked the job in ``run_dir`` to stop."""
    return os.path.exists(os.path.join(run_dir, STOP_FILE))


def read_request(path: str, *, remove: bool) -> DrainRequest:
    """The request in ``path`` (an empty one when there is none); ``remove``: it is taken."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        return DrainRequest()
    except (OSError, ValueError) as e:
        raise ConfigError(f"drain request {path} cannot be read: {e}") from None
    if remove:
        os.remove(path)
    if not isinstance(raw, dict) or set(raw) - {"gangs", "max_gangs"}:
        raise ConfigError(f"drain request {path} must hold gangs and/or max_gangs, got {raw!r}")
    return DrainRequest(gangs=int(raw.get("gangs") or 0), max_gangs=raw.get("max_gangs"))
