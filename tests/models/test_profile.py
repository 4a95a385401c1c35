"""Step-cost profiling: what is measured, and what is filled in between."""

from __future__ import annotations

import pytest

import raysd.models.profile as profile
from raysd.models.runner import ModelRunner
from raysd.models.static_runner import StaticModelRunner
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
    assert isinstance(profile._prefilled_runner(model, 2, 8, VOCAB, "auto"), StaticModelRunner)
    assert isinstance(profile._prefilled_runner(model, 2, 8, VOCAB, "dynamic"), ModelRunner)
    for kind in ("static", "dynamic"):
        times = profile.time_forward(model, 2, [0, 2], context=8, reps=1, runner=kind)
        assert set(times) == {0, 2} and all(t > 0 for t in times.values())
    with pytest.raises(ValueError, match="runner must be one of"):
        profile.time_forward(model, 1, [0], context=8, reps=1, runner="fast")
