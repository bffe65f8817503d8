"""Train a DLRM with 2D sparse parallelism: ``python -m jobs.train [options]``.

Runs on an embedded local Ray cluster (127.0.0.1) unless ``RAY_ADDRESS`` is
set, in which case it runs on that cluster (this is also the entry point for
``ray job submit --working-dir . -- python -m jobs.train``). Exits non-zero
when training fails.
"""

from __future__ import annotations

import argparse
import sys

from raytrec.api import fit
from raytrec.config import (
    ConfigError,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ScalingConfig,
    ShardingConfig,
    SyncConfig,
    TrainConfig,
    criteo_tables,
)
from raytrec.data.arrow_kjt import BadInputError
from raytrec.data.parquet import ParquetSource
from raytrec.data.spec import SpecError, criteo_spec


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobs.train", description=__doc__)
    p.add_argument("--num-workers", type=int, default=4, help="ranks in the job")
    p.add_argument("--gang-size", type=int, default=2, help="ranks per model copy")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--batch-size", type=int, default=256, help="rows per rank per step")
    p.add_argument("--sync-every", type=int, default=4)
    p.add_argument("--arch", default="dlrm", help="dlrm or dlrm_dcn")
    p.add_argument("--sharding-type", default="table_wise")
    p.add_argument("--embedding-optimizer", default="rowwise_adagrad")
    p.add_argument("--num-embeddings", type=int, default=10_000, help="rows per table")
    p.add_argument("--embedding-dim", type=int, default=16)
    p.add_argument("--layout", default="replicas_across_hosts")
    p.add_argument("--gpu", action="store_true", help="one GPU per rank, NCCL")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--storage-path", default="runs")
    p.add_argument(
        "--data",
        default=None,
        help="Criteo-layout Parquet (a file, directory or URI, e.g. from python -m jobs.make_data) "
        "streamed with Ray Data; default: the synthetic source",
    )
    p.add_argument("--epochs", type=int, default=1, help="passes over --data")
    return p


def build_config(argv: list[str] | None = None) -> TrainConfig:
    return config_from_args(parser().parse_args(argv))


def config_from_args(a: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        model=ModelConfig(
            arch=a.arch,
            tables=criteo_tables(num_embeddings=a.num_embeddings, embedding_dim=a.embedding_dim),
            dense_arch_layers=(64, a.embedding_dim),
        ),
        optimizer=OptimizerConfig(embedding=a.embedding_optimizer),
        sharding=ShardingConfig(sharding_type=a.sharding_type),
        scaling=ScalingConfig(
            num_workers=a.num_workers, gang_size=a.gang_size, layout=a.layout, use_gpu=a.gpu
        ),
        sync=SyncConfig(sync_every=a.sync_every),
        data=DataConfig(batch_size=a.batch_size),
        num_steps=a.steps,
        log_every=a.log_every,
        seed=a.seed,
        storage_path=a.storage_path,
    )


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
        config = config_from_args(args)
        source = None
        if args.data:
            source = ParquetSource(
                paths=args.data,
                spec=criteo_spec(args.num_embeddings),
                epochs=args.epochs,
                shuffle_seed=args.seed,
            )
        result = fit(config, source=source)
    except (ConfigError, SpecError) as e:
        print(f"raytrec: configuration error: {e}", file=sys.stderr)
        return 2
    except BadInputError as e:
        print(f"raytrec: bad input: {e}", file=sys.stderr)
        return 3
    first, last = result.history[0], result.history[-1]
    print(
        f"[raytrec] done: {result.steps} steps in {result.wall_s:.1f}s; loss {first.loss:.4f} "
        f"-> {last.loss:.4f}; final model: {result.final_state_path}; "
        f"metrics: {result.run_dir}/metrics.json"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
