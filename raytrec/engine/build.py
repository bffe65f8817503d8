"""Building a rank: its gang world, the sharded model and the optimizers.

The rank joins its gang's world (the default ``torch.distributed`` group, world size L) through
the job's store, shards the model over it with the job's single plan, and builds the dense
optimizer. The replica plane across gangs is joined afterwards
(:class:`~raytrec.engine.replica_sync.ReplicaSync`).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ShardingEnv
from torchrec.optim.optimizers import in_backward_optimizer_filter

from raytrec._quiet import quiet_known_warnings
from raytrec.engine.dense_optimizer import build_dense_optimizer
from raytrec.engine.managed_ids import ManagedIds
from raytrec.engine.plan import apply_embedding_optimizer, sharders
from raytrec.engine.publish_rows import UnpublishedRows
from raytrec.engine.rank_model import RankModel, fused_tables
from raytrec.engine.replica_plane import RENDEZVOUS_TIMEOUT_S
from raytrec.engine.spec import RankSpec, dropout_seed, embedding_seed
from raytrec.engine.touched_rows import TouchedRows

__all__ = ["build_rank"]


def build_rank(spec: RankSpec) -> tuple[RankModel, dist.Store]:
    """Joins the gang world, shards the model and builds the optimizers; returns them with the
    client of the job's store that the replica plane is built from."""
    quiet_known_warnings()
    cfg = spec.config
    device = torch.device("cpu")
    if cfg.scaling.use_gpu:
        # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU.
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, int(cfg.scaling.cpus_per_rank)))
    # Rendezvous waits for the slowest rank to start (imports take seconds, more on a loaded
    # machine); collectives afterwards get the short timeout that failure detection relies on.
    rendezvous = timedelta(seconds=max(spec.timeout_s, RENDEZVOUS_TIMEOUT_S))
    store = spec.store.connect(rendezvous)
    dist.init_process_group(
        backend=cfg.scaling.resolved_backend,
        store=dist.PrefixStore(f"gang{spec.gang}", store),
        rank=spec.gang_rank,
        world_size=spec.gang_size,
        timeout=rendezvous,
    )
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=spec.timeout_s))
    module = spec.model_factory(cfg.model, spec.num_dense, device, cfg.seed)
    apply_embedding_optimizer(module, cfg.optimizer)
    # DistributedModelParallel allocates this rank's embedding shards and initialises them from
    # the global generator: seeded here from the job's seed and the rank's place in its gang,
    # so that a run is reproducible (the other gangs then copy the first's state).
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(embedding_seed(cfg.seed, spec.gang_rank))
        model = DistributedModelParallel(
            module=module,
            env=ShardingEnv.from_process_group(dist.group.WORLD),
            device=device,
            plan=spec.plan,
            sharders=sharders(),
        )
    if cfg.model.dropout:
        # Dropout draws its masks from the global generator: one seed per job rank, from the
        # job's seed, so that a run with dropout reproduces too.
        torch.manual_seed(dropout_seed(cfg.seed, spec.rank))
    dense_params = dict(in_backward_optimizer_filter(model.named_parameters()))
    built = RankModel(
        device=device,
        model=model,
        dense_params=dense_params,
        # Its state exists from here on with the shapes a stepped rank's has (Adam's moments
        # and step counts included), so every state movement works before the first step.
        dense_optimizer=build_dense_optimizer(dense_params, cfg.optimizer),
        tables=(tables := fused_tables(model)),
        touched=(
            TouchedRows(tables, levels=len(cfg.sync.levels) + 1)
            if cfg.sync.rows == "touched"
            else None
        ),
        unpublished=UnpublishedRows(tables) if cfg.publish.every_n_steps is not None else None,
        ids=ManagedIds.for_model(cfg.model),
        seed=cfg.seed,
    )
    return built, store
