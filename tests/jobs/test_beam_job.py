"""The job layer's side of beam search: the flags, their one-line errors, the fingerprint, the
output columns and the summary's pooling; and `raysd generate --beam-width` end to end, whose rows
are the target's own beam search (Hugging Face `generate(num_beams=W)`) through the replica's actor."""

from __future__ import annotations

import argparse

import pyarrow as pa
import pytest

from raysd.core.beam import BeamConfig
from raysd.core.stats import SpecDecodeStats
from raysd.jobs import GenerateConfig, JobError
from raysd.jobs.cli import add_arguments, config_from_args, run
from raysd.jobs.runner import pooled
from raysd.jobs.schema import GENERATED_FIELDS, row_totals


def parse(*argv: str) -> GenerateConfig:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return config_from_args(p.parse_args(["--input", "in.jsonl", "--output", "out", *argv]))


def beam_flags(monkeypatch, *argv: str) -> GenerateConfig:
    return parse(*argv)


def test_beam_flags_parse_into_the_engines_config(monkeypatch):
    cfg = beam_flags(monkeypatch, "--beam-width", "4", "--num-return-sequences", "2", "--length-penalty", "0.5",
                     "--early-stopping", "never", "--draft", "ngram")
    assert cfg.beam_config == BeamConfig(4, 0.5, "never", 2)
    assert cfg.effective_num_speculative_tokens == 4 and not cfg.adaptive_speculation  # -k auto: a fixed depth
    assert cfg.beam_lookup_budget == 8 and cfg.samples_per_prompt == 2 and parse("-n", "3").samples_per_prompt == 3
    fp = cfg.fingerprint()
    assert (fp["beam_width"], fp["num_return_sequences"], fp["length_penalty"], fp["early_stopping"]) == (4, 2, 0.5, "never")
    assert "beam_width" not in parse().fingerprint() and parse().beam_config is None


@pytest.mark.parametrize("argv, message", [
    (["--beam-width", "1"], "--beam-width must be an integer >= 2"),
    (["--beam-width", "4", "--temperature", "0.7"], "needs --temperature 0"),
    (["--beam-width", "4", "--top-p", "0.9"], "no --top-p or --top-k"),
    (["--beam-width", "4", "--num-return-sequences", "5"], "--num-return-sequences must be in 1..--beam-width (4)"),
    (["--num-return-sequences", "2"], "--num-return-sequences needs --beam-width"),
    (["--length-penalty", "2"], "need --beam-width"),
    (["--beam-width", "4", "-n", "2"], "use --num-return-sequences, not --num-samples"),
    (["--beam-width", "4", "--stop", "###"], "does not take --stop"),
    (["--beam-width", "4", "--logprobs"], "does not return --logprobs"),
    (["--beam-width", "4", "--acceptance", "relaxed:0.5"], "use --acceptance exact"),
    (["--beam-width", "4", "--draft", "smollm2-135m-instruct-draft", "--tree-budget", "8"], "use --tree-budget 0"),
    (["--beam-width", "4", "--replica-shape", "split"], "use --replica-shape colocated"),
])
def test_beam_conflicts_are_one_line_errors(argv, message):
    with pytest.raises(JobError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        parse(*argv)
    assert "\n" not in str(err.value)


def test_raysd_generate_with_beams_stops_with_one_line(capsys):
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert run(p.parse_args(["--input", "in.jsonl", "--output", "out", "--beam-width", "4", "--temperature", "1"])) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("raysd generate: error: --beam-width") and "\n" not in err


def test_output_columns_and_summary_pool_the_beam_statistics():
    names = [f.name for f in GENERATED_FIELDS]
    assert "beam_score" in names and "num_beam_nodes_selected" in names
    schema = pa.schema(GENERATED_FIELDS)
    assert schema.field("beam_score").nullable and not schema.field("num_beam_nodes_selected").nullable
    # two prompts' rows: 5 passes and 3 passes; 12 and 4 levels; 30 and 10 nodes, 12 and 2 on a selected beam
    stats = [SpecDecodeStats(4, num_spec_steps=5, num_draft_tokens=30, num_accepted_draft_tokens=7, num_beam_nodes_selected=12),
             SpecDecodeStats(4, num_spec_steps=3, num_draft_tokens=10, num_accepted_draft_tokens=1, num_beam_nodes_selected=2)]
    rows = [{"finish_reason": "stop", "num_generated_tokens": 9, "beam_score": -1.5, **s.to_dict()} for s in stats]
    table = pa.Table.from_pylist(rows)
    out = pooled(row_totals(table), tree_budget=0, beam_width=4)
    assert out["mean_acceptance_length"] == pytest.approx(16 / 8)  # levels per target pass
    assert out["beam_node_selection_rate"] == pytest.approx(14 / 40)
    assert pooled(row_totals(table), tree_budget=0)["beam_node_selection_rate"] is None


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["none", "ngram", "model"])
def test_a_beam_job_writes_the_targets_own_beams(draft, tmp_path, model_dirs, local_ray):
    """`raysd generate --beam-width 2 --num-return-sequences 2`: two rows per prompt (sample_index 0
    the best), whatever drafts the tree, equal to the target's own beam search without a drafter
    (raysd.engine.beam, which tests/engine/test_beam.py holds to Hugging Face's `generate`)."""
    import json

    import pyarrow.parquet as pq

    from raysd.engine.beam import BeamEngineConfig, BeamSearchEngine
    from raysd.engine.requests import Request
    from raysd.jobs import generate
    from raysd.core.sampling import SamplingParams
    from tests.conftest import EOS, tiny_model
    from tests.jobs.conftest import token_prompts

    target, draft_dir = model_dirs
    prompts = token_prompts(5, seed=21)
    inp = tmp_path / "prompts.jsonl"
    inp.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    cfg = GenerateConfig(input=str(inp), output=str(tmp_path / "out"), target=target,
                         draft=draft_dir if draft == "model" else draft, beam_width=2, num_return_sequences=2,
                         num_speculative_tokens=2, max_new_tokens=8, batch_size=4, quiet=True)
    summary = generate(cfg)
    assert summary.rows == 2 * len(prompts) and summary.rows_failed == 0
    rows = {(r["id"], r["sample_index"]): r for r in pq.read_table(cfg.output).to_pylist()}
    engine = BeamSearchEngine(tiny_model("llama", seed=0), None, BeamEngineConfig(BeamConfig(2, num_return_sequences=2),
                                                                                  eos_token_ids=(EOS,)))
    expected = engine.generate([Request(i, p, SamplingParams(max_new_tokens=8)) for i, p in enumerate(prompts)])
    for i, hypotheses in enumerate(expected):
        for j, h in enumerate(hypotheses):
            row = rows[(i, j)]
            assert row["generated_token_ids"] == h.token_ids, (i, j)
            assert row["beam_score"] == pytest.approx(h.beam_score, rel=1e-5)
    assert all(rows[(i, 0)]["beam_score"] >= rows[(i, 1)]["beam_score"] for i in range(len(prompts)))
