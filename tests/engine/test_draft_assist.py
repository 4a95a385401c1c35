"""Hierarchical speculation (raysd.engine.draft_assist): n-gram lookup drafts for the draft model,
which drafts for the target. Greedy output is the target's own; sampled output follows the
target's law; the middle level's proposals follow the draft model's law; its draft_probs are
the draft model's distributions; and its cache rolls back past rejected inner drafts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raysd.core.draws import counter_uniforms
from raysd.core.sampling import SamplingParams, SamplingTensors, logits_to_probs
from raysd.core.speculation import AdaptiveConfig, SpeculationConfig, StepCosts
from raysd.engine.draft_assist import DraftAssistDrafter, profile_assist_costs
from raysd.engine.drafters import DraftModelDrafter
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.requests import Request
from tests.conftest import EOS, VOCAB, tiny_model
from tests.core.test_distribution import chi_square_pvalue, tv_tolerance
from tests.engine.test_distribution_e2e import assert_first_two_tokens_follow_target, copyable_prompt
from tests.engine.test_equivalence import hf_greedy, prompts, run

RUNNERS = ["static", "dynamic"]


def repetitive_prompts() -> list[list[int]]:
    """Random prompts, each with a repeated stretch, so the lookup finds matches from the start."""
    return [p + p[: max(1, len(p) // 2)] for p in prompts(seed=3)]


@pytest.fixture(scope="module")
def llama_greedy():
    target = tiny_model("llama")
    ps = repetitive_prompts()
    return target, ps, [hf_greedy(target, p, 24) for p in ps]


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("draft_kind", ["random", "same"])
@pytest.mark.parametrize("k,assist_k,batch_size", [(4, 3, 8), (6, 2, 3), (1, 4, 8)])
def test_greedy_matches_target_generate_and_two_levels(llama_greedy, runner, draft_kind, k, assist_k, batch_size):
    target, ps, expected = llama_greedy
    draft = target if draft_kind == "same" else tiny_model("llama", seed=123, layers=1)
    three = DraftAssistDrafter(draft, VOCAB, runner=runner, assist_k=assist_k)
    results = run(target, three, ps, k, batch_size, 24, runner=runner)
    two = run(target, DraftModelDrafter(draft, VOCAB, runner=runner), ps, k, batch_size, 24, runner=runner)
    for r, t, e in zip(results, two, expected):
        n = len(r.token_ids)
        assert r.token_ids == e[:n] and (n == 24 or r.token_ids[-1] == EOS)
        assert r.token_ids == t.token_ids
        # Greedy rows hand up exactly the draft model's greedy tokens: the same drafts, the same verdicts.
        assert r.stats.num_accepted_draft_tokens == t.stats.num_accepted_draft_tokens
    s = three.assist_stats
    if k > 1:
        assert s.lookup_drafted > 0 and s.row_steps < s.handed_up  # the middle level really drafted for itself
    if draft_kind == "same":
        assert all(r.stats.draft_acceptance_rate == 1.0 for r in results if r.stats.num_draft_tokens)


def test_inner_k_zero_is_two_levels():
    """Inner k = 0 is the plain draft model, token for token, seeded samples included."""
    target, draft = tiny_model("llama"), tiny_model("llama", seed=123, layers=1)
    ps = repetitive_prompts()
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=7, ignore_eos=True)
    three = DraftAssistDrafter(draft, VOCAB, assist_k=0)
    got = run(target, three, ps, 4, 4, 16, params=params)
    two = run(target, DraftModelDrafter(draft, VOCAB), ps, 4, 4, 16, params=params)
    assert [r.token_ids for r in got] == [r.token_ids for r in two]
    s = three.assist_stats
    assert s.row_steps == s.handed_up > 0 and s.lookup_drafted == 0 and set(s.assist_k_chosen) == {0}


def test_seeded_sampling_is_reproducible_whatever_the_batch():
    target, draft = tiny_model("llama"), tiny_model("llama", seed=123, layers=1)
    ps = repetitive_prompts()
    params = SamplingParams(temperature=0.8, top_k=40, max_new_tokens=20, seed=5)
    a = run(target, DraftAssistDrafter(draft, VOCAB, assist_k=3), ps, 4, 8, 20, params=params)
    b = run(target, DraftAssistDrafter(draft, VOCAB, assist_k=3), ps, 4, 3, 20, params=params)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


V = 8
N = 6000  # samples, as tests/engine/test_distribution_e2e.py: 64 cells of ~94 expected counts each


@pytest.mark.parametrize("runner", RUNNERS)
def test_joint_law_of_two_tokens_matches_target(runner):
    """Through the engine with three levels, T = 0.9 with top-k and top-p: the joint law of the first
    two of four tokens (the first step offers 3 drafts, so the lookup drafts up to 2 for the draft
    model) is the target's exact law (chi-square and a total-variation bound from N)."""
    target = tiny_model("llama", seed=11, vocab=V)
    draft = tiny_model("llama", seed=12, layers=1, vocab=V)
    prompt = copyable_prompt(target)
    base = SamplingParams(temperature=0.9, top_k=6, top_p=0.95, max_new_tokens=4, ignore_eos=True)
    drafter = DraftAssistDrafter(draft, V, runner=runner, assist_k=2)
    speculation = SpeculationConfig(num_speculative_tokens=3)
    engine = SpecEngine(target, drafter, EngineConfig(speculation, max_batch_size=1000, runner=runner))
    reqs = [Request(i, prompt, SamplingParams(**{**base.__dict__, "seed": 10_000 + i})) for i in range(N)]
    results = engine.generate(reqs)
    assert_first_two_tokens_follow_target(results, target, prompt, base, length=4)
    assert sum(r.stats.num_accepted_draft_tokens for r in results) > 0
    s = drafter.assist_stats
    assert s.lookup_drafted > 0 and s.lookup_accepted > 0  # the lookup's drafts were tested and some accepted


