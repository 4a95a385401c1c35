"""Safe defaults: no repository code, no unpickled weights, a local Ray on
localhost without a dashboard, and no file outside the output directory. No Ray, no job here
(except one CLI run); the end-to-end path-like ids are in test_bad_input.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raysd.jobs import GenerateConfig, JobError
from raysd.jobs.runner import check_job
from raysd.models.loading import ModelSpec, UnsafeWeightsError, load_model
from tests.conftest import tiny_model

ROWS = [{"id": i, "prompt": [3 + i, 4, 5]} for i in range(3)]


@pytest.fixture(scope="module")
def pickle_only_dir(tmp_path_factory):
    """A model directory whose weights are only pytorch_model.bin (a pickle)."""
    d = tmp_path_factory.mktemp("pickled") / "model"
    model = tiny_model("llama", seed=0)
    model.config.save_pretrained(d)
    model.generation_config.save_pretrained(d)
    torch.save(model.state_dict(), d / "pytorch_model.bin")
    return d


def _input(tmp_path) -> str:
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "in.parquet")
    return str(tmp_path / "in.parquet")


def test_pickled_weights_refused_before_ray_unless_allowed(tmp_path, pickle_only_dir):
    inp = _input(tmp_path)
    with pytest.raises(JobError, match="only pickled weights.*--allow-pickle-weights"):
        check_job(GenerateConfig(input=inp, output=str(tmp_path / "o"), target=str(pickle_only_dir)))
    with pytest.raises(JobError, match="only pickled weights"):  # a draft too
        check_job(GenerateConfig(input=inp, output=str(tmp_path / "o"), target=str(pickle_only_dir), draft=str(pickle_only_dir),
                                 allow_pickle_weights=False))
    check_job(GenerateConfig(input=inp, output=str(tmp_path / "o"), target=str(pickle_only_dir), allow_pickle_weights=True))
    # The loader itself refuses too (an actor given such a directory never unpickles it) ...
    with pytest.raises(UnsafeWeightsError):
        load_model(ModelSpec(str(pickle_only_dir)))
    # ... and loads it when asked, with the same weights.
    model = load_model(ModelSpec(str(pickle_only_dir), allow_pickle_weights=True))
    ref = tiny_model("llama", seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))


def test_pickled_weights_cli_is_one_line_before_ray(tmp_path, pickle_only_dir):
    args = ["--input", _input(tmp_path), "--output", str(tmp_path / "out"), "--target", str(pickle_only_dir), "--quiet"]
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "raysd", "generate", *args], capture_output=True, text=True,
                          env={**os.environ, "RAY_ADDRESS": ""}, timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "only pickled weights" in lines[0] and "--allow-pickle-weights" in lines[0], proc.stderr
    assert time.monotonic() - start < 30
    assert not (tmp_path / "out").exists()
    from raysd.jobs.cli import add_arguments, config_from_args
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert config_from_args(p.parse_args(["--input", "x", "--output", "y", "--allow-pickle-weights"])).allow_pickle_weights
    assert not config_from_args(p.parse_args(["--input", "x", "--output", "y"])).allow_pickle_weights


def test_remote_code_is_never_run_unless_asked(tmp_path, monkeypatch):
    """A model directory naming its own code (auto_map) must not get that code run by default."""
    d = tmp_path / "evil"
    tiny_model("llama", seed=0).save_pretrained(d)
    marker = tmp_path / "pwned"
    cfg = json.loads((d / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                               "from transformers import LlamaConfig, LlamaForCausalLM\n"
                               "class EvilConfig(LlamaConfig): pass\nclass EvilModel(LlamaForCausalLM): pass\n")
    assert GenerateConfig(input="x", output="y").trust_remote_code is False and ModelSpec().trust_remote_code is False
    try:
        load_model(ModelSpec(str(d)))  # transformers either refuses or ignores auto_map; never imports evil.py
    except Exception:  # noqa: BLE001
        pass
    from raysd.models.loading import load_tokenizer

    load_tokenizer(str(d))
    assert not marker.exists()
    # The flag is what turns it on: the loader passes it through as given.
    seen = {}
    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        classmethod(lambda cls, *a, **kw: seen.update(kw) or tiny_model("llama")))
    load_model(ModelSpec(str(d)))
    assert seen["trust_remote_code"] is False and seen["use_safetensors"] is True


# Run in a fresh process: it starts Ray the way `raysd generate` does, spawns a worker, then lists
# every TCP socket listening in the process tree Ray started (GCS, raylet, agents, workers).
_LISTENERS = r"""
import json, os, psutil, ray
from raysd.jobs import GenerateConfig
from raysd.jobs.runner import _init_ray

