"""Draft trees through the engine (EngineConfig.tree_budget): the shape, the drafting rule's
law by exact enumeration, greedy output identical to the target's own `generate`, a draft
equal to the target accepting whole paths, the joint law of two sampled tokens (chi-square),
seeded reproducibility, one read-back per step, and the one-line refusals."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from raysd.core.sampling import SamplingParams
from raysd.core.speculation import AdaptiveConfig, SpeculationConfig, StepCosts
from raysd.core.tree_shape import RANK_PRIOR, tree_shape
from raysd.engine.drafters import DraftModelDrafter, FeatureDrafter, NgramDrafter
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.requests import Request
from tests.conftest import EOS, VOCAB, tiny_eagle, tiny_model
from tests.core import test_tree as core
from tests.engine.test_distribution_e2e import assert_first_two_tokens_follow_target, copyable_prompt
from tests.engine.test_equivalence import hf_greedy, prompts
from tests.engine.test_host_syncs import count_reads_per_step


def engine_for(target, draft, P: int, K: int = 4, batch_size: int = 8, **config) -> SpecEngine:
    vocab = target.get_output_embeddings().weight.shape[0]
    speculation = SpeculationConfig(num_speculative_tokens=K, eos_token_ids=(EOS,), tree_budget=P)
    return SpecEngine(target, DraftModelDrafter(draft, vocab), EngineConfig(speculation, max_batch_size=batch_size, **config))


# ---------------------------------------------------------------- the shape


@pytest.mark.parametrize("P", [1, 2, 4, 8, 16, 64])
@pytest.mark.parametrize("K", [1, 3, 4, 8])
def test_the_shape_is_a_breadth_first_tree_of_at_most_P_nodes(P, K):
    s = tree_shape(P, K)
    assert s.num_nodes == P or max(s.depths) == K  # fills the budget unless the prior's ranks run out
    assert s.num_nodes <= P and max(s.depths) <= K
    assert list(s.depths) == sorted(s.depths)
    for i, (up, r) in enumerate(zip(s.parents, s.ranks)):
        assert up < i and s.depths[i] == (s.depths[up] + 1 if up >= 0 else 1)
        siblings = [j for j in range(s.num_nodes) if s.parents[j] == up]
        assert siblings == list(range(siblings[0], siblings[0] + len(siblings)))  # consecutive
        assert [s.ranks[j] for j in siblings] == list(range(len(siblings)))  # in rank order
        assert r < len(RANK_PRIOR)
    deepest = max(s.depths)
    chain = [i for i in range(s.num_nodes) if all(s.ranks[j] == 0 for j in _path(s, i))]
    assert sorted(s.depths[i] for i in chain) == list(range(1, deepest + 1))  # the rank-0 chain is deepest
    for d in range(deepest + 1):
        assert all(s.depths[i] <= d for i in range(s.nodes_within(d)))  # shallow nodes are a prefix


def _path(s, i):
    return (_path(s, s.parents[i]) if s.parents[i] >= 0 else []) + [i]


def test_small_budgets_give_chains_then_branches():
    assert tree_shape(1, 4).parents == (-1,)
    assert tree_shape(3, 4).parents == (-1, 0, 1)  # the prior prefers depth first
    assert tree_shape(4, 4).ranks == (0, 1, 0, 0)  # then the root's second child
    with pytest.raises(ValueError):
        tree_shape(0, 4)


# ---------------------------------------------------------------- the drafting rule's law


def drafted_law(ctx: tuple, shape: list, one_hot: bool = True) -> dict[tuple, float]:
    """Law of the tokens one verification emits when each node's first child is drawn from the
    draft q and its r-th child is q's r-th most likely other token (one-hot), as
    DraftModelDrafter.propose_tree drafts, tested as tree_rejection_sample tests: by
    enumeration of every draw and, in closed form, of every acceptance test. `one_hot=False`
    tests the alternatives as if drawn from q (wrong)."""
    q, law = core.draft(ctx), {}
    draws = [(x, q[x]) for x in range(core.V)] if shape else [(None, 1.0)]
    for x0, pr_draw in draws:
        others = [int(t) for t in np.argsort(-q, kind="stable") if t != x0]
        xs = ([x0] + others)[: len(shape)]
        p, remaining = core.target(ctx).copy(), 1.0
        for j, (x, child) in enumerate(zip(xs, shape)):
            qi = q if j == 0 or not one_hot else np.eye(core.V)[x]
            a = min(1.0, p[x] / qi[x])
            for seq, pr in drafted_law(ctx + (x,), child, one_hot).items():
                law[(x,) + seq] = law.get((x,) + seq, 0.0) + pr_draw * remaining * a * pr
            remaining *= 1 - a
            residual = np.maximum(p - qi, 0.0)
            p = residual / residual.sum() if residual.sum() > 0 else p
        for y in range(core.V):
            law[(y,)] = law.get((y,), 0.0) + pr_draw * remaining * p[y]
    return law


@pytest.mark.parametrize("name", list(core.SHAPES))
def test_a_sampled_first_child_and_top_alternatives_give_the_target_law(name):
    """The alternatives depend on the first child's draw (they exclude it); still exact, since
    given the draw the remaining siblings are tested against the residual it left."""
    ctx = (1,)
    law = drafted_law(ctx, core.SHAPES[name])
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-12)
    got, want = core.extended(law, ctx, 4), core.target_law(ctx, 4)
    for seq in want:
        assert got.get(seq, 0.0) == pytest.approx(want[seq], abs=1e-12), seq


def test_the_enumeration_has_power():
    """Alternatives tested as if drawn from q: the enumeration sees the bias."""
    got, want = core.extended(drafted_law((1,), core.BINARY2, one_hot=False), (1,), 2), core.target_law((1,), 2)
    assert max(abs(got.get(k, 0.0) - v) for k, v in want.items()) > 1e-2


# ---------------------------------------------------------------- greedy: the target's own tokens


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def arch_target(request):
    target = tiny_model(request.param)
    ps = prompts()
    return request.param, target, ps, [hf_greedy(target, p, 24) for p in ps]


@pytest.mark.parametrize("P", [1, 4, 8, 16])
@pytest.mark.parametrize("draft_kind", ["same", "random"])
@pytest.mark.parametrize("batch_size", [1, 8])
def test_greedy_tree_matches_target_generate(arch_target, P, draft_kind, batch_size):
    arch, target, ps, expected = arch_target
    if batch_size == 1:
        ps, expected = ps[:3], expected[:3]
    draft = target if draft_kind == "same" else tiny_model(arch, seed=123, layers=1)
    engine = engine_for(target, draft, P, batch_size=batch_size)
    results = engine.generate([Request(i, p, SamplingParams(max_new_tokens=24)) for i, p in enumerate(ps)])
    assert [r.token_ids for r in results] == expected
    for r in results:
        s = r.stats
        assert sum(s.acceptance_histogram) == s.num_spec_steps
        assert sum(j * h for j, h in enumerate(s.acceptance_histogram)) == s.num_accepted_draft_tokens
        assert s.num_draft_tokens <= P * s.num_spec_steps and 0 <= s.num_branch_accepts <= s.num_accepted_draft_tokens
    assert engine.target.rows.runner.num_rows == 0 and engine.draft.drafter.rows.runner.num_rows == 0


@pytest.mark.parametrize("P", [4, 16])
@pytest.mark.parametrize("batch_size", [1, 8])
def test_ngram_tree_matches_target_generate(arch_target, P, batch_size):
    arch, target, ps, expected = arch_target
    if batch_size == 1:
        ps, expected = ps[:3], expected[:3]
    speculation = SpeculationConfig(num_speculative_tokens=4, eos_token_ids=(EOS,), tree_budget=P)
    engine = SpecEngine(target, NgramDrafter(VOCAB), EngineConfig(speculation, max_batch_size=batch_size))
    results = engine.generate([Request(i, p, SamplingParams(max_new_tokens=24)) for i, p in enumerate(ps)])
    assert [r.token_ids for r in results] == expected


def test_ngram_branches_are_the_continuations_of_several_matches():
    d = NgramDrafter(VOCAB)
    history = [5, 6, 7, 8, 1, 5, 6, 9, 2, 5, 6, 7, 3, 5, 6]  # "5 6" was followed by 7 3, 9 2 and 7 8
    shape = tree_shape(8, 3)  # ranks (0, 1, 0, 1, 0, 0, 1, 0), parents (-1, -1, 0, 0, 1, 2, 2, 3)
    assert d.tree_tokens(history, shape, 3) == [7, 9, 3, 8, 2, 5, 5, 1]  # node 6: no 2nd token after 7 3: a repeat
    tokens = d.tree_tokens(history, shape, 3)
    assert [tokens[i] for i in (0, 2, 5)] == [7, 3, 5] == d.lookup(history, 3)  # the rank-0 chain: nodes 0 -> 2 -> 5
    assert d.tree_tokens([1, 2, 3], shape, 3) == []  # no match: no tree


def test_a_wide_tree_accepts_branches_a_chain_would_not_draft():
    """A weak draft at temperature 0: some accepted tokens are the draft's second or third choice."""
    target = tiny_model("llama")
    draft = tiny_model("llama", seed=7, layers=1)
    results = engine_for(target, draft, 16).generate(
        [Request(i, p, SamplingParams(max_new_tokens=24)) for i, p in enumerate(prompts())])
    assert sum(r.stats.num_branch_accepts for r in results) > 0


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("P,K", [(4, 3), (8, 4), (16, 4)])
def test_draft_equal_to_target_accepts_the_whole_path(P, K, temperature):
    target = tiny_model("llama")
    D = max(tree_shape(P, K).depths)
    # max_new_tokens a multiple of D + 1 and EOS ignored: every step drafts the full tree and keeps D + 1.
    params = [SamplingParams(temperature=temperature, seed=i, max_new_tokens=3 * (D + 1), ignore_eos=True) for i in range(8)]
    results = engine_for(target, target, P, K).generate([Request(i, p, params[i]) for i, p in enumerate(prompts())])
    for r in results:
        s = r.stats
        assert len(r.token_ids) == 3 * (D + 1)
        assert s.mean_acceptance_length == D + 1 and s.mean_accepted_depth == D
        assert s.mean_nodes_verified == tree_shape(P, K).num_nodes
        assert s.alpha_estimate == pytest.approx(1.0) and s.num_branch_accepts == 0
        assert s.acceptance_histogram == [0] * D + [3] + [0] * (K - D)


