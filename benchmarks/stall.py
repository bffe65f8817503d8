"""The survivors' stall at a loss and at a join: the elastic runs of ``benchmarks.recovery``
alone (no restart from a checkpoint), repeated.

    .venv/bin/python -m benchmarks.stall --repeats 4

Each repeat runs ``benchmarks.recovery``'s run 1 (a loss: the survivors go on alone) and run 3
(a loss, then a new gang placed at once that heals and joins). **At a loss**: from the row of
the step before the failure to the survivors' next completed step (both runs); **at a join**:
``gang_placed`` to ``gang_joined`` (the live gangs' sync, the new generation and the heal: what
the survivors stop for), and their longest gap between two steps while the gang came in.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Sequence

from benchmarks import recovery
from benchmarks.common import dims, md_table
from raytrec.cluster import connect


def spread(values: Sequence[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.3f} ({min(values):.3f} to {max(values):.3f}) s"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.stall", description=__doc__)
    p.add_argument("--size", type=lambda t: dims(t, 3), default="26x10000x16")
    p.add_argument("--shape", type=lambda t: dims(t, 2), default="2x2")
    p.add_argument("--repeats", type=int, default=4)
    a = p.parse_args(argv)
    connect(num_cpus=(a.shape[0] + 1) * a.shape[1] * recovery.CPUS_PER_RANK + (os.cpu_count() or 2))
    recovery.STORAGE.mkdir(parents=True, exist_ok=True)
    loss: list[float] = []
    join: list[float] = []
    gap: list[float] = []
    for repeat in range(a.repeats):
        for grow in (False, True):
            try:
                t, _ = recovery.run_elastic(a.size, a.shape, grow=grow)
            except Exception as e:  # a failed run is reported; the others go on
                print(f"repeat {repeat}, grow={grow}: failed: {e}"[:300], flush=True)
                continue
            loss.append(t.resume_s)
            join += [t.heal_transfer_s] if t.heal_transfer_s is not None else []
            gap += [t.survivors_gap_s] if t.survivors_gap_s is not None else []
            print(f"repeat {repeat}, grow={grow}: {t}", flush=True)
    heads = "survivors' stall at a loss | at a join | longest gap while a gang joins"
    print(md_table(heads, [[spread(loss), spread(join), spread(gap)]], left=0))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
