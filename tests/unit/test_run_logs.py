"""A run's Ray and worker output goes to ``logs/`` in the run directory, and to the terminal only
when asked for (``verbose``); errors show either way. Ray's driver-side dispatcher of worker
lines is driven by hand, as Ray's log thread would; no cluster is started."""

from __future__ import annotations

import contextlib
import io
import logging
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

from raytrec.observability.ray_errors import RayErrors
from raytrec.observability.run_logs import DRIVER_LOG, LOG_DIR, WORKERS_LOG, RunLogs

PLAN = {
    "pid": 4242,
    "actor_name": "RankWorker",
    "ip": "127.0.0.1",
    "localhost": "127.0.0.1",
    "is_err": True,
    "lines": ["Execution plan of Dataset d_0: InputDataBuffer[Input] -> ..."],
}


@pytest.fixture
def ray_printed() -> Any:
    """Stands in for Ray's own handler of worker lines (it prints them on the terminal)."""
    seen: list[dict[str, Any]] = []
    saved = list(dispatcher.handlers)
    dispatcher.remove_handler("ray_print_logs")
    dispatcher.add_handler("ray_print_logs", seen.append)
    yield seen
    dispatcher.handlers = saved


@pytest.fixture
def console() -> Iterator[io.StringIO]:
    """Stands in for Ray's console handler of the driver's "ray" logger (Ray's own holds the
    stderr it found at import, which pytest replaced since)."""
    text = io.StringIO()
    handler = logging.StreamHandler(text)
    logging.getLogger("ray").addHandler(handler)
    yield text
    logging.getLogger("ray").removeHandler(handler)


@pytest.mark.parametrize("verbose", [False, True])
def test_output_goes_to_the_run_directory_and_to_the_terminal_only_when_verbose(
    tmp_path: pathlib.Path,
    console: io.StringIO,
    ray_printed: list[dict[str, Any]],
    verbose: bool,
) -> None:
    ray_logger = logging.getLogger("ray._private.worker")
    with RunLogs(verbose=verbose) as logs:
        # Before the run directory exists: kept, then written.
        ray_logger.info("Started a local Ray instance.")
        dispatcher.emit(PLAN)
        assert logs.open(str(tmp_path)) == str(tmp_path / LOG_DIR)
        ray_logger.error("the GCS is unreachable")
        dispatcher.emit({**PLAN, "lines": ["after"], "ip": "10.0.0.2"})
    terminal = console.getvalue()
    driver = (tmp_path / LOG_DIR / DRIVER_LOG).read_text()
    workers = (tmp_path / LOG_DIR / WORKERS_LOG).read_text().splitlines()
    assert "INFO" in driver and "Started a local Ray instance." in driver
    assert "ERROR" in driver and "the GCS is unreachable" in driver
    assert workers == [
        "(RankWorker pid=4242) Execution plan of Dataset d_0: InputDataBuffer[Input] -> ...",
        "(RankWorker pid=4242, ip=10.0.0.2) after",
    ]
    # An error shows either way; the rest only when verbose.
    assert "the GCS is unreachable" in terminal
    assert ("Started a local Ray instance." in terminal) is verbose
    assert [d["lines"][0] for d in ray_printed] == ([PLAN["lines"][0], "after"] if verbose else [])
    # Leaving restores the terminal: our handler is gone, Ray's console handler unfiltered.
    assert all(name != "raytrec_run_logs" for name, _ in dispatcher.handlers)
    ray_logger.info("after the run")
    assert "after the run" in console.getvalue()


#: The raylet's report of a rank killed by a ``kill_rank`` fault, as the README's fault run
#: printed it (``ray._private.worker.listen_error_messages`` hands it to ``print_to_stdstream``).
WORKER_DIED = (
    "A worker died or was killed while executing a task by an unexpected system error. To "
    "troubleshoot the problem, check the logs for the dead worker. Lease ID: 06000000a9d3c0a9 "
    "Worker ID: 3d737c141ae62b79 Node ID: 94dcba27edcadde9 Worker IP address: 127.0.0.1 Worker "
    "port: 46307 Worker PID: {pid} Worker exit type: SYSTEM_ERROR Worker exit detail: Worker "
    "unexpectedly exits with a connection error code 2. End of file. Some common causes include:"
    " (1) the process was killed by the OOM killer due to high memory usage, ..."
)


