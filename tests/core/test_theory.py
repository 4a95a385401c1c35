"""Tests for raysd.core.theory: hand values, paper tables, limits, Monte-Carlo, validation."""
import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from scipy import stats

from raysd.core import theory as th

ALPHAS = [0.0, 0.05, 0.3, 0.5, 0.62, 0.8, 0.95, 0.999, 1.0]
KS = [0, 1, 2, 4, 7, 16]


# ---------------------------------------------------------------- hand values and paper tables


def test_hand_values():
    assert th.expected_tokens_per_step(0.8, 4) == pytest.approx((1 - 0.8**5) / 0.2)
    assert th.expected_tokens_per_step(0.8, 4) == pytest.approx(3.3616)
    assert th.expected_walltime_improvement(0.8, 4, 0.1) == pytest.approx(3.3616 / 1.4)
    # Theorem 3.11 with c_hat = 0.1: 0.2 * (0.4 + 4 + 1) / (1 - 0.8^5)
    assert th.expected_arithmetic_overhead(0.8, 4, 0.1) == pytest.approx(0.2 * 5.4 / (1 - 0.8**5))
    assert th.expected_extra_tokens(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert th.throughput_tokens_per_s(0.5, 3, 0.01, 0.05) == pytest.approx(1.875 / 0.08)
    assert th.alpha_from_tv(0.25) == 0.75


@pytest.mark.parametrize(
    "alpha, k, ops, speed",  # Leviathan et al. 2023 Table 1 (c = c_hat = 0)
    [(0.6, 2, 1.53, 1.96), (0.7, 3, 1.58, 2.53), (0.8, 2, 1.23, 2.44),
     (0.8, 5, 1.63, 3.69), (0.9, 2, 1.11, 2.71), (0.9, 10, 1.60, 6.86)],
)
def test_leviathan_table1(alpha, k, ops, speed):
    assert th.expected_arithmetic_overhead(alpha, k, 0.0) == pytest.approx(ops, abs=0.0051)
    assert th.expected_walltime_improvement(alpha, k, 0.0) == pytest.approx(speed, abs=0.0051)


@pytest.mark.parametrize(
    "alpha, c, k_star, speed",  # the optimum of Leviathan et al. 2023 Theorem 3.8 over gamma in 1..40
    [(0.5, 0.01, 5, 1.88), (0.6, 0.05, 4, 1.92), (0.7, 0.1, 4, 1.98),
     (0.8, 0.05, 8, 3.09), (0.8, 0.2, 4, 1.87), (0.9, 0.01, 24, 7.49), (0.9, 0.1, 10, 3.43)],
)
def test_optimal_k_table(alpha, c, k_star, speed):
    k = th.optimal_k(alpha, c, k_max=40)
    assert k == k_star
    assert th.expected_walltime_improvement(alpha, k, c) == pytest.approx(speed, abs=0.0051)


def test_leviathan_table4_prediction():
    # T5-small EnDe, t=0: alpha=0.75, c=0.02, gamma=7 -> Exp 3.2
    assert round(th.expected_walltime_improvement(0.75, 7, 0.02), 1) == 3.2


def test_overlap_examples():
    # A memory-bound target (T(B,K+1) == T(B,1)), c = T_d/T_t.
    e = th.expected_tokens_per_step(0.8, 20)
    assert th.overlapped_speedup(e, 1.0, 1.0, 0.05, 20) == pytest.approx(4.95, abs=0.005)
    e = th.expected_tokens_per_step(0.7, 10)
    assert th.overlapped_speedup(e, 1.0, 1.0, 0.1, 10) == pytest.approx(3.27, abs=0.005)


def test_serial_matches_theorem_38_when_verification_is_free():
    e = th.expected_tokens_per_step(0.8, 4)
    assert th.serial_speedup(e, 0.02, 0.02, 0.002, 4) == pytest.approx(
        th.expected_walltime_improvement(0.8, 4, 0.1))


# ---------------------------------------------------------------- limits and identities


@pytest.mark.parametrize("k", KS)
def test_limits(k):
    assert th.expected_tokens_per_step(0.0, k) == 1.0
    assert th.expected_tokens_per_step(1.0, k) == k + 1
    assert th.expected_tokens_per_step(1.0 - 1e-13, k) == pytest.approx(k + 1, rel=1e-9)
    assert th.expected_walltime_improvement(1.0, k, 0.5) == pytest.approx((k + 1) / (0.5 * k + 1))
    assert th.expected_extra_tokens(1.0, k) == k
    assert th.expected_extra_tokens_closed_form(1.0, k) == k
    assert th.expected_extra_tokens_closed_form(0.0, k) == 0.0


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("k", KS)
def test_recursion_closed_form_pmf_agree(alpha, k):
    e_rec = th.expected_extra_tokens(alpha, k)
    assert th.expected_extra_tokens_closed_form(alpha, k) == pytest.approx(e_rec, rel=1e-12, abs=1e-15)
    assert e_rec + 1 == pytest.approx(th.expected_tokens_per_step(alpha, k), rel=1e-12)
    pmf = th.truncated_geometric_pmf(alpha, k)
    assert pmf.shape == (k + 1,) and np.all(pmf >= 0)
    assert pmf.sum() == pytest.approx(1.0, abs=1e-12)
    mean = (np.arange(k + 1) * pmf).sum()
    assert mean + 1 == pytest.approx(th.expected_tokens_per_step(alpha, k), rel=1e-12)


def test_speculation_helps_iff_optimal_k_positive():
    grid = np.round(np.linspace(0.0, 1.0, 41), 6)
    costs = np.concatenate([grid, [1.5, 3.0]])
    for a in grid:
        for c in costs:
            assert th.speculation_helps(a, c) == (th.optimal_k(a, c) > 0), (a, c)
    assert th.optimal_k(0.5, 0.5) == 0 and not th.speculation_helps(0.5, 0.5)
    assert th.optimal_k(1.0, 0.0, k_max=12) == 12


# 300 examples, or more under an exploring profile (tests/conftest.py: --hypothesis-profile=explore).
@settings(max_examples=max(300, settings().max_examples), deadline=None, database=None)
@given(a=st.floats(0, 1), c=st.floats(0, 2), k=st.integers(0, 64),
       t1=st.floats(1e-4, 1.0), ratio=st.floats(1.0, 70.0), td=st.floats(0, 0.5))
@example(a=0.75, c=0.0, k=0, t1=1e-4, ratio=1.0, td=0.0)  # E computes 0.9999999999999999 unclamped
@example(a=0.6, c=0.0, k=0, t1=1e-4, ratio=1.0, td=0.0)
@example(a=1.0 - 2.0**-53, c=0.0, k=64, t1=1.0, ratio=70.0, td=0.5)
@example(a=5e-324, c=2.0, k=1, t1=1e-4, ratio=1.0, td=0.0)
def test_properties(a, c, k, t1, ratio, td):
    e = th.expected_tokens_per_step(a, k)
    assert 1.0 - 1e-12 <= e <= k + 1 + 1e-9
    if a < 1:
        assert e <= 1 / (1 - a) * (1 + 1e-12)  # c -> 0 ceiling, Leviathan §3.5
    assert th.expected_tokens_per_step(a, k + 1) >= e - 1e-12
    assert th.expected_arithmetic_overhead(a, k, c) >= 1 - 1e-9  # never fewer operations
    s = th.serial_speedup(e, t1, t1 * ratio, td, k)
    assert th.overlapped_speedup(e, t1, t1 * ratio, td, k) >= s * (1 - 1e-12)
    assert th.overlapped_speedup(e, t1, t1 * ratio, td, k, t_comm=0.01) >= th.serial_speedup(
        e, t1, t1 * ratio, td, k, t_comm=0.01) * (1 - 1e-12)


# ---------------------------------------------------------------- bounds under rounding


def test_expected_tokens_at_k0_is_exactly_one():
    """At K = 0, E is exactly 1 whatever alpha (unclamped, alpha = 0.75 computes 0.9999999999999999),
    and the speed-ups accept it."""
    for a in (0.75, 0.6, 0.9, 1.0 - 2.0**-53):
        e = th.expected_tokens_per_step(a, 0)
        assert e == 1.0
        assert th.serial_speedup(e, 1e-4, 1e-4, 0.0, 0) == 1.0
        assert th.overlapped_speedup(e, 1e-4, 1e-4, 0.0, 0) == 1.0
        assert th.expected_walltime_improvement(a, 0, 0.0) == 1.0


def test_every_result_lies_in_its_bounds_and_is_accepted_back():
    """A dense grid (seeded) of alpha, including the dyadic values whose 1 - alpha is exact, and
    every K up to 64: each result lies exactly in its bounds and the cost models accept it."""
    rng = np.random.default_rng(21)
    alphas = np.concatenate([rng.random(400), [1 - 2.0**-i for i in range(1, 54)], [2.0**-i for i in range(1, 60)],
                             [0.75, 0.6, 0.3, 0.1, 0.7, 0.9, 0.95, 0.999, 5e-324]])
    for a in alphas.tolist():
        for k in range(65):
            e = th.expected_tokens_per_step(a, k)
            assert 1.0 <= e <= k + 1, (a, k, e)
            assert 0.0 <= th.expected_extra_tokens_closed_form(a, k) <= k
            assert 0.0 <= th.expected_extra_tokens(a, k) <= k
            assert th.serial_speedup(e, 1e-3, 2e-3, 1e-4, k) <= th.overlapped_speedup(e, 1e-3, 2e-3, 1e-4, k)
            assert th.expected_arithmetic_overhead(a, k, 0.0) >= 1.0 - 1e-12
        tv = 1.0 - a
        assert th.alpha_from_tv(th.alpha_from_tv(tv)) == pytest.approx(tv, abs=1e-15)
        assert th.pareto_front_tv_loss(tv, tv) == 0.0


@pytest.mark.parametrize("inside", [0.0, 0.5])
def test_bound_tolerance_accepts_rounding_and_clamps(inside):
    tol = th.BOUND_TOL
    off = inside * tol  # 0: exactly at the bound; 0.5: past it by half the tolerance
    assert th.expected_tokens_per_step(1.0 + off, 3) == 4.0
    assert th.expected_tokens_per_step(-off, 3) == 1.0
    assert th.alpha_from_tv(1.0 + off) == 0.0
    assert th.serial_speedup(1.0 - off, 1.0, 1.0, 0.0, 2) == 1.0
    assert th.expected_rejections([1.0 + off, -off]) == 1.0
    assert th.pareto_front_tv_loss(0.3 + off, 0.3) == 0.0
    assert th.speed_of_light_bound(2.0, 4.0 * (1 - off), 8) == th.speed_of_light_bound(2.0, 4.0, 8)


def test_bound_tolerance_is_not_a_loophole():
    two = 2 * th.BOUND_TOL
    for call in (lambda: th.expected_tokens_per_step(1.0 + two, 3), lambda: th.expected_tokens_per_step(-two, 3),
                 lambda: th.serial_speedup(1.0 - two, 1.0, 1.0, 0.0, 2), lambda: th.expected_rejections([1.0 + two]),
                 lambda: th.pareto_front_tv_loss(0.3 + two, 0.3),
                 lambda: th.speed_of_light_bound(2.0, 4.0 * (1 - two), 8)):
        with pytest.raises(ValueError):
            call()
    with pytest.raises(ValueError):  # times get no tolerance
        th.serial_speedup(2.0, 1.0, 1.0, -1e-12, 2)


def test_float32_acceptance_rate_is_accepted():
    """raysd's alpha is a float32 sum of min(target_probs, draft_probs) over the vocabulary; where the
    two are equal it may exceed 1 by rounding, within BOUND_TOL at a 151,936-token vocabulary. The
    theory takes it as alpha = 1."""
    import torch

    from raysd.core.rejection import draft_target_overlap

    target_probs = torch.softmax(torch.randn(4, 3, 151_936, generator=torch.Generator().manual_seed(0)) * 3, -1)
    alpha = float(draft_target_overlap(target_probs[:, :2], target_probs).max())
    assert 1.0 <= alpha <= 1.0 + th.BOUND_TOL
    assert th.expected_tokens_per_step(alpha, 4) == 5.0


def test_unnormalised_rows_keep_jensen_for_the_speed_of_light_bound():
    """entropy_moments accepts rows summing to 1 within 1e-3; what it returns must be accepted by
    speed_of_light_bound (before renormalising, mu2 fell 1e-3 short of mu^2 on a uniform row)."""
    for scale in (1 - 9e-4, 1.0, 1 + 9e-4):
        for v in (2, 8, 1000):
            mu, mu2 = th.entropy_moments(np.full((3, v), scale / v))
            assert mu2 >= mu * mu * (1 - 1e-12)
            assert th.speed_of_light_bound(mu, mu2, 4) == pytest.approx(
                (math.log(v) + math.log(v) ** 2) * math.log(4) / math.log(v) ** 2)


# ---------------------------------------------------------------- Monte-Carlo (i.i.d. acceptance)


def _simulate_accepted(rng, alpha, k, n_steps):
    """Number of accepted drafts per step: length of the leading run of accepts among K."""
    accept = rng.random((n_steps, k)) < alpha
    return np.cumprod(accept, axis=1).sum(axis=1)


@pytest.mark.parametrize("alpha, k", [(0.3, 1), (0.5, 3), (0.8, 4), (0.9, 8), (0.62, 7)])
def test_monte_carlo_tokens_per_step(alpha, k):
    n = 200_000
    tokens = _simulate_accepted(np.random.default_rng(1234 + k), alpha, k, n) + 1
    se = tokens.std(ddof=1) / math.sqrt(n)
    # 5 standard errors of the mean of n draws: a false alarm has probability 6e-7 (normal limit).
    assert abs(tokens.mean() - th.expected_tokens_per_step(alpha, k)) <= 5 * se


@pytest.mark.parametrize("alpha, k", [(0.3, 2), (0.8, 4), (0.9, 8)])
def test_monte_carlo_pmf(alpha, k):
    n = 200_000
    counts = np.bincount(_simulate_accepted(np.random.default_rng(99 + k), alpha, k, n), minlength=k + 1)
    pmf = th.truncated_geometric_pmf(alpha, k)
    # per-bin binomial standard error sqrt(p(1-p)/n), 5 sigma each (6e-7 false alarm per bin),
    # and the chi-square goodness of fit at 1e-6
    assert np.all(np.abs(counts / n - pmf) <= 5 * np.sqrt(pmf * (1 - pmf) / n) + 1e-12)
    assert stats.chisquare(counts, n * pmf).pvalue > 1e-6


# ---------------------------------------------------------------- Yin et al. and speed-of-light


def test_yin_rejections_and_pareto_front():
    assert th.expected_rejections([0.1, 0.2, 0.0, 0.7]) == pytest.approx(1.0)
    assert th.expected_rejections([]) == 0.0
    assert th.pareto_front_tv_loss(0.3, 0.3) == 0.0  # lossless speculative decoding
    assert th.pareto_front_tv_loss(0.0, 0.3) == 0.3  # always accept the draft
    assert th.pareto_front_tv_loss(0.1, 0.3) == pytest.approx(0.2)


def test_entropy_moments():
    v = 8
    mu, mu2 = th.entropy_moments(np.full((3, v), 1 / v))
    assert mu == pytest.approx(math.log(v)) and mu2 == pytest.approx(math.log(v) ** 2)
    with np.errstate(all="raise"):  # log(0) must be guarded, no warnings
        assert th.entropy_moments(np.eye(4)) == (0.0, 0.0)
        mu, mu2 = th.entropy_moments(np.array([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]))
    assert mu == pytest.approx(math.log(2) / 2) and mu2 == pytest.approx(math.log(2) ** 2 / 2)
    probs = np.random.default_rng(0).dirichlet(np.ones(50), size=20)
    mu, mu2 = th.entropy_moments(probs)
    assert mu2 >= mu**2 and th.entropy_moments(probs[0]) == th.entropy_moments(probs[:1])


def test_speed_of_light_bound():
    assert th.speed_of_light_bound(1.0, 2.0, 8) == pytest.approx(3 * math.log(8))
    mu, mu2 = th.entropy_moments(np.full((1, 16), 1 / 16))
    b = [th.speed_of_light_bound(mu, mu2, p) for p in (2, 4, 16, 256)]
    assert all(x < y for x, y in zip(b, b[1:]))
    assert b[3] - b[2] == pytest.approx(b[2] - b[1] + b[2] - b[1])  # linear in log P


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("call", [
    lambda: th.expected_tokens_per_step(-0.1, 3),
    lambda: th.expected_tokens_per_step(1.1, 3),
    lambda: th.expected_tokens_per_step(float("nan"), 3),
    lambda: th.expected_tokens_per_step(0.5, -1),
    lambda: th.expected_tokens_per_step(0.5, 2.0),
    lambda: th.expected_tokens_per_step(0.5, True),
    lambda: th.expected_walltime_improvement(0.5, 2, -0.1),
    lambda: th.expected_arithmetic_overhead(0.5, 2, float("inf")),
    lambda: th.optimal_k(0.5, 0.1, k_max=-1),
    lambda: th.speculation_helps(0.5, -1.0),
    lambda: th.expected_extra_tokens(1.5, 2),
    lambda: th.throughput_tokens_per_s(0.5, 2, 0.01, 0.0),
    lambda: th.serial_speedup(0.5, 1.0, 1.0, 0.1, 2),
    lambda: th.serial_speedup(2.0, 0.0, 1.0, 0.1, 2),
    lambda: th.overlapped_speedup(2.0, 1.0, 1.0, -0.1, 2),
    lambda: th.overlapped_speedup(2.0, 1.0, 1.0, 0.1, 2, t_comm=-1.0),
    lambda: th.expected_rejections([0.1, 1.2]),
    lambda: th.expected_rejections([[0.1, 0.2]]),
    lambda: th.pareto_front_tv_loss(0.4, 0.3),
    lambda: th.speed_of_light_bound(0.0, 1.0, 8),
    lambda: th.speed_of_light_bound(1.0, 2.0, 1),
    lambda: th.speed_of_light_bound(2.0, 1.0, 8),
    lambda: th.entropy_moments(np.array([[0.5, 0.6]])),
    lambda: th.entropy_moments(np.array([[1.5, -0.5]])),
    lambda: th.entropy_moments(np.zeros((2, 2, 2))),
    lambda: th.truncated_geometric_pmf(0.5, -2),
    lambda: th.alpha_from_tv(2.0),
])
def test_validation_errors(call):
    with pytest.raises(ValueError):
        call()


@pytest.mark.parametrize("tv,lam", [(0.0, 0.5), (0.3, 0.0), (0.3, 0.25), (0.3, 1.0), (1.0, 0.7)])
def test_relaxed_rule_point_lies_on_the_front(tv, lam):
    reject, loss = th.relaxed_rule_point(tv, lam)
    assert reject == pytest.approx((1 - lam) * tv) and loss == pytest.approx(lam * tv)
    assert loss == pytest.approx(th.pareto_front_tv_loss(reject, tv))


def test_relaxed_rule_point_checks_its_arguments():
    for tv, lam in [(1.5, 0.1), (0.2, -0.1), (0.2, 1.1), (float("nan"), 0.5)]:
        with pytest.raises(ValueError):
            th.relaxed_rule_point(tv, lam)


def test_expected_tokens_batch_is_the_scalar_formula_summed_over_rows():
    """The controller's vectorised form (choose_k) against expected_tokens_per_step row by row:
    alphas at the ends (0, 1, 1 + 2e-5 clipped), rows whose budget caps K, an empty batch."""
    rng = np.random.default_rng(0)
    alphas = np.concatenate([[0.0, 1.0, 1.0 + 2e-5, 0.5, 1e-9, 1 - 1e-9], rng.uniform(0, 1, 58)])
    budgets = np.concatenate([[0, 3, 8, 1, 8, 8], rng.integers(0, 12, 58)])
    got = th.expected_tokens_batch(alphas, budgets, 8)
    for k in range(9):
        want = sum(th.expected_tokens_per_step(min(a, 1.0), min(k, int(b))) for a, b in zip(alphas, budgets))
        assert got[k] == pytest.approx(want, rel=1e-12)
    assert got[0] == len(alphas)  # K = 0: one token per row
    assert th.expected_tokens_batch([], [], 4).tolist() == [0.0] * 5
