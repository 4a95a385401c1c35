"""The target side of a speculative step: score the drafts, run the rejection test."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from raysd.core.rejection import RejectionOutput, draft_target_overlap, greedy_rejection_sample, rejection_sample
from raysd.core.sampling import SamplingTensors, argmax_last, logits_to_probs, sample_from_probs
from raysd.core.tree import TreeOutput, tree_rejection_sample
from raysd.core.tree_shape import TreeShape
from raysd.engine.drafters import Proposal
from raysd.engine.sequences import SequenceState
from raysd.models.features import FeatureTap
from raysd.models.runners import make_runner
from raysd.models.static_runner import StaticModelRunner

if TYPE_CHECKING:  # annotations only: a process that only coordinates never imports the modeling stack
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class Verdict:
    """One verification, read back to the host in one copy (`VerifyOutput.read_back`)."""

    tokens: np.ndarray  # [B, K + 1] int64: accepted drafts, then the recovered or bonus token, then -1
    num_accepted: np.ndarray  # [B] drafts accepted; tokens emitted = num_accepted + 1
    num_tested: np.ndarray  # [B] positions whose rejection test ran
    num_drafted: np.ndarray  # [B] drafts proposed
    overlaps: np.ndarray  # [B, K] float64 sum_x min(target_probs, draft_probs); meaningful below num_tested
    # A tree's verdict (TreeVerifyOutput) also has, per row, the node at each accepted depth
    # ([B, D], -1 past num_accepted) and how many accepted nodes were not a rank-0 child.
    path_nodes: np.ndarray | None = None
    branch_accepts: np.ndarray | None = None

    def overlap_sums(self) -> np.ndarray:
        """[B] the overlaps summed over each row's tested positions."""
        tested = np.arange(self.overlaps.shape[1])[None, :] < self.num_tested[:, None]  # [B, K]
        return np.where(tested, self.overlaps, 0.0).sum(axis=1)

    def paths(self) -> list[list[int]] | None:
        """A tree's accepted nodes per row (host lists), or None for a chain."""
        if self.path_nodes is None:
            return None
        return [row[:n].tolist() for row, n in zip(self.path_nodes, self.num_accepted)]


@dataclass(frozen=True)
class VerifyOutput:
    rejection: RejectionOutput
    overlap: torch.Tensor  # [B, K] sum_x min(target_probs, draft_probs) per draft position
    num_draft_tokens: torch.Tensor  # [B] drafts proposed per row

    def read_back(self) -> Verdict:
        """The step's one device-to-host copy: tokens, counts and overlaps packed in one tensor
        (float64 holds token ids exactly)."""
        r = self.rejection
        W = r.output_token_ids.shape[1]  # K + 1
        packed = torch.cat([
            r.output_token_ids.double(),  # [B, K + 1]
            torch.stack([r.num_accepted, r.num_tested, self.num_draft_tokens], dim=1).double(),  # [B, 3]
            self.overlap.double(),  # [B, K]
        ], dim=1).cpu().numpy()
        counts = packed[:, W : W + 3].astype(np.int64)
        return Verdict(packed[:, :W].astype(np.int64), counts[:, 0], counts[:, 1], counts[:, 2], packed[:, W + 3 :])

    def per_row(self) -> tuple[list[list[int]], list[int], list[int], list[list[float]]]:
        """Ragged emitted tokens, drafts verified, drafts accepted, and the overlap at each tested position."""
        v = self.read_back()
        tokens = [v.tokens[b, : v.num_accepted[b] + 1].tolist() for b in range(len(v.tokens))]
        overlaps = [v.overlaps[b, : v.num_tested[b]].tolist() for b in range(len(v.tokens))]
        return tokens, v.num_tested.tolist(), v.num_accepted.tolist(), overlaps


