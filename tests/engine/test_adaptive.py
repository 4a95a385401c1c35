"""The speculation-length controller: it maximises expected goodput, agrees with the
theory's optimal K where the theory's assumptions hold, and falls back to plain
decoding when speculation does not pay."""

from __future__ import annotations

import pytest

from raysd.core.stats import SpecDecodeStats
from raysd.core.theory import expected_tokens_per_step, expected_walltime_improvement, optimal_k
from raysd.engine.adaptive import AdaptiveConfig, KController, StepCosts, choose_k, num_micro_batches, row_alpha, step_seconds

K_MAX = 8


def flat_costs(c: float, batch_sizes=(1, 8, 64), t: float = 0.01) -> StepCosts:
    """Leviathan's assumptions: verifying K + 1 tokens costs one target step; a draft step costs c of it."""
    return StepCosts(batch_sizes, tuple((t,) * (K_MAX + 1) for _ in batch_sizes), tuple(c * t for _ in batch_sizes))


@pytest.mark.parametrize("alpha", [0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95])
@pytest.mark.parametrize("c", [0.0, 0.05, 0.2, 0.5, 0.9])
def test_agrees_with_leviathan_optimal_k(alpha, c):
    config = AdaptiveConfig(flat_costs(c))
    k = choose_k([alpha] * 4, [K_MAX] * 4, config)
    best = optimal_k(alpha, c, k_max=K_MAX)
    # Equal, or a tie in walltime improvement to rounding.
    assert k == best or expected_walltime_improvement(alpha, k, c) == pytest.approx(expected_walltime_improvement(alpha, best, c))


def test_never_chooses_a_k_worse_than_plain_decoding():
    # Verification cost grows steeply with K at large batch (a compute-bound target).
    costs = StepCosts((1, 64), ((0.01,) * (K_MAX + 1), tuple(0.05 * (k + 1) for k in range(K_MAX + 1))), (0.003, 0.02))
    config = AdaptiveConfig(costs)
    assert choose_k([0.9] * 64, [K_MAX] * 64, config) == 0  # at batch 64 only plain decoding pays
    assert choose_k([0.9], [K_MAX], config) > 0  # at batch 1 speculation pays
    for B in (1, 2, 8, 32, 64):
        for a in (0.0, 0.3, 0.6, 0.9):
            k = choose_k([a] * B, [K_MAX] * B, config)
            goodput = B * expected_tokens_per_step(a, k) / step_seconds(costs, B, k, False)
            assert goodput >= B / step_seconds(costs, B, 0, False)


def test_low_acceptance_turns_speculation_off():
    config = AdaptiveConfig(flat_costs(0.5))
    assert choose_k([0.2] * 8, [K_MAX] * 8, config) == 0
    assert choose_k([0.95] * 8, [K_MAX] * 8, config) > 0


def test_budgets_cap_k_and_overlap_makes_drafting_cheaper():
    config = AdaptiveConfig(flat_costs(0.4))
    assert choose_k([0.9, 0.9], [2, 1], config) <= 2
    assert choose_k([0.9], [0], config) == 0
    serial = choose_k([0.8] * 4, [K_MAX] * 4, config)
    overlapped = choose_k([0.8] * 4, [K_MAX] * 4, AdaptiveConfig(flat_costs(0.4), overlapped=True))
    assert overlapped >= serial


def test_row_alpha_moves_from_prior_to_history():
    s = SpecDecodeStats(4)
    assert row_alpha(s, 0.5, 4.0) == 0.5
    for _ in range(100):
        s.observe(4, 4, [0.95] * 4)
    assert row_alpha(s, 0.5, 4.0) == pytest.approx(0.95, abs=0.01)


def test_new_rows_start_from_the_pooled_acceptance():
    """After a weak drafter has shown itself on earlier rows, a new row does not pay to find out
    again; its own evidence still moves it away from the pool."""
    ctl = KController(AdaptiveConfig(flat_costs(0.2)))
    fresh = SpecDecodeStats(K_MAX)
    assert ctl.prior == 0.5 and ctl.choose_k([fresh], [K_MAX]) > 0  # the fixed prior: worth a try
    for _ in range(50):  # earlier rows: almost nothing accepted
        ctl.observe([0.05])
    assert ctl.prior == pytest.approx((50 * 0.05 + 0.5 * 4) / 54)
    assert ctl.choose_k([SpecDecodeStats(K_MAX)], [K_MAX]) == 0  # a new row starts off
    good = SpecDecodeStats(K_MAX)
    for _ in range(20):
        good.observe(4, 4, [0.97] * 4)
    assert ctl.choose_k([good], [K_MAX]) > 0  # its own history wins over the pool


