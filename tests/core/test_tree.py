"""Tree verification (raysd.core.tree) in three layers: hand-built trees with exact expected
tokens; a chain is `rejection_sample` bit for bit; the emitted law equals the target's, by
exact enumeration of the scheme and by a large seeded sample through the code."""

from __future__ import annotations

import itertools
import math
import zlib

import numpy as np
import pytest
import torch

from raysd.core.rejection import rejection_sample
from raysd.core.tree import tree_attention_mask, tree_depths, tree_rejection_sample
from tests.core.test_distribution import chi_square_pvalue, tv_tolerance

V = 3


def one_hot(t, v=V):
    return torch.nn.functional.one_hot(torch.as_tensor(t), v).float()


def test_greedy_tree_follows_the_target_argmax_path():
    # Root children: 1 (node 0), 2 (node 1); node 1 has children 0 (node 2), 2 (node 3).
    parents = torch.tensor([[-1, -1, 1, 1]])
    tokens = torch.tensor([[1, 2, 0, 2]])
    draft = torch.stack([one_hot(t) for t in tokens[0]])[None]  # deterministic candidates
    # Greedy target: after the context 2, after (2) token 2, after (2, 2) token 0.
    target = torch.stack([one_hot(2), one_hot(0), one_hot(2), one_hot(1), one_hot(0)])[None]
    out = tree_rejection_sample(parents, tokens, torch.tensor([4]), draft, target,
                                torch.full((1, 4), 0.5), torch.tensor([0.5]), max_depth=2)
    assert out.num_accepted.tolist() == [2]
    assert out.output_token_ids.tolist() == [[2, 2, 0]]  # path 2 -> 2, then the bonus 0 at the leaf
    assert out.accepted_nodes.tolist() == [[1, 3]]
    assert out.num_tested.tolist() == [4]  # node 0 rejected, 1 accepted, 2 rejected, 3 accepted


def test_all_children_rejected_draws_from_the_residual():
    parents = torch.tensor([[-1, -1]])
    tokens = torch.tensor([[0, 1]])
    draft = torch.stack([one_hot(0), one_hot(1)])[None]
    target = torch.stack([torch.tensor([0.0, 0.0, 1.0]), one_hot(0), one_hot(0)])[None]
    out = tree_rejection_sample(parents, tokens, torch.tensor([2]), draft, target,
                                torch.full((1, 2), 0.3), torch.tensor([0.9]), max_depth=1)
    assert out.num_accepted.tolist() == [0] and out.output_token_ids.tolist() == [[2, -1]]
    assert out.num_tested.tolist() == [2]


def test_nodes_past_num_nodes_are_ignored():
    parents = torch.tensor([[-1, -1]])
    tokens = torch.tensor([[0, 1]])
    draft = torch.stack([one_hot(0), one_hot(1)])[None]
    target = torch.stack([one_hot(1), one_hot(2), one_hot(2)])[None]
    out = tree_rejection_sample(parents, tokens, torch.tensor([1]), draft, target,
                                torch.full((1, 2), 0.5), torch.tensor([0.5]), max_depth=1)
    assert out.output_token_ids.tolist() == [[1, -1]]  # node 1 (token 1) would have been accepted


def test_a_chain_is_rejection_sample_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    B, K, Vb = 64, 4, 11
    draft = torch.softmax(torch.randn(B, K, Vb, generator=g), -1)
    target = torch.softmax(torch.randn(B, K + 1, Vb, generator=g), -1)
    tokens = torch.multinomial(draft.reshape(-1, Vb), 1, generator=g).reshape(B, K)
    num = torch.randint(0, K + 1, (B,), generator=g)
    u, uf = torch.rand(B, K, generator=g), torch.rand(B, generator=g)
    chain = rejection_sample(tokens, num, draft, target, u, uf)
    parents = torch.arange(-1, K - 1).expand(B, K)
    tree = tree_rejection_sample(parents, tokens, num, draft, target, u, uf, max_depth=K)
    assert torch.equal(tree.output_token_ids, chain.output_token_ids)
    assert torch.equal(tree.num_accepted, chain.num_accepted)
    assert torch.equal(tree.num_tested, chain.num_tested)


