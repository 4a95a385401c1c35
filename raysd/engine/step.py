"""One speculative step: propose, verify, accept, roll back both sides, retire.

`speculative_step` is the whole algorithm for a batch; the single-process engine calls it
with both sides in one process, and the Ray actors call it unchanged: the target actor with
a `ReceivedProposal` standing in for a draft that lives in another actor, which then applies
the same `Verdict` to its own `DraftSide` (raysd.actors). Its one hook (`StepHook`) chooses
the step's K and tree (fixed, or by goodput: raysd.engine.adaptive.KController) and keeps
the timings.

The sides agree without being told: each row's drafts are capped by its own room (the same
`Batch.room` on both sides, which apply the same verdicts), and each row's draws come from
(seed, tokens generated) (raysd.core.draws.step_uniforms), so a seed gives the same tokens in
the engine and through the actors, whatever the batch.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from raysd.core.draws import step_uniforms
from raysd.core.sampling import SamplingTensors
from raysd.core.speculation import SpeculationConfig
from raysd.engine.adaptive import PlainRun
from raysd.engine.batch import Batch
from raysd.engine.drafters import Drafter, Proposal, runner_counts
from raysd.engine.requests import Request
from raysd.engine.target import TargetSide
from raysd.engine.verdict import Plan, StepTimings, Verdict
from raysd.models.cuda_graphs import GraphCounts

if TYPE_CHECKING:
    from raysd.engine.adaptive import KController


class StepHook:
    """The one hook of a step: it chooses the step's plan before, and learns from its verdict
    and timings after. With no controller, every step drafts the configured K and tree; with
    one (raysd.engine.adaptive.KController), the plan of best expected goodput."""

    def __init__(self, spec: SpeculationConfig, controller: KController | None = None):
        self.spec, self.controller = spec, controller
        self.timings = StepTimings()

    def plan(self, draft: DraftSide) -> Plan:
        if self.controller is None:
            return Plan(self.spec.num_speculative_tokens, self.spec.tree_budget)
        batch = draft.batch
        if not self.spec.tree_budget:
            if self.controller.resting():
                return Plan(0)
            start = time.perf_counter()
            if (confidence := draft.confidence()) is not None:
                return Plan(self.controller.choose_k_by_confidence(confidence, batch.room(), time.perf_counter() - start))
        return Plan(*self.controller.choose_plan_from(batch.stats.overlap_sum, batch.stats.tested, batch.room()))

    def observe(self, verdict: Verdict, draft_s: float, verify_s: float, prefill_s: float) -> None:
        if self.controller is not None:
            self.controller.observe_all(verdict.step_overlap, verdict.step_tested, int(verdict.accepted.sum()))
            self.controller.observe_ranks(verdict.rank_offered, verdict.rank_moved)
            width = int(verdict.drafted.max(initial=0)) + 1  # tokens per row the target verified
            self.controller.observe_step(len(verdict.kept), width, verdict.plan.k, verify_s, draft_s,
                                         tokens=sum(map(len, verdict.kept)), steps=verdict.steps)
        t, drafted, n = self.timings, verdict.plan.k > 0, verdict.steps  # k = 0 drafts nothing: no draft time
        t.draft_s, t.verify_s, t.prefill_s = t.draft_s + drafted * draft_s, t.verify_s + verify_s, t.prefill_s + prefill_s
        t.steps, t.drafted_steps, t.row_steps = t.steps + n, t.drafted_steps + drafted, t.row_steps + n * len(verdict.kept)
        t.generated_tokens += sum(map(len, verdict.kept))  # as emitted: a Ray actor's call reports its steps' tokens

    def plain_run(self, draft: DraftSide, cap: int) -> PlainRun:
        """After `plan` chose plain decoding (K = 0) for this step: the steps, this one first and at
        most `cap` and at most the steps until a row's budget or context ends it, to decode
        plainly before planning again (KController.plain_run; without a controller, every step
        plans the configured K)."""
        cap = max(1, min(cap, int(draft.batch.tokens_left().min(initial=cap))))
        if self.controller is None:
            return PlainRun(1 if self.spec.num_speculative_tokens else cap, "step", 0)
        return self.controller.plain_run(len(draft.batch), cap)

    def end_plain_run(self, run: PlainRun, ran: int) -> None:
        """`ran` steps of the run went by (the target stops after the first that retires a row)."""
        if self.controller is not None:
            self.controller.end_plain_run(run, ran)


def speculative_step(draft: DraftSide | ReceivedProposal, target: TargetSide, hook: StepHook) -> Verdict:
    """One speculative step for every row of the batch: Leviathan, Kalman and Matias 2023,
    Algorithm 1, batched with ragged acceptance (each row accepts its own number of drafts).

    1. propose: up to K drafts per row (or a tree), with draft_probs, the distribution each was drawn from;
    2. verify: one target forward over each row's pending token and its drafts, the rejection
       test (raysd.core.rejection), and one read-back to the host;
    3. accept: each row keeps its accepted drafts and the recovered or bonus token, cut at its
       first stop condition (the target side counts them into its rows' statistics);
    4. roll back: both KV caches keep exactly the kept tokens (`commit`, target and draft);
    5. retire: rows that finished leave both sides (`commit`), their results in the verdict.

    Its halves are `draft_half` (1) and `target_half` (2-5 on the target), then `settle` (4-5 on the
    draft): a draft actor runs the first and the last of these on its side of a split replica.
    """
    counts = draft.graph_counts(), target.graph_counts()
    plan, proposal, draft_s, prefill_s = draft_half(draft, hook)
    verdict, verify_s = target_half(target, proposal, plan)
    settle(draft, hook, verdict, draft_s, verify_s, prefill_s)
    hook.timings.add_counts(draft.graph_counts().minus(counts[0]))  # graph replays, eager forwards, captures
    hook.timings.add_counts(target.graph_counts().minus(counts[1]))
    return verdict


def draft_half(draft: DraftSide | ReceivedProposal, hook: StepHook, plan: Plan | None = None
               ) -> tuple[Plan, Proposal, float, float]:
    """1. The step's plan (K and the tree: the hook's, unless chosen already) and its proposal; with
    the seconds proposing took and, of them apart, the seconds prefilling cold rows into the drafter."""
    plan = hook.plan(draft) if plan is None else plan
    prefilled, start = draft.prefill_s, time.perf_counter()
    proposal = draft.propose(plan)
    prefill_s = draft.prefill_s - prefilled
    return plan, proposal, time.perf_counter() - start - prefill_s, prefill_s


def target_half(target: TargetSide, proposal: Proposal, plan: Plan) -> tuple[Verdict, float]:
    """2-5 on the target side: verify, accept, roll its cache back, retire; with its seconds."""
    start = time.perf_counter()
    verdict = target.verify(proposal, plan)
    target.commit(verdict)
    return verdict, time.perf_counter() - start


def settle(draft: DraftSide | ReceivedProposal, hook: StepHook, verdict: Verdict, draft_s: float, verify_s: float,
           prefill_s: float = 0.0) -> None:
    """4-5 on the draft side, to the verdict's tokens and rows; the hook learns from the step."""
    draft.commit(verdict)
    hook.observe(verdict, draft_s, verify_s, prefill_s)


