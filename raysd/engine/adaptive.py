"""Choosing the speculation length each step, so speculation never costs throughput.

For a step with K drafts per row (each row capped by its own budget) the expected
goodput of the whole batch is

    G(K) = sum_b E(alpha_b, min(K, budget_b)) / T_step(B, K)
    E(a, k) = (1 - a^(k+1)) / (1 - a)                    Leviathan et al. 2023, eq. 1
    T_step(B, K) = T_target(B, K + 1) + K T_draft(B)      one process (SpecEngine)
                 = max(T_target(B, K + 1), K T_draft(B))  draft and target overlapped (actors)

K = 0 is plain decoding (E = 1 per row, and the draft is not called). The rows share
one K: the target verifies a padded [B, K + 1] block and the draft runs K passes over
the batch, so a step costs the same whatever K the other rows would want; what is
per request is each row's acceptance estimate, which weighs its vote. A row's alpha
is its running alpha_estimate shrunk towards a prior by pseudo-counts, so a new row
starts at the prior and its own history takes over as it accumulates. The prior is itself
learned (KController): the acceptance pooled over every row served so far, starting
from AdaptiveConfig.prior_alpha.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

from raysd.core.stats import SpecDecodeStats
from raysd.core.theory import expected_tokens_per_step
from raysd.models.profile import time_forward, time_forward_upto


@dataclass(frozen=True)
class StepCosts:
    """Measured seconds per step at a few batch sizes (e.g. from `raysd study`)."""

    batch_sizes: tuple[int, ...]  # increasing
    target_s: tuple[tuple[float, ...], ...]  # [len(batch_sizes)][K_max + 1]: T_target(B, K + 1) for K = 0..K_max
    draft_s: tuple[float, ...]  # [len(batch_sizes)]: one draft forward (0 for a model-free drafter)

    def __post_init__(self) -> None:
        n = len(self.batch_sizes)
        if n == 0 or list(self.batch_sizes) != sorted(set(self.batch_sizes)) or self.batch_sizes[0] < 1:
            raise ValueError(f"batch_sizes must be increasing positive integers, got {self.batch_sizes}")
        if len(self.target_s) != n or len(self.draft_s) != n:
            raise ValueError("target_s and draft_s need one entry per batch size")
        if len({len(row) for row in self.target_s}) != 1 or not self.target_s[0]:
            raise ValueError("every target_s row needs the same K_max + 1 entries")
        if any(t <= 0 for row in self.target_s for t in row) or any(t < 0 for t in self.draft_s):
            raise ValueError("step times must be positive (draft times >= 0)")

    @property
    def k_max(self) -> int:
        return len(self.target_s[0]) - 1

    def target(self, batch_size: int, k: int) -> float:
        return _interpolate(self.batch_sizes, [row[k] for row in self.target_s], batch_size)

    def draft(self, batch_size: int) -> float:
        return _interpolate(self.batch_sizes, self.draft_s, batch_size)


def _interpolate(xs: Sequence[int], ys: Sequence[float], x: int) -> float:
    """Piecewise linear in the batch size; constant below the first point, linear beyond the last."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    i = min(bisect.bisect_left(xs, x), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), min(ys) * 0.5)


@dataclass(frozen=True)
class AdaptiveConfig:
    costs: StepCosts
    overlapped: bool = False  # draft and target in separate actors, overlapped
    prior_alpha: float = 0.5  # what a row with no history is assumed to accept
    prior_weight: float = 4.0  # pseudo tested positions behind the prior

    def __post_init__(self) -> None:
        if not 0.0 <= self.prior_alpha <= 1.0 or self.prior_weight <= 0:
            raise ValueError("prior_alpha must be in [0, 1] and prior_weight > 0")


def row_alpha(stats: SpecDecodeStats, prior_alpha: float, prior_weight: float) -> float:
    return (stats.overlap_sum + prior_alpha * prior_weight) / (stats.num_tested_positions + prior_weight)