# ---------------------------------------------------------------- sampling: the target's law


N = 6000  # samples; 64 cells of ~94 expected counts each


def flat_copy(target, scale: float = 0.4):
    """The target with its output layer scaled down: an under-confident draft, whose sample is
    often rejected where the target is sure, and whose next choices are then the target's."""
    draft = copy.deepcopy(target)
    with torch.no_grad():
        draft.get_output_embeddings().weight.mul_(scale)
    return draft


@pytest.mark.parametrize("draft_kind", ["random", "flat", "ngram"])
@pytest.mark.parametrize("P,K", [(4, 2), (6, 3)])
def test_joint_law_of_two_tokens_matches_target(P, K, draft_kind):
    """As tests/engine/test_distribution_e2e.py, through a tree: the first two tokens of N seeded
    rows (each generating K + 1, so the first step drafts the whole tree) against the target's
    exact joint law: chi-square at 1e-3, TV within the McDiarmid bound at 1e-6."""
    V = 8
    target = tiny_model("llama", seed=11, vocab=V)
    prompt = copyable_prompt(target)
    base = SamplingParams(temperature=0.9, top_k=6, top_p=0.95, max_new_tokens=K + 1, ignore_eos=True)
    if draft_kind == "ngram":  # [3, 5, t, 3, 5, 3, 5]: after "3 5", t and 3 are both continuations
        prompt = prompt + [3, 5]
        speculation = SpeculationConfig(num_speculative_tokens=K, eos_token_ids=(EOS,), tree_budget=P)
        engine = SpecEngine(target, NgramDrafter(V), EngineConfig(speculation, max_batch_size=1000))
    else:
        draft = tiny_model("llama", seed=12, layers=1, vocab=V) if draft_kind == "random" else flat_copy(target)
        engine = engine_for(target, draft, P, K, batch_size=1000)
    results = engine.generate([Request(i, prompt, SamplingParams(**{**base.__dict__, "seed": 20_000 + i})) for i in range(N)])
    assert_first_two_tokens_follow_target(results, target, prompt, base, length=K + 1)
    assert sum(r.stats.num_accepted_draft_tokens for r in results) > N / 20  # the tree was used
    if draft_kind != "random":  # and its branches: accepted alternatives after a rejected draft
        assert sum(r.stats.num_branch_accepts for r in results) > N / 100


