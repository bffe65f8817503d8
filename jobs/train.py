"""Train a DLRM with 2D sparse parallelism: ``python -m jobs.train [--config FILE] [options]``.

Runs on an embedded local Ray cluster (127.0.0.1) unless ``RAY_ADDRESS`` is set, in which case
it runs on that cluster; this is also the entry point for
``ray job submit --working-dir . -- python -m jobs.train ...`` (Ray sets ``RAY_ADDRESS`` for a
job's driver). See docs/job_submission.md.

The configuration is resolved in this order, later wins: the config classes' defaults, this
job's own defaults (listed below), ``--config FILE`` (YAML, keys as in docs/configuration.md),
the shortcut flags, then ``--set KEY=VALUE`` (repeatable). ``--print-config`` prints the
result as YAML and exits.

Exit codes: 0 success, 2 configuration error (also a cluster that never held the job's gangs
within ``elastic.resource_wait_s``), 3 bad input data, 4 stopped on request (SIGTERM, SIGINT or
``ray job stop``: the job stopped at its next interval boundary, synced, checkpointed when
checkpoints are configured, with its model and metrics saved; a second signal stops at once,
130), 1 the job failed (it cannot go on: a shard lost every copy with no checkpoint, too few
gangs for too long, ranks lost over and over, a coordinator whose process died more often
than ``elastic.max_coordinator_restarts`` allows, or a defect). Whatever ended a job that had
started, its ``summary.json`` is written, and the last line names why, the checkpoint to resume
from and the ledger.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from raytrec.config import ConfigError, TrainConfig
from raytrec.config.base import yaml_flow
from raytrec.config.file import Override, dump, load_config
from raytrec.errors import JobFailedError

# This job's defaults where they differ from the config classes' defaults: the one place the
# command line departs from them (listed in --help and docs/configuration.md).
JOB_DEFAULTS: tuple[tuple[str, Any], ...] = (
    ("num_steps", 1000),
    ("log_every", 25),
    ("optimizer.embedding", "rowwise_adagrad"),
    ("optimizer.embedding_lr", 0.1),
    # Parquet written once from the synthetic teacher (oracle AUC known), through Ray Data.
    ("data.source", "generated"),
    # 500 rows per table: one pass of 1000 x 4 x 256 rows sees each id often enough to learn
    # it; and mean pooling, as the teacher scores a list by the mean of its ids' effects (a sum
    # cannot fit that: docs/benchmarks.md, "AUC against the oracle").
    ("model.tables[*].num_embeddings", 500),
    ("model.tables[*].pooling", "mean"),
    # A held-out split of the same teacher, evaluated every 200 steps and at the end.
    ("data.generated_held_out_rows", 16384),
    ("eval.every_n_steps", 200),
)

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_BAD_INPUT, EXIT_STOPPED = 0, 1, 2, 3, 4
EXIT_INTERRUPTED = 130


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jobs.train",
        description=__doc__,
        epilog="this job's own defaults:\n"
        + "\n".join(f"  {key}={yaml_flow(value)}" for key, value in JOB_DEFAULTS),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", metavar="FILE", help="YAML config file (docs/configuration.md)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one key, value read as YAML, e.g. --set sync.sync_every=2 (repeatable)",
    )
    p.add_argument("--print-config", action="store_true", help="print the config and exit")
    start = p.add_mutually_exclusive_group()
    start.add_argument(
        "--resume-from",
        metavar="CHECKPOINT",
        help="continue a saved job from its checkpoint (a directory or URI, e.g. the one a "
        "failed or stopped job's last line names): its model, step and position in the same "
        "data files (refused when they changed); the job may have another number of gangs, "
        "gang size or sharding plan",
    )
    start.add_argument(
        "--init-from",
        metavar="CHECKPOINT",
        help="start a new run from a checkpoint's model (weights and optimizer state, on any "
        "shape) on this config's data, at step 0: no data position, step or ledger is taken",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="also show Ray's log records and the ranks' and Ray Data tasks' output, which "
        "otherwise go only to logs/ in the run directory",
    )
    shortcuts = p.add_argument_group("shortcuts (each sets config keys; --set wins)")
    flag = shortcuts.add_argument
    flag("--num-workers", type=int, help="scaling.num_workers: ranks in the job")
    flag("--gang-size", type=int, help="scaling.gang_size: ranks per model copy")
    flag("--steps", type=int, help="num_steps")
    flag("--log-every", type=int, help="log_every")
    flag("--batch-size", type=int, help="data.batch_size: rows per rank per step")
    flag("--sync-every", type=int, help="sync.sync_every")
    flag(
        "--arch",
        help="model.arch: dlrm, dlrm_dcn, deepfm or two_tower (two_tower: the user tower "
        "over the first half of the tables' features unless model.user_features is set)",
    )
    flag("--sharding-type", help="sharding.sharding_type")
    flag("--embedding-optimizer", help="optimizer.embedding")
    flag("--num-embeddings", type=int, help="model.tables[*].num_embeddings: rows per table")
    flag(
        "--embedding-dim",
        type=int,
        help="model.tables[*].embedding_dim and model.dense_arch_layers[-1]",
    )
    flag("--layout", help="scaling.layout")
    flag("--gpu", action="store_true", default=None, help="scaling.use_gpu: one GPU per rank")
    flag("--seed", type=int, help="seed")
    flag("--storage-path", help="storage_path: where run directories go")
    flag(
        "--data",
        metavar="PATH",
        help="data.source=parquet and data.path=PATH: Criteo-layout Parquet (a file, directory "
        "or URI, e.g. from python -m jobs.make_data) streamed with Ray Data",
    )
    flag("--epochs", type=int, help="data.epochs: passes over the Parquet data")
    return p


# flag attribute -> the config keys it sets
_SHORTCUTS: dict[str, tuple[str, ...]] = {
    "num_workers": ("scaling.num_workers",),
    "gang_size": ("scaling.gang_size",),
    "steps": ("num_steps",),
    "log_every": ("log_every",),
    "batch_size": ("data.batch_size",),
    "sync_every": ("sync.sync_every",),
    "arch": ("model.arch",),
    "sharding_type": ("sharding.sharding_type",),
    "embedding_optimizer": ("optimizer.embedding",),
    "num_embeddings": ("model.tables[*].num_embeddings",),
    "embedding_dim": ("model.tables[*].embedding_dim", "model.dense_arch_layers[-1]"),
    "layout": ("scaling.layout",),
    "gpu": ("scaling.use_gpu",),
    "seed": ("seed",),
    "storage_path": ("storage_path",),
    "epochs": ("data.epochs",),
}


def shortcut_overrides(args: argparse.Namespace) -> list[Override]:
    """The (key, value) overrides that the shortcut flags given on the command line stand for."""
    out: list[Override] = []
    for attr, keys in _SHORTCUTS.items():
        value = getattr(args, attr)
        if value is not None:
            out += [(key, value) for key in keys]
    if args.data is not None:
        out += [("data.source", "parquet"), ("data.path", args.data)]
    return out


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    overrides = [*shortcut_overrides(args), *args.overrides]
    if args.arch == "two_tower" and not any(
        o.split("=", 1)[0].strip() == "model.user_features" for o in args.overrides
    ):
        # A two-tower model needs its user tower's features, which --arch alone cannot say:
        # the first half of the tables' features (of the config without the shortcut), so the
        # shortcut trains on the job's own data; --set model.user_features=[...] chooses.
        others = [
            o
            for o in shortcut_overrides(args)
            if not (isinstance(o, tuple) and o[0] == "model.arch")
        ]
        base: TrainConfig = load_config(
            args.config, [*others, *args.overrides], defaults=JOB_DEFAULTS
        )
        if not base.model.user_features:
            features = list(base.model.features)
            overrides.insert(
                len(overrides) - len(args.overrides),
                ("model.user_features", features[: max(1, len(features) // 2)]),
            )
    return load_config(args.config, overrides, defaults=JOB_DEFAULTS)


def build_config(argv: Sequence[str] | None = None) -> TrainConfig:
    """The config a command line resolves to (what the job would train)."""
    return config_from_args(parser().parse_args(argv))


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _where(e: BaseException) -> str:
    """For a job that had started (its result travels with the error): the checkpoint to
    resume from and its ledger."""
    result = getattr(e, "result", None)
    if result is None:
        return ""
    from raytrec.observability.summary import SUMMARY_FILE

    resume = result.checkpoint.path if result.checkpoint is not None else None
    return (
        f"; resume from checkpoint: {resume or 'none (no checkpoint was saved)'}; "
        f"ledger: {result.run_dir}/{SUMMARY_FILE}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        config = config_from_args(args)
        # Every rank's data pipeline reads RAYTREC_DATA_STEP_FLOOR_S: a bad value is refused here.
        import raytrec.data.executor_pace  # noqa: F401
    except ConfigError as e:
        print(f"raytrec: configuration error: {_one_line(e)}", file=sys.stderr)
        return EXIT_CONFIG
    if args.print_config:
        sys.stdout.write(dump(config))
        return EXIT_OK
    return train(
        config, verbose=args.verbose, resume_from=args.resume_from, init_from=args.init_from
    )


def train(
    config: TrainConfig,
    *,
    verbose: bool = False,
    resume_from: str | None = None,
    init_from: str | None = None,
) -> int:
    """Trains ``config`` with progress on the console and in the run directory (``verbose``:
    Ray's and the workers' own output on the console too, not only in ``logs/`` there),
    from the checkpoint ``resume_from`` when one is given, or from the model of the checkpoint
    ``init_from``."""
    from raytrec.api import TrainingStopped, fit
    from raytrec.data.arrow_kjt import BadInputError
    from raytrec.data.spec import SpecError
    from raytrec.errors import StopRequested
    from raytrec.observability.progress import METRICS_FILE, ProgressReporter

    reporter = ProgressReporter(config.num_steps, title=config.name)
    result: Any = None
    try:
        result = fit(
            config,
            on_progress=reporter,
            verbose=verbose,
            resume_from_checkpoint=resume_from,
            init_from=init_from,
        )
    except (ConfigError, SpecError) as e:
        print(f"raytrec: configuration error: {_one_line(e)}{_where(e)}", file=sys.stderr)
        return EXIT_CONFIG
    except BadInputError as e:
        print(f"raytrec: bad input: {_one_line(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except TrainingStopped as e:
        result = e.result
        if isinstance(e.cause, StopRequested):
            saved = result.checkpoint.path if result.checkpoint is not None else "none configured"
            print(
                f"[raytrec] stopped on request at step {result.steps} of "
                f"{result.config.num_steps}; checkpoint: {saved}; final model: "
                f"{result.final_state_path}; metrics: {result.run_dir}/{METRICS_FILE}"
            )
            return EXIT_STOPPED
        bad = isinstance(e.cause, BadInputError)
        print(f"raytrec: {'bad input' if bad else 'error'}: {_one_line(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT if bad else EXIT_FAILED
    except StopRequested as e:  # a signal before training started: nothing was trained
        print(f"[raytrec] {_one_line(e)}; nothing was trained{_where(e)}")
        return EXIT_STOPPED
    except KeyboardInterrupt as e:
        print(f"raytrec: interrupted{_where(e)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except JobFailedError as e:
        # fit wrote the ledger (summary.json) and printed its lines: the last line says why
        # the job ended and what to resume from.
        print(f"raytrec: failed: {_one_line(e)}{_where(e)}", file=sys.stderr)
        return EXIT_FAILED
    except Exception as e:
        import traceback

        traceback.print_exc()
        print(f"raytrec: error: {type(e).__name__}: {_one_line(e)}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        # Metrics and the plot are written for whatever trained, including a stopped run.
        if result is not None:
            if reporter.run_dir is None:
                reporter.start(result.run_dir)
            reporter.close(events=getattr(result, "events", ()))
        else:
            reporter.close()
    first, last = result.history[0], result.history[-1]
    auc = "n/a" if last.auc is None else f"{last.auc:.4f}"
    if result.oracle_auc is not None and last.auc is not None:
        ratio = last.auc / result.oracle_auc
        auc += f" ({ratio:.3f} of the data's oracle AUC {result.oracle_auc:.4f})"
    if last.eval_auc is not None:
        auc += f"; held-out AUC {last.eval_auc:.4f}"
        if result.held_out_oracle_auc is not None:
            ratio = last.eval_auc / result.held_out_oracle_auc
            auc += f" ({ratio:.3f} of its oracle AUC {result.held_out_oracle_auc:.4f})"
    print(
        f"[raytrec] done: {result.steps} steps in {result.wall_s:.1f}s; loss {first.loss:.4f} "
        f"-> {last.loss:.4f}; AUC {auc}; final model: {result.final_state_path}; "
        f"metrics: {result.run_dir}/{METRICS_FILE}; plot: {reporter.plot_path}"
    )
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
