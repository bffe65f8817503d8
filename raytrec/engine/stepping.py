"""The training step: forward, backward and the dense update, one batch at a time or through
TorchRec's train pipeline, with the replica syncs the schedule puts between steps.

Per step: forward, backward (FBGEMM applies the embedding update inside backward; DDP averages
dense gradients over the gang), then the dense update (:mod:`raytrec.engine.dense_update`).
A batch whose dense gradient is already in the model (a replay after a loss) trains with a zero
dense gradient (``StepInput(dense=False)``).

:meth:`Stepper.train_steps` yields what happens as values, in order: :class:`StepBegins`
before each step, :class:`StepResult` as it ends, :class:`SyncBegins` and :class:`Synced`
around each sync the schedule puts after a step. A step that fails raises :class:`StepFailed`,
which names the input whose step began (its forward ran, so its embedding update may have
happened and the step counts) and the inputs taken and never started.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch

from raytrec.data.source import Batch
from raytrec.engine.dense_update import DenseUpdate
from raytrec.engine.managed_rows import merge_ids, merges_after
from raytrec.engine.rank_model import RankModel
from raytrec.engine.replica_plane import ReplicaPlaneError
from raytrec.engine.replica_sync import ReplicaSync
from raytrec.sync.schedule import SyncDecision

__all__ = [
    "StepBegins",
    "StepEvent",
    "StepFailed",
    "StepInput",
    "StepResult",
    "Stepper",
    "SyncBegins",
    "Synced",
]


@dataclasses.dataclass(frozen=True, slots=True)
class StepInput:
    """One step's batch (on the CPU), whether its dense gradient counts (``dense=False``: a
    replay whose dense gradient is already in the model) and its batch id (None: a batch
    without one)."""

    batch: Batch
    dense: bool = True
    batch_id: int | None = None

    @property
    def rows(self) -> int:
        return int(self.batch.labels.shape[0])


@dataclasses.dataclass(frozen=True, slots=True)
class StepBegins:
    """Step ``step`` is about to run on ``input`` (what the caller does before a step, such as
    an injected fault, goes here). What trained is told by :class:`StepResult` and
    :class:`StepFailed`."""

    step: int
    input: StepInput


@dataclasses.dataclass(frozen=True, slots=True)
class StepResult:
    """A step that ended: its loss, logits and labels, detached and left on the device (reading
    them waits for the step)."""

    step: int
    batch_id: int | None
    rows: int
    loss: torch.Tensor
    logits: torch.Tensor
    labels: torch.Tensor


@dataclasses.dataclass(frozen=True, slots=True)
class SyncBegins:
    """The sync the schedule puts after step ``decision.step`` begins."""

    decision: SyncDecision


@dataclasses.dataclass(frozen=True, slots=True)
class Synced:
    """The sync after step ``step`` ended, ``seconds`` after it began."""

    step: int
    seconds: float


StepEvent = StepBegins | StepResult | SyncBegins | Synced


class StepFailed(Exception):
    """Step ``step`` of :meth:`Stepper.run_steps` failed with ``error`` (also this exception's
    cause).

    ``began``: that step's input if its forward ran (its embedding update may have happened,
    so the step counts as trained: :meth:`DenseUpdate.abandon_failed_step`); None if the step
    failed before it (a train pipeline's input distribution, say). ``unstarted``: the inputs
    taken and never started, oldest first; nothing of them reached the model."""

    def __init__(
        self,
        error: Exception,
        *,
        step: int,
        began: StepInput | None,
        unstarted: tuple[StepInput, ...] = (),
    ) -> None:
        super().__init__(f"step {step} failed: {error!r}")
        self.error = error
        self.step = step
        self.began = began
        self.unstarted = unstarted


class Stepper:
    """Runs one rank's steps, with or without a TorchRec train pipeline."""

    def __init__(
        self, model: RankModel, dense: DenseUpdate, replicas: ReplicaSync, *, pipeline: str
    ) -> None:
        self._model = model
        self._dense = dense
        self._replicas = replicas
        self._pipeline_kind = pipeline  # "off", "sparse_dist" or "semi_sync"
        # While a batch trains whose dense gradient is already in the model (a replay): hooks
        # that make its dense gradient zero (_set_dense_grads).
        self._mask_hooks: list[Any] = []
        # TorchRec's train pipeline, made at the first pipelined step, and the inputs it holds
        # that have not started, oldest first.
        self.pipeline: Any = None
        self._held: deque[StepInput] = deque()
        self._began: StepInput | None = None  # the input whose pipelined forward ran last
        self._last_loss = torch.zeros(())  # that forward's loss, detached

    def train_step(self, item: StepInput) -> StepResult:
        """One forward/backward/update on this rank's local batch.

        ``item.dense=False``: the batch updates its embedding rows only; its dense gradient is
        zero. The step still takes part in every collective, so it is a step like any other for
        the job.
        """
        step = self._dense.step + 1
        batch = self._model.remapped(item.batch, step).to(self._model.device)
        loss, (_, logits, labels) = self._model.model(batch)
        self._set_dense_grads(item.dense)
        try:
            loss.backward()
        finally:
            self._set_dense_grads(True)
        self._dense.apply()
        return _result(step, item, loss, logits, labels)

    def train_steps(self, inputs: Iterator[StepInput], num_steps: int) -> Iterator[StepEvent]:
        """Trains ``num_steps`` steps on the next inputs of ``inputs``, syncing with the
        replicas after every step the schedule says (:meth:`ReplicaSync.decide`).

        The steps run in segments that end at each sync due with another gang and at
        ``num_steps`` (each one :meth:`run_steps`), so a train pipeline holds no batch in flight
        at a sync, nor when this returns.
        """
        left = num_steps
        replicas = self._replicas
        # With managed ids the map changes after each job-wide sync: a segment ends there too,
        # so that no batch is mapped ahead of its step under the map before.
        merging = self._model.ids is not None

        def boundary(step: int) -> bool:
            lower = len(replicas.config.levels)
            return replicas.syncs_with_others(step) or (
                merging and merges_after(replicas.decide(step), lower)
            )

        while left:
            n = next((k for k in range(1, left) if boundary(self._dense.step + k)), left)
            yield from self.run_steps(itertools.islice(inputs, n))
            left -= n
            decision = replicas.decide(self._dense.step)
            if decision.due:
                started = time.perf_counter()
                yield SyncBegins(decision)
                # Each rank of the gang syncs in its own replica group: they leave the sync
                # together, failed or done (ReplicaSync.leave_with_gang).
                together = replicas.syncs_with_others(decision.step)
                try:
                    replicas.sync(decision)
                    if merging and merges_after(decision, len(replicas.config.levels)):
                        merge_ids(self._model, replicas.replica, decision.step)
                except ReplicaPlaneError:
                    if together:
                        with contextlib.suppress(Exception):
                            replicas.leave_with_gang(ok=False)
                    raise
                if together:
                    replicas.leave_with_gang(ok=True)
                yield Synced(decision.step, time.perf_counter() - started)

    def run_steps(self, inputs: Iterable[StepInput]) -> Iterator[StepBegins | StepResult]:
        """Trains every input, in order, yielding :class:`StepBegins` and :class:`StepResult`
        for each.

        With a train pipeline up to two inputs beyond the current one are taken from ``inputs``
        ahead of their steps, and are copied and input-distributed while the current one
        trains; once ``inputs`` ends, the pipeline runs what it holds and is empty when the
        last result is yielded. If a step fails, :class:`StepFailed` names the inputs taken but
        not started, and the pipeline is emptied.
        """
        if self._pipeline_kind == "off":
            for item in inputs:
                step = self._dense.step + 1
                yield StepBegins(step, item)
                try:
                    result = self.train_step(item)
                except Exception as e:
                    raise StepFailed(e, step=step, began=item) from e
                yield result
            return
        pipeline = self.pipeline or self._make_pipeline()
        source = iter(inputs)
        held = self._held  # handed to the pipeline, not started
        ahead: deque[StepInput] = deque()  # taken from the source, not yet handed over
        held.clear()

        def batches() -> Iterator[Batch]:
            while (item := ahead.popleft() if ahead else next(source, None)) is not None:
                held.append(item)
                yield self._model.remapped(item.batch, self._dense.step + 1 + len(held))

        handed = batches()  # one iterator for the segment: the pipeline fills from it
        step = self._dense.step + 1
        try:
            while True:
                step, self._began = self._dense.step + 1, None
                # The next progress() starts the oldest input held or, with none held, the
                # next one the source gives.
                if not held and not ahead:
                    first = next(source, None)
                    if first is None:
                        return
                    ahead.append(first)
                nxt = held[0] if held else ahead[0]
                yield StepBegins(step, nxt)
                _, logits, labels = pipeline.progress(handed)
                assert self._began is nxt, "the pipeline ran its batches out of order"
                yield _result(step, nxt, self._last_loss, logits, labels)
        except BaseException as e:
            pipeline.reset()  # the in-flight batches are dropped here (StepFailed names them)
            unstarted = (*held, *ahead)
            held.clear()
            if isinstance(e, Exception):
                raise StepFailed(e, step=step, began=self._began, unstarted=unstarted) from e
            raise  # the caller closed the generator, or an interrupt

    def _make_pipeline(self) -> Any:
        from torchrec.distributed.train_pipeline.train_pipelines import (
            TrainPipelineSemiSync,
            TrainPipelineSparseDist,
        )

        semi_sync = self._pipeline_kind == "semi_sync"
        cls = TrainPipelineSemiSync if semi_sync else TrainPipelineSparseDist
        self.pipeline = cls(
            self._model.model,
            optimizer=cast(torch.optim.Optimizer, _PipelineSteps(self)),
            device=self._model.device,
            execute_all_batches=True,
            custom_model_fwd=self._pipelined_forward,
        )
        return self.pipeline

    def _pipelined_forward(self, batch: Any) -> tuple[torch.Tensor, Any]:
        """The pipeline's forward of its oldest batch: the step of the oldest input held."""
        item = self._held.popleft()
        self._began = item
        self._set_dense_grads(item.dense)
        loss, output = self._model.model(batch)
        self._last_loss = loss.detach()
        return loss, output

    def _end_pipelined_step(self) -> None:
        self._set_dense_grads(True)
        self._dense.apply()

    def _set_dense_grads(self, on: bool) -> None:
        """Whether the dense gradient of the batch training now counts. While it does not, a
        hook on every dense parameter makes its gradient zero: a tensor hook runs before the
        gradient is accumulated, so DDP (whose hooks run after accumulation) averages a zero
        for this rank's batch; every rank of the gang still applies the same dense update, and
        the other ranks' batches keep their weight. The hooks exist only then (each costs every
        backward a Python call)."""
        if on and self._mask_hooks:
            for hook in self._mask_hooks:
                hook.remove()
            self._mask_hooks = []
        elif not on and not self._mask_hooks:
            self._mask_hooks = [
                p.register_hook(torch.zeros_like) for p in self._model.dense_params.values()
            ]

    def score(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's logits and the labels on this rank's local batch, in eval mode and under
        ``torch.no_grad()``: no backward, so no embedding or dense update. Every rank of the
        gang scores a batch at once (the forward is sharded)."""
        model = self._model
        batch = model.remapped(batch, None).to(model.device)
        if self.pipeline is not None:
            # The pipeline's rewritten forwards read inputs it distributed; it attaches again
            # (rewriting them anew) at its next step.
            self.pipeline.detach()
        # FBGEMM advances its step counter on every forward, scoring included: put it back,
        # so that scoring leaves fused Adam's bias correction where training had it.
        counters = [(c, c.clone()) for c in model.embedding_step_counters()]
        model.model.eval()
        try:
            with torch.no_grad():
                _, (_, logits, labels) = model.model(batch)
        finally:
            model.model.train()
            if counters:
                for counter, value in counters:
                    counter.copy_(value)
                model.step_counters_written()
        return logits.detach(), labels.detach()


def _result(
    step: int, item: StepInput, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor
) -> StepResult:
    return StepResult(
        step=step,
        batch_id=item.batch_id,
        rows=item.rows,
        loss=loss.detach(),
        logits=logits.detach(),
        labels=labels.detach(),
    )


class _PipelineSteps:
    """What a TorchRec train pipeline takes as its optimizer: its ``step()`` is the end of a
    raytrec step (the dense update, averaged over the replica group per ``sync.dense``, and the
    step count); its ``zero_grad()`` does nothing, the step having zeroed the gradients. The
    embedding update is FBGEMM's, inside backward, as in :meth:`Stepper.train_step`."""

    def __init__(self, stepper: Stepper) -> None:
        self._stepper = stepper
        self.param_groups = stepper._model.dense_optimizer.param_groups  # SemiSync checks them

    def zero_grad(self, set_to_none: bool = False) -> None:
        # Nothing to do: every step ends with the gradients zeroed (DenseUpdate.apply), and a
        # failed step's gradients must stay for settle_failed_step.
        pass

    def step(self, closure: Any = None) -> None:
        self._stepper._end_pipelined_step()
