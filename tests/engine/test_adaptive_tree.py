"""Choosing the tree each step: the controller weighs chains and trees on one
scale of expected goodput, learns the acceptance of each rank from the verification walks, and
drafts a tree only where it beats the best chain. Outputs stay exact whatever it chooses."""

from __future__ import annotations

import numpy as np
import pytest

from raysd.core.sampling import SamplingParams
from raysd.core.speculation import AdaptiveConfig, SpeculationConfig, StepCosts
from raysd.core.theory import expected_tokens_per_step
from raysd.core.tree_shape import RANK_PRIOR, rank_visits, tree_shape
from raysd.engine.adaptive import KController, _TreeCandidate, tree_budgets
from raysd.engine.drafters import DraftModelDrafter, NgramDrafter
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.requests import Request
from tests.conftest import EOS, VOCAB, tiny_model
from tests.engine.test_distribution_e2e import assert_first_two_tokens_follow_target
from tests.engine.test_equivalence import hf_greedy, prompts
from tests.engine.test_host_syncs import count_reads_per_step
from tests.engine.test_tree_draft import flat_copy

P_MAX = 16


def costs(slope: float, draft: float = 0.05, batch_sizes=(1, 8)) -> StepCosts:
    """T_target(B, n) = 1 + slope (n - 1) for n tokens per row: slope 0 is a verifier with
    spare width (a GPU at small batch), slope 1 one whose cost is its tokens."""
    row = tuple(1.0 + slope * k for k in range(P_MAX + 1))
    return StepCosts(batch_sizes, (row,) * len(batch_sizes), (draft,) * len(batch_sizes))


def controller(slope: float, depth: int = 4, draft: float = 0.05, budget: int = P_MAX) -> KController:
    return KController(AdaptiveConfig(costs(slope, draft)), budget, depth)


# ---------------------------------------------------------------- the evidence: the walk by rank


def test_rank_visits_count_where_the_walk_stood_and_went():
    shape = tree_shape(8, 3)  # ranks (0, 1, 0, 1, 0, 0, 1, 0), parents (-1, -1, 0, 0, 1, 2, 2, 3)
    assert shape.ranks == (0, 1, 0, 1, 0, 0, 1, 0) and shape.parents == (-1, -1, 0, 0, 1, 2, 2, 3)
    # Row 0, every node: root -> node 1 (rank 1) -> node 4 (rank 0), which has no child.
    #   at the root: children 0 (rank 0) and 1 (rank 1); at node 1: child 4 (rank 0).
    # Row 1, the first 3 nodes, nothing accepted: at the root, children 0 and 1.
    # Row 2, every node: root -> node 0 -> node 3 (rank 1), which has child 7 (rank 0), rejected.
    #   at the root: 0, 1; at node 0: 2 (rank 0), 3 (rank 1); at node 3: 7 (rank 0).
    offered, moved = rank_visits(shape, [8, 3, 8], [[1, 4], [], [0, 3]])
    assert offered.tolist() == [2 + 1 + 3, 1 + 1 + 2]
    assert moved.tolist() == [1 + 1, 1 + 1]


def test_rank_visits_stop_at_a_rows_last_node():
    shape = tree_shape(8, 3)
    # Only the first 2 nodes (the root's two children): the path ends at node 0, whose children are not the row's.
    offered, moved = rank_visits(shape, [2], [[0]])
    assert offered.tolist() == [1, 1] and moved.tolist() == [1, 0]


# ---------------------------------------------------------------- the expectation


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 1.0])
def test_a_chain_shaped_tree_expects_leviathans_tokens(alpha):
    chain = _TreeCandidate(3, tree_shape(3, 4))
    assert chain.shape.ranks == (0, 0, 0)
    reach = chain.reach(np.array([alpha]), np.asarray(RANK_PRIOR))  # [1, D]
    assert 1 + reach.sum() == pytest.approx(expected_tokens_per_step(alpha, 3))


