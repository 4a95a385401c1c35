"""Step-cost profiling: what is measured, and what is filled in between."""

from __future__ import annotations

import raysd.models.profile as profile
from tests.conftest import tiny_model


def test_time_forward_upto_measures_powers_of_two_and_fills_linearly(monkeypatch):
    asked = []

    def fake(model, batch_size, ks, context, reps):
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