def test_step_costs_interpolate_and_validate():
    costs = StepCosts((1, 9), ((1.0, 2.0), (3.0, 6.0)), (0.1, 0.5))
    assert costs.target(5, 1) == pytest.approx(4.0)
    assert costs.target(1, 0) == 1.0 and costs.draft(9) == 0.5
    assert costs.target(17, 0) == pytest.approx(5.0)  # linear beyond the last point
    with pytest.raises(ValueError):
        StepCosts((4, 1), ((1.0,), (1.0,)), (0.0, 0.0))
    with pytest.raises(ValueError):
        StepCosts((1,), ((1.0, 2.0),), (0.1, 0.2))


def test_num_micro_batches_follows_the_step_costs():
    # Memory-bound (a step costs the same at 4 and 8 rows): halving the batch doubles the
    # target's work per token; a model-free draft (free) has nothing to overlap.
    flat = StepCosts((4, 8), ((1.0, 1.0), (1.0, 1.0)), (0.0, 0.0))
    assert num_micro_batches(flat, 8, 1) == 1
    flat_costly_draft = StepCosts((4, 8), ((1.0, 1.0), (1.0, 1.0)), (0.9, 0.9))
    assert num_micro_batches(flat_costly_draft, 8, 1) == 1  # 2 max(1, 0.9) = 2.0 > 1 + 0.9
    # Compute-bound (cost proportional to rows) with a costly draft: overlap hides the draft.
    linear = StepCosts((4, 8), ((1.0, 1.0, 1.0), (2.0, 2.0, 2.0)), (0.4, 0.8))
    assert num_micro_batches(linear, 8, 2) == 2  # 2 max(1, 0.8) = 2.0 < 2 + 1.6
    assert num_micro_batches(linear, 8, 0) == 1  # no drafts: nothing to overlap (2.0 is not < 2.0)
    assert num_micro_batches(linear, 1, 2) == 1  # one row cannot be split


# ---------------------------------------------------------------- through the engine

from raysd.core.sampling import SamplingParams
from raysd.engine.drafters import DraftModelDrafter, NgramDrafter
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.rows import Request
from tests.conftest import EOS, VOCAB, tiny_model
from tests.engine.test_equivalence import hf_greedy, prompts


@pytest.mark.parametrize("c", [0.05, 5.0])  # speculation pays / never pays
def test_auto_k_keeps_greedy_output_identical(c):
    target = tiny_model("llama")
    ps = prompts()
    expected = [hf_greedy(target, p, 20) for p in ps]
    config = EngineConfig(num_speculative_tokens=K_MAX, max_batch_size=8, eos_token_ids=(EOS,), adaptive=AdaptiveConfig(flat_costs(c)))
    for drafter in (DraftModelDrafter(target, VOCAB), NgramDrafter(VOCAB)):
        results = SpecEngine(target, drafter, config).generate([Request(i, p, SamplingParams(max_new_tokens=20)) for i, p in enumerate(ps)])
        assert [r.token_ids for r in results] == expected
        for r in results:
            s = r.stats
            assert s.mean_speculation_length is not None and 0 <= s.mean_speculation_length <= K_MAX
            if c > 1:  # drafting costs more than a target step: plain decoding every step
                assert s.num_steps_without_drafts == s.num_spec_steps and s.num_draft_tokens == 0


def test_auto_k_drafts_long_when_the_draft_is_the_target():
    target = tiny_model("llama")
    config = EngineConfig(num_speculative_tokens=K_MAX, max_batch_size=4, eos_token_ids=(EOS,), adaptive=AdaptiveConfig(flat_costs(0.05)))
    results = SpecEngine(target, DraftModelDrafter(target, VOCAB), config).generate(
        [Request(i, p, SamplingParams(max_new_tokens=27, ignore_eos=True)) for i, p in enumerate(prompts()[:4])])
    for r in results:
        assert r.stats.draft_acceptance_rate == 1.0
        assert r.stats.mean_speculation_length > 4  # the controller learns alpha = 1 and drafts long


def test_profiled_costs_are_usable():
    from raysd.engine.adaptive import profile_step_costs

    target = tiny_model("llama")
    costs = profile_step_costs(target, tiny_model("llama", seed=1, layers=1), k_max=3, batch_sizes=(1, 4), context=16, reps=1)
    assert costs.k_max == 3 and all(t > 0 for row in costs.target_s for t in row) and all(t > 0 for t in costs.draft_s)
