"""The end of a step (the dense update and the step count), and settling a step that failed.

FBGEMM applies a step's embedding update inside backward; the dense update follows: the dense
gradients (DDP's average over the gang) are averaged over the replica group per ``sync.dense``
and the dense optimizer steps. If the replica plane fails in between, the step has happened
(its embedding update cannot be undone) but its dense update has not. Such a step's dense
gradients are kept until the re-formed job finishes that update among the survivors or drops
it (:meth:`DenseUpdate.settle_failed_step`); :mod:`raytrec.elastic.dense` decides which.
"""

from __future__ import annotations

import contextlib

import torch

from raytrec.engine.rank_model import RankModel
from raytrec.engine.replica_plane import ReplicaPlaneError
from raytrec.engine.replica_sync import ReplicaSync

__all__ = ["DenseUpdate"]


class DenseUpdate:
    """A rank's step count and the dense update that ends each step."""

    def __init__(self, model: RankModel, replicas: ReplicaSync, *, step: int = 0) -> None:
        self._model = model
        self._replicas = replicas
        self.step = step  # optimizer steps taken
        self._in_flight = False
        self._holding_failed_step = False  # dense gradients of a failed step kept, not applied

    def apply(self) -> None:
        """Ends a step whose backward has run: the dense update, averaged over the replica
        group per ``sync.dense``, and the step count."""
        # FBGEMM updated the embeddings inside backward: from here on the step has happened,
        # whatever becomes of the dense update (see abandon_failed_step).
        optimizer = self._model.dense_optimizer
        self._in_flight = True
        try:
            across_gangs = self._replicas.average_dense_grads()
        except ReplicaPlaneError:
            with contextlib.suppress(Exception):  # a gang that lost a rank: dropped anyway
                self._replicas.leave_with_gang(ok=False)
            raise
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        self.step += 1
        self._in_flight = False
        if across_gangs:
            # A peer whose all-reduce failed holds this step undone; this rank finished it and
            # stops here too (GangPeerFailed), its step counted.
            self._replicas.leave_with_gang(ok=True)

    def abandon_failed_step(self) -> bool:
        """Cleans up after a replica-plane failure inside a step.

        The embedding update of that step already happened (fused into backward) and cannot
        be undone, so the step counts. Its dense update did not happen: the all-reduce failed,
        and a failed collective writes nothing back, so the dense gradients are still this
        gang's own (DDP's average over the gang). They are kept until the coordinator, once
        the job has re-formed, says whether to finish that update among the survivors or drop
        it (:meth:`settle_failed_step`). Returns whether this rank holds such a step (also when
        it is asked again, after a further loss interrupted the re-forming).
        """
        if self._in_flight:
            self.step += 1
            self._in_flight = False
            self._holding_failed_step = True
        elif not self._holding_failed_step:
            self._model.dense_optimizer.zero_grad(set_to_none=False)
        return self._holding_failed_step

    def settle_failed_step(self, *, finish: bool) -> None:
        """After re-forming: applies the failed step's dense update among this generation's
        gangs (``finish``), or drops it.

        Finishing averages the dense gradients each rank kept (:meth:`abandon_failed_step`;
        zero on a rank that had not reached the step) over the new replica plane and steps the
        dense optimizer, so the survivors' batches of that step reach the dense parameters
        once, averaged over the live gangs like any step's. Collective: every live rank calls
        it with the same ``finish``, after the dense state was made identical
        (:meth:`ReplicaSync.broadcast_dense`).
        """
        optimizer = self._model.dense_optimizer
        if finish:
            for p in self._model.dense_params.values():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self._replicas.average_dense_grads()
            optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        self._holding_failed_step = False
