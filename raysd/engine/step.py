"""The two halves of a speculative step, shared by the single-process engine and the Ray actors.

`DraftSide` proposes; `TargetSide` verifies, emits, rolls back and retires finished rows, and
holds the batch state (`Batch`: budgets, stop sets, statistics) beside the target model.
`SpecEngine.step` calls one after the other in one process; the Ray coordinator calls them in
two actors, one pair per micro-batch, and only forwards the target's `StepOutcome` to the draft
and admits new rows. Nothing else is kept per row outside the two sides.

The sides agree without being told: each row's drafts are capped by its own room (the same
`Batch.room` on both sides, since both see the same kept tokens), and each row's draws come
from (seed, tokens generated) (`step_uniforms`), so the caller sends one K per step and a seed
gives the same tokens in the engine and through the actors, whatever the batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from raysd.core.sampling import SamplingTensors
from raysd.core.tree_shape import TreeShape, rank_visits, tree_shape
from raysd.engine.batch import Batch
from raysd.engine.drafters import Drafter, Proposal
from raysd.engine.rows import GenerationResult, Request, fill_holes, step_uniforms
from raysd.engine.verifier import TargetVerifier, Verdict, verifies_by_argmax


@dataclass(frozen=True)
class RowLimits:
    """What both sides must agree on to cap and stop rows identically."""

    num_speculative_tokens: int  # K: the most drafts a row is offered per step
    max_model_len: int  # prompt + generated tokens per row
    eos_token_ids: tuple[int, ...] = ()
    # A feature draft (EAGLE) drafts from the target's features, which a row has only after its
    # first target pass (the prefill runs on the target side): its first step offers no drafts.
    feature_draft: bool = False
    # P > 0: draft a tree of at most P nodes per row per step, at most K deep (tree_shape(P, K));
    # 0: a chain of K drafts.
    tree_budget: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.num_speculative_tokens <= 64 or self.max_model_len < 2:
            raise ValueError(f"need 0 <= num_speculative_tokens <= 64 and max_model_len >= 2, got {self}")
        if self.tree_budget < 0 or (self.tree_budget and self.num_speculative_tokens < 1):
            raise ValueError(f"need tree_budget >= 0, and num_speculative_tokens >= 1 for a tree, got {self}")
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))

    def tree(self, tree_budget: int | None = None) -> TreeShape | None:
        """The draft tree both sides grow in a step with this budget (default: the configured one;
        an adaptive controller chooses one per step), or None for a chain."""
        P = self.tree_budget if tree_budget is None else tree_budget
        return tree_shape(P, self.num_speculative_tokens) if P else None

    def batch(self) -> Batch:
        return Batch(self.num_speculative_tokens, self.max_model_len, self.eos_token_ids, self.feature_draft)

    def first_room(self, request: Request) -> int:
        """`Batch.room` of a row not yet admitted (for choosing the K of the step that admits it)."""
        batch = self.batch()
        batch.add([(0, request)])
        return int(batch.room()[0])


@dataclass(frozen=True)
class StepOutcome:
    """What the target side decided in one step: the draft side applies `kept`, `accepted` and
    `keep` before its next proposal; the caller takes `finished` and feeds the K controller."""

    kept: tuple[tuple[int, ...], ...]  # tokens each row kept this step (the step's row order)
    accepted: tuple[int, ...]  # drafts each row accepted (both caches roll back to them)
    keep: tuple[int, ...] | None  # rows left once the finished ones leave (fill_holes order); None: all
    finished: tuple[tuple[int, GenerationResult], ...]  # (caller's index, result) of the rows that ended
    # The surviving rows' acceptance evidence and room, for the next step's K (KController.choose_k_from).
    overlap_sum: tuple[float, ...]
    tested: tuple[int, ...]
    room: tuple[int, ...]
    step_overlap: float  # overlaps summed over every position tested this step (KController.observe_all)
    step_tested: int
    # For a feature draft: each row's target features [n, H] of the positions it cached for good since
    # the last outcome (a new row's prompt, then its pending tokens and accepted drafts); else None.
    features: tuple[torch.Tensor, ...] | None = None
    # For a tree: the nodes each row's accepted path went through (the draft keeps that branch); else None.
    path: tuple[tuple[int, ...], ...] | None = None
    # For a tree: the walk counted by rank over the rows (rank_visits; KController.observe_ranks); else ().
    rank_offered: tuple[int, ...] = ()
    rank_moved: tuple[int, ...] = ()


class DraftSide:
    """The propose half: a drafter and, per row, what its draws and its cap depend on.

    The drafter stays cold until a step asks for drafts: until then the side keeps the rows'
    tokens itself and the drafter does no work at all (no prefill, no cache), so a step with
    K = 0, as the adaptive controller chooses when drafting would not pay, costs the draft
    side nothing. The first step with K > 0 prefills the drafter with every row's tokens."""

    def __init__(self, drafter: Drafter, limits: RowLimits, device: torch.device | str):
        self.drafter, self.limits, self.device = drafter, limits, torch.device(device)
        self.batch = limits.batch()  # seeds, budgets and tokens generated; its statistics stay unused
        # Each row's tokens while the drafter holds none; None once warm (a feature draft is never
        # cold: it follows the target's features from a row's first step).
        self.cold: list[list[int]] | None = None if drafter.needs_features else []
        self._sampling: SamplingTensors | None = None
        self.deferred_prefill_s = 0.0  # seconds the first drafting step spent prefilling the cold rows

    def __len__(self) -> int:
        return len(self.batch)

    def add(self, items: Sequence[tuple[int, Request]]) -> None:
        prompts = [list(req.prompt_token_ids) for _, req in items]
        if self.cold is None:
            self.drafter.add_rows(prompts)
        else:
            self.cold += prompts
        self.batch.add(items)
        self._sampling = None

    def propose(self, k: int, tree_budget: int | None = None) -> Proposal:
        """Up to min(k, room) drafts per row, drawn with the rows' own counter-based draws; with a
        tree (`tree_budget` > 0, default RowLimits.tree_budget), its nodes at most min(k, room)
        deep (Drafter.propose_tree)."""
        K = self.limits.num_speculative_tokens
        offered = np.minimum(self.batch.room(), k)  # [B]
        if self.cold is not None:
            if not offered.any():  # nothing to draft: the drafter stays cold
                return Proposal.empty(len(self.batch), self.drafter.vocab_size, self.device)
            t0 = time.perf_counter()
            self.drafter.add_rows(self.cold)
            self.cold = None
            self.deferred_prefill_s += time.perf_counter() - t0
        if self._sampling is None:
            self._sampling = SamplingTensors.from_params(self.batch.params, self.device)
        tree = self.limits.tree(tree_budget)
        if tree is not None:
            N = tree.num_nodes
            uniforms = step_uniforms(self.batch.seeds, self.batch.generated, N, self.device)[:, :N]  # [B, N]
            return self.drafter.propose_tree(tree, offered.tolist(), self._sampling, uniforms)
        uniforms = step_uniforms(self.batch.seeds, self.batch.generated, K, self.device)[:, :K]  # [B, K]
        return self.drafter.propose(offered.tolist(), self._sampling, uniforms)

    def commit(self, kept: Sequence[Sequence[int]], accepted: Sequence[int], keep: Sequence[int] | None,
               features: Sequence[torch.Tensor] | None = None, path: Sequence[Sequence[int]] | None = None) -> None:
        """Apply the target's decision: the tokens kept (roll back the rest; with a tree, keep the
        accepted branch), then the rows kept."""
        self.batch.advance(kept)
        if self.drafter.needs_features:
            assert features is not None, "a feature draft needs the target's features in every outcome"
            self.drafter.commit(kept, accepted, [f.to(self.device) for f in features])
            if keep is not None:
                self.drafter.select(keep)
        elif self.cold is None:
            if path is None:
                self.drafter.commit(kept, accepted)
            else:
                self.drafter.commit_path(kept, path)
            if keep is not None:
                self.drafter.select(keep)
        else:
            for tokens, new in zip(self.cold, kept):
                tokens += new
            if keep is not None:
                self.cold = [self.cold[i] for i in keep]
        if keep is not None:
            self.batch.keep(keep)
            self._sampling = None


