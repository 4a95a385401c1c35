"""The speculation-length controller: it maximises expected goodput, agrees with the
theory's optimal K where the theory's assumptions hold, and falls back to plain
decoding when speculation does not pay."""

from __future__ import annotations

import math

import numpy as np
import pytest

from raysd.core.speculation import AdaptiveConfig, StepCosts
from raysd.core.theory import expected_tokens_per_step, expected_walltime_improvement, optimal_k
from raysd.engine.adaptive import KController, choose_k, step_seconds

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


def test_new_rows_start_from_the_pooled_acceptance_and_their_own_evidence_moves_them():
    """A row's alpha is its own evidence shrunk towards the pool's: after a weak drafter has shown
    itself on earlier rows, a new row does not pay to find out again; its own evidence still
    moves it away from the pool."""
    ctl = KController(AdaptiveConfig(flat_costs(0.2)))
    assert ctl.prior == 0.5 and ctl.choose_k_from([0.0], [0], [K_MAX]) > 0  # the fixed prior: worth a try
    for _ in range(50):  # earlier rows: almost nothing accepted
        ctl.observe_all(0.05, 1)
    assert ctl.prior == pytest.approx((50 * 0.05 + 0.5 * 4) / 54)
    assert ctl.choose_k_from([0.0], [0], [K_MAX]) == 0  # a new row starts off
    assert ctl.choose_k_from([20 * 4 * 0.97], [20 * 4], [K_MAX]) > 0  # its own history wins over the pool


def test_step_costs_interpolate_and_validate():
    costs = StepCosts((1, 9), ((1.0, 2.0), (3.0, 6.0)), (0.1, 0.5))
    assert costs.target(5, 1) == pytest.approx(4.0)
    assert costs.target(1, 0) == 1.0 and costs.draft(9) == 0.5
    assert costs.target(17, 0) == pytest.approx(5.0)  # linear beyond the last point
    with pytest.raises(ValueError):
        StepCosts((4, 1), ((1.0,), (1.0,)), (0.0, 0.0))
    with pytest.raises(ValueError):
        StepCosts((1,), ((1.0, 2.0),), (0.1, 0.2))


# ---------------------------------------------------------------- through the engine

from raysd.core.sampling import SamplingParams
from raysd.core.speculation import SpeculationConfig
from raysd.engine.drafters import DraftModelDrafter, NgramDrafter
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.requests import Request
from tests.conftest import EOS, VOCAB, tiny_model
from tests.engine.test_equivalence import hf_greedy, prompts


@pytest.mark.parametrize("c", [0.05, 5.0])  # speculation pays / never pays
def test_auto_k_keeps_greedy_output_identical(c):
    target = tiny_model("llama")
    ps = prompts()
    expected = [hf_greedy(target, p, 20) for p in ps]
    speculation = SpeculationConfig(num_speculative_tokens=K_MAX, eos_token_ids=(EOS,),
                                    adaptive=AdaptiveConfig(flat_costs(c)))
    config = EngineConfig(speculation, max_batch_size=8)
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
    speculation = SpeculationConfig(num_speculative_tokens=K_MAX, eos_token_ids=(EOS,),
                                    adaptive=AdaptiveConfig(flat_costs(0.05)))
    config = EngineConfig(speculation, max_batch_size=4)
    results = SpecEngine(target, DraftModelDrafter(target, VOCAB), config).generate(
        [Request(i, p, SamplingParams(max_new_tokens=27, ignore_eos=True)) for i, p in enumerate(prompts()[:4])])
    for r in results:
        assert r.stats.draft_acceptance_rate == 1.0
        assert r.stats.mean_speculation_length > 4  # the controller learns alpha = 1 and drafts long


def test_profiled_costs_are_usable():
    from raysd.models.profile import profile_step_costs

    target = tiny_model("llama")
    costs = profile_step_costs(target, tiny_model("llama", seed=1, layers=1), k_max=3, batch_sizes=(1, 4), context=16, reps=1)
    assert costs.k_max == 3 and all(t > 0 for row in costs.target_s for t in row) and all(t > 0 for t in costs.draft_s)


