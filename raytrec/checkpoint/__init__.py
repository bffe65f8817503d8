"""Sharded checkpoints: save a gang's training state, resume on any shape.

* :mod:`~raytrec.checkpoint.config`: :class:`CheckpointConfig` and the save policy.
* :mod:`~raytrec.checkpoint.layout`: naming, atomic commit, listing, keep-last-K, verification.
* :mod:`~raytrec.checkpoint.manifest`: what a checkpoint holds; compatibility checks.
* :mod:`~raytrec.checkpoint.reshard`: row-wise optimizer state across column layouts.
* :mod:`~raytrec.checkpoint.state`: in-rank save and load with torch.distributed.checkpoint,
  over :mod:`~raytrec.checkpoint.storage` (DCP on any filesystem) and
  :mod:`~raytrec.checkpoint.collective` (agreement within a gang).

The pure parts are importable without torch.distributed state; ``state``
imports torch and is what a rank process uses. Import from the submodules: the
package imports nothing, so :mod:`raytrec.config` can hold a
:class:`~raytrec.checkpoint.config.CheckpointConfig`.
"""
