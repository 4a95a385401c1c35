"""The target side of a speculative step: score the drafts, run the rejection test."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import PreTrainedModel

from raysd.core.rejection import RejectionOutput, draft_target_overlap, rejection_sample
from raysd.core.sampling import SamplingTensors, logits_to_probs
from raysd.engine.drafters import Proposal
from raysd.engine.sequences import SequenceState
from raysd.models.runner import ModelRunner


@dataclass(frozen=True)
class VerifyOutput:
    rejection: RejectionOutput
    overlap: torch.Tensor  # [B, K] sum_x min(target_probs, draft_probs) per draft position

    def per_row(self) -> tuple[list[list[int]], list[int], list[int], list[list[float]]]:
        """Ragged emitted tokens, drafts verified, drafts accepted, and the overlap at each tested position."""
        tokens = self.rejection.to_lists()
        tested = self.rejection.num_tested.tolist()
        overlap = self.overlap.tolist()
        return tokens, tested, self.rejection.num_accepted.tolist(), [o[:n] for o, n in zip(overlap, tested)]


class TargetVerifier:
    def __init__(self, model: PreTrainedModel):
        self.seqs = SequenceState(ModelRunner(model))
        self.vocab_size = self.seqs.runner.vocab_size

    def add_rows(self, prompts: Sequence[Sequence[int]]) -> None:
        self.seqs.add_rows(prompts)

    def select(self, rows: Sequence[int]) -> None:
        self.seqs.select(rows)

    def commit(self, new_tokens: Sequence[Sequence[int]]) -> None:
        self.seqs.commit(new_tokens)

    def verify(
        self,
        proposal: Proposal,
        sampling: SamplingTensors,
        accept_uniforms: torch.Tensor,  # [B, K]
        final_uniforms: torch.Tensor,  # [B]
    ) -> VerifyOutput:
        """One target forward over each row's last token plus its drafts (K + 1 logits), then
        the rejection test."""
        ids, num = proposal.draft_token_ids, proposal.num_draft_tokens
        logits = self.seqs.feed(ids, num, num + 1)  # [B, n, V] with n = max(num) + 1
        K = ids.shape[1]
        if logits.shape[1] < K + 1:  # every row drafted fewer than K: pad positions never read
            logits = torch.cat([logits, logits[:, -1:].expand(-1, K + 1 - logits.shape[1], -1)], dim=1)
        target_probs = logits_to_probs(logits, sampling)  # [B, K + 1, V]
        rejection = rejection_sample(ids, num, proposal.draft_probs, target_probs, accept_uniforms, final_uniforms)
        return VerifyOutput(rejection, draft_target_overlap(proposal.draft_probs, target_probs))
