"""SpeculationConfig and the typed acceptance rule: validated once, one-line errors."""

import pytest

from raysd.core.speculation import Acceptance, AdaptiveConfig, SpeculationConfig, StepCosts


@pytest.mark.parametrize("text, rule, value", [("exact", "exact", 0.0), ("relaxed:0.5", "relaxed", 0.5),
                                               ("relaxed:1", "relaxed", 1.0), ("synthetic:0.25", "synthetic", 0.25)])
def test_acceptance_parses_and_prints_back(text, rule, value):
    a = Acceptance.parse(text)
    assert (a.rule, a.value) == (rule, value)
    assert Acceptance.parse(str(a)) == a and Acceptance.parse(a) is a
    assert a.exact == (rule == "exact")
    assert a.relax == (value if rule == "relaxed" else None)
    assert a.synthetic_rate == (value if rule == "synthetic" else None)


@pytest.mark.parametrize("text", ["", "relaxed", "relaxed:", "relaxed:1.5", "relaxed:-0.1", "relaxed:nan", "lossy:0.5",
                                  "synthetic:2", "exact:0.5"])
def test_bad_acceptance_is_one_line(text):
    with pytest.raises(ValueError) as info:
        Acceptance.parse(text)
    assert "\n" not in str(info.value)


def test_speculation_config_checks_everything_once():
    spec = SpeculationConfig(num_speculative_tokens=3, acceptance="relaxed:0.5", eos_token_ids=[2, 7])
    assert spec.acceptance == Acceptance("relaxed", 0.5) and spec.eos_token_ids == (2, 7) and spec.lossy
    costs = StepCosts((1,), ((1.0,) * 5,), (0.1,))
    bad = [dict(num_speculative_tokens=-1), dict(num_speculative_tokens=65), dict(num_speculative_tokens=True),
           dict(tree_budget=257), dict(tree_budget=4, num_speculative_tokens=0),
           dict(tree_budget=4, acceptance="relaxed:0.5"), dict(tree_budget=4, acceptance="synthetic:0.5"),
           dict(max_model_len=1), dict(num_speculative_tokens=6, adaptive=AdaptiveConfig(costs)),
           dict(tree_budget=8, adaptive=AdaptiveConfig(costs))]
    for kwargs in bad:
        with pytest.raises(ValueError) as info:
            SpeculationConfig(**kwargs)
        assert "\n" not in str(info.value), kwargs
    SpeculationConfig(num_speculative_tokens=4, tree_budget=4, adaptive=AdaptiveConfig(costs))  # costs reach P + 1
    SpeculationConfig(adaptive=AdaptiveConfig())  # costs measured later (a job's -k auto)


def test_the_devices_crossover_goes_to_learned_costs_only():
    """-k auto with learned costs takes the device's crossover; fixed K, measured costs, a
    crossover already given and no crossover (a CPU) leave the config as it is."""
    learned = SpeculationConfig(num_speculative_tokens=4, adaptive=AdaptiveConfig())
    assert learned.with_crossover(300.0).adaptive == AdaptiveConfig(crossover_tokens=300.0)
    assert learned.with_crossover(None) is learned
    given = SpeculationConfig(num_speculative_tokens=4, adaptive=AdaptiveConfig(crossover_tokens=50.0))
    measured = SpeculationConfig(num_speculative_tokens=4, adaptive=AdaptiveConfig(StepCosts((1,), ((1.0,) * 5,), (0.1,))))
    fixed = SpeculationConfig(num_speculative_tokens=4)
    for spec in (given, measured, fixed):
        assert spec.with_crossover(300.0) is spec