def test_middle_level_proposals_follow_the_draft_models_law():
    """The first three tokens the middle level hands up follow the draft model's joint law, and the
    draft_probs it reports are the draft model's exact conditionals after the tokens handed up."""
    draft = tiny_model("llama", seed=12, layers=1, vocab=V)
    prompt = copyable_prompt(tiny_model("llama", seed=11, vocab=V))
    params = SamplingParams(temperature=1.0, top_p=0.97, max_new_tokens=4)
    n = 4000
    drafter = DraftAssistDrafter(draft, V, assist_k=2)
    drafter.add_rows([prompt] * n)
    sampling = SamplingTensors.from_params([params] * n)
    uniforms = counter_uniforms(torch.arange(n, dtype=torch.int64) + 77, torch.zeros(n, dtype=torch.int64), 3)
    proposal = drafter.propose([3] * n, sampling, uniforms)
    tokens = proposal.draft_token_ids.tolist()
    assert drafter.assist_stats.lookup_accepted > 0 and drafter.assist_stats.row_steps < 3 * n
    # The draft model's joint law of three tokens, by brute force over the V^2 prefixes.
    one = SamplingTensors.from_params([params])
    with torch.no_grad():
        def q(prefix):
            return logits_to_probs(draft(torch.tensor([prompt + prefix])).logits[:, -1], one)[0].double()
        law = np.zeros((V, V, V))
        first = q([])
        for a in range(V):
            if first[a] == 0:
                continue
            second = q([a])
            for b in range(V):
                if second[b] > 0:
                    law[a, b] = (first[a] * second[b] * q([a, b])).numpy()
    counts = np.zeros((V, V, V))
    for a, b, c in tokens:
        counts[a, b, c] += 1
    assert counts.ravel()[law.ravel() == 0].sum() == 0
    assert chi_square_pvalue(counts.ravel(), law.ravel()) > 1e-3
    tv = 0.5 * np.abs(counts / n - law).sum()
    assert tv <= tv_tolerance(int((law > 0).sum()), n), tv
    # draft_probs: the draft model's distribution at each handed-up position, for a few rows.
    for row in range(0, n, 997):
        a, b, _ = tokens[row]
        for i, prefix in enumerate([[], [a], [a, b]]):
            torch.testing.assert_close(proposal.draft_probs[row, i].double(), q(prefix), atol=1e-5, rtol=1e-4)


