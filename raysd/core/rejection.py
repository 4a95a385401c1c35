"""Batched rejection sampling of drafts against the target (speculative sampling).

Leviathan, Kalman, Matias 2023, "Fast Inference from Transformers via Speculative
Decoding", Algorithm 1; Chen et al. 2023, "Accelerating Large Language Model
Decoding with Speculative Sampling", Algorithm 2. The full draft distribution is
used, not a one-hot of the drafted token, so any drafter is exact: a model-free
drafter simply passes one-hot `draft_probs`.

Each row may have its own number of drafts (`num_draft_tokens`); positions past it
are not tested and the token there is the bonus. The output has a fixed shape
[B, K + 1] padded with PLACEHOLDER_TOKEN_ID and is turned into ragged lists once,
by `RejectionOutput.to_lists`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raysd.core.sampling import sample_from_probs

PLACEHOLDER_TOKEN_ID = -1  # public: marks the unused tail of each output row


@dataclass(frozen=True)
class RejectionOutput:
    """What a rejection test decided, on the device: for a chain (`rejection_sample`) and a tree
    (raysd.core.tree.tree_rejection_sample) alike."""

    output_token_ids: torch.Tensor  # [B, K + 1] accepted drafts, then recovered or bonus, then -1
    num_accepted: torch.Tensor  # [B] accepted drafts per row (a tree: the accepted depth); tokens emitted = num_accepted + 1
    num_tested: torch.Tensor  # [B] positions (a tree: nodes) whose rejection test ran
    # A tree only: the node at each accepted depth, [B, D], -1 past num_accepted; None for a chain.
    accepted_nodes: torch.Tensor | None = None

    @classmethod
    def from_prefix(cls, draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor, num_accepted: torch.Tensor,
                    final_tokens: torch.Tensor) -> "RejectionOutput":
        """Each row's first num_accepted[b] drafts ([B, K]), then its final (recovered or bonus)
        token ([B]), then PLACEHOLDER_TOKEN_ID: what every acceptance rule emits."""
        B, K = draft_token_ids.shape
        device = draft_token_ids.device
        positions = torch.arange(K, device=device)
        output = torch.full((B, K + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
        output[:, :K] = torch.where(positions[None, :] < num_accepted[:, None], draft_token_ids, PLACEHOLDER_TOKEN_ID)
        output[torch.arange(B, device=device), num_accepted] = final_tokens
        return cls(output, num_accepted, torch.minimum(num_accepted + 1, num_draft_tokens))

    def to_lists(self) -> list[list[int]]:
        """Ragged emitted tokens per row; one device-to-host copy for the batch."""
        rows = self.output_token_ids.tolist()
        counts = (self.num_accepted + 1).tolist()
        return [row[:n] for row, n in zip(rows, counts)]


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [B, K] int64
    num_draft_tokens: torch.Tensor,  # [B] int64, each in 0..K
    draft_probs: torch.Tensor,  # [B, K, V] distribution each draft was sampled from
    target_probs: torch.Tensor,  # [B, K + 1, V] target distribution after each prefix
    accept_uniforms: torch.Tensor,  # [B, K] in [0, 1)
    final_uniforms: torch.Tensor,  # [B] in [0, 1), for the recovered or bonus token
    relax: torch.Tensor | None = None,  # [B] lambda in [0, 1]; None: exact
) -> RejectionOutput:
    """Accept each draft token x with probability min(1, target_probs(x) / draft_probs(x)).

    The first rejection at position j emits a recovered token drawn from
    norm(max(0, target_probs[j] - draft_probs[j])); if every draft is accepted the
    bonus token is drawn from target_probs[num_drafts]. Greedy rows pass one-hot
    target_probs, which makes this the exact "accept while draft == argmax" rule.

    `relax` (lossy, off by default): verify against the mixture
    (1 - lambda) target_probs + lambda draft_probs instead, i.e. accept with probability
    min(1, (1 - lambda) target_probs(x) / draft_probs(x) + lambda). Its residual is
    (1 - lambda) max(0, target_probs - draft_probs), the same distribution once normalised,
    so a drafted position emits exactly the mixture: TV to the target lambda TV(target, draft),
    rejection probability (1 - lambda) TV. Their sum is TV: Yin et al. 2024's Pareto front
    (arXiv 2411.00841, Theorems 4-5). The bonus token stays the target's.
    """
    B, K = draft_token_ids.shape
    V = target_probs.shape[-1]
    assert num_draft_tokens.shape == (B,)
    assert draft_probs.shape == (B, K, V), (draft_probs.shape, (B, K, V))
    assert target_probs.shape == (B, K + 1, V), (target_probs.shape, (B, K + 1, V))
    assert accept_uniforms.shape == (B, K) and final_uniforms.shape == (B,)
    device = target_probs.device
    rows = torch.arange(B, device=device)

    positions = torch.arange(K, device=device)
    drafted = positions[None, :] < num_draft_tokens[:, None]  # [B, K]
    index = draft_token_ids.clamp(min=0)[..., None]  # [B, K, 1]
    target_at_draft = target_probs[:, :K].gather(-1, index)[..., 0]  # [B, K]
    draft_at_draft = draft_probs.gather(-1, index)[..., 0]  # [B, K]
    if relax is not None:  # the mixture's probability at the draft
        lam = relax[:, None]  # [B, 1]
        target_at_draft = (1 - lam) * target_at_draft + lam * draft_at_draft  # [B, K]
    # u < target/draft written without the division; a sampled draft has draft_prob > 0.
    accepted = drafted & (accept_uniforms * draft_at_draft < target_at_draft)  # [B, K]
    num_accepted = accepted.int().cumprod(dim=1).sum(dim=1)  # [B] length of the accepted prefix

    rejected = num_accepted < num_draft_tokens  # [B] stopped by a rejection, not by running out
    final_target = target_probs[rows, num_accepted]  # [B, V]
    if K > 0:
        final_draft = draft_probs[rows, num_accepted.clamp(max=K - 1)]  # [B, V]
        residual = (final_target - final_draft).clamp_(min=0.0)  # [B, V] recovered distribution
        # float32 probabilities do not sum to exactly 1, so target <= draft everywhere can
        # happen with a rejection of probability ~1e-6; then the two agree to rounding and
        # the residual's limit is the target itself.
        use_residual = rejected & (residual.sum(dim=-1) > 0)  # [B]
        final_dist = torch.where(use_residual[:, None], residual, final_target)
    else:
        final_dist = final_target
    final_tokens = sample_from_probs(final_dist, final_uniforms)  # [B]
    return RejectionOutput.from_prefix(draft_token_ids, num_draft_tokens, num_accepted, final_tokens)


def greedy_rejection_sample(
    draft_token_ids: torch.Tensor,  # [B, K] int64
    num_draft_tokens: torch.Tensor,  # [B] int64, each in 0..K
    target_token_ids: torch.Tensor,  # [B, K + 1] int64: the target's argmax after each prefix
) -> RejectionOutput:
    """`rejection_sample` for a batch whose rows are all greedy, from the target's argmax alone.

    With one-hot target_probs the test accepts a draft iff it is the argmax (target_probs(x) is 1
    there and 0 elsewhere, whatever draft_probs(x) and the uniform), and the residual
    max(0, onehot - draft_probs) has mass only at the argmax, so the recovered and bonus tokens
    are the argmax too: no uniform is read and draft_probs does not matter. Same output as
    rejection_sample (tests/core/test_rejection.py), without the [B, K + 1, V] one-hots; vLLM's
    rejection sampler keeps the same all-greedy path (`rejection_greedy_sample_kernel`)."""
    B, K = draft_token_ids.shape
    assert num_draft_tokens.shape == (B,) and target_token_ids.shape == (B, K + 1), target_token_ids.shape
    positions = torch.arange(K, device=target_token_ids.device)
    drafted = positions[None, :] < num_draft_tokens[:, None]  # [B, K]
    accepted = drafted & (draft_token_ids == target_token_ids[:, :K])  # [B, K]
    num_accepted = accepted.int().cumprod(dim=1).sum(dim=1)  # [B]
    final_tokens = target_token_ids.gather(1, num_accepted[:, None])[:, 0]  # [B] the argmax right after the prefix
    return RejectionOutput.from_prefix(draft_token_ids, num_draft_tokens, num_accepted, final_tokens)


def draft_target_overlap(draft_probs: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """sum_x min(target_probs(x), draft_probs(x)) = 1 - TV: the acceptance probability at
    each draft position (Leviathan et al. 2023, Definition 3.1 and Corollary 3.6).

    Args:
        draft_probs: [B, K, V]
        target_probs: [B, K + 1, V]; the last position has no draft and is ignored.
    Returns:
        [B, K] float32.
    """
    K = draft_probs.shape[1]
    return torch.minimum(draft_probs, target_probs[:, :K]).sum(dim=-1)
