"""`-k auto` end to end: no profiling pass before the first token, with a draft model or without:
the step costs are learned from the job's own steps, and the rows stay the
target's greedy tokens whatever K is chosen. A fixed K with a draft model measures its profile
once per models and machine (to choose one or two micro-batches)."""

from __future__ import annotations

import json
import os

import pyarrow.parquet as pq
import pytest
import ray

from raysd.jobs import GenerateConfig, generate
from tests.jobs.conftest import token_prompts
from tests.jobs.test_eagle_job import greedy
from tests.conftest import fresh_cache_dir, own_ray, tiny_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """Set before the module's Ray starts, so the replicas inherit it."""
    path = fresh_cache_dir(tmp_path_factory.mktemp("raysd-cache"))
    old = os.environ.get("RAYSD_CACHE_DIR")
    os.environ["RAYSD_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("RAYSD_CACHE_DIR")
    else:
        os.environ["RAYSD_CACHE_DIR"] = old


@pytest.fixture(scope="module")
def local_ray(cache_dir):
    """A Ray of this module's own, started after `cache_dir` is set (the session's shared Ray
    caches into another directory): its workers see only this module's profiles."""
    own_ray(num_cpus=6)
    yield
    ray.shutdown()


def test_auto_with_a_draft_model_profiles_nothing_and_keeps_greedy_output(cache_dir, tmp_path, model_dirs, local_ray):
    target, draft = model_dirs[0], model_dirs[1]
    prompts = token_prompts(6, seed=9)
    inp = tmp_path / "prompts.jsonl"
    inp.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    cfg = GenerateConfig(input=str(inp), output=str(tmp_path / "out"), target=target, draft=draft,
                         num_speculative_tokens="auto", max_new_tokens=8, batch_size=4, quiet=True)
    summary = generate(cfg)
    assert not list((cache_dir / "step_costs").glob("*.json"))  # nothing measured, nothing cached
    model = tiny_model("llama", seed=0)
    rows = {r["id"]: r for r in pq.read_table(cfg.output).to_pylist()}
    assert [rows[i]["generated_token_ids"] for i in range(len(prompts))] == [greedy(model, p, 8) for p in prompts]
    assert summary.latest_run.time_breakdown["wall"]["generating"] > 0

    # A fixed K measures nothing either: the replica's shape decides its micro-batches (raysd.jobs.replica).
    fixed = GenerateConfig(**{**cfg.to_dict(), "output": str(tmp_path / "fixed"), "num_speculative_tokens": 8})
    generate(fixed)
    assert not list((cache_dir / "step_costs").glob("*.json"))
    rows = {r["id"]: r for r in pq.read_table(fixed.output).to_pylist()}
    assert [rows[i]["generated_token_ids"] for i in range(len(prompts))] == [greedy(model, p, 8) for p in prompts]


def test_auto_with_a_model_free_drafter_profiles_nothing(cache_dir, tmp_path, model_dirs, local_ray):
    """-k auto with n-gram lookup learns its step costs from the job's own steps: no profiling pass,
    nothing cached, and the rows are still the target's greedy tokens."""
    target = model_dirs[0]
    before = sorted(p.name for p in (cache_dir / "step_costs").glob("*.json"))
    prompts = [p + p for p in token_prompts(6, seed=10)]  # repeats give the lookup something to find
    inp = tmp_path / "prompts.jsonl"
    inp.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    cfg = GenerateConfig(input=str(inp), output=str(tmp_path / "out"), target=target, draft="ngram",
                         num_speculative_tokens="auto", max_new_tokens=8, batch_size=4, quiet=True)
    summary = generate(cfg)
    assert sorted(p.name for p in (cache_dir / "step_costs").glob("*.json")) == before
    model = tiny_model("llama", seed=0)
    rows = {r["id"]: r for r in pq.read_table(cfg.output).to_pylist()}
    assert [rows[i]["generated_token_ids"] for i in range(len(prompts))] == [greedy(model, p, 8) for p in prompts]
    assert summary.latest_run.time_breakdown["wall"]["generating"] > 0
