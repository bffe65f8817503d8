"""Connecting to Ray: an embedded local cluster on 127.0.0.1, or ``RAY_ADDRESS``.

With no address, the job starts its own single-node cluster bound to the
loopback interface (``address="local"`` also ignores a stale
``ray_current_cluster`` file from an earlier run). The cluster's logical CPU
count is raised to fit the job, because Ray's CPU resource is a scheduling
token here: ranks on a small machine share its cores.
"""

from __future__ import annotations

import collections
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import ray
from ray._private import ray_constants

from raytrec.cluster.capacity import NodeShape

if TYPE_CHECKING:
    from ray.core.generated import autoscaler_pb2

__all__ = [
    "COORDINATOR_PREFIX",
    "ClusterStateError",
    "autoscaler_hides_node_types",
    "autoscaling_in_status",
    "bind_to_loopback",
    "cluster_shapes",
    "connect",
    "node_shapes",
    "pin_collectives_to",
    "pin_ray_data_helpers",
    "read_cluster_config",
    "resolve_storage_path",
]

LOOPBACK = "127.0.0.1"
#: A job's coordinator actor is named this plus the run's name (tools find it by the prefix).
COORDINATOR_PREFIX = "raytrec-coordinator-"


def connect(address: str | None = None, *, num_cpus: float = 0, **kwargs: Any) -> bool:
    """Connects to Ray; returns True when this call started an embedded cluster."""
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    runtime_env = kwargs.pop("runtime_env", None)
    if address:
        ray.init(address=address, runtime_env=runtime_env, **kwargs)
        return False
    bind_to_loopback()
    ray.init(
        address="local",
        _node_ip_address=LOOPBACK,
        num_cpus=max(int(num_cpus + 0.999), os.cpu_count() or 1),
        include_dashboard=False,
        runtime_env=runtime_env,
        **kwargs,
    )
    return True


def bind_to_loopback() -> None:
    """Makes the Ray nodes this process starts (``ray.init``, ``ray.cluster_utils.Cluster``)
    bind to 127.0.0.1.

    Ray resolves "127.0.0.1" to the machine's outward address unless
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER is 0. Ray reads that variable when it is imported: the
    environment carries it to the processes Ray starts, and the already-imported constant is set
    for this one.
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def pin_collectives_to(address: str) -> str | None:
    """Makes Gloo and NCCL listen on the interface that holds ``address`` (the node's Ray
    address) instead of the one the host name resolves to; returns the interface's name, or
    None when no interface holds it or the operator chose one already.

    Gloo and NCCL pick their interface by name only (``GLOO_SOCKET_IFNAME``,
    ``NCCL_SOCKET_IFNAME``), and read the variables when a process group is created, so this
    runs in the rank's process before its first group.
    """
    import psutil  # a dependency of Ray

    if "GLOO_SOCKET_IFNAME" in os.environ:
        return None
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addresses):
            os.environ["GLOO_SOCKET_IFNAME"] = name
            os.environ.setdefault("NCCL_SOCKET_IFNAME", name)
            return name
    return None


#: Where a relative ``storage_path`` goes for a job sent with ``ray job submit``.
SUBMITTED_RESULTS = "~/raytrec_results"


def pin_ray_data_helpers() -> None:
    """Creates Ray Data's per-cluster helper actors from this process, so that they live on its
    node (the driver's, which lives as long as the job).

    The first pipeline run anywhere in a cluster creates Ray Data's detached helper actors (its
    stats actor and its autoscaling coordinator) pinned to the node of the process that ran it.
    Left to the ranks, that is a worker node; once it is lost, every later pipeline's calls to
    them fail (``ActorUnschedulableError``, ``KeyError: dataset_...``) and Ray Data logs a
    traceback for each. Ray has no public call that creates them; these are Ray Data's own
    getters (Ray's version is pinned in requirements/base.lock), skipped if they moved.
    """
    try:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator,
        )
        from ray.data._internal.stats import get_or_create_stats_actor
    except ImportError:  # another Ray: its pipelines create them where they first run
        return
    get_or_create_stats_actor()
    get_or_create_autoscaling_coordinator()


def resolve_storage_path(path: str, environ: Mapping[str, str] | None = None) -> str:
    """An absolute ``storage_path``. A relative one is taken from the working directory, except
    in the driver of a job sent with ``ray job submit`` (Ray hands it its job config through
    ``RAY_JOB_CONFIG_JSON_ENV_VAR``): its working directory is Ray's temporary copy of the
    uploaded code, deleted with the session, so a relative path goes under
    ``~/raytrec_results`` on the node the driver runs on instead (as Ray Train's
    ``~/ray_results``)."""
    environ = os.environ if environ is None else environ
    if os.path.isabs(path):
        return path
    if "RAY_JOB_CONFIG_JSON_ENV_VAR" in environ:
        home = environ.get("HOME") or os.path.expanduser("~")
        return os.path.normpath(os.path.join(SUBMITTED_RESULTS.replace("~", home, 1), path))
    return os.path.abspath(path)


class ClusterStateError(RuntimeError):
    """Ray's GCS did not answer what the job reads of the cluster before it starts; the message
    names what was read and from where."""


def read_cluster_config() -> autoscaler_pb2.ClusterConfig | None:
    """The node types the cluster's autoscaler published in the GCS (Ray's cluster config), or
    None when none was published (a fixed cluster, or an autoscaler that publishes none: Ray
    2.60's own do not). Raises :class:`ClusterStateError` when the GCS cannot be read."""
    from ray._private.state import state  # no public wrapper for the cluster config in Ray 2.60

    try:
        return state.get_cluster_config()
    except Exception as e:
        raise ClusterStateError(
            "could not read the autoscaler's node types (Ray's cluster config, "
            f"ray._private.state.state.get_cluster_config()) from the GCS at {_gcs_address()}: "
            f"{type(e).__name__}: {e}"
        ) from e


def autoscaler_hides_node_types() -> bool:
    """Whether an autoscaler runs on the cluster without having published its node types: then
    what it may add is not known before the job asks for it. Ray 2.60's autoscalers publish
    none. Raises :class:`ClusterStateError` when the GCS cannot be read."""
    import ray._raylet
    from ray._private import ray_constants

    try:
        if read_cluster_config() is not None:
            return False
        gcs = ray._raylet.GcsClient(address=_gcs_address())
        v2 = gcs.internal_kv_get(
            ray._raylet.GCS_AUTOSCALER_V2_ENABLED_KEY.encode(),
            namespace=ray._raylet.GCS_AUTOSCALER_STATE_NAMESPACE.encode(),
        )
        status = gcs.internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS.encode(), None)
    except ClusterStateError:
        raise
    except Exception as e:
        raise ClusterStateError(
            f"could not read whether the cluster runs an autoscaler (its status in the GCS at "
            f"{_gcs_address()}): {type(e).__name__}: {e}"
        ) from e
    return v2 == b"1" or autoscaling_in_status(status)


