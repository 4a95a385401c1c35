"""Tests for raysd.core.rejection: hand-built cases with exact expected tokens, and parity
with a slow per-row loop of Leviathan et al. 2023, Algorithm 1.

Every uniform is passed in, so every case below is deterministic.
"""
import numpy as np
import pytest
import torch

from raysd.core.rejection import PLACEHOLDER_TOKEN_ID as PH
from raysd.core.rejection import RejectionOutput, draft_target_overlap, greedy_rejection_sample, rejection_sample
from raysd.core.sampling import SamplingTensors, logits_to_probs, sample_from_probs

V = 10


def one_hot(tokens, v=V):
    """[..., V] float32 one-hot rows for a nested list of token ids."""
    t = torch.as_tensor(tokens, dtype=torch.int64)
    return torch.nn.functional.one_hot(t, v).float()


def dist(weights):
    w = torch.as_tensor(weights, dtype=torch.float32)
    return w / w.sum(dim=-1, keepdim=True)


def run(drafts, num, draft_probs, target_probs, accept_u=None, final_u=None):
    drafts = torch.as_tensor(drafts, dtype=torch.int64)
    B, K = drafts.shape
    accept_u = torch.zeros(B, K) if accept_u is None else torch.as_tensor(accept_u, dtype=torch.float32)
    final_u = torch.full((B,), 0.5) if final_u is None else torch.as_tensor(final_u, dtype=torch.float32)
    num = torch.as_tensor(num, dtype=torch.int64)
    return rejection_sample(drafts, num, draft_probs, target_probs, accept_u, final_u)


# ---------------------------------------------------------------- hand-built exact cases


def test_all_accepted_emits_bonus_from_last_target_position():
    # Target puts mass 1 on each draft, so every test passes whatever the uniform;
    # the bonus is the only token of target_probs[K].
    drafts = [[1, 4, 7]]
    draft_probs = dist([[1.0] * V] * 3)[None]  # uniform drafter
    target_probs = one_hot([[1, 4, 7, 8]])
    out = run(drafts, [3], draft_probs, target_probs, accept_u=[[0.99, 0.99, 0.99]], final_u=[0.999])
    assert out.output_token_ids.tolist() == [[1, 4, 7, 8]]
    assert out.num_accepted.tolist() == [3]
    assert out.num_tested.tolist() == [3]
    assert out.to_lists() == [[1, 4, 7, 8]]


def test_bonus_is_sampled_from_target_at_k_by_cdf_inversion():
    # target_probs[K] = [0.25 on 2, 0.75 on 5]: u < 0.25 gives 2, u >= 0.25 gives 5.
    last = torch.zeros(V)
    last[2], last[5] = 0.25, 0.75
    target = torch.stack([one_hot(3), last])[None]  # [1, 2, V]
    draft = one_hot([[3]])
    for u, expected in [(0.0, 2), (0.2499, 2), (0.2501, 5), (0.9999, 5)]:
        out = run([[3]], [1], draft, target, accept_u=[[0.5]], final_u=[u])
        assert out.output_token_ids.tolist() == [[3, expected]], u


def test_early_rejection_emits_recovered_token_from_residual():
    # Position 0: draft q = [.5 on 3, .5 on 6], target p = [.5 on 3, .5 on 9].
    # Draft 6 has p(6)/q(6) = 0, so it is rejected for any uniform, and the residual
    # max(0, p - q) = [.5 on 9] is one-hot after normalisation: the recovered token is 9.
    q0 = torch.zeros(V)
    q0[3], q0[6] = 0.5, 0.5
    p0 = torch.zeros(V)
    p0[3], p0[9] = 0.5, 0.5
    draft_probs = torch.stack([q0, one_hot(1), one_hot(2)])[None]  # [1, 3, V]
    target_probs = torch.stack([p0, one_hot(1), one_hot(2), one_hot(5)])[None]  # [1, 4, V]
    for fu in [0.0, 0.3, 0.999]:
        out = run([[6, 1, 2]], [3], draft_probs, target_probs, accept_u=[[0.0, 0.0, 0.0]], final_u=[fu])
        assert out.output_token_ids.tolist() == [[9, PH, PH, PH]]
        assert out.num_accepted.tolist() == [0]
        assert out.num_tested.tolist() == [1]
        assert out.to_lists() == [[9]]


