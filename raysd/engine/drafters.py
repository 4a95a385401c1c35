"""Drafters: whatever proposes tokens for the target to verify, behind one small interface.

A drafter keeps its own per-row state (a KV cache, or the token history) and is
told what happened through `commit`. Whatever it proposes, it also says from
which distribution it drew each draft (`draft_probs`), and the rejection test
makes the output exact for any drafter.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import torch

from raysd.core.device import host_to_device
from raysd.core.sampling import SamplingTensors, logits_to_probs, sample_from_probs
from raysd.core.tree_shape import TreeShape
from raysd.engine.cache_rows import CacheRows, right_align
from raysd.models.cuda_graphs import GraphCounts
from raysd.models.eagle_draft import EagleDraft
from raysd.models.features import EagleCausalLM
from raysd.models.loading import max_model_len, output_vocab_size
from raysd.models.runner import make_runner
from raysd.models.static_runner import StaticRunner, prefill_groups

if TYPE_CHECKING:  # annotations only: a process that only coordinates never imports the modeling stack
    from transformers import PreTrainedModel

PENDING = 2  # a draft program's pending tokens per row: one, or two after a step that accepted every draft


@dataclass(frozen=True)
class Proposal:
    draft_token_ids: torch.Tensor  # [B, K] int64; entries past num_draft_tokens are ignored
    num_draft_tokens: torch.Tensor  # [B] int64
    draft_probs: torch.Tensor  # [B, K, V] the distribution each draft was drawn from
    num_draft_host: tuple[int, ...] | None = None  # num_draft_tokens on the host, when the drafter knows it
    # Every drafted position's draft_probs is one-hot at its draft token (greedy rows only, or a
    # deterministic drafter): what crosses to a target actor is then the tokens alone, without
    # reading the [B, K, V] tensor (raysd.actors.proposals.encode_proposal).
    one_hot: bool = False

    @staticmethod
    def empty(batch_size: int, vocab_size: int, device) -> "Proposal":
        return Proposal(
            torch.zeros(batch_size, 0, dtype=torch.int64, device=device),
            torch.zeros(batch_size, dtype=torch.int64, device=device),
            torch.zeros(batch_size, 0, vocab_size, device=device),
            (0,) * batch_size,
        )

    @staticmethod
    def of_tokens(ids: torch.Tensor, num: torch.Tensor, counts: Sequence[int], vocab_size: int) -> "Proposal":
        """Deterministic drafts `ids` [B, K] (row b's first counts[b]; `num` the same on ids' device):
        their draft_probs one-hot at each token, marked so (`one_hot`)."""
        probs = torch.zeros(*ids.shape, vocab_size, device=ids.device).scatter_(-1, ids[..., None], 1.0)  # [B, K, V]
        return Proposal(ids, num, probs, tuple(counts), one_hot=True)

    @staticmethod
    def of_drafts(drafts: Sequence[Sequence[int]], vocab_size: int, device) -> "Proposal":
        """Deterministic drafts, a list per row, as a one-hot Proposal as wide as the longest (`of_tokens`;
        no row drafting: an empty one)."""
        B, K = len(drafts), max((len(d) for d in drafts), default=0)
        if K == 0:
            return Proposal.empty(B, vocab_size, device)
        ids = torch.zeros(B, K, dtype=torch.int64)  # [B, K]
        for b, d in enumerate(drafts):
            ids[b, : len(d)] = torch.tensor(d, dtype=torch.int64)
        counts = [len(d) for d in drafts]
        ids, num = host_to_device(ids, torch.int64, device), host_to_device(counts, torch.int64, device)  # [B, K], [B]
        return Proposal.of_tokens(ids, num, counts, vocab_size)


class Drafter(ABC):
    name: str
    vocab_size: int  # the width of draft_probs: the target's vocabulary
    needs_features = False  # True: `commit` also takes the target's features (FeatureDrafter)
    # True: `propose_tree` drafts trees (and `commit_path` keeps the accepted branch, for a drafter
    # whose cache keeps drafted positions): a draft model or a feature draft on a static runner, n-gram
    supports_trees = False
    # The drafter's own context limit (a draft model's), or None for a model-free drafter.
    max_model_len: int | None = None

    @abstractmethod
    def add_rows(self, prompts: Sequence[Sequence[int]]) -> None: ...

    @abstractmethod
    def select(self, rows: Sequence[int]) -> None: ...

    @abstractmethod
    def propose(self, max_drafts: Sequence[int], sampling: SamplingTensors, uniforms: torch.Tensor) -> Proposal:
        """Propose up to max_drafts[b] tokens for each row; `uniforms` is [B, K] with K >= max(max_drafts)."""

    @abstractmethod
    def commit(self, new_tokens: Sequence[Sequence[int]], num_accepted: Sequence[int] | None = None) -> None:
        """The tokens each row emitted this step (and, if known, how many drafts it accepted)."""

    def confidence(self, max_drafts: Sequence[int]) -> np.ndarray | None:
        """[B, K] the drafter's own estimate, before proposing, that row b's drafts up to position i
        would all be accepted, for up to max_drafts[b] drafts (0 past them); None for a drafter
        with no such estimate. A drafter that has one proposes, in the same step, the drafts it
        estimated (raysd.engine.suffix)."""
        return None


class NoDrafter(Drafter):
    """Plain autoregressive decoding through the same engine: the fair baseline."""

    name = "none"

    def __init__(self, vocab_size: int, device="cpu"):
        self.vocab_size, self.device, self.num_rows = vocab_size, device, 0

    def add_rows(self, prompts):
        self.num_rows += len(prompts)

    def select(self, rows):
        self.num_rows = len(rows)

    def propose(self, max_drafts, sampling, uniforms):
        return Proposal.empty(len(max_drafts), self.vocab_size, self.device)

    def commit(self, new_tokens, num_accepted=None):
        pass


class DraftModelDrafter(Drafter):
    """A smaller (or cheaper) causal LM sampled autoregressively with the rows' own parameters.

    `draft_top_m` > 0 makes the draft sample from its m largest logits only (the rest
    at -inf before temperature, top-k and top-p). Still exact: the rejection test gets
    the distribution the draft was really drawn from, which then has at most m
    nonzeros and crosses between actors sparse. Greedy drafts are unchanged.
    """

    def __init__(self, model: PreTrainedModel, target_vocab_size: int, name: str = "draft-model", draft_top_m: int = 0,
                 runner: str = "auto", cuda_graphs: bool | None = None, compile: bool | None = None):
        if draft_top_m < 0:
            raise ValueError(f"draft_top_m must be >= 0 (0 disables), got {draft_top_m}")
        self.name = name
        self.draft_top_m = draft_top_m
        self.target_vocab_size = self.vocab_size = target_vocab_size
        own_vocab = output_vocab_size(model)
        # Drafts outside the target's vocabulary could never be accepted; a narrower
        # draft vocabulary gets zero probability on the target's extra tokens.
        # cuda_graphs: the draft's K steps replayed as one CUDA graph (raysd.models.cuda_graphs); compile: its
        # forwards through torch.compile (StaticRunner), the graphs then capturing the compiled kernels. None
        # (the default): both on for the static runner on a CUDA device (raysd.models.runner.make_runner).
        self.rows = CacheRows(make_runner(model, runner, vocab_size=min(own_vocab, target_vocab_size), cuda_graphs=cuda_graphs,
                                          compile=compile))
        self.supports_trees = isinstance(self.rows.runner, StaticRunner)
        self.max_model_len = max_model_len(model)
        self._fed_depth = 0  # levels of the last proposed tree that the draft fed (its cache holds them)
        # On the static runner: the K a step drafts is rounded up to one of these (the K whose programs
        # were captured: `raysd.engine.graphs`); drafts past a row's max_drafts are never verified.
        self.draft_widths: tuple[int, ...] = ()
        self._probs: torch.Tensor | None = None  # [slots, K, V] where the draft program writes draft_probs

    def add_rows(self, prompts):
        self.rows.add_rows(prompts)

    def select(self, rows):
        self.rows.select(rows)

    def commit(self, new_tokens, num_accepted=None):
        self.rows.commit(new_tokens, num_accepted)

    def propose(self, max_drafts, sampling, uniforms):
        B, device = len(max_drafts), self.rows.device
        K = max(max_drafts, default=0)
        if K == 0:
            return Proposal.empty(B, self.target_vocab_size, device)
        if isinstance(self.rows.runner, StaticRunner):
            return self._propose_program(max_drafts, sampling, uniforms)
        ones = torch.ones(B, dtype=torch.int64, device=device)
        host_ones = (1,) * B
        logits = self.rows.feed(torch.zeros(B, 0, dtype=torch.int64, device=device), ones * 0, ones, 1)[:, 0]  # [B, V']
        tokens, probs = [], []
        for i in range(K):
            step_probs = logits_to_probs(self._draft_logits(logits), sampling)  # [B, V]
            t = sample_from_probs(step_probs, uniforms[:, i], one_hot=sampling.all_greedy)  # [B]
            tokens.append(t)
            probs.append(step_probs)
            if i + 1 < K:  # the last draft is fed at the next step, with the verified tokens
                logits = self.rows.feed(t[:, None], ones, ones, 1, host_ones)[:, 0]
        num = host_to_device(list(max_drafts), torch.int64, device)
        return Proposal(torch.stack(tokens, dim=1), num, torch.stack(probs, dim=1), tuple(int(k) for k in max_drafts),
                        one_hot=sampling.all_greedy)

    def _propose_program(self, max_drafts: Sequence[int], sampling: SamplingTensors, uniforms: torch.Tensor) -> Proposal:
        """`propose` on the static runner: the K draft forwards and their sampling as one program
        (`draft_program`), replayed from one CUDA graph when the runner has graphs, with no host
        read between the drafts. K is the largest max_drafts rounded up to a captured width
        (`draft_widths`). A row's pending tokens but its last two (plain steps leave more) are fed
        first (CacheRows.catch_up), so the program always starts from a chunk of two."""
        B, device = len(max_drafts), self.rows.device
        k = self.width(max(max_drafts))
        self.rows.catch_up(keep=PENDING)
        inputs = self.draft_inputs(k, sampling, uniforms)
        tokens, probs = self.rows.runner.run(*self.program(k, sampling), inputs, PENDING + k - 1, forwards=k)
        host = (k - 1,) * B
        self.rows.mark_fed(tokens[:, : k - 1], host_to_device(host, torch.int64, device), host)
        num = host_to_device(list(max_drafts), torch.int64, device)
        return Proposal(tokens, num, probs, tuple(int(n) for n in max_drafts), one_hot=sampling.all_greedy)

    def width(self, k: int) -> int:
        """The drafts a step of at most `k` per row makes: `k` rounded up to a captured width."""
        return min((w for w in self.draft_widths if w >= k), default=k)

    def program(self, k: int, sampling: SamplingTensors) -> tuple[tuple, Callable]:
        """The key and function (`draft_program`) of the program that drafts k per row with these rows'
        sampling flags (StaticRunner.run)."""
        flags = flags_of(sampling)
        return ("draft", k, *flags, self.draft_top_m), functools.partial(self.draft_program, k, flags)

    def draft_inputs(self, k: int, sampling: SamplingTensors, uniforms: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The draft program's inputs for the rows' pending tokens (at most PENDING each): pending
        tokens [B, PENDING] and their count [B], draws [B, K], the rows' temperature, top-k, top-p."""
        pending, count = self.rows.pending_inputs(PENDING)
        self.reserve_probs(max(pending.shape[0], self.rows.runner.cache.capacity[0]), k)
        return pending, count, uniforms[:, :k].double(), sampling.temperature, sampling.top_k, sampling.top_p

    def reserve_probs(self, slots: int, k: int) -> None:
        """Room in the buffer the draft program writes draft_probs into for `slots` rows of k drafts.
        Growing it (rare: the first time, or more slots) drops the runner's captured graphs, which
        write into the old one."""
        if self._probs is not None and self._probs.shape[0] >= slots and self._probs.shape[1] >= k:
            return
        k = max(k, 0 if self._probs is None else self._probs.shape[1])
        self._probs = torch.zeros(slots, k, self.target_vocab_size, dtype=torch.float32, device=self.rows.device)
        graphs = getattr(self.rows.runner, "graphs", None)
        if graphs is not None:
            graphs.graphs.clear()

    def draft_program(self, k: int, flags: tuple[bool, ...], attend: int, pending, count, uniforms, temperature, top_k,
                      top_p) -> tuple[torch.Tensor, torch.Tensor]:
        """The k drafts of every slot 0 .. R - 1 (a program: raysd.models.cuda_graphs), device tensors only:
        one forward over each row's pending tokens, then k times: the draft's distribution (the rows'
        temperature, top-k, top-p: `flags` says which apply), a draw from it, and (but after the
        last) a forward over the draw. A padding row (count 0) feeds nothing. Returns [R, K] drafts and
        [R, K, V] draft_probs (a view of `_probs`, overwritten by the next program)."""
        runner, R = self.rows.runner, pending.shape[0]
        sampling = SamplingTensors(temperature, top_k, top_p, *flags)
        chunk, valid = right_align(pending, count, pending[:, :0], count * 0)  # [R, PENDING]
        live = valid[:, -1:]  # [R, 1] a real row's last pending token
        ones = torch.ones(R, dtype=torch.int64, device=pending.device)
        logits = runner.step_slots(attend, chunk, valid, ones, 1, keep=1)[0][:, 0]  # [R, V']
        tokens = []
        probs = self._probs[:R, :k]  # [R, K, V]
        for i in range(k):
            step_probs = logits_to_probs(self._draft_logits(logits), sampling)  # [R, V]
            t = sample_from_probs(step_probs, uniforms[:, i], one_hot=sampling.all_greedy)  # [R]
            probs[:, i] = step_probs
            tokens.append(t)
            if i + 1 < k:  # the last draft is fed at the next step, with the verified tokens
                logits = runner.step_slots(attend, t[:, None], live, ones, 1)[0][:, 0]
        return torch.stack(tokens, dim=1), probs

    def commit_path(self, new_tokens: Sequence[Sequence[int]], path: Sequence[Sequence[int]]) -> None:
        """After a tree: the tokens each row emitted and the tree nodes its accepted path went through."""
        self.rows.commit_path(new_tokens, path, self._fed_depth)

    def propose_tree(self, shape: TreeShape, max_depths: Sequence[int], sampling: SamplingTensors,
                     uniforms: torch.Tensor) -> Proposal:
        """A tree of drafts per row: the first `shape.nodes_within(max_depths[b])` nodes of `shape`
        (breadth first), drafted level by level, one draft forward per level but the deepest
        (StaticRunner.forward_tree over the level's nodes, after the row's cache and the
        levels above). `uniforms` is [B, >= shape.num_nodes]: node i's draw is uniforms[:, i].

        A node's rank-0 child is drawn from the draft's distribution after the node's path
        (the row's temperature, top-k, top-p), with draft_probs that distribution, as a chain's
        draft; its rank-r child (r >= 1) is the draft's r-th most likely token other than that
        draw, with a one-hot draft_probs. Each child is a draw from its draft_probs or a function
        of its earlier siblings, never of the verifier's draws, so multi-draft speculative sampling
        (raysd.core.tree.tree_rejection_sample) stays exact (docs/trees.md). At temperature 0
        the tree is EAGLE-2's top-k tree (Li et al. 2024, arXiv 2406.16858).

        Returns a Proposal of [B, N] nodes, N the batch's largest tree; num_draft_tokens counts
        each row's nodes.
        """
        B, device = len(max_depths), self.rows.device
        counts = [shape.nodes_within(int(d)) for d in max_depths]
        N = max(counts, default=0)
        self._fed_depth = 0
        if N == 0:
            return Proposal.empty(B, self.target_vocab_size, device)
        zeros = torch.zeros(B, dtype=torch.int64, device=device)
        logits = self.rows.feed(torch.zeros(B, 0, dtype=torch.int64, device=device), zeros, zeros + 1, 1)  # [B, 1, V']
        parents = torch.tensor(shape.parents[:N], dtype=torch.int64, device=device).expand(B, N)  # [B, N]
        num = torch.tensor(counts, dtype=torch.int64).to(device)  # [B]
        levels = shape.levels(N)
        tokens, probs = [], []
        above = -1  # the first node of the level above (-1: the root)
        for d, (s, e) in enumerate(levels):
            wide = self._draft_logits(logits.flatten(0, 1)).view(*logits.shape[:2], -1)  # [B, n, V]
            t, level_probs = draft_tree_level(shape, s, e, above, wide, sampling, uniforms)  # [B, e - s], [B, e - s, V]
            tokens.append(t)
            probs.append(level_probs)
            if d + 1 < len(levels):  # the deepest level is verified, never fed
                logits = self.rows.feed_tree(t, parents[:, :e], (num - s).clamp(0, e - s), start=s)  # [B, e - s, V']
                self._fed_depth = d + 1
            above = s
        return Proposal(torch.cat(tokens, dim=1), num, torch.cat(probs, dim=1), tuple(counts))

    def _draft_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, V'] draft logits -> [B, V] over the target's vocabulary, top-m applied."""
        logits = _widen(logits, self.target_vocab_size)
        if 0 < self.draft_top_m < logits.shape[-1]:
            index = logits.topk(self.draft_top_m, dim=-1).indices  # [B, m]
            logits = torch.full_like(logits, float("-inf")).scatter_(-1, index, logits.gather(-1, index))
        return logits


def draft_tree_level(shape: TreeShape, start: int, end: int, above: int, wide: torch.Tensor,
                     sampling: SamplingTensors, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft nodes start .. end - 1 (one level of `shape`) from the draft's logits [B, n, V] (over
    the target's vocabulary) at the level above, whose first node is `above` (-1: the root, n = 1).

    Each parent's rank-0 child is drawn from the draft's distribution (the rows' sampling
    parameters, node i's draw uniforms[:, i]) with draft_probs that distribution; its rank-r
    child is the r-th most likely other token, with a one-hot draft_probs. Returns [B, m] tokens and [B, m, V]
    draft_probs for the level's m nodes."""
    B, n = wide.shape[:2]
    level = range(start, end)
    up = [shape.parents[i] - above for i in level]  # each node's parent, as an index into `wide`
    rank = [shape.ranks[i] for i in level]
    first = [0] * n  # the node whose draw is each parent's sample (its rank-0 child)
    for i, u, r in zip(level, up, rank):
        if r == 0:
            first[u] = i
    parent_probs = logits_to_probs(wide, sampling)  # [B, n, V] the draft's distribution after each parent
    sampled = sample_from_probs(parent_probs.flatten(0, 1), uniforms[:, first].flatten(), one_hot=sampling.all_greedy).view(B, n)  # [B, n]
    candidates = sampled[..., None]  # [B, n, R]: the sample, then the best other tokens
    R = max(rank) + 1
    if R > 1:
        others = wide.scatter(-1, sampled[..., None], float("-inf")).topk(R - 1, dim=-1).indices  # [B, n, R - 1]
        candidates = torch.cat([candidates, others], dim=-1)
    up_t = torch.tensor(up, dtype=torch.int64, device=wide.device)  # [m]
    rank_t = torch.tensor(rank, dtype=torch.int64, device=wide.device)  # [m]
    tokens = candidates[:, up_t, rank_t]  # [B, m]
    one_hot = torch.zeros(B, len(up), wide.shape[-1], device=wide.device).scatter_(-1, tokens[..., None], 1.0)
    return tokens, torch.where((rank_t == 0)[None, :, None], parent_probs[:, up_t], one_hot)  # [B, m], [B, m, V]


