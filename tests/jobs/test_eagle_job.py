"""`raysd generate --draft <an EAGLE draft>`: the draft actor builds the feature draft on the job's
target, and the rows are the target's own greedy continuations."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import torch

from raysd.jobs import GenerateConfig, generate
from raysd.models.eagle_draft import save_eagle
from tests.conftest import EOS, tiny_eagle, tiny_model
from tests.jobs.conftest import token_prompts

pytestmark = pytest.mark.slow


@torch.inference_mode()
def greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=EOS, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("tree_budget", [0, 8])  # a chain, and EAGLE-2's tree
def test_an_eagle_draft_job_gives_the_targets_greedy_tokens(tmp_path, local_ray, tree_budget):
    target_dir, eagle_dir = tmp_path / "target", tmp_path / "eagle"
    target = tiny_model("llama", seed=0)
    target.save_pretrained(target_dir)
    save_eagle(tiny_eagle(0, 3), eagle_dir, str(target_dir), type(target).__name__, dtype="float32")
    prompts = token_prompts(10, seed=4)
    inp = tmp_path / "prompts.jsonl"
    inp.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    cfg = GenerateConfig(input=str(inp), output=str(tmp_path / "out"), target=str(target_dir), draft=str(eagle_dir),
                         max_new_tokens=9, batch_size=4, quiet=True,
                         num_speculative_tokens=4, tree_budget=tree_budget)  # fixed K: auto turns a random draft off
    summary = generate(cfg)
    rows = {r["id"]: r for r in pq.read_table(cfg.output).to_pylist()}
    assert summary.rows == len(prompts) == len(rows) and summary.rows_failed == 0
    for i, p in enumerate(prompts):
        assert rows[i]["generated_token_ids"] == greedy(target, p, 9)
    assert sum(r["num_draft_tokens"] for r in rows.values()) > 0  # the feature draft really drafted
    assert {r["tree_budget"] for r in rows.values()} == {tree_budget}
    if tree_budget:
        assert any(r["mean_nodes_verified"] > 4 for r in rows.values())  # wider than the chain of 4
