"""deploy/kuberay/rayjob.yaml: valid against the RayJob custom resource's schema of a named KubeRay
release (vendored in tests/data/kuberay, SOURCE.md says from where), strictly (an unknown field
is an error, as `kubectl apply --validate=strict` makes it), and a job raysd can run: its
entrypoint parses with `raysd generate`'s own flags, and the cluster has what the job asks."""

from __future__ import annotations

import argparse
import copy
import gzip
import hashlib
import json
import re
import shlex
from pathlib import Path

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "deploy" / "kuberay" / "rayjob.yaml"
SCHEMA_DIR = ROOT / "tests" / "data" / "kuberay"


def rayjob_schema() -> dict:
    data = gzip.decompress((SCHEMA_DIR / "rayjob-v1.openapi.json.gz").read_bytes())
    note = (SCHEMA_DIR / "SOURCE.md").read_text()
    assert hashlib.sha256(data).hexdigest() in note, "the vendored schema is not the one SOURCE.md describes"
    return json.loads(data)


def strict(schema):
    """The schema with every object that lists its properties closed to others, unless it keeps
    unknown fields (x-kubernetes-preserve-unknown-fields): a misspelt field fails. The API server
    itself would drop such a field silently (a structural schema prunes unknown fields)."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def validate(doc: dict) -> list[str]:
    """The schema errors of `doc` (OpenAPI v3 schemas are JSON Schema draft 4 plus extensions)."""
    validator = jsonschema.Draft4Validator(strict(rayjob_schema()))
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def manifest() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


def test_manifest_is_a_valid_rayjob():
    doc = manifest()
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayJob")
    assert validate(doc) == []
    # The validation has teeth: a misspelt field, a wrong type, a missing required field.
    typo = copy.deepcopy(doc)
    typo["spec"]["shutdownAfterJobFinish"] = True
    assert any("shutdownAfterJobFinish" in e for e in validate(typo))
    wrong = copy.deepcopy(doc)
    wrong["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = "two"
    assert validate(wrong)
    missing = copy.deepcopy(doc)
    del missing["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]
    assert any("template" in e for e in validate(missing))


def _containers(spec: dict) -> list[dict]:
    return spec["template"]["spec"]["containers"]


def test_manifest_runs_raysd_generate_on_a_cpu_head_and_gpu_workers():
    from ray.runtime_env import RuntimeEnv

    from raysd.jobs.cli import add_arguments, config_from_args

    spec = manifest()["spec"]
    assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] > 0
    # The entrypoint: `raysd generate` with flags it knows, reading and writing cloud storage.
    argv = shlex.split(spec["entrypoint"])
    assert argv[:2] == ["raysd", "generate"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = config_from_args(parser.parse_args(argv[2:]))
    assert re.match(r"(s3|gs)://", cfg.input) and re.match(r"(s3|gs)://", cfg.output)
    # raysd from the runtime environment, with the extra its storage needs.
    env = yaml.safe_load(spec["runtimeEnvYAML"])
    RuntimeEnv(**env)  # known fields, right types
    extra = "s3" if cfg.output.startswith("s3://") else "gcs"
    assert any(re.fullmatch(rf"raysd\[[a-z0-9,]*\b{extra}\b[a-z0-9,]*\].*", p) for p in env["pip"]), env["pip"]

    cluster = spec["rayClusterSpec"]
    head, workers = cluster["headGroupSpec"], cluster["workerGroupSpecs"]
    containers = _containers(head) + [c for g in workers for c in _containers(g)]
    # Every pod runs the Ray that pyproject admits, in the version the cluster says.
    ray_version = cluster["rayVersion"]
    assert all(c["image"].split(":")[1].startswith(ray_version + "-") for c in containers), containers
    major, minor, _ = map(int, ray_version.split("."))
    assert (2, 60) <= (major, minor) < (2, 64)
    # HF_TOKEN from a Secret in every container, never a literal.
    for c in containers:
        [token] = [e for e in c["env"] if e["name"] == "HF_TOKEN"]
        assert set(token) == {"name", "valueFrom"} and "secretKeyRef" in token["valueFrom"], token
    # A CPU head; GPU workers enough for the job's model actors.
    assert all("nvidia.com/gpu" not in c["resources"].get("limits", {}) for c in _containers(head))
    gpus = sum(g["replicas"] * int(c["resources"]["limits"].get("nvidia.com/gpu", 0)) for g in workers for c in _containers(g))
    actors = cfg.target_tensor_parallel + (1 if cfg.draft_is_model else 0)
    assert 0 < cfg.replicas * actors * cfg.num_gpus_per_actor <= gpus
