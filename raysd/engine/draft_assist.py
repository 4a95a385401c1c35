"""Hierarchical speculation: an n-gram drafter drafts for the draft model, which drafts for the target.

Three levels, each with an exact rejection test (Leviathan, Kalman, Matias 2023, section 4 on
extensions: "the draft model could itself be accelerated by speculative decoding"; Spector and
Re 2023, "Accelerating LLM Inference with Staged Speculative Decoding", arXiv 2308.04623;
TriForce, Sun et al. 2024, arXiv 2404.11912, which stacks a lookup-like cheap drafter under a
small model the same way):

    n-gram prompt lookup  --proposes-->  draft model  --proposes-->  target
                          (exact test:                (exact test:
                           draft's law)                target's law)

`DraftAssistDrafter` is the middle level. Each *middle step* it looks up up to k inner
drafts per row with n-gram prompt lookup (one-hot `draft_probs`), runs the draft model once over
the row's last token and those drafts (k + 1 distributions), and applies
`raysd.core.rejection.rejection_sample` with the draft model's own probabilities in the role of
the target. The tokens it hands up therefore follow the draft model's law exactly, token after
token, and it reports as `draft_probs` the draft model's distribution at each of them
(temperature, top-k, top-p and top-m applied, as `DraftModelDrafter._draft_logits`): all the top
level's rejection test needs for the output to follow the target exactly. Greedy rows hand up
exactly the draft model's greedy tokens. Inner k = 0 is two levels: the call is the plain
`DraftModelDrafter.propose`, token for token (seeded samples included).

k is chosen once per propose call, by goodput like the top level's K (`raysd.engine.adaptive`):
E(alpha_inner, k) draft tokens per draft-model forward of k + 1 tokens, with the draft model's
measured step costs (`profile_assist_costs`) and the n-gram's acceptance by the draft model (the
overlap of the draft model's distribution with a one-hot draft: the draft model's probability of
the drafted token) pooled over rows. k = 0 when the lookup does not pay: the controller chooses
between two and three levels. (As for the top level's K, a pool
that has turned pessimistic gathers no more evidence: two levels, once chosen, stay.)

Randomness: the middle step that starts at a row's i-th handed-up token draws from
counter_uniforms keyed by the 53 bits of that row's i-th drafting uniform (the engine's
`uniforms[:, i]`, itself a function of the row's seed and tokens generated), so a seed reproduces
a row, and the draws are disjoint from the top level's acceptance draws.

Cost: one read-back per middle step (the n-gram lookup runs on the host on the tokens handed up
so far), where a plain draft model reads nothing back while drafting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from raysd.core.draws import counter_uniforms
from raysd.core.rejection import rejection_sample
from raysd.core.sampling import logits_to_probs
from raysd.core.speculation import AdaptiveConfig, StepCosts
from raysd.engine.adaptive import KController
from raysd.engine.drafters import DraftModelDrafter, NgramDrafter, Proposal
from raysd.models.profile import time_forward

if TYPE_CHECKING:  # annotations only: a process that only coordinates never imports the modeling stack
    from transformers import PreTrainedModel

INNER_SALT = 0x9E3779B9  # the `positions` key of the middle level's draws (any constant < 2^32)


@dataclass
class AssistStats:
    """What the middle level did, summed over every propose call (cheap host counters)."""

    proposals: int = 0  # propose calls that drafted something
    middle_steps: int = 0  # draft-model forwards over the batch while proposing
    row_steps: int = 0  # middle steps summed over the rows they advanced (a plain draft model: one per token)
    handed_up: int = 0  # tokens handed to the top level (drafts for the target)
    lookup_drafted: int = 0  # n-gram drafts the draft model tested
    lookup_accepted: int = 0  # of those, accepted by the draft model's rejection test
    assist_k_chosen: list[int] = field(default_factory=list)  # the inner k of each middle step

    @property
    def tokens_per_middle_step(self) -> float:
        """Draft tokens per row per draft-model forward (1.0 for two levels)."""
        return self.handed_up / self.row_steps if self.row_steps else 0.0

    @property
    def lookup_acceptance_rate(self) -> float | None:
        return self.lookup_accepted / self.lookup_drafted if self.lookup_drafted else None

    def to_dict(self) -> dict:
        return {"proposals": self.proposals, "middle_steps": self.middle_steps, "row_steps": self.row_steps, "handed_up": self.handed_up,
                "lookup_drafted": self.lookup_drafted, "lookup_accepted": self.lookup_accepted,
                "tokens_per_middle_step": self.tokens_per_middle_step,
                "lookup_acceptance_rate": self.lookup_acceptance_rate,
                "mean_inner_k": (sum(self.assist_k_chosen) / len(self.assist_k_chosen)) if self.assist_k_chosen else 0.0}


def profile_assist_costs(draft: PreTrainedModel, assist_k_max: int = 4, batch_sizes: Sequence[int] = (1, 8),
                        context: int = 64, reps: int = 2) -> StepCosts:
    """The middle level's StepCosts: the draft model in the target's role (one forward over
    k + 1 tokens per row, k = 0..assist_k_max) and a free drafter (n-gram lookup)."""
    rows = [time_forward(draft, B, range(assist_k_max + 1), context, reps) for B in batch_sizes]
    return StepCosts(tuple(batch_sizes), tuple(tuple(t[k] for k in range(assist_k_max + 1)) for t in rows),
                     tuple(0.0 for _ in batch_sizes))


class DraftAssistDrafter(DraftModelDrafter):
    """The middle level of three: a draft model whose own drafts come from n-gram prompt lookup,
    each middle step verified by the draft model with an exact rejection test (module docstring).

    Args:
        model, target_vocab_size, name, draft_top_m, runner: as DraftModelDrafter.
        assist_k: the most n-gram drafts per middle step (0: two levels, exactly DraftModelDrafter).
        assist_adaptive: choose the inner k in 0..assist_k each middle step by goodput, with the draft
            model's step costs (`profile_assist_costs`); None: always assist_k.
        min_ngram, max_ngram: the lookup's n-gram lengths (NgramDrafter).
    """

    supports_trees = False  # tree drafting takes a plain draft model, an EAGLE draft or n-gram (docs/draft_assist.md)

    def __init__(self, model: PreTrainedModel, target_vocab_size: int, name: str = "draft-model+ngram",
                 draft_top_m: int = 0, runner: str = "auto", assist_k: int = 4,
                 assist_adaptive: AdaptiveConfig | None = None, min_ngram: int = 1, max_ngram: int = 3):
        # Its middle steps feed widths of their own: eager, not from graphs.
        super().__init__(model, target_vocab_size, name=name, draft_top_m=draft_top_m, runner=runner, cuda_graphs=False,
                         compile=False)
        self.supports_trees = False
        if not 0 <= assist_k <= 64:
            raise ValueError(f"assist_k must be in 0..64, got {assist_k}")
        if assist_adaptive is not None and assist_adaptive.costs.k_max < assist_k:
            raise ValueError(f"the inner step costs cover k <= {assist_adaptive.costs.k_max}, below assist_k = {assist_k}")
        self.assist_k = assist_k
        self.ngram = NgramDrafter(target_vocab_size, self.rows.device, min_ngram, max_ngram)  # holds the rows' tokens
        self.controller = KController(assist_adaptive) if assist_adaptive is not None else None
        self.assist_stats = AssistStats()
        # Per row: the draft model's overlaps with the n-gram's drafts, and how many were tested.
        self._overlap: list[float] = []
        self._tested: list[int] = []

    def add_rows(self, prompts):
        super().add_rows(prompts)
        self.ngram.add_rows(prompts)
        self._overlap += [0.0] * len(prompts)
        self._tested += [0] * len(prompts)

    def select(self, rows):
        super().select(rows)
        self.ngram.select(rows)
        self._overlap = [self._overlap[i] for i in rows]
        self._tested = [self._tested[i] for i in rows]

    def commit(self, new_tokens, num_accepted=None):
        super().commit(new_tokens, num_accepted)
        self.ngram.commit(new_tokens)

    def propose_tree(self, shape, max_depths, sampling, uniforms):
        raise ValueError("tree drafting does not take an assisted draft model (draft assist 'ngram'): use a chain")

    def _choose_inner_k(self, want: Sequence[int]) -> int:
        """The inner k of this propose call's middle steps: assist_k, or by goodput over the rows drafting."""
        if self.controller is None:
            return self.assist_k
        active = [b for b, n in enumerate(want) if n > 0]
        budgets = [min(self.assist_k, want[b] - 1) for b in active]
        return self.controller.choose_k_from([self._overlap[b] for b in active], [self._tested[b] for b in active], budgets)

    def propose(self, max_drafts, sampling, uniforms):
        """Up to max_drafts[b] tokens per row, each drawn from the draft model's law (module
        docstring); `uniforms` [B, >= max(max_drafts)] keys the middle steps' draws."""
        B, device = len(max_drafts), self.rows.device
        want = [int(k) for k in max_drafts]
        K = max(want, default=0)
        if K == 0:
            return Proposal.empty(B, self.target_vocab_size, device)
        stats = self.assist_stats
        stats.proposals += 1
        k_in = self._choose_inner_k(want)
        if k_in == 0:  # two levels: the plain draft model, token for token (no read-backs)
            stats.middle_steps += K
            stats.row_steps += sum(want)
            stats.handed_up += sum(want)
            stats.assist_k_chosen.append(0)
            return super().propose(max_drafts, sampling, uniforms)
        stats.assist_k_chosen.append(k_in)
        out: list[list[int]] = [[] for _ in range(B)]  # tokens handed up so far, per row
        probs = torch.zeros(B, K, self.target_vocab_size, device=device)  # [B, K, V] draft_probs handed up
        bits = (uniforms[:, :K].double() * 2.0**53).long()  # [B, K] the keys of the middle steps' draws
        salt = torch.full((B,), INNER_SALT, dtype=torch.int64, device=device)
        first = True
        base = None  # [B] each row's committed tokens in the draft's cache, after the first feed
        while True:
            need = [w - len(o) for w, o in zip(want, out)]
            if not any(n > 0 for n in need):
                break
            # 1. Inner drafts by lookup on each row's tokens and what it handed up so far; at most
            #    need - 1, so the middle step's bonus token can be the row's last.
            inner = [self.ngram.lookup(h + o, min(k_in, n - 1)) if n > 0 else [] for h, o, n in
                     zip(self.ngram.history, out, need)]
            counts = [len(d) for d in inner]
            C = max(counts)
            # 2. One draft forward per active row over its head (pending tokens first, later the
            #    last handed-up token, not yet fed) and its inner drafts: C + 1 distributions.
            head = 0 if first else 1
            extra = torch.zeros(B, head + C, dtype=torch.int64)
            fed = []  # extra tokens per row
            for b, (d, n) in enumerate(zip(inner, need)):
                row = ([out[b][-1]] if head else []) + d if n > 0 else []
                extra[b, : len(row)] = torch.tensor(row, dtype=torch.int64)
                fed.append(len(row))
            extra_counts = torch.tensor(fed, dtype=torch.int64)
            num_logits = torch.tensor([c + 1 for c in counts], dtype=torch.int64)
            logits = self.rows.feed(extra.to(device), extra_counts.to(device), num_logits.to(device), C + 1,
                                    tuple(fed))  # [B, C + 1, V']
            if first:
                base = list(self.rows.cached)
                first = False
            wide = self._draft_logits(logits.flatten(0, 1)).view(B, C + 1, -1)  # [B, C + 1, V]
            draft_model_probs = logits_to_probs(wide, sampling)  # [B, C + 1, V] q: the law handed up
            # 3. The exact test with q as the "target" and the one-hot lookup as the "draft".
            ids = torch.tensor([d + [0] * (C - len(d)) for d in inner], dtype=torch.int64).to(device)  # [B, C]
            one_hot = torch.zeros(B, C, self.target_vocab_size, device=device).scatter_(-1, ids[..., None], 1.0)
            pos = torch.tensor([min(len(o), K - 1) for o in out], dtype=torch.int64, device=device)  # [B]
            draws = counter_uniforms(bits.gather(1, pos[:, None])[:, 0], salt, C + 1)  # [B, C + 1]
            verdict = rejection_sample(ids, torch.tensor(counts, dtype=torch.int64).to(device), one_hot,
                                       draft_model_probs, draws[:, 1:], draws[:, 0])
            emitted = verdict.to_lists()  # the one read-back of a middle step
            # 4. Hand up the new tokens (and q at each), keep their fed drafts in the cache, drop the rest.
            rows, src, dst = [], [], []
            for b, (new, n) in enumerate(zip(emitted, need)):
                if n <= 0:
                    continue
                for j, t in enumerate(new):
                    rows.append(b), src.append(j), dst.append(len(out[b]))
                    out[b].append(int(t))
                stats.lookup_drafted += counts[b]
                stats.lookup_accepted += len(new) - 1
                stats.handed_up += len(new)
                stats.row_steps += 1
            if rows:
                r = torch.tensor(rows, device=device)
                probs[r, torch.tensor(dst, device=device)] = draft_model_probs[r, torch.tensor(src, device=device)]
            if C:
                overlap = one_hot.mul_(draft_model_probs[:, :C]).sum(-1)  # [B, C] q(drafted token)
                tested = verdict.num_tested.tolist()
                sums = torch.where(torch.arange(C, device=device)[None, :] < verdict.num_tested[:, None], overlap, 0.0).sum(1).tolist()
                for b in range(B):
                    if need[b] > 0 and tested[b]:
                        self._overlap[b] += sums[b]
                        self._tested[b] += tested[b]
                if self.controller is not None:
                    self.controller.observe_all(sum(s for b, s in enumerate(sums) if need[b] > 0),
                                                sum(t for b, t in enumerate(tested) if need[b] > 0))
            stats.middle_steps += 1
            in_cache = [base[b] + max(len(o) - 1, 0) for b, o in enumerate(out)]  # all handed up but the last
            self.rows.runner.rollback(torch.tensor(in_cache, dtype=torch.int64, device=device), max(in_cache))
        # 5. The cache holds each row's handed-up tokens but the last, as speculative tokens that the
        #    top level's commit keeps as far as the target accepted them (CacheRows.commit).
        F = max(max(len(o) - 1, 0) for o in out)
        spec = torch.zeros(B, F, dtype=torch.int64)
        for b, o in enumerate(out):
            if len(o) > 1:
                spec[b, : len(o) - 1] = torch.tensor(o[:-1], dtype=torch.int64)
        fed_host = tuple(max(len(o) - 1, 0) for o in out)
        self.rows.replace_speculative(spec, fed_host)
        tokens = torch.zeros(B, K, dtype=torch.int64)
        for b, o in enumerate(out):
            tokens[b, : len(o)] = torch.tensor(o, dtype=torch.int64)
        num = torch.tensor(want, dtype=torch.int64, device=device)
        return Proposal(tokens.to(device), num, probs, tuple(want))
