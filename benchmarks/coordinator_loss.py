"""How long after its process is SIGKILLed the driver books the coordinator's loss.

    .venv/bin/python -m benchmarks.coordinator_loss [--kills N] [--steps S] [--write PAGE]

Trains 2 gangs of 1 rank on synthetic data on the embedded local cluster (a checkpoint every 4
steps) and SIGKILLs the coordinator's process ``--kills`` times, each a few steps after the
coordinator before it started training (its process id from the run's journal). For each kill:
when the driver booked ``coordinator_lost`` and ``coordinator_restarted``. The kill's time is put
on the job's clock from when each metrics row was first seen, so the delays are upper bounds.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from collections.abc import Sequence

from benchmarks.common import md_table, parse, parser, publish

__all__ = ["main"]

#: Steps trained after a coordinator's first row before it is killed.
STEPS_BEFORE_KILL = 6


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__, "coordinator_loss", "docs/fault_tolerance.md")
    p.add_argument("--kills", type=int, default=3, help="coordinator processes to SIGKILL")
    p.add_argument("--steps", type=int, default=120, help="steps of the job")
    a = parse(p, argv)

    from raytrec.api import fit
    from raytrec.checkpoint.config import CheckpointConfig
    from raytrec.config import (
        DataConfig,
        ModelConfig,
        ScalingConfig,
        SyncConfig,
        TrainConfig,
        criteo_tables,
    )
    from raytrec.elastic.config import ElasticConfig
    from raytrec.elastic.events import CoordinatorLost, CoordinatorRestarted
    from raytrec.elastic.journal import CoordinatorStartedRecorded, read_journal
    from raytrec.observability.metrics import IntervalMetrics

    storage = tempfile.mkdtemp(prefix="coordinator-loss-")
    offset = [float("inf")]  # time.monotonic() - the job's clock, from above
    kills: list[float] = []  # time.monotonic() of each kill
    first_step: dict[int, int] = {}  # a coordinator's pid -> the step of its first row seen

    def coordinator_pid() -> int | None:
        runs = [os.path.join(storage, d) for d in os.listdir(storage)]
        records = read_journal(runs[0]) if runs else []
        started = [r.pid for r in records if isinstance(r, CoordinatorStartedRecorded)]
        return started[-1] if started else None

    def kill(pid: int) -> None:
        time.sleep(0.2)  # not at the row's own boundary
        kills.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    def on_progress(row: IntervalMetrics) -> None:
        offset[0] = min(offset[0], time.monotonic() - row.at)
        pid = coordinator_pid()
        if pid is None or len(kills) >= a.kills:
            return
        first = first_step.setdefault(pid, row.step)
        if row.step == first + STEPS_BEFORE_KILL:
            threading.Thread(target=kill, args=(pid,), daemon=True).start()

    config = TrainConfig(
        model=ModelConfig(tables=criteo_tables(num_features=4, num_embeddings=200)),
        scaling=ScalingConfig(num_workers=2, gang_size=1),
        sync=SyncConfig(sync_every=2),
        data=DataConfig(batch_size=32),
        elastic=ElasticConfig(max_coordinator_restarts=a.kills),
        checkpoint=CheckpointConfig(every_n_steps=4, num_to_keep=2),
        num_steps=a.steps,
        log_every=2,
        storage_path=storage,
    )
    result = fit(config, on_progress=on_progress)
    lost = [e.at for e in result.events.of(CoordinatorLost)]
    restarted = [e.at for e in result.events.of(CoordinatorRestarted)]
    rows = []
    for i, (k, booked, new) in enumerate(zip(kills, lost, restarted, strict=False)):
        at = k - offset[0]
        rows.append((i + 1, f"{booked - at:.2f}", f"{new - at:.2f}"))
    heads = "kill | coordinator_lost after (s) | coordinator_restarted after (s)"
    body = f"{len(kills)} kills, {result.steps} steps trained.\n\n{md_table(heads, rows)}\n"
    publish(a, body, name="coordinator-loss")
    return 0 if len(lost) == len(kills) == a.kills else 1


if __name__ == "__main__":
    raise SystemExit(main())
