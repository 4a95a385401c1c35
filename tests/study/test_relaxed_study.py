"""The relaxed acceptance dial in the study: on i.i.d. toy models the engine's measured rejection
rate and acceptance length match Yin et al.'s front and Leviathan's eq. 1 at the rule's acceptance
rate; `raysd study --acceptance relaxed:LAMBDA` reports both side by side."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pyarrow.parquet as pq
import pytest

from raysd.cli import main
from raysd.core import theory
from raysd.core.sampling import SamplingParams
from raysd.core.speculation import SpeculationConfig
from raysd.engine.drafters import DraftModelDrafter
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.requests import LossyAcceptanceWarning, Request
from raysd.study.sweep import Pool, StudyConfig
from tests.study.conftest import save_tiny_pair, write_token_prompts
from tests.study.test_iid import V, toy_pair


@pytest.mark.parametrize("lam", [0.0, 0.5])
def test_relaxed_iid_rejection_rate_is_on_the_front(lam):
    """Every position has the same TV = 1 - a, so each test rejects with probability (1 - lam) TV
    (within 5 standard errors over ~4,000 tested positions) and a step emits eq. 1's tokens at the
    acceptance rate 1 - (1 - lam) TV (within 5 standard errors, less the budget-cut steps)."""
    target, draft, a = toy_pair(1.0)
    k, tv = 3, 1.0 - a
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LossyAcceptanceWarning)
        speculation = SpeculationConfig(num_speculative_tokens=k, acceptance=f"relaxed:{lam}")
        engine = SpecEngine(target, DraftModelDrafter(draft, V),
                            EngineConfig(speculation, max_batch_size=32))
    params = [SamplingParams(temperature=1.0, max_new_tokens=160, ignore_eos=True, seed=i) for i in range(32)]
    results = engine.generate([Request(i, [1 + i % 5, 3], p) for i, p in enumerate(params)])
    assert {r.acceptance for r in results} == {f"relaxed:{lam}"}
    pool = Pool(k)
    for r in results:
        pool.add(r)
    assert pool.alpha == pytest.approx(a, abs=1e-4)  # the overlap is the true target's, not the mixture's
    front_reject, loss = theory.relaxed_rule_point(tv, lam)
    se = math.sqrt(front_reject * (1 - front_reject) / pool.tested)
    assert pool.tested > 3000 and abs(pool.rejection_rate - front_reject) < 5 * se
    assert pool.rejection_rate + loss == pytest.approx(tv, abs=5 * se)  # on the front: P(reject) + TV(out, p) = TV
    counts = pool.histogram
    steps = int(counts.sum())
    j = np.arange(k + 1)
    mean = (j * counts).sum() / steps
    se_mean = np.sqrt((counts * (j - mean) ** 2).sum() / (steps - 1) / steps)
    not_offered = k * steps - sum(r.stats.speculation_length_sum for r in results)
    expected = theory.expected_tokens_per_step(1.0 - front_reject, k) - 1
    assert expected - not_offered / steps - 5 * se_mean <= mean <= expected + 5 * se_mean, (mean, expected)


def test_study_config_refuses_a_bad_rule():
    with pytest.raises(ValueError, match="acceptance"):
        StudyConfig(acceptance="relaxed:2")


@pytest.fixture(scope="module")
def relaxed_study(tmp_path_factory):
    root = tmp_path_factory.mktemp("relaxed_study")
    target, draft = save_tiny_pair(root)
    prompts = write_token_prompts(root / "prompts.jsonl", per_task=2)
    out = root / "study.parquet"
    argv = ["study", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts), "--prompts-per-task", "2",
            "--batch-sizes", "2", "--ks", "2", "--max-new-tokens", "8", "--temperature", "1.0", "--profile-context", "8",
            "--profile-reps", "1", "--acceptance", "relaxed:0.5", "--output", str(out)]
    return argv, out, str(draft)


def test_study_reports_the_front_beside_the_measurement(relaxed_study, capsys):
    argv, out, draft = relaxed_study
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LossyAcceptanceWarning)
        assert main(argv) == 0
    df = pq.read_table(out).to_pandas()
    base, spec = df[df.drafter == "none"], df[df.drafter == draft]
    assert (base.acceptance == "exact").all() and base.tv_target_draft.isna().all()
    assert (spec.acceptance == "relaxed:0.5").all() and (spec.relax_lambda == 0.5).all()
    for _, r in spec[spec.alpha_task.notna()].iterrows():
        tv = 1 - r.alpha_task
        assert r.tv_target_draft == pytest.approx(tv)
        assert r.front_rejection_rate == pytest.approx(0.5 * tv) and r.front_tv_to_target == pytest.approx(0.5 * tv)
        assert r.alpha_rule == pytest.approx(1 - 0.5 * tv)
        assert r.predicted_mean_acceptance_length == pytest.approx(theory.expected_tokens_per_step(1 - 0.5 * tv, int(r.k)))
        assert 0 <= r.measured_rejection_rate_task <= 1
    m = spec[spec.measured & (spec.task == "all")]
    assert len(m) == 1 and m.rejection_rate.iloc[0] == pytest.approx(m.measured_rejection_rate_task.iloc[0])
    printed = capsys.readouterr().out
    assert "front_rejection_rate" in printed and "relaxed:0.5" in printed


def test_study_refuses_a_bad_rule_on_the_command_line(relaxed_study, tmp_path, capsys):
    argv, _, _ = relaxed_study
    argv = [x if x != "relaxed:0.5" else "lossy" for x in argv]
    argv[argv.index("--output") + 1] = str(tmp_path / "x.parquet")
    assert main(argv) == 2 and "acceptance" in capsys.readouterr().err
