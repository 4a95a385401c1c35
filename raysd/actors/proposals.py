"""What crosses from the draft actor to the target actor each step, and how many bytes it takes.

Verification needs the draft tokens, how many each row drafted, and the
distribution each draft was drawn from (`draft_probs` [B, K, V]). Dense, that is
B * K * V * 4 bytes: 82 MB for B=32, K=5, V=128k. A one-hot proposal (greedy drafts,
n-gram and suffix drafts: `Proposal.one_hot`) travels as its token ids alone, and
decoding puts the ones back. Other drafters draw from a distribution that is often
exactly sparse (top-k: k entries; an explicit `draft_top_m`: m entries), so the
proposal travels as the M largest entries of each position (indices + float32
values) whenever that is smaller than dense. Decoding scatters them back into
zeros, bit for bit the tensor the drafter produced, so the rejection test sees
exactly what it would in one process.

Positions past a row's num_draft_tokens are zeroed before encoding: the rejection
test never reads them (see raysd.core.rejection), and the overlap there is cut by
VerifyOutput.per_row.

The wire format holds numpy arrays: pickle protocol 5 (what Ray uses) sends them as
out-of-band buffers without a copy, and `pickled_nbytes` (raysd.actors.wire) counts them the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from raysd.actors.wire import ENCODINGS, ProbsEncoding
from raysd.engine.drafters import Proposal


@dataclass(frozen=True)
class WireProposal:
    draft_token_ids: np.ndarray  # [B, K] int32
    num_draft_tokens: np.ndarray  # [B] int32
    vocab_size: int
    dense: np.ndarray | None = None  # [B, K, V] float32, or None when sparse
    index: np.ndarray | None = None  # [B, K, M] int32 token ids of the M kept entries
    value: np.ndarray | None = None  # [B, K, M] float32 their probabilities (0 on padding)

    @property
    def encoding(self) -> str:
        """"ids" (one-hot: the token ids say it all), "dense" or "sparse"."""
        if self.dense is not None:
            return "dense"
        return "ids" if self.index is None else "sparse"


def encode_proposal(proposal: Proposal, encoding: ProbsEncoding = "auto") -> WireProposal:
    """Lossless: `decode_proposal(encode_proposal(p))` gives p's tokens, counts, and
    draft_probs equal at every drafted position (zero elsewhere)."""
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
    ids, num, probs = proposal.draft_token_ids, proposal.num_draft_tokens, proposal.draft_probs
    B, K, V = probs.shape
    wire_ids = ids.to(torch.int32).cpu().numpy()
    wire_num = num.to(torch.int32).cpu().numpy()
    if proposal.one_hot and encoding != "dense" and K:
        # A 1 at each drafted token, 0 past a row's drafts: the ids and counts carry it, and the
        # [B, K, V] tensor is never read (the general path below reads it twice).
        return WireProposal(wire_ids, wire_num, V)
    drafted = torch.arange(K, device=probs.device)[None, :] < num[:, None]  # [B, K]
    probs = torch.where(drafted[..., None], probs, 0.0)  # [B, K, V]
    M = int((probs > 0).sum(dim=-1).max()) if probs.numel() else 0  # most nonzeros at any position
    sparse_smaller = M * 8 < V * 4  # int32 index + float32 value per kept entry
    if encoding == "dense" or (encoding == "auto" and not sparse_smaller):
        return WireProposal(wire_ids, wire_num, V, dense=probs.float().cpu().numpy())
    # topk returns M distinct indices per position, so zero-valued padding never
    # lands on a kept entry when scattered back.
    value, index = probs.topk(M, dim=-1) if M else (probs[..., :0], probs[..., :0].long())  # [B, K, M]
    return WireProposal(wire_ids, wire_num, V, index=index.to(torch.int32).cpu().numpy(), value=value.float().cpu().numpy())


def decode_proposal(wire: WireProposal, device: torch.device | str = "cpu") -> Proposal:
    ids = torch.as_tensor(wire.draft_token_ids.astype(np.int64), device=device)  # [B, K]
    num = torch.as_tensor(wire.num_draft_tokens.astype(np.int64), device=device)  # [B]
    if wire.dense is not None:
        probs = torch.tensor(wire.dense, device=device)  # [B, K, V]
    elif wire.index is None:  # one-hot: a 1 at each drafted token
        B, K = ids.shape
        drafted = (torch.arange(K, device=device)[None, :] < num[:, None]).float()  # [B, K]
        probs = torch.zeros(B, K, wire.vocab_size, device=device).scatter_(-1, ids[..., None], drafted[..., None])
        return Proposal(ids, num, probs, tuple(int(n) for n in wire.num_draft_tokens), one_hot=True)
    else:
        B, K = ids.shape
        index = torch.as_tensor(wire.index.astype(np.int64), device=device)  # [B, K, M]
        value = torch.tensor(wire.value, device=device)  # [B, K, M]
        probs = torch.zeros(B, K, wire.vocab_size, device=device).scatter_(-1, index, value)
    return Proposal(ids, num, probs, tuple(int(n) for n in wire.num_draft_tokens))  # host counts: commit reads nothing back


def dense_probs_nbytes(batch_size: int, num_drafts: int, vocab_size: int) -> int:
    """The float32 draft_probs [B, K, V] alone: what a dense proposal costs at least."""
    return batch_size * num_drafts * vocab_size * 4
