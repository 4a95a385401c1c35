"""The benchmarks' one definition of each figure (bench.measure), the harness's pairing, a
scenario's run on tiny random models, and `python -m bench report` on a hand-made result file.
No Ray, no real model; a few seconds. (Speed itself is measured by `python -m bench run`, not here.)"""

from __future__ import annotations

import argparse
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench import environment, record, registry
from bench.cli import scenario_parser
from bench.harness import Outcome, Variant, run_variants
from bench.measure import Counts, decode_tokens_per_s, figures, median_figures, paired_ratio
from bench.report import MANIFEST, MAX_LINES, MAX_PROSE_WORDS, main as report_main, prose_words, render
from raysd.core.stats import SpecDecodeStats
from tests.conftest import tiny_model


@dataclass
class Result:  # what Counts.of_results reads of a GenerationResult
    token_ids: list
    stats: SpecDecodeStats


def stats(drafted, accepted, steps, overlap, tested) -> SpecDecodeStats:
    return SpecDecodeStats(4, num_spec_steps=steps, num_draft_tokens=drafted, num_accepted_draft_tokens=accepted,
                           overlap_sum=overlap, num_tested_positions=tested)


def test_figures_pool_rows_by_one_definition():
    rows = [Result(list(range(10)), stats(8, 4, 6, 3.5, 6)), Result(list(range(6)), stats(4, 1, 5, 1.2, 4))]
    c = Counts.of_results(rows)
    assert (c.generated_tokens, c.drafted, c.accepted, c.passes, c.tested) == (16, 12, 5, 11, 10)
    f = figures(c, wall_s=2.0, prefill_s=0.5)
    assert f["tokens_per_s"] == 8.0  # tokens / the whole call's wall: the prefill is not taken out
    assert f["acceptance_rate"] == pytest.approx(5 / 12)  # accepted / drafted, pooled (not a mean of row rates)
    assert f["alpha"] == pytest.approx(4.7 / 10)  # pooled overlap / pooled tested positions
    assert f["mean_acceptance_length"] == pytest.approx(1 + 5 / 11)  # tokens per target pass
    assert f["prefill_s"] == 0.5
    # Pooled, not averaged: the mean of the rows' own alpha estimates is another number.
    assert f["alpha"] != pytest.approx((rows[0].stats.alpha_estimate + rows[1].stats.alpha_estimate) / 2)


def test_no_drafts_and_bad_counts():
    f = figures(Counts(7), 1.0)
    assert (f["acceptance_rate"], f["alpha"], f["mean_acceptance_length"]) == (None, None, None)
    with pytest.raises(ValueError):
        Counts(5, drafted=2, accepted=3)
    with pytest.raises(ValueError):
        figures(Counts(5), 0.0)
    rows = [{"num_generated_tokens": 4, "num_draft_tokens": 6, "num_accepted_draft_tokens": 3, "num_spec_steps": 2}] * 2
    assert Counts.of_rows(rows) == Counts(8, 12, 6, 4)  # a job's output: no overlaps, so alpha stays unknown


def test_medians_paired_ratios_and_decode_rate():
    a = [{"tokens_per_s": 10.0, "x": None}, {"tokens_per_s": 30.0, "x": None}, {"tokens_per_s": 12.0, "x": None}]
    b = [{"tokens_per_s": 5.0}, {"tokens_per_s": 30.0}, {"tokens_per_s": 6.0}]
    assert median_figures(a) == {"tokens_per_s": 12.0, "x": None}
    r = paired_ratio(a, b)
    assert r["per_repeat"] == [2.0, 1.0, 2.0] and r["median"] == 2.0  # the ratio of medians would be 12 / 6 = 2 too,
    assert paired_ratio(a[:2], b[:2])["median"] == 1.5  # but not here: (10 + 30) / 2 against 30 / 17.5
    assert decode_tokens_per_s({"generated_tokens": 90, "wall_s": 4.0}, {"generated_tokens": 10, "wall_s": 2.0}) == 40.0
    with pytest.raises(ValueError):
        paired_ratio(a, b[:2])


