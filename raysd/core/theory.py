"""Closed-form speculative-decoding theory: pure functions on floats and numpy arrays.

Notation: alpha is the expected per-token acceptance rate (1 - TV(target, draft)), k (K, gamma)
the number of drafted tokens per step, cost_ratio c = T_draft / T_target per forward pass.
Each function cites its source. Tags: [V] checked against the paper itself, [S] taken from a
secondary account of it, [D] derived here from the cited formulas (raysd's own model, not a
published result).
"""
from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Sequence

import numpy as np

# ---------------------------------------------------------------- argument checks

# Bounds and rounding. Every result below that has a bound (expected tokens in [1, K+1], extra
# tokens in [0, N], a loss >= 0) is clamped into it, so no function rejects what another returns.
# Arguments with a bound get one tolerance, BOUND_TOL, stated here only: a dimensionless argument
# (a probability or TV distance in [0, 1], expected tokens >= 1, mu2 >= mu^2) may lie outside its
# closed interval by BOUND_TOL (absolute for bounds of magnitude <= 1, relative beyond) and is
# then clamped onto the bound; further out it raises ValueError. Why: such arguments are computed
# in floating point, and rounding may put them just past a bound they satisfy exactly. This
# module's float64 formulas err by < 1e-12 (expected_tokens_per_step(0.75, 0) computes
# 0.9999999999999999 unclamped); raysd's acceptance rates (alpha_estimate, `raysd study`'s
# alpha) are float32 sums of min(target_probs, draft_probs) over the vocabulary, which reach
# 1 + 2.4e-5 at V = 151,936. 1e-4 covers both with margin, while a probability of 1.001 or 0.999 expected
# tokens still raise. Times and cost ratios get no tolerance: they are inputs, not rounded onto a
# bound, and a negative one is a mistake. (Two other constants are not bound checks: the 1e-3 on
# entropy_moments' row sums, which accepts unnormalised float32/bf16 softmax rows, and optimal_k's
# 1e-12 tie-break.)
BOUND_TOL = 1e-4


def _slack(bound: float) -> float:
    return BOUND_TOL * max(1.0, abs(bound))