class TargetSide:
    """The verify-and-commit half: the target verifier and the batch state beside it.

    `synthetic_rate` (capacity planning) and `relax` (Yin et al. 2024's lossy dial) are the
    verifier's; `acceptance` labels every result with the rule that produced it."""

    def __init__(self, verifier: TargetVerifier, limits: RowLimits, synthetic_rate: float | None = None,
                 relax: float | None = None, acceptance: str = "exact"):
        self.verifier, self.limits = verifier, limits
        self.synthetic_rate, self.relax, self.acceptance = synthetic_rate, relax, acceptance
        self.batch = limits.batch()
        self._sampling: SamplingTensors | None = None
        # Feature draft only: each row's prompt features, until its first outcome carries them.
        self._prompt_features: list[torch.Tensor | None] | None = [] if verifier.tap is not None else None

    def __len__(self) -> int:
        return len(self.batch)

    @property
    def device(self) -> torch.device:
        return self.verifier.seqs.device

    def add(self, items: Sequence[tuple[int, Request]]) -> None:
        features = self.verifier.add_rows([req.prompt_token_ids for _, req in items])
        if self._prompt_features is not None:
            self._prompt_features += features
        self.batch.add(items)
        self._sampling = None

    def verify(self, proposal: Proposal, k: int, tree_budget: int | None = None) -> StepOutcome:
        """One target pass over every row's drafts (or tree: `tree_budget` as DraftSide.propose),
        the rejection test, one read-back; emit up to each row's stop condition, roll the cache
        back to what was kept, retire finished rows."""
        batch = self.batch
        offered = np.minimum(batch.room(), k)  # [B] what the draft side was allowed (statistics)
        if self._sampling is None:
            self._sampling = SamplingTensors.from_params(batch.params, self.device)
        tree = self.limits.tree(tree_budget)
        verdict = self._verdict(proposal, tree)
        kept = batch.emit(verdict, offered)
        accepted = verdict.num_accepted.tolist()
        path = verdict.paths()
        features = self._features(accepted, path)
        ranks: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
        if path is None:
            self.verifier.commit(kept, accepted)
        else:
            self.verifier.commit_path(kept, path)
            offered_r, moved_r = rank_visits(tree, verdict.num_drafted.tolist(), path)
            ranks = (tuple(offered_r.tolist()), tuple(moved_r.tolist()))
        finished, keep = self._retire()
        return StepOutcome(
            tuple(map(tuple, kept)), tuple(accepted), keep, finished,
            tuple(batch.overlap_sum.tolist()), tuple(batch.tested.tolist()), tuple(batch.room().tolist()),
            float(verdict.overlap_sums().sum()), int(verdict.num_tested.sum()), features,
            None if path is None else tuple(map(tuple, path)), *ranks,
        )

    def _verdict(self, proposal: Proposal, tree: TreeShape | None) -> Verdict:
        """The target pass and the rejection test of a chain (or a tree), read back in one copy."""
        batch = self.batch
        if tree is not None:
            N, n = tree.num_nodes, proposal.draft_token_ids.shape[1]
            uniforms = step_uniforms(batch.seeds, batch.generated, N, self.device)  # [B, 2N + 1]
            return self.verifier.verify_tree(proposal, tree, self._sampling, uniforms[:, N : N + n],
                                             uniforms[:, 2 * N]).read_back()
        K = self.limits.num_speculative_tokens
        if verifies_by_argmax(self._sampling, self.synthetic_rate, self.relax):
            uniforms = torch.zeros(len(batch), 2 * K + 1, dtype=torch.float64, device=self.device)  # no draw is read
        else:
            uniforms = step_uniforms(batch.seeds, batch.generated, K, self.device)  # [B, 2K + 1]
        Kp = proposal.draft_token_ids.shape[1]
        return self.verifier.verify(proposal, self._sampling, uniforms[:, K : K + Kp], uniforms[:, 2 * K],
                                    self.synthetic_rate, self.relax).read_back()

    def _features(self, accepted: Sequence[int], path: Sequence[Sequence[int]] | None) -> tuple[torch.Tensor, ...] | None:
        """A feature draft's part of the outcome: new rows' prompt features, then every row's
        features at the positions this step cached for good (device tensors; a tree's: its head
        and accepted path)."""
        if self._prompt_features is None:
            return None
        step = self.verifier.accepted_features(accepted, path)
        out = tuple(f if prompt is None else torch.cat([prompt, f]) for prompt, f in zip(self._prompt_features, step))
        self._prompt_features = [None] * len(step)
        return out

    def _retire(self) -> tuple[tuple[tuple[int, GenerationResult], ...], tuple[int, ...] | None]:
        done = self.batch.finish != 0  # [B]
        if not done.any():
            return (), None
        finished = tuple((self.batch.ids[b], self.label(self.batch.result(b))) for b in np.flatnonzero(done))
        keep = fill_holes((~done).tolist())  # a static cache copies only the rows that move
        self.batch.keep(keep)
        self.verifier.select(keep)
        if self._prompt_features is not None:
            self._prompt_features = [self._prompt_features[i] for i in keep]
        self._sampling = None
        return finished, tuple(keep)

    def label(self, result: GenerationResult) -> GenerationResult:
        result.synthetic = self.synthetic_rate is not None
        result.acceptance = self.acceptance
        return result