def test_depths_and_mask_from_parent_pointers():
    parents = torch.tensor([[-1, -1, 1, 2, 0]])
    assert tree_depths(parents).tolist() == [[1, 1, 2, 3, 2]]
    mask = tree_attention_mask(parents)[0].int().tolist()
    assert mask == [[1, 0, 0, 0, 0], [0, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 1, 1, 1, 0], [1, 0, 0, 0, 1]]


# ---------------------------------------------------------------- the emitted law
#
# A toy language over V = 3 tokens: target and draft distributions are fixed random functions
# of the context. A tree shape is a list of child shapes; "iid" children are drawn i.i.d. from
# the draft after their parent's path, "topk" children are the draft's most likely tokens.


def dist(kind: str, context: tuple, v: int = V) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(repr((kind,) + tuple(int(t) for t in context)).encode()))
    w = rng.dirichlet(np.full(v, 0.7))
    return w / w.sum()


def target(ctx):
    return dist("target", ctx)


def draft(ctx):
    return dist("draft", ctx)


STAR3 = [[], [], []]  # three root children
CHAIN2 = [[[]]]  # root -> node -> node
BINARY2 = [[[], []], [[], []]]  # two children, two grandchildren each
LOPSIDED = [[[[]]], []]  # a depth-3 chain and a sibling leaf
SHAPES = {"star3": STAR3, "chain2": CHAIN2, "binary2": BINARY2, "lopsided": LOPSIDED}


def scheme_law(ctx: tuple, shape: list, mode: str, residual_update: bool = True) -> dict[tuple, float]:
    """Law of the tokens one verification emits from `ctx`, by enumeration: every draw of the
    children (iid) and, in closed form, every acceptance test (accept with min(1, p/q))."""
    law: dict[tuple, float] = {}
    m = len(shape)
    q = draft(ctx)
    if mode == "iid":
        draws = [(xs, math.prod(q[x] for x in xs)) for xs in itertools.product(range(V), repeat=m)]
    else:
        draws = [(tuple(np.argsort(-q, kind="stable")[:m]), 1.0)]
    for xs, pr_draw in draws:
        p, remaining = target(ctx).copy(), 1.0
        for x, child in zip(xs, shape):
            qi = q if mode == "iid" else np.eye(V)[x]
            a = min(1.0, p[x] / qi[x])
            for seq, pr in scheme_law(ctx + (x,), child, mode, residual_update).items():
                law[(x,) + seq] = law.get((x,) + seq, 0.0) + pr_draw * remaining * a * pr
            remaining *= 1 - a
            residual = np.maximum(p - qi, 0.0)
            if residual_update:
                p = residual / residual.sum() if residual.sum() > 0 else p
        for y in range(V):
            law[(y,)] = law.get((y,), 0.0) + pr_draw * remaining * p[y]
    return law


def extended(law: dict[tuple, float], ctx: tuple, length: int) -> dict[tuple, float]:
    """The law of the first `length` tokens when the target continues after the step."""
    out: dict[tuple, float] = {}
    for seq, pr in law.items():
        for tail in itertools.product(range(V), repeat=max(0, length - len(seq))):
            full = (seq + tail)[:length]
            p = pr
            for j, t in enumerate(tail):
                p *= target(ctx + seq + tail[:j])[t]
            out[full] = out.get(full, 0.0) + p
    return out


def target_law(ctx: tuple, length: int) -> dict[tuple, float]:
    out = {}
    for seq in itertools.product(range(V), repeat=length):
        out[seq] = math.prod(target(ctx + seq[:j])[seq[j]] for j in range(length))
    return out