# ---------------------------------------------------------------- costs learned as the job runs


def test_learned_costs_estimate_from_what_was_timed():
    from raysd.engine.adaptive import LearnedStepCosts

    costs = LearnedStepCosts(k_max=8, decay=1.0)
    assert not costs.knows(8) and costs.target(8, 3) == 1.0 and costs.draft(8) == 0.0  # nothing timed: all equal
    costs.observe(8, width=1, verify_s=0.010)  # a plain step of 8 rows (bucket 8)
    assert costs.knows(5) and costs.knows(8) and not costs.knows(9)  # buckets: powers of two
    assert costs.target(8, 0) == 0.010 and costs.target(8, 1) == 0.010  # twice as wide: optimistic until timed
    assert costs.target(8, 2) == math.inf  # over twice the widest timed width: not guessed
    costs.observe(7, width=5, verify_s=0.030, draft_forward_s=0.002)
    assert costs.target(8, 4) == 0.030 and costs.target(8, 2) == pytest.approx(0.020)  # interpolated
    assert costs.target(8, 8) == pytest.approx(0.050) and costs.draft(8) == 0.002  # the line through widths 1 and 5
    assert costs.target(8, 10) == math.inf  # width 11 > 2 x 5
    assert costs.target(32, 4) == 0.030 and costs.draft(1) == 0.002  # the nearest timed bucket
    costs.observe(8, width=1, verify_s=0.020)
    assert costs.target(8, 0) == 0.020  # decay 1: the latest step


def test_learned_costs_replace_a_cold_first_timing_and_retime_plain_steps():
    """A shape's first timing pays one-time work: its second replaces it. T_target(B, 1), against which
    every plan is weighed, is re-timed after 8, 16, 32, .. drafting steps (`wants_plain`)."""
    from raysd.engine.adaptive import FIRST_REPLAIN, LearnedStepCosts

    costs = LearnedStepCosts(k_max=4)  # decay 0.25
    assert costs.wants_plain(8)
    costs.observe(8, width=1, verify_s=0.100)  # cold
    costs.observe(8, width=1, verify_s=0.070)
    assert costs.target(8, 0) == 0.070 and not costs.wants_plain(8)
    costs.observe(8, width=1, verify_s=0.080)
    assert costs.target(8, 0) == pytest.approx(0.0725)  # from the third on, a running mean
    gaps = []
    for _ in range(3):
        n = 0
        while not costs.wants_plain(8):
            costs.observe(8, width=3, verify_s=0.1)
            n += 1
        gaps.append(n)
        costs.observe(8, width=1, verify_s=0.07)
    assert gaps == [FIRST_REPLAIN, 2 * FIRST_REPLAIN, 4 * FIRST_REPLAIN]
    assert costs.wants_plain(2)  # each bucket its own: none timed at batch 2 yet


def test_a_learning_controller_starts_plain_explores_once_then_decides_on_measured_costs():
    """No profile: the first step at a batch size is plain decoding (it times T_target(B, 1));
    drafting is then tried where it might pay, and kept only if the timed steps say it does."""
    ctl = KController(AdaptiveConfig(prior_alpha=0.6), depth=4)
    evidence = ([0.0] * 4, [0] * 4, [4] * 4)
    assert ctl.choose_plan_from(*evidence) == (0, 0)  # the safe start
    ctl.observe_step(4, 1, 0, verify_s=0.010, draft_s=0.0)
    k, _ = ctl.choose_plan_from(*evidence)
    assert k == 1  # twice the widest timed width looks as cheap as a plain step until timed: it is tried
    ctl.observe_step(4, 2, 1, verify_s=0.100, draft_s=0.0)  # and it turns out 10x a plain step
    ctl.observe_all(4 * 0.6, 4)
    assert ctl.choose_plan_from(*evidence)[0] == 0  # drafting does not pay at these costs
    cheap = KController(AdaptiveConfig(prior_alpha=0.6), depth=4)
    cheap.observe_step(4, 1, 0, verify_s=0.010, draft_s=0.0)
    widths = []
    for _ in range(3):  # verifying is nearly free: each step drafts as wide as it may, doubling
        k = cheap.choose_plan_from(*evidence)[0]
        widths.append(k + 1)
        cheap.observe_step(4, k + 1, k, verify_s=0.010 + 0.0001 * k, draft_s=0.0)
    assert widths == [2, 4, 5]  # 5: the depth K = 4 caps it


