"""How a job speculates, validated once: K, the draft tree, the acceptance rule, adaptive K,
EOS and the length limit (`SpeculationConfig`), embedded by the engine's, the coordinator's
and the job's configs. No torch here: a job's config is checked anywhere, even in a process
that only moves rows.

`StepCosts` are measured step times (raysd.models.profile.profile_step_costs, cached per
machine by the jobs layer); the adaptive controller (raysd.engine.adaptive.KController) weighs
them against the rows' acceptance to choose each step's K and tree. `SuffixConfig` bounds the
suffix drafter (raysd.engine.suffix).
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

MAX_SPECULATIVE_TOKENS = 64  # K: the most drafts a row is offered per step
MAX_TREE_BUDGET = 256  # P: the most draft-tree nodes per row per step
ACCEPTANCE_RULES = ("exact", "relaxed", "synthetic")


@dataclass(frozen=True)
class Acceptance:
    """The rule that decides which drafts are kept.

    - `exact`: the rejection test (Leviathan, Kalman, Matias 2023, Algorithm 1): outputs follow
      the target's distribution.
    - `relaxed` (LOSSY): verify against (1 - value) target_probs + value draft_probs (Yin et al.
      2024, arXiv 2411.00841): total variation value x TV(target, draft) per drafted position.
    - `synthetic` (capacity planning, NOT the target's distribution): each draft is accepted with
      probability `value`, whatever the models say, so steps cost what they would at that rate; the
      rows' acceptance evidence (their overlaps, what `-k auto` plans from) is that rate too.

    Written as text `exact`, `relaxed:LAMBDA` or `synthetic:RATE` (`parse`, `str`)."""

    rule: str = "exact"
    value: float = 0.0  # LAMBDA for relaxed, the acceptance rate for synthetic

    def __post_init__(self) -> None:
        if self.rule not in ACCEPTANCE_RULES:
            raise ValueError(f"acceptance must be 'exact', 'relaxed:LAMBDA' or 'synthetic:RATE', got rule {self.rule!r}")
        value = self.value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise ValueError(f"acceptance {self.rule}: the value must be in [0, 1], got {value!r}")
        if self.rule == "exact" and value:
            raise ValueError("the exact acceptance rule takes no value")
        object.__setattr__(self, "value", float(value))

    @classmethod
    def parse(cls, text: "str | Acceptance") -> "Acceptance":
        """'exact', 'relaxed:LAMBDA' or 'synthetic:RATE' (LAMBDA, RATE in [0, 1]); one-line ValueError otherwise."""
        if isinstance(text, Acceptance):
            return text
        if text == "exact":
            return cls()
        rule, sep, value = str(text).partition(":")
        try:
            number = float(value)
        except ValueError:
            number = float("nan")
        if not sep or rule not in ("relaxed", "synthetic") or not 0.0 <= number <= 1.0:
            raise ValueError(f"acceptance must be 'exact', 'relaxed:LAMBDA' or 'synthetic:RATE' with a value in [0, 1], "
                             f"got {text!r}")
        return cls(rule, number)

    def __str__(self) -> str:
        return "exact" if self.rule == "exact" else f"{self.rule}:{self.value!r}"

    @property
    def exact(self) -> bool:
        return self.rule == "exact"

    @property
    def relax(self) -> float | None:
        """LAMBDA of a relaxed rule, else None."""
        return self.value if self.rule == "relaxed" else None

    @property
    def synthetic_rate(self) -> float | None:
        return self.value if self.rule == "synthetic" else None


@dataclass(frozen=True)
class StepCosts:
    """Measured seconds per step at a few batch sizes (raysd.models.profile.profile_step_costs)."""

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
    """K (and the tree) chosen each step for the best expected goodput (raysd.engine.adaptive).
    `costs`: a measured profile; None: learned from the job's own timed steps as it runs
    (raysd.engine.adaptive.LearnedStepCosts), with no profiling pass before the first token."""

    costs: StepCosts | None = None
    overlapped: bool = False  # draft and target in separate actors, overlapped
    prior_alpha: float = 0.5  # what a row with no history is assumed to accept
    prior_weight: float = 4.0  # pseudo tested positions behind the prior
    # Learned costs: the tokens per target forward (rows x tokens per row) past which a forward is
    # compute-bound on this device (a GPU's ridge point; raysd.models.profile.crossover_tokens). A verify
    # width not timed yet is then costed by the roofline from the plain step's time; None: no prior.
    crossover_tokens: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.prior_alpha <= 1.0 or self.prior_weight <= 0:
            raise ValueError("prior_alpha must be in [0, 1] and prior_weight > 0")
        if self.crossover_tokens is not None and self.crossover_tokens <= 0:
            raise ValueError(f"crossover_tokens must be > 0, got {self.crossover_tokens}")

    @property
    def wants_crossover(self) -> bool:
        """Costs learned with no crossover given: the device's own is worth measuring."""
        return self.costs is None and self.crossover_tokens is None


@dataclass(frozen=True)
class SpeculationConfig:
    """What every step of every row obeys, in the engine and through the actors alike."""

    num_speculative_tokens: int = 4  # K: drafts per row per step (under `adaptive`, the most)
    # P > 0: each step drafts a tree of at most P nodes per row, at most K deep (raysd.core.tree_shape,
    # docs/trees.md), verified in one target pass; with `adaptive`, the largest tree weighed. 0: chains.
    tree_budget: int = 0
    acceptance: Acceptance = field(default_factory=Acceptance)  # or its text: "exact", "relaxed:0.5", ...
    adaptive: AdaptiveConfig | None = None  # None: always K drafts (and the tree of P)
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int | None = None  # prompt + generated tokens per row; None: the models' own limit

    def __post_init__(self) -> None:
        object.__setattr__(self, "acceptance", Acceptance.parse(self.acceptance))
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        K, P = self.num_speculative_tokens, self.tree_budget
        if isinstance(K, bool) or not isinstance(K, int) or not 0 <= K <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an int in 0..{MAX_SPECULATIVE_TOKENS}, got {K!r}")
        if isinstance(P, bool) or not isinstance(P, int) or not 0 <= P <= MAX_TREE_BUDGET:
            raise ValueError(f"tree_budget must be an int in 0..{MAX_TREE_BUDGET} (0: a chain), got {P!r}")
        if P and K < 1:
            raise ValueError("tree drafting needs num_speculative_tokens >= 1 (the tree's depth)")
        if P and not self.acceptance.exact:
            raise ValueError(f"tree drafting verifies exactly: use the exact acceptance rule, not {self.acceptance}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        costs = self.adaptive.costs if self.adaptive is not None else None
        if costs is not None and costs.k_max < max(K, P):
            raise ValueError(f"adaptive step costs cover K <= {costs.k_max}, below num_speculative_tokens ({K}) or "
                             f"tree_budget ({P}): a tree of P nodes needs T_target(B, P + 1)")

    @property
    def lossy(self) -> bool:
        return not self.acceptance.exact

    def with_crossover(self, crossover_tokens: float | None) -> SpeculationConfig:
        """This config with the device's crossover (raysd.models.profile.crossover_tokens) given to
        -k auto's learned costs, where it has none; unchanged otherwise (fixed K, measured costs, a
        crossover given, or None: a CPU)."""
        if self.adaptive is None or not self.adaptive.wants_crossover or crossover_tokens is None:
            return self
        return dataclasses.replace(self, adaptive=dataclasses.replace(self.adaptive, crossover_tokens=crossover_tokens))


@dataclass(frozen=True)
class SuffixConfig:
    """How the suffix drafter (raysd.engine.suffix) matches a row's suffix, and how much its index keeps."""

    max_match: int = 32  # longest suffix of a row matched
    min_match: int = 1  # shorter matches draft nothing
    max_spec_factor: float = 1.0  # at most max_spec_factor * n + max_spec_offset drafts after a match of n tokens
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1  # stop where the draft's estimated acceptance (a product) drops below this
    # Bounds the work per row: only the most recent occurrences of its last token, per source, are matched.
    max_occurrences: int = 1024
    max_cached_sequences: int = 10_000  # the job's index (when the drafter makes its own): oldest evicted first
    max_cached_tokens: int = 2_000_000

    def __post_init__(self) -> None:
        if not 1 <= self.min_match <= self.max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {self.min_match}, {self.max_match}")
        if self.max_spec_factor < 0 or self.max_spec_offset < -self.max_spec_factor * self.max_match:
            raise ValueError(f"need max_spec_factor >= 0 and some match to allow drafts, got {self}")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {self.min_token_prob}")
        if self.max_occurrences < 1:
            raise ValueError(f"max_occurrences must be >= 1, got {self.max_occurrences}")
        if self.max_cached_sequences < 0 or self.max_cached_tokens < 0:
            raise ValueError(f"index bounds must be >= 0, got {self.max_cached_sequences}, {self.max_cached_tokens}")