def test_a_branch_adds_its_ranks_rate_times_its_parents_reach():
    tree = _TreeCandidate(4, tree_shape(4, 4))  # ranks (0, 1, 0, 0): the root's two best children, then a chain
    assert tree.shape.ranks == (0, 1, 0, 0) and tree.shape.depths == (1, 1, 2, 3)
    a, rates = 0.6, np.array([0.0, 0.2, 0.1, 0.05])
    assert tree.reach(np.array([a]), rates)[0].tolist() == pytest.approx([a + 0.2, a**2, a**3])


def test_budgets_weighed():
    assert tree_budgets(0) == () and tree_budgets(1) == (1,) and tree_budgets(2) == (2,)
    assert tree_budgets(16) == (2, 4, 8, 16) and tree_budgets(12) == (2, 4, 8, 12)


# ---------------------------------------------------------------- the choice


def test_without_a_tree_budget_the_plan_is_adaptive_k():
    kc = KController(AdaptiveConfig(costs(0.3)))
    rng = np.random.default_rng(0)
    for _ in range(50):
        B = int(rng.integers(1, 9))
        overlap, tested, room = rng.uniform(0, 20, B).tolist(), rng.integers(20, 40, B).tolist(), rng.integers(0, 5, B).tolist()
        assert kc.choose_plan_from(overlap, tested, room) == (kc.choose_k_from(overlap, tested, room), 0)


def test_a_tree_where_the_verifier_has_spare_width_a_chain_where_it_has_not():
    """At the prior (acceptance 0.5, RANK_PRIOR), a verify that costs the same for 17 tokens as
    for 1 pays for a tree; one whose cost is its tokens does not, and the chain it chooses is
    adaptive K's."""
    wide = controller(slope=0.0)
    assert wide.choose_plan_from([0.0], [0], [4])[1] > 0
    narrow = controller(slope=1.0, draft=0.01)
    k, tree = narrow.choose_plan_from([0.0], [0], [4])
    assert tree == 0 and k == narrow.choose_k_from([0.0], [0], [4])


@pytest.mark.parametrize("slope", [0.0, 0.02, 0.1, 0.3, 1.0])
@pytest.mark.parametrize("draft", [0.0, 0.05, 0.5])
def test_the_plan_never_expects_less_than_the_best_chain(slope, draft):
    kc = controller(slope, depth=6, draft=draft)
    rng = np.random.default_rng(1)
    for _ in range(20):
        B = int(rng.integers(1, 9))
        kc.observe_ranks(rng.integers(0, 50, 4).tolist(), rng.integers(0, 10, 4).tolist())
        alphas = rng.uniform(0, 1, B).tolist()
        room = rng.integers(0, 7, B).tolist()
        overlap, tested = alphas, [1] * B  # the controller shrinks them to its prior; only the order matters here
        k, tree = kc.choose_plan_from(overlap, tested, room)
        shrunk = kc._alphas(overlap, tested)
        chosen = kc.goodput(shrunk, room, k, tree)
        assert all(chosen >= kc.goodput(shrunk, room, j) * (1 - 1e-12) for j in range(7))


def test_measured_ranks_turn_trees_off():
    """The prior expects a rank-1 child to be taken 25% of the time; walks that never take one
    make the same controller draft the chain."""
    kc = controller(slope=0.05, draft=0.01)
    assert kc.choose_plan_from([0.0], [0], [4])[1] > 0
    kc.observe_ranks([400, 400, 400, 0], [200, 0, 0, 0])
    assert kc.rank_rates()[1:3].tolist() == pytest.approx([1.0 / 404, 0.48 / 404])
    assert kc.choose_plan_from([0.0], [0], [4])[1] == 0


def test_step_costs_must_cover_the_largest_tree():
    with pytest.raises(ValueError, match="tree budget"):
        KController(AdaptiveConfig(StepCosts((1,), ((1.0,) * 9,), (0.1,))), tree_budget=16, depth=4)
    with pytest.raises(ValueError, match="tree_budget"):
        speculation = SpeculationConfig(num_speculative_tokens=4, tree_budget=16,
                                        adaptive=AdaptiveConfig(StepCosts((1,), ((1.0,) * 9,), (0.1,))))
        EngineConfig(speculation)


# ---------------------------------------------------------------- exact whatever is chosen


