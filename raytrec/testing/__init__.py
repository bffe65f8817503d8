"""Test doubles, for tests, demos and the fault-space simulation.

- :mod:`raytrec.testing.ray_cluster`: fault injection on a simulated multi-node Ray cluster
  (:func:`simulated_cluster`, :class:`NodeRemover`, :class:`NodeDrainer`, ...), re-exported
  here. It imports Ray; the others do not.
- :mod:`raytrec.testing.fake_group`: :class:`~raytrec.testing.fake_group.FakeWorkerGroup`, the
  coordinator's worker group without Ray: fake ranks (:mod:`~raytrec.testing.fake_rank`, which
  implement :class:`~raytrec.elastic.rank_protocol.RankProtocol`), their model copies
  (:mod:`~raytrec.testing.fake_model`), their training (:mod:`~raytrec.testing.fake_training`)
  and the fault schedule they carry out (:mod:`~raytrec.testing.fake_faults`), on a manual
  clock.
- :mod:`raytrec.testing.gloo_job`: :func:`~raytrec.testing.gloo_job.run_gang_job`, a job of
  real rank engines, one process per rank on gloo (multi-process tests and benchmarks).
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
