"""Fixtures shared by the test modules.

``local_ray``: one local Ray cluster on 127.0.0.1 (5 CPUs: 4 ranks and one for Ray Data's
tasks), shared by every cluster test that needs no particular cluster shape. It starts with the
first module that asks for it and stays up; a module that needs a cluster of its own
(``raytrec.testing.simulated_cluster``) shuts it down first. The modules that use it run first,
so it starts once per session. Ray is imported only where a test uses it, so the modules that
need none (the gloo engine tests, the GPU tests) run where Ray is not installed.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator

import pytest

LOCAL_CPUS = 5


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    import ray

    from raytrec.cluster import connect

    if not ray.is_initialized():
        connect(num_cpus=LOCAL_CPUS)
        ray.data.DataContext.get_current().enable_progress_bars = False
    yield


#: The markers of the slow tiers: a test carrying one may not live in ``tests/unit/``.
SLOW_MARKERS = ("cluster", "multiprocess", "gpu")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests on the shared cluster first (stable otherwise), so it starts once. A test in
    ``tests/unit/`` that carries a slow tier's marker is refused: the folders show the tiers."""
    misplaced = [
        item.nodeid
        for item in items
        if item.path.parent.name == "unit"
        and any(item.get_closest_marker(name) for name in SLOW_MARKERS)
    ]
    if misplaced:
        raise pytest.UsageError(
            "these tests carry a slow tier's marker but live in tests/unit/; move their module to "
            "tests/cluster/, tests/multiprocess/ or tests/gpu/: " + ", ".join(misplaced)
        )
    items.sort(key=lambda item: "local_ray" not in getattr(item, "fixturenames", ()))


_EXIT_STATUS = pytest.StashKey[int]()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    session.config.stash[_EXIT_STATUS] = int(exitstatus)
    # The process ends without running exit handlers (below): remove what they would have.
    fault_space = sys.modules.get("simulation.fault_space")
    if fault_space is not None and fault_space._DATA_ROOT:
        shutil.rmtree(fault_space._DATA_ROOT[0], ignore_errors=True)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Ends the process with pytest's exit status once every report is written, without the
    interpreter's teardown. The test process holds Ray's core worker, Ray Data's executor threads
    and torch's thread pools; their native teardown at interpreter exit crashed now and then
    (SIGSEGV after the summary line, so a green run exited 139)."""
    status = config.stash.get(_EXIT_STATUS, None)
    if status is None:  # no session ran (--help, --version)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
