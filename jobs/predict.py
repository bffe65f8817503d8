"""Score Parquet rows with a trained model: ``python -m jobs.predict CHECKPOINT SOURCE OUTPUT``.

``CHECKPOINT`` is an export, a checkpoint or a job's final model (as for ``jobs.export``);
``SOURCE`` Parquet files or a directory in the model's row layout (label and row id optional);
``OUTPUT`` a new directory that receives the predictions as Parquet (``row_id``, ``label``,
``score``), scored with Ray Data on the cluster of ``RAY_ADDRESS`` or an embedded local one.
Ray's own output goes to ``OUTPUT/_logs/`` (``--verbose`` shows it); one line says what was
scored. See docs/serving.md.

Exit codes: 0 scored, 2 a bad checkpoint, config or path, 3 bad input data, 130 stopped by
SIGINT or SIGTERM (an embedded cluster it started is shut down; the output holds what was
written by then).
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

from raytrec._quiet import quiet_known_warnings
from raytrec.errors import ConfigError


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jobs.predict", description=__doc__)
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="export, checkpoint or final model")
    p.add_argument("source", metavar="SOURCE", nargs="+", help="Parquet files or a directory")
    p.add_argument("output", metavar="OUTPUT", help="the predictions' directory (new or empty)")
    p.add_argument("--config", default=None, help="the job's YAML config file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override")
    p.add_argument("--batch-size", type=int, default=4096, help="rows per scoring call")
    p.add_argument("--workers", type=int, default=None, help="scoring actors (1 CPU each)")
    p.add_argument("--verbose", action="store_true", help="show Ray's own output too")
    args = p.parse_args(argv)
    quiet_known_warnings()
    signal.signal(signal.SIGTERM, _interrupt)
    from raytrec.checkpoint.errors import CheckpointError
    from raytrec.config.file import load_config
    from raytrec.data.arrow_kjt import BadInputError
    from raytrec.serving.evaluate import predict

    try:
        config = load_config(args.config, args.set) if args.config or args.set else None
        source = args.source[0] if len(args.source) == 1 else args.source
        predict(
            args.checkpoint,
            source,
            output=args.output,
            config=config,
            batch_size=args.batch_size,
            num_workers=args.workers,
            verbose=args.verbose,
        )
    except (CheckpointError, ConfigError, FileExistsError, FileNotFoundError) as e:
        print(f"raytrec: {e}", file=sys.stderr)
        return 2
    except BadInputError as e:
        print(f"raytrec: bad input: {' '.join(str(e).split())}", file=sys.stderr)
        return 3
    except (KeyboardInterrupt, SystemExit):  # SystemExit: Ray's own SIGTERM handler
        print("raytrec: interrupted", file=sys.stderr)
        return 130
    return 0


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    sys.exit(main())