def test_learned_costs_keep_greedy_output_identical():
    """-k auto with no profile, through the engine: whatever K the timed steps choose, greedy
    output is the target's own."""
    target = tiny_model("llama")
    ps = prompts()
    speculation = SpeculationConfig(num_speculative_tokens=K_MAX, eos_token_ids=(EOS,), adaptive=AdaptiveConfig())
    for drafter in (DraftModelDrafter(tiny_model("llama", seed=3, layers=1), VOCAB), NgramDrafter(VOCAB)):
        engine = SpecEngine(target, drafter, EngineConfig(speculation, max_batch_size=8))
        results = engine.generate([Request(i, p, SamplingParams(max_new_tokens=20)) for i, p in enumerate(ps)])
        assert [r.token_ids for r in results] == [hf_greedy(target, p, 20) for p in ps]
        assert engine.k_controller.chosen[(0, 0)] >= 1  # it started plain


def test_a_drafters_own_confidence_chooses_k_and_is_calibrated_by_the_verdicts():
    """choose_k_by_confidence: E_b(k) = 1 + c sum_{i < k} confidence[b, i] tokens per row against the
    step's cost; confident drafts are drafted long, unconfident ones not at all, and a drafter whose
    confidence the verdicts do not bear out (c falls) is trusted less."""
    costs = StepCosts((1, 8), ((1.0, 1.1, 1.2, 1.3, 1.4),) * 2, (0.0, 0.0))  # each extra token costs 10%
    ctl = KController(AdaptiveConfig(costs), depth=4)
    sure = np.array([[0.95, 0.9, 0.85, 0.8]] * 4)  # [B, K]
    unsure = np.array([[0.05, 0.01, 0.0, 0.0]] * 4)
    assert ctl.choose_k_by_confidence(sure, [4] * 4) == 4
    assert ctl.choose_k_by_confidence(unsure, [4] * 4) == 0
    assert ctl.choose_k_by_confidence(sure, [1] * 4) == 1  # capped by the rows' room
    assert ctl.calibration == 1.0
    for _ in range(20):  # steps whose confident drafts were all rejected
        ctl.choose_k_by_confidence(sure, [4] * 4)
        ctl.observe_all(0.0, 4, accepted=0)
    assert ctl.calibration < 0.1
    assert ctl.choose_k_by_confidence(sure, [4] * 4) == 0


def test_an_estimate_that_chooses_plain_decoding_rests_as_long_as_it_costs():
    """KController.resting: an estimate of the drafter's confidence that chose K = 0 and cost over
    REST_ABOVE of a plain step skips the next steps, as many as bring it to REST_ABOVE of the steps it
    covers (at most MAX_REST); one that costs less, or one that chose to draft, never rests."""
    from raysd.engine.adaptive import MAX_REST, REST_ABOVE

    costs = StepCosts((1, 8), ((1.0, 1.5, 2.0),) * 2, (0.0, 0.0))  # 1 s a plain step
    unsure = np.array([[0.05, 0.01]] * 4)  # [B, K]
    sure = np.array([[0.95, 0.9]] * 4)
    ctl = KController(AdaptiveConfig(costs), depth=2)

    def rests() -> int:
        n = 0
        while ctl.resting():
            n += 1
        return n

    assert ctl.choose_k_by_confidence(unsure, [2] * 4, estimate_s=0.5 * REST_ABOVE) == 0 and rests() == 0
    assert ctl.choose_k_by_confidence(unsure, [2] * 4, estimate_s=3 * REST_ABOVE) == 0 and rests() == 2
    assert ctl.choose_k_by_confidence(unsure, [2] * 4, estimate_s=2.5 * REST_ABOVE) == 0 and rests() == 2
    assert ctl.choose_k_by_confidence(unsure, [2] * 4, estimate_s=100 * REST_ABOVE) == 0 and rests() == MAX_REST
    assert ctl.choose_k_by_confidence(sure, [2] * 4, estimate_s=3 * REST_ABOVE) == 2 and rests() == 0
    assert ctl.chosen[(0, 0)] == 4 + 2 + 2 + MAX_REST  # a rested step counts as a plain one

