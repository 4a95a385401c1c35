"""How every scenario times its variants: warm-ups, interleaved repeats, medians, paired ratios.

A scenario describes its variants (`Variant`: a name, its settings, a function that makes one
timed run and returns its figures, from bench.measure) and hands them to `run_variants`, which
- runs each variant's warm-up once (short, untimed), so the first timed run pays no first-call costs;
- runs `repeats` rounds, every variant once per round, the order reversed every other round
  (A B C, C B A, ...), so a drift in the machine's load lands on every variant alike;
- records the 1-minute load average before each run beside its figures;
- returns, per variant, its runs, their medians and its ratio to its baseline, pair by pair.

Figures whose key starts with "_" (e.g. "_tokens", the generated token ids that a scenario
compares between variants) are kept for the scenario's checks and never written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Sequence

from bench.measure import median_figures, paired_ratio


@dataclass
class Variant:
    name: str
    settings: dict
    run: Callable[[], dict]  # one timed run -> its figures (bench.measure.figures)
    baseline: str | None = None  # the variant its ratios are against (same repeat), None: none
    warmup: Callable[[], object] | None = None  # one short untimed run

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a variant needs a name")


@dataclass
class Outcome:
    """What a scenario hands back: its variants' summaries, anything else it measured, its checks."""

    variants: list[dict]
    extra: dict = field(default_factory=dict)
    checks: dict = field(default_factory=dict)  # name -> {"ok": bool, ...}
    markdown: str | None = None  # a scenario's own table, written beside the JSON

    @property
    def ok(self) -> bool:
        return all(c.get("ok", True) for c in self.checks.values())


# Seconds a variant may report beside its rate, logged as each run ends (a run cut short still says where its time went).
PHASES = ("start_s", "generate_s", "fixed_s")


def run_variants(variants: Sequence[Variant], repeats: int, ratio_keys: Sequence[str] = ("tokens_per_s",),
                 log: Callable[[str], None] = print) -> tuple[list[dict], dict[str, list[dict]]]:
    """(summaries in variant order, runs by variant name with their private "_" figures)."""
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise ValueError(f"variant names must be unique: {names}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for v in variants:
        if v.warmup is not None:
            v.warmup()
    runs: dict[str, list[dict]] = {v.name: [] for v in variants}
    for r in range(repeats):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            load = round(os.getloadavg()[0], 2)
            fig = v.run()
            fig["load_1min"] = load
            runs[v.name].append(fig)
            rate = fig.get("tokens_per_s")
            phases = "".join(f", {k} {fig[k]:.2f}" for k in PHASES if isinstance(fig.get(k), (int, float)))
            log(f"[{r}] {v.name}: " + (f"{rate:.2f} tok/s" if rate is not None else _brief(fig)) + phases + f", load {load}")
    return [summary(v, runs, ratio_keys) for v in variants], runs


def summary(v: Variant, runs: dict[str, list[dict]], ratio_keys: Sequence[str] = ("tokens_per_s",)) -> dict:
    mine = [public(f) for f in runs[v.name]]
    out = {"name": v.name, "settings": v.settings, "baseline": v.baseline, "median": median_figures(mine), "runs": mine}
    if v.baseline is not None and v.baseline in runs:
        base = runs[v.baseline]
        out["ratio"] = {k: paired_ratio(mine, base, k) for k in ratio_keys
                        if all(isinstance(f.get(k), (int, float)) for f in mine + base)}
    return out


def public(fig: dict) -> dict:
    return {k: v for k, v in fig.items() if not k.startswith("_")}


def _brief(fig: dict) -> str:
    return ", ".join(f"{k} {v:.4g}" for k, v in fig.items() if isinstance(v, float) and not k.startswith("_") and k != "load_1min")[:120]
