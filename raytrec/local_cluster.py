"""A multi-node Ray cluster of ``ray start`` processes on this machine, every node on 127.0.0.1.

For cluster tests and the chaos harness: a head node and worker nodes, each with its own ports,
temporary directory and process session, so that one node can be lost (its raylet killed by
pid) and every process a node left behind can be ended without touching any other Ray cluster
on the machine (``ray stop`` would stop them all).

Worker nodes join differently from the head (see docs/job_submission.md, "A local cluster for
trying it"): ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, which keeps the head on 127.0.0.1, makes
``ray start --address`` refuse to add a node; without it, Ray replaces a literal ``127.0.0.1``
or ``localhost`` (in ``--address`` and ``--node-ip-address``) by the machine's outward address,
where the head does not listen. So a worker node runs without the variable and is given the
head's address under a host name that resolves to 127.0.0.1 (Ray rewrites only the literal
loopback names); Ray then takes the node's address from its route to the head: 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

__all__ = [
    "LocalCluster",
    "WorkerNode",
    "free_port",
    "local_cluster",
    "loopback_host_name",
    "session_pids",
    "stop_session",
]

LOOPBACK = "127.0.0.1"
BIN = os.path.dirname(sys.executable)  # the environment running this has Ray
RAY = os.path.join(BIN, "ray")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def loopback_host_name() -> str:
    """A name of this machine that resolves to 127.0.0.1 only and is not ``localhost`` (which
    Ray would replace by the outward address); raises when there is none."""
    for name in dict.fromkeys([socket.gethostname(), socket.getfqdn()]):
        with contextlib.suppress(OSError):
            if name != "localhost" and set(socket.gethostbyname_ex(name)[2]) == {LOOPBACK}:
                return name
    raise RuntimeError(
        f"no host name of this machine resolves to {LOOPBACK} only (tried "
        f"{socket.gethostname()!r}, {socket.getfqdn()!r}); worker nodes need one to join a "
        "head on 127.0.0.1: add one to /etc/hosts, e.g. '127.0.0.1 raynode'"
    )


def stop_session(session: int, grace_s: float = 8.0) -> None:
    """Terminates every process in ``session`` and their children; kills what outlives
    ``grace_s``."""
    import psutil

    procs: dict[int, psutil.Process] = {}
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == session:
                procs[p.pid] = p
                procs.update({c.pid: c for c in p.children(recursive=True)})
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    for p in procs.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    _, alive = psutil.wait_procs(list(procs.values()), timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=5)


def session_pids(session: int, name: str | None = None) -> list[int]:
    """The processes of ``session`` (whose name or title starts with ``name``, when given)."""
    import psutil

    out = []
    for p in psutil.process_iter(["name", "cmdline"]):
        try:
            if os.getsid(p.pid) != session:
                continue
        except (ProcessLookupError, PermissionError):
            continue
        title = " ".join(p.info["cmdline"] or []) or p.info["name"] or ""
        if name is None or (p.info["name"] or "").startswith(name) or title.startswith(name):
            out.append(p.pid)
    return out


@dataclasses.dataclass(frozen=True)
class WorkerNode:
    """A worker node: its ``ray start`` session and temporary directory."""

    name: str
    session: int
    temp_dir: str

    def raylet_pid(self) -> int | None:
        pids = session_pids(self.session, "raylet")
        return pids[0] if pids else None

    def node_id(self) -> str | None:
        """Ray's node id, read from the raylet's command line."""
        import psutil

        pid = self.raylet_pid()
        if pid is None:
            return None
        with contextlib.suppress(psutil.Error):
            for arg in psutil.Process(pid).cmdline():
                if arg.startswith("--node_id="):
                    return arg.split("=", 1)[1]
        return None


@dataclasses.dataclass
class LocalCluster:
    dashboard: str  # http://127.0.0.1:<port>, what `ray job submit --address` takes
    gcs_address: str  # 127.0.0.1:<port>
    env: dict[str, str]  # with the token: what a client of this cluster runs with
    session: int  # the process session of every process the head's `ray start` left running
    temp_dir: str
    nodes: list[WorkerNode] = dataclasses.field(default_factory=list)  # added, in order

    def ray(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        """The ``ray`` command line, as a client of this cluster."""
        return subprocess.run(
            [RAY, *args],
            env=env or self.env,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def submit(self, submission_id: str, *entrypoint: str, cwd: str, runtime_env: str) -> None:
        """``ray job submit --no-wait`` as a user types it, with the working directory ``cwd``;
        retried while the job agent is still starting."""
        command = [
            "job", "submit", "--address", self.dashboard, "--submission-id", submission_id,
            "--working-dir", ".", "--runtime-env", runtime_env, "--no-wait", "--", *entrypoint,
        ]  # fmt: skip
        for _ in range(30):
            done = self.ray(*command, cwd=cwd)
            if done.returncode == 0:
                return
            if "No available agent" not in done.stdout + done.stderr:
                raise RuntimeError(done.stdout + done.stderr)
            time.sleep(2)
        raise RuntimeError("the cluster's job agent never came up")

    def wait(self, submission_id: str, timeout_s: float = 240) -> str:
        """The job's final state and status text, read from ``ray job status``."""
        # What the CLI prints (on stderr) once a job has ended.
        ended = {
            f"Job '{submission_id}' succeeded": "SUCCEEDED",
            f"Job '{submission_id}' failed": "FAILED",
            f"Job '{submission_id}' was stopped": "STOPPED",
        }
        deadline = time.monotonic() + timeout_s
        text = ""
        while time.monotonic() < deadline:
            status = self.ray(
                "job", "status", "--log-color", "false", "--address", self.dashboard,
                submission_id,
            )  # fmt: skip
            text = status.stdout + status.stderr
            state = next((s for line, s in ended.items() if line in text), None)
            if state:
                return f"{state}\n{text}"
            time.sleep(3)
        raise TimeoutError(f"job {submission_id} did not end in {timeout_s}s: {text}")

    def logs(self, submission_id: str) -> str:
        return self.ray("job", "logs", "--address", self.dashboard, submission_id).stdout

    def worker_env(self) -> dict[str, str]:
        """The head's environment without the variable that keeps it on 127.0.0.1 (with it,
        ``ray start --address`` refuses to add a node)."""
        return {k: v for k, v in self.env.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}

    def add_node(self, name: str, *, num_cpus: float, timeout_s: float = 120) -> WorkerNode:
        """Starts a worker node with its own ports, temporary directory and process session."""
        temp_dir = tempfile.mkdtemp(prefix=f"rt{name}-", dir="/tmp")
        port = self.gcs_address.rsplit(":", 1)[1]
        flags = _node_ports(head=False)
        start = subprocess.Popen(
            [
                RAY,
                "start",
                f"--address={loopback_host_name()}:{port}",
                f"--num-cpus={num_cpus}",
                f"--temp-dir={temp_dir}",
                "--disable-usage-stats",
                *(f"{flag}={p}" for flag, p in flags.items()),
            ],
            env=self.worker_env(),
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            out, _ = start.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            start.kill()
            stop_session(start.pid)
            raise
        if start.returncode != 0 or "Local node IP: 127.0.0.1" not in _plain(out):
            stop_session(start.pid)
            raise RuntimeError(f"worker node {name} did not start on {LOOPBACK}:\n{out}")
        node = WorkerNode(name=name, session=start.pid, temp_dir=temp_dir)
        self.nodes.append(node)
        return node


def _plain(text: str) -> str:
    """``text`` without terminal colour codes."""
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def _node_ports(*, head: bool) -> dict[str, int]:
    """Every port a node opens, given explicitly: two clusters on one machine otherwise collide
    (the dashboard agent's 52365)."""
    ports = {
        "--dashboard-agent-listen-port": free_port(),
        "--dashboard-agent-grpc-port": free_port(),
        "--runtime-env-agent-port": free_port(),
        "--metrics-export-port": free_port(),
        "--node-manager-port": free_port(),
        "--object-manager-port": free_port(),
    }
    if head:
        ports |= {
            "--port": free_port(),
            "--dashboard-port": free_port(),
            "--ray-client-server-port": free_port(),
        }
    return ports


@contextlib.contextmanager
def local_cluster(*, head_cpus: float, temp_prefix: str = "rthead-") -> Iterator[LocalCluster]:
    """A head node on 127.0.0.1 with token authentication (a token of its own), its own ports
    and temporary directory; every process it and its worker nodes left is ended on exit."""
    # Unix socket paths under Ray's temp dir must stay short: a short name in /tmp.
    temp_dir = tempfile.mkdtemp(prefix=temp_prefix, dir="/tmp")
    env = {
        **os.environ,
        # A Ray 2.60 cluster with token authentication, with a token of its own.
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # keep 127.0.0.1 as the head's address
        "RAY_USAGE_STATS_ENABLED": "0",
        # The job's entrypoint runs `python` from the PATH that `ray start` had.
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    env.pop("RAY_ADDRESS", None)
    ports = _node_ports(head=True)
    start = subprocess.Popen(
        [
            RAY,
            "start",
            "--head",
            f"--node-ip-address={LOOPBACK}",
            f"--dashboard-host={LOOPBACK}",
            f"--num-cpus={head_cpus}",
            f"--temp-dir={temp_dir}",
            "--disable-usage-stats",
            *(f"{flag}={port}" for flag, port in ports.items()),
        ],
        env=env,
        start_new_session=True,  # everything it starts shares this session: stopped below
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    cluster = None
    try:
        out, _ = start.communicate(timeout=120)
        if start.returncode != 0:
            raise RuntimeError(f"ray start --head failed:\n{out}")
        cluster = LocalCluster(
            dashboard=f"http://{LOOPBACK}:{ports['--dashboard-port']}",
            gcs_address=f"{LOOPBACK}:{ports['--port']}",
            env=env,
            session=start.pid,
            temp_dir=temp_dir,
        )
        yield cluster
    finally:
        if start.poll() is None:
            start.kill()
        for node in [] if cluster is None else reversed(cluster.nodes):
            stop_session(node.session)
            shutil.rmtree(node.temp_dir, ignore_errors=True)
        stop_session(start.pid)
        shutil.rmtree(temp_dir, ignore_errors=True)