@dataclass(frozen=True)
class TreeVerifyOutput:
    tree: TreeOutput
    overlap: torch.Tensor  # [B, D] overlaps of the rank-0 children along the accepted path (path_overlaps)
    num_tested: torch.Tensor  # [B] how many of them were tested
    num_draft_tokens: torch.Tensor  # [B] nodes per row
    branch_accepts: torch.Tensor  # [B] accepted nodes that are not a rank-0 child

    def read_back(self) -> Verdict:
        """As VerifyOutput.read_back, in one copy: tokens, counts, overlaps and the accepted nodes."""
        t = self.tree
        W = t.output_token_ids.shape[1]  # D + 1
        D = W - 1
        packed = torch.cat([
            t.output_token_ids.double(),  # [B, D + 1]
            torch.stack([t.num_accepted, self.num_tested, self.num_draft_tokens, self.branch_accepts], dim=1).double(),
            self.overlap.double(),  # [B, D]
            t.accepted_nodes.double(),  # [B, D]
        ], dim=1).cpu().numpy()
        counts = packed[:, W : W + 4].astype(np.int64)
        return Verdict(packed[:, :W].astype(np.int64), counts[:, 0], counts[:, 1], counts[:, 2],
                       packed[:, W + 4 : W + 4 + D], packed[:, W + 4 + D :].astype(np.int64), counts[:, 3])


