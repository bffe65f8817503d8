"""Export a trained model unsharded: ``python -m jobs.export CHECKPOINT PATH``.

``CHECKPOINT`` is a checkpoint directory or URI (``<run_dir>/checkpoints/checkpoint_<step>``)
or a job's final model (``<run_dir>/final_model``). ``PATH``, a new directory, receives
``model.pt`` (the state dict under TorchRec's DLRM names), ``model.pt2`` (a ``torch.export``
program, unless ``--no-program``) and ``model.json`` (the model spec). A model saved without
its spec (``model_spec.json``) needs the job's config: ``--config FILE`` and ``--set KEY=VALUE``
as for ``jobs.train``. See docs/serving.md.

Exit codes: 0 exported, 2 a bad checkpoint, config or path, 130 stopped by SIGINT or SIGTERM
(the export directory is then incomplete: ``model.json``, written last, is missing, and nothing
reads it as an export).
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

from raytrec._quiet import quiet_known_warnings
from raytrec.errors import ConfigError


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jobs.export", description=__doc__)
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint or final model")
    p.add_argument("path", metavar="PATH", help="the export directory (new or empty)")
    p.add_argument("--config", default=None, help="the job's YAML config file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override")
    p.add_argument("--no-program", action="store_true", help="write no model.pt2")
    args = p.parse_args(argv)
    quiet_known_warnings()
    signal.signal(signal.SIGTERM, _interrupt)
    from raytrec.checkpoint.errors import CheckpointError
    from raytrec.config.file import load_config
    from raytrec.serving.export import export

    try:
        config = load_config(args.config, args.set) if args.config or args.set else None
        export(args.checkpoint, args.path, config=config, program=not args.no_program)
    except (CheckpointError, ConfigError, FileExistsError) as e:
        print(f"raytrec: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("raytrec: interrupted", file=sys.stderr)
        return 130
    return 0  # export() printed its one line


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    sys.exit(main())
