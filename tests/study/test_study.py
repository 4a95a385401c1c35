"""`raysd study` on tiny models: the tidy Parquet's shape, and its predictions recomputed from the theory."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from raysd.cli import main
from raysd.core import theory
from raysd.study.prompts import default_prompts_path, load_prompts
from tests.study.conftest import BATCH_SIZES, KS, TASKS

REQUIRED = {"drafter", "k", "batch_size", "task", "measured", "measured_tokens_per_s", "measured_speedup",
            "predicted_speedup", "predicted_speedup_overlapped", "predicted_best_k", "alpha", "alpha_task",
            "mean_acceptance_length", "acceptance_histogram", "t_target_1_s", "t_target_k_s", "t_draft_s",
            "entropy_mu", "entropy_mu2"}


@pytest.fixture(scope="module")
def df(tiny_study):
    return pq.read_table(tiny_study["path"]).to_pandas()


def test_one_row_per_drafter_k_batch_task(df, tiny_study):
    assert REQUIRED <= set(df.columns)
    assert not df.duplicated(["drafter", "k", "batch_size", "task"]).any()
    assert set(df.drafter) == {"none", tiny_study["draft"], "ngram"}
    assert set(df.task) == {"all", *TASKS} and set(df.batch_size) == set(BATCH_SIZES)
    drafts = df[df.drafter != "none"]
    assert set(drafts.k) == set(range(9))  # predictions over every profiled K
    assert set(df[df.drafter == "none"].k) == {0}
    measured = set(map(tuple, drafts[drafts.measured][["drafter", "k", "batch_size"]].to_numpy()))
    assert measured == {(d, k, b) for d in (tiny_study["draft"], "ngram") for k in KS for b in BATCH_SIZES}


def test_measured_columns(df):
    m = df[df.measured]
    pooled = m[m.task == "all"]
    assert (pooled.measured_tokens_per_s > 0).all()
    assert m[m.task != "all"].measured_tokens_per_s.isna().all()  # tasks share batches: no per-task time
    assert np.allclose(pooled[pooled.drafter == "none"].measured_speedup, 1.0)
    for _, r in m.iterrows():
        assert len(r.acceptance_histogram) == r.k + 1 and sum(r.acceptance_histogram) == r.num_steps
        assert 1.0 <= r.mean_acceptance_length <= r.k + 1
    spec = m[m.drafter != "none"]
    assert spec.alpha.dropna().between(0, 1).all() and spec.alpha.notna().any()  # NaN: nothing drafted
    assert (df[df.measured].drafter != "none").any() and spec.mean_acceptance_length.max() > 1.0
    assert (df.entropy_mu > 0).all() and (df.entropy_mu2 >= df.entropy_mu**2 - 1e-9).all()


def test_predictions_follow_the_theory(df):
    rows = df[(df.drafter != "none") & df.alpha_task.notna()]
    assert len(rows)
    for _, r in rows.iterrows():
        e = theory.expected_tokens_per_step(r.alpha_task, int(r.k))
        assert r.predicted_mean_acceptance_length == pytest.approx(e)
        args = (e, r.t_target_1_s, r.t_target_k_s, r.t_draft_s, int(r.k))
        assert r.predicted_speedup == pytest.approx(theory.serial_speedup(*args))
        assert r.predicted_speedup_overlapped == pytest.approx(theory.overlapped_speedup(*args))
    for _, g in rows.groupby(["drafter", "batch_size", "task"]):
        assert g.predicted_best_k.nunique() == 1
        assert g.predicted_speedup.max() == pytest.approx(g[g.k == g.predicted_best_k.iloc[0]].predicted_speedup.iloc[0])


def test_text_prompts_need_a_tokenizer(tiny_study, tmp_path, capsys):
    prompts = tmp_path / "text.jsonl"
    prompts.write_text(json.dumps({"category": "qa", "prompt": "hello"}) + "\n")
    rc = main(["study", "--target", tiny_study["target"], "--prompts", str(prompts), "--output", str(tmp_path / "x.parquet")])
    assert rc == 2 and "tokenizer" in capsys.readouterr().err


class _CharTokenizer:
    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) % 90 + 3 for c in text]}

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


@pytest.mark.skipif(not default_prompts_path().is_file(), reason="Spec-Bench question.jsonl not available")
def test_spec_bench_prompts_six_tasks():
    prompts = load_prompts(default_prompts_path(), 2, _CharTokenizer(), max_prompt_tokens=50)
    tasks = [p.task for p in prompts]
    assert sorted(set(tasks)) == ["math_reasoning", "mt_bench", "qa", "rag", "summarization", "translation"]
    assert all(tasks.count(t) == 2 for t in set(tasks))
    assert max(len(p.token_ids) for p in prompts) <= 50
