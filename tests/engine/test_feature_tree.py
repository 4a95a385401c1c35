"""Draft trees from the EAGLE feature draft: FeatureDrafter.propose_tree grows
EAGLE-2's tree from the target's features and its own hidden states; the verifier hands back the
features of the tree's head and accepted path. Layers: each node reads the right feature (against
the draft run by hand without a cache); the output stays the target's (greedy token for token,
sampled in law); one read-back per step; the tree chosen each step."""

from __future__ import annotations

import pytest
import torch

from raysd.core.sampling import SamplingParams, SamplingTensors, logits_to_probs
from raysd.core.speculation import AdaptiveConfig, SpeculationConfig, StepCosts
from raysd.core.tree_shape import tree_shape
from raysd.engine.drafters import FeatureDrafter
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.requests import Request
from raysd.models.eagle_draft import EagleDraft, final_norm
from tests.conftest import VOCAB, tiny_model
from tests.engine.test_equivalence import hf_greedy, prompts
from tests.engine.test_feature_draft import V, assert_first_three_follow_target


def eagle_tree_engine(target, P: int, K: int, batch: int, seed: int = 0, vocab: int = VOCAB,
                      adaptive: AdaptiveConfig | None = None) -> SpecEngine:
    draft = EagleDraft.from_target(target, init_layer=-1, seed=seed)  # untrained: a weak but real draft
    spec = SpeculationConfig(num_speculative_tokens=K, tree_budget=P, adaptive=adaptive)
    return SpecEngine(target, FeatureDrafter(draft, vocab), EngineConfig(spec, max_batch_size=batch))


# ---------------------------------------------------------------- each node reads the right feature


