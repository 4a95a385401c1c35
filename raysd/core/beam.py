"""Beam search as Hugging Face `generate(num_beams=W, do_sample=False)` runs it, and its exact
speculative form: replaying beam selection level by level against a verified tree of drafts.

Glossary:
    beam        one of the W running hypotheses of a prompt: its generated tokens and its score,
                the float32 sum of the target's log-probabilities of those tokens
    level       one beam-search step: every running beam grows by one token
    candidate   (beam, token, beam score + log-probability of token after the beam): the
                top max(2, 1 + #EOS) x W over all W x V continuations are kept per level
    finished    a hypothesis that ended (an EOS token, or the length limit), scored
                sum / generated_length ** length_penalty; the best W are kept
    tree        per row (a running beam's KV-cache slot), drafted continuations of that beam:
                node i holds a token and its parent (-1: the beam's last token, the row's head)
    replay      beam selection run level by level from the target's log-probabilities at the
                tree's nodes, while every beam selected at a level is a node

The definition followed is transformers' `GenerationMixin._beam_search` (transformers 5):
per level, the top 2W candidates (more with several EOS ids) of all beams; the first W of them
that end go to the finished set, the best W that do not end run on; a prompt stops when its
finished set can no longer change (`early_stopping`: True stops once W hypotheses finished;
False and "never" use HF's bound on the best running beam's final score). The arithmetic is
HF's, in float32, so equal log-probabilities give equal scores bit for bit.

Speculation (Leviathan, Kalman and Matias 2023 list beam search among its extensions): one
target pass over every row's head and tree gives log-probabilities after each beam and each
node. Level 1 needs only the heads. A level's candidates need the log-probabilities after each
running beam, which are known while every running beam is a node whose logits the pass
computed; so the replay goes on while each beam a level selects is a node, and stops after the
first level that selects one that is not. Each level is computed as the target's own beam search
would compute it, so the output is the target's beam search (ties apart: HF breaks exact ties by
index) and each pass advances at least one level, at most the tree's depth + 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

NO_SCORE = -1.0e9  # HF's score of the W - 1 copies of the prompt before the first level


@dataclass(frozen=True)
class BeamConfig:
    """HF's beam-search settings (GenerationConfig's names)."""

    num_beams: int = 4  # W >= 2
    length_penalty: float = 1.0  # finished score = sum of log-probs / generated_length ** length_penalty
    early_stopping: bool | str = False  # True, False or "never" (HF's meanings)
    num_return_sequences: int = 1  # N <= W: the best N finished hypotheses are returned

    def __post_init__(self) -> None:
        W, N = self.num_beams, self.num_return_sequences
        if isinstance(W, bool) or not isinstance(W, int) or W < 2:
            raise ValueError(f"beam search needs num_beams >= 2, got {W!r}")
        if isinstance(N, bool) or not isinstance(N, int) or not 1 <= N <= W:
            raise ValueError(f"num_return_sequences must be in 1..num_beams ({W}), got {N!r}")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        if not np.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be finite, got {self.length_penalty}")


@dataclass(frozen=True)
class Hypothesis:
    score: float  # float32 value: sum of log-probs / generated_length ** length_penalty
    tokens: tuple[int, ...]  # generated tokens, the ending one (EOS, or the last at the limit) included


def _div32(values: np.ndarray, denominator: float) -> np.ndarray:
    """float32 values / a Python float, as torch divides them in HF's code."""
    return (torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)) / denominator).numpy()


