"""What drafts the trees of speculative beam search (raysd.core.beam): one tree per row, each
row a running beam of the target's, rooted at the beam's last token.

A beam drafter mirrors the target's rows: `add_rows` when a prompt's W beams are admitted,
`reorder` after every pass (row i becomes a copy of row order[i] grown by new_tokens[i]; the
paths name the tree nodes those tokens were, in the tree's own numbering), which also drops the
rows of finished prompts. Drafts need no probabilities: the replay is exact whatever the tree.

  * `DraftBeamSearch`: a draft model's own beam search, W' >= W wide, K levels deep, from the
    target's running beams and scores; a row's tree holds the draft beams that descend from it.
    A draft that agrees with the target selects the target's beams: K + 1 levels per pass.
  * `LookupBeams`: a model-free drafter's trees (n-gram prompt lookup, suffix decoding) on a fixed
    shape (raysd.core.tree_shape), each row's from its own tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Sequence

import torch

from raysd.core.beam import BeamGroup, BeamTree
from raysd.core.sampling import SamplingParams, SamplingTensors
from raysd.core.tree_shape import tree_shape
from raysd.engine.cache_rows import CacheRows
from raysd.engine.drafters import Drafter, _widen
from raysd.models.loading import max_model_len, output_vocab_size
from raysd.models.static_runner import StaticRunner

if TYPE_CHECKING:  # annotations only: a process that only coordinates never imports the modeling stack
    from transformers import PreTrainedModel


class BeamDrafter(ABC):
    name: str
    max_model_len: int | None = None  # a draft model's context limit; None for a model-free drafter

    @abstractmethod
    def add_rows(self, prompts: Sequence[Sequence[int]]) -> None: ...

    @abstractmethod
    def propose(self, groups: Sequence[BeamGroup], rows: Sequence[Sequence[int]], depths: Sequence[int]) -> BeamTree:
        """A tree per row, at most depths[g] deep for group g (whose beam j is row rows[g][j])."""

    @abstractmethod
    def reorder(self, order: Sequence[int], new_tokens: Sequence[Sequence[int]], paths: Sequence[Sequence[int]]) -> None:
        """Row i becomes row order[i] followed by new_tokens[i], whose first len(paths[i]) tokens
        were the nodes paths[i] of that row's last tree."""


class NoBeamDrafter(BeamDrafter):
    """Beam search without speculation: one level per target pass (the baseline)."""

    name = "none"

    def add_rows(self, prompts):
        pass

    def propose(self, groups, rows, depths):
        return BeamTree.empty(sum(map(len, rows)))

    def reorder(self, order, new_tokens, paths):
        pass


