"""`raysd generate --draft-assist ngram`: one-line refusals, the fingerprint, and a
three-level job whose greedy rows are the target's own tokens."""

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
    ({"draft_assist": "ngram"}, "needs a draft model"),  # the default drafter is ngram
    ({"draft_assist": "ngram", "draft": "none"}, "needs a draft model"),
    ({"draft_assist": "lookup", "draft": "m"}, "--draft-assist must be one of"),
    ({"draft_assist": "ngram", "draft": "m", "tree_budget": 4}, "--tree-budget 0"),
    ({"draft_assist": "ngram", "draft": "smollm2-135m-instruct-eagle"}, "EAGLE"),
])
def test_what_draft_assist_refuses_is_a_one_line_error(fields, match):
    with pytest.raises(JobError, match=match):
        GenerateConfig(input="in.jsonl", output="out", **fields)


def test_the_flag_parses_and_two_levels_keep_old_fingerprints():
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["--input", "i", "--output", "o", "--draft-assist", "ngram"]).draft_assist == "ngram"
    assert p.parse_args(["--input", "i", "--output", "o"]).draft_assist == "none"
    assert "draft_assist" not in GenerateConfig(input="i", output="o").fingerprint()
    assert GenerateConfig(input="i", output="o", draft="m", draft_assist="ngram").fingerprint()["draft_assist"] == "ngram"


@pytest.mark.slow
def test_a_three_level_job_gives_the_target_greedy_tokens(tmp_path, model_dirs, local_ray):
    from transformers import AutoModelForCausalLM

    target, draft = model_dirs
    prompts = [p + p for p in token_prompts(6, seed=9)]  # repeated halves: the lookup finds matches
    inp = tmp_path / "prompts.jsonl"
    inp.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    cfg = GenerateConfig(input=str(inp), output=str(tmp_path / "out"), target=target, draft=draft, max_new_tokens=10,
                         batch_size=4, quiet=True, draft_assist="ngram")
    generate(cfg)
    rows = sorted(pq.read_table(cfg.output).to_pylist(), key=lambda r: r["id"])
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    assert [r["generated_token_ids"] for r in rows] == [hf_greedy(model, p, 10) for p in prompts]
