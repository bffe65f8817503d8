"""A floor on how often an idle Ray Data pipeline's scheduling loop runs.

Ray Data runs each dataset's ``StreamingExecutor`` on a thread of the process that iterates it
(here: every rank, for its own stream). Each step of its loop waits in ``ray.wait`` (up to
0.1 s) only while one of its tasks is running. When none is (the rank holds the blocks it may
read ahead, or the cluster's read CPUs are taken by other pipelines, so no task may start) the
loop does not wait at all: it steps again at once, hundreds of times a second, each step a few
hundred microseconds of Python. In a rank that is a thread taking the GIL from the training
thread for as long as the rank is ahead of its data, which is most of the job, and with several
ranks on a host it takes their cores. Ray Data has no setting for it (ray 2.60), but it calls
every :class:`ExecutionCallback` of the dataset's context at the end of each step, so
:class:`PacedLoop` sleeps there until a step in which none of the pipeline's tasks was running
has taken at least :data:`STEP_FLOOR_S`.

A step with tasks running is left alone (it waited for them). In an idle step nothing can
change but the rank taking a block, which frees room for the next task, or another pipeline's
task ending: that next task starts at most :data:`STEP_FLOOR_S` later, a delay the block read
ahead covers (up to 16,384 rows). ``python -m benchmarks.data_loop`` measures a submitted job's
pace with and without it (docs/data.md, "The pipelines' scheduling loop, measured").
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from ray.data._internal.execution.execution_callback import ExecutionCallback

from raytrec.errors import ConfigError

__all__ = ["FLOOR_VARIABLE", "STEP_FLOOR_S", "PacedLoop", "floor_from", "pace"]

FLOOR_VARIABLE = "RAYTREC_DATA_STEP_FLOOR_S"


def floor_from(environ: Mapping[str, str]) -> float:
    """The floor that ``environ`` sets (:data:`FLOOR_VARIABLE`, seconds; 0 turns the pacing
    off), 0.02 s without it; a value that is not a number >= 0 is refused, naming it (when this
    module is imported: a job's driver refuses it before anything starts)."""
    text = environ.get(FLOOR_VARIABLE, "0.02")
    try:
        floor = float(text)
    except ValueError:
        floor = -1.0
    if not floor >= 0:  # NaN included
        raise ConfigError(f"{FLOOR_VARIABLE}={text!r}: expected seconds, a number >= 0")
    return floor


#: The least time an idle step of a pipeline's scheduling loop takes; the environment variable
#: ``RAYTREC_DATA_STEP_FLOOR_S`` (in the job's runtime environment) sets it.
STEP_FLOOR_S = floor_from(os.environ)


class PacedLoop(ExecutionCallback):
    """Makes every step of the executor's loop in which none of its tasks was running take at
    least :data:`STEP_FLOOR_S`; a step with tasks running waited for them in ``ray.wait``."""

    def __init__(self) -> None:
        self._last = time.perf_counter()

    def on_execution_step(self, executor: Any) -> None:
        # Its operators (ray 2.60 keeps them in ``_topology``; without it every step is paced).
        operators = getattr(executor, "_topology", None) or ()
        if not any(op.num_active_tasks() for op in operators):
            rest = STEP_FLOOR_S - (time.perf_counter() - self._last)
            if rest > 0:
                time.sleep(rest)
        self._last = time.perf_counter()


def pace(context: Any) -> None:
    """Has every pipeline run under Ray Data context ``context`` (a dataset's own copy) pace its
    scheduling loop with :class:`PacedLoop`."""
    if PacedLoop not in context.custom_execution_callback_classes:
        context.custom_execution_callback_classes = [
            *context.custom_execution_callback_classes,
            PacedLoop,
        ]