class BeamGroup:
    """One prompt's beam search, HF's `_beam_search` for one batch entry.

    `advance` takes a level's top candidates and returns the new running beams; the group keeps
    the beams' tokens and scores, the finished hypotheses, and whether anything can still change
    (`done`). W - 1 of the beams start as copies of the prompt scored NO_SCORE, as in HF."""

    def __init__(self, config: BeamConfig, eos_token_ids: Sequence[int], max_new_tokens: int):
        W = config.num_beams
        self.config, self.eos, self.max_new = config, frozenset(eos_token_ids), max_new_tokens
        self.scores = np.full(W, NO_SCORE, dtype=np.float32)  # [W] running beams' scores
        self.scores[0] = 0.0
        self.tokens: list[tuple[int, ...]] = [()] * W  # running beams' generated tokens
        self.finished: list[Hypothesis] = []  # best first, at most W
        self.improvable = True  # HF's is_early_stop_heuristic_unsatisfied (once False, always)
        self.generated = 0  # levels so far
        self.done = False

    @property
    def num_candidates(self) -> int:
        """Candidates kept per level: enough that W of them do not end at an EOS."""
        return max(2, 1 + len(self.eos)) * self.config.num_beams

    def advance(self, scores: np.ndarray, beams: np.ndarray, tokens: np.ndarray) -> list[tuple[int, int]]:
        """One level from its top `num_candidates` candidates, best first ([C] float32 scores,
        parent beam, token). Returns the new running beams as (parent beam, token), best first
        ([] when the level reached the length limit)."""
        cfg, W = self.config, self.config.num_beams
        assert not self.done and scores.shape == beams.shape == tokens.shape == (self.num_candidates,)
        g = self.generated + 1  # generated length after this level
        at_limit = g >= self.max_new
        ends = [at_limit or int(t) in self.eos for t in tokens]
        full = len(self.finished) == W
        if self.improvable and not (cfg.early_stopping is True and full):
            # Only the top W candidates may finish; the others are HF's spares for running on.
            penalised = _div32(scores[:W], float(g ** cfg.length_penalty))
            new = [Hypothesis(float(penalised[i]), self.tokens[int(beams[i])] + (int(tokens[i]),))
                   for i in range(W) if ends[i]]
            self.finished = sorted(self.finished + new, key=lambda h: -h.score)[:W]
        running = [i for i in range(len(ends)) if not ends[i]][:W]
        self.generated = g
        if len(running) < W:  # the length limit: every candidate ended
            self.done = True
            return []
        self.tokens = [self.tokens[int(beams[i])] + (int(tokens[i]),) for i in running]
        self.scores = scores[running].astype(np.float32)
        self._check_improvable()
        self.done = not self.improvable or (cfg.early_stopping is True and len(self.finished) == W)
        return [(int(beams[i]), int(tokens[i])) for i in running]

    def _check_improvable(self) -> None:
        """HF's `_check_early_stop_heuristic`: can the best running beam still beat the worst of
        W finished hypotheses? Its length is taken as now, or as the limit under "never" with a
        positive length penalty (a longer beam then scores higher)."""
        cfg = self.config
        if len(self.finished) < cfg.num_beams:
            return
        length = self.max_new if cfg.early_stopping == "never" and cfg.length_penalty > 0.0 else self.generated
        best = _div32(self.scores.max(keepdims=True), float(length ** cfg.length_penalty))[0]
        self.improvable = bool(best > np.float32(self.finished[-1].score))

    def results(self) -> list[Hypothesis]:
        """The best num_return_sequences finished hypotheses, best first."""
        return self.finished[: self.config.num_return_sequences]


