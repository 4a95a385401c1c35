"""`raysd generate --tree-budget P` (issue 19): one-line refusals, the fingerprint, and a job
whose greedy rows are the target's own tokens, each row recording P and its tree statistics."""

from __future__ import annotations

import argparse
import json

import pyarrow.parquet as pq
import pytest
import torch

from raysd.jobs import GenerateConfig, JobError, generate
from raysd.jobs.cli import add_arguments
from tests.actors.actor_helpers import hf_greedy
from tests.jobs.conftest import token_prompts


@pytest.mark.parametrize("fields,match", [
    ({"tree_budget": -1}, "--tree-budget"),
    ({"tree_budget": 4, "draft": "none"}, "drafter"),
    ({"tree_budget": 4, "draft": "m", "num_speculative_tokens": "auto"}, "auto"),
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


@pytest.mark.slow
def test_a_tree_job_gives_the_target_greedy_tokens(tmp_path, model_dirs, local_ray):
    from transformers import AutoModelForCausalLM

    target, draft = model_dirs
    prompts = token_prompts(6, seed=9)
    inp = tmp_path / "prompts.jsonl"
    inp.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    cfg = GenerateConfig(input=str(inp), output=str(tmp_path / "out"), target=target, draft=draft, max_new_tokens=10,
                         batch_size=4, quiet=True, tree_budget=8)
    generate(cfg)
    rows = sorted(pq.read_table(cfg.output).to_pylist(), key=lambda r: r["id"])
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    assert [r["generated_token_ids"] for r in rows] == [hf_greedy(model, p, 10) for p in prompts]
    assert {r["tree_budget"] for r in rows} == {8}
    assert all(1 < r["mean_nodes_verified"] <= 8 and r["num_branch_accepts"] >= 0 for r in rows)