def test_rejection_at_middle_position_keeps_accepted_prefix():
    # Draft 3 at position 0 is accepted (p = q). At position 1, q = [.8 on 4, .2 on 7],
    # p = [.4 on 4, .6 on 7]: draft 4 is accepted iff u < 0.5. Residual = [.4 on 7] -> 7.
    p1, q1 = torch.zeros(V), torch.zeros(V)
    p1[4], p1[7] = 0.4, 0.6
    q1[4], q1[7] = 0.8, 0.2
    draft_probs = torch.stack([one_hot(3), q1, one_hot(0)])[None]
    target_probs = torch.stack([one_hot(3), p1, one_hot(0), one_hot(8)])[None]
    rejected = run([[3, 4, 0]], [3], draft_probs, target_probs, accept_u=[[0.9, 0.51, 0.0]], final_u=[0.7])
    assert rejected.output_token_ids.tolist() == [[3, 7, PH, PH]]
    assert rejected.num_accepted.tolist() == [1]
    assert rejected.num_tested.tolist() == [2]
    accepted = run([[3, 4, 0]], [3], draft_probs, target_probs, accept_u=[[0.9, 0.49, 0.0]], final_u=[0.7])
    assert accepted.output_token_ids.tolist() == [[3, 4, 0, 8]]
    assert accepted.num_accepted.tolist() == [3]
    assert accepted.num_tested.tolist() == [3]


def test_acceptance_threshold_is_target_over_draft():
    # q(x) = 0.5, p(x) = 0.2: accepted exactly when u < 0.4.
    q, p = torch.zeros(V), torch.zeros(V)
    q[1], q[2] = 0.5, 0.5
    p[1], p[3] = 0.2, 0.8
    dp, tp = q[None, None], torch.stack([p, one_hot(0)])[None]
    assert run([[1]], [1], dp, tp, accept_u=[[0.3999]]).num_accepted.tolist() == [1]
    assert run([[1]], [1], dp, tp, accept_u=[[0.4001]]).num_accepted.tolist() == [0]
    # Rejected: residual max(0, p - q) = [.8 on 3] -> 3.
    assert run([[1]], [1], dp, tp, accept_u=[[0.4001]]).to_lists() == [[3]]


def test_greedy_mismatch_stops_at_first_mismatch_and_emits_target_argmax():
    # Temperature 0 makes both distributions one-hot at the argmax (vLLM test_early_mismatch).
    greedy = SamplingTensors(torch.zeros(1), torch.zeros(1, dtype=torch.int64), torch.ones(1))
    target_argmax = [1, 2, 3, 4, 5]
    draft_tokens = [1, 2, 6, 4]  # third draft disagrees
    t_logits = torch.randn(1, 5, V, generator=torch.Generator().manual_seed(0))
    d_logits = torch.randn(1, 4, V, generator=torch.Generator().manual_seed(1))
    for j, tok in enumerate(target_argmax):
        t_logits[0, j, tok] = 10.0
    for j, tok in enumerate(draft_tokens):
        d_logits[0, j, tok] = 10.0
    target_probs = logits_to_probs(t_logits, greedy)
    draft_probs = logits_to_probs(d_logits, greedy)
    assert torch.equal(target_probs, one_hot([target_argmax]))
    # The uniforms must not matter for greedy rows: try the extremes.
    for au, fu in [(0.0, 0.0), (0.999999, 0.999999), (0.5, 0.5)]:
        out = run([draft_tokens], [4], draft_probs, target_probs, accept_u=[[au] * 4], final_u=[fu])
        assert out.output_token_ids.tolist() == [[1, 2, 3, PH, PH]]
        assert out.num_accepted.tolist() == [2]
        assert out.num_tested.tolist() == [3]
    perfect = run([[1, 2, 3, 4]], [4], one_hot([[1, 2, 3, 4]]), target_probs, accept_u=[[0.99] * 4])
    assert perfect.output_token_ids.tolist() == [[1, 2, 3, 4, 5]]  # vLLM test_perfect_match


