"""`ray job submit` against a real local cluster, and the cluster files that size gangs.

The cluster test starts its own Ray head with ``ray start`` on 127.0.0.1 (its own ports, temp
directory and authentication token), submits the training job with the real ``ray job submit``
command line, and stops exactly the processes it started: ``ray stop`` would stop every Ray
cluster on the machine, so the test ends its own process session by pid instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pathlib
import secrets
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest
import yaml

from raytrec.config import TrainConfig
from raytrec.config_file import load_config

REPO = pathlib.Path(__file__).resolve().parent.parent
BIN = pathlib.Path(sys.executable).parent  # the environment running the tests has Ray
RAY = str(BIN / "ray")
GPU_CONFIG = REPO / "examples" / "configs" / "gpu_cluster.yaml"
LAUNCHER = REPO / "examples" / "cluster" / "cluster-launcher.yaml"
KUBERAY = REPO / "examples" / "cluster" / "kuberay-raycluster.yaml"
RUNTIME_ENV = REPO / "examples" / "runtime_env.yaml"


# --- the cluster files fit whole gangs ---------------------------------------------------------


def gangs_per_node(config: TrainConfig, cpus: float, gpus: float) -> int:
    """Whole gangs a node of ``cpus``/``gpus`` holds; its GPUs must be an exact multiple."""
    per_rank_gpus = 1 if config.scaling.use_gpu else 0
    gang_gpus = config.scaling.gang_size * per_rank_gpus
    gang_cpus = config.scaling.gang_size * config.scaling.cpus_per_rank
    assert gang_gpus > 0, "the example is a GPU job"
    assert gpus % gang_gpus == 0, f"{gpus} GPUs is not a multiple of a gang's {gang_gpus}"
    gangs = int(gpus // gang_gpus)
    assert gangs >= 1
    assert cpus >= gangs * gang_cpus, f"{cpus} CPUs cannot hold {gangs} gangs of {gang_cpus}"
    return gangs


def test_cluster_launcher_nodes_hold_whole_gangs() -> None:
    import jsonschema
    import ray.autoscaler

    config = load_config(str(GPU_CONFIG))
    launcher = yaml.safe_load(LAUNCHER.read_text())
    schema = json.loads(
        (pathlib.Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text()
    )
    jsonschema.validate(launcher, schema)  # Ray's own schema for `ray up` configs

    types = launcher["available_node_types"]
    head = types[launcher["head_node_type"]]
    assert head["resources"].get("CPU", 0) == 0 and head["resources"].get("GPU", 0) == 0
    gang_types = {name: t for name, t in types.items() if t["resources"].get("GPU", 0) > 0}
    assert list(gang_types) == ["gpu_gang_node"]
    node = gang_types["gpu_gang_node"]
    per_node = gangs_per_node(config, node["resources"]["CPU"], node["resources"]["GPU"])
    assert per_node == 1
    assert node["min_workers"] * per_node == config.elastic.min_gangs
    assert node["max_workers"] * per_node == config.elastic.max_gangs
    assert launcher["max_workers"] >= node["max_workers"]
    assert config.scaling.ranks_per_host == config.scaling.gang_size  # one bundle per gang
    starting = config.scaling.num_gangs
    assert config.elastic.min_gangs <= starting <= (config.elastic.max_gangs or starting)
    assert all("RAY_AUTH_MODE=token" in c for c in launcher["worker_start_ray_commands"][1:])


def test_kuberay_worker_pods_hold_whole_gangs() -> None:
    config = load_config(str(GPU_CONFIG))
    manifest = yaml.safe_load(KUBERAY.read_text())
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayCluster"
    spec = manifest["spec"]
    assert spec["rayVersion"] == "2.60.0" and spec["enableInTreeAutoscaling"] is True
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    (group,) = spec["workerGroupSpecs"]
    (container,) = group["template"]["spec"]["containers"]
    limits = container["resources"]["limits"]
    assert container["resources"]["requests"] == limits  # Ray reads its resources from these
    per_pod = gangs_per_node(config, float(limits["cpu"]), float(limits["nvidia.com/gpu"]))
    assert group["minReplicas"] * per_pod == config.elastic.min_gangs
    assert group["maxReplicas"] * per_pod == config.elastic.max_gangs
    assert group["replicas"] * per_pod == config.scaling.num_gangs
    for pod in (spec["headGroupSpec"]["template"]["spec"], group["template"]["spec"]):
        env = {e["name"]: e for e in pod["containers"][0]["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        assert "secretKeyRef" in env["RAY_AUTH_TOKEN"]["valueFrom"]


def test_runtime_env_excludes_the_environment_and_runs() -> None:
    env = yaml.safe_load(RUNTIME_ENV.read_text())
    assert {".venv/", "runs/", ".git/"} <= set(env["excludes"])
    assert "working_dir" not in env  # given with --working-dir on the command line


# --- a real cluster -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass(frozen=True)
class LocalCluster:
    dashboard: str  # http://127.0.0.1:<port>, what `ray job submit --address` takes
    env: dict[str, str]  # with the token: what a client of this cluster runs with
    session: int  # the process session of every process `ray start` left running


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


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    # Unix socket paths under Ray's temp dir must stay short: a short name in /tmp.
    temp_dir = tempfile.mkdtemp(prefix="rtjob-", dir="/tmp")
    env = {
        **os.environ,
        # A Ray 2.60 cluster with token authentication, with a token of its own.
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # keep 127.0.0.1 as the node address
        "RAY_USAGE_STATS_ENABLED": "0",
        # The job's entrypoint runs `python` from the PATH that `ray start` had.
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    env.pop("RAY_ADDRESS", None)
    dashboard_port = free_port()
    ports = {
        "--port": free_port(),
        "--dashboard-port": dashboard_port,
        "--dashboard-agent-listen-port": free_port(),
        "--dashboard-agent-grpc-port": free_port(),
        "--runtime-env-agent-port": free_port(),
        "--metrics-export-port": free_port(),
        "--ray-client-server-port": free_port(),
        "--node-manager-port": free_port(),
        "--object-manager-port": free_port(),
    }
    start = subprocess.Popen(
        [
            RAY,
            "start",
            "--head",
            "--node-ip-address=127.0.0.1",
            "--dashboard-host=127.0.0.1",
            "--num-cpus=3",
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
    try:
        out, _ = start.communicate(timeout=120)
        assert start.returncode == 0, out
        yield LocalCluster(
            dashboard=f"http://127.0.0.1:{dashboard_port}", env=env, session=start.pid
        )
    finally:
        if start.poll() is None:
            start.kill()
        stop_session(start.pid)
        shutil.rmtree(temp_dir, ignore_errors=True)


def ray_cli(
    cluster: LocalCluster, *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [RAY, *args],
        env=env or cluster.env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def submit(cluster: LocalCluster, submission_id: str, *job_args: str) -> None:
    """``ray job submit`` as a user types it; retried while the job agent is still starting."""
    command = [
        "job",
        "submit",
        "--address",
        cluster.dashboard,
        "--submission-id",
        submission_id,
        "--working-dir",
        ".",
        "--runtime-env",
        str(RUNTIME_ENV.relative_to(REPO)),
        "--no-wait",
        "--",
        "python",
        "-m",
        "jobs.train",
        *job_args,
    ]
    for _ in range(30):
        done = ray_cli(cluster, *command)
        if done.returncode == 0:
            return
        assert "No available agent" in done.stdout + done.stderr, done.stdout + done.stderr
        time.sleep(2)
    raise AssertionError("the cluster's job agent never came up")


def wait_for(cluster: LocalCluster, submission_id: str, timeout_s: float = 240) -> str:
    """The job's final state and status message, read from ``ray job status``."""
    # What the CLI prints (on stderr) once a job has ended.
    ended = {
        f"Job '{submission_id}' succeeded": "SUCCEEDED",
        f"Job '{submission_id}' failed": "FAILED",
        f"Job '{submission_id}' was stopped": "STOPPED",
    }
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        status = ray_cli(
            cluster,
            "job",
            "status",
            "--log-color",
            "false",
            "--address",
            cluster.dashboard,
            submission_id,
        )
        text = status.stdout + status.stderr
        state = next((s for line, s in ended.items() if line in text), None)
        if state:
            return f"{state}\n{text}"
        time.sleep(3)
    raise AssertionError(f"job {submission_id} did not end in {timeout_s}s: {text}")