MAX_NGRAM_BRANCHES = 8  # earlier occurrences whose continuations a tree may hold


class NgramDrafter(Drafter):
    """Prompt lookup: copy the tokens that followed the most recent earlier occurrence
    of the row's last n tokens (n from max_ngram down to min_ngram), in prompt and output.
    Drafts are deterministic, so draft_probs is one-hot. With a tree, the continuations of
    several earlier occurrences are its branches (`propose_tree`)."""

    name = "ngram"
    supports_trees = True

    def __init__(self, vocab_size: int, device="cpu", min_ngram: int = 1, max_ngram: int = 3):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.vocab_size, self.device = vocab_size, device
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.history: list[list[int]] = []

    def add_rows(self, prompts):
        self.history.extend(list(p) for p in prompts)

    def select(self, rows):
        self.history = [self.history[i] for i in rows]

    def gather(self, rows: Sequence[int]) -> None:
        """Row i becomes a copy of row rows[i], repeats allowed (beam search's reordering)."""
        self.history = [list(self.history[i]) for i in rows]

    def commit(self, new_tokens, num_accepted=None):
        for row, new in zip(self.history, new_tokens):
            row.extend(new)

    def propose(self, max_drafts, sampling, uniforms):
        B, K = len(max_drafts), max(max_drafts, default=0)
        if K == 0:
            return Proposal.empty(B, self.vocab_size, self.device)
        ids = torch.zeros(B, K, dtype=torch.int64)
        counts = []
        for b, (row, k) in enumerate(zip(self.history, max_drafts)):
            draft = self.lookup(row, k)
            ids[b, : len(draft)] = torch.tensor(draft, dtype=torch.int64)
            counts.append(len(draft))
        # As wide as the longest lookup found, not K: the verifier feeds max(counts) + 1 tokens
        # anyway, and the one-hot draft_probs ([B, K, V], 25 MB at B = 32) need not be built
        # for positions no row drafted. No match in any row: plain decoding's step.
        K = max(counts)
        if K == 0:
            return Proposal.empty(B, self.vocab_size, self.device)
        ids, num = host_to_device(ids[:, :K], torch.int64, self.device), host_to_device(counts, torch.int64, self.device)  # [B, K], [B]
        return Proposal.of_tokens(ids, num, counts, self.vocab_size)

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        continuations = self.continuations(tokens, k, 1)
        return continuations[0] if continuations else []

    def continuations(self, tokens: Sequence[int], k: int, limit: int) -> list[list[int]]:
        """Up to k tokens after each of the `limit` most recent earlier occurrences of the row's
        longest matching suffix (n from max_ngram down to min_ngram), most recent first."""
        if k <= 0 or len(tokens) < 2:
            return []
        seq = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)  # earlier n-grams
            hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
            if hits.size:
                return [seq[h + n : h + n + k].tolist() for h in hits[::-1][:limit]]
        return []

    def commit_path(self, new_tokens: Sequence[Sequence[int]], path: Sequence[Sequence[int]]) -> None:
        self.commit(new_tokens)

    def propose_tree(self, shape: TreeShape, max_depths: Sequence[int], sampling: SamplingTensors,
                     uniforms: torch.Tensor) -> Proposal:
        """Several matched continuations as branches: each row's tree holds the continuations
        of the most recent earlier occurrences of its suffix (`tree_tokens`), on `shape`'s nodes
        at most max_depths[b] deep, cut at the depth they reach. Deterministic candidates with
        one-hot draft_probs: EAGLE-2's rule verifies them exactly, whatever they are."""
        trees = [self.tree_tokens(row, shape, int(d)) for row, d in zip(self.history, max_depths)]
        return Proposal.of_drafts(trees, self.vocab_size, self.device)

    def tree_tokens(self, tokens: Sequence[int], shape: TreeShape, depth: int) -> list[int]:
        """Tokens of `shape`'s first nodes: node (r_1, .., r_d) holds the r_d-th distinct next token,
        most recent first, of the continuations that agree with its parent's path, so the rank-0
        chain is the chain's draft (`lookup`). A node with no such token repeats its previous
        sibling (a repeat of a rejected one-hot candidate is rejected for sure) or, for a rank-0
        node, its parent's token. Cut after the deepest level a continuation reaches."""
        pools = {-1: self.continuations(tokens, depth, MAX_NGRAM_BRANCHES)}  # node -> agreeing continuations
        out: list[int] = []
        reach = 0
        for i in range(shape.nodes_within(depth)):
            up, rank, d = shape.parents[i], shape.ranks[i], shape.depths[i]
            pool = [c for c in pools[up] if len(c) >= d]
            nexts = list(dict.fromkeys(c[d - 1] for c in pool))  # distinct, most recent first
            if rank < len(nexts):
                out.append(nexts[rank])
                reach = d
            else:
                out.append(out[i - 1] if rank else (out[up] if up >= 0 else int(tokens[-1])))
            pools[i] = [c for c in pool if rank < len(nexts) and c[d - 1] == out[i]]
        return out[: shape.nodes_within(reach)]