@pytest.mark.parametrize("verbose", [False, True])
def test_ray_s_reports_go_to_the_log_and_the_unexpected_ones_show_in_raytrec_s_words(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], verbose: bool
) -> None:
    from ray._private import worker

    ray_printed: list[dict[str, Any]] = []
    monkeypatch.setattr(
        worker, "print_to_stdstream", lambda data, _prefix: ray_printed.append(data)
    )
    ray_print = worker.print_to_stdstream
    written: list[str] = []

    def ended_on_purpose(message: str) -> str | None:  # the ranks' records in Ray's store
        return "kill_rank fault, rank 3, step 120" if "Worker PID: 10842 " in message else None

    errors = RayErrors(written.append, lambda: "/runs/r/logs/driver.log", verbose=verbose)
    errors._ended = ended_on_purpose
    errors.install()
    reports = [WORKER_DIED.format(pid=10842), WORKER_DIED.format(pid=777), "The node died. Why."]
    for report in reports:  # as Ray's listener calls it, by its name in Ray's module
        worker.print_to_stdstream({"lines": [report], "pid": "raylet", "is_err": False}, False)
    worker.print_to_stdstream({"lines": ["hello"], "pid": 123, "is_err": False}, False)
    errors.uninstall()
    assert worker.print_to_stdstream is ray_print

    # Every report is in the log, the one of a process raytrec ended saying so.
    assert len(written) == 3 and all("\tERROR (raylet) -- " in w for w in written)
    assert [r in w for r, w in zip(reports, written, strict=True)] == [True] * 3
    assert written[0].endswith("(raytrec ended this process: kill_rank fault, rank 3, step 120)\n")
    # Ray prints the reports only when verbose; what is not a report it prints either way.
    assert [d["lines"][0] for d in ray_printed] == [*(reports if verbose else []), "hello"]
    # raytrec's words for the two it did not expect, with where Ray's message is.
    expected = [
        "[raytrec] Ray reports that a process of this job died (pid 777 at 127.0.0.1, "
        "SYSTEM_ERROR: Worker unexpectedly exits with a connection error code 2); its message "
        "is in /runs/r/logs/driver.log",
        "[raytrec] Ray reports an error (The node died); its message is in /runs/r/logs/driver.log",
    ]
    assert capsys.readouterr().out.splitlines() == ([] if verbose else expected)


def test_overlapping_quiet_executions_route_once_and_restore_once() -> None:
    """Quiet datasets that run at once (two threads) share one routing: the first to start
    enters it, the last to end leaves it, and a run that never started gives its share back."""
    import gc

    from raytrec.observability import quiet_data

    entered: list[str] = []

    @contextlib.contextmanager
    def routing() -> Iterator[None]:
        entered.append("enter")
        yield
        entered.append("leave")

    shared = quiet_data._Shared(routing)
    a, b = quiet_data._Lease(shared), quiet_data._Lease(shared)
    a.release()
    a.release()  # once only
    assert entered == ["enter"]
    b.release()
    assert entered == ["enter", "leave"]
    # Ray Data's callback: its native share ends as the execution starts, the rest at its end.
    native, console = quiet_data._Shared(routing), quiet_data._Shared(routing)
    saved = quiet_data._NATIVE, quiet_data._CONSOLE
    quiet_data._NATIVE, quiet_data._CONSOLE = native, console
    try:
        run = quiet_data._QuietRun()
        assert native._users == console._users == 1
        run.before_execution_starts(None)
        assert native._users == 0 and console._users == 1
        run.after_execution_succeeds(None)
        assert native._users == console._users == 0
        quiet_data._QuietRun()  # planned, never started, dropped
        gc.collect()
        assert native._users == console._users == 0
    finally:
        quiet_data._NATIVE, quiet_data._CONSOLE = saved