def test_harness_interleaves_and_pairs_by_repeat():
    calls, rates = [], {"A": iter([10.0, 20.0]), "B": iter([5.0, 40.0])}

    def make(name):
        return lambda: calls.append(name) or figures(Counts(int(next(rates[name]))), 1.0, _tokens=[1])

    variants = [Variant("A", {}, make("A")), Variant("B", {}, make("B"), baseline="A")]
    summaries, runs = run_variants(variants, repeats=2, log=lambda line: None)
    assert calls == ["A", "B", "B", "A"]  # the order reversed every other repeat
    b = summaries[1]
    assert b["ratio"]["tokens_per_s"]["per_repeat"] == [0.5, 2.0] and b["median"]["tokens_per_s"] == 22.5
    assert "_tokens" in runs["B"][0] and all("_tokens" not in r for r in b["runs"])  # private figures never written


def test_engine_scenario_runs_on_tiny_models():
    from bench.models import Models
    from bench.scenarios.engine import Spec, engine_run

    models = Models(target=tiny_model("llama"), tokenizer=object())
    prompts = [{"ids": [5, 6, 7, 8, 5, 6]}, {"ids": [9, 10, 11]}, {"ids": [3, 4]}]
    a = argparse.Namespace(auto_k_max=2, max_new_tokens=5, stop_at_eos=False, batch_sizes=[2])
    plain = engine_run(models, Spec("none", 0, 0, "exact", "auto", 2, 0.0), prompts, a, None)
    ngram = engine_run(models, Spec("ngram", 2, 0, "exact", "auto", 2, 0.0), prompts, a, None)
    assert plain["generated_tokens"] == ngram["generated_tokens"] == 15  # EOS ignored: every row makes 5
    assert plain["drafted"] == 0 and plain["mean_acceptance_length"] == 1.0
    assert ngram["_tokens"] == plain["_tokens"]  # greedy: exact


def test_step_scenario_times_a_tiny_model():
    from bench.scenarios.steps import Steps

    s = Steps(tiny_model("llama"), "stock", batch=2, context=16)
    out = s.time(3, reps=3)
    assert out["step_s"] > 0 and s.runner.lengths.tolist() == [16, 16]  # rolled back after every forward


def test_every_scenario_loads_and_parses_its_quick_options():
    for scenario in registry.SCENARIOS.values():
        module = scenario.load()
        a = scenario_parser(scenario, module, quick=True).parse_args(["--quick"])
        assert a.quick and a.repeats >= 1, scenario.name


def hand_made_result(tmp_path: Path) -> Path:
    plain = [{"tokens_per_s": t} for t in (10.0, 8.0, 10.0)]
    draft = [{"tokens_per_s": t} for t in (12.0, 10.0, 13.0)]
    variants = [{"name": "plain, B=1", "settings": {}, "baseline": None, "median": {"tokens_per_s": 10.0}, "runs": plain},
                {"name": "draft K=3, B=1", "settings": {}, "baseline": "plain, B=1",
                 "median": {"tokens_per_s": 12.5, "acceptance_rate": 0.4, "alpha": 0.5, "mean_acceptance_length": 1.9},
                 "ratio": {"tokens_per_s": {"median": 1.25, "per_repeat": [1.2, 1.25, 1.3]}}, "runs": draft}]
    machine = {"cpu": "Test CPU", "cores": 2, "simd": ["avx2"], "torch_threads": 2, "gpu": None}
    versions = {"python": "3.11", "torch": "2.x", "transformers": "5.x", "ray": "2.60", "raysd_commit": "abc123"}
    r = record.build("engine", "python -m bench run engine --ks 3", {"ks": [3]}, False, "2026-11-26T09:00:00+00:00", 12.0,
                     machine, [0.5, 0.4, 0.3], [1.5, 0.6, 0.3], versions, Outcome(variants))
    return record.write(r, tmp_path / "engine_test.json")


