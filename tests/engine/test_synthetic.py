"""Synthetic-acceptance mode (capacity planning): drafts accepted with a given probability
instead of by the rejection test; outputs flagged; the default path is exact and unflagged."""

from __future__ import annotations

import math

import pytest

from raysd.core.sampling import SamplingParams
from raysd.core.speculation import Acceptance, SpeculationConfig
from raysd.core.theory import expected_tokens_per_step
from raysd.engine.drafters import DraftModelDrafter, NoDrafter
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.requests import GenerationResult, Request, SyntheticAcceptanceWarning
from tests.conftest import VOCAB, tiny_model
from tests.engine.test_equivalence import prompts


def generate(rate, k, params, n_rows=32, batch=32):
    target, draft = tiny_model("llama", seed=0), tiny_model("llama", seed=5, layers=1)
    acceptance = Acceptance() if rate is None else Acceptance("synthetic", rate)
    config = EngineConfig(SpeculationConfig(num_speculative_tokens=k, acceptance=acceptance), max_batch_size=batch)
    engine = SpecEngine(target, DraftModelDrafter(draft, VOCAB), config)
    ps = prompts(seed=1, lengths=[3 + i % 7 for i in range(n_rows)])
    return engine.generate([Request(i, p, SamplingParams(**{**params.__dict__, "seed": i})) for i, p in enumerate(ps)])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("rate", [0.3, 0.8])
def test_measured_acceptance_rate_matches_the_synthetic_rate(rate, temperature):
    k = 4
    params = SamplingParams(temperature=temperature, max_new_tokens=101, ignore_eos=True)
    with pytest.warns(SyntheticAcceptanceWarning):
        results = generate(rate, k, params)
    accepted = sum(r.stats.num_accepted_draft_tokens for r in results)
    tested = sum(r.stats.num_tested_positions for r in results)  # Bernoulli trials: up to the first rejection
    assert tested > 2000
    se = math.sqrt(rate * (1 - rate) / tested)
    assert abs(accepted / tested - rate) < 5 * se, (accepted / tested, rate, se)
    # Accepted drafts per step: a truncated geometric with mean E - 1. Tolerance: 5 standard
    # errors from the steps' own spread, plus the steps cut short by a row's budget (each
    # draft not offered lowers the expected count by at most `rate`).
    hist = [sum(h) for h in zip(*(r.stats.acceptance_histogram for r in results))]
    steps = sum(hist)
    mean = sum(j * h for j, h in enumerate(hist)) / steps
    se = math.sqrt(sum(h * (j - mean) ** 2 for j, h in enumerate(hist)) / (steps - 1) / steps)
    not_offered = k * steps - sum(r.stats.speculation_length_sum for r in results)
    expected = expected_tokens_per_step(rate, k) - 1
    assert expected - rate * not_offered / steps - 5 * se <= mean <= expected + 5 * se, (mean, expected, se, not_offered)
    for r in results:
        assert r.acceptance == str(Acceptance("synthetic", rate))
        assert len(r.token_ids) == 101


def test_rate_zero_greedy_is_plain_greedy_decoding_and_rate_one_accepts_everything():
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    target = tiny_model("llama", seed=0)
    ps = prompts(seed=2)
    speculation = SpeculationConfig(num_speculative_tokens=0)
    plain = SpecEngine(target, NoDrafter(VOCAB), EngineConfig(speculation, max_batch_size=8)).generate([Request(i, p, params) for i, p in enumerate(ps)])
    with pytest.warns(SyntheticAcceptanceWarning):
        zero = generate(0.0, 3, params, n_rows=len(ps), batch=8)
    assert all(r.stats.num_accepted_draft_tokens == 0 and r.stats.num_spec_steps == 20 for r in zero)
    with pytest.warns(SyntheticAcceptanceWarning):
        speculation = SpeculationConfig(num_speculative_tokens=3, acceptance=Acceptance("synthetic", 0.0))
        engine = SpecEngine(target, DraftModelDrafter(tiny_model("llama", seed=9, layers=1), VOCAB),
                            EngineConfig(speculation, max_batch_size=8))
    same = engine.generate([Request(i, p, params) for i, p in enumerate(ps)])
    assert [r.token_ids for r in same] == [r.token_ids for r in plain]  # the token after the prefix is the target's
    with pytest.warns(SyntheticAcceptanceWarning):
        one = generate(1.0, 4, params, n_rows=8, batch=8)
    assert all(r.stats.mean_acceptance_length == 5.0 for r in one)  # 20 tokens = 4 full steps of 5


def test_default_is_exact_and_unflagged(recwarn):
    config = EngineConfig(SpeculationConfig(num_speculative_tokens=4), max_batch_size=8)
    assert config.speculation.acceptance.exact and config.speculation.acceptance.synthetic_rate is None
    results = generate(None, 4, SamplingParams(max_new_tokens=8), n_rows=4, batch=4)
    assert not [w for w in recwarn if issubclass(w.category, SyntheticAcceptanceWarning)]
    for r in results:
        assert type(r) is GenerationResult and r.acceptance == "exact"


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), True])
def test_rate_is_validated(bad):
    with pytest.raises(ValueError):
        EngineConfig(SpeculationConfig(acceptance=Acceptance("synthetic", bad)))


def test_relaxed_acceptance_is_flagged_accepts_more_and_lambda_zero_is_exact():
    from raysd.engine.requests import LossyAcceptanceWarning

    target, draft = tiny_model("llama", seed=0), tiny_model("llama", seed=5, layers=1)
    ps = prompts(seed=3)
    params = [SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True, seed=i) for i in range(len(ps))]

    def run(acceptance):
        speculation = SpeculationConfig(num_speculative_tokens=4, acceptance=acceptance)
        engine = SpecEngine(target, DraftModelDrafter(draft, VOCAB), EngineConfig(speculation, max_batch_size=8))
        return engine.generate([Request(i, p, q) for i, (p, q) in enumerate(zip(ps, params))])

    exact = run("exact")
    with pytest.warns(LossyAcceptanceWarning):
        zero = run("relaxed:0")
    assert [r.token_ids for r in zero] == [r.token_ids for r in exact]
    with pytest.warns(LossyAcceptanceWarning):
        loose = run("relaxed:0.8")
    rate = lambda rs: sum(r.stats.num_accepted_draft_tokens for r in rs) / sum(r.stats.num_draft_tokens for r in rs)  # noqa: E731
    assert rate(loose) > rate(exact)
    assert all(r.acceptance == "relaxed:0.8" for r in loose) and all(r.acceptance == "exact" for r in exact)