def test_greedy_target_with_sampled_draft_emits_argmax_on_mismatch():
    # A sampling drafter against a greedy target: a mismatch is rejected whatever u, and
    # the residual max(0, onehot(a) - q) has all its mass on the argmax a.
    q = dist([[1.0] * V])[0]
    target = one_hot([[4, 0]])
    for u in [0.0, 0.5, 0.999]:
        assert run([[7]], [1], q[None, None], target, accept_u=[[u]], final_u=[u]).to_lists() == [[4]]
        assert run([[4]], [1], q[None, None], target, accept_u=[[u]], final_u=[0.0]).to_lists() == [[4, 0]]


def test_ragged_num_draft_tokens_including_zero():
    K = 3
    rng = torch.Generator().manual_seed(3)
    target_probs = torch.stack([
        one_hot([1, 2, 3, 4]),   # row 0: 3 drafts, all accepted -> bonus 4
        one_hot([5, 6, 7, 8]),   # row 1: 0 drafts -> plain sampling from target_probs[0] = 5
        one_hot([2, 9, 0, 0]),   # row 2: 1 draft, accepted -> bonus from target_probs[1] = 9
        one_hot([3, 3, 1, 1]),   # row 3: 2 drafts, second rejected -> recovered 3
    ])
    draft_probs = torch.rand(4, K, V, generator=rng) + 0.01
    draft_probs /= draft_probs.sum(-1, keepdim=True)
    drafts = [[1, 2, 3], [PH, PH, PH], [2, PH, PH], [3, 0, PH]]
    out = run(drafts, [3, 0, 1, 2], draft_probs, target_probs, accept_u=torch.full((4, K), 0.5).tolist())
    assert out.output_token_ids.shape == (4, K + 1)
    assert out.output_token_ids.dtype == torch.int64
    assert out.output_token_ids.tolist() == [
        [1, 2, 3, 4],
        [5, PH, PH, PH],
        [2, 9, PH, PH],
        [3, 3, PH, PH],
    ]
    assert out.num_accepted.tolist() == [3, 0, 1, 1]
    assert out.num_tested.tolist() == [3, 0, 1, 2]
    assert out.to_lists() == [[1, 2, 3, 4], [5], [2, 9], [3, 3]]


def test_positions_past_num_drafts_are_never_tested():
    # Row has 1 draft but the (unused) second slot would be accepted: it must not be.
    target = one_hot([[5, 6, 7]])
    out = run([[5, 6]], [1], one_hot([[5, 6]]), target, accept_u=[[0.0, 0.0]])
    assert out.output_token_ids.tolist() == [[5, 6, PH]]  # 6 is the bonus from target[1]
    assert out.num_accepted.tolist() == [1]
    assert out.num_tested.tolist() == [1]
    # Same bonus when the drafted token at the slot differs: the slot is not looked at.
    out = run([[5, 2]], [1], one_hot([[5, 2]]), target, accept_u=[[0.0, 0.0]])
    assert out.output_token_ids.tolist() == [[5, 6, PH]]


