"""The law of what rejection_sample emits is the target's law.

Two independent checks, both through `rejection_sample` itself:

(a) Exact. rejection_sample is a deterministic, piecewise-constant function of its
    uniforms. For every draft token x we *measure* on the implementation (by bisection
    on the uniform, in float64) the length of the set of accept-uniforms that accept x,
    and, on the rejection branch, the length of the set of final-uniforms that emit each
    token y. These lengths are the probabilities under U[0, 1). Enumerating over the
    draft token (weighted by draft_probs) gives the emitted token's law exactly (up to
    bisection error < 1e-13), which must equal target_probs to 1e-6. Nothing here reuses
    the acceptance or residual formulas; monotonicity of the measured decisions in the
    uniform is itself checked on a grid, so the lengths are the probabilities. (Uniforms
    are passed as float64 so that the bisection can resolve them; the engine's float32
    uniforms are a subset of the same values.)
(b) Monte-Carlo. 20,000 seeded rows with drafts sampled from draft_probs; chi-square
    and a total-variation bound derived from the sample size.
"""
import math

import numpy as np
import pytest
import torch
from scipy import stats

from raysd.core.rejection import PLACEHOLDER_TOKEN_ID as PH
from raysd.core.rejection import rejection_sample
from raysd.core.sampling import SamplingTensors, logits_to_probs, sample_from_probs

V = 8


CASES = {  # (temperature, top_k, top_p), shared by draft and target as in the engine
    "plain": (1.0, 0, 1.0),
    "temp": (0.6, 0, 1.0),
    "top_k": (1.2, 5, 1.0),
    "top_p": (0.9, 0, 0.8),
    "all": (0.8, 6, 0.9),
}


def sampling_for(rows: int, case: tuple[float, int, float]) -> SamplingTensors:
    t, k, p = case
    return SamplingTensors(torch.full((rows,), t), torch.full((rows,), k, dtype=torch.int64), torch.full((rows,), p))


# ---------------------------------------------------------------- (a) exact, by measuring the implementation


def bisect(pred, n: int, iters: int = 44) -> torch.Tensor:
    """Per-row threshold t of a predicate that holds for u < t and fails for u >= t, u in [0, 1];
    44 halvings leave an error below 1e-13, far under the 1e-6 tolerance."""
    lo, hi = torch.zeros(n, dtype=torch.float64), torch.ones(n, dtype=torch.float64)
    for _ in range(iters):
        mid = (lo + hi) / 2
        ok = pred(mid)
        lo, hi = torch.where(ok, mid, lo), torch.where(ok, hi, mid)
    return torch.where(pred(torch.zeros(n, dtype=torch.float64)), (lo + hi) / 2, 0.0)  # exactly 0 if it never holds


GRID = torch.linspace(0.0, 1.0, 17, dtype=torch.float64)[:-1] + 0.0123  # 16 points in (0, 1)


def measure_position(drafts, draft_probs, target_probs, j):
    """Law of the token emitted at position j, given the drafts before j are accepted.

    Rows: one per candidate draft at position j (drafts[:, j]); the drafts before j are
    forced through with accept-uniform 0 (the caller makes them supported by the target).
    Returns (a [R], r [R, V]): a[b] the measured probability that drafts[b, j] is
    accepted (0 when j == K), r[b] the measured law of the token emitted at j on the
    rejection branch (the bonus law when j == K).
    """
    R, K = drafts.shape
    num = torch.full((R,), K)

    def call(accept_u_j, final_u, rows=None):
        idx = torch.arange(R) if rows is None else rows
        au = torch.zeros(len(idx), K, dtype=torch.float64)
        if j < K:
            au[:, j] = accept_u_j
        return rejection_sample(drafts[idx], num[idx], draft_probs[idx], target_probs[idx], au,
                                final_u.to(torch.float64))

    half = torch.full((R,), 0.5, dtype=torch.float64)
    if j < K:
        accepted = lambda u: call(u, half).num_accepted > j  # noqa: E731
        a = bisect(accepted, R)
        for g in GRID:  # the accept set is exactly [0, a): a is its probability
            ok = accepted(torch.full((R,), float(g), dtype=torch.float64))
            far = (g - a).abs() > 1e-9
            assert torch.equal(ok[far], (g < a)[far])
        # Accepted: position j emits the draft itself, and the forced prefix is intact.
        acc_rows = (a > 0).nonzero()[:, 0]
        out = call(a[acc_rows] / 2, half[acc_rows], acc_rows).output_token_ids
        assert torch.equal(out[:, : j + 1], drafts[acc_rows, : j + 1])
        reject_u = (a + 1) / 2  # inside the rejection set [a, 1)
        live = ~accepted(reject_u)  # rows that can be rejected at all
        assert bool((a[~live] > 1 - 1e-12).all())
        a = torch.where(live, a, 1.0)
    else:
        a = torch.zeros(R, dtype=torch.float64)
        reject_u = a
        live = torch.ones(R, dtype=torch.bool)

    # Law of the emitted token on the rejection (or bonus) branch: token(u) is
    # non-decreasing in the final uniform; c(y) = sup{u : token(u) <= y}.
    rows = torch.arange(R).repeat_interleave(V)
    ys = torch.arange(V).repeat(R)

    def token(final_u, rows_=rows):
        out = call(reject_u[rows_], final_u, rows_)
        assert bool((out.num_accepted[live[rows_]] == j).all())
        return out.output_token_ids[:, j]

    c = bisect(lambda u: token(u) <= ys, R * V).reshape(R, V)
    # (c(V - 1) is bisected too rather than set to 1, so that a token never emitted gets
    # exactly zero mass: its predicate, hence its bisection path, equals its neighbour's.)
    r = torch.diff(c, dim=1, prepend=torch.zeros(R, 1, dtype=torch.float64))
    for g in GRID:  # token(u) == min{y : u < c(y)} on the grid: r are the probabilities
        t = token(torch.full((R,), float(g), dtype=torch.float64), torch.arange(R))
        expected = (c <= g).sum(1)
        far = ((c - g).abs() > 1e-9).all(1) & live
        assert torch.equal(t[far], expected[far])
    r[~live] = 0.0
    return a, r


