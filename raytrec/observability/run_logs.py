"""What a run prints besides raytrec's own lines goes to the run directory's ``logs/``.

The terminal shows raytrec's progress, events, summary and errors. While :func:`raytrec.fit`
runs, the rest goes to files instead, unless ``verbose``:

- ``logs/driver.log``: the driver's Ray log records (connecting, token authentication, Ray
  Data's execution plans); records at ERROR or above still show on the terminal;
- ``logs/workers.log``: what every rank, coordinator and Ray Data task writes to stdout or
  stderr (Ray forwards it to the driver), each line prefixed as Ray prints it,
  ``(RankWorker pid=123)``.

Ray's own error reports (a worker died, a task killed for memory) go to ``driver.log`` too; one
raytrec line shows each that raytrec did not expect, with where the report is
(:mod:`raytrec.observability.ray_errors`).

With ``verbose`` the terminal shows everything as Ray prints it, and the files are written too.
Lines that come before the run directory exists (Ray starting, data being generated) are kept
and written once it is named.

Worker output is taken from Ray's driver-side dispatcher of forwarded worker lines
(``ray._private.ray_logging``, Ray's version is pinned in requirements/base.lock); with another
Ray, where it moved, the terminal shows that output as Ray prints it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TextIO

from raytrec.observability.ray_errors import RayErrors

__all__ = [
    "DRIVER_LOG",
    "LOG_DIR",
    "NATIVE_LOG",
    "WORKERS_LOG",
    "RunLogs",
    "console_handlers",
    "errors_only",
    "native_stderr_to",
]

LOG_DIR = "logs"
DRIVER_LOG = "driver.log"
WORKERS_LOG = "workers.log"
NATIVE_LOG = "native.log"

#: The driver's loggers whose console output moves to ``driver.log`` (neither propagates).
RAY_LOGGERS = ("ray", "ray.data")
#: Ray's name for its handler that prints forwarded worker lines on the driver.
_RAY_PRINT = "ray_print_logs"
_OURS = "raytrec_run_logs"
#: Lines kept before the run directory exists, at most.
_KEPT = 20_000


class _Sink:
    """Text kept in memory until a file is named, then appended to it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: list[str] = []
        self._file: TextIO | None = None

    def write(self, text: str) -> None:
        with self._lock:
            if self._file is not None:
                self._file.write(text)
                self._file.flush()
            elif len(self._kept) < _KEPT:
                self._kept.append(text)

    def open(self, path: str) -> None:
        with self._lock:
            self._file = open(path, "a")  # noqa: SIM115 (closed in close)
            self._file.write("".join(self._kept))
            self._file.flush()
            self._kept.clear()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


class _SinkHandler(logging.Handler):
    def __init__(self, sink: _Sink) -> None:
        super().__init__(logging.INFO)
        self.sink = sink
        self.setFormatter(
            logging.Formatter("%(asctime)s\t%(levelname)s %(filename)s:%(lineno)s -- %(message)s")
        )

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.sink.write(self.format(record) + "\n")
        except Exception:
            self.handleError(record)


def errors_only(record: logging.LogRecord) -> bool:
    """A logging filter that lets errors through, and nothing else."""
    return record.levelno >= logging.ERROR


def console_handlers(names: Iterable[str]) -> list[logging.Handler]:
    """The handlers of the loggers ``names`` that write to a console (not to a file)."""
    return [
        h
        for name in names
        for h in logging.getLogger(name).handlers
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
    ]


def worker_line(data: Mapping[str, Any], line: str) -> str:
    """A forwarded worker line as Ray prints it: ``(RankWorker pid=123, ip=10.0.0.2) text``."""
    pid = data.get("pid")
    if pid in ("raylet", "autoscaler"):
        return f"({pid}) {line}"
    name = data.get("actor_name") or data.get("task_name")
    where = f"{name} pid={pid}" if name else f"pid={pid}"
    ip = data.get("ip")
    if ip and ip != data.get("localhost"):
        where += f", ip={ip}"
    return f"({where}) {line}"


def _dispatcher() -> Any:
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher
    except ImportError:
        return None
    return (
        global_worker_stdstream_dispatcher
        if hasattr(global_worker_stdstream_dispatcher, "handlers")
        else None
    )


