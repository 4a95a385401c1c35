"""Deployment: cluster.yaml against Ray's own schema, and a real `ray job submit` to a
head started with `ray start` (tiny model, token-id prompts: no tokenizer, no download)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_cluster_yaml_validates_against_ray_schema():
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    validate_config(prepare_config(cfg))  # raises on any schema error
    workers = cfg["available_node_types"]["ray.worker.gpu"]
    assert workers["node_config"]["InstanceType"].startswith(("g", "p"))  # GPU instances
    setup = cfg["setup_commands"]
    torch_at = next(i for i, c in enumerate(setup) if "install torch" in c)
    raysd_at = next(i for i, c in enumerate(setup) if "/raysd" in c and "install" in c)
    assert torch_at < raysd_at  # torch first, then the package
    assert "/raysd[s3,gcs]" in setup[raysd_at]  # cloud storage for --input/--output (docs/cluster.md)


def test_cloud_extras_are_declared():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["s3"][0].startswith("s3fs") and extras["gcs"][0].startswith("gcsfs")


def test_runtime_env_example_is_valid():
    from ray.runtime_env import RuntimeEnv

    env = yaml.safe_load((ROOT / "jobs" / "runtime_env.yaml").read_text())
    RuntimeEnv(**env)  # known fields, right types
    assert env["working_dir"] == "."


def test_submit_script_forwards_hf_token_and_every_argument(tmp_path):
    """jobs/submit_generate.sh, against a fake `ray` that records its arguments."""
    fake = tmp_path / "ray"
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$FAKE_RAY_ARGS"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "HF_TOKEN": "hf_test", "FAKE_RAY_ARGS": str(tmp_path / "args")}
    subprocess.run(["bash", "jobs/submit_generate.sh", "--input", "s3://b/in/", "--output", "s3://b/out/"], cwd=ROOT, env=env,
                   check=True, timeout=60)
    args = (tmp_path / "args").read_text().splitlines()
    assert args[:2] == ["job", "submit"]
    runtime = json.loads(args[args.index("--runtime-env-json") + 1])
    assert runtime == {**yaml.safe_load((ROOT / "jobs" / "runtime_env.yaml").read_text()),
                       "env_vars": {**runtime["env_vars"], "HF_TOKEN": "hf_test"}}
    assert args[args.index("--") + 1:] == ["python", "-m", "raysd", "generate", "--input", "s3://b/in/", "--output", "s3://b/out/"]


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


@pytest.fixture
def ray_head(tmp_path):
    """`ray start --head --block` on non-default ports. Teardown ends this head only (its own
    process group) rather than `ray stop`, which would kill every Ray on a shared machine."""
    pytest.importorskip("aiohttp", reason="job submission needs the dashboard: pip install 'ray[default]'")
    gcs, dashboard, agent = _free_ports(3)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # On SIGTERM the head drains for up to 30 s first (for Serve replicas; none here): 31 s of each run.
    # Its workers at normal priority, as docs/cluster.md says to start a cluster's nodes.
    head_env = {**env, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", "RAY_worker_niceness": "0"}
    cmd = ["ray", "start", "--head", "--block", f"--port={gcs}", "--num-cpus=2", "--num-gpus=0",
           "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
           f"--dashboard-agent-listen-port={agent}", "--node-ip-address=127.0.0.1", "--disable-usage-stats"]
    log = open(tmp_path / "head.log", "w")
    head = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=head_env, start_new_session=True)
    address = f"http://127.0.0.1:{dashboard}"
    deadline = time.monotonic() + 120
    client_env = {**env, "RAY_AUTH_MODE": "token"}  # send ~/.ray/auth_token (the head requires it)
    while True:
        probe = subprocess.run(["ray", "job", "list", "--address", address], capture_output=True, text=True, env=client_env)
        if probe.returncode == 0:
            break
        if head.poll() is not None or time.monotonic() > deadline:
            log.flush()
            pytest.fail(f"ray head did not come up: {(tmp_path / 'head.log').read_text()[-2000:]}")
        time.sleep(2)
    yield address, client_env
    try:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops its own processes
        head.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    finally:
        try:
            os.killpg(head.pid, signal.SIGKILL)  # anything left of this head's process group
        except ProcessLookupError:
            pass
        log.close()


@pytest.mark.slow
@pytest.mark.alone  # a `ray start` head with its dashboard and job agent, beside no other Ray
@pytest.mark.xdist_group("own-rays")  # nor beside another test's own Ray or cluster (tests/conftest.py)
def test_ray_job_submit_end_to_end(tmp_path, model_dirs, ray_head):
    address, env = ray_head
    target, _ = model_dirs
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13], [], [14, 15, 16, 17, 18]]
    pq.write_table(pa.table({"prompt": prompts, "note": list("abcde")}), tmp_path / "prompts.parquet")
    out = tmp_path / "out"
    cmd = ["ray", "job", "submit", "--address", address, "--runtime-env", "jobs/runtime_env.yaml",
           "--", "python", "-m", "raysd", "generate", "--input", str(tmp_path / "prompts.parquet"), "--output", str(out),
           "--target", target, "--draft", "ngram", "--max-new-tokens", "4", "--batch-size", "2", "--quiet"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "succeeded" in proc.stdout
    assert "raysd generate: 5 rows" in proc.stdout  # the job's own summary line, streamed back
    table = pq.read_table(out)
    assert sorted(table.column("id").to_pylist()) == [0, 1, 2, 3, 4]
    reasons = dict(zip(table.column("id").to_pylist(), table.column("finish_reason").to_pylist()))
    assert reasons[3] == "error" and all(reasons[i] != "error" for i in (0, 1, 2, 4))
    assert (out / "_summary.json").exists()
