"""Per-sample speculative decoding statistics (names as in vLLM's spec-decode metrics)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Sequence


@dataclass
class SpecDecodeStats:
    """Acceptance statistics of one generated sample.

    A step is one target forward pass for this row, whether or not it drafted.
    `mean_acceptance_length` counts tokens emitted per step with the bonus or
    recovered token included (the Spec-Bench convention), so plain decoding has 1.0.
    `alpha_estimate` averages sum_x min(target_probs(x), draft_probs(x)) over the
    positions whose rejection test actually ran: 1 - E[TV], the acceptance rate
    the theory uses, estimated on the contexts the sample really visited.

    With a draft tree (raysd.core.tree_shape) a draft is a node: `num_draft_tokens` counts
    the nodes the target verified, `num_accepted_draft_tokens` the depths of the accepted
    paths, the histogram and the per-position counts are by accepted depth, and
    `alpha_estimate` reads the rank-0 (sampled) child of each node on the accepted path.
    `num_branch_accepts` counts accepted nodes that were not a rank-0 child: tokens a chain
    would not have drafted (0 for a chain).
    """

    num_speculative_tokens: int  # K: sets the lengths of the two per-position lists
    num_spec_steps: int = 0
    num_draft_tokens: int = 0  # drafts proposed and verified
    num_accepted_draft_tokens: int = 0
    acceptance_histogram: list[int] = field(default_factory=list)  # [K + 1]: steps accepting exactly j
    accepted_per_position: list[int] = field(default_factory=list)  # [K]: accepts at draft position i
    overlap_sum: float = 0.0
    num_tested_positions: int = 0
    speculation_length_sum: int = 0  # K offered to this row, summed over steps
    num_steps_without_drafts: int = 0  # steps where K was 0 (plain decoding for this row)
    num_branch_accepts: int = 0  # a tree's accepted nodes other than rank-0 children

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        K = self.num_speculative_tokens
        self.acceptance_histogram = self.acceptance_histogram or [0] * (K + 1)
        self.accepted_per_position = self.accepted_per_position or [0] * K
        if len(self.acceptance_histogram) != K + 1 or len(self.accepted_per_position) != K:
            raise ValueError("histogram lengths do not match num_speculative_tokens")
        if not 0 <= self.num_branch_accepts <= self.num_accepted_draft_tokens:
            raise ValueError(f"num_branch_accepts must be in 0..num_accepted_draft_tokens, got {self.num_branch_accepts}")

    def observe(self, num_drafted: int, num_accepted: int, overlaps: Sequence[float], k: int | None = None) -> None:
        """Record one chain step: drafts verified, drafts accepted, the overlap at each tested
        position, and the speculation length K this row was offered (default: num_drafted).
        (Tree steps are recorded by raysd.engine.batch.Batch.emit.)"""
        k = num_drafted if k is None else k
        if not 0 <= num_accepted <= num_drafted <= k <= self.num_speculative_tokens:
            raise ValueError(f"bad step: {num_accepted} accepted of {num_drafted}, K={k} (max {self.num_speculative_tokens})")
        self.num_spec_steps += 1
        self.speculation_length_sum += k
        self.num_steps_without_drafts += k == 0
        self.num_draft_tokens += num_drafted
        self.num_accepted_draft_tokens += num_accepted
        self.acceptance_histogram[num_accepted] += 1
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1
        self.overlap_sum += float(sum(overlaps))
        self.num_tested_positions += len(overlaps)

    @property
    def draft_acceptance_rate(self) -> float | None:
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        if not self.num_spec_steps:
            return None
        return 1.0 + self.num_accepted_draft_tokens / self.num_spec_steps

    @property
    def mean_speculation_length(self) -> float | None:
        return self.speculation_length_sum / self.num_spec_steps if self.num_spec_steps else None

    @property
    def mean_nodes_verified(self) -> float | None:
        """Draft nodes the target verified per step (a chain's drafts; a tree's nodes, <= P)."""
        return self.num_draft_tokens / self.num_spec_steps if self.num_spec_steps else None

    @property
    def mean_accepted_depth(self) -> float | None:
        """Depth of the accepted path per step (a chain: drafts accepted per step)."""
        return self.num_accepted_draft_tokens / self.num_spec_steps if self.num_spec_steps else None

    @property
    def alpha_estimate(self) -> float | None:
        return self.overlap_sum / self.num_tested_positions if self.num_tested_positions else None

    def to_dict(self) -> dict:
        """The public per-sample columns (the output schema's statistics)."""
        return {
            "num_spec_steps": self.num_spec_steps,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_draft_tokens": self.num_accepted_draft_tokens,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_histogram": list(self.acceptance_histogram),
            "accepted_per_position": list(self.accepted_per_position),
            "alpha_estimate": self.alpha_estimate,
            "mean_speculation_length": self.mean_speculation_length,
            "num_steps_without_drafts": self.num_steps_without_drafts,
            "mean_nodes_verified": self.mean_nodes_verified,
            "mean_accepted_depth": self.mean_accepted_depth,
            "num_branch_accepts": self.num_branch_accepts,
        }

    def state(self) -> dict:
        """Everything, for moving the object between processes."""
        return asdict(self)