class RunLogs:
    """Routes a run's Ray and worker output to files (module doc). Enter before Ray is
    connected, call :meth:`connected` once it is and :meth:`open` once the run directory is
    named; leaving restores the terminal as it was."""

    def __init__(self, *, verbose: bool = False) -> None:
        self.verbose = verbose
        self.dir: str | None = None
        self._driver, self._workers = _Sink(), _Sink()
        self._handler = _SinkHandler(self._driver)
        self._filtered: list[logging.Handler] = []
        self._ray_print: tuple[str, Callable[[Any], None]] | None = None
        self._errors = RayErrors(self._driver.write, self._driver_log, verbose=verbose)

    def _driver_log(self) -> str:
        if self.dir is None:
            return f"{DRIVER_LOG} in the run directory's {LOG_DIR}/"
        return os.path.join(self.dir, DRIVER_LOG)

    def __enter__(self) -> RunLogs:
        import ray.data  # noqa: F401  (sets up the "ray.data" logger's handlers)

        if not self.verbose:
            self._filtered = console_handlers(RAY_LOGGERS)
        for name in RAY_LOGGERS:
            logging.getLogger(name).addHandler(self._handler)
        for h in self._filtered:
            h.addFilter(errors_only)
        self.connected()
        return self

    def connected(self) -> None:
        """Takes Ray's error reports and the worker lines Ray forwards to this driver (once Ray
        is connected)."""
        import ray

        if ray.is_initialized():
            self._errors.install()
        dispatcher = _dispatcher()
        if dispatcher is None or any(name == _OURS for name, _ in dispatcher.handlers):
            return
        if not self.verbose:
            self._ray_print = next((p for p in dispatcher.handlers if p[0] == _RAY_PRINT), None)
            if self._ray_print is None:  # Ray does not forward worker output (log_to_driver off)
                return
            dispatcher.remove_handler(_RAY_PRINT)
        dispatcher.add_handler(_OURS, self._on_worker_lines)

    def _on_worker_lines(self, data: Mapping[str, Any]) -> None:
        lines = data.get("lines", [])
        if data.get("pid") == "autoscaler":  # its events only, as Ray prints them
            from ray._private.worker import filter_autoscaler_events

            lines = list(filter_autoscaler_events(lines))
        self._workers.write("".join(worker_line(data, line) + "\n" for line in lines))

    def open(self, run_dir: str) -> str:
        """Writes to ``<run_dir>/logs/`` from now on (and what came before); returns it."""
        return self.open_dir(os.path.join(run_dir, LOG_DIR))

    def open_dir(self, path: str) -> str:
        """Like :meth:`open`, into the folder ``path`` itself."""
        self.dir = path
        os.makedirs(path, exist_ok=True)
        self._driver.open(os.path.join(path, DRIVER_LOG))
        self._workers.open(os.path.join(path, WORKERS_LOG))
        return path

    def __exit__(self, *_: Any) -> None:
        self._errors.uninstall()
        dispatcher = _dispatcher()
        if dispatcher is not None:
            dispatcher.remove_handler(_OURS)
            # Ray's handler goes back only while Ray is connected (ray.shutdown drops it).
            import ray

            if self._ray_print is not None and ray.is_initialized():
                dispatcher.add_handler(*self._ray_print)
        for name in RAY_LOGGERS:
            logging.getLogger(name).removeHandler(self._handler)
        for h in self._filtered:
            h.removeFilter(errors_only)
        self._driver.close()
        self._workers.close()


@contextlib.contextmanager
def native_stderr_to(path: str) -> Iterator[None]:
    """While it lasts, what Ray's native code writes to this process's stderr (its core
    worker's log lines, e.g. a warning about every Ray Data actor it starts) goes to ``path``;
    Python's ``sys.stderr`` (raytrec's lines, progress bars, log handlers that wrote to it,
    tracebacks) still reaches the terminal.

    Ray's native logging writes to file descriptor 2 and has no switch for one process alone:
    the descriptor is pointed at the file, and Python's stream at a copy of the terminal's."""
    old = sys.stderr
    try:
        old.flush()
        fd = old.fileno()
    except (AttributeError, OSError, ValueError):  # no real descriptor (a notebook's stream)
        fd = None
    if fd != 2:
        yield  # Python's stderr is not descriptor 2: native lines do not mix with it
        return
    saved = os.dup(2)
    terminal = os.fdopen(os.dup(saved), "w", buffering=1, errors="backslashreplace")
    moved = [
        h
        for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
        if isinstance(logger, logging.Logger)
        for h in logger.handlers
        if isinstance(h, logging.StreamHandler) and h.stream is old
    ]
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 2)
    os.close(log)
    sys.stderr = terminal
    for h in moved:
        h.setStream(terminal)
    try:
        yield
    finally:
        terminal.flush()
        os.dup2(saved, 2)
        os.close(saved)
        sys.stderr = old
        for h in moved:
            h.setStream(old)
        terminal.close()
