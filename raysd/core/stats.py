"""Speculative decoding statistics (names as in vLLM's spec-decode metrics): `BatchStats` counts
every step of the rows in flight, and hands each finished row its `SpecDecodeStats`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np


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

    Beam search (raysd.engine.beam) counts in the same terms: a step is a target pass, a draft a
    tree node, an accepted draft a level beyond the one every pass computes, so that
    `mean_acceptance_length` is the levels advanced per pass; `num_beam_nodes_selected` counts the
    nodes that lay on a beam the replay selected (0 outside beam search).

    Counted by `BatchStats.observe`, but for `num_beam_nodes_selected`, which the beam search counts
    per prompt (raysd.engine.beam).
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
    num_beam_nodes_selected: int = 0  # beam search: drafted tree nodes that lay on a selected beam

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
            "num_beam_nodes_selected": self.num_beam_nodes_selected,
        }

    def state(self) -> dict:
        """Everything, for moving the object between processes."""
        return asdict(self)


_COUNTERS = ("steps", "offered", "no_draft", "drafted", "accepted", "tested", "branch", "overlap_sum")


class BatchStats:
    """SpecDecodeStats of every row in flight, as arrays with one entry per row (slot order).

    One step's counts for the whole batch are a few vectorised updates (`observe`), whatever the
    batch size; `row(b)` is row b's SpecDecodeStats. Rows join with `add` and leave with `keep`.
    """

    def __init__(self, num_speculative_tokens: int):
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        K = self.num_speculative_tokens = num_speculative_tokens
        for name in _COUNTERS:
            setattr(self, name, np.zeros(0, dtype=np.float64 if name == "overlap_sum" else np.int64))
        self.histogram = np.zeros((0, K + 1), dtype=np.int64)  # [B, K + 1] steps that accepted exactly j
        self.per_position = np.zeros((0, K), dtype=np.int64)  # [B, K] accepts at draft position i

    def __len__(self) -> int:
        return len(self.steps)

    def add(self, n: int) -> None:
        """n new rows at the end, with nothing counted."""
        for name in _COUNTERS + ("histogram", "per_position"):
            a = getattr(self, name)
            setattr(self, name, np.concatenate([a, np.zeros((n,) + a.shape[1:], dtype=a.dtype)]))

    def keep(self, order: Sequence[int]) -> None:
        idx = np.asarray(order, dtype=np.int64)
        for name in _COUNTERS + ("histogram", "per_position"):
            setattr(self, name, getattr(self, name)[idx])

    def observe(self, offered: np.ndarray, drafted: np.ndarray, accepted: np.ndarray, tested: np.ndarray,
                overlap_sums: np.ndarray, branch: np.ndarray | None = None) -> None:
        """One step of every row, each [B]: the K it was offered, the drafts (a tree's nodes) the
        target verified, how many it accepted (the accepted depth), the positions whose test ran,
        the overlaps summed over them, and (a tree) the accepted nodes that were not rank-0 children.
        A step that breaks 0 <= accepted <= drafted <= offered <= K raises and counts nothing."""
        arrays = [np.asarray(a, dtype=np.int64) for a in (offered, drafted, accepted, tested)]
        offered, drafted, accepted, tested = arrays
        B = len(self)
        if any(a.shape != (B,) for a in arrays) or np.shape(overlap_sums) != (B,):
            raise ValueError(f"a step needs one count per row ({B})")
        k = self.num_speculative_tokens
        ok = (accepted >= 0) & (accepted <= drafted) & (accepted <= k) & (offered >= 0) & (offered <= k)
        ok &= (drafted <= offered) | (branch is not None)  # a tree verifies more nodes than its depth K
        if not ok.all():
            b = int(np.flatnonzero(~ok)[0])
            raise ValueError(f"bad step for row {b}: {accepted[b]} accepted of {drafted[b]} drafted, "
                             f"K={offered[b]} offered (max {k})")
        self.steps += 1
        self.offered += offered
        self.no_draft += offered == 0
        self.drafted += drafted
        self.accepted += accepted
        self.tested += tested
        self.overlap_sum += np.asarray(overlap_sums, dtype=np.float64)
        np.add.at(self.histogram, (np.arange(B), accepted), 1)
        self.per_position += np.arange(k)[None, :] < accepted[:, None]
        if branch is not None:
            self.branch += np.asarray(branch, dtype=np.int64)

    def row(self, b: int) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.num_speculative_tokens, num_spec_steps=int(self.steps[b]), num_draft_tokens=int(self.drafted[b]),
            num_accepted_draft_tokens=int(self.accepted[b]), acceptance_histogram=self.histogram[b].tolist(),
            accepted_per_position=self.per_position[b].tolist(), overlap_sum=float(self.overlap_sum[b]),
            num_tested_positions=int(self.tested[b]), speculation_length_sum=int(self.offered[b]),
            num_steps_without_drafts=int(self.no_draft[b]), num_branch_accepts=int(self.branch[b]),
        )