def test_zero_speculative_tokens_is_plain_sampling():
    target = torch.zeros(2, 1, V)
    target[0, 0, 3] = 1.0
    target[1, 0, 1], target[1, 0, 8] = 0.5, 0.5
    out = rejection_sample(torch.zeros(2, 0, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
                           torch.zeros(2, 0, V), target, torch.zeros(2, 0), torch.tensor([0.9, 0.6]))
    assert out.output_token_ids.tolist() == [[3], [8]]
    assert out.num_accepted.tolist() == [0, 0]
    assert out.num_tested.tolist() == [0, 0]
    assert out.to_lists() == [[3], [8]]


def test_to_lists_on_constructed_output():
    out = RejectionOutput(torch.tensor([[4, 5, PH], [7, PH, PH], [1, 2, 3]]), torch.tensor([1, 0, 2]),
                          torch.tensor([2, 1, 2]))
    assert out.to_lists() == [[4, 5], [7], [1, 2, 3]]


def test_draft_target_overlap_is_one_minus_tv():
    g = torch.Generator().manual_seed(0)
    q = torch.rand(3, 2, V, generator=g).softmax(-1)
    p = torch.rand(3, 3, V, generator=g).softmax(-1)
    tv = 0.5 * (p[:, :2] - q).abs().sum(-1)
    torch.testing.assert_close(draft_target_overlap(q, p), 1 - tv)
    assert draft_target_overlap(q, p).shape == (3, 2)


# ---------------------------------------------------------------- parity with a reference loop


def reference_rejection(drafts, num, q, p, accept_u, final_u):
    """Leviathan et al. 2023 Algorithm 1, one row at a time, in plain Python loops.

    Acceptance uses the same float32 product as the batched code (u * q(x) < p(x) is
    r < p/q without a division), so parity can be asserted with torch.equal.
    """
    B, K = drafts.shape
    out = torch.full((B, K + 1), PH, dtype=torch.int64)
    for b in range(B):
        n = int(num[b])
        final = None
        for j in range(n):
            x = int(drafts[b, j])
            if bool(accept_u[b, j] * q[b, j, x] < p[b, j, x]):
                out[b, j] = x
                continue
            residual = np.maximum(p[b, j].double().numpy() - q[b, j].double().numpy(), 0.0)
            final = (j, residual)
            break
        if final is None:
            final = (n, p[b, n].double().numpy())
        j, weights = final
        cdf = np.cumsum(weights)
        draw = float(final_u[b]) * cdf[-1]
        out[b, j] = min(int(np.searchsorted(cdf, draw, side="right")), V - 1)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_matches_reference_loop_on_random_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    B, K = 256, 4
    # Peaked random distributions with zeros (some masked tokens), so that both accepts
    # and rejects happen often and the residual path is exercised.
    def random_probs(*shape):
        logits = torch.randn(*shape, generator=g) * 2
        logits = logits.masked_fill(torch.rand(*shape, generator=g) < 0.3, float("-inf"))
        logits[..., 0] = torch.where(torch.isinf(logits[..., 0]), 0.0, logits[..., 0])  # >= 1 token kept
        return logits.softmax(-1)

    q = random_probs(B, K, V)
    p = random_probs(B, K + 1, V)
    drafts = sample_from_probs(q.reshape(-1, V), torch.rand(B * K, generator=g)).reshape(B, K)
    num = torch.randint(0, K + 1, (B,), generator=g)
    drafts = torch.where(torch.arange(K)[None] < num[:, None], drafts, PH)
    accept_u = torch.rand(B, K, generator=g)
    final_u = torch.rand(B, generator=g)

    out = rejection_sample(drafts, num, q, p, accept_u, final_u)
    expected = reference_rejection(drafts, num, q, p, accept_u, final_u)
    assert torch.equal(out.output_token_ids, expected)
    n_emitted = (expected != PH).sum(1)
    assert torch.equal(out.num_accepted + 1, n_emitted)
    assert torch.equal(out.num_tested, torch.minimum(n_emitted, num))
    # The test is not vacuous: there are rows stopped by a rejection and rows fully accepted.
    assert bool((out.num_accepted < num).any()) and bool(((out.num_accepted == num) & (num > 0)).any())
    # Every emitted token, accepted draft or recovered/bonus, has positive target probability.
    emitted = expected.clamp(min=0)
    p_at = p.gather(-1, emitted[..., None])[..., 0]
    assert bool((p_at[expected != PH] > 0).all())


def test_seeded_runs_are_deterministic():
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    outs = []
    for g in (g1, g2):
        q = torch.rand(8, 3, V, generator=g).softmax(-1)
        p = torch.rand(8, 4, V, generator=g).softmax(-1)
        d = torch.randint(0, V, (8, 3), generator=g)
        outs.append(rejection_sample(d, torch.full((8,), 3), q, p, torch.rand(8, 3, generator=g),
                                     torch.rand(8, generator=g)).output_token_ids)
    assert torch.equal(outs[0], outs[1])


# ---------------------------------------------------------------- all-zero residual
# float32 softmax outputs do not sum to exactly 1, so target <= draft elementwise can hold
# with target != draft; a rejection (probability ~1e-6) then finds max(0, target - draft)
# all zero. The recovered token must still come from the target's support.
_BUG_DRAFT_LOGITS = [1.2975760698318481, 6.391336441040039, 7.650025367736816, 0.8977562785148621,
                     -1.7511913776397705, 0.9764492511749268, 0.39976054430007935, 0.37465012073516846]
_BUG_TARGET_LOGITS = [1.297577142715454, 6.3913373947143555, 7.650026321411133, 0.8977562189102173,
                      -1.751192331314087, 0.9764491319656372, 0.3997591733932495, 0.3746510148048401]


def test_all_zero_residual_still_emits_a_target_token():
    sampling = SamplingTensors(torch.ones(1), torch.tensor([6]), torch.ones(1))  # top-k 6 of 8
    q = logits_to_probs(torch.tensor([_BUG_DRAFT_LOGITS]), sampling)  # [1, 8]
    p = logits_to_probs(torch.tensor([_BUG_TARGET_LOGITS]), sampling)
    assert bool((p <= q).all()) and p[0, 7] == 0 and p[0, 3] < q[0, 3]  # the precondition
    # Draft token 3 (q(3) > 0) is rejected for u >= p(3)/q(3) ~ 1 - 1e-6: a float32 uniform can be that large.
    out = rejection_sample(torch.tensor([[3]]), torch.tensor([1]), q[:, None], torch.stack([p, p], dim=1),
                           torch.tensor([[0.9999995]]), torch.tensor([0.5]))
    assert out.num_accepted.tolist() == [0]
    token = out.output_token_ids[0, 0]
    assert p[0, token] > 0, f"emitted token {int(token)} has target probability 0"


@pytest.mark.parametrize("seed", range(6))
def test_greedy_path_equals_rejection_sample_with_one_hot_targets(seed):
    """For all-greedy rows the verifier takes greedy_rejection_sample on the target's argmax: the
    same tokens, counts and overlaps as rejection_sample on one-hot target_probs, for drafts drawn
    from a spread draft distribution, one-hot (n-gram) drafts and drafts equal to the argmax."""
    g = torch.Generator().manual_seed(seed)
    B, K, V = 16, 4, 11
    target_ids = torch.randint(0, V, (B, K + 1), generator=g)  # (B, K + 1)
    target_probs = torch.zeros(B, K + 1, V).scatter_(-1, target_ids[..., None], 1.0)  # (B, K + 1, V) one-hot
    draft_probs = torch.softmax(torch.randn(B, K, V, generator=g) * 2, dim=-1)  # (B, K, V)
    drafts = torch.multinomial(draft_probs.view(-1, V), 1, generator=g).view(B, K)
    copy = torch.rand(B, K, generator=g) < 0.6  # many drafts are the argmax, so prefixes get accepted
    drafts = torch.where(copy, target_ids[:, :K], drafts)
    one_hot_rows = torch.arange(B) % 3 == 0  # an n-gram drafter's one-hot draft_probs
    draft_probs[one_hot_rows] = torch.zeros(V).expand(int(one_hot_rows.sum()), K, V).scatter(-1, drafts[one_hot_rows, :, None], 1.0)
    num = torch.randint(0, K + 1, (B,), generator=g)
    u, final = torch.rand(B, K, generator=g), torch.rand(B, generator=g)
    want = rejection_sample(drafts, num, draft_probs, target_probs, u, final)
    got = greedy_rejection_sample(drafts, num, target_ids)
    for field in ("output_token_ids", "num_accepted", "num_tested"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert want.num_accepted.sum() > 0 and (want.num_accepted < num).any()  # both branches taken
    overlap = draft_probs.gather(-1, target_ids[:, :K, None])[..., 0]
    torch.testing.assert_close(overlap, draft_target_overlap(draft_probs, target_probs))
