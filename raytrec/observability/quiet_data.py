"""A Ray Dataset that runs without Ray Data's console output: :func:`quiet_dataset`.

:func:`raytrec.predict` returns its scores as a lazy dataset, run in the caller's process when
consumed. Left as it is, each run prints Ray Data's progress bars, its INFO records (execution
plan, progress, "execution finished"), and, from Ray's core worker, an error-level line for each
map actor it starts ("has constructor arguments in the object store and max_restarts > 0": Ray
Data passes every map actor its context and its function through the object store and lets it
restart, whatever the function, ray-project/ray#53727).

:func:`quiet_dataset` turns these off for one dataset and those made from it, through what Ray
Data keeps per dataset, its own DataContext (a copy made when it was read): it draws no
progress bars and runs an execution callback (:class:`_QuietRun`). From when Ray Data plans an
execution until it ends, only errors of Ray's loggers reach the console (Ray Data writes every
record to its log files in Ray's session directory, ``logs/ray-data/``); while the operators
start (and the actors with them), what Ray's native code writes to this process's stderr goes
to ``raytrec-native.log`` there. The console is Ray's loggers' for the whole process, so another
dataset's INFO records during that time go to the files only.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from ray.data import DataContext
from ray.data._internal.execution.execution_callback import ExecutionCallback

from raytrec.observability.run_logs import (
    RAY_LOGGERS,
    console_handlers,
    errors_only,
    native_stderr_to,
)

__all__ = ["NATIVE_LOG", "progress_bars", "quiet_dataset"]

#: Where the native lines of Ray's core worker go while a quiet dataset's operators start.
NATIVE_LOG = "raytrec-native.log"


def quiet_dataset(dataset: Any) -> Any:
    """``dataset`` (a Ray Dataset), set to run without Ray Data's console output (module
    doc); returned for chaining."""
    context = dataset.context
    context.enable_progress_bars = False
    if _QuietRun not in context.custom_execution_callback_classes:
        context.custom_execution_callback_classes = [
            *context.custom_execution_callback_classes,
            _QuietRun,
        ]
    return dataset


@contextlib.contextmanager
def progress_bars(enabled: bool) -> Iterator[None]:
    """Ray Data draws progress bars (those of reading a dataset too) only if ``enabled``, while
    it lasts."""
    context = DataContext.get_current()
    before = context.enable_progress_bars
    context.enable_progress_bars = enabled
    try:
        yield
    finally:
        context.enable_progress_bars = before


@contextlib.contextmanager
def _ray_errors_only() -> Iterator[None]:
    handlers = console_handlers(RAY_LOGGERS)
    for h in handlers:
        h.addFilter(errors_only)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(errors_only)


def _native_to_ray_data_logs() -> contextlib.AbstractContextManager[None]:
    from ray.data._internal.logging import get_log_directory

    where = get_log_directory()
    if where is None:  # Ray is not connected: nothing native to route
        return contextlib.nullcontext()
    os.makedirs(where, exist_ok=True)
    return native_stderr_to(os.path.join(where, NATIVE_LOG))


class _Shared:
    """A context that the first of overlapping users enters and the last one leaves (quiet
    datasets may run at once, from several threads)."""

    def __init__(self, make: Callable[[], contextlib.AbstractContextManager[None]]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._users = 0
        self._stack = contextlib.ExitStack()

    def acquire(self) -> None:
        with self._lock:
            if self._users == 0:
                self._stack.enter_context(self._make())
            self._users += 1

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                self._stack.close()


_CONSOLE = _Shared(_ray_errors_only)
_NATIVE = _Shared(_native_to_ray_data_logs)


class _Lease:
    """One use of a :class:`_Shared`, given back once."""

    def __init__(self, shared: _Shared) -> None:
        self._shared: _Shared | None = shared
        shared.acquire()

    def release(self) -> None:
        shared, self._shared = self._shared, None
        if shared is not None:
            shared.release()


class _QuietRun(ExecutionCallback):
    """Ray Data makes one per execution as it plans it, just before the executor starts the
    operators; it calls ``before_execution_starts`` once they have started, and one of the
    ``after_execution_*`` when the execution ends."""

    def __init__(self) -> None:
        self._console, self._native = _Lease(_CONSOLE), _Lease(_NATIVE)
        # An execution that fails before it starts calls neither: given back when dropped.
        self._done = weakref.finalize(self, _release, self._console, self._native)

    def before_execution_starts(self, executor: Any) -> None:
        self._native.release()

    def after_execution_succeeds(self, executor: Any) -> None:
        self._done()

    def after_execution_fails(self, executor: Any, error: Exception) -> None:
        self._done()


def _release(*leases: _Lease) -> None:
    for lease in leases:
        lease.release()