def job_logs(cluster: LocalCluster, submission_id: str) -> str:
    return ray_cli(cluster, "job", "logs", "--address", cluster.dashboard, submission_id).stdout


@pytest.mark.cluster
def test_ray_job_submit_trains_and_reports(cluster: LocalCluster, tmp_path: pathlib.Path) -> None:
    # Without the token (RAY_AUTH_MODE unset) the cluster refuses the client.
    no_token = {k: v for k, v in cluster.env.items() if k != "RAY_AUTH_MODE"}
    refused = ray_cli(cluster, "job", "list", "--address", cluster.dashboard, env=no_token)
    assert refused.returncode != 0
    assert "Unauthorized" in refused.stdout + refused.stderr

    storage = tmp_path / "runs"
    submit(
        cluster,
        "raytrec-ok",
        "--config",
        "examples/configs/local_cpu.yaml",
        "--steps",
        "6",
        "--log-every",
        "3",
        "--storage-path",
        str(storage),
        "--set",
        "name=submitted",
    )
    submit(cluster, "raytrec-bad-config", "--set", "scaling.gang_size=3")

    state = wait_for(cluster, "raytrec-ok")
    logs = job_logs(cluster, "raytrec-ok")
    assert state.startswith("SUCCEEDED"), state + logs
    # Job logs are not a terminal: plain progress lines, no redrawn bar.
    assert "[raytrec] step      3/6 ( 50%)" in logs and "[raytrec] step      6/6 (100%)" in logs
    assert "[raytrec] done: 6 steps" in logs
    assert "\r" not in logs

    (run_dir,) = storage.glob("submitted-*")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [3, 6]
    assert all(r["gangs"] == 2 and math.isfinite(r["loss"]) for r in rows)
    # fit() writes its own history too: the streamed file holds the same rows.
    assert rows == json.loads((run_dir / "metrics.json").read_text())
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    png = (run_dir / "metrics.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (900, 600)
    assert len(png) > 20_000

    # A bad configuration fails the job, with exit code 2 and the reason in its log.
    state = wait_for(cluster, "raytrec-bad-config")
    assert state.startswith("FAILED"), state
    assert "exit code 2" in state
    logs = job_logs(cluster, "raytrec-bad-config")
    assert "raytrec: configuration error: scaling.gang_size=3 does not divide" in logs


@pytest.mark.cluster
def test_ray_job_stop_stops_at_a_boundary_with_a_checkpoint(
    cluster: LocalCluster, tmp_path: pathlib.Path
) -> None:
    storage = tmp_path / "runs"
    submit(
        cluster,
        "raytrec-stop",
        "--config",
        "examples/configs/local_cpu.yaml",
        "--steps",
        "400",
        "--log-every",
        "4",
        "--storage-path",
        str(storage),
        "--set",
        "name=stopped",
        "--set",
        "checkpoint.every_n_steps=200",
        # Slow steps: the job is still training when it is stopped.
        "--set",
        "faults.faults=[{kind: slow_rank, step: 1, rank: 0, stall_s: 0.2, steps: 400}]",
    )
    deadline = time.monotonic() + 180
    while "[raytrec] step      8/400" not in job_logs(cluster, "raytrec-stop"):
        assert time.monotonic() < deadline, job_logs(cluster, "raytrec-stop")
        time.sleep(2)
    stopped = ray_cli(cluster, "job", "stop", "--address", cluster.dashboard, "raytrec-stop")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr

    state = wait_for(cluster, "raytrec-stop")
    logs = job_logs(cluster, "raytrec-stop")
    assert state.startswith("STOPPED"), state + logs
    assert "stopping at the next interval boundary" in logs, logs
    (line,) = [x for x in logs.splitlines() if "[raytrec] stopped on request at step" in x]
    step = int(line.split("at step ")[1].split()[0])
    assert 8 <= step < 400 and step % 4 == 0, line
    (run_dir,) = storage.glob("stopped-*")
    # A checkpoint of the step it stopped at, although none was due by every_n_steps.
    assert f"checkpoint: {run_dir}/checkpoints/" in line, line
    assert (run_dir / "final_model").is_dir()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == step
    # The ledger, in the log and the run directory.
    ledger = json.loads((run_dir / "summary.json").read_text())
    assert ledger["steps"] == step and ledger["stopped"].startswith("StopRequested"), ledger
    assert ledger["batches"]["lost"] == 0 and ledger["replica_check"]["passed"] is True, ledger
    assert ledger["artifacts"]["checkpoint"] in line, (ledger, line)
    assert f"[raytrec] ledger: {step} of 400 steps" in logs, logs