def test_cache_rolls_back_past_rejected_inner_drafts():
    """After proposing (inner drafts rejected along the way) and the target's commit, the draft
    model's next logits equal a fresh forward over the committed tokens."""
    draft = tiny_model("llama", seed=12, layers=1)
    ps = repetitive_prompts()[:4]
    drafter = DraftAssistDrafter(draft, VOCAB, assist_k=3)
    drafter.add_rows(ps)
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(4)]
    sampling = SamplingTensors.from_params(params)
    history = [list(p) for p in ps]
    for step in range(4):
        uniforms = counter_uniforms(torch.arange(4, dtype=torch.int64), torch.full((4,), step, dtype=torch.int64), 4)
        proposal = drafter.propose([4, 2, 3, 0], sampling, uniforms)
        drafts = proposal.draft_token_ids.tolist()
        accepted = [1, 2, 0, 0]
        kept = [d[:a] + [5 + step] for d, a in zip(drafts, accepted)]  # accepted prefix, then a "recovered" token
        drafter.commit(kept, accepted)
        for h, new in zip(history, kept):
            h += new
    assert drafter.assist_stats.lookup_drafted > drafter.assist_stats.lookup_accepted  # some inner drafts were rejected
    logits = drafter.rows.feed(torch.zeros(4, 0, dtype=torch.int64), torch.zeros(4, dtype=torch.int64),
                               torch.ones(4, dtype=torch.int64), 1)[:, 0]
    with torch.no_grad():
        for b, h in enumerate(history):
            torch.testing.assert_close(logits[b], draft(torch.tensor([h])).logits[0, -1], atol=1e-4, rtol=1e-4)


def test_goodput_chooses_two_levels_when_lookup_does_not_pay():
    """Inner k by goodput (raysd.engine.adaptive): where a wider draft forward costs much more than
    the lookup's drafts can pay back, the controller settles on k = 0 (two levels); where it is
    nearly free, it drafts."""
    target, draft = tiny_model("llama"), tiny_model("llama", seed=123, layers=1)
    ps = prompts(seed=4)  # random prompts: few lookups accepted
    costly = StepCosts((1,), ((1.0, 5.0, 9.0, 13.0),), (0.0,))
    cheap = StepCosts((1,), ((1.0, 1.01, 1.02, 1.03),), (0.0,))
    picks = {}
    for name, costs in (("costly", costly), ("cheap", cheap)):
        d = DraftAssistDrafter(draft, VOCAB, assist_k=3, assist_adaptive=AdaptiveConfig(costs, prior_alpha=0.3))
        run(target, d, ps, 4, 8, 16)
        picks[name] = d.assist_stats.assist_k_chosen
    assert set(picks["costly"]) == {0}
    assert max(picks["cheap"]) > 0


def test_profile_inner_costs_shape():
    costs = profile_assist_costs(tiny_model("llama", layers=1), assist_k_max=3, batch_sizes=(1, 2), context=8, reps=1)
    assert costs.k_max == 3 and costs.draft_s == (0.0, 0.0) and costs.batch_sizes == (1, 2)


def test_refusals():
    draft = tiny_model("llama", layers=1)
    with pytest.raises(ValueError, match="assist_k"):
        DraftAssistDrafter(draft, VOCAB, assist_k=-1)
    with pytest.raises(ValueError, match="inner step costs"):
        DraftAssistDrafter(draft, VOCAB, assist_k=4,
                                  assist_adaptive=AdaptiveConfig(StepCosts((1,), ((1.0, 1.0),), (0.0,))))
    with pytest.raises(ValueError, match="assisted"):
        SpecEngine(tiny_model("llama"), DraftAssistDrafter(draft, VOCAB),
                   EngineConfig(SpeculationConfig(num_speculative_tokens=2, tree_budget=4)))