def path_overlaps(shape: TreeShape, tree: TreeOutput, num_nodes: torch.Tensor, draft_probs: torch.Tensor,
                  target_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The chain's evidence for alpha_estimate, read off a tree: at each node of the accepted
    path (the root first), sum_x min(target_probs, draft_probs) of its rank-0 child, the one
    drawn from the draft and tested first, against the untouched target. Returns [B, D]
    overlaps and [B] how many were tested (a prefix: the accepted depth, plus one where the
    path's last node has a child)."""
    B, N = draft_probs.shape[:2]
    D = tree.accepted_nodes.shape[1]
    device = target_probs.device
    first = torch.tensor(shape.first_children(N), dtype=torch.int64, device=device)  # [N + 1]
    root = torch.full((B, 1), -1, dtype=torch.int64, device=device)
    at = torch.cat([root, tree.accepted_nodes], dim=1)[:, :D]  # [B, D] the path's node at depth d
    child = first[at + 1]  # [B, D] its rank-0 child, -1 if none
    d = torch.arange(D, device=device)[None, :]
    tested = (d <= tree.num_accepted[:, None]) & (child >= 0) & (child < num_nodes[:, None])  # [B, D]
    V = target_probs.shape[-1]
    p = target_probs.gather(1, (at + 1)[..., None].expand(B, D, V))  # [B, D, V]
    q = draft_probs.gather(1, child.clamp(min=0)[..., None].expand(B, D, V))  # [B, D, V]
    overlap = torch.where(tested, torch.minimum(p, q).sum(dim=-1), 0.0)  # [B, D]
    return overlap, tested.sum(dim=1)


class TargetVerifier:
    """`features=True` also keeps the target's features (last-layer pre-norm hidden states) of
    every position it caches, for a feature draft: `add_rows` returns the prompts', and
    `accepted_features` a step's accepted positions'."""

    def __init__(self, model: PreTrainedModel, runner: str = "auto", features: bool = False,
                 linear_kernels: str = "auto"):
        self.seqs = SequenceState(make_runner(model, runner, linear_kernels=linear_kernels))
        self.vocab_size = self.seqs.runner.vocab_size
        self.tap = FeatureTap.of(model) if features else None
        self.hidden_size = model.config.hidden_size
        self._step: tuple[torch.Tensor, list[int], list[int]] | None = None  # features [B, W, H], starts, pending

    def add_rows(self, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor] | None:
        """Prefill new rows (all but each prompt's last token); with features, return each row's
        [len(prompt) - 1, H] features of the prefilled positions."""
        if self.tap is not None:
            self.tap.take_all()  # drop whatever ran on the model since (e.g. a step-cost profile)
        self.seqs.add_rows(prompts)
        if self.tap is None:
            return None
        lengths = [len(p) - 1 for p in prompts]
        calls = self.tap.take_all()  # one [n, W, H] per prefill forward, its rows right-aligned
        layout = self.seqs.runner.prefill_calls  # the new rows each of those forwards ran
        assert len(calls) == len(layout), f"{len(calls)} prefill forwards recorded, the runner made {len(layout)}"
        by_row = {i: F[k, F.shape[1] - lengths[i] :] for F, rows in zip(calls, layout) for k, i in enumerate(rows)}
        empty = torch.zeros(0, self.hidden_size, device=self.seqs.device)
        return [by_row.get(i, empty) for i in range(len(prompts))]

    def accepted_features(self, num_accepted: Sequence[int], path: Sequence[Sequence[int]] | None = None) -> list[torch.Tensor]:
        """After `verify`: each row's features at the positions it now caches for good (its pending
        tokens and its accepted drafts), [pending + accepted, H]: device tensors, nothing read back.
        After `verify_tree`, with the accepted `path`: the tree's head (the pending token), then
        the path's nodes."""
        assert self._step is not None, "verify with features=True first"
        F, starts, pending = self._step
        self._step = None
        if path is not None:
            assert starts is None, "a chain's features: no path"
            return [F[b, [0] + [n + 1 for n in p]] for b, p in enumerate(path)]  # [1 + len(p), H]
        return [F[b, s : s + p + int(a)] for b, (s, p, a) in enumerate(zip(starts, pending, num_accepted))]

    def select(self, rows: Sequence[int]) -> None:
        self.seqs.select(rows)

    def commit(self, new_tokens: Sequence[Sequence[int]], num_accepted: Sequence[int] | None = None) -> None:
        self.seqs.commit(new_tokens, num_accepted)

    @property
    def supports_trees(self) -> bool:
        return isinstance(self.seqs.runner, StaticModelRunner)

    def commit_path(self, new_tokens: Sequence[Sequence[int]], path: Sequence[Sequence[int]]) -> None:
        """After `verify_tree`: keep each row's pending token and accepted branch (the target fed them all)."""
        self.seqs.commit_path(new_tokens, path, fed_depth=max(map(len, path), default=0))

    def verify_tree(
        self,
        proposal: Proposal,  # [B, N] nodes of `shape`, breadth first; num_draft_tokens: nodes per row
        shape: TreeShape,
        sampling: SamplingTensors,
        accept_uniforms: torch.Tensor,  # [B, N]
        final_uniforms: torch.Tensor,  # [B]
    ) -> TreeVerifyOutput:
        """One target forward over each row's pending token and its tree (N + 1 logits:
        StaticModelRunner.forward_tree with the pending token as the tree's head), then multi-draft
        speculative sampling (raysd.core.tree.tree_rejection_sample: SpecInfer's MSS, Miao et al.
        2024, Algorithm 2, with EAGLE-2's rule for one-hot candidates)."""
        ids, num = proposal.draft_token_ids, proposal.num_draft_tokens
        B, N = ids.shape
        parents = torch.tensor(shape.parents[:N], dtype=torch.int64, device=self.seqs.device).expand(B, N)  # [B, N]
        if self.tap is not None:  # the chunk: each row's pending token (the tree's head), then its nodes
            assert {len(p) for p in self.seqs.pending} == {1}, "a feature draft's tree follows one pending token per row"
        logits = self.seqs.feed_tree(ids, parents, num)  # [B, N + 1, V]
        if self.tap is not None:
            self._step = (self.tap.take(), None, None)  # [B, N + 1, H]
        target_probs = logits_to_probs(logits, sampling)  # [B, N + 1, V]
        tree = tree_rejection_sample(parents, ids, num, proposal.draft_probs, target_probs, accept_uniforms,
                                     final_uniforms, max_depth=shape.depth_of(N))
        overlap, tested = path_overlaps(shape, tree, num, proposal.draft_probs, target_probs)
        ranks = torch.tensor((0,) + shape.ranks[:N], dtype=torch.int64, device=self.seqs.device)  # [N + 1]
        branch = (ranks[tree.accepted_nodes + 1] > 0).sum(dim=1)  # [B]; -1 (past the path) reads rank 0
        return TreeVerifyOutput(tree, overlap, tested, num, branch)

    def verify(
        self,
        proposal: Proposal,
        sampling: SamplingTensors,
        accept_uniforms: torch.Tensor,  # [B, K]
        final_uniforms: torch.Tensor,  # [B]
        synthetic_acceptance_rate: float | None = None,
        relax: float | None = None,
    ) -> VerifyOutput:
        """One target forward over each row's last token plus its drafts (K + 1 logits), then
        the rejection test, or, with `synthetic_acceptance_rate`, the synthetic accept rule
        (see `synthetic_accept`; its output does NOT follow the target distribution), or with
        `relax` = lambda the relaxed test (rejection_sample; lossy, lambda TV per position)."""
        ids, num = proposal.draft_token_ids, proposal.num_draft_tokens
        K = ids.shape[1]
        host = proposal.num_draft_host
        n = max(host, default=0) + 1 if host is not None else None
        pending = [len(p) for p in self.seqs.pending]
        logits = self.seqs.feed(ids, num, num + 1, n, host)  # [B, n, V] with n = max(num) + 1
        if self.tap is not None:  # the chunk right-aligns each row's pending tokens and drafts
            assert host is not None, "a feature draft states its draft counts on the host"
            F = self.tap.take()  # [B, W, H]
            W = F.shape[1]
            self._step = (F, [W - p - d for p, d in zip(pending, host)], pending)
        if logits.shape[1] < K + 1:  # every row drafted fewer than K: pad positions never read
            logits = torch.cat([logits, logits[:, -1:].expand(-1, K + 1 - logits.shape[1], -1)], dim=1)
        if verifies_by_argmax(sampling, synthetic_acceptance_rate, relax):
            target_ids = argmax_last(logits)  # [B, K + 1]: each greedy row's one-hot target
            rejection = greedy_rejection_sample(ids, num, target_ids)
            overlap = proposal.draft_probs.gather(-1, target_ids[:, :K, None])[..., 0]  # [B, K] 1 - TV to a one-hot
            return VerifyOutput(rejection, overlap, num)
        target_probs = logits_to_probs(logits, sampling)  # [B, K + 1, V]
        if synthetic_acceptance_rate is None:
            lam = None if relax is None else torch.full_like(final_uniforms, relax)  # [B]
            rejection = rejection_sample(ids, num, proposal.draft_probs, target_probs, accept_uniforms, final_uniforms, lam)
        else:
            rejection = synthetic_accept(ids, num, target_probs, accept_uniforms, final_uniforms, synthetic_acceptance_rate)
        return VerifyOutput(rejection, draft_target_overlap(proposal.draft_probs, target_probs), num)


def verifies_by_argmax(sampling: SamplingTensors, synthetic_acceptance_rate: float | None, relax: float | None) -> bool:
    """Whether `TargetVerifier.verify` decides from the target's argmax alone (an all-greedy batch
    under the exact rule): it then reads no uniform, so the caller need not draw any."""
    return sampling.all_greedy and synthetic_acceptance_rate is None and relax is None


def synthetic_accept(
    draft_token_ids: torch.Tensor,  # [B, K] int64
    num_draft_tokens: torch.Tensor,  # [B] int64, each in 0..K
    target_probs: torch.Tensor,  # [B, K + 1, V]
    accept_uniforms: torch.Tensor,  # [B, K] in [0, 1)
    final_uniforms: torch.Tensor,  # [B] in [0, 1)
    rate: float,
) -> RejectionOutput:
    """Capacity-planning stand-in for the rejection test (vLLM's "synthetic" acceptance):
    draft i is accepted iff accept_uniforms[:, i] < rate, whatever the two models say; the
    accepted prefix is kept as usual and the next token is drawn from the target right after
    it. Steps then cost what they would at acceptance rate `rate`, but the output is NOT
    distributed as the target's."""
    B, K = draft_token_ids.shape
    rows = torch.arange(B, device=target_probs.device)
    positions = torch.arange(K, device=target_probs.device)
    drafted = positions[None, :] < num_draft_tokens[:, None]  # [B, K]
    accepted = drafted & (accept_uniforms < rate)  # [B, K]
    num_accepted = accepted.int().cumprod(dim=1).sum(dim=1)  # [B] length of the accepted prefix
    final_tokens = sample_from_probs(target_probs[rows, num_accepted], final_uniforms)  # [B]
    return RejectionOutput.from_prefix(draft_token_ids, num_draft_tokens, num_accepted, final_tokens)
