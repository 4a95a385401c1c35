"""Step-cost profiling: what is measured, and what is filled in between."""

from __future__ import annotations

import pytest

import raysd.models.profile as profile
from raysd.models.dynamic_runner import DynamicRunner
from raysd.models.static_runner import StaticRunner
from tests.conftest import VOCAB, tiny_model


def test_time_forward_upto_measures_powers_of_two_and_fills_linearly(monkeypatch):
    asked = []

    def fake(model, batch_size, ks, context, reps, runner):
        asked.append(list(ks))
        return {k: 1.0 + k * k for k in ks}  # convex in K: the fill is the chord between measured points

    monkeypatch.setattr(profile, "time_forward", fake)
    times = profile.time_forward_upto(None, 4, 8)
    assert asked == [[0, 1, 2, 4, 8]]
    assert len(times) == 9
    assert [times[k] for k in (0, 1, 2, 4, 8)] == [1.0, 2.0, 5.0, 17.0, 65.0]
    assert times[3] == (5.0 + 17.0) / 2 and times[6] == (17.0 + 65.0) / 2
    assert profile.time_forward_upto(None, 1, 6) and asked[-1] == [0, 1, 2, 4, 6]
    assert profile.time_forward_upto(None, 1, 0) == [1.0] and asked[-1] == [0]


def test_time_forward_upto_on_a_model():
    times = profile.time_forward_upto(tiny_model("llama", 0), 2, 3, context=8, reps=1)
    assert len(times) == 4 and all(t > 0 for t in times)


def test_profiles_time_the_runner_the_engine_runs():
    """"auto" is the static runner for a Llama-family model, as in the engine and the actors (its
    verify costs differently per extra token than Hugging Face's DynamicCache); each kind can be asked."""
    model = tiny_model("llama", 0)
    assert isinstance(profile._prefilled_runner(model, 2, 8, VOCAB, "auto"), StaticRunner)
    assert isinstance(profile._prefilled_runner(model, 2, 8, VOCAB, "dynamic"), DynamicRunner)
    for kind in ("static", "dynamic"):
        times = profile.time_forward(model, 2, [0, 2], context=8, reps=1, runner=kind)
        assert set(times) == {0, 2} and all(t > 0 for t in times.values())
    with pytest.raises(ValueError, match="runner must be one of"):
        profile.time_forward(model, 1, [0], context=8, reps=1, runner="fast")


def test_measured_points_are_fitted_non_decreasing():
    """A dip (more tokens timed as cheaper) is pooled with its neighbour; a rising profile is kept."""
    assert profile.nondecreasing([101.0, 92.0, 138.0, 171.0]) == [96.5, 96.5, 138.0, 171.0]
    assert profile.nondecreasing([3.0, 2.0, 1.0]) == [2.0, 2.0, 2.0]
    assert profile.nondecreasing([1.0, 2.0, 2.0, 5.0]) == [1.0, 2.0, 2.0, 5.0]
    assert profile.nondecreasing([5.0, 1.0, 9.0, 7.0]) == [3.0, 3.0, 8.0, 8.0]
    assert profile.nondecreasing([]) == []


def test_time_forward_upto_never_falls(monkeypatch):
    monkeypatch.setattr(profile, "time_forward", lambda model, B, ks, context, reps, runner: {k: [10, 8, 12, 11, 20][i]
                                                                                             for i, k in enumerate(ks)})
    times = profile.time_forward_upto(None, 4, 8)
    assert all(a <= b for a, b in zip(times, times[1:])) and times[0] == times[1] == 9.0


def test_the_ks_are_timed_in_interleaved_rounds(monkeypatch):
    """Round by round over every K (a warm-up round first), not all repeats of one K then the next:
    a burst of other work then slows every K alike."""
    fed = []

    class Recording:
        device = profile.torch.device("cpu")
        lengths = profile.torch.zeros(2, dtype=profile.torch.int64)

        def forward(self, ids, valid, n):
            fed.append(ids.shape[1])

        def rollback(self, lengths):
            pass

    monkeypatch.setattr(profile, "_prefilled_runner", lambda *a, **k: Recording())
    monkeypatch.setattr(profile, "output_vocab_size", lambda model: VOCAB)
    times = profile.time_forward(None, 2, [0, 2, 4], context=8, reps=2)
    assert fed == [1, 3, 5] * 3 and set(times) == {0, 2, 4}
