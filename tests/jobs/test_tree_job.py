"""`raysd generate --tree-budget P`: one-line refusals, the fingerprint, and a job whose greedy
rows are the target's own tokens, each row recording P and the tree statistics the single-process
engine gives it."""

from __future__ import annotations

import argparse
import json

import pyarrow.parquet as pq
import pytest
import torch

from raysd.core.sampling import SamplingParams
from raysd.core.speculation import SpeculationConfig
from raysd.engine.drafters import DraftModelDrafter
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.requests import Request
from raysd.jobs import GenerateConfig, JobError, generate
from raysd.jobs.cli import add_arguments
from tests.actors.actor_helpers import hf_greedy
from tests.conftest import EOS, VOCAB
from tests.jobs.conftest import token_prompts


@pytest.mark.parametrize("fields,match", [
    ({"tree_budget": -1}, "--tree-budget"),
    ({"tree_budget": 4, "draft": "none"}, "drafter"),
    ({"tree_budget": 4, "draft": "m", "num_speculative_tokens": 0}, ">= 1"),
    ({"tree_budget": 4, "draft": "m", "acceptance": "relaxed:0.5"}, "exactly"),
])
def test_what_a_tree_refuses_is_a_one_line_error(fields, match):
    with pytest.raises(JobError, match=match):
        GenerateConfig(input="in.jsonl", output="out", **fields)


def test_the_flag_parses_and_a_chain_keeps_old_fingerprints():
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["--input", "i", "--output", "o", "--tree-budget", "8"]).tree_budget == 8
    assert "tree_budget" not in GenerateConfig(input="i", output="o").fingerprint()
    assert GenerateConfig(input="i", output="o", draft="m", tree_budget=8).fingerprint()["tree_budget"] == 8


def test_the_summary_pools_the_tree_statistics_and_is_null_for_a_chain():
    from raysd.jobs.runner import pooled

    totals = {"rows": 3, "failed": 0, "tokens": 40, "drafted": 70, "accepted": 20, "steps": 10, "branch_accepts": 4}
    tree = pooled(totals, tree_budget=8)
    assert tree == {"draft_acceptance_rate": 20 / 70, "mean_acceptance_length": 3.0, "mean_nodes_verified": 7.0,
                    "mean_accepted_depth": 2.0, "num_branch_accepts": 4, "beam_node_selection_rate": None}
    chain = pooled(totals, tree_budget=0)
    assert [chain[k] for k in ("mean_nodes_verified", "mean_accepted_depth", "num_branch_accepts")] == [None, None, None]


@pytest.mark.slow
def test_a_tree_job_gives_the_target_greedy_tokens(tmp_path, model_dirs, local_ray):
    from transformers import AutoModelForCausalLM

    target, draft = model_dirs
    prompts = token_prompts(6, seed=9)
    inp = tmp_path / "prompts.jsonl"
    inp.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    cfg = GenerateConfig(input=str(inp), output=str(tmp_path / "out"), target=target, draft=draft, max_new_tokens=10,
                         batch_size=4, quiet=True, tree_budget=8, num_speculative_tokens=4)
    summary = generate(cfg)
    rows = sorted(pq.read_table(cfg.output).to_pylist(), key=lambda r: r["id"])
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    assert [r["generated_token_ids"] for r in rows] == [hf_greedy(model, p, 10) for p in prompts]
    assert {r["tree_budget"] for r in rows} == {8}
    assert all(1 < r["mean_nodes_verified"] <= 8 for r in rows)
    # Each row's counts, its branch accepts among them, are the single-process engine's on the same
    # models, tree and K: at temperature 0 a row's steps do not depend on the rows beside it.
    speculation = SpeculationConfig(num_speculative_tokens=4, eos_token_ids=(EOS,), tree_budget=8)
    drafter = DraftModelDrafter(AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval(), VOCAB)
    engine = SpecEngine(model, drafter, EngineConfig(speculation, max_batch_size=4))
    with torch.inference_mode():
        expected = engine.generate([Request(i, p, SamplingParams(max_new_tokens=10)) for i, p in enumerate(prompts)])
    counts = ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens", "num_branch_accepts")
    assert [[r[c] for c in counts] for r in rows] == [[e.stats.to_dict()[c] for c in counts] for e in expected]
    # The summary (and _summary.json) pools the same statistics over the written rows.
    steps = sum(r["num_spec_steps"] for r in rows)
    pooled = {"mean_nodes_verified": sum(r["num_draft_tokens"] for r in rows) / steps,
              "mean_accepted_depth": sum(r["num_accepted_draft_tokens"] for r in rows) / steps,
              "num_branch_accepts": sum(r["num_branch_accepts"] for r in rows)}
    written = json.loads((tmp_path / "out" / "_summary.json").read_text())
    for got in (summary.to_dict(), written, written["latest_run"]):  # the whole output, and its one run
        assert {k: got[k] for k in pooled} == pytest.approx(pooled)
    assert summary.tree_budget == written["tree_budget"] == 8
    assert summary.mean_accepted_depth == pytest.approx(summary.mean_acceptance_length - 1)


@pytest.mark.slow
def test_a_job_choosing_its_tree_each_step_gives_the_target_greedy_tokens(tmp_path, model_dirs, local_ray):
    """The default -k auto with --tree-budget: each step's chain or tree is chosen from the step
    costs the replica learns from its own steps; the rows are still the target's own."""
    from transformers import AutoModelForCausalLM

    target, draft = model_dirs
    prompts = token_prompts(4, seed=10)
    inp = tmp_path / "prompts.jsonl"
    inp.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    cfg = GenerateConfig(input=str(inp), output=str(tmp_path / "out"), target=target, draft=draft, max_new_tokens=8,
                         batch_size=4, quiet=True, tree_budget=8)
    assert cfg.adaptive_speculation
    generate(cfg)
    rows = sorted(pq.read_table(cfg.output).to_pylist(), key=lambda r: r["id"])
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    assert [r["generated_token_ids"] for r in rows] == [hf_greedy(model, p, 8) for p in prompts]
    assert {r["tree_budget"] for r in rows} == {8} and all(r["error"] is None for r in rows)
