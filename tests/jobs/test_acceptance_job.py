"""`raysd generate --acceptance`: exact by default, `relaxed:LAMBDA` on request,
and every row records the rule that produced it."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from raysd.jobs import GenerateConfig, JobError, generate
from raysd.jobs.cli import add_arguments
from tests.jobs.conftest import token_prompts


@pytest.mark.parametrize("rule", ["relaxed", "relaxed:2", "relaxed:-0.1", "lossy:0.5", "exact:0"])
def test_a_bad_rule_is_a_one_line_error(rule):
    with pytest.raises(JobError, match="--acceptance"):
        GenerateConfig(input="in.jsonl", output="out", acceptance=rule)


def test_the_flag_parses_and_exact_keeps_old_fingerprints():
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--input", "in.jsonl", "--output", "out", "--acceptance", "relaxed:0.25"])
    assert args.acceptance == "relaxed:0.25"
    exact = GenerateConfig(input="in.jsonl", output="out")
    assert exact.acceptance == "exact" and "acceptance" not in exact.fingerprint()  # outputs before the flag resume
    assert GenerateConfig(input="in.jsonl", output="out", acceptance="relaxed:0.25").fingerprint()["acceptance"] == "relaxed:0.25"


@pytest.mark.slow
def test_relaxed_one_accepts_every_draft_and_rows_say_so(tmp_path, model_dirs, local_ray):
    """LAMBDA = 1 verifies each draft against the draft itself: every draft is accepted."""
    target, draft = model_dirs[0], model_dirs[1]
    inp = tmp_path / "prompts.jsonl"
    inp.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in token_prompts(6, seed=8)))
    rows = {}
    for rule in ("exact", "relaxed:1"):
        cfg = GenerateConfig(input=str(inp), output=str(tmp_path / rule.replace(":", "_")), target=target, draft=draft,
                             max_new_tokens=8, temperature=1.0, batch_size=4, quiet=True, acceptance=rule,
                             num_speculative_tokens=4)  # fixed: auto could choose not to draft at all
        generate(cfg)
        rows[rule] = pq.read_table(cfg.output).to_pylist()
    assert {r["acceptance"] for r in rows["exact"]} == {"exact"}
    assert {r["acceptance"] for r in rows["relaxed:1"]} == {"relaxed:1"}
    relaxed = rows["relaxed:1"]
    assert sum(r["num_draft_tokens"] for r in relaxed) > 0
    assert all(r["num_accepted_draft_tokens"] == r["num_draft_tokens"] for r in relaxed)
    assert sum(r["num_accepted_draft_tokens"] for r in rows["exact"]) < sum(r["num_draft_tokens"] for r in rows["exact"])
