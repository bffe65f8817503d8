"""A run's Ray and worker output goes to ``logs/`` in the run directory, and to the terminal only
when asked for (``verbose``); errors show either way. Ray's driver-side dispatcher of worker
lines is driven by hand, as Ray's log thread would; no cluster is started."""

from __future__ import annotations

import io
import logging
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

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