def test_same_seed_same_tokens_whatever_the_batch():
    target = tiny_model("llama")
    draft = tiny_model("llama", seed=3, layers=1)
    ps = prompts()
    params = [SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=100 + i, max_new_tokens=16) for i in range(len(ps))]

    def sample(batch_size, order):
        res = engine_for(target, draft, 8, batch_size=batch_size).generate([Request(i, ps[i], params[i]) for i in order])
        return {r.request_id: r.token_ids for r in res}

    alone = sample(1, range(len(ps)))
    assert sample(8, range(len(ps))) == alone
    assert sample(3, reversed(range(len(ps)))) == alone


# ---------------------------------------------------------------- one read-back per step


@pytest.mark.parametrize("kind", ["model", "eagle", "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_tree_step_reads_back_once(temperature, kind, monkeypatch):
    target = tiny_model("llama", seed=0)
    if kind == "model":
        engine = engine_for(target, tiny_model("llama", seed=5, layers=1), 8, batch_size=4)
    elif kind == "eagle":
        speculation = SpeculationConfig(num_speculative_tokens=4, eos_token_ids=(EOS,), tree_budget=8)
        engine = SpecEngine(target, FeatureDrafter(tiny_eagle(), VOCAB), EngineConfig(speculation, max_batch_size=4))
    else:
        speculation = SpeculationConfig(num_speculative_tokens=4, eos_token_ids=(EOS,), tree_budget=8)
        engine = SpecEngine(target, NgramDrafter(VOCAB), EngineConfig(speculation, max_batch_size=4))
    per_step = count_reads_per_step(engine, monkeypatch)
    params = SamplingParams(temperature=temperature, max_new_tokens=12, seed=3, ignore_eos=True)
    results = engine.generate([Request(i, p, params) for i, p in enumerate(prompts(lengths=(5, 9, 3, 7, 4, 6)))])
    assert all(len(r.token_ids) == 12 for r in results)
    assert per_step and all(n <= 1 for n, _ in per_step), per_step


# ---------------------------------------------------------------- what a tree refuses


def test_unsupported_configurations_fail_at_once():
    target = tiny_model("llama")
    with pytest.raises(ValueError, match="static runner"):
        EngineConfig(SpeculationConfig(tree_budget=4), runner="dynamic")
    with pytest.raises(ValueError, match="tree_budget"):  # an adaptive tree of P nodes needs T_target(B, P + 1)
        costs = StepCosts((1,), ((1.0,) * 9,), (0.1,))
        EngineConfig(SpeculationConfig(tree_budget=16, adaptive=AdaptiveConfig(costs)))
    with pytest.raises(ValueError, match="exact"):
        EngineConfig(SpeculationConfig(tree_budget=4, acceptance="relaxed:0.5"))
    with pytest.raises(ValueError, match="tree_budget"):
        EngineConfig(SpeculationConfig(tree_budget=-1))
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(SpeculationConfig(tree_budget=4, num_speculative_tokens=0))
    for drafter in (FeatureDrafter(tiny_eagle(), VOCAB, runner="dynamic"),
                    DraftModelDrafter(tiny_model("llama", seed=1, layers=1), VOCAB, runner="dynamic")):
        with pytest.raises(ValueError, match="tree drafting needs the static runner and a draft-model, EAGLE, n-gram or suffix drafter"):
            SpecEngine(target, drafter, EngineConfig(SpeculationConfig(tree_budget=4)))
    with pytest.raises(ValueError, match="target"):
        speculation = SpeculationConfig(tree_budget=4)
        SpecEngine(tiny_model("gpt2"), DraftModelDrafter(tiny_model("llama", seed=1, layers=1), VOCAB), EngineConfig(speculation))
