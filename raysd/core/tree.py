"""Exact verification of a tree of drafts: multi-draft speculative sampling.

A row's drafts form a tree rooted at its context: node i holds a token, its parent
(-1 for the root) and the distribution its token was drawn from (`draft_probs[i]`, the
draft's distribution after the parent's path, or a one-hot for a deterministic
candidate). One target forward over every node gives `target_probs[0]` (after the
context) and `target_probs[i + 1]` (after node i's path).

Verification walks down from the root. At the current node, its children are tested in
order: child x, drawn from draft_probs, is accepted with probability
min(1, target_probs(x) / draft_probs(x)), target_probs the current target distribution there;
on a rejection target_probs becomes the residual norm(max(0, target_probs - draft_probs)) and
the next child is tried. An accepted child emits its token and becomes the current node
(target_probs: the target after its path); when every child is rejected, or the node has none,
one more token is drawn from target_probs (recovered or bonus) and the step ends.

This is SpecInfer's multi-step speculative sampling (Miao et al. 2024, arXiv 2305.09781,
Algorithm 2 "MSS") for children drawn i.i.d. from the parent's draft distribution, and the
top-k tree rule of EAGLE-2 / SGLang for deterministic candidates (draft_probs one-hot: accept x
with probability target_probs(x), else drop x from target_probs). Each test is Leviathan et al.'s exact rule against
the distribution that remains, so by induction every emitted token follows the target
given the tokens before it, provided each child's draw is independent of the verifier's
draws (children are drafted before verification). With a chain (every node the only child
of the previous one) this is `raysd.core.rejection.rejection_sample` exactly.

Nodes are numbered in a topological order (a parent before its children); siblings are
tested in index order. Processing nodes in index order is then the walk above: node i is
tested iff the current node is its parent when i comes up (its earlier siblings were all
rejected, and no later sibling has moved the walk).
"""

from __future__ import annotations

import torch

from raysd.core.rejection import PLACEHOLDER_TOKEN_ID, RejectionOutput
from raysd.core.sampling import sample_from_probs


def tree_rejection_sample(
    parents: torch.Tensor,  # [B, N] int64: parent node index, -1 for the root; parents[b, i] < i
    draft_token_ids: torch.Tensor,  # [B, N] int64
    num_nodes: torch.Tensor,  # [B] int64: real nodes per row; nodes past it are ignored
    draft_probs: torch.Tensor,  # [B, N, V] the distribution node i's token was drawn from
    target_probs: torch.Tensor,  # [B, N + 1, V]: 0 after the context, i + 1 after node i's path
    accept_uniforms: torch.Tensor,  # [B, N] in [0, 1)
    final_uniforms: torch.Tensor,  # [B] in [0, 1)
    max_depth: int,  # D >= the deepest node's depth (sizes the output)
) -> RejectionOutput:
    """Returns the accepted path's tokens [B, D + 1] (then the recovered or bonus token, then -1),
    its depth, the nodes tested, and `accepted_nodes` [B, D]."""
    B, N = draft_token_ids.shape
    V = target_probs.shape[-1]
    assert parents.shape == (B, N) and num_nodes.shape == (B,)
    assert draft_probs.shape == (B, N, V), (draft_probs.shape, (B, N, V))
    assert target_probs.shape == (B, N + 1, V), (target_probs.shape, (B, N + 1, V))
    assert accept_uniforms.shape == (B, N) and final_uniforms.shape == (B,)
    device = target_probs.device
    rows = torch.arange(B, device=device)

    current = torch.full((B,), -1, dtype=torch.int64, device=device)  # [B] the walk's node (-1: root)
    p = target_probs[:, 0].clone()  # [B, V] target (or residual) distribution at the current node
    depth = torch.zeros(B, dtype=torch.int64, device=device)  # [B] accepted so far
    tested = torch.zeros(B, dtype=torch.int64, device=device)  # [B]
    path_tokens = torch.full((B, max_depth + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    path_nodes = torch.full((B, max_depth), -1, dtype=torch.int64, device=device)
    for i in range(N):
        q = draft_probs[:, i]  # [B, V]
        x = draft_token_ids[:, i].clamp(min=0)  # [B]
        live = (parents[:, i] == current) & (i < num_nodes)  # [B] node i is the next test of its row
        p_x, q_x = p[rows, x], q[rows, x]  # [B]
        accept = live & (accept_uniforms[:, i] * q_x < p_x)  # [B] u < p/q without the division
        reject = live & ~accept
        # Rejected: the residual max(0, p - q), renormalised where it has mass (float32 sums
        # that should be equal can leave none; p is then its own limit, as in rejection_sample).
        residual = (p - q).clamp_(min=0.0)  # [B, V]
        mass = residual.sum(dim=-1, keepdim=True)  # [B, 1]
        residual = torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(p.dtype).tiny), p)
        p = torch.where(reject[:, None], residual, p)
        # Accepted: emit x, move to node i, whose own target distribution comes next.
        p = torch.where(accept[:, None], target_probs[:, i + 1], p)
        # Written with where, not boolean indexing: no nonzero, so nothing is read back to the host.
        path_tokens[rows, depth] = torch.where(accept, x, path_tokens[rows, depth])
        slot = depth.clamp(max=max(max_depth - 1, 0))  # [B] a row at full depth has no live node left
        if max_depth:
            path_nodes[rows, slot] = torch.where(accept, i, path_nodes[rows, slot])
        current = torch.where(accept, i, current)
        depth = depth + accept.long()
        tested = tested + live.long()
    final = sample_from_probs(p, final_uniforms)  # [B] recovered (after rejections) or bonus (at a leaf)
    path_tokens[rows, depth] = final
    return RejectionOutput(path_tokens, depth, tested, path_nodes)


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """[B, N] depth of each node (1 for the root's children), from parent pointers in topological order."""
    B, N = parents.shape
    depth = torch.zeros(B, N, dtype=torch.int64, device=parents.device)
    for i in range(N):
        up = parents[:, i]
        depth[:, i] = torch.where(up >= 0, depth.gather(1, up.clamp(min=0)[:, None])[:, 0] + 1, 1)
    return depth


def tree_attention_mask(parents: torch.Tensor) -> torch.Tensor:
    """[B, N, N] bool: node i attends to node j iff j is i or an ancestor of i (the context
    before the tree is visible to every node; the caller adds it)."""
    B, N = parents.shape
    mask = torch.eye(N, dtype=torch.bool, device=parents.device).expand(B, N, N).clone()
    for i in range(N):
        up = parents[:, i]
        has = up >= 0
        inherited = mask[torch.arange(B, device=parents.device), up.clamp(min=0)]  # [B, N] the parent's row
        mask[:, i] |= inherited & has[:, None]
    return mask