def _guarded_steps(tokens_per_row: float, estimate_s: float, steps: int) -> tuple[list[int], KController]:
    """A controller with costs learned from the steps, every width timed at a plain step's 1 s, so
    its cost model wants K = 4 for confident rows (batch 4). Drafting steps emit `tokens_per_row`
    and cost the drafter's estimate `estimate_s` on top, which the cost model does not see: the
    steps realise tokens_per_row / (1 + estimate_s) per row per second, plain steps 1."""
    ctl = KController(AdaptiveConfig(), depth=4)  # no profile: costs learned
    for width in range(1, 6):
        ctl.observe_step(4, width, width - 1, verify_s=1.0, draft_s=0.0)
    sure = np.array([[0.95, 0.9, 0.85, 0.8]] * 4)  # [B, K]
    chosen = []
    for _ in range(steps):
        k = ctl.choose_k_by_confidence(sure, [4] * 4, estimate_s=estimate_s)
        chosen.append(k)
        if k:
            ctl.observe_step(4, k + 1, k, verify_s=1.0, draft_s=0.0, tokens=round(4 * tokens_per_row))
        else:
            ctl.observe_step(4, 1, 0, verify_s=1.0, draft_s=0.0, tokens=4)
    return chosen, ctl


def test_drafting_that_realises_less_than_plain_decoding_is_paused_and_retried():
    """_RealisedGuard: the learned costs say K = 4 pays, but drafting steps realise 2 tokens per row
    in 3 s against plain decoding's 1 in 1 s. Each try of GUARD_STEPS drafting steps is followed by
    a pause twice as long as the last (FIRST_PAUSE, 2 FIRST_PAUSE, ..): drafting is retried, and
    the steps it loses are few."""
    from raysd.engine.adaptive import FIRST_PAUSE, GUARD_STEPS

    chosen, ctl = _guarded_steps(2.0, 2.0, 250)
    drafting = sum(k > 0 for k in chosen)
    assert ctl.guard.paused_steps >= FIRST_PAUSE * (1 + 2 + 4 + 8)  # four pauses at least, doubling
    assert ctl.guard.next_pause[4] >= 16 * FIRST_PAUSE
    assert GUARD_STEPS < drafting <= 6 * GUARD_STEPS  # retried after each pause, a try at a time
    runs = [len(r) for r in "".join("d" if k else "." for k in chosen).split(".") if r]
    assert max(runs) <= GUARD_STEPS  # never more than one try of drafting in a row


def test_drafting_that_realises_more_than_plain_decoding_is_never_paused():
    chosen, ctl = _guarded_steps(3.0, 0.01, 100)  # ~3 tokens per row per second against plain's 1
    assert ctl.guard.paused_steps == 0
    assert sum(k > 0 for k in chosen) >= 90  # plain only to re-time plain steps


def test_a_measured_profile_is_not_second_guessed():
    """With a measured profile the plans are a function of the rows' evidence alone (no guard):
    reproducible, as the actors-against-engine statistics tests need."""
    costs = StepCosts((4,), ((1.0, 1.0, 1.0, 1.0, 1.0),), (0.0,))
    ctl = KController(AdaptiveConfig(costs), depth=4)
    assert ctl.guard is None
    sure = np.array([[0.95, 0.9, 0.85, 0.8]] * 4)
    for _ in range(20):
        assert ctl.choose_k_by_confidence(sure, [4] * 4, estimate_s=2.0) == 4
        ctl.observe_step(4, 5, 4, verify_s=1.0, draft_s=0.0, tokens=8)


