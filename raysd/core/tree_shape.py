"""Which draft tree to grow per step: a fixed shape chosen once from the node budget P.

A node is named by the ranks along its path from the root: (0, 0, 1) is the second
child (rank 1) of the first child of the root's first child. A node's rank-0 child is
the draft's sampled token; its rank-r child (r >= 1) is the draft's r-th most likely
other token (raysd.engine.drafters.DraftModelDrafter.propose_tree).

The shape is the P nodes of largest prior value, at most `max_depth` deep, where a
node's value is the product of RANK_PRIOR[r] over the ranks r on its path: the chance
that the whole path is accepted if the r-th child of a node were accepted with
probability RANK_PRIOR[r], independently. This is how Medusa (Cai et al. 2024, section
3.3.1) and EAGLE-1 build their static trees, and Sequoia's tree (Chen et al. 2024,
arXiv 2402.12374, section 3.1) without its dynamic programme: a best-first search
over the positional acceptance rates, here a fixed prior instead of measured ones.
Every node's parent and earlier siblings have at least its value, so the P best
nodes form a tree; the rank-0 chain is always its deepest path.

Nodes are numbered breadth first (by depth, then by their rank paths), so
  * a parent comes before its children and siblings are consecutive in rank order,
    the order raysd.core.tree.tree_rejection_sample tests them in;
  * the nodes at most d deep are a prefix: a row with room for d more tokens drafts
    the first `nodes_within(d)` nodes.
"""

from __future__ import annotations

import bisect
import functools
import heapq
from dataclasses import dataclass
from typing import Sequence

import numpy as np

# Assumed acceptance of a node's r-th child, r = 0 the sampled one. Any decreasing
# sequence in (0, 1] gives a valid tree; this one makes the chain win until the tree is
# a few nodes wide (P = 4, K = 4: a chain of 3 and one alternative at depth 1).
RANK_PRIOR = (0.7, 0.25, 0.12, 0.06)


@dataclass(frozen=True)
class TreeShape:
    parents: tuple[int, ...]  # parent of node i, -1 for the root; parents[i] < i
    ranks: tuple[int, ...]  # node i's rank among its siblings (0: the draft's sampled child)
    depths: tuple[int, ...]  # 1 for the root's children; non-decreasing (breadth first)

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    def nodes_within(self, depth: int) -> int:
        """How many nodes are at most `depth` deep (a prefix of the numbering)."""
        return bisect.bisect_right(self.depths, depth)

    def depth_of(self, n: int) -> int:
        """Depth of the deepest of the first n nodes (0 for none)."""
        return self.depths[n - 1] if n else 0

    def levels(self, n: int) -> list[tuple[int, int]]:
        """[start, end) of each depth 1, 2, ... among the first n nodes."""
        return [(self.nodes_within(d - 1), min(self.nodes_within(d), n)) for d in range(1, self.depth_of(n) + 1)]

    def first_children(self, n: int) -> tuple[int, ...]:
        """[n + 1]: the rank-0 child of the root (entry 0) and of node i (entry i + 1) among
        the first n nodes, -1 where there is none."""
        first = [-1] * (n + 1)
        for i in range(n):
            if self.ranks[i] == 0:
                first[self.parents[i] + 1] = i
        return tuple(first)


@functools.lru_cache(maxsize=256)  # pure, and asked for every step by both sides of an adaptive plan
def tree_shape(budget: int, max_depth: int, prior: tuple[float, ...] = RANK_PRIOR) -> TreeShape:
    """The `budget` nodes of largest prior value at most `max_depth` deep (see the module
    docstring), numbered breadth first. Ties go to the lexicographically smaller rank path."""
    if budget < 1 or max_depth < 1:
        raise ValueError(f"a tree needs budget >= 1 and max_depth >= 1, got {budget}, {max_depth}")
    if not prior or any(not 0 < w <= 1 for w in prior) or list(prior) != sorted(prior, reverse=True):
        raise ValueError(f"prior must be decreasing values in (0, 1], got {prior}")
    heap: list[tuple[float, tuple[int, ...]]] = [(-prior[0], (0,))]  # (minus value, rank path)
    chosen: list[tuple[int, ...]] = []
    while heap and len(chosen) < budget:
        neg, path = heapq.heappop(heap)
        chosen.append(path)
        if len(path) < max_depth:  # its first child
            heapq.heappush(heap, (neg * prior[0], path + (0,)))
        r = path[-1]
        if r + 1 < len(prior):  # its next sibling
            heapq.heappush(heap, (neg / prior[r] * prior[r + 1], path[:-1] + (r + 1,)))
    chosen.sort(key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(chosen)}
    return TreeShape(
        parents=tuple(index[p[:-1]] if len(p) > 1 else -1 for p in chosen),
        ranks=tuple(p[-1] for p in chosen),
        depths=tuple(len(p) for p in chosen),
    )


@functools.lru_cache(maxsize=256)
def _children(shape: TreeShape) -> tuple[tuple[int, ...], ...]:
    """[N + 1]: the children of the root (entry 0) and of node i (entry i + 1), in rank order."""
    kids: list[list[int]] = [[] for _ in range(shape.num_nodes + 1)]
    for i, parent in enumerate(shape.parents):
        kids[parent + 1].append(i)
    return tuple(map(tuple, kids))


def rank_visits(shape: TreeShape, num_nodes: Sequence[int], paths: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Where verification walked, counted by rank: the evidence for the adaptive controller's
    per-rank acceptance (raysd.engine.adaptive.KController.rank_rates).

    Row b verified the first `num_nodes[b]` nodes of `shape` and its walk went through the nodes
    `paths[b]` (root first; RejectionOutput.accepted_nodes). At every node the walk stood on, the root
    included, each child it had among the row's nodes counts once in `offered[rank]`, and the
    child the walk moved to (if any) once in `moved[rank]`. moved[r] / offered[r] estimates the
    chance that the walk moves from a node to its rank-r child, which is a node's value in the
    module docstring's best-first search with the prior replaced by measurements.
    Returns ([R], [R]) int64, R = the shape's largest rank + 1."""
    R = max(shape.ranks, default=0) + 1
    offered, moved = np.zeros(R, dtype=np.int64), np.zeros(R, dtype=np.int64)
    children = _children(shape)
    for n, path in zip(num_nodes, paths):
        for at, node in enumerate((-1, *path)):
            for child in children[node + 1]:
                if child < n:
                    offered[shape.ranks[child]] += 1
            if at < len(path):
                moved[shape.ranks[path[at]]] += 1
    return offered, moved
