"""The one definition of every figure a benchmark reports. Every scenario computes its figures
here, and every result file carries `DEFINITIONS`, so two files that both say "tokens/s" mean
the same thing.

- tokens/s: generated tokens / wall seconds of the whole generate call. Prefill and admission
  are inside the call, so they are included; model loading is not, unless the variant's
  `timed` says so (the pipeline scenario times `raysd generate` from models on disk, and its
  engine side the same way). Earlier scripts divided by (wall - prefill) in places: not here.
- acceptance rate: accepted drafts / drafted (verified) drafts, pooled over rows.
- alpha: sum over tested positions of sum_x min(p(x), q(x)) / tested positions, pooled over
  rows: `SpecDecodeStats.alpha_estimate` over the whole run (1 - the mean total variation
  between the target's and the draft's distributions where the rejection test ran). Not the
  acceptance rate: a chain's drafts after its first rejection are never tested, so they count
  against the acceptance rate and not in alpha (alpha is the per-position rate the theory's
  expected tokens per step (1 - a^(K+1)) / (1 - a) takes).
- mean acceptance length: 1 + accepted / target passes, passes summed over rows: tokens
  emitted per row per target pass, the bonus or recovered token included (plain decoding: 1).
- medians: over `--repeats` repeats, the variants interleaved within each repeat.
- ratios (x plain, x HF, ...): per repeat, variant / baseline of the same repeat; the median of
  those per-repeat ratios (pair by pair, so a drift in load over the run cancels).

No torch here: the definitions are checked on hand-built results (tests/bench/test_bench.py).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

DEFINITIONS = {
    "tokens_per_s": "generated tokens / wall seconds of the whole generate call (prefill included; model "
                    "loading excluded unless the variant's `timed` says otherwise)",
    "acceptance_rate": "accepted drafts / drafted drafts, pooled over rows",
    "alpha": "sum of sum_x min(target_probs(x), draft_probs(x)) over tested positions / tested positions, pooled over rows "
             "(SpecDecodeStats.alpha_estimate over the run)",
    "mean_acceptance_length": "1 + accepted / target passes (passes summed over rows): tokens per row per target pass",
    "median": "median over --repeats repeats, variants interleaved within each repeat",
    "ratio": "median over repeats of (variant / baseline) within the same repeat",
}


@dataclass(frozen=True)
class Counts:
    """What a run produced, summed over its rows: the inputs of every figure."""

    generated_tokens: int
    drafted: int = 0  # drafts (a tree's nodes) the target verified
    accepted: int = 0  # of those, accepted (a tree: the accepted depth)
    passes: int = 0  # target passes summed over rows (SpecDecodeStats.num_spec_steps)
    overlap_sum: float = 0.0  # sum over tested positions of sum_x min(p(x), q(x))
    tested: int = 0  # positions whose rejection test ran

    def __post_init__(self) -> None:
        if min(self.generated_tokens, self.drafted, self.accepted, self.passes, self.tested) < 0:
            raise ValueError(f"counts must be >= 0: {self}")
        if self.accepted > self.drafted:
            raise ValueError(f"accepted ({self.accepted}) > drafted ({self.drafted})")
        if not 0.0 <= self.overlap_sum <= self.tested + 1e-9:
            raise ValueError(f"overlap_sum ({self.overlap_sum}) must be in [0, tested = {self.tested}]")

    @classmethod
    def of_results(cls, results: Iterable) -> "Counts":
        """Pooled over `GenerationResult`s (anything with `.token_ids` and a `SpecDecodeStats` `.stats`)."""
        generated = drafted = accepted = passes = tested = 0
        overlap = 0.0
        for r in results:
            s = r.stats
            generated += len(r.token_ids)
            drafted += s.num_draft_tokens
            accepted += s.num_accepted_draft_tokens
            passes += s.num_spec_steps
            overlap += s.overlap_sum
            tested += s.num_tested_positions
        return cls(generated, drafted, accepted, passes, overlap, tested)

    @classmethod
    def of_rows(cls, rows: Iterable[dict]) -> "Counts":
        """Pooled over output rows of `raysd generate` (its Parquet columns). The output has no
        overlap sums or tested positions, so alpha stays unknown there."""
        rows = list(rows)
        return cls(sum(r["num_generated_tokens"] for r in rows), sum(r["num_draft_tokens"] for r in rows),
                   sum(r["num_accepted_draft_tokens"] for r in rows), sum(r["num_spec_steps"] for r in rows))


def tokens_per_s(generated_tokens: int, wall_s: float) -> float:
    if wall_s <= 0:
        raise ValueError(f"wall time must be > 0, got {wall_s}")
    return generated_tokens / wall_s


def acceptance_rate(c: Counts) -> float | None:
    return c.accepted / c.drafted if c.drafted else None


def alpha(c: Counts) -> float | None:
    return c.overlap_sum / c.tested if c.tested else None


def mean_acceptance_length(c: Counts) -> float | None:
    return 1.0 + c.accepted / c.passes if c.passes else None


def figures(counts: Counts, wall_s: float, **extra) -> dict:
    """One timed run's figures (the per-repeat entries of a result file), `extra` added as is."""
    return {"tokens_per_s": tokens_per_s(counts.generated_tokens, wall_s), "wall_s": wall_s,
            "acceptance_rate": acceptance_rate(counts), "alpha": alpha(counts),
            "mean_acceptance_length": mean_acceptance_length(counts), **asdict(counts), **extra}


def decode_tokens_per_s(full: dict, one: dict) -> float | None:
    """The GPU scenario's decode-only rate, named apart from tokens/s: (tokens(N) - tokens(1)) /
    (wall(N) - wall(1)) of two runs of the same rows, N and 1 new tokens, so prefill cancels."""
    dt = full["wall_s"] - one["wall_s"]
    return (full["generated_tokens"] - one["generated_tokens"]) / dt if dt > 0 else None


def median_figures(runs: Sequence[dict]) -> dict:
    """The median of every numeric figure over repeats (None where a figure is None in any run)."""
    out = {}
    for key in runs[0] if runs else ():
        values = [r.get(key) for r in runs]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out[key] = statistics.median(values)
        elif all(v is None for v in values):
            out[key] = None
    return out


def paired_ratio(runs: Sequence[dict], baseline: Sequence[dict], key: str = "tokens_per_s") -> dict:
    """Per repeat runs[i][key] / baseline[i][key], and their median."""
    if len(runs) != len(baseline) or not runs:
        raise ValueError(f"paired ratios need as many runs as baseline runs ({len(runs)} against {len(baseline)})")
    ratios = [r[key] / b[key] for r, b in zip(runs, baseline)]
    return {"median": statistics.median(ratios), "per_repeat": ratios}


def fmt(v, digits: int = 2) -> str:
    """A figure as the tables print it: "-" where there is none."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)
