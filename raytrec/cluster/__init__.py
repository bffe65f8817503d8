"""The Ray cluster a job runs on: connecting and what a session needs
(:mod:`raytrec.cluster.session`), the layout of ranks in gangs and hosts
(:mod:`~raytrec.cluster.topology`), gang placement groups (:mod:`~raytrec.cluster.placement`),
whether a cluster can hold a job (:mod:`~raytrec.cluster.capacity`), and local multi-node
clusters on 127.0.0.1 (:mod:`~raytrec.cluster.local`)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raytrec.cluster.session import (
        COORDINATOR_PREFIX,
        ClusterStateError,
        autoscaler_hides_node_types,
        autoscaling_in_status,
        bind_to_loopback,
        cluster_shapes,
        connect,
        node_shapes,
        pin_collectives_to,
        pin_ray_data_helpers,
        read_cluster_config,
        resolve_storage_path,
    )

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


def __getattr__(name: str) -> Any:
    """``raytrec.cluster.X`` is ``raytrec.cluster.session.X``, imported when first asked for: the
    package's other modules are imported by what ``session`` imports, so it cannot import
    ``session`` as it starts."""
    if name in __all__:
        return getattr(importlib.import_module("raytrec.cluster.session"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
