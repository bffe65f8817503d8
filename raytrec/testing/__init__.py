"""Fault injection on a simulated multi-node Ray cluster, for users testing a job on one machine.

:mod:`raytrec.testing.ray_cluster` (re-exported here; it imports Ray when first asked for):
:func:`simulated_cluster` starts a multi-node cluster on 127.0.0.1, :class:`NodeRemover` and
:class:`NodeDrainer` remove or drain the node of a chosen rank at a chosen step,
:func:`running_coordinator` finds the job's coordinator and :func:`committed_row_ids` reads the
rows a job committed. Rank faults (kill, hang, slow) are configured with ``testing.faults``.

The project's own test doubles (the fake worker group the fault-space simulation drives, the
gloo gang harness) live in the checkout's ``simulation/`` and are not installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raytrec.testing.ray_cluster import (
        NodeDrainer,
        NodeRemover,
        committed_row_ids,
        running_coordinator,
        simulated_cluster,
    )

__all__ = [
    "NodeDrainer",
    "NodeRemover",
    "committed_row_ids",
    "running_coordinator",
    "simulated_cluster",
]


def __getattr__(name: str) -> Any:
    """The Ray doubles, imported (with Ray) when first asked for."""
    if name in __all__:
        from raytrec.testing import ray_cluster

        return getattr(ray_cluster, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