@torch.no_grad()
def target_features(target, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), H]: the target's pre-norm last-layer hidden states (EAGLE's features)."""
    seen = []
    handle = final_norm(target).register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    target(torch.tensor([prompt]))
    handle.remove()
    return seen[0][0]


def warm_drafter(draft: EagleDraft, target, ps: list[list[int]]) -> FeatureDrafter:
    """A drafter in the state after each row's first step: the prompt's features and one token."""
    d = FeatureDrafter(draft, VOCAB)
    d.add_rows(ps)
    d.commit([[7 + b] for b in range(len(ps))], [0] * len(ps), [target_features(target, p) for p in ps])
    return d


def test_the_rank0_path_is_the_chain():
    target = tiny_model("llama", seed=0)
    draft = EagleDraft.from_target(target, init_layer=-1, seed=1)
    ps = [p[:n] for p, n in zip(prompts(seed=4), (6, 11, 3))]  # several lengths: grouped catch-up forwards
    B, K = len(ps), 3
    shape = tree_shape(8, K)  # parents (-1, -1, 0, 0, 1, 2, 2, 3), ranks (0, 1, 0, 1, 0, 0, 1, 0)
    assert shape.parents[:8] == (-1, -1, 0, 0, 1, 2, 2, 3) and shape.ranks[:8] == (0, 1, 0, 1, 0, 0, 1, 0)
    sampling = SamplingTensors.from_params([SamplingParams(temperature=1.0)] * B, "cpu")
    g = torch.Generator().manual_seed(0)
    chain_u = torch.rand(B, K, generator=g, dtype=torch.float64)
    tree_u = torch.rand(B, shape.num_nodes, generator=g, dtype=torch.float64)
    rank0_path = [0, 2, 5]  # root -> 0 -> 2 -> 5, every step the sampled child
    tree_u[:, rank0_path] = chain_u

    chain_drafter, tree_drafter = warm_drafter(draft, target, ps), warm_drafter(draft, target, ps)
    chain = chain_drafter.propose([K] * B, sampling, chain_u)
    tree = tree_drafter.propose_tree(shape, [K] * B, sampling, tree_u)
    assert tree.draft_token_ids.shape == (B, 8) and tree.num_draft_host == (8,) * B
    assert torch.equal(tree.draft_token_ids[:, rank0_path], chain.draft_token_ids)
    torch.testing.assert_close(tree.draft_probs[:, rank0_path], chain.draft_probs, atol=1e-5, rtol=1e-5)
    # nothing drafted is kept: both caches hold the positions that read the target's features
    assert tree_drafter.runner.lengths.tolist() == chain_drafter.runner.lengths.tolist() == [len(p) for p in ps]


@torch.no_grad()
def test_every_node_reads_its_parents_hidden_state():
    """Each sampled (rank-0) node's draft_probs is the draft's law after its parent's path: the
    target's features, then the draft's own hidden state at each node of the path, fed one by
    one. The draft is run here by hand over the whole sequence without a cache."""
    target = tiny_model("llama", seed=0)
    draft = EagleDraft.from_target(target, init_layer=-1, seed=1)
    ps = [p[:n] for p, n in zip(prompts(seed=6), (8, 4))]
    B, K = len(ps), 3
    shape = tree_shape(16, K)  # second- and third-best nodes with children at depth 2 and 3
    sampling = SamplingTensors.from_params([SamplingParams(temperature=1.0)] * B, "cpu")
    uniforms = torch.rand(B, shape.num_nodes, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    tree = warm_drafter(draft, target, ps).propose_tree(shape, [K] * B, sampling, uniforms)
    one = SamplingTensors.from_params([SamplingParams(temperature=1.0)], "cpu")
    for b, p in enumerate(ps):
        F = target_features(target, p)[None]  # [1, L, H]
        tokens = torch.tensor([p[1:] + [7 + b]])  # [1, L]: the token after each position
        for node in range(shape.num_nodes):
            if shape.ranks[node] != 0:
                continue
            path = []  # the parent's path from the root, tokens in order
            up = shape.parents[node]
            while up >= 0:
                path.insert(0, tree.draft_token_ids[b, up].view(1, 1))
                up = shape.parents[up]
            feats, toks = F, tokens
            logits, hidden = draft(feats, toks)  # [1, n, V], [1, n, H]
            for t in path:  # each path node reads the hidden state at the position before it
                feats, toks = torch.cat([feats, hidden[:, -1:]], dim=1), torch.cat([toks, t], dim=1)
                logits, hidden = draft(feats, toks)
            torch.testing.assert_close(logits_to_probs(logits[:, -1], one)[0], tree.draft_probs[b, node],
                                       atol=1e-5, rtol=1e-5, msg=f"row {b}, node {node}")


def test_the_draft_receives_the_targets_features_of_the_accepted_path():
    """After each tree step the draft gets the target's features of the tree's head and the
    accepted path's nodes: over a row's life, exactly the features a full target forward over
    the finished sequence computes, position by position."""
    target = tiny_model("llama", seed=0)
    ps = prompts(seed=2)[:3]
    engine = eagle_tree_engine(target, 8, 3, 3)
    received: list[list[torch.Tensor]] = [[] for _ in ps]
    commit = engine.drafter.commit

    def recording_commit(new_tokens, num_accepted=None, features=None):
        for b, f in enumerate(features):  # rows leave as they finish: file by the request's index
            received[engine.draft.batch.ids[b]].append(f.clone())
        return commit(new_tokens, num_accepted, features)

    engine.drafter.commit = recording_commit
    results = engine.generate([Request(i, p, SamplingParams(max_new_tokens=12, ignore_eos=True)) for i, p in enumerate(ps)])
    assert sum(r.stats.num_accepted_draft_tokens for r in results) > 0
    for b, r in enumerate(results):
        full = target_features(target, list(r.prompt_token_ids) + r.token_ids)  # [L, H]
        got = torch.cat(received[b])
        assert got.shape[0] == full.shape[0] - 1  # all but the unread last token
        torch.testing.assert_close(got, full[:-1], atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- the target's output


@pytest.mark.parametrize("P,K", [(4, 3), (8, 4), (16, 4)])
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_output_is_the_targets_own(P, K, batch):
    target = tiny_model("llama", seed=0)
    ps = prompts(seed=1)[: 3 if batch == 1 else 8]
    lengths = (14, 3, 9, 14, 1, 7, 12, 5)
    engine = eagle_tree_engine(target, P, K, batch)
    results = engine.generate([Request(i, p, SamplingParams(max_new_tokens=n, ignore_eos=True))
                               for i, (p, n) in enumerate(zip(ps, lengths))])
    for p, n, r in zip(ps, lengths, results):
        assert r.token_ids == hf_greedy(target, p, n)
    per_drafting_step = [r.stats.num_draft_tokens / max(1, r.stats.num_spec_steps - r.stats.num_steps_without_drafts)
                         for r in results]
    assert max(per_drafting_step) > K  # trees, wider than a chain of K, were drafted and verified
    assert engine.draft.drafter.runner.num_rows == 0 and engine.target.rows.runner.num_rows == 0


N = 12_000  # V = 6: three tokens, 216 cells of ~56 expected counts each


def test_sampled_output_follows_the_targets_law():
    """The first step drafts nothing (the target prefills); with 4 tokens to go the second drafts
    a tree of 4 nodes, 2 deep, for the second and third tokens (a step emits its drafts and one
    more). The joint law of the first three equals the target's: chi-square at 1e-3, total
    variation within its sample-size bound."""
    target = tiny_model("llama", seed=11, vocab=V)
    prompt = [3, 5, 1, 3, 5]
    base = SamplingParams(temperature=0.9, top_k=5, max_new_tokens=4, ignore_eos=True)
    engine = eagle_tree_engine(target, 4, 2, 2000, seed=3, vocab=V)
    results = engine.generate([Request(i, prompt, SamplingParams(**{**base.__dict__, "seed": 60_000 + i}))
                               for i in range(N)])
    assert_first_three_follow_target(results, target, prompt, base)
    assert sum(r.stats.num_accepted_draft_tokens for r in results) > N / 20  # the trees were used
    assert all(r.stats.num_draft_tokens >= 4 for r in results)  # each row's second step: the tree of 4 nodes


# ---------------------------------------------------------------- chosen each step (one read-back: test_tree_draft.py)


def test_the_tree_chosen_each_step_keeps_greedy_output():
    """-k auto with a tree budget and a feature draft, on costs of a verifier with spare width."""
    target = tiny_model("llama", seed=0)
    P, K = 8, 4
    costs = StepCosts((1, 8), (tuple(1.0 + 0.01 * n for n in range(P + 1)),) * 2, (0.05, 0.05))
    engine = eagle_tree_engine(target, P, K, 8, adaptive=AdaptiveConfig(costs))
    ps = prompts(seed=5)
    results = engine.generate([Request(i, p, SamplingParams(max_new_tokens=12, ignore_eos=True)) for i, p in enumerate(ps)])
    assert [r.token_ids for r in results] == [hf_greedy(target, p, 12) for p in ps]
    assert any(tree for _, tree in engine.k_controller.chosen), engine.k_controller.chosen