def _real(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(x)


def _prob(name: str, x: float) -> float:
    """x in [0, 1] up to BOUND_TOL, clamped into [0, 1]."""
    if not _real(x) or not -_slack(0.0) <= x <= 1.0 + _slack(1.0):
        raise ValueError(f"{name} must be a real number in [0, 1], got {x!r}")
    return min(max(float(x), 0.0), 1.0)


def _at_least(name: str, x: float, lo: float, what: str = "") -> float:
    """x >= lo up to BOUND_TOL, clamped up to lo."""
    if not _real(x) or x < lo - _slack(lo):
        raise ValueError(f"{name}{what} must be >= {lo:g}, got {x!r}")
    return max(float(x), lo)


def _int(name: str, x: int, lo: int) -> int:
    if isinstance(x, bool) or not isinstance(x, Integral) or x < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {x!r}")
    return int(x)


def _nonneg(name: str, x: float, strict: bool = False) -> float:
    if not _real(x) or x < 0 or (strict and x == 0):
        raise ValueError(f"{name} must be a finite real {'>' if strict else '>='} 0, got {x!r}")
    return float(x)


def _clamp(x: float, lo: float, hi: float) -> float:
    """A computed value put back into [lo, hi], the interval it lies in in exact arithmetic."""
    return min(max(x, lo), hi)


def _one_minus_pow(a: float, n: int) -> float:
    """1 - a^n without cancellation near a = 1 (there a - 1 is exact, so use log1p/expm1)."""
    return 1.0 - a**n if a < 0.5 else -math.expm1(n * math.log1p(a - 1.0))


# ---------------------------------------------------------------- Leviathan et al. 2023


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """E[tokens per target step] = (1 - alpha^(K+1)) / (1 - alpha); exactly K+1 at alpha == 1.

    Leviathan, Kalman, Matias 2023 (arXiv 2211.17192), eq. 1, assuming i.i.d. acceptance.
    Includes the correction/bonus token, so it lies in [1, K+1]; the result is clamped there,
    so that rounding (e.g. 0.9999999999999999 at alpha = 0.75, K = 0) never leaves it.
    """
    a, k = _prob("alpha", alpha), _int("k", k, 0)
    if a == 1.0:
        return float(k + 1)
    return _clamp(_one_minus_pow(a, k + 1) / (1.0 - a), 1.0, float(k + 1))


def expected_tokens_batch(alphas: Sequence[float], budgets: Sequence[int], k_max: int) -> np.ndarray:
    """[k_max + 1] the batch's expected tokens per target step at K = 0..k_max: the sum over rows of
    expected_tokens_per_step(alpha_b, min(K, budget_b)), each alpha clipped into [0, 1]. The same
    formula vectorised over rows and K, for a controller that weighs every K at every step."""
    a = np.clip(np.asarray(alphas, dtype=np.float64), 0.0, 1.0)[:, None]  # (B, 1)
    n = np.minimum(np.arange(k_max + 1)[None, :], np.asarray(budgets, dtype=np.int64)[:, None]) + 1  # (B, K + 1)
    below = a < 1.0
    safe = np.where(below, a, 0.0)  # no log(0) or 1 - 1 in the lanes where a == 1
    with np.errstate(divide="ignore"):
        tokens = np.where(below, -np.expm1(n * np.log1p(safe - 1.0)) / (1.0 - safe), n)  # (B, K + 1)
    return np.clip(tokens, 1.0, n).sum(axis=0)


def expected_walltime_improvement(alpha: float, k: int, cost_ratio: float) -> float:
    """Speedup over autoregressive decoding = (1 - alpha^(K+1)) / ((1 - alpha)(cK + 1)).

    Leviathan et al. 2023, Theorem 3.8 (c = cost_ratio, Definition 3.7); assumes K+1
    parallel target evaluations cost one and long generations.
    """
    c = _nonneg("cost_ratio", cost_ratio)
    return expected_tokens_per_step(alpha, k) / (c * k + 1.0)


def expected_arithmetic_overhead(alpha: float, k: int, cost_ratio: float) -> float:
    """Factor of increase in total arithmetic = (1 - alpha)(c_hat K + K + 1) / (1 - alpha^(K+1)).

    Leviathan et al. 2023, Theorem 3.11. Here cost_ratio is c_hat, the draft/target ratio of
    arithmetic operations per token (not of walltime). Equals (c_hat K + K + 1) / E[tokens].
    """
    c = _nonneg("cost_ratio", cost_ratio)
    return (c * k + k + 1.0) / expected_tokens_per_step(alpha, k)


def optimal_k(alpha: float, cost_ratio: float, k_max: int = 64) -> int:
    """argmax_{K in 0..k_max} of Theorem 3.8's walltime improvement; 0 when no K > 0 helps.

    Leviathan et al. 2023 §3.5: no closed form, found numerically. K = 0 scores exactly 1.
    Values within 1e-12 (relative) of the best count as ties and go to the smaller K.
    """
    k_max = _int("k_max", k_max, 0)
    vals = np.array([expected_walltime_improvement(alpha, k, cost_ratio) for k in range(k_max + 1)])
    best = vals.max()
    if best <= 1.0 + 1e-12:
        return 0
    return int(np.flatnonzero(vals >= best * (1.0 - 1e-12))[0])


def speculation_helps(alpha: float, cost_ratio: float) -> bool:
    """True iff alpha > c: some K > 0 gives walltime improvement > 1.

    Leviathan et al. 2023, Corollary 3.9 (K = 1 already gives (1 + alpha)/(1 + c)). Conversely
    for alpha <= c, 1 + alpha + ... + alpha^K <= 1 + cK, so no K helps.
    """
    return _prob("alpha", alpha) > _nonneg("cost_ratio", cost_ratio)


def alpha_from_tv(tv: float) -> float:
    """alpha = beta = 1 - TV(target, draft) (Leviathan et al. 2023, Theorem 3.5 / Corollary 3.6)."""
    return 1.0 - _prob("tv", tv)


def truncated_geometric_pmf(alpha: float, k: int) -> np.ndarray:
    """Law of the number j of accepted drafts per step, length K+1.

    P(j) = alpha^j (1 - alpha) for j < K, P(K) = alpha^K (i.i.d. acceptance, as behind
    Leviathan et al. 2023 eq. 1). Its mean + 1 equals expected_tokens_per_step(alpha, k).
    """
    a, k = _prob("alpha", alpha), _int("k", k, 0)
    pmf = np.power(a, np.arange(k + 1, dtype=np.float64))  # 0.0**0 == 1
    pmf[:k] *= 1.0 - a
    return pmf


# ---------------------------------------------------------------- E_k recursion [D]


def expected_extra_tokens(p_accept: float, n: int) -> float:
    """E_0 from the recursion E_k = P (1 + E_{k+1}) for k < N, E_N = 0.

    E_k is the expected number of further drafts accepted given positions 0..k-1 were accepted,
    with per-token acceptance probability P and N drafted tokens [D]; E_0 + 1 reproduces
    Leviathan et al. 2023 eq. 1 with alpha = P, K = N.
    """
    p, n = _prob("p_accept", p_accept), _int("n", n, 0)
    e = 0.0
    for _ in range(n):
        e = p * (1.0 + e)
    return e


def expected_extra_tokens_closed_form(p_accept: float, n: int) -> float:
    """E_0 = P (1 - P^N) / (1 - P) = sum_{j=1}^{N} P^j; exactly N at P == 1, clamped into [0, N] [D]."""
    p, n = _prob("p_accept", p_accept), _int("n", n, 0)
    if p == 1.0:
        return float(n)
    return _clamp(p * _one_minus_pow(p, n) / (1.0 - p), 0.0, float(n))


def throughput_tokens_per_s(p_accept: float, n: int, t_draft_s: float, t_verify_s: float) -> float:
    """Tokens/s = (E_0 + 1) / (T_s N + T_v): T_s per draft token, T_v per verification pass [D]."""
    ts, tv = _nonneg("t_draft_s", t_draft_s), _nonneg("t_verify_s", t_verify_s, strict=True)
    return (expected_extra_tokens(p_accept, n) + 1.0) / (ts * n + tv)


# ---------------------------------------------------------------- batched / overlapped cost model [D]


def _cost_args(e, t1, tk1, td, k, tc):
    e = _at_least("expected_tokens", e, 1.0, " (per target step, incl. bonus token)")
    return (e, _nonneg("t_target_1", t1, strict=True), _nonneg("t_target_k1", tk1, strict=True),
            _nonneg("t_draft", td), _int("k", k, 0), _nonneg("t_comm", tc))


def serial_speedup(expected_tokens: float, t_target_1: float, t_target_k1: float,
                   t_draft: float, k: int, t_comm: float = 0.0) -> float:
    """E * T_target(B,1) / (T_target(B,K+1) + K T_draft(B) + T_comm).

    raysd's cost model for a batched, two-device design [D], generalising Leviathan et al. 2023
    Theorem 3.8 to measured per-step times at one batch size B. t_comm (default 0) is the per-round draft->target transfer.
    """
    e, t1, tk1, td, k, tc = _cost_args(expected_tokens, t_target_1, t_target_k1, t_draft, k, t_comm)
    return e * t1 / (tk1 + k * td + tc)


def overlapped_speedup(expected_tokens: float, t_target_1: float, t_target_k1: float,
                       t_draft: float, k: int, t_comm: float = 0.0) -> float:
    """E * T_target(B,1) / max(T_target(B,K+1) + T_comm, K T_draft(B)).

    raysd's cost model [D] with PEARL/AMUSD-style perfect overlap. Optimistic upper estimate: drafts
    made past a rejection are wasted. Always >= serial_speedup for the same arguments.
    """
    e, t1, tk1, td, k, tc = _cost_args(expected_tokens, t_target_1, t_target_k1, t_draft, k, t_comm)
    return e * t1 / max(tk1 + tc, k * td)


# ---------------------------------------------------------------- Yin et al. 2024 [S]


def expected_rejections(tv_distances: Sequence[float]) -> float:
    """E[#rejections] = sum_n E_{x_{1:n-1} ~ target}[TV(target_n, draft_n)].

    Yin, Chen, Huang, Wang 2024 (arXiv 2411.00841), Theorem 1 [S]. Pass one value per
    position n, each already averaged over prefixes. Each rejection costs one target call.
    """
    tv = np.asarray(tv_distances, dtype=np.float64)
    if tv.ndim != 1:
        raise ValueError(f"tv_distances must be 1-D (one expected TV per position), got shape {tv.shape}")
    if not np.all((tv >= -_slack(0.0)) & (tv <= 1.0 + _slack(1.0))):  # NaN fails both
        raise ValueError(f"every TV distance must lie in [0, 1] (up to BOUND_TOL = {BOUND_TOL:g})")
    return float(np.clip(tv, 0.0, 1.0).sum())


def pareto_front_tv_loss(rejection_prob: float, tv: float) -> float:
    """Optimal output TV loss at a given rejection probability: Loss*_TV = TV(target, draft) - P(reject).

    Yin et al. 2024, Theorems 4-5 [S]: the front is the straight line from (0, TV) to (TV, 0).
    Endpoints: rejection_prob = TV is standard (lossless) speculative decoding, loss 0;
    rejection_prob = 0 accepts every draft, so the output is the draft and the loss is TV.
    """
    t = _prob("tv", tv)
    r = _prob("rejection_prob", rejection_prob)
    if r > t + _slack(t):
        raise ValueError(f"rejection_prob must be <= tv ({t}) on the front, got {r}")
    return max(t - r, 0.0)


# ---------------------------------------------------------------- Pankratov & Alistarh 2025


def entropy_moments(target_probs: np.ndarray) -> tuple[float, float]:
    """(mu, mu2) from rows of target probabilities, shape [N, V] (or [V]), in nats.

    mu  = mean over rows of H(p) = -sum_x p(x) log p(x)        (expected entropy)
    mu2 = mean over rows of sum_x p(x) (log p(x))^2            (expected second log-moment)
    i.e. the first two moments of the surprisal -log p(x), x ~ p, averaged over contexts.
    Pankratov & Alistarh 2025 (arXiv 2512.11718), abstract [V]; the body was not reachable,
    so this reading of "second log-moment" is ours. 0 log 0 is taken as 0. By Jensen mu2 >= mu^2.
    Rows may sum to 1 within 1e-3 (float32 softmax output); each is renormalised first, so that
    the moments are those of a distribution and mu2 >= mu^2 holds up to float64 rounding.
    """
    p = np.asarray(target_probs, dtype=np.float64)
    p = p[None, :] if p.ndim == 1 else p
    if p.ndim != 2 or p.shape[0] == 0 or p.shape[1] == 0:
        raise ValueError(f"target_probs must have shape [N, V] with N, V >= 1, got {p.shape}")
    if not np.all(np.isfinite(p)) or np.any(p < 0):
        raise ValueError("target_probs must be finite and non-negative")
    if not np.allclose(p.sum(axis=1), 1.0, atol=1e-3):
        raise ValueError("each row of target_probs must sum to 1 (atol 1e-3)")
    p = p / p.sum(axis=1, keepdims=True)
    pos = p > 0
    logp = np.log(np.where(pos, p, 1.0))  # log(1) = 0 where p == 0: guards log(0)
    h = -(p * logp).sum(axis=1)
    m2 = (p * logp * logp).sum(axis=1)
    return max(float(h.mean()), 0.0), float(m2.mean())


def speed_of_light_bound(mu: float, mu2: float, capacity: int) -> float:
    """Upper bound on E[tokens predicted per iteration] = (mu + mu2) log(P) / mu^2.

    Pankratov & Alistarh 2025 (arXiv 2512.11718; EACL 2026), abstract [V], for deterministic
    draft-tree algorithms; P = verifier capacity (B, "batch size", in the EACL version).
    The additive O(1) term is dropped, so this is the leading term only. Natural logs (nats).
    mu = 0 (a deterministic target) has no finite bound and raises; mu2 may fall short of mu^2
    by BOUND_TOL (rounding) and is then taken as mu^2.
    """
    mu = _nonneg("mu", mu, strict=True)
    mu2 = _nonneg("mu2", mu2)
    cap = _int("capacity", capacity, 2)
    mu2 = _at_least("mu2", mu2, mu * mu, f" (Jensen: mu^2, mu={mu})")
    return (mu + mu2) * math.log(cap) / (mu * mu)


def relaxed_rule_point(tv: float, lam: float) -> tuple[float, float]:
    """(P(reject), TV(output, target)) at one drafted position under the relaxed test with weight
    lam, which verifies against (1 - lam) target + lam draft (raysd.core.rejection.rejection_sample's
    `relax`): ((1 - lam) TV, lam TV), with TV = TV(target, draft) there.

    The position emits the mixture, whose distance to the target is lam TV, and rejects with
    probability TV(mixture, draft) = (1 - lam) TV. The two sum to TV, so every lam lies on Yin et
    al. 2024's front (pareto_front_tv_loss); lam = 0 is exact speculative decoding, lam = 1 emits
    the draft. Linear in TV, so it holds for averages over positions too.
    """
    t, lam = _prob("tv", tv), _prob("lam", lam)
    return (1.0 - lam) * t, lam * t
