"""Tests for raysd.core.stats: BatchStats counts steps (the engine's one counting path),
SpecDecodeStats reports a row: updates, identities, conventions, validation."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raysd.core.stats import BatchStats, SpecDecodeStats


class OneRow:
    """A one-row BatchStats driven step by step, as the engine drives every row."""

    def __init__(self, num_speculative_tokens: int):
        self.batch = BatchStats(num_speculative_tokens)
        self.batch.add(1)

    def observe(self, drafted: int, accepted: int, overlaps, k: int | None = None) -> None:
        k = drafted if k is None else k
        self.batch.observe(np.array([k]), np.array([drafted]), np.array([accepted]), np.array([len(overlaps)]),
                           np.array([float(sum(overlaps))]))

    def __getattr__(self, name):
        return getattr(self.batch.row(0), name)

    def state(self) -> dict:
        return self.batch.row(0).state()


def test_observe_updates_every_counter():
    s = OneRow(num_speculative_tokens=3)
    assert s.acceptance_histogram == [0, 0, 0, 0] and s.accepted_per_position == [0, 0, 0]
    assert s.mean_acceptance_length is None and s.draft_acceptance_rate is None and s.alpha_estimate is None

    s.observe(3, 2, [0.9, 0.5, 0.25])  # accepted 2 of 3, all three positions tested
    assert (s.num_spec_steps, s.num_draft_tokens, s.num_accepted_draft_tokens) == (1, 3, 2)
    assert s.acceptance_histogram == [0, 0, 1, 0]
    assert s.accepted_per_position == [1, 1, 0]
    assert s.num_tested_positions == 3 and s.overlap_sum == pytest.approx(1.65)

    s.observe(3, 3, [1.0, 1.0, 1.0])
    s.observe(0, 0, [])  # a step with no drafts: plain decoding
    s.observe(2, 0, [0.1])
    assert (s.num_spec_steps, s.num_draft_tokens, s.num_accepted_draft_tokens) == (4, 8, 5)
    assert s.acceptance_histogram == [2, 0, 1, 1]
    assert s.accepted_per_position == [2, 2, 1]
    assert s.draft_acceptance_rate == pytest.approx(5 / 8)
    assert s.mean_acceptance_length == pytest.approx(1 + 5 / 4)
    assert s.alpha_estimate == pytest.approx((1.65 + 3.0 + 0.1) / 7)


def test_mean_acceptance_length_counts_the_bonus_token():
    s = OneRow(num_speculative_tokens=4)
    for _ in range(5):
        s.observe(4, 4, [1.0] * 4)
    assert s.mean_acceptance_length == 5.0  # K + 1 when every draft is accepted
    plain = OneRow(num_speculative_tokens=0)
    for _ in range(3):
        plain.observe(0, 0, [])
    assert plain.mean_acceptance_length == 1.0  # plain decoding
    assert plain.draft_acceptance_rate is None and plain.alpha_estimate is None
    assert plain.acceptance_histogram == [3] and plain.accepted_per_position == []


@pytest.mark.parametrize("drafted, accepted", [(2, 3), (5, 1), (-1, 0), (1, -1), (4, 4)])
def test_invalid_observe_raises_and_leaves_state_unchanged(drafted, accepted):
    s = OneRow(num_speculative_tokens=3)
    s.observe(3, 1, [0.5, 0.5])
    before = s.state()
    with pytest.raises(ValueError):
        s.observe(drafted, accepted, [0.5])
    assert s.state() == before


def test_invalid_construction_raises():
    with pytest.raises(ValueError):
        SpecDecodeStats(num_speculative_tokens=-1)
    with pytest.raises(ValueError):
        SpecDecodeStats(num_speculative_tokens=2, acceptance_histogram=[0, 0])
    with pytest.raises(ValueError):
        SpecDecodeStats(num_speculative_tokens=2, accepted_per_position=[0, 0, 0])


def test_to_dict_and_state_round_trip():
    row = OneRow(num_speculative_tokens=2)
    row.observe(2, 1, [0.75, 0.5])
    s = row.batch.row(0)
    d = s.to_dict()
    assert d == {
        "num_spec_steps": 1, "num_draft_tokens": 2, "num_accepted_draft_tokens": 1,
        "draft_acceptance_rate": 0.5, "mean_acceptance_length": 2.0, "acceptance_histogram": [0, 1, 0],
        "accepted_per_position": [1, 0], "alpha_estimate": 0.625,
        "mean_speculation_length": 2.0, "num_steps_without_drafts": 0,
        "mean_nodes_verified": 2.0, "mean_accepted_depth": 1.0, "num_branch_accepts": 0, "num_beam_nodes_selected": 0,
    }
    d["acceptance_histogram"].append(99)  # a copy, not the live list
    assert s.acceptance_histogram == [0, 1, 0]
    clone = SpecDecodeStats(**s.state())
    assert clone == s and clone.to_dict() == s.to_dict()


@st.composite
def step_sequences(draw):
    K = draw(st.integers(0, 6))
    steps = []
    for _ in range(draw(st.integers(0, 40))):
        drafted = draw(st.integers(0, K))
        accepted = draw(st.integers(0, drafted))
        tested = min(accepted + 1, drafted)
        overlaps = draw(st.lists(st.floats(0.0, 1.0), min_size=tested, max_size=tested))
        steps.append((drafted, accepted, overlaps))
    return K, steps


@settings(max_examples=max(150, settings().max_examples), deadline=None)  # more under --hypothesis-profile=explore
@given(step_sequences())
def test_identities_hold_for_any_sequence_of_steps(case):
    K, steps = case
    s = OneRow(num_speculative_tokens=K)
    for drafted, accepted, overlaps in steps:
        s.observe(drafted, accepted, overlaps)
    h = s.acceptance_histogram
    assert len(h) == K + 1 and len(s.accepted_per_position) == K
    assert sum(h) == s.num_spec_steps == len(steps)
    assert sum(j * h[j] for j in range(K + 1)) == s.num_accepted_draft_tokens
    assert sum(s.accepted_per_position) == s.num_accepted_draft_tokens
    # Position i is accepted in exactly the steps that accepted more than i drafts.
    assert s.accepted_per_position == [sum(h[i + 1 :]) for i in range(K)]
    assert s.num_draft_tokens == sum(d for d, _, _ in steps)
    assert s.num_tested_positions == sum(len(o) for _, _, o in steps)
    if steps:
        assert s.mean_acceptance_length == pytest.approx(1 + s.num_accepted_draft_tokens / s.num_spec_steps)
        assert 1.0 <= s.mean_acceptance_length <= K + 1
    else:
        assert s.mean_acceptance_length is None
    if s.num_draft_tokens:
        assert 0.0 <= s.draft_acceptance_rate <= 1.0
    if s.num_tested_positions:
        assert 0.0 <= s.alpha_estimate <= 1.0 + 1e-12


def test_speculation_length_is_recorded_per_step():
    s = OneRow(num_speculative_tokens=4)
    s.observe(3, 3, [1.0, 1.0, 1.0], k=4)  # offered 4, the drafter found 3
    s.observe(0, 0, [], k=0)  # plain decoding this step
    s.observe(2, 0, [0.1])
    assert s.mean_speculation_length == (4 + 0 + 2) / 3
    assert s.num_steps_without_drafts == 1
    with pytest.raises(ValueError):
        s.observe(3, 1, [0.5, 0.5], k=2)  # more drafts than offered


def test_a_batch_counts_each_row_as_its_own_steps_would():
    """Rows stepped together, then reordered and joined by new rows: each row's SpecDecodeStats is
    what stepping it alone gives."""
    together = BatchStats(3)
    together.add(2)
    alone = [OneRow(3), OneRow(3)]
    steps = [([3, 2], [2, 0], [3, 1], [1.5, 0.25]), ([1, 3], [1, 3], [1, 3], [0.9, 2.7])]
    for offered, accepted, tested, overlap in steps:
        together.observe(np.array(offered), np.array(offered), np.array(accepted), np.array(tested), np.array(overlap))
        for b in range(2):
            alone[b].batch.observe(np.array([offered[b]]), np.array([offered[b]]), np.array([accepted[b]]),
                                   np.array([tested[b]]), np.array([overlap[b]]))
    together.keep([1, 0])
    together.add(1)
    assert together.row(0) == alone[1].batch.row(0) and together.row(1) == alone[0].batch.row(0)
    assert together.row(2) == SpecDecodeStats(3)