class DraftBeamSearch(BeamDrafter):
    """A draft model's own beam search over the target's running beams (the draft's rows mirror
    the target's, on the static runner).

    Level 1 extends every running beam by the draft's log-probabilities (the beams' target scores
    plus the draft's log-probabilities; EOS tokens excluded, as they would finish rather than run
    on), keeping the `width` best; each further level extends those. The kept candidates of level
    d are tree nodes of depth d, in the row their beam descends from; a level's nodes are fed in
    one forward (StaticRunner.forward_tree) to score the next, the deepest never. The draft's tree
    numbering keeps one block of columns per level, as wide as the widest row's level (holes in the
    others); the target gets each row's nodes compacted (`_index` maps them back)."""

    def __init__(self, model: PreTrainedModel, target_vocab_size: int, width: int | None = None,
                 eos_token_ids: Sequence[int] = (), name: str = "draft-model", linear_kernels: str = "auto"):
        """`width`: W' draft beams per level (None: the target's W)."""
        vocab = min(output_vocab_size(model), target_vocab_size)
        self.rows = CacheRows(StaticRunner(model, vocab_size=vocab, linear_kernels=linear_kernels))
        self.name, self.vocab_size, self.width = name, target_vocab_size, width
        self.eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.int64)
        self.max_model_len = max_model_len(model)
        self._fed_depth = 0
        self._index: list[list[int]] = []  # per row: the draft's number of each target tree node

    def add_rows(self, prompts):
        self.rows.add_rows(prompts)

    def propose(self, groups, rows, depths):
        R, device = self.rows.runner.num_rows, self.rows.device
        D = max(depths, default=0)
        self._fed_depth, self._index = 0, [[] for _ in range(R)]
        if D == 0:
            return BeamTree.empty(R)
        zeros = torch.zeros(R, dtype=torch.int64, device=device)
        logits = self.rows.feed(torch.zeros(R, 0, dtype=torch.int64, device=device), zeros, zeros + 1, 1)  # [R, 1, V']
        tree = BeamTree.empty(R)  # the draft's numbering: one block per level, holes (token -1) included
        # Each group's draft beams: (row, node) (-1: the row's head) and their scores.
        beams = {g: ([(r, -1) for r in rows[g]], torch.from_numpy(groups[g].scores).to(device))
                 for g, d in enumerate(depths) if d > 0}
        start = 0  # the first node of the level whose logits `logits` holds (the heads: 0)
        for d in range(1, D + 1):
            live = [g for g in beams if depths[g] >= d]
            base = len(tree.tokens[0])
            level: list[list[tuple[int, int]]] = [[] for _ in range(R)]  # per row: the level's (parent, token)
            for g in live:
                nodes, scores = beams[g]
                picked, values = self._extend(nodes, scores, logits, start, len(rows[g]))
                moved = []
                for (r, parent), t in picked:
                    level[r].append((parent, t))
                    moved.append((r, base + len(level[r]) - 1))
                beams[g] = (moved, values)
            width = max(map(len, level))
            for r, new in enumerate(level):  # each row's nodes first, then holes
                new = new + [(-1, -1)] * (width - len(new))
                tree.parents[r] += [p for p, _ in new]
                tree.tokens[r] += [t for _, t in new]
            if d < max(depths[g] for g in live):  # the deepest level is never fed
                ids = torch.tensor([row[base:] for row in tree.tokens], dtype=torch.int64, device=device).clamp(min=0)
                up = torch.tensor(tree.parents, dtype=torch.int64, device=device)  # [R, base + width]
                num = torch.tensor([len(x) for x in level], dtype=torch.int64, device=device)  # [R] a prefix of the block
                logits = self.rows.feed_tree(ids, up, num, start=base)  # [R, width, V']
                self._fed_depth, start = d, base
        return self._compact(tree)

    def _extend(self, nodes: list[tuple[int, int]], scores: torch.Tensor, logits: torch.Tensor, start: int,
                num_beams: int) -> tuple[list[tuple[tuple[int, int], int]], torch.Tensor]:
        """One group's draft beams one level on: the `width` best (beam, token) that do not end,
        by score. `logits` [R, n, V'] holds the draft's logits after nodes start .. start + n - 1
        (after the heads when the beams stand there)."""
        r = torch.tensor([row for row, _ in nodes], dtype=torch.int64)
        c = torch.tensor([max(node - start, 0) for _, node in nodes], dtype=torch.int64)
        log_probs = torch.log_softmax(_widen(logits[r, c], self.vocab_size), dim=-1)  # [F, V]
        if len(self.eos):
            log_probs[:, self.eos] = float("-inf")
        V = log_probs.shape[-1]
        values, index = torch.topk((log_probs + scores[:, None]).flatten(), k=self.width or num_beams)
        return [(nodes[i // V], i % V) for i in index.tolist()], values

    def _compact(self, tree: BeamTree) -> BeamTree:
        """The target's tree: each row's real nodes in the draft's order (a parent still first)."""
        out = BeamTree.empty(len(tree.tokens))
        for r, (tokens, parents) in enumerate(zip(tree.tokens, tree.parents)):
            where: dict[int, int] = {}
            for i, (t, p) in enumerate(zip(tokens, parents)):
                if t >= 0:
                    where[i] = len(self._index[r])
                    self._index[r].append(i)
                    out.tokens[r].append(t)
                    out.parents[r].append(where[p] if p >= 0 else -1)
        return out

    def reorder(self, order, new_tokens, paths):
        self.rows.gather(order)
        draft_paths = [[self._index[src][n] for n in path] for src, path in zip(order, paths)]
        self.rows.commit_path(new_tokens, draft_paths, self._fed_depth)


class LookupBeams(BeamDrafter):
    """A model-free drafter's trees (NgramDrafter, SuffixDrafter: `propose_tree`) on the shape of
    `budget` nodes at most K deep (raysd.core.tree_shape), one per row from that row's tokens."""

    def __init__(self, drafter: Drafter, budget: int, depth: int):
        assert drafter.max_model_len is None, "LookupBeams takes a model-free drafter"
        self.drafter, self.name = drafter, drafter.name
        self.shape = tree_shape(budget, depth)

    def add_rows(self, prompts):
        self.drafter.add_rows(prompts)

    def propose(self, groups, rows, depths):
        depth_of = [0] * sum(map(len, rows))
        for g, group_rows in enumerate(rows):
            for r in group_rows:
                depth_of[r] = depths[g]
        greedy = SamplingTensors.from_params([SamplingParams()] * len(depth_of))
        proposal = self.drafter.propose_tree(self.shape, depth_of, greedy, torch.zeros(len(depth_of), self.shape.num_nodes))
        ids, counts = proposal.draft_token_ids.tolist(), proposal.num_draft_host or proposal.num_draft_tokens.tolist()
        return BeamTree([row[:n] for row, n in zip(ids, counts)], [list(self.shape.parents[:n]) for n in counts])

    def reorder(self, order, new_tokens, paths):
        self.drafter.gather(order)
        self.drafter.commit(new_tokens)
