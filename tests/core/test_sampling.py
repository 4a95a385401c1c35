"""Tests for raysd.core.sampling: parity with Hugging Face's own logits warpers, exact greedy,
and the CDF-inversion sampler."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from raysd.core.sampling import SamplingParams, SamplingTensors, argmax_last, logits_to_probs, sample_from_probs

V = 32


def hf_probs(logits_row: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """One row through HF's warpers in generate's order (temperature, top-k, top-p), then softmax."""
    scores = logits_row[None].float().clone()
    ids = torch.zeros(1, 1, dtype=torch.int64)
    if temperature == 0.0:  # HF greedy search: argmax, no warpers
        return torch.nn.functional.one_hot(scores.argmax(-1), scores.shape[-1]).float()[0]
    scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    return scores.softmax(-1)[0]


# Per-row parameters, all different, covering each warper alone, together, disabled,
# top-k >= V (disabled by both), and greedy rows that also carry top-k / top-p.
ROW_PARAMS = [
    (1.0, 0, 1.0),
    (0.7, 0, 1.0),
    (1.3, 5, 1.0),
    (0.5, 0, 0.9),
    (0.9, 8, 0.8),
    (2.0, 1, 1.0),
    (1.0, 0, 0.3),
    (0.8, 64, 0.95),  # top_k > V
    (1.1, V, 0.5),  # top_k == V
    (0.0, 0, 1.0),
    (0.0, 3, 0.7),
    (0.25, 12, 0.05),  # tiny top_p keeps only the argmax
]


def tensors(params):
    return SamplingTensors.from_params([SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in params])


@pytest.mark.parametrize("seed", range(3))
def test_logits_to_probs_matches_hf_warpers_per_row(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(ROW_PARAMS), V, generator=g) * 3
    probs = logits_to_probs(logits, tensors(ROW_PARAMS))
    assert probs.dtype == torch.float32 and probs.shape == logits.shape
    for b, (t, k, p) in enumerate(ROW_PARAMS):
        expected = hf_probs(logits[b], t, k, p)
        torch.testing.assert_close(probs[b], expected, atol=1e-6, rtol=0, msg=f"row {b}: {(t, k, p)}")
        # Same support exactly: a token HF masks must have probability exactly 0 here.
        assert torch.equal(probs[b] > 0, expected > 0), (b, (t, k, p))


def test_logits_to_probs_three_dim_input_matches_per_position():
    g = torch.Generator().manual_seed(5)
    B, T = len(ROW_PARAMS), 4
    logits = torch.randn(B, T, V, generator=g) * 2
    probs = logits_to_probs(logits, tensors(ROW_PARAMS))
    assert probs.shape == (B, T, V) and probs.dtype == torch.float32
    for t in range(T):
        torch.testing.assert_close(probs[:, t], logits_to_probs(logits[:, t], tensors(ROW_PARAMS)), atol=1e-7, rtol=0)
        for b, params in enumerate(ROW_PARAMS):
            torch.testing.assert_close(probs[b, t], hf_probs(logits[b, t], *params), atol=1e-6, rtol=0)


def test_logits_to_probs_accepts_half_precision_and_returns_float32():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    probs = logits_to_probs(logits, tensors(ROW_PARAMS[:3]))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, logits_to_probs(logits.float(), tensors(ROW_PARAMS[:3])))


def test_temperature_zero_is_exact_one_hot_at_argmax():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 3, V, generator=g) * 5
    params = [(0.0, 0, 1.0), (0.0, 4, 1.0), (0.0, 0, 0.2), (0.0, 2, 0.5), (0.0, 1, 1.0), (0.0, 50, 0.99)]
    probs = logits_to_probs(logits, tensors(params))
    expected = torch.nn.functional.one_hot(logits.argmax(-1), V).float()
    assert torch.equal(probs, expected)
    # Mixed batch: greedy rows stay one-hot, sampling rows are unaffected by them.
    mixed = [(0.0, 0, 1.0), (1.0, 0, 1.0)]
    probs = logits_to_probs(logits[:2, 0], tensors(mixed))
    assert torch.equal(probs[0], expected[0, 0])
    torch.testing.assert_close(probs[1], logits[1, 0].softmax(-1))


def test_an_all_greedy_batch_takes_the_one_hot_shortcut_with_identical_results():
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(5, 4, V, generator=g) * 5).half()  # half: the argmax of the raw logits
    params = [(0.0, 0, 1.0), (0.0, 4, 1.0), (0.0, 0, 0.2), (0.0, 2, 0.5), (0.0, 50, 0.99)]
    fast = tensors(params)
    assert fast.all_greedy and not tensors(params + [(1.0, 0, 1.0)]).all_greedy
    general = SamplingTensors(fast.temperature, fast.top_k, fast.top_p, all_greedy=False)  # the softmax path
    probs = logits_to_probs(logits, fast)
    assert torch.equal(probs, logits_to_probs(logits, general)) and probs.dtype == torch.float32
    assert torch.equal(logits_to_probs(logits[:, 0], fast), logits_to_probs(logits[:, 0], general))
    # one_hot=True reads the hot index; the CDF inversion lands there for any uniform.
    flat = probs.flatten(0, 1)
    u = torch.rand(len(flat), generator=g)
    assert torch.equal(sample_from_probs(flat, u, one_hot=True), sample_from_probs(flat, u))


def test_disabled_warpers_are_plain_softmax():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(4))
    params = [(1.0, 0, 1.0), (0.5, 0, 1.0), (1.0, V, 1.0), (1.0, V + 7, 1.0)]
    probs = logits_to_probs(logits, tensors(params))
    temps = torch.tensor([1.0, 0.5, 1.0, 1.0])[:, None]
    torch.testing.assert_close(probs, (logits / temps).softmax(-1), atol=1e-7, rtol=0)


def test_top_k_keeps_ties_at_the_boundary():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0, 2.0]])
    probs = logits_to_probs(logits, tensors([(1.0, 2, 1.0)]))
    # 2nd largest is 2.0, shared by three tokens: all of them survive, as in HF.
    assert (probs[0] > 0).tolist() == [True, False, True, True, False, True]
    assert torch.equal(probs[0] > 0, hf_probs(logits[0], 1.0, 2, 1.0) > 0)


def test_sampling_params_validation():
    for bad in [dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_k=-1), dict(top_p=0.0),
                dict(top_p=1.5), dict(max_new_tokens=0)]:
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy


# ---------------------------------------------------------------- sample_from_probs


@st.composite
def weights_and_uniforms(draw):
    n = draw(st.integers(1, 6))
    v = draw(st.integers(1, 12))
    rows = []
    for _ in range(n):
        w = draw(st.lists(st.one_of(st.just(0.0), st.floats(1e-30, 1e3), st.floats(1e-8, 1.0)), min_size=v, max_size=v))
        if sum(w) == 0:
            w[draw(st.integers(0, v - 1))] = draw(st.floats(1e-30, 1.0))
        rows.append(w)
    edge = [0.0, float(np.nextafter(np.float32(1), np.float32(0))), 0.5]
    us = draw(st.lists(st.one_of(st.sampled_from(edge), st.floats(0.0, 1.0, exclude_max=True, width=32)),
                       min_size=n, max_size=n))
    return rows, us


@settings(max_examples=max(150, settings().max_examples), deadline=None)  # more under --hypothesis-profile=explore
@given(weights_and_uniforms())
def test_sample_from_probs_never_returns_zero_probability_token(case):
    rows, us = case
    probs = torch.tensor(rows, dtype=torch.float32)
    tokens = sample_from_probs(probs, torch.tensor(us, dtype=torch.float32))
    assert tokens.dtype == torch.int64 and tokens.shape == (len(rows),)
    for b, tok in enumerate(tokens.tolist()):
        assert 0 <= tok < probs.shape[1]
        assert probs[b, tok] > 0, (rows[b], us[b], tok)


def test_sample_from_probs_is_cdf_inversion():
    probs = torch.tensor([[0.0, 0.2, 0.0, 0.3, 0.5, 0.0]]).expand(7, -1)
    u = torch.tensor([0.0, 0.1999, 0.2001, 0.4999, 0.5001, 0.9, 0.99999994])
    assert sample_from_probs(probs, u).tolist() == [1, 1, 3, 3, 4, 4, 4]
    # Unnormalised weights give the same answer.
    assert sample_from_probs(probs * 7.0, u).tolist() == [1, 1, 3, 3, 4, 4, 4]


def test_sample_from_probs_matches_distribution_chi_square():
    g = torch.Generator().manual_seed(11)
    p = torch.tensor([0.3, 0.0, 0.05, 0.15, 0.0, 0.2, 0.1, 0.2])
    N = 40_000
    tokens = sample_from_probs(p.expand(N, -1), torch.rand(N, generator=g))
    counts = np.bincount(tokens.numpy(), minlength=len(p))
    assert counts[p.numpy() == 0].sum() == 0
    support = p.numpy() > 0
    _, pvalue = stats.chisquare(counts[support], N * p.numpy()[support] / p.numpy()[support].sum())
    assert pvalue > 1e-4, (counts, pvalue)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_last_equals_torch_argmax_with_ties_nans_and_infinities(dtype):
    g = torch.Generator().manual_seed(0)
    V = 49152  # SmolLM2's vocabulary: the blocked path
    x = torch.randn(5, 3, V, generator=g).to(dtype)  # (B, T, V)
    x[0, 0, [7, 300, 40000]] = 9.0  # a tie across blocks: the first wins
    x[0, 1, [129, 130]] = 9.0  # a tie inside one block
    x[1, 0, [5000, 20]] = float("nan")  # NaN counts as the maximum, the first NaN
    x[1, 1] = float("-inf")  # all equal: index 0
    x[2, 2, -1] = float("inf")
    assert torch.equal(argmax_last(x), x.argmax(dim=-1))
    assert torch.equal(argmax_last(x[:, 0]), x[:, 0].argmax(dim=-1))  # (B, V)
    odd = torch.randn(4, 1000, generator=g)  # not a multiple of the block: torch's own argmax
    assert torch.equal(argmax_last(odd), odd.argmax(dim=-1))