def adaptive_engine(target, drafter, slope: float = 0.01, batch_size: int = 8, K: int = 4) -> SpecEngine:
    speculation = SpeculationConfig(num_speculative_tokens=K, eos_token_ids=(EOS,), tree_budget=P_MAX,
                                    adaptive=AdaptiveConfig(costs(slope)))
    return SpecEngine(target, drafter, EngineConfig(speculation, max_batch_size=batch_size))


@pytest.fixture(scope="module")
def greedy_case():
    target = tiny_model("llama")
    ps = prompts()
    return target, ps, [hf_greedy(target, p, 24) for p in ps]


@pytest.mark.parametrize("draft_kind", ["random", "same", "ngram"])
@pytest.mark.parametrize("batch_size", [1, 8])
def test_greedy_output_is_the_targets_whatever_the_plan(greedy_case, draft_kind, batch_size):
    target, ps, expected = greedy_case
    if draft_kind == "ngram":
        drafter = NgramDrafter(VOCAB)
    else:
        drafter = DraftModelDrafter(target if draft_kind == "same" else tiny_model("llama", seed=123, layers=1), VOCAB)
    engine = adaptive_engine(target, drafter, batch_size=batch_size)
    results = engine.generate([Request(i, p, SamplingParams(max_new_tokens=24)) for i, p in enumerate(ps)])
    assert [r.token_ids for r in results] == expected
    chosen = engine.k_controller.chosen
    assert any(tree for _, tree in chosen), chosen  # trees were drafted ...
    if draft_kind == "same":  # ... and a draft the target always accepts takes no branch: chains win
        assert any(k and not tree for k, tree in chosen), chosen
        assert engine.k_controller.rank_moved[1:].sum() == 0


def test_joint_law_of_two_tokens_matches_target_with_trees_and_chains_mixed():
    """tests/engine/test_tree_draft.py's law test with the plan chosen each step: N seeded rows'
    first two tokens against the target's exact joint law."""
    V, K, N = 8, 3, 6000
    target = tiny_model("llama", seed=11, vocab=V)
    prompt = [3, 5, 2, 3, 5]
    base = SamplingParams(temperature=0.9, top_k=6, top_p=0.95, max_new_tokens=K + 1, ignore_eos=True)
    engine = adaptive_engine(target, DraftModelDrafter(flat_copy(target), V), slope=0.02, batch_size=500, K=K)
    results = engine.generate([Request(i, prompt, SamplingParams(**{**base.__dict__, "seed": 30_000 + i})) for i in range(N)])
    assert_first_two_tokens_follow_target(results, target, prompt, base, length=K + 1)
    chosen = engine.k_controller.chosen
    assert any(tree for _, tree in chosen) and any(k and not tree for k, tree in chosen), chosen


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_an_adaptive_tree_step_reads_back_once(temperature, monkeypatch):
    target = tiny_model("llama", seed=0)
    engine = adaptive_engine(target, DraftModelDrafter(tiny_model("llama", seed=5, layers=1), VOCAB), batch_size=4)
    per_step = count_reads_per_step(engine, monkeypatch)
    params = SamplingParams(temperature=temperature, max_new_tokens=12, seed=3, ignore_eos=True)
    results = engine.generate([Request(i, p, params) for i, p in enumerate(prompts(lengths=(5, 9, 3, 7, 4, 6)))])
    assert all(len(r.token_ids) == 12 for r in results)
    assert per_step and all(n <= 1 for n, _ in per_step), per_step
    assert any(tree for _, tree in engine.k_controller.chosen)


def test_a_controller_unpickled_read_only_still_learns():
    """Ray hands an actor a controller whose arrays are read-only views of the object store."""
    kc = controller(slope=0.05)
    kc.rank_offered.setflags(write=False)
    kc.rank_moved.setflags(write=False)
    kc.observe_ranks((3, 2), (1, 1))
    kc.observe_ranks((1, 1, 1, 1, 1), (0, 0, 0, 0, 1))  # a rank past RANK_PRIOR's is dropped
    assert kc.rank_offered.tolist() == [4, 3, 1, 1] and kc.rank_moved.tolist() == [1, 1, 0, 0]