def test_report_writes_a_short_page_from_a_result_file(tmp_path):
    path = hand_made_result(tmp_path)
    manifest = tmp_path / "m.toml"
    manifest.write_text(f'''[page]
intro = "How fast."
no_gpu = "No GPU figure."
no_cpu = "No CPU figure."
not_measured = ["GPU"]
smoke = "{tmp_path}/none-*.json"
smoke_intro = "Smoke."
glance_note = "Paired."

[[glance]]
what = "A draft at K = 3"
file = "{path}"
variant = "draft K=3, B=1"
section = "drafters"

[[glance]]
what = "Plain against the draft, inverted"
file = "{path}"
variant = "draft K=3, B=1"
key = "tokens_per_s"
invert = true
section = "drafters"

[[table]]
section = "CPU"
anchor = "drafters"
title = "Drafters"
files = [{{path = "{path}"}}]
''')
    page = tmp_path / "performance.md"
    assert report_main(["--manifest", str(manifest), "--out", str(page)]) == 0
    text = page.read_text()
    assert text.count("\n") < 150
    for needed in ("Test CPU, 2 cores, AVX2", "2026-11-26T09:00:00", "load 0.50 at the start, 1.50 at the end",
                   "`python -m bench run engine --ks 3`", "| draft K=3, B=1 | 12.5 | 0.40 | 0.50 | 1.90 | 1.25 | 3 |",
                   "No GPU figure.", "- GPU", '<a id="drafters"></a>',
                   # the glance row is computed from the runs, repeat by repeat: 12/10, 10/8, 13/10
                   "| A draft at K = 3 | **1.25x** | 1.20, 1.25, 1.30 | 2-core CPU | [engine_test](#drafters) |",
                   # `invert` (for a time): the baseline over the variant, 10/12, 8/10, 10/13
                   "| Plain against the draft, inverted | **0.80x** | 0.83, 0.80, 0.77 | 2-core CPU | [engine_test](#drafters) |"):
        assert needed in text, needed
    assert report_main(["--manifest", str(manifest), "--out", str(page), "--check"]) == 0
    page.write_text(text + "edited\n")
    assert report_main(["--manifest", str(manifest), "--out", str(page), "--check"]) == 1


def test_the_real_manifest_gives_a_page_read_in_a_minute():
    text = render(tomllib.loads(MANIFEST.read_text()))
    assert text.count("\n") <= MAX_LINES and prose_words(text) <= MAX_PROSE_WORDS
    assert "## At a glance" in text and "## GPU" in text and "## Not measured yet" in text
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', text))
    assert set(re.findall(r"\]\(#([^)]+)\)", text)) <= anchors  # every glance row links to its table


def test_prose_words_leave_out_tables_and_commands():
    assert prose_words("# T\n| a | b |\nReproduce: `x y z`.\nTwo words") == 2


def test_a_page_too_long_to_read_in_a_minute_is_refused(tmp_path):
    manifest = tomllib.loads(MANIFEST.read_text())
    manifest["page"]["intro"] += " word" * MAX_PROSE_WORDS
    with pytest.raises(ValueError, match="words of prose"):
        render(manifest)


def test_result_envelope_names_its_machine_and_versions():
    v = environment.versions()
    assert {"python", "torch", "transformers", "ray", "raysd_commit"} <= set(v)
    assert len(environment.load_average()) == 3


def test_fast_steps_row_check_passes_near_ties_only():
    from bench.scenarios.fast_step import rows_check

    variants = [Variant("engine", {}, None), Variant("actors", {}, None, baseline="engine")]
    base = {"0": [5, 6, 7], "1": [1, 2, 3], "2": [4, 4, 4]}
    runs = {"engine": [{"_rows": base}], "actors": [{"_rows": {"0": [5, 6, 7], "1": [1, 9, 9], "2": [4, 8, 8]}}]}
    asked = []

    def near_tie(row, prefix, a, b):  # row 1's first difference is a tie, row 2's is not
        asked.append((row, prefix, a, b))
        return {"near_tie": row == "1"}

    check = rows_check(variants, runs, near_tie)
    assert asked == [("1", [1], 9, 2), ("2", [4], 8, 4)]
    assert not check["ok"] and check["mismatched"] == {"actors": {"2": {"position": 1, "near_tie": False}}}
    assert check["near_ties"] == {"actors": {"1": {"position": 1, "near_tie": True}}}
    runs["actors"][0]["_rows"]["2"] = [4, 4, 4]
    assert rows_check(variants, runs, near_tie)["ok"]