class DraftSide:
    """The propose half: a drafter and, per row, what its draws and its cap depend on.

    A draft model gets a row only when a step asks for drafts: until then the side keeps the row's
    tokens itself (the row is cold) and the drafter does no work for it (no prefill, no cache), so
    a step with K = 0, as the adaptive controller chooses when drafting would not pay, costs the
    draft side nothing, for the rows admitted before the first drafting step and for every row
    admitted after the last one alike. A step with K > 0 first prefills the drafter with each cold
    row's tokens so far. The drafter's rows are the warm rows, in the batch's order."""

    def __init__(self, drafter: Drafter, spec: SpeculationConfig, device: torch.device | str):
        self.drafter, self.spec, self.device = drafter, spec, torch.device(device)
        self.batch = Batch(spec, drafter.needs_features)
        # Whether rows may wait cold: a draft model's (a feature draft follows the target's features
        # from a row's first step; a model-free drafter has no prefill to save, and the suffix
        # drafter learns from every row that finishes).
        self.lazy = drafter.max_model_len is not None and not drafter.needs_features
        self.cold: list[list[int] | None] = []  # per batch row: its tokens while cold, None once in the drafter
        self._sampling: SamplingTensors | None = None
        self.prefill_s = 0.0  # seconds drafting steps spent prefilling cold rows

    def __len__(self) -> int:
        return len(self.batch)

    def add(self, items: Sequence[tuple[int, Request]]) -> None:
        prompts = [list(req.prompt_token_ids) for _, req in items]
        if self.lazy:
            self.cold += prompts
        else:
            self.drafter.add_rows(prompts)
            self.cold += [None] * len(prompts)
        self.batch.add(items)
        self._sampling = None

    def graph_counts(self) -> GraphCounts:
        """The drafter's model's forwards so far (zeros for a model-free drafter)."""
        return runner_counts(self.drafter)

    @property
    def num_cold(self) -> int:
        return sum(tokens is not None for tokens in self.cold)

    def confidence(self) -> np.ndarray | None:
        """[B, K] the drafter's own acceptance estimate for each row's drafts up to its room
        (Drafter.confidence), or None (a cold row, or a drafter with no such estimate)."""
        if self.num_cold or not len(self.batch):
            return None
        return self.drafter.confidence(self.batch.room().tolist())

    def _warm_up(self) -> None:
        """Every cold row into the drafter: appended after the warm rows, then put in the batch's order."""
        t0 = time.perf_counter()
        warm = [i for i, tokens in enumerate(self.cold) if tokens is None]
        cold = [i for i, tokens in enumerate(self.cold) if tokens is not None]
        self.drafter.add_rows([self.cold[i] for i in cold])
        where = {row: n for n, row in enumerate(warm + cold)}  # batch row -> the drafter's row
        order = [where[i] for i in range(len(self.cold))]
        if order != list(range(len(order))):
            self.drafter.select(order)
        self.cold = [None] * len(self.cold)
        self.prefill_s += time.perf_counter() - t0

    def propose(self, plan: Plan) -> Proposal:
        """Up to min(plan.k, room) drafts per row, drawn with the rows' own counter-based draws;
        with a tree, its nodes at most min(plan.k, room) deep (Drafter.propose_tree)."""
        offered = np.minimum(self.batch.room(), plan.k)  # [B]
        if self.num_cold:
            if not offered.any():  # nothing to draft: the cold rows stay cold
                return Proposal.empty(len(self.batch), self.drafter.vocab_size, self.device)
            self._warm_up()
        if self._sampling is None:
            self._sampling = SamplingTensors.from_params(self.batch.params, self.device)
        tree = plan.tree(self.spec.num_speculative_tokens)
        n = tree.num_nodes if tree is not None else self.spec.num_speculative_tokens
        if self._sampling.all_greedy:  # every draft is an argmax, whatever its uniform: draw none
            uniforms = torch.zeros(len(self.batch), n, dtype=torch.float64, device=self.device)  # [B, n]
        else:
            uniforms = step_uniforms(self.batch.seeds, self.batch.generated, n, self.device)[:, :n]  # [B, n]
        if tree is not None:
            return self.drafter.propose_tree(tree, offered.tolist(), self._sampling, uniforms)
        return self.drafter.propose(offered.tolist(), self._sampling, uniforms)

    def commit(self, verdict: Verdict) -> None:
        """Accept the verdict's tokens, roll the drafter back to them (with a tree: keep the
        accepted branch), and retire the rows that finished."""
        self.batch.accept(verdict)
        warm = [i for i, tokens in enumerate(self.cold) if tokens is None]  # the drafter's rows, in order
        for tokens, new in zip(self.cold, verdict.kept):
            if tokens is not None:
                tokens += new
        if self.drafter.needs_features:
            assert verdict.features is not None, "a feature draft needs the target's features in every verdict"
            self.drafter.commit(verdict.kept, verdict.accepted, [f.to(self.device) for f in verdict.features])
        elif len(warm) == len(self.cold):
            if verdict.path is None:
                self.drafter.commit(verdict.kept, verdict.accepted)
            else:
                self.drafter.commit_path(verdict.kept, verdict.path)
        elif warm:  # a step without drafts (a cold row never drafts): the warm rows take their new tokens
            assert verdict.path is None and not verdict.accepted[warm].any(), "a step with cold rows drafts nothing"
            self.drafter.commit([verdict.kept[i] for i in warm], verdict.accepted[warm])
        if verdict.keep is not None:
            where = {row: n for n, row in enumerate(warm)}
            if warm:
                self.drafter.select([where[i] for i in verdict.keep if i in where])
            self.cold = [self.cold[i] for i in verdict.keep]
            self.batch.keep(verdict.keep)
            self._sampling = None


class ReceivedProposal:
    """A draft side that lives in another process (raysd.actors): the target's step gets its
    proposal from here, and the draft's own process applies the verdict to its DraftSide."""

    batch = None
    prefill_s = 0.0

    def __init__(self, proposal: Proposal):
        self.proposal = proposal

    def confidence(self) -> None:
        return None  # the plan was made where the drafter lives (the draft actor)

    def graph_counts(self) -> GraphCounts:
        return GraphCounts()  # counted where the drafter lives

    def propose(self, plan: Plan) -> Proposal:
        return self.proposal

    def commit(self, verdict: Verdict) -> None:
        pass


class ReceivedPlan(StepHook):
    """The hook of a step whose plan was chosen where the draft lives (raysd.actors)."""

    def __init__(self, spec: SpeculationConfig, plan: Plan):
        super().__init__(spec)
        self.received = plan

    def plan(self, draft: ReceivedProposal) -> Plan:
        return self.received