class KController:
    """Chooses each step's K from the rows' acceptance estimates, and pools acceptance evidence
    over every row it has served (empirical Bayes). A row with no history of its own starts from
    the pool's estimate, not from the fixed prior: a weak drafter is switched off once, rather
    than rediscovered by every new request at the cost of a few slow steps each. A row's own
    evidence then moves it away from the pool. A row never offered K > 0 gathers no evidence,
    so once the pool is pessimistic, rows that would do better than it are not found."""

    def __init__(self, config: AdaptiveConfig):
        self.config = config
        self.overlap_sum = 0.0
        self.num_tested_positions = 0

    @property
    def prior(self) -> float:
        c = self.config
        return (self.overlap_sum + c.prior_alpha * c.prior_weight) / (self.num_tested_positions + c.prior_weight)

    def choose_k(self, stats: Sequence[SpecDecodeStats], budgets: Sequence[int]) -> int:
        return self.choose_k_from([s.overlap_sum for s in stats], [s.num_tested_positions for s in stats], budgets)

    def choose_k_from(self, overlap_sums: Sequence[float], tested: Sequence[int], budgets: Sequence[int]) -> int:
        """choose_k from the rows' statistics as arrays (the engine's Batch)."""
        prior, w = self.prior, self.config.prior_weight
        alphas = [(o + prior * w) / (n + w) for o, n in zip(overlap_sums, tested)]
        return choose_k(alphas, budgets, self.config)

    def observe_all(self, overlap_sum: float, tested: int) -> None:
        """Several rows' tested positions at once."""
        self.overlap_sum += float(overlap_sum)
        self.num_tested_positions += int(tested)

    def observe(self, overlaps: Sequence[float]) -> None:
        """One row's tested positions in one step."""
        self.overlap_sum += float(sum(overlaps))
        self.num_tested_positions += len(overlaps)


def step_seconds(costs: StepCosts, batch_size: int, k: int, overlapped: bool) -> float:
    t_target = costs.target(batch_size, k)
    t_draft = k * costs.draft(batch_size)
    return max(t_target, t_draft) if overlapped else t_target + t_draft


def num_micro_batches(costs: StepCosts, batch_size: int, k: int) -> int:
    """Split `batch_size` rows over a draft actor and a target actor into 1 or 2 micro-batches.

    Two micro-batches overlap one's drafting with the other's verification, but each model then
    runs at half the batch. Where a step's cost barely grows with the batch (decoding is
    memory-bound: a small model on a CPU, any model at a small batch on a GPU), that doubles the
    target's work per token, which overlap pays back only with a costly draft. Compares the time
    for every row to advance one step: T_target(B, K + 1) + K T_draft(B) in one micro-batch
    against 2 max(T_target(B/2, K + 1), K T_draft(B/2)) for two, alternating."""
    if batch_size < 2:
        return 1
    half = -(-batch_size // 2)
    serial = step_seconds(costs, batch_size, k, overlapped=False)
    return 2 if 2 * step_seconds(costs, half, k, overlapped=True) < serial else 1


def choose_k(alphas: Sequence[float], budgets: Sequence[int], config: AdaptiveConfig) -> int:
    """The K in 0..K_max with the highest expected goodput for this batch."""
    B = len(alphas)
    best_k, best = 0, B / step_seconds(config.costs, B, 0, config.overlapped)
    for k in range(1, min(config.costs.k_max, max(budgets, default=0)) + 1):
        tokens = sum(expected_tokens_per_step(min(max(a, 0.0), 1.0), min(k, cap)) for a, cap in zip(alphas, budgets))
        goodput = tokens / step_seconds(config.costs, B, k, config.overlapped)
        if goodput > best:
            best_k, best = k, goodput
    return best_k


def profile_step_costs(target, draft=None, k_max: int = 8, batch_sizes: Sequence[int] = (1, 4, 16, 64),
                       context: int = 128, reps: int = 3, runner: str = "auto") -> StepCosts:
    """Measure StepCosts on the machine at hand: T_target(B, K + 1) for K = 0..k_max and one
    draft forward per batch size (a model-free drafter counts as free), both on the runner the
    engine runs them on (EngineConfig.runner, DraftModelDrafter's runner)."""
    target_s, draft_s = [], []
    for B in batch_sizes:
        target_s.append(tuple(time_forward_upto(target, B, k_max, context, reps, runner)))
        draft_s.append(time_forward(draft, B, [0], context, reps, runner)[0] if draft is not None else 0.0)
    return StepCosts(tuple(batch_sizes), tuple(target_s), tuple(draft_s))