#: The node type Ray's monitor gives each node of a fixed cluster (its read-only provider).
_READ_ONLY_NODE_TYPE = re.compile(r"node_[0-9a-f]{56}")


def autoscaling_in_status(status: bytes | None) -> bool:
    """Whether the status Ray's monitor (autoscaler version 1) writes to the GCS under
    ``__autoscaling_status`` comes from an autoscaler with a config. On a fixed cluster the
    monitor runs a read-only autoscaler that names every node's type ``node_<node id>``; an
    autoscaler with a config names them as its config does (the head's type included)."""
    if not status:
        return False
    try:
        report = json.loads(status).get("autoscaler_report") or {}
    except (ValueError, AttributeError):
        return False
    types = set((report.get("node_type_mapping") or {}).values()) | set(
        report.get("active_nodes") or {}
    )
    return any(not _READ_ONLY_NODE_TYPE.fullmatch(t) for t in types)


def _gcs_address() -> str:
    # Not get_runtime_context() unconnected: it would start a Ray instance to answer.
    if not ray.is_initialized():
        return "(not connected)"
    return str(ray.get_runtime_context().gcs_address)


def node_shapes(
    nodes: Sequence[Mapping[str, Any]], config: autoscaler_pb2.ClusterConfig | None
) -> list[NodeShape]:
    """The shapes of ``nodes`` (``ray.nodes()``: the live ones, alike ones counted together) and
    of the node types in ``config`` an autoscaler may add (those with a maximum above 0)."""
    alive: collections.Counter[tuple[tuple[str, float], ...]] = collections.Counter()
    for node in nodes:
        if node.get("Alive"):
            res = node.get("Resources", {})
            alive[tuple((k, float(res[k])) for k in ("CPU", "GPU") if res.get(k))] += 1
    # A node without CPUs or GPUs (a head node kept for Ray's own processes) holds no rank.
    shapes = [
        NodeShape(name="alive", resources=dict(key), count=count)
        for key, count in alive.items()
        if key
    ]
    for group in config.node_group_configs if config is not None else ():
        if group.max_count != 0:
            shapes.append(
                NodeShape(
                    name=f"node type {group.name}",
                    resources={k: float(v) for k, v in group.resources.items()},
                    count=None if group.max_count < 0 else int(group.max_count),
                )
            )
    return shapes


def cluster_shapes() -> list[NodeShape]:
    """The connected cluster's node shapes: its live nodes (alike ones counted together) and,
    on an autoscaling cluster that published them, the node types the autoscaler may add
    (:func:`read_cluster_config`). Raises :class:`ClusterStateError` when the GCS cannot be
    read."""
    return node_shapes(ray.nodes(), read_cluster_config())