@pytest.mark.parametrize("mode", ["iid", "topk"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_exact_enumeration_of_the_scheme_gives_the_target_law(name, mode):
    ctx = (1,)
    law = scheme_law(ctx, SHAPES[name], mode)
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-12)
    length = 4  # deeper than every shape, so every emitted token is checked
    got, want = extended(law, ctx, length), target_law(ctx, length)
    for seq in want:
        assert got.get(seq, 0.0) == pytest.approx(want[seq], abs=1e-12), seq


@pytest.mark.parametrize("mode", ["iid", "topk"])
def test_the_enumeration_has_power(mode):
    """Testing every sibling against the untouched target (no residual) is biased, and the
    enumeration sees it."""
    law = extended(scheme_law((1,), STAR3, mode, residual_update=False), (1,), 2)
    want = target_law((1,), 2)
    assert max(abs(law.get(k, 0.0) - v) for k, v in want.items()) > 1e-2


def flatten(shape) -> list[int]:
    """Parent index of each node, depth first (a topological order)."""
    parents: list[int] = []

    def walk(children, up):
        for sub in children:
            parents.append(up)
            walk(sub, len(parents) - 1)

    walk(shape, -1)
    return parents


def by_context(paths: torch.Tensor, ctx: tuple, fn) -> torch.Tensor:
    """[B, V] fn(ctx + path) per row, computed once per distinct path ([B, d] tokens)."""
    uniq, inverse = torch.unique(paths, dim=0, return_inverse=True) if paths.shape[1] else (paths[:1], torch.zeros(len(paths), dtype=torch.int64))
    table = torch.tensor(np.stack([fn(ctx + tuple(u.tolist())) for u in uniq]), dtype=torch.float32)
    return table[inverse]


@pytest.mark.parametrize("mode", ["iid", "topk"])
@pytest.mark.parametrize("name", ["star3", "binary2", "lopsided"])
def test_the_code_samples_the_target_law(name, mode):
    """100,000 rows through tree_rejection_sample, children drafted as the scheme says; the
    first two emitted tokens (the second from the target when the step emitted one) against
    the target's joint law: chi-square at 1e-4 and TV within the McDiarmid tolerance at 1e-6."""
    B, ctx = 100_000, (1,)
    g = torch.Generator().manual_seed(7)
    ups = flatten(SHAPES[name])
    N = len(ups)
    parents = torch.tensor(ups).expand(B, N)
    depth = tree_depths(parents[:1])[0].tolist()
    tokens = torch.zeros(B, N, dtype=torch.int64)
    draft_p, target_p = torch.zeros(B, N, V), torch.zeros(B, N + 1, V)
    target_p[:, 0] = torch.tensor(target(ctx), dtype=torch.float32)
    paths: list[torch.Tensor] = []  # [B, depth] token path of each node
    for i, up in enumerate(ups):
        parent_path = paths[up] if up >= 0 else torch.zeros(B, 0, dtype=torch.int64)
        q = by_context(parent_path, ctx, draft)  # [B, V]
        if mode == "iid":
            tokens[:, i] = torch.multinomial(q, 1, generator=g)[:, 0]
            draft_p[:, i] = q
        else:  # the sibling's rank among the draft's most likely tokens
            rank = [j for j, u in enumerate(ups) if u == up].index(i)
            tokens[:, i] = q.argsort(dim=-1, descending=True, stable=True)[:, rank]
            draft_p[:, i] = torch.nn.functional.one_hot(tokens[:, i], V).float()
        paths.append(torch.cat([parent_path, tokens[:, i : i + 1]], dim=1))
        target_p[:, i + 1] = by_context(paths[i], ctx, target)
    out = tree_rejection_sample(parents, tokens, torch.full((B,), N), draft_p, target_p,
                                torch.rand(B, N, generator=g), torch.rand(B, generator=g), max_depth=max(depth))
    first = out.output_token_ids[:, 0]
    second = out.output_token_ids[:, 1].clone()
    one = out.num_accepted == 0  # emitted one token: the target continues
    if one.any():
        cont = torch.tensor(np.stack([target(ctx + (t,)) for t in range(V)]), dtype=torch.float32)[first[one]]
        second[one] = torch.multinomial(cont, 1, generator=g)[:, 0]
    counts = np.zeros(V * V)
    np.add.at(counts, (first * V + second).numpy(), 1)
    want = np.array([target_law(ctx, 2)[(a, b)] for a in range(V) for b in range(V)])
    assert chi_square_pvalue(counts, want) > 1e-4
    tv = 0.5 * np.abs(counts / B - want).sum()
    assert tv <= tv_tolerance(V * V, B), tv
    assert (out.num_accepted > 0).float().mean() > 0.2  # the tree was really used