def top_candidates(log_probs: torch.Tensor, scores: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A level's top k candidates of G groups: log_probs [G, W, V] after each running beam, scores
    [G, W] float32. Returns [G, k] float32 scores, parent beams and tokens, best first (HF's top-k
    over each group's flattened W x V continuations)."""
    G, W, V = log_probs.shape
    total = (log_probs + scores[:, :, None]).reshape(G, W * V)  # [G, W V]
    values, index = torch.topk(total, k=k)  # [G, k]
    index = index.cpu().numpy()
    return values.cpu().numpy(), index // V, index % V


@dataclass
class BeamTree:
    """The drafted tree of every row: node i of row r holds tokens[r][i], its parent parents[r][i]
    (-1: the row's head, its beam's last token) comes before it. Host lists."""

    tokens: list[list[int]]
    parents: list[list[int]]
    _children: list[dict[tuple[int, int], int]] | None = field(default=None, repr=False)

    @staticmethod
    def empty(rows: int) -> "BeamTree":
        return BeamTree([[] for _ in range(rows)], [[] for _ in range(rows)])

    @property
    def num_nodes(self) -> list[int]:
        return [len(t) for t in self.tokens]

    def child(self, row: int, node: int, token: int) -> int | None:
        """The node of `row` under `node` (-1: the head) holding `token`, or None."""
        if self._children is None:
            self._children = [{(p, t): i for i, (p, t) in enumerate(zip(ps, ts))}
                              for ps, ts in zip(self.parents, self.tokens)]
        return self._children[row].get((node, token))

    def depth(self, row: int) -> int:
        depths: list[int] = []
        for p in self.parents[row]:
            depths.append(1 if p < 0 else depths[p] + 1)
        return max(depths, default=0)


@dataclass
class Walk:
    """Where a running beam stands during a replay: the row it descends from, the tree node its
    last token is (-1: the row's head; None: not a node), the nodes and tokens of this pass."""

    row: int
    node: int | None = -1
    nodes: tuple[int, ...] = ()
    tokens: tuple[int, ...] = ()

    def to(self, node: int | None, token: int) -> "Walk":
        return Walk(self.row, node, self.nodes + ((node,) if node is not None else ()), self.tokens + (token,))


@dataclass
class Replayed:
    """One group's outcome of a replay: levels advanced, its new running beams (`walks`, best
    first; read only while the group runs on) and the distinct tree nodes that lay on a selected beam."""

    levels: int = 0
    walks: list[Walk] = field(default_factory=list)
    selected_nodes: int = 0


def replay(groups: Sequence[BeamGroup], rows: Sequence[Sequence[int]], logits: torch.Tensor,
           tree: BeamTree) -> list[Replayed]:
    """Beam selection of every group, level by level, from one target pass (module docstring).

    rows[g][j]: the row holding group g's running beam j; logits [R, N + 1, V]: row r's target
    logits after its head (0) and after node i (i + 1). A group goes on to the next level while
    it is not done and every beam its level selected is a node; done groups are left alone."""
    out = [Replayed() for _ in groups]
    walks = [[Walk(r) for r in group_rows] for group_rows in rows]
    live = [g for g, group in enumerate(groups) if not group.done]
    seen: list[set[tuple[int, int]]] = [set() for _ in groups]
    while live:
        r = torch.tensor([[w.row for w in walks[g]] for g in live], dtype=torch.int64)  # [G, W]
        n = torch.tensor([[w.node + 1 for w in walks[g]] for g in live], dtype=torch.int64)  # [G, W]
        log_probs = torch.log_softmax(logits[r.to(logits.device), n.to(logits.device)], dim=-1)  # [G, W, V]
        scores = torch.from_numpy(np.stack([groups[g].scores for g in live])).to(logits.device)  # [G, W]
        k = max(groups[g].num_candidates for g in live)
        values, beams, tokens = top_candidates(log_probs, scores, k)
        going = []
        for i, g in enumerate(live):
            group = groups[g]
            c = group.num_candidates
            selected = group.advance(values[i, :c], beams[i, :c], tokens[i, :c])
            before = walks[g]
            walks[g] = [before[j].to(tree.child(before[j].row, before[j].node, t), t) for j, t in selected]
            out[g].levels += 1
            out[g].walks = walks[g]
            seen[g].update((w.row, w.node) for w in walks[g] if w.node is not None)
            if not group.done and all(w.node is not None for w in walks[g]):
                going.append(g)
        live = going
    for g, nodes in enumerate(seen):
        out[g].selected_nodes = len(nodes)
    return out
