"""`ray job submit` against a real local cluster, and the cluster files that size gangs.

The cluster test starts its own Ray head with ``ray start`` on 127.0.0.1 (its own ports, temp
directory and authentication token; ``raytrec.cluster.local``), submits the training job with the
real ``ray job submit`` command line, and stops exactly the processes it started: ``ray stop``
would stop every Ray cluster on the machine, so the cluster's process sessions are ended by pid.
"""

from __future__ import annotations

import json
import math
import pathlib
import struct
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import yaml

from raytrec.cluster.local import LocalCluster, local_cluster
from raytrec.config import TrainConfig
from raytrec.config.file import load_config

REPO = pathlib.Path(__file__).resolve().parents[2]
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


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with local_cluster(head_cpus=3, temp_prefix="rtjob-") as c:
        yield c


def ray_cli(
    cluster: LocalCluster, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return cluster.ray(*args, env=env, cwd=str(REPO))


def submit(cluster: LocalCluster, submission_id: str, *job_args: str) -> None:
    """``ray job submit`` as a user types it."""
    runtime_env = str(RUNTIME_ENV.relative_to(REPO))
    entrypoint = ("python", "-m", "jobs.train", *job_args)
    cluster.submit(submission_id, *entrypoint, cwd=str(REPO), runtime_env=runtime_env)


def wait_for(cluster: LocalCluster, submission_id: str, timeout_s: float = 240) -> str:
    return cluster.wait(submission_id, timeout_s)


def job_logs(cluster: LocalCluster, submission_id: str) -> str:
    return cluster.logs(submission_id)


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
        "testing.faults=[{kind: slow_rank, step: 1, rank: 0, stall_s: 0.2, steps: 400}]",
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