def test_a_plain_run_is_as_long_as_the_controller_would_keep_planning_plain_steps():
    """KController.plain_run, after a plan of K = 0: the whole cap when plain decoding had the best
    goodput (nothing new is learned in the run, and the rows' room only shrinks); one step when it
    timed plain decoding (the next plan weighs it); the pause's steps left when the guard refused."""
    from raysd.engine.adaptive import FIRST_PAUSE, GUARD_STEPS

    costs = StepCosts((4,), ((1.0, 1.05, 1.1, 1.15, 1.2),), (0.05,))
    ctl = KController(AdaptiveConfig(costs, prior_alpha=0.05), depth=4)
    weak = ([0.0] * 4, [0] * 4, [4] * 4)
    assert ctl.choose_plan_from(*weak) == (0, 0)
    assert ctl.plain_run(4, 8).steps == 8 and ctl.plain_run(4, 1).steps == 1
    assert ctl.chosen[(0, 0)] == 1 + 7
    ctl.end_plain_run(ctl.plain_run(4, 8), ran=3)  # a row retired at the run's third step
    assert ctl.chosen[(0, 0)] == 1 + 7 + 2
    assert ctl.choose_plan_from([3.8] * 4, [4] * 4, [4] * 4)[0] > 0  # rows that accept: drafting pays
    learning = KController(AdaptiveConfig(prior_alpha=0.6), depth=4)  # no profile: the first step times plain decoding
    assert learning.choose_plan_from(*weak) == (0, 0) and learning.plain_run(4, 8).steps == 1
    # The guard: costs learned, drafting looks free but realises less than plain decoding's rate
    # (an estimate too cheap to rest after).
    chosen, guarded = _guarded_steps(1.0, 0.005, GUARD_STEPS + 2)
    assert chosen[GUARD_STEPS:] == [0, 0]
    left = guarded.guard.pause[4]  # refused steps left of the first pause
    assert 3 < left < FIRST_PAUSE
    paused = guarded.guard.paused_steps
    run = guarded.plain_run(4, 4)
    assert run.steps == 4 and guarded.guard.pause[4] == left - 3 and guarded.guard.paused_steps == paused + 3
    guarded.end_plain_run(run, ran=2)  # a row retired at its second step: two steps given back
    assert guarded.guard.pause[4] == left - 1 and guarded.guard.paused_steps == paused + 1
    assert guarded.plain_run(4, 100).steps == left and guarded.guard.pause[4] == 0


def test_learned_costs_with_the_devices_crossover_size_k_to_the_batch():
    """With the device's crossover (tokens per forward past which it is compute-bound) a verify width
    not yet timed costs the roofline's: flat while B (K + 1) tokens stay under it, growing past it. At
    8 rows K = 4 pays (40 tokens), at 64 rows (320 tokens, 1.6x a plain step) K = 2 is the best; a
    controller restricted to the captured lengths chooses among them."""
    from raysd.core.speculation import AdaptiveConfig
    from raysd.engine.adaptive import LearnedStepCosts, choose_k

    costs = LearnedStepCosts(4, crossover_tokens=200)
    for B in (8, 64):
        costs.observe(B, 1, 0.010)  # a plain step: 10 ms, memory-bound
    assert costs.target(8, 4) == pytest.approx(0.010) and costs.target(64, 4) == pytest.approx(0.016)
    config = AdaptiveConfig()
    assert choose_k([0.6] * 8, [4] * 8, config, costs) == 4
    assert choose_k([0.6] * 64, [4] * 64, config, costs) == 2
    assert choose_k([0.6] * 8, [4] * 8, config, costs, ks=(1, 3)) == 3
    costs.observe(64, 5, 0.012)  # timed: the measurement wins over the model
    assert costs.target(64, 4) == pytest.approx(0.012) and costs.target(64, 3) == pytest.approx(0.012)
    plain_only = LearnedStepCosts(4)
    plain_only.observe(64, 1, 0.010)
    assert plain_only.target(64, 4) == math.inf  # without it: untried widths past double the widest
