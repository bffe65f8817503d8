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
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

__all__ = [
    "AutoscalingCluster",
    "LocalCluster",
    "WorkerNode",
    "WorkerNodeType",
    "autoscaling_cluster",
    "connected",
    "fake_autoscaling_config",
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


def process_title(pid: int) -> str:
    """A process's title (a Ray worker's shows its actor class and the method it runs, as
    ``ray::RankWorker.train``); "" when it is gone."""
    import psutil

    try:
        return " ".join(psutil.Process(pid).cmdline()).strip()
    except psutil.Error:
        return ""


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

    def wait(self, submission_id: str, timeout_s: float = 240, *, poll_s: float = 3) -> str:
        """The job's final state and status text, read from ``ray job status`` every ``poll_s``
        (the CLI takes a second of CPU to start)."""
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
            time.sleep(poll_s)
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
    """Every port a node opens, given explicitly and each a different one: two clusters on one
    machine otherwise collide (the dashboard agent's 52365), and a port just freed can be the
    next one handed out (Ray refuses two components on one port)."""
    flags = [
        "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
        "--runtime-env-agent-port", "--metrics-export-port", "--node-manager-port",
        "--object-manager-port",
    ]  # fmt: skip
    if head:
        flags += ["--port", "--dashboard-port", "--ray-client-server-port"]
    ports: dict[str, int] = {}
    while len(ports) < len(flags):
        port = free_port()
        if port not in ports.values():
            ports[flags[len(ports)]] = port
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


# --- a head with Ray's own autoscaler, on the fake multi-node provider ------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerNodeType:
    """A worker node type of an autoscaling cluster (``available_node_types.<name>``)."""

    name: str
    resources: dict[str, float]  # CPU, GPU, ...: what each node of the type offers
    min_workers: int = 0
    max_workers: int

    def __post_init__(self) -> None:
        if not 0 <= self.min_workers <= self.max_workers:
            raise ValueError(
                f"node type {self.name!r}: min_workers={self.min_workers} and max_workers="
                f"{self.max_workers} need 0 <= min_workers <= max_workers"
            )


def fake_autoscaling_config(
    node_types: Sequence[WorkerNodeType],
    *,
    gcs_address: str,
    idle_timeout_s: float,
    head_resources: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """An autoscaling config for Ray's fake multi-node provider (what
    ``ray.cluster_utils.AutoscalingCluster`` writes from the example config Ray's sources keep
    next to the provider), with worker nodes that join the GCS at ``gcs_address``."""
    types: dict[str, Any] = {
        "ray.head.default": {
            "resources": dict(head_resources or {"CPU": 0}),
            "node_config": {},
            "max_workers": 0,
        }
    }
    for t in node_types:
        types[t.name] = {
            "resources": dict(t.resources),
            "node_config": {},
            "min_workers": t.min_workers,
            "max_workers": t.max_workers,
        }
    return {
        "cluster_name": "fake_multinode",
        "max_workers": sum(t.max_workers for t in node_types),
        "provider": {
            "type": "fake_multinode",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "gcs_address": gcs_address,  # else the provider's nodes look for the GCS on :6379
        },
        "available_node_types": types,
        "head_node_type": "ray.head.default",
        "auth": {},
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": idle_timeout_s / 60,
        "docker": {},
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
    }


@dataclasses.dataclass
class AutoscalingCluster:
    gcs_address: str  # 127.0.0.1:<port>
    env: dict[str, str]  # with the token: what a client of this cluster runs with
    session: int  # the process session of the head's `ray start`: every node lives in it
    temp_dir: str
    config_path: str  # the autoscaling config the autoscaler reads (again at every update)

    def config(self) -> dict[str, Any]:
        with open(self.config_path) as f:
            return dict(json.load(f))


@contextlib.contextmanager
def autoscaling_cluster(
    node_types: Sequence[WorkerNodeType],
    *,
    idle_timeout_s: float = 6.0,
    update_interval_s: float = 1.0,
    temp_prefix: str = "rtas-",
) -> Iterator[AutoscalingCluster]:
    """A head node on 127.0.0.1 (no CPUs: ranks go to worker nodes) running Ray's autoscaler on
    the fake multi-node provider, which starts and stops worker nodes of ``node_types`` as
    processes on this machine.

    ``ray.cluster_utils.AutoscalingCluster`` does the same, but its ``start()`` first runs
    ``ray stop --force``, which ends every Ray process on the machine. Here the head is started
    in a process session of its own, with its own ports, temporary directory and token; the
    autoscaler starts its nodes from that session too, and on exit every process of the session
    is ended by pid.
    """
    temp_dir = tempfile.mkdtemp(prefix=temp_prefix, dir="/tmp")
    ports = _node_ports(head=True)
    gcs_address = f"{LOOPBACK}:{ports['--port']}"
    config_path = os.path.join(temp_dir, "autoscaling.json")
    with open(config_path, "w") as f:
        json.dump(
            fake_autoscaling_config(
                node_types, gcs_address=gcs_address, idle_timeout_s=idle_timeout_s
            ),
            f,
        )
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        # The autoscaler's nodes start from its process: this keeps them on 127.0.0.1 too.
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_FAKE_CLUSTER": "1",  # the fake provider refuses to start without it
        "AUTOSCALER_UPDATE_INTERVAL_S": f"{update_interval_s:g}",
    }
    env.pop("RAY_ADDRESS", None)
    command = [
        RAY,
        "start",
        "--head",
        f"--node-ip-address={LOOPBACK}",
        f"--dashboard-host={LOOPBACK}",
        "--num-cpus=0",
        f"--autoscaling-config={config_path}",
        f"--temp-dir={temp_dir}",
        "--disable-usage-stats",
        *(f"{flag}={port}" for flag, port in ports.items()),
    ]
    start: subprocess.Popen[str] | None = None
    try:
        # Ray gives its raylet 30 s to register (not configurable); on a loaded machine that can
        # run out, so a failed start is retried once.
        for attempt in range(2):
            if start is not None:
                stop_session(start.pid)
            start = subprocess.Popen(
                command,
                env=env,
                start_new_session=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            out, _ = start.communicate(timeout=120)
            if start.returncode == 0:
                break
            if attempt == 1:
                raise RuntimeError(f"ray start --head --autoscaling-config failed:\n{out}")
        assert start is not None
        yield AutoscalingCluster(
            gcs_address=gcs_address,
            env=env,
            session=start.pid,
            temp_dir=temp_dir,
            config_path=config_path,
        )
    finally:
        if start is not None:
            if start.poll() is None:
                start.kill()
            stop_session(start.pid)
        shutil.rmtree(temp_dir, ignore_errors=True)


@contextlib.contextmanager
def connected(cluster: AutoscalingCluster | LocalCluster) -> Iterator[None]:
    """This process as a driver of ``cluster`` (its token in the environment while connected);
    a cluster this process is connected to already is shut down first."""
    import ray
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

    from raytrec.cluster import bind_to_loopback

    if ray.is_initialized():
        ray.shutdown()
    keys = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")
    saved = {k: os.environ.get(k) for k in keys}

    def refresh() -> None:
        # Ray reads the mode and the token once per process: read them again.
        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()

    os.environ.update({k: cluster.env[k] for k in keys})
    refresh()
    bind_to_loopback()
    try:
        ray.init(address=cluster.gcs_address)
        yield
    finally:
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        refresh()