class FeatureDrafter(Drafter):
    """EAGLE (Li et al. 2024): a one-layer draft that reads the target's own features
    (raysd.models.eagle_draft), run by the same runners as any model.

    The draft's position t reads (feature f_t, token x_{t+1}) and predicts x_{t+2}. After each
    step the target hands over its features of the positions it cached for good; they are this
    drafter's pending inputs, paired with the tokens that follow them. `propose` feeds them,
    then drafts K tokens, feeding back its own hidden state as the next feature (EAGLE's
    autoregression at the feature level), and rolls its cache back to the target's features:
    a drafted position is never kept, since its input was the draft's own feature.
    Exact whatever the draft: `draft_probs` is the distribution each draft was drawn from.
    """

    name = "eagle"
    needs_features = True

    def __init__(self, draft: EagleDraft, target_vocab_size: int, runner: str = "auto"):
        self.model = EagleCausalLM(draft)
        self.vocab_size = target_vocab_size
        self.runner = make_runner(self.model, runner, vocab_size=min(output_vocab_size(self.model), target_vocab_size))
        self.max_model_len = draft.config.max_position_embeddings
        self.hidden_size = draft.config.hidden_size
        self.supports_trees = isinstance(self.runner, StaticRunner)
        self.tokens: list[list[int]] = []  # every row's committed tokens
        self.cached: list[int] = []  # positions in the draft's cache (all read the target's features)
        self.pending: list[torch.Tensor] = []  # [n, H] target features of positions cached[b].. not yet fed

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def add_rows(self, prompts):
        self.runner.add_rows(len(prompts))
        self.tokens += [list(p) for p in prompts]
        self.cached += [0] * len(prompts)
        self.pending += [torch.zeros(0, self.hidden_size, device=self.device) for _ in prompts]

    def select(self, rows):
        self.runner.select(rows)
        self.tokens = [self.tokens[i] for i in rows]
        self.cached = [self.cached[i] for i in rows]
        self.pending = [self.pending[i] for i in rows]

    def commit(self, new_tokens, num_accepted=None, features=None):
        assert features is not None and len(features) == len(new_tokens), "the target's features for every row"
        for b, (new, f) in enumerate(zip(new_tokens, features)):
            self.tokens[b] += new
            self.pending[b] = torch.cat([self.pending[b], f.to(self.pending[b].dtype)])

    def propose(self, max_drafts, sampling, uniforms):
        B, K = len(max_drafts), max(max_drafts, default=0)
        if K == 0:
            return Proposal.empty(B, self.vocab_size, self.device)
        # 1. Feed each row's pending (feature, next token) pairs: logits and hidden state at its last
        #    committed position. A row with none (its first step) drafts nothing.
        logits, hidden = self._feed_pending()  # [B, V'], [B, 1, H]
        ones = torch.ones(B, dtype=torch.int64, device=self.device)
        # 2. Draft: each token drawn from the row's own distribution; its own hidden state is the next feature.
        drafts, probs = [], []
        for i in range(K):
            step_probs = logits_to_probs(_widen(logits, self.vocab_size), sampling)  # [B, V]
            t = sample_from_probs(step_probs, uniforms[:, i], one_hot=sampling.all_greedy)  # [B]
            drafts.append(t)
            probs.append(step_probs)
            if i + 1 < K:
                self.model.features = hidden
                logits = self.runner.forward(t[:, None], ones[:, None].bool(), ones, 1)[:, 0]
                hidden = self.model.hidden
        # 3. Back to the positions that read the target's features.
        self.runner.rollback(host_to_device(self.cached, torch.int64, self.device), max(self.cached))
        num = host_to_device(list(max_drafts), torch.int64, self.device)
        return Proposal(torch.stack(drafts, dim=1), num, torch.stack(probs, dim=1), tuple(int(k) for k in max_drafts),
                        one_hot=sampling.all_greedy)

    def propose_tree(self, shape: TreeShape, max_depths: Sequence[int], sampling: SamplingTensors,
                     uniforms: torch.Tensor) -> Proposal:
        """EAGLE-2's tree (Li et al. 2024, arXiv 2406.16858, section 4) with this draft: the first
        `shape.nodes_within(max_depths[b])` nodes of `shape` per row, drafted level by level as
        DraftModelDrafter.propose_tree does (`draft_tree_level`: rank-0 children drawn from the draft,
        rank-r children the r-th best other token), one forward per level but the deepest
        (StaticRunner.forward_tree). Each node's feature is the draft's own hidden state at its
        parent, the root's children's the hidden state after catching up on the target's
        features, so a tree's rank-0 path is the chain `propose` would draft with the same draws.
        Nothing drafted is kept: the cache rolls back to the positions that read the target's
        features, as after a chain (hence no `commit_path`: the outcome's features suffice)."""
        B = len(max_depths)
        counts = [shape.nodes_within(int(d)) for d in max_depths]
        N = max(counts, default=0)
        if N == 0:
            return Proposal.empty(B, self.vocab_size, self.device)
        logits, hidden = self._feed_pending()  # [B, V'], [B, 1, H] at the root
        parents = torch.tensor(shape.parents[:N], dtype=torch.int64, device=self.device).expand(B, N)  # [B, N]
        num = torch.tensor(counts, dtype=torch.int64).to(self.device)  # [B]
        levels = shape.levels(N)
        logits = logits[:, None]  # [B, n, V'] at the level above (the root: n = 1)
        tokens, probs = [], []
        above = -1  # the first node of the level above (-1: the root)
        for d, (s, e) in enumerate(levels):
            wide = _widen(logits.flatten(0, 1), self.vocab_size).view(B, logits.shape[1], -1)  # [B, n, V]
            t, level_probs = draft_tree_level(shape, s, e, above, wide, sampling, uniforms)  # [B, e - s], [B, e - s, V]
            tokens.append(t)
            probs.append(level_probs)
            if d + 1 < len(levels):  # the deepest level is verified, never fed
                up = torch.tensor([shape.parents[i] - above for i in range(s, e)], dtype=torch.int64, device=self.device)
                self.model.features = hidden[:, up]  # [B, e - s, H]: each node reads its parent's hidden state
                logits = self.runner.forward_tree(t, parents[:, :e], (num - s).clamp(0, e - s), start=s)  # [B, e - s, V']
                hidden = self.model.hidden  # [B, e - s, H]
            above = s
        self.runner.rollback(torch.tensor(self.cached, dtype=torch.int64, device=self.device), max(self.cached))
        return Proposal(torch.cat(tokens, dim=1), num, torch.cat(probs, dim=1), tuple(counts))

    def _feed_pending(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Catch up on every row's pending pairs (`_catch_up`); they are cached from then on."""
        counts = [len(f) for f in self.pending]
        out = self._catch_up(counts)
        self.cached = [c + n for c, n in zip(self.cached, counts)]
        self.pending = [f[:0] for f in self.pending]
        return out

    def _catch_up(self, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed every row its pending pairs, right-aligned, in one forward; on the static runner, in
        one forward per run of rows of similar counts (`prefill_groups`), so that a new row's whole
        prompt does not pad every other row's one or two pairs to its length (at batch 8 on
        Spec-Bench, most of the draft's time). Returns logits [B, V'] and hidden states [B, 1, H]
        at each row's last fed position (meaningless for a row that fed nothing)."""
        B = len(counts)
        grouped = isinstance(self.runner, StaticRunner)
        runs = prefill_groups(counts) if grouped else [(0, B)]
        logits, hidden = [], []
        for lo, hi in runs:
            n = hi - lo
            P = max(counts[lo:hi])
            if grouped and P == 0:  # nothing to feed: no forward
                logits.append(torch.zeros(n, self.runner.vocab_size, device=self.device))
                hidden.append(torch.zeros(n, 1, self.hidden_size, device=self.device))
                continue
            tokens = torch.zeros(n, P, dtype=torch.int64)  # [n, P]
            feats = torch.zeros(n, P, self.hidden_size, device=self.device)  # [n, P, H]
            for i, b in enumerate(range(lo, hi)):
                c, k = self.cached[b], counts[b]
                if k:
                    tokens[i, P - k :] = torch.as_tensor(self.tokens[b][c + 1 : c + 1 + k])
                    feats[i, P - k :] = self.pending[b]
            valid = (torch.arange(P)[None, :] >= torch.tensor([P - k for k in counts[lo:hi]])[:, None]).to(self.device)
            ones = torch.ones(n, dtype=torch.int64, device=self.device)
            self.model.features = feats
            if grouped:
                out = self.runner.forward_rows(slice(lo, hi), tokens.to(self.device), valid, ones, 1)  # [n, 1, V']
            else:
                out = self.runner.forward(tokens.to(self.device), valid, ones, 1)  # [B, 1, V']
            logits.append(out[:, 0])
            hidden.append(self.model.hidden[:, -1:])  # the last real position of every row
        if grouped and len(runs) > 1:  # each run widened the attended bound by its width: tighten it
            fed = [c + k for c, k in zip(self.cached, counts)]
            self.runner.rollback(torch.tensor(fed, dtype=torch.int64, device=self.device), max(fed))
        return torch.cat(logits), torch.cat(hidden)


def flags_of(sampling: SamplingTensors) -> tuple[bool, bool, bool, bool]:
    """The host flags a program's sampling is built with (SamplingTensors' field order)."""
    return sampling.any_greedy, sampling.any_top_k, sampling.any_top_p, sampling.all_greedy


def runner_counts(drafter: Drafter) -> GraphCounts:
    """A copy of a drafter's model's forwards so far (raysd.models.cuda_graphs.GraphCounts): its
    static runner's, or zeros (a model-free drafter, the dynamic runner)."""
    rows = getattr(drafter, "rows", None)
    runner = rows.runner if isinstance(rows, CacheRows) else getattr(drafter, "runner", None)
    return runner.counts.copy() if isinstance(runner, StaticRunner) else GraphCounts()


def _widen(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V'] -> [B, V]: a draft's narrower vocabulary gets -inf on the target's extra tokens."""
    missing = vocab_size - logits.shape[-1]
    if missing <= 0:
        return logits
    return torch.cat([logits, logits.new_full((logits.shape[0], missing), float("-inf"))], dim=-1)