def emitted_law(q_j: torch.Tensor, a: torch.Tensor, r: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """sum_x q(x) [a(x) 1{y = x} + (1 - a(x)) r_x(y)] over the candidate drafts x."""
    q = q_j.double() / q_j.double().sum()
    law = torch.zeros(V, dtype=torch.float64)
    for i, x in enumerate(cand.tolist()):
        law[x] += q[x] * a[i]
        law += q[x] * (1 - a[i]) * r[i]
    return law


def context_probs(drafts, case, K, seed):
    """draft_probs [R, K, V] and target_probs [R, K + 1, V] where position i's logits depend
    on the previous drafted token, like a real model's; both through logits_to_probs."""
    g = torch.Generator().manual_seed(seed)
    base_t, emb_t = torch.randn(K + 1, V, generator=g) * 1.5, torch.randn(V, V, generator=g)
    base_q, emb_q = torch.randn(K, V, generator=g) * 1.5, torch.randn(V, V, generator=g)
    R = drafts.shape[0]
    prev = torch.cat([torch.zeros(R, 1, dtype=torch.int64), drafts.clamp(min=0)], dim=1)  # token before i
    t_logits = base_t[None] + emb_t[prev] * (torch.arange(K + 1) > 0)[None, :, None]
    q_logits = base_q[None] + emb_q[prev[:, :K]] * (torch.arange(K) > 0)[None, :, None]
    s = sampling_for(R, case)
    return logits_to_probs(q_logits, s), logits_to_probs(t_logits, s)


@pytest.mark.parametrize("K", [1, 2, 3, 4])
@pytest.mark.parametrize("case", ["plain", "top_k", "all", "greedy"])
def test_exact_law_of_each_emitted_position(K, case):
    """For every position j <= K: given the drafts before j were accepted, the emitted token
    at j has exactly the target's law at j (j = 0 is the first emitted token, j = K the bonus).
    By the chain rule this is the law of the whole emitted prefix."""
    params = (0.0, 0, 1.0) if case == "greedy" else CASES[case]
    seed = 100 * K + len(case)
    # A prefix that the target supports, found position by position (argmax of p * q).
    prefix = torch.zeros(1, K, dtype=torch.int64)
    for i in range(K):
        q, p = context_probs(prefix, params, K, seed)
        prefix[0, i] = int((p[0, i] * q[0, i] + 1e-3 * p[0, i]).argmax())
    for j in range(K + 1):
        if j < K:
            q, _ = context_probs(prefix, params, K, seed)
            cand = (q[0, j] > 0).nonzero()[:, 0]  # every draft token the drafter can produce
            drafts = prefix.repeat(len(cand), 1)
            drafts[:, j] = cand
        else:
            drafts = prefix.clone()  # one row: all K drafts accepted, then the bonus
        draft_probs, target_probs = context_probs(drafts, params, K, seed)
        rows = torch.arange(len(drafts))[:, None]
        assert bool((target_probs[rows, torch.arange(j), drafts[:, :j]] > 0).all())  # prefix can be accepted
        a, r = measure_position(drafts, draft_probs, target_probs, j)
        p_j = target_probs[0, j].double() / target_probs[0, j].double().sum()
        if j < K:
            law = emitted_law(draft_probs[0, j], a, r, cand)
        else:
            law = r[0]
        torch.testing.assert_close(law, p_j, atol=1e-6, rtol=0, msg=f"K={K} j={j} {case}")
        assert bool((law[p_j == 0] == 0).all())  # never a token outside the target's top-k / top-p


def test_exact_law_with_one_hot_drafter():
    """A model-free drafter passes one-hot draft_probs; the result is still exact."""
    K, params, seed = 1, CASES["all"], 7
    drafts = torch.tensor([[3]])
    _, target_probs = context_probs(drafts, params, K, seed)
    for x in range(V):
        d = torch.tensor([[x]])
        a, r = measure_position(d, torch.nn.functional.one_hot(d, V).float(), target_probs, 0)
        q = torch.nn.functional.one_hot(torch.tensor(x), V).float()
        law = emitted_law(q, a, r, torch.tensor([x]))
        p0 = target_probs[0, 0].double() / target_probs[0, 0].double().sum()
        torch.testing.assert_close(law, p0, atol=1e-6, rtol=0)


@pytest.mark.parametrize("case", ["plain", "all"])
def test_exact_joint_law_of_first_two_emitted_tokens(case):
    """K = 2, position-1 probabilities depend on the token at position 0 (as in a real LM).

    The first two tokens of the output stream are (y0, y1). If x0 is accepted, y0 = x0 and
    y1 is what this step emits at position 1; if x0 is rejected, y0 is the recovered token
    and y1 comes from the next step, whose first token has law P1(. | y0) (that is the
    single-step result proved above, so the next step is not simulated here). The joint
    law must be P0(y0) P1(y1 | y0).
    """
    K, params, seed = 2, CASES[case], 31
    probe = torch.zeros(1, K, dtype=torch.int64)
    q, p = context_probs(probe, params, K, seed)
    cand0 = (q[0, 0] > 0).nonzero()[:, 0]
    P0 = p[0, 0].double() / p[0, 0].double().sum()

    # Position 0, one row per x0.
    d0 = torch.stack([cand0, torch.zeros_like(cand0)], dim=1)
    dp0, tp0 = context_probs(d0, params, K, seed)
    a0, r0 = measure_position(d0, dp0, tp0, 0)

    def p1_given(y0):  # target's law at position 1 after token y0
        _, tp = context_probs(torch.tensor([[y0, 0]]), params, K, seed)
        return tp[0, 1].double() / tp[0, 1].double().sum()

    P1 = torch.stack([p1_given(y) for y in range(V)])  # [V, V]

    joint = torch.zeros(V, V, dtype=torch.float64)
    q0 = dp0[0, 0].double() / dp0[0, 0].double().sum()
    for i, x0 in enumerate(cand0.tolist()):
        joint += q0[x0] * (1 - a0[i]) * r0[i][:, None] * P1  # rejected at 0: next step samples y1

    # Accepted at 0: y0 = x0, and y1 is emitted by this step at position 1. One row per
    # (x0, x1) with x0 acceptable and x1 a token the drafter can produce after x0.
    pairs = []
    for i, x0 in enumerate(cand0.tolist()):
        if a0[i] > 0:
            qx, _ = context_probs(torch.tensor([[x0, 0]]), params, K, seed)
            pairs += [(i, x0, x1) for x1 in (qx[0, 1] > 0).nonzero()[:, 0].tolist()]
    d1 = torch.tensor([[x0, x1] for _, x0, x1 in pairs])
    dp1, tp1 = context_probs(d1, params, K, seed)
    a1, r1 = measure_position(d1, dp1, tp1, 1)
    for i, x0 in enumerate(cand0.tolist()):
        mine = torch.tensor([k for k, (ii, _, _) in enumerate(pairs) if ii == i], dtype=torch.int64)
        if len(mine):
            law1 = emitted_law(dp1[mine[0], 1], a1[mine], r1[mine], d1[mine, 1])
            joint[x0] += q0[x0] * a0[i] * law1

    expected = P0[:, None] * P1
    torch.testing.assert_close(joint, expected, atol=1e-6, rtol=0)


# ---------------------------------------------------------------- (b) Monte-Carlo

N = 20_000
# Total-variation tolerance. For the empirical law p_hat of N i.i.d. draws from p over
# V cells, E|p_hat_i - p_i| <= sqrt(p_i (1 - p_i) / N), so by Cauchy-Schwarz
#   E[TV] = 1/2 sum_i E|p_hat_i - p_i| <= 1/2 sqrt(V / N).
# TV is a function of the N draws that changes by at most 1/N when one draw changes, so
# McDiarmid gives P(TV >= E[TV] + t) <= exp(-2 N t^2); t = sqrt(log(1/delta) / (2N))
# with delta = 1e-6 makes a false failure a one-in-a-million event.
DELTA = 1e-6


def tv_tolerance(cells: int, n: int) -> float:
    return 0.5 * math.sqrt(cells / n) + math.sqrt(math.log(1 / DELTA) / (2 * n))


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit on the support; cells expecting < 5 are pooled."""
    support = probs > 0
    expected = probs[support] / probs[support].sum() * counts.sum()
    observed = counts[support]
    small = expected < 5
    if small.any():
        expected = np.append(expected[~small], expected[small].sum())
        observed = np.append(observed[~small], observed[small].sum())
    return stats.chisquare(observed, expected).pvalue


def iid_setup(K: int, case: str, seed: int):
    """Per-position target P_i and draft Q_i, the same for every row and every prefix
    (the i.i.d. per-position assumption), from independent random logits."""
    g = torch.Generator().manual_seed(seed)
    t_logits = torch.randn(K + 1, V, generator=g) * 1.5
    # A draft correlated with the target (both branches happen often) but still far from it
    # in TV (0.1 to 0.7 here); one spare position for the next step of the joint test.
    q_logits = t_logits + torch.randn(K + 1, V, generator=g)
    s = sampling_for(1, CASES[case])
    return logits_to_probs(t_logits[None], s)[0], logits_to_probs(q_logits[None], s)[0], g


def speculative_step(P, Q, K, g, rows=N):
    """One rejection_sample call over `rows` rows, drafts sampled from Q by sample_from_probs."""
    drafts = torch.stack([sample_from_probs(Q[i].expand(rows, V), torch.rand(rows, generator=g)) for i in range(K)], 1)
    out = rejection_sample(drafts, torch.full((rows,), K), Q[:K].expand(rows, K, V).contiguous(),
                           P[: K + 1].expand(rows, K + 1, V).contiguous(), torch.rand(rows, K, generator=g),
                           torch.rand(rows, generator=g))
    return drafts, out


def check_law(samples: np.ndarray, probs: np.ndarray, label: str, compare_to=None):
    counts = np.bincount(samples, minlength=len(probs))
    assert counts[probs == 0].sum() == 0, f"{label}: emitted a zero-probability token"
    pvalue = chi_square_pvalue(counts, probs)
    assert pvalue > 1e-4, (label, pvalue, counts, probs)
    tv = 0.5 * np.abs(counts / counts.sum() - probs / probs.sum()).sum()
    tol = tv_tolerance(len(probs), int(counts.sum()))
    assert tv <= tol, (label, tv, tol)
    if compare_to is not None:  # the test has power: the draft's own law would fail it
        tv_draft = 0.5 * np.abs(compare_to - probs).sum()
        assert tv_draft > 2 * tol, (label, tv_draft, tol)


@pytest.mark.parametrize("K", [1, 2, 3, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_monte_carlo_first_emitted_token(K, case):
    P, Q, g = iid_setup(K, case, seed=1000 + 10 * K + len(case))
    drafts, out = speculative_step(P, Q, K, g)
    # Sanity of the batch: accepted prefixes are the drafts; both branches occur.
    acc = out.num_accepted
    pos = torch.arange(K)[None]
    assert torch.equal(torch.where(pos < acc[:, None], out.output_token_ids[:, :K], PH),
                       torch.where(pos < acc[:, None], drafts, PH))
    assert 0 < int((acc == 0).sum()) < N
    check_law(out.output_token_ids[:, 0].numpy(), P[0].double().numpy(), f"K={K} {case}",
              compare_to=Q[0].double().numpy())


@pytest.mark.parametrize("K, case", [(2, "all"), (3, "top_p"), (2, "temp")])
def test_monte_carlo_joint_law_of_first_two_emitted_tokens(K, case):
    """Assumption (i.i.d. per position): the target's law at position 1 does not depend on
    the token at position 0, so the first two emitted tokens must be P_0 x P_1 jointly.
    Rows that emit only one token continue with a second step, which sits at position 1
    and so uses (P_1, P_2, ...) and drafts from (Q_1, Q_2, ...)."""
    P, Q, g = iid_setup(K + 1, case, seed=77 + K)
    _, out = speculative_step(P, Q, K, g)
    first = out.output_token_ids[:, 0]
    second = out.output_token_ids[:, 1].clone()
    short = out.num_accepted == 0
    n_short = int(short.sum())
    assert 0 < n_short < N
    _, nxt = speculative_step(P[1:], Q[1:], K, g, rows=n_short)
    second[short] = nxt.output_token_ids[:, 0]
    assert bool((second >= 0).all())
    joint = (first * V + second).numpy()
    expected = (P[0].double()[:, None] * P[1].double()[None, :]).reshape(-1).numpy()
    check_law(joint, expected, f"joint K={K} {case}")
    # And the second token alone has law P_1, given either value of the branch.
    check_law(second[~short].numpy(), P[1].double().numpy(), "second | first accepted")
    check_law(second[short].numpy(), P[1].double().numpy(), "second | first rejected")