os.environ.pop("RAY_ADDRESS", None)
assert _init_ray(GenerateConfig(input="x", output="y"), {})
ray.get(ray.remote(lambda: 1).remote())
me = psutil.Process()
procs = {p.pid: p.name() for p in [me] + me.children(recursive=True)}
listening = [(procs[c.pid], c.laddr.ip) for c in psutil.net_connections("tcp")
             if c.status == psutil.CONN_LISTEN and c.pid in procs]
print(json.dumps({"listening": listening, "node_ip": ray.util.get_node_ip_address(),
                  "env_after": os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"),
                  "task_events_kept": ray._raylet.Config.task_events_max_num_task_in_gcs()}))
ray.shutdown()
"""


def test_local_ray_listens_on_loopback_only():
    import ipaddress

    from raysd.actors.local import TASK_EVENTS_KEPT_IN_GCS

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", _LISTENERS], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    names = {name for name, _ in got["listening"]}
    assert {"gcs_server", "raylet"} <= names, got  # the check is not vacuous
    exposed = [(name, ip) for name, ip in got["listening"]
               if not ipaddress.ip_address(ip.removeprefix("::ffff:")).is_loopback]
    assert exposed == [], f"listening beyond loopback: {exposed}"
    assert got["node_ip"] == "127.0.0.1"
    assert got["env_after"] is None  # the driver's environment is restored for later ray.init calls
    assert got["task_events_kept"] == TASK_EVENTS_KEPT_IN_GCS  # as the cluster reports it: the GCS is bounded


def test_local_ray_has_no_dashboard(monkeypatch):
    import ray

    from raysd.jobs import runner

    calls = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    assert runner._init_ray(GenerateConfig(input="x", output="y"), {}) is True
    (kw,) = calls
    assert kw["address"] == "local"  # never a stale cluster recorded in /tmp/ray
    assert kw["include_dashboard"] is False


def test_local_ray_refuses_a_routable_address(monkeypatch):
    import ray

    from raysd.jobs import runner

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: None)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "192.0.2.7")
    with pytest.raises(JobError, match="192.0.2.7, not loopback"):
        runner._init_ray(GenerateConfig(input="x", output="y"), {})


def test_part_names_never_come_from_data(tmp_path):
    """Whatever the ids or columns hold, parts are named by the run and the write task's index,
    and land in the output directory (the job-level check is test_bad_input.test_nasty_inputs_end_to_end)."""
    from raysd.jobs.io import OutputStore
    from raysd.jobs.pipeline import PartsSink
    from raysd.jobs.schema import output_schema

    schema = output_schema(pa.field("id", pa.string()), [pa.field("prompt", pa.string())])
    out = tmp_path / "a" / "out"
    sink = PartsSink(str(out), schema, 1, local=True)
    from tests.reliability.test_bad_input import error_rows_for

    rows = error_rows_for(["../x", "../../etc/passwd", "/tmp/abs", "a/b", "..", "C:\\x", "nul\x00"], schema)
    ctx = type("Ctx", (), {"task_idx": 0})()
    sink.write([pa.Table.from_pylist(rows, schema=schema)], ctx)
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert all(p.parent in (out, out / "_tmp") for p in written), written
    assert [p.name for p in written if p.parent == out] == [f"part-{sink.run_id}-000000.parquet"]
    assert OutputStore(str(out)).done_samples("id") == {r["id"]: {0} for r in rows}
