"""Choosing the speculation length each step, so speculation never costs throughput.

For a step with K drafts per row (each row capped by its own budget) the expected
goodput of the whole batch is

    G(K) = sum_b E(alpha_b, min(K, budget_b)) / T_step(B, K)
    E(a, k) = (1 - a^(k+1)) / (1 - a)                    Leviathan et al. 2023, eq. 1
    T_step(B, K) = T_target(B, K + 1) + K T_draft(B)      one process (SpecEngine)
                 = max(T_target(B, K + 1), K T_draft(B))  draft and target overlapped (actors)

K = 0 is plain decoding (E = 1 per row, and the draft is not called). The rows share
one K: the target verifies a padded [B, K + 1] block and the draft runs K passes over
the batch, so a step costs the same whatever K the other rows would want; what is
per request is each row's acceptance estimate, which weighs its vote. A row's alpha
is its running alpha_estimate shrunk towards a prior by pseudo-counts, so a new row
starts at the prior and its own history takes over as it accumulates. The prior is itself
learned (KController): the acceptance pooled over every row served so far, starting
from AdaptiveConfig.prior_alpha.

With a tree budget P the controller also weighs draft trees (`choose_plan_from`): the shapes
tree_shape(P', K) for P' = 2, 4, 8, .. up to P, each cut at any depth k <= K, against the
chains k = 0..K, by the same goodput. A tree's expected tokens per step is one plus the sum over
its nodes of the chance the walk reaches them,

    E = 1 + sum_nodes prod_{ranks r on the node's path} m_r,   m_0 = alpha_b, m_r = rank_rates()[r]

where m_r is the measured chance that verification moves from a node to its rank-r child
(raysd.core.tree_shape.rank_visits, pooled over the rows; RANK_PRIOR before any evidence).
With only rank-0 nodes this is Leviathan et al.'s E(alpha, k) above, so a chain and a tree are
compared on one scale: the tree is drafted only when its expected tokens pay for its wider
verify, T_target(B, N + 1) for N nodes, and its wider draft levels. Sequoia (Chen et al. 2024,
arXiv 2402.12374, section 3.1) chooses its tree from the same positional acceptance rates, once
and offline; here the choice is made each step from rates measured on the run.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from raysd.core.speculation import AdaptiveConfig, StepCosts
from raysd.core.theory import expected_tokens_batch
from raysd.core.tree_shape import RANK_PRIOR, TreeShape, tree_shape

FIRST_REPLAIN, MAX_REPLAIN = 8, 256  # LearnedStepCosts.wants_plain: drafting steps between plain re-timings
REST_ABOVE = 0.01  # KController.resting: a confidence estimate costing more than this share of a plain step...
MAX_REST = 15  # ...rests at most this many steps after one that chose K = 0
# _RealisedGuard: drafting steps in a bucket before their realised rate is weighed, and the
# steps (that would have drafted) paused after one found it below plain decoding's (doubling).
GUARD_STEPS, FIRST_PAUSE, MAX_PAUSE = 4, 8, 256


class KController:
    """Chooses each step's K from the rows' acceptance estimates, and pools acceptance evidence
    over every row it has served (empirical Bayes). A row with no history of its own starts from
    the pool's estimate, not from the fixed prior: a weak drafter is switched off once, rather
    than rediscovered by every new request at the cost of a few slow steps each. A row's own
    evidence then moves it away from the pool. A row never offered K > 0 gathers no evidence,
    so once the pool is pessimistic, rows that would do better than it are not found.

    `tree_budget` P > 0 (with `depth` K, the trees' depth limit) adds draft trees to the choice:
    `choose_plan_from` returns (k, P') with P' = 0 for a chain of k drafts, or P' > 0 for the
    tree tree_shape(P', K) cut at depth k (module docstring)."""

    def __init__(self, config: AdaptiveConfig, tree_budget: int = 0, depth: int = 0):
        if tree_budget and depth < 1:
            raise ValueError(f"a tree budget needs depth >= 1, got {depth}")
        if tree_budget and config.costs is not None and config.costs.k_max < tree_budget:
            raise ValueError(f"a tree budget needs step costs up to K = {tree_budget}, got costs up to {config.costs.k_max}")
        self.config = config
        # Measured beforehand (a profile), or learned from the steps as they run.
        self.costs = (config.costs if config.costs is not None
                      else LearnedStepCosts(max(depth, tree_budget, 1), crossover_tokens=config.crossover_tokens))
        self.ks: tuple[int, ...] | None = None  # the chain lengths a step may draft (those captured as graphs); None: any
        self.overlap_sum = 0.0
        self.num_tested_positions = 0
        self.trees = [_TreeCandidate(P, tree_shape(P, depth)) for P in tree_budgets(tree_budget)]
        R = len(RANK_PRIOR)
        self.rank_offered = np.zeros(R, dtype=np.int64)  # rank_visits, summed over every tree step
        self.rank_moved = np.zeros(R, dtype=np.int64)
        self.chosen: Counter[tuple[int, int]] = Counter()  # steps per (k, tree budget) chosen
        # A drafter's own confidence against what it delivered (choose_k_by_confidence, observe_all).
        self.confidence_expected = self.confidence_accepted = 0.0
        self._expected: float | None = None  # what the last confidence-planned step expected
        self._rest = 0  # steps left to plan K = 0 without asking the drafter's confidence
        self._plan_s = 0.0  # the drafter's confidence estimate of the step planned last (its cost)
        self._settled = False  # the last plan was K = 0 by goodput (`plain_run`)
        # Costs learned from the steps are checked against what the steps realised; a measured
        # profile is taken as given, so its plans are a function of the rows' evidence alone.
        self.guard = _RealisedGuard() if isinstance(self.costs, LearnedStepCosts) else None

    @property
    def prior(self) -> float:
        c = self.config
        return (self.overlap_sum + c.prior_alpha * c.prior_weight) / (self.num_tested_positions + c.prior_weight)

    def rank_rates(self) -> np.ndarray:
        """[R] m_r: the chance that verification moves from a node to its rank-r child, for
        r >= 1 (entry 0 is unused: a row's own alpha stands for it), shrunk towards RANK_PRIOR."""
        w = self.config.prior_weight
        return (self.rank_moved + np.asarray(RANK_PRIOR) * w) / (self.rank_offered + w)

    def choose_k_from(self, overlap_sums: Sequence[float], tested: Sequence[int], budgets: Sequence[int]) -> int:
        """choose_k from the rows' statistics as arrays (the engine's Batch)."""
        return choose_k(self._alphas(overlap_sums, tested), budgets, self.config, self.costs, self.ks)

    def choose_plan_from(self, overlap_sums: Sequence[float], tested: Sequence[int],
                         budgets: Sequence[int]) -> tuple[int, int]:
        """(k, tree budget) of the step with the best expected goodput: (k, 0) a chain of k drafts
        (k = 0: plain decoding), (k, P) the tree of budget P cut at depth k. A tree must beat the
        best chain strictly, so with no tree budget this is (choose_k_from, 0)."""
        alphas = self._alphas(overlap_sums, tested)
        self._settled = False
        if self._plain_to_time(len(alphas)):
            return 0, 0
        plan = (choose_k(alphas, budgets, self.config, self.costs, self.ks), 0)
        if self.trees and len(alphas):
            best = self.goodput(alphas, budgets, *plan)
            a, caps, rates = np.clip(np.asarray(alphas, dtype=np.float64), 0.0, 1.0), np.asarray(budgets), self.rank_rates()
            for tree in self.trees:
                for k, goodput in self._tree_goodputs(tree, a, caps, rates):
                    if goodput > best:
                        plan, best = (k, tree.budget), goodput
        self._settled = plan == (0, 0)  # plain by the rows' evidence and the costs, not by a pause
        if plan[0] and self.guard is not None and not self.guard.allows(len(alphas)):
            plan = (0, 0)
        self.chosen[plan] += 1
        return plan

    def plain_run(self, batch_size: int, cap: int) -> PlainRun:
        """After this controller planned K = 0 for a step of `batch_size` rows: how many steps, that
        one first and at most `cap`, it would plan K = 0 for in a row, were it asked before each
        with nothing new learned (the same rows, no tested drafts); the steps past the first are
        planned now (counted, and taken from a rest or a pause). A draft actor hands the run to the
        target, which decodes it in one call and spares the steps between their round trips
        (raysd.actors.model_actors); `end_plain_run` gives back the steps a retired row cut off.

        The plan of best expected goodput was plain: it stays plain while nothing is learned (a
        row's room only shrinks, which favours drafting less), so the whole cap; a step the guard
        refused or a resting step: the pause's or the rest's steps left; a step that times plain
        decoding (LearnedStepCosts.wants_plain): itself only, since the next plan weighs what it
        measures. Which steps draft changes how fast the rows go, never what they emit."""
        extra, b = max(0, cap - 1), LearnedStepCosts.bucket(batch_size)
        if self._settled:
            run = PlainRun(1 + extra, "settled", b)
        elif self._rest > 0:
            run = PlainRun(1 + min(extra, self._rest), "rest", b)
            self._rest -= run.steps - 1
        elif self.guard is not None and self.guard.pause[b] > 0:
            run = PlainRun(1 + min(extra, self.guard.pause[b]), "pause", b)
            self.guard.pause[b] -= run.steps - 1
            self.guard.paused_steps += run.steps - 1
        else:
            return PlainRun(1, "step", b)
        self.chosen[(0, 0)] += run.steps - 1
        return run

    def end_plain_run(self, run: PlainRun, ran: int) -> None:
        """The run's steps that did not run (a row retired first) given back, as if never planned."""
        unused = run.steps - ran
        assert 0 <= unused < run.steps, f"a run of {run.steps} steps ran {ran}"
        self.chosen[(0, 0)] -= unused
        if run.kind == "rest":
            self._rest += unused
        elif run.kind == "pause":
            self.guard.pause[run.bucket] += unused
            self.guard.paused_steps -= unused

    def goodput(self, alphas: Sequence[float], budgets: Sequence[int], k: int, tree_budget: int = 0) -> float:
        """Expected tokens per second of a step: a chain of k drafts, or the tree of `tree_budget`
        (one of `tree_budgets(P)`) cut at depth k; rows capped by their budgets (room)."""
        B, costs, overlapped = len(alphas), self.costs, self.config.overlapped
        if not tree_budget:
            tokens = float(expected_tokens_batch(alphas, budgets, k)[k]) if B else 0.0
            return tokens / step_seconds(costs, B, k, overlapped)
        tree = next(t for t in self.trees if t.budget == tree_budget)
        a, caps = np.clip(np.asarray(alphas, dtype=np.float64), 0.0, 1.0), np.minimum(np.asarray(budgets), k)
        return dict(self._tree_goodputs(tree, a, caps, self.rank_rates()))[min(k, tree.depth, max(budgets))]

    def _tree_goodputs(self, tree: _TreeCandidate, alphas: np.ndarray, caps: np.ndarray,
                       rates: np.ndarray) -> list[tuple[int, float]]:
        """(k, goodput) of the tree cut at each depth k up to the rows' largest cap that adds a
        node off the rank-0 chain (a cut with the chain's nodes only is a chain candidate)."""
        B, costs, overlapped = len(alphas), self.costs, self.config.overlapped
        reach = tree.reach(alphas, rates)  # [B, D]
        D = reach.shape[1]
        per_depth = np.where(np.arange(D)[None, :] < caps[:, None], reach, 0.0).sum(axis=0)  # [D]
        tokens = B + np.cumsum(per_depth)  # [D]: tokens with the tree cut at depth k = index + 1
        out = []
        for k in range(1, min(D, int(caps.max(initial=0))) + 1):
            n = tree.shape.nodes_within(k)
            if n > k:
                out.append((k, float(tokens[k - 1]) / tree_step_seconds(costs, B, tree.shape, n, overlapped)))
        return out

    def _alphas(self, overlap_sums: Sequence[float], tested: Sequence[int]) -> list[float]:
        prior, w = self.prior, self.config.prior_weight
        return [(o + prior * w) / (n + w) for o, n in zip(overlap_sums, tested)]

    def observe_all(self, overlap_sum: float, tested: int, accepted: int = 0) -> None:
        """Several rows' tested positions at once (and the drafts they accepted, for the calibration
        of a step planned by the drafter's confidence)."""
        self.overlap_sum += float(overlap_sum)
        self.num_tested_positions += int(tested)
        if self._expected is not None:
            self.confidence_expected += self._expected
            self.confidence_accepted += accepted
            self._expected = None

    def choose_k_by_confidence(self, confidence: np.ndarray, budgets: Sequence[int], estimate_s: float = 0.0) -> int:
        """The K of best expected goodput from the drafter's own estimates ([B, K]: the chance that
        row b's drafts up to position i are all accepted; raysd.engine.suffix), calibrated by how
        many such estimates the rows' verdicts have borne out (`calibration`): E_b(k) = 1 +
        c sum_{i < min(k, budget_b)} confidence[b, i] tokens per row, against the step's cost.
        `estimate_s`: the seconds the drafter took for `confidence` (see `resting`)."""
        B = len(budgets)
        self._settled = False  # a rest (`resting`) follows a plain choice here, not a whole run
        if self._plain_to_time(B):
            return 0
        best_k, expected = self._best_k_by_confidence(confidence, budgets)
        if best_k and self.guard is not None and not self.guard.allows(B):
            best_k, expected = 0, 0.0
        self.chosen[(best_k, 0)] += 1
        self._expected, self._plan_s = expected, estimate_s
        plain_s = self.costs.target(B, 0)
        if not best_k and estimate_s > REST_ABOVE * plain_s:
            self._rest = min(math.ceil(estimate_s / (REST_ABOVE * plain_s)) - 1, MAX_REST)
        return best_k

    def _plain_to_time(self, batch_size: int) -> bool:
        """Whether this step is plain decoding, chosen (and counted) before any plan is weighed:
        with costs learned from the steps, a safe first step at this batch size (plain decoding
        measures T_target(B, 1)), or a re-timing of it (LearnedStepCosts.wants_plain)."""
        if isinstance(self.costs, LearnedStepCosts) and self.costs.wants_plain(batch_size):
            self.chosen[(0, 0)] += 1
            return True
        return False

    def resting(self) -> bool:
        """Whether this step plans K = 0 without asking the drafter's confidence. The estimate costs
        host time every step, K = 0 or not (the suffix drafter's lookups: a few percent of a plain
        step of the embedded SmolLM2 on a CPU). An estimate that chose K = 0 and cost over
        REST_ABOVE of a plain step rests the next steps, as many as bring it to REST_ABOVE of the
        steps it covers (at most MAX_REST): a job where drafting does not pay loses at most
        ~REST_ABOVE to asking, and the estimate still comes often enough to find rows where it
        starts to pay, and for its calibration to follow."""
        if self._rest <= 0:
            return False
        self._settled = False
        self._rest -= 1
        self.chosen[(0, 0)] += 1
        return True

    def _best_k_by_confidence(self, confidence: np.ndarray, budgets: Sequence[int]) -> tuple[int, float]:
        """(k, the accepted drafts it expects) of best expected goodput."""
        B = len(budgets)
        caps = np.minimum(np.asarray(budgets, dtype=np.int64), confidence.shape[1])  # [B]
        positions = np.arange(confidence.shape[1])[None, :]  # [1, K]
        cumulative = np.cumsum(np.where(positions < caps[:, None], confidence, 0.0), axis=1)  # [B, K]
        c = self.calibration
        best_k, best = 0, B / step_seconds(self.costs, B, 0, self.config.overlapped)
        for k in range(1, min(self.costs.k_max, int(caps.max(initial=0))) + 1):
            if self.ks is not None and k not in self.ks:
                continue
            goodput = (B + c * cumulative[:, k - 1].sum()) / step_seconds(self.costs, B, k, self.config.overlapped)
            if goodput > best:
                best_k, best = k, goodput
        return best_k, float(cumulative[:, best_k - 1].sum()) if best_k else 0.0

    @property
    def calibration(self) -> float:
        """Accepted drafts per accepted draft the drafter's confidence expected, over every step
        planned by it (shrunk towards 1 by prior_weight pseudo-drafts)."""
        w = self.config.prior_weight
        return (self.confidence_accepted + w) / (self.confidence_expected + w)

    def observe_step(self, batch_size: int, width: int, k: int, verify_s: float, draft_s: float,
                     tokens: int | None = None, steps: int = 1) -> None:
        """A step's own timings, for costs learned as the job runs (a measured profile ignores them):
        `width` tokens per row verified (the pending token and the widest row's drafts), k drafts
        offered (a draft model's forwards), the seconds of each side; `tokens`: the tokens the step
        emitted over its rows, for the realised-rate guard (`_RealisedGuard`). `steps` > 1: a run
        of plain steps (`plain_run`), its seconds and tokens summed over them."""
        if steps > 1:
            verify_s, tokens = verify_s / steps, None if tokens is None else tokens / steps
        if isinstance(self.costs, LearnedStepCosts):
            self.costs.observe(batch_size, width, verify_s, draft_s / k if k else None)
        if tokens is not None and self.guard is not None:
            # A drafting step's price includes the confidence estimate that planned it.
            seconds = verify_s + draft_s + (self._plan_s if width > 1 else 0.0)
            self.guard.observe(batch_size, drafting=width > 1, tokens=tokens, seconds=seconds)
        self._plan_s = 0.0

    def observe_ranks(self, offered: Sequence[int], moved: Sequence[int]) -> None:
        """A tree step's walk, counted by rank (raysd.core.tree_shape.rank_visits)."""
        # New arrays, not in place: a controller sent to an actor arrives with read-only arrays.
        self.rank_offered = self.rank_offered + by_rank(offered, len(self.rank_offered))
        self.rank_moved = self.rank_moved + by_rank(moved, len(self.rank_moved))


@dataclass(frozen=True)
class PlainRun:
    """Plain steps a controller planned in a row (KController.plain_run): how many, why (the plan
    settled on K = 0, a rest, the guard's pause, or a single step), and the batch-size bucket."""

    steps: int
    kind: str
    bucket: int


class _RealisedGuard:
    """What learned costs cannot see: drafting that pays on paper but not in fact. Per batch-size
    bucket, the tokens per row per second that plain steps and drafting steps realised (the step's
    whole time: the drafter's confidence estimate, its proposing and the target's verify). Once
    GUARD_STEPS drafting steps since the last check realised less than plain decoding, the steps
    that would draft decode plainly instead for a pause (FIRST_PAUSE steps, doubling up to
    MAX_PAUSE while drafting keeps losing; back to FIRST_PAUSE once it wins); after each pause
    drafting is tried again, so a change in the rows (a template's repeated part, a new block) is
    found. Bounded cost: at most GUARD_STEPS losing steps per pause. The plan itself never changes
    what a row emits (exact whatever K), only how fast."""

    def __init__(self):
        self.plain: dict[int, float] = {}  # bucket -> plain steps' tokens per row per second (running mean)
        self.drafting: dict[int, list[float]] = {}  # bucket -> [tokens per row, seconds, steps] since the last check
        self.pause: Counter[int] = Counter()  # bucket -> drafting steps left to refuse
        self.next_pause: dict[int, int] = {}  # bucket -> the next pause's length
        self.paused_steps = 0  # steps refused over the controller's life

    def observe(self, batch_size: int, drafting: bool, tokens: int, seconds: float) -> None:
        if seconds <= 0 or batch_size < 1:
            return
        b = LearnedStepCosts.bucket(batch_size)
        per_row = tokens / batch_size
        if drafting:
            acc = self.drafting.setdefault(b, [0.0, 0.0, 0])
            acc[0], acc[1], acc[2] = acc[0] + per_row, acc[1] + seconds, acc[2] + 1
        else:
            rate = per_row / seconds
            self.plain[b] = rate if b not in self.plain else 0.75 * self.plain[b] + 0.25 * rate

    def allows(self, batch_size: int) -> bool:
        """Whether a step of this batch size that would draft may draft."""
        b = LearnedStepCosts.bucket(batch_size)
        if self.pause[b] > 0:
            self.pause[b] -= 1
            self.paused_steps += 1
            return False
        acc, plain = self.drafting.get(b), self.plain.get(b)
        if acc is None or plain is None or acc[2] < GUARD_STEPS:
            return True
        rate = acc[0] / acc[1]
        del self.drafting[b]  # each check weighs fresh steps
        if rate >= plain:
            self.next_pause[b] = FIRST_PAUSE
            return True
        pause = self.next_pause.get(b, FIRST_PAUSE)
        self.next_pause[b] = min(2 * pause, MAX_PAUSE)
        self.pause[b] = pause - 1  # this step is the pause's first
        self.paused_steps += 1
        return False


def by_rank(counts: Sequence[int], R: int) -> np.ndarray:
    """[R] int64: counts by rank, cut or zero-padded to R ranks."""
    out = np.zeros(R, dtype=np.int64)
    n = min(len(counts), R)
    out[:n] = np.asarray(counts, dtype=np.int64)[:n]
    return out


def tree_budgets(tree_budget: int) -> tuple[int, ...]:
    """The tree budgets a controller with budget P weighs: 2, 4, 8, .. below P, and P."""
    if tree_budget < 2:
        return (tree_budget,) if tree_budget else ()
    return tuple(sorted({2**i for i in range(1, tree_budget.bit_length()) if 2**i < tree_budget} | {tree_budget}))


class _TreeCandidate:
    """One tree shape, with each node's path counted by rank for `reach`."""

    def __init__(self, budget: int, shape: TreeShape):
        self.budget, self.shape = budget, shape
        self.depth = max(shape.depths)
        R = len(RANK_PRIOR)
        counts = np.zeros((shape.num_nodes, R), dtype=np.int64)  # [N, R] ranks on node i's path
        for i, (parent, rank) in enumerate(zip(shape.parents, shape.ranks)):
            if parent >= 0:
                counts[i] = counts[parent]
            counts[i, rank] += 1
        self.rank0 = counts[:, 0]  # [N]
        self.other = counts[:, 1:]  # [N, R - 1]
        self.at_depth = np.asarray(shape.depths)[None, :] == np.arange(1, self.depth + 1)[:, None]  # [D, N]

    def reach(self, alphas: np.ndarray, rates: np.ndarray) -> np.ndarray:
        """[B, D]: per row, the expected number of nodes at each depth that verification accepts."""
        branch = np.prod(rates[1:][None, :] ** self.other, axis=1)  # [N] the rank >= 1 steps' factor
        value = alphas[:, None] ** self.rank0[None, :] * branch[None, :]  # [B, N]
        return value @ self.at_depth.T  # [B, D]


def step_seconds(costs: StepCosts, batch_size: int, k: int, overlapped: bool) -> float:
    t_target = costs.target(batch_size, k)
    t_draft = k * costs.draft(batch_size)
    return max(t_target, t_draft) if overlapped else t_target + t_draft


def tree_step_seconds(costs: StepCosts, batch_size: int, shape: TreeShape, num_nodes: int, overlapped: bool) -> float:
    """A tree step of the first `num_nodes` nodes of `shape`: one target pass over N + 1 tokens
    per row, and one draft forward per level but the deepest (DraftModelDrafter.propose_tree),
    the first over the pending tokens, each later one over the level above's nodes. A draft
    forward over w tokens is costed as one over 1 scaled as the target's (the profile times the
    target's widths only)."""
    B = batch_size
    t_target = costs.target(B, num_nodes)
    levels = shape.levels(num_nodes)
    one = costs.target(B, 0)
    t_draft = costs.draft(B) * (1 + sum(costs.target(B, e - s - 1) / one for s, e in levels[:-1]))
    return max(t_target, t_draft) if overlapped else t_target + t_draft


def choose_k(alphas: Sequence[float], budgets: Sequence[int], config: AdaptiveConfig,
             costs: StepCosts | LearnedStepCosts | None = None, ks: Sequence[int] | None = None) -> int:
    """The K in 0..K_max (and in `ks`, when given: the lengths a step may draft) with the highest
    expected goodput for this batch (`costs`: the config's profile by default)."""
    costs = config.costs if costs is None else costs
    B = len(alphas)
    best_k, best = 0, B / step_seconds(costs, B, 0, config.overlapped)
    k_max = min(costs.k_max, max(budgets, default=0))
    tokens = expected_tokens_batch(alphas, budgets, k_max) if k_max > 0 else None  # [k_max + 1]
    for k in range(1, k_max + 1):
        if ks is not None and k not in ks:
            continue
        goodput = tokens[k] / step_seconds(costs, B, k, config.overlapped)
        if goodput > best:
            best_k, best = k, goodput
    return best_k


class LearnedStepCosts:
    """Step costs learned from the job's own timed steps: no profiling pass before the first token.

    StepCosts' interface (target(B, k) = T_target(B, k + 1), draft(B), k_max), filled as steps run:
    per batch-size bucket (powers of two) and per verified width w (tokens per row), a running mean
    of the measured seconds (the latest steps weigh most: `decay`). What is not measured yet:
    - a width between two measured ones: linear interpolation; beyond the widest, the widest's
      cost (optimistic: the next choice of a wider step measures it, once);
    - a bucket with nothing measured: the nearest measured bucket's costs;
    - a draft forward: free until a drafting step has been timed.
    KController starts each bucket with a plain step (`knows`), whose cost every plan is weighed
    against; a drafting step is then chosen only where, at the costs known so far, it pays. A job
    thus explores each width it might choose once per bucket, and then decides on measured costs.

    With `crossover_tokens` N* (the device's ridge: a forward over more tokens than that, rows times
    tokens per row, is compute-bound) a width not timed yet in a bucket is costed by the roofline
    from the bucket's plain step instead: T(B, w) = T(B, 1) max(1, B w / N*) / max(1, B / N*), never
    below what the timed widths say (Williams, Waterman and Patterson 2009, "Roofline"). At a large
    batch a wide verify is then known to cost more before it is tried (a GPU's verify of B (K + 1)
    tokens turns compute-bound near N*: K = 4 pays up to a few tens of rows, less beyond)."""

    def __init__(self, k_max: int, decay: float = 0.25, crossover_tokens: float | None = None):
        if k_max < 1 or not 0.0 < decay <= 1.0:
            raise ValueError(f"need k_max >= 1 and decay in (0, 1], got {k_max}, {decay}")
        self.k_max, self.decay, self.crossover_tokens = k_max, decay, crossover_tokens
        self.verify: dict[int, dict[int, float]] = {}  # bucket -> width -> seconds
        self.draft_forward: dict[int, float] = {}  # bucket -> seconds of one draft forward
        self.seen: Counter[tuple[int, int]] = Counter()  # (bucket, width) -> steps timed (width 0: a draft forward)
        self.since_plain: Counter[int] = Counter()  # bucket -> steps timed since its last plain one
        self.replain: dict[int, int] = {}  # bucket -> steps between re-timings of a plain step (doubling)

    @staticmethod
    def bucket(batch_size: int) -> int:
        return 1 << max(0, (int(batch_size) - 1).bit_length())

    def observe(self, batch_size: int, width: int, verify_s: float, draft_forward_s: float | None = None) -> None:
        b = self.bucket(batch_size)
        self._update(self.verify.setdefault(b, {}), width, (b, width), verify_s)
        if draft_forward_s is not None:
            self._update(self.draft_forward, b, (b, 0), draft_forward_s)
        if width == 1:
            if self.since_plain[b] >= self.replain.get(b, FIRST_REPLAIN):
                self.replain[b] = min(2 * self.replain.get(b, FIRST_REPLAIN), MAX_REPLAIN)
            self.since_plain[b] = 0
        else:
            self.since_plain[b] += 1

    def _update(self, table: dict, key: int, seen: tuple[int, int], seconds: float) -> None:
        """A running mean, but a shape's second timing replaces its first: the first call of a new
        shape pays one-time work (kernel selection, buffers: the first step of a shape is markedly
        slower than the next ones), and left in it would make every other width look cheap."""
        self.seen[seen] += 1
        table[key] = seconds if self.seen[seen] <= 2 else (1 - self.decay) * table[key] + self.decay * seconds

    def knows(self, batch_size: int) -> bool:
        """Whether a plain step (width 1) has been timed in this batch size's bucket."""
        return 1 in self.verify.get(self.bucket(batch_size), {})

    def wants_plain(self, batch_size: int) -> bool:
        """Whether the next step at this batch size should be plain decoding: none timed in its bucket
        yet, or FIRST_REPLAIN, then twice as many (up to MAX_REPLAIN) drafting steps since the last.
        Every plan is weighed against T_target(B, 1), which drafting steps never time: re-timing it
        replaces its cold first timing and follows the rows' growing context, at a few plain steps
        over a whole job."""
        b = self.bucket(batch_size)
        return not self.knows(batch_size) or self.since_plain[b] >= self.replain.get(b, FIRST_REPLAIN)

    def _nearest(self, table: dict[int, object], batch_size: int):
        b = self.bucket(batch_size)
        if b in table or not table:
            return table.get(b)
        return table[min(table, key=lambda x: abs(x.bit_length() - b.bit_length()))]

    def target(self, batch_size: int, k: int) -> float:
        table = self._nearest(self.verify, batch_size)
        if not table:
            return 1.0  # nothing timed anywhere: every plan costs the same until a step is
        w = k + 1
        if w in table:
            return table[w]
        if self.crossover_tokens is None or 1 not in table:
            return self._untimed(table, w)
        B, N = batch_size, self.crossover_tokens
        roofline = table[1] * max(1.0, B * w / N) / max(1.0, B / N)
        # within what the timed widths say: no less than a narrower one, no more than a wider one
        low = max((t for x, t in table.items() if x < w), default=0.0)
        high = min((t for x, t in table.items() if x > w), default=math.inf)
        return min(max(roofline, low), max(high, low))

    def _untimed(self, table: dict[int, float], w: int) -> float:
        """A width not timed in this bucket, from the widths that were (no device model)."""
        widths = sorted(table)
        below = [x for x in widths if x < w]
        above = [x for x in widths if x > w]
        if below and above:
            lo, hi = below[-1], above[0]
            return table[lo] + (table[hi] - table[lo]) * (w - lo) / (hi - lo)
        if not below:
            return table[above[0]]
        widest = below[-1]
        if w > 2 * widest:
            # Not tried yet, and more than double the widest timed width: a step that wide may
            # cost several plain steps (on a CPU at batch 32, a verify of 9 tokens per row does), so
            # exploration widens by at most doubling, each step timing the next bound.
            return math.inf
        if len(below) == 1:
            return table[widest]  # only a plain step timed: optimistic, as the next choice measures it
        # Beyond the widest: the slope of the two widest timed widths (never below flat).
        lo = below[-2]
        slope = max(0.0, (table[widest] - table[lo]) / (widest - lo))
        return table[widest] + slope * (w - widest)

    def draft(self, batch_size: int) -> float:
        return self._nearest(self.draft_forward, batch_size) or 0.0
