"""Step-cost profiles are measured once per model pair and machine (issue 17 item 6)."""

from __future__ import annotations

import raysd.jobs.profiles as profiles
from raysd.core.speculation import StepCosts
from raysd.jobs.profiles import cached_step_costs

COSTS = StepCosts((1, 4), ((0.010, 0.012, 0.015), (0.02, 0.025, 0.03)), (0.002, 0.003))


def test_a_profile_is_measured_once_then_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYSD_CACHE_DIR", str(tmp_path))
    calls = []

    def measure():
        calls.append(1)
        return COSTS

    key = {"target": "t", "draft": "d", "devices": ["cpu", "cpu"], "k_max": 2, "batch_sizes": [1, 4]}
    assert cached_step_costs(key, measure) == (COSTS, False)
    assert cached_step_costs(key, measure) == (COSTS, True)
    assert len(calls) == 1
    assert cached_step_costs({**key, "draft": "other"}, measure) == (COSTS, False)  # another pair: measured
    assert len(calls) == 2


def test_a_damaged_entry_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYSD_CACHE_DIR", str(tmp_path))
    key = {"target": "t"}
    cached_step_costs(key, lambda: COSTS)
    (entry,) = (tmp_path / "step_costs").glob("*.json")
    entry.write_text("{not json")
    assert cached_step_costs(key, lambda: COSTS) == (COSTS, False)
    assert cached_step_costs(key, lambda: COSTS) == (COSTS, True)


def test_a_profile_from_older_engine_code_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYSD_CACHE_DIR", str(tmp_path))
    key = {"target": "t"}
    assert cached_step_costs(key, lambda: COSTS) == (COSTS, False)
    monkeypatch.setattr(profiles, "STEP_CODE_VERSION", profiles.STEP_CODE_VERSION + 1)
    assert cached_step_costs(key, lambda: COSTS) == (COSTS, False)  # the engine changed: measured again
    assert cached_step_costs(key, lambda: COSTS) == (COSTS, True)
