"""Give gangs back from a running job: ``python -m jobs.drain RUN_DIR --gangs 1``.

The job reads the request at its next interval boundary: it syncs (the drained gangs' work is
committed into every replica), shares the rows they had not trained among the other gangs and
releases their placement groups, so no row is lost or trained twice. ``--max-gangs N`` lowers
the job's ``elastic.max_gangs`` while it runs (gangs beyond it are given back). The job never
goes below ``elastic.min_gangs``. ``RUN_DIR`` is the run directory the job printed when it
started. See docs/fault_tolerance.md ("Giving gangs back").

Exit codes: 0 the request was written, 2 a bad request or no such run directory.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from raytrec.errors import ConfigError


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jobs.drain", description=__doc__)
    p.add_argument("run_dir", metavar="RUN_DIR", help="the running job's run directory")
    p.add_argument("--gangs", type=int, default=0, help="give back this many gangs")
    p.add_argument("--max-gangs", type=int, default=None, help="keep at most this many gangs")
    args = p.parse_args(argv)
    from raytrec.elastic.drain_policy import request_drain

    try:
        path = request_drain(args.run_dir, gangs=args.gangs, max_gangs=args.max_gangs)
    except ConfigError as e:
        print(f"raytrec: {e}", file=sys.stderr)
        return 2
    print(f"raytrec: drain requested ({path}); the job carries it out at its next interval")
    return 0


if __name__ == "__main__":
    sys.exit(main())
