"""The suffix drafter (raysd.engine.suffix, SuffixDecoding): exact drafts on hand-built histories,
the shared index's bound and eviction, provenance counts, then through the engine: greedy output
identical to the target's own `generate` (chains on both runners, a tree), and sampled output
following the target's exact law of two tokens."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from raysd.core.sampling import SamplingParams, SamplingTensors
from raysd.core.speculation import SpeculationConfig
from raysd.core.tree_shape import tree_shape
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.requests import Request
from raysd.engine.suffix import OTHER, SELF, SuffixConfig, SuffixDrafter, SuffixIndex, tree_tokens
from tests.conftest import EOS, VOCAB, tiny_model
from tests.engine.test_distribution_e2e import assert_first_two_tokens_follow_target
from tests.engine.test_equivalence import hf_greedy, prompts

LONG = SuffixConfig(max_spec_factor=4.0)  # long drafts after short matches, to see whole continuations


def drafter(rows, index_sequences=(), config=SuffixConfig(), vocab=VOCAB) -> SuffixDrafter:
    index = SuffixIndex()
    for s in index_sequences:
        index.insert(s)
    d = SuffixDrafter(vocab, index, config)
    d.add_rows(rows)
    return d


def propose(d: SuffixDrafter, ks):
    sampling = SamplingTensors.from_params([SamplingParams()] * len(ks), "cpu")
    p = d.propose(ks, sampling, torch.zeros(len(ks), max(ks)))
    return [p.draft_token_ids[b, :n].tolist() for b, n in enumerate(p.num_draft_host)], p


# ---------------------------------------------------------------- drafts on hand-built histories


def test_own_history_match_copies_what_followed():
    d = drafter([[5, 6, 7, 8, 9, 5, 6]], config=LONG)
    drafts, p = propose(d, [6])
    assert drafts == [[7, 8, 9, 5, 6]]  # "5 6" was followed by 7 8 9 5 6, then the row ends
    assert d.candidate(0, 6).source == SELF
    assert p.draft_probs.shape == (1, 5, VOCAB) and p.draft_probs.sum() == 5 and p.draft_probs[0, 2, 9] == 1
    assert d.last_confidence.tolist() == [[1.0] * 5]  # one occurrence: every step certain
    assert propose(d, [3])[0] == [[7, 8, 9]] and propose(d, [0])[0] == [[]]


def test_a_match_only_in_another_finished_row():
    d = drafter([[20, 10, 11]], index_sequences=[[10, 11, 12, 13, 14]], config=LONG)
    assert propose(d, [6])[0] == [[12, 13, 14]]
    assert d.candidate(0, 6).source == OTHER
    assert propose(drafter([[20, 10, 11]], config=LONG), [6])[0] == [[]]  # nothing without the index


def test_the_most_frequent_continuation_wins_over_a_more_recent_one():
    seqs = [[1, 2, 3, 4, 40], [1, 2, 3, 4, 40], [1, 2, 3, 4, 50]]  # 50 is the most recent
    d = drafter([[9, 2, 3, 4]], index_sequences=seqs)
    assert propose(d, [4])[0] == [[40]]
    assert d.last_confidence[0].tolist() == pytest.approx([2 / 3])  # 2 of the 3 occurrences
    tie = drafter([[9, 2, 3, 4]], index_sequences=seqs[1:])  # one each: the most recent
    assert propose(tie, [4])[0] == [[50]]


def test_only_the_most_recent_occurrences_count_past_the_work_bound():
    seqs = [[1, 2, 40]] * 3 + [[1, 2, 50]] * 2
    assert propose(drafter([[9, 2]], seqs), [4])[0] == [[40]]  # 3 of 5
    assert propose(drafter([[9, 2]], seqs, SuffixConfig(max_occurrences=2)), [4])[0] == [[50]]  # 2 of the last 2


def test_a_weak_match_offers_fewer_tokens():
    # The adaptive length: after a match of n tokens at most n drafts (max_spec_factor 1).
    index = [[30, 31, 32, 33, 34, 35, 36]]
    assert propose(drafter([[99, 31, 32]], index), [6])[0] == [[33, 34]]
    assert propose(drafter([[30, 31, 32]], index), [6])[0] == [[33, 34, 35]]
    # The confidence threshold: after "7 8", 1 (3 of 4), then 2 (2 of 3), then 3 or 4 (1 of 2 each).
    seqs = [[7, 8, 1, 2, 3], [7, 8, 1, 2, 4], [7, 8, 1, 5, 6], [7, 8, 9, 9, 9]]
    for threshold, expected, confidence in [(0.6, [1], [0.75]), (0.3, [1, 2], [0.75, 0.5]),
                                            (0.2, [1, 2, 4], [0.75, 0.5, 0.25])]:
        d = drafter([[7, 8]], seqs, SuffixConfig(max_spec_factor=4.0, min_token_prob=threshold))
        assert propose(d, [6])[0] == [expected]
        assert d.last_confidence[0].tolist() == pytest.approx(confidence)


def test_tree_branches_are_the_next_most_frequent_tokens():
    seqs = [[7, 8, 1, 2, 3], [7, 8, 1, 2, 4], [7, 8, 1, 5, 6], [7, 8, 9, 9, 9]]
    shape = tree_shape(8, 3)  # parents (-1, -1, 0, 0, 1, 2, 2, 3), ranks (0, 1, 0, 1, 0, 0, 1, 0)
    assert shape.parents == (-1, -1, 0, 0, 1, 2, 2, 3)
    d = drafter([[7, 8]], seqs, SuffixConfig(max_spec_factor=4.0, min_token_prob=0.2))
    tokens, conf = tree_tokens(d.candidate(0, 3), shape, 3, 0.2)
    assert tokens == [1, 9, 2, 5, 9, 4, 3, 6]
    assert conf == pytest.approx([0.75, 0.25, 0.5, 0.25, 0.25, 0.25, 0.25, 0.25])
    assert [tokens[i] for i in (0, 2, 5)] == propose(d, [3])[0][0]  # the rank-0 chain is the chain's draft
    # Below the threshold a node repeats its sibling (or, at rank 0, its parent); cut after depth 2.
    assert tree_tokens(d.candidate(0, 3), shape, 3, 0.3) == ([1, 1, 2, 2, 1], [0.75, 0.0, 0.5, 0.0, 0.0])
    p = d.propose_tree(shape, [3], SamplingTensors.from_params([SamplingParams()], "cpu"), torch.zeros(1, 8))
    assert p.num_draft_host == (8,) and p.draft_token_ids[0].tolist() == tokens and d.last_confidence.shape == (1, 8)


# ---------------------------------------------------------------- the shared index


def test_eviction_drops_the_oldest_sequence_and_the_bounds_hold():
    index = SuffixIndex(max_sequences=2, max_tokens=100)
    for s in ([1, 2, 3], [4, 5, 6], [7, 8, 9]):
        index.insert(s)
        assert len(index) <= 2
    assert index.sequences() == [[4, 5, 6], [7, 8, 9]]
    assert index.occurrences(2).size == 0 and index.occurrences(5).size == 1
    d = SuffixDrafter(VOCAB, index, LONG)
    d.add_rows([[1, 2], [4, 5]])
    assert propose(d, [4, 4])[0] == [[], [6]]  # the evicted sequence no longer drafts
    tokens = SuffixIndex(max_sequences=10, max_tokens=8)
    for s in ([1, 2, 3, 4, 5], [6, 7, 8, 9], list(range(10, 30))):
        tokens.insert(s)
        assert tokens.num_tokens <= 8
    assert tokens.sequences() == [list(range(22, 30))]  # longer than the bound: its last tokens


def test_after_many_evictions_the_index_answers_as_one_built_from_its_live_sequences():
    rng = np.random.default_rng(0)
    index = SuffixIndex(max_sequences=7, max_tokens=60)
    for _ in range(200):  # compacts many times
        index.insert(rng.integers(3, 12, rng.integers(1, 15)).tolist())
    fresh = SuffixIndex()
    for s in index.sequences():
        fresh.insert(s)
    assert len(index) <= 7 and index.num_tokens <= 60 and index.buf.size <= 3 * 60 + 16
    rows = [rng.integers(3, 12, 6).tolist() for _ in range(30)]
    a, b = SuffixDrafter(VOCAB, index, LONG), SuffixDrafter(VOCAB, fresh, LONG)
    a.add_rows(rows)
    b.add_rows(rows)
    assert propose(a, [5] * 30)[0] == propose(b, [5] * 30)[0]
    assert np.array_equal(a.last_confidence, b.last_confidence)
    for t in range(3, 12):
        assert np.array_equal(index.buf.data[index.occurrences(t)], fresh.buf.data[fresh.occurrences(t)])


def test_finished_rows_join_the_index_shared_by_other_drafters():
    index = SuffixIndex()
    a, b = SuffixDrafter(VOCAB, index, LONG), SuffixDrafter(VOCAB, index, LONG)
    a.add_rows([[10, 11, 12], [20, 21]])
    a.commit([[13, 14], [22]])
    a.select([1])  # row 0 finished
    assert index.sequences() == [[10, 11, 12, 13, 14]]
    b.add_rows([[50, 11, 12]])
    assert propose(b, [4])[0] == [[13, 14]] and b.candidate(0, 4).source == OTHER


def test_provenance_counts_drafts_and_accepts_by_source():
    d = drafter([[5, 6, 7, 5, 6], [10, 11]], index_sequences=[[10, 11, 12, 13, 14, 15, 16]])
    assert propose(d, [4, 4])[0] == [[7, 5], [12, 13]]  # matches of 2 tokens: 2 drafts each
    d.commit([[7, 9], [12, 13, 14]], num_accepted=[1, 2])
    assert d.provenance() == dict(drafted_self=2, drafted_other=2, accepted_self=1, accepted_other=2)
    assert propose(d, [4, 4])[0] == [[], [15, 16]]  # row 1 now matches 5 tokens: up to the end of the copy
    d.commit([[3], [15, 8]])  # without num_accepted: the common prefix (a rejected draft is never re-emitted)
    d.select([1])  # row 0 leaves: its counts stay in the totals
    assert d.provenance() == dict(drafted_self=2, drafted_other=4, accepted_self=1, accepted_other=3)


def test_config_is_validated():
    for bad in [dict(min_match=0), dict(min_match=5, max_match=4), dict(max_spec_factor=-1.0),
                dict(min_token_prob=1.5), dict(max_cached_sequences=-1), dict(max_occurrences=0)]:
        with pytest.raises(ValueError):
            SuffixConfig(**bad)
    with pytest.raises(ValueError):
        SuffixIndex(max_tokens=-1)


def test_proposal_cost():
    """32 rows against 200 finished sequences of 300 tokens (phrases shared between sequences, so
    matches are long and frequent): the seconds per row to draft, and those of the one-hot
    [B, K, V] draft_probs at V = 32000 that NgramDrafter builds too (docs/history/notes.md has a
    run's figures). Not asserted (no timing asserts): printed with -s."""
    rng = np.random.default_rng(0)
    phrases = [rng.integers(3, 32_000, rng.integers(5, 30)).tolist() for _ in range(60)]

    def sequence(n):
        s = []
        while len(s) < n:
            s += phrases[rng.integers(60)] if rng.random() < 0.7 else rng.integers(3, 32_000, 3).tolist()
        return s[:n]

    index = SuffixIndex()
    for _ in range(200):
        index.insert(sequence(300))
    d = SuffixDrafter(32_000, index)
    d.add_rows([sequence(300) for _ in range(32)])
    t0 = time.perf_counter()
    drafts = [d.candidate(b, 8) for b in range(32)]
    print(f"suffix drafting: {(time.perf_counter() - t0) / 32 * 1e3:.3f} ms per row")
    assert sum(c is not None for c in drafts) > 16


# ---------------------------------------------------------------- through the engine


@pytest.fixture(scope="module")
def greedy_case():
    """Prompts that repeat themselves (own-history matches), each asked twice: the second copy finds
    the first's prompt and output in the index once the first has finished."""
    target = tiny_model("llama")
    ps = [p * 3 for p in prompts(seed=1, lengths=(4, 6, 3))] * 2
    return target, ps, [hf_greedy(target, p, 24) for p in ps]


@pytest.mark.parametrize("runner,batch_size,tree_budget", [
    ("static", 1, 0), ("static", 3, 0), ("dynamic", 1, 0), ("dynamic", 3, 0), ("static", 1, 4), ("static", 3, 4)])
def test_greedy_output_is_the_targets_own(greedy_case, runner, batch_size, tree_budget):
    target, ps, expected = greedy_case
    d = SuffixDrafter(VOCAB)
    speculation = SpeculationConfig(num_speculative_tokens=4, eos_token_ids=(EOS,), tree_budget=tree_budget)
    engine = SpecEngine(target, d, EngineConfig(speculation, max_batch_size=batch_size, runner=runner))
    results = engine.generate([Request(i, p, SamplingParams(max_new_tokens=24)) for i, p in enumerate(ps)])
    assert [r.token_ids for r in results] == expected
    accepted = sum(r.stats.num_accepted_draft_tokens for r in results)
    prov = d.provenance()
    assert accepted > 0 and prov["accepted_other"] > 0  # drafts were used, some from rows finished before
    assert prov["accepted_self"] + prov["accepted_other"] == accepted
    assert prov["drafted_self"] + prov["drafted_other"] == sum(r.stats.num_draft_tokens for r in results)
    assert len(d.index) == len(ps)  # every finished row joined the index


@pytest.mark.parametrize("tree_budget", [0, 4])
def test_sampled_output_follows_the_targets_law(tree_budget):
    """As tests/engine/test_distribution_e2e.py: N seeded rows of one prompt, admitted 250 at a time,
    so that later rows draft the most frequent continuations of earlier rows' samples (and, in a tree,
    the next most frequent as branches); the law of their first two tokens is the target's."""
    V, K, N = 8, 2, 2000  # 64 cells of ~30 expected counts; the tolerances follow from N
    target = tiny_model("llama", seed=11, vocab=V)
    prompt = [3, 5, 6]  # no repetition: every draft comes from other rows
    base = SamplingParams(temperature=0.9, top_k=6, top_p=0.95, max_new_tokens=K + 1, ignore_eos=True)
    d = SuffixDrafter(V, SuffixIndex(max_sequences=250))
    speculation = SpeculationConfig(num_speculative_tokens=K, tree_budget=tree_budget)
    engine = SpecEngine(target, d, EngineConfig(speculation, max_batch_size=250, runner="static"))
    results = engine.generate([Request(i, prompt, SamplingParams(**{**base.__dict__, "seed": 10_000 + i}))
                               for i in range(N)])
    assert_first_two_tokens_follow_target(results, target, prompt, base, length=K + 1)
    prov = d.provenance()
    assert prov["accepted_other"] > N / 10  # the drafts from other rows were really used
    if tree_budget:
        assert sum(r.stats.num_branch_accepts for r in results) > N / 100  # and the branches


def test_auto_k_from_the_drafters_confidence_keeps_greedy_output(greedy_case):
    """-k auto with the suffix drafter: each step's K from its own confidence and the costs timed
    as the steps run (KController.choose_k_by_confidence); greedy output is the target's own."""
    from raysd.core.speculation import AdaptiveConfig

    target, ps, expected = greedy_case
    speculation = SpeculationConfig(num_speculative_tokens=4, eos_token_ids=(EOS,), adaptive=AdaptiveConfig())
    engine = SpecEngine(target, SuffixDrafter(VOCAB), EngineConfig(speculation, max_batch_size=3))
    results = engine.generate([Request(i, p, SamplingParams(max_new_tokens=24)) for i, p in enumerate(ps)])
    assert [r.token_ids for r in results] == expected
    assert engine.k_controller.confidence_expected > 0  # steps were planned from the drafter's confidence
