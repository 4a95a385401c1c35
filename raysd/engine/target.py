"""The target side of a speculative step: one target pass over every row's drafts, the rejection
test, one read-back, each row's tokens cut at its stop (`verify`); then the cache rolled back to
the kept tokens and finished rows retired (`commit`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import torch

from raysd.core.device import host_to_device
from raysd.core.draws import counter_uniforms, step_uniforms
from raysd.core.rejection import RejectionOutput, draft_target_overlap, greedy_rejection_sample, rejection_sample
from raysd.core.sampling import SamplingTensors, argmax_last, logits_to_probs, sample_from_probs
from raysd.core.speculation import SpeculationConfig
from raysd.core.tree import tree_rejection_sample
from raysd.core.tree_shape import TreeShape, rank_visits
from raysd.engine.batch import Batch, fill_holes
from raysd.engine.cache_rows import CacheRows, right_align
from raysd.engine.drafters import Proposal, flags_of
from raysd.engine.requests import Request
from raysd.engine.verdict import Plan, Verdict
from raysd.models.cuda_graphs import GraphCounts
from raysd.models.features import FeatureTap
from raysd.models.runner import make_runner
from raysd.models.static_runner import StaticRunner

if TYPE_CHECKING:  # annotations only: a process that only coordinates never imports the modeling stack
    from transformers import PreTrainedModel


class TargetSide:
    """The target model's runner and the rows' state beside it (`Batch`: budgets, stop sets,
    statistics).

    `features=True` also keeps the target's features (last-layer pre-norm hidden states) of every
    position it caches, for a feature draft (EAGLE): each verdict carries those of the positions
    cached for good in its step (a new row's prompt first)."""

    def __init__(self, model: PreTrainedModel, spec: SpeculationConfig, runner: str = "auto", features: bool = False,
                 linear_kernels: str = "auto", decode: Callable[[list[int]], str] | None = None,
                 cuda_graphs: bool | None = False, compile: bool | None = False):
        """`decode`: token ids -> text with the target's tokenizer, for requests with stop strings;
        `cuda_graphs`: decode and verify programs replayed as CUDA graphs (raysd.models.cuda_graphs);
        `compile`: their forwards through torch.compile (StaticRunner); None: raysd.models.runner.make_runner's default."""
        self.rows = CacheRows(make_runner(model, runner, linear_kernels=linear_kernels, cuda_graphs=cuda_graphs,
                                          compile=compile))
        self.spec, self.acceptance = spec, str(spec.acceptance)
        self.vocab_size = self.rows.runner.vocab_size
        self.batch = Batch(spec, feature_draft=features, decode=decode)
        self.tap = FeatureTap.of(model) if features else None
        self.hidden_size = model.config.hidden_size
        self._sampling: SamplingTensors | None = None
        self.prompt_features: list[torch.Tensor | None] = []  # a feature draft's: each row's prompt features, until a verdict carries them
        self._features_at: tuple | None = None  # a feature draft's: the last verify's features [B, W, H], starts, pending
        # The drafts per row a verify feeds are rounded up to one of these (the widths whose programs
        # were captured: raysd.engine.graphs); empty: as proposed.
        self.verify_widths: tuple[int, ...] = ()
        self._layouts: dict[tuple, tuple] = {}  # a verify program's packed parts, by its key

    def __len__(self) -> int:
        return len(self.batch)

    @property
    def device(self) -> torch.device:
        return self.rows.device

    def graph_counts(self) -> GraphCounts:
        """A copy of the target's forwards so far (raysd.models.cuda_graphs; zeros on the dynamic runner)."""
        runner = self.rows.runner
        return runner.counts.copy() if isinstance(runner, StaticRunner) else GraphCounts()

    @property
    def supports_trees(self) -> bool:
        return isinstance(self.rows.runner, StaticRunner)

    def add(self, items: Sequence[tuple[int, Request]]) -> None:
        """Prefill new rows (all but each prompt's last token)."""
        prompts = [req.prompt_token_ids for _, req in items]
        if self.tap is not None:
            self.tap.take_all()  # drop whatever ran on the model since (e.g. a step-cost profile)
        self.rows.add_rows(prompts, share=self.tap is None)  # a feature tap needs every prompt's own forward
        if self.tap is not None:
            self.prompt_features += self._prefill_features(prompts)
        self.batch.add(items)
        self._sampling = None

    def verify(self, proposal: Proposal, plan: Plan) -> Verdict:
        """One target pass over every row's drafts (a chain, or the tree of `plan`), the rejection
        test, one read-back; each row's accepted drafts and recovered or bonus token, cut at its
        first stop, accepted into the rows' state. The caches are rolled back by `commit`."""
        batch = self.batch
        offered = np.minimum(batch.room(), plan.k)  # [B] what the draft side was allowed
        if self._sampling is None:
            self._sampling = SamplingTensors.from_params(batch.params, self.device)
        tree = plan.tree(self.spec.num_speculative_tokens)
        logprobs = any(p.logprobs for p in batch.params)
        if tree is None and self._programs and proposal.num_draft_host is not None and not logprobs:
            host = self._verify_program(proposal)  # the step's one device-to-host copy
        else:
            if tree is None:
                out, overlap, tested, logits_at = self._verify_chain(proposal)
            else:
                out, overlap, tested, logits_at = self._verify_tree(proposal, tree)
            parts = verdict_parts(out, overlap, tested, proposal.num_draft_tokens)
            if tree is not None:
                parts.update(nodes=out.accepted_nodes, branch=self._branch_accepts(tree, out))
            if logprobs:
                parts.update(self._logprobs(logits_at, out.output_token_ids))
            host = read_back(parts)  # the step's one device-to-host copy
        tokens, n_acc = host["tokens"].astype(np.int64), host["accepted"].astype(np.int64)
        n_keep, finish = batch.cut_at_stops(tokens, n_acc)
        n_keep, finish, texts = batch.stop_at_strings(tokens, n_keep, finish)
        drafted = host["drafted"].astype(np.int64)
        path = None if tree is None else tuple(tuple(row[:n].tolist()) for row, n in zip(host["nodes"].astype(np.int64), n_acc))
        ranks = rank_visits(tree, drafted.tolist(), path) if tree is not None else None
        done = finish != 0
        verdict = Verdict(
            plan, tuple(tuple(tokens[b, : n_keep[b]].tolist()) for b in range(len(batch))), finish, offered, drafted,
            n_acc, host["tested"].astype(np.int64), host["overlap"],
            tuple(fill_holes((~done).tolist())) if done.any() else None, (), path,
            None if tree is None else host["branch"].astype(np.int64),
            *((tuple(ranks[0].tolist()), tuple(ranks[1].tolist())) if ranks is not None else ((), ())),
            features=self._step_features(n_acc, path),
            logprobs=host.get("logprobs"),
            top_logprobs=(host["top_ids"].astype(np.int64), host["top_logprobs"]) if "top_ids" in host else None,
        )
        batch.accept(verdict)
        finished = tuple((batch.ids[b], batch.result(b, self.acceptance, texts.get(b))) for b in np.flatnonzero(done))
        return dataclasses.replace(verdict, finished=finished)

    def _logprobs(self, logits_at: torch.Tensor, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """The target's log-probability of each emitted token (`tokens` [B, W], -1 past them) from the
        logits it was chosen at ([B, W, V]): "raw" rows the log-softmax of the logits (vLLM's default),
        "processed" rows of the distribution sampled; and the `top_logprobs` most likely tokens'."""
        params = self.batch.params
        logp = torch.log_softmax(logits_at.float(), dim=-1)  # [B, W, V]
        processed = [p.logprobs_mode == "processed" for p in params]
        if any(processed):
            sampled = logits_to_probs(logits_at, self._sampling).float().log()  # [B, W, V], -inf outside the support
            rows = torch.tensor(processed, device=logp.device)[:, None, None]
            logp = torch.where(rows, sampled, logp)
        index = tokens.clamp(min=0)[..., None]  # [B, W, 1]
        out = {"logprobs": logp.gather(-1, index)[..., 0]}  # [B, W]
        N = max(p.top_logprobs for p in params)
        if N:
            values, ids = logp.topk(N, dim=-1)  # [B, W, N]
            out.update(top_ids=ids, top_logprobs=values)
        return out

    def commit(self, verdict: Verdict) -> None:
        """Roll the cache back to the kept tokens (with a tree: the pending token and the accepted
        branch), and retire the rows that finished (the verdict already holds their results)."""
        if verdict.path is None:
            self.rows.commit(verdict.kept, verdict.accepted)
        else:
            self.rows.commit_path(verdict.kept, verdict.path, fed_depth=max(map(len, verdict.path), default=0))
        if verdict.keep is not None:
            self.batch.keep(verdict.keep)
            self.rows.select(verdict.keep)  # a static cache copies only the rows that move
            if self.tap is not None:
                self.prompt_features = [self.prompt_features[i] for i in verdict.keep]
            self._sampling = None

    def _verify_chain(self, proposal: Proposal) -> tuple[RejectionOutput, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One forward over each row's pending tokens and its drafts (K + 1 logits), then the
        rejection test (`judge_chain`). Returns the test's output, the overlaps [B, K] and positions
        tested [B], and the logits [B, K + 1, V]. (On the static runner without a feature tap or
        log-probabilities, `_verify_program` does the same as one program.)"""
        ids, num, host = proposal.draft_token_ids, proposal.num_draft_tokens, proposal.num_draft_host
        B, K = ids.shape
        n = max(host, default=0) + 1 if host is not None else None
        pending = [len(p) for p in self.rows.pending]
        logits = self.rows.feed(ids, num, num + 1, n, host)  # [B, n, V] with n = max(num) + 1
        if self.tap is not None:  # the chunk right-aligns each row's pending tokens and drafts
            assert host is not None, "a feature draft states its draft counts on the host"
            F = self.tap.take()  # [B, W, H]
            self._features_at = (F, [F.shape[1] - p - d for p, d in zip(pending, host)], pending)
        if logits.shape[1] < K + 1:  # every row drafted fewer than K: pad positions never read
            logits = torch.cat([logits, logits[:, -1:].expand(-1, K + 1 - logits.shape[1], -1)], dim=1)
        uniforms = None
        if not (self._sampling.all_greedy and self.spec.acceptance.exact):  # an all-greedy test reads no draw
            uniforms = step_uniforms(self.batch.seeds, self.batch.generated, self.spec.num_speculative_tokens, self.device)
        out, overlap = judge_chain(logits, ids, num, proposal.draft_probs, uniforms, self._sampling, self.spec.acceptance)
        return out, overlap, out.num_tested, logits

    @property
    def _programs(self) -> bool:
        """Whether a chain's verify runs as one program (`_verify_program`): the static runner, no feature tap."""
        return isinstance(self.rows.runner, StaticRunner) and self.tap is None

    def _verify_program(self, proposal: Proposal) -> dict[str, np.ndarray]:
        """A chain's verify as one program (`verify_program`), replayed from one CUDA graph when the
        runner has graphs: the target forward over each row's pending tokens and drafts, the rejection
        test and the verdict's parts packed for one read-back, which this returns on the host. The
        drafts are padded to a captured width (`verify_widths`) with drafts no row counts."""
        ids, host = proposal.draft_token_ids, proposal.num_draft_host
        k = self.width(ids.shape[1])
        inputs, flags = self.verify_inputs(proposal, k)
        P = inputs[0].shape[1]
        packed, = self.rows.runner.run(("verify", P, k, *flags), self.program_fn(k, flags), inputs, P + k)
        self.rows.mark_fed(inputs[2], proposal.num_draft_tokens, host)
        return unpack(packed.cpu().numpy(), self._layouts[(P, k, *flags)])

    def program_fn(self, k: int, flags: tuple) -> Callable:
        """The verify program of k drafts per row with these flags (`verify_inputs`), for StaticRunner.run."""
        return functools.partial(self.verify_program, k, flags)

    def width(self, k: int) -> int:
        """Drafts per row a verify of `k` feeds: `k` rounded up to a captured width (`verify_widths`)."""
        return min((w for w in self.verify_widths if w >= k), default=k)

    def verify_inputs(self, proposal: Proposal, k: int) -> tuple[tuple[torch.Tensor, ...], tuple]:
        """The verify program's inputs and static flags: the rows' pending tokens [B, P] and their
        count [B], drafts [B, K] and their count [B], draft_probs [B, K, V] (none for one-hot drafts of
        an all-greedy batch: the test reads the drafts alone), the rows' (seed, tokens generated) [B, 2]
        for their draws (none where nothing is drawn), temperature, top-k and top-p [B]."""
        ids, num, probs = proposal.draft_token_ids, proposal.num_draft_tokens, proposal.draft_probs
        if k > ids.shape[1]:  # drafts no row counts (num is unchanged)
            ids = torch.cat([ids, ids.new_zeros(ids.shape[0], k - ids.shape[1])], dim=1)
            probs = torch.cat([probs, probs.new_zeros(probs.shape[0], k - probs.shape[1], probs.shape[2])], dim=1)
        sampling, acceptance = self._sampling, self.spec.acceptance
        greedy = sampling.all_greedy and acceptance.exact  # argmaxes only: no draw, and a one-hot draft needs no probs
        one_hot = greedy and (proposal.one_hot or k == 0)
        pending, count = self.rows.pending_inputs()
        inputs = [pending, count, ids, num] + ([] if one_hot else [probs])
        if not greedy:
            inputs.append(host_to_device(np.stack([self.batch.seeds, self.batch.generated], axis=1), torch.int64, self.device))
        inputs += [sampling.temperature, sampling.top_k, sampling.top_p]
        return tuple(inputs), (*flags_of(sampling), one_hot, greedy, str(acceptance))

    def verify_program(self, k: int, flags: tuple, attend: int, pending, count, ids, num, *rest) -> tuple[torch.Tensor]:
        """A chain's verify over the slots 0 .. R - 1 (a program: raysd.models.cuda_graphs), device tensors
        only: the target forward over each row's pending tokens and its num[b] drafts (of `ids` [R, K]),
        the rejection test (`judge_chain`) and the verdict's parts (`verdict_parts`), packed into one
        [R, X] float64 tensor for one read-back. A padding row (count 0, num 0) feeds nothing."""
        *sampling_flags, one_hot, greedy, _ = flags
        rest = list(rest)
        probs = None if one_hot else rest.pop(0)
        keys = None if greedy else rest.pop(0)
        sampling = SamplingTensors(*rest, *sampling_flags)
        chunk, valid = right_align(pending, count, ids, num)  # [R, P + K]
        logits, = self.rows.runner.step_slots(attend, chunk, valid, num + 1, k + 1)  # [R, K + 1, V]
        Kc = self.spec.num_speculative_tokens
        uniforms = None if keys is None else counter_uniforms(keys[:, 0], keys[:, 1], 2 * Kc + 1)  # [R, 2Kc + 1]
        out, overlap = judge_chain(logits, ids, num, probs, uniforms, sampling, self.spec.acceptance)
        packed, layout = pack(verdict_parts(out, overlap, out.num_tested, num))
        self._layouts[(pending.shape[1], k, *flags)] = layout
        return (packed,)

    def _verify_tree(self, proposal: Proposal, shape: TreeShape) -> tuple[RejectionOutput, torch.Tensor, torch.Tensor,
                                                                           torch.Tensor]:
        """One forward over each row's pending token and its tree (N + 1 logits: StaticRunner.forward_tree
        with the pending token as the tree's head), then multi-draft speculative sampling
        (raysd.core.tree.tree_rejection_sample: SpecInfer's MSS, Miao et al. 2024, Algorithm 2,
        with EAGLE-2's rule for one-hot candidates)."""
        ids, num = proposal.draft_token_ids, proposal.num_draft_tokens
        B, N = ids.shape
        parents = torch.tensor(shape.parents[:N], dtype=torch.int64, device=self.device).expand(B, N)  # [B, N]
        if self.tap is not None:
            assert {len(p) for p in self.rows.pending} == {1}, "a feature draft's tree follows one pending token per row"
        logits = self.rows.feed_tree(ids, parents, num)  # [B, N + 1, V]
        if self.tap is not None:  # the chunk: each row's pending token (the tree's head), then its nodes
            self._features_at = (self.tap.take(), None, None)  # [B, N + 1, H]
        Nc = shape.num_nodes
        uniforms = step_uniforms(self.batch.seeds, self.batch.generated, Nc, self.device)  # [B, 2Nc + 1]
        target_probs = logits_to_probs(logits, self._sampling)  # [B, N + 1, V]
        out = tree_rejection_sample(parents, ids, num, proposal.draft_probs, target_probs, uniforms[:, Nc : Nc + N],
                                    uniforms[:, 2 * Nc], max_depth=shape.depth_of(N))
        overlap, tested = path_overlaps(shape, out, num, proposal.draft_probs, target_probs)
        # The logits each emitted token was chosen at: after the head, then after each accepted node.
        head = torch.zeros(B, 1, dtype=torch.int64, device=self.device)
        at = torch.cat([head, out.accepted_nodes + 1], dim=1).clamp(min=0)  # [B, D + 1]
        logits_at = logits.gather(1, at[..., None].expand(*at.shape, logits.shape[-1]))  # [B, D + 1, V]
        return out, overlap, tested, logits_at

    def _branch_accepts(self, shape: TreeShape, out: RejectionOutput) -> torch.Tensor:
        """[B] accepted nodes that are not a rank-0 child (tokens a chain would not have drafted)."""
        N = shape.num_nodes
        ranks = torch.tensor((0,) + shape.ranks[:N], dtype=torch.int64, device=self.device)  # [N + 1]
        return (ranks[out.accepted_nodes + 1] > 0).sum(dim=1)  # -1 (past the path) reads rank 0

    def _prefill_features(self, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Each new row's [len(prompt) - 1, H] features of its prefilled positions."""
        lengths = [len(p) - 1 for p in prompts]
        calls = self.tap.take_all()  # one [n, W, H] per prefill forward, its rows right-aligned
        layout = self.rows.runner.prefill_calls  # the new rows each of those forwards ran
        assert len(calls) == len(layout), f"{len(calls)} prefill forwards recorded, the runner made {len(layout)}"
        by_row = {i: F[k, F.shape[1] - lengths[i] :] for F, rows in zip(calls, layout) for k, i in enumerate(rows)}
        empty = torch.zeros(0, self.hidden_size, device=self.device)
        return [by_row.get(i, empty) for i in range(len(prompts))]

    def _step_features(self, num_accepted: np.ndarray, path: Sequence[Sequence[int]] | None) -> tuple[torch.Tensor, ...] | None:
        """A feature draft's part of the verdict: each row's features at the positions it caches
        for good this step (its pending tokens and accepted drafts; a tree's head and accepted
        path), after a new row's prompt features. Device tensors: nothing read back."""
        if self.tap is None:
            return None
        F, starts, pending = self._features_at
        if path is not None:
            step = [F[b, [0] + [n + 1 for n in p]] for b, p in enumerate(path)]  # [1 + len(p), H]
        else:
            step = [F[b, s : s + p + int(a)] for b, (s, p, a) in enumerate(zip(starts, pending, num_accepted))]
        out = tuple(f if prompt is None else torch.cat([prompt, f]) for prompt, f in zip(self.prompt_features, step))
        self.prompt_features = [None] * len(step)
        return out


def judge_chain(logits: torch.Tensor, ids: torch.Tensor, num: torch.Tensor, draft_probs: torch.Tensor | None,
                uniforms: torch.Tensor | None, sampling: SamplingTensors, acceptance) -> tuple[RejectionOutput, torch.Tensor]:
    """The rejection test of a chain (Leviathan et al. 2023, Algorithm 1), on the device, with no host read.

    Args:
        logits: [B, K + 1, V] the target's after each row's pending token and each draft.
        ids: [B, K] drafts, row b's first num[b] ([B]) real.
        draft_probs: [B, K, V] what each draft was drawn from; None for one-hot drafts of an
            all-greedy batch under the exact rule.
        uniforms: [B, 2Kc + 1] the step's draws (raysd.core.draws.step_uniforms, Kc the configured K);
            None for an all-greedy batch under the exact rule, whose test reads no draw.
        sampling: the rows' parameters; acceptance: the rule (exact, relaxed or synthetic).
    Returns:
        the test's output, and [B, K] overlaps sum_x min(target_probs, draft_probs) (1 - TV).
    """
    K = ids.shape[1]
    if sampling.all_greedy and acceptance.exact:  # each row's one-hot target: its argmax
        target_ids = argmax_last(logits)  # [B, K + 1]
        out = greedy_rejection_sample(ids, num, target_ids)
        if draft_probs is None:  # one-hot drafts: 1 where the draft is the argmax
            return out, (ids == target_ids[:, :K]).float()
        return out, draft_probs.gather(-1, target_ids[:, :K, None])[..., 0]  # [B, K] 1 - TV to a one-hot
    Kc = (uniforms.shape[1] - 1) // 2
    accept_u, final_u = uniforms[:, Kc : Kc + K], uniforms[:, 2 * Kc]
    target_probs = logits_to_probs(logits, sampling)  # [B, K + 1, V]
    if acceptance.synthetic_rate is not None:  # each draft's chance of acceptance is the rate: so is its overlap
        out = synthetic_accept(ids, num, target_probs, accept_u, final_u, acceptance.synthetic_rate)
        return out, torch.full(ids.shape, acceptance.synthetic_rate, device=ids.device)
    lam = None if acceptance.relax is None else torch.full_like(final_u, acceptance.relax)  # [B]
    out = rejection_sample(ids, num, draft_probs, target_probs, accept_u, final_u, lam)
    return out, draft_target_overlap(draft_probs, target_probs)


def verdict_parts(out: RejectionOutput, overlap: torch.Tensor, tested: torch.Tensor, drafted: torch.Tensor) -> dict[str, torch.Tensor]:
    """What a step reads back for its verdict: emitted tokens [B, W], accepted, tested and drafted
    counts [B], and the overlap summed over each row's tested positions [B]."""
    positions = torch.arange(overlap.shape[1], device=overlap.device)[None, :]
    return {"tokens": out.output_token_ids, "accepted": out.num_accepted, "tested": tested, "drafted": drafted,
            "overlap": torch.where(positions < tested[:, None], overlap, 0.0).sum(dim=1)}


def pack(parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, tuple[tuple[str, tuple[int, ...]], ...]]:
    """Every part ([B] or [B, ...]) as float64 (which holds token ids exactly) in one [B, X] tensor,
    and the layout `unpack` reads it back by (each part's name and trailing shape)."""
    flat = [t.reshape(t.shape[0], -1).double() for t in parts.values()]
    return torch.cat(flat, dim=1), tuple((name, tuple(t.shape[1:])) for name, t in parts.items())


def unpack(packed: np.ndarray, layout: tuple[tuple[str, tuple[int, ...]], ...]) -> dict[str, np.ndarray]:
    """`pack`'s parts from its tensor on the host, by name."""
    out, at = {}, 0
    for name, shape in layout:
        width = int(np.prod(shape, dtype=np.int64))
        out[name] = packed[:, at : at + width].reshape(packed.shape[0], *shape)
        at += width
    return out


def read_back(parts: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """The step's one device-to-host copy: every part packed into one tensor, then unpacked on the host."""
    packed, layout = pack(parts)
    return unpack(packed.cpu().numpy(), layout)


def path_overlaps(shape: TreeShape, tree: RejectionOutput, num_nodes: torch.Tensor, draft_probs: torch.Tensor,
                  target_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The chain's evidence for alpha_estimate, read off a tree: at each node of the accepted
    path (the root first), sum_x min(target_probs, draft_probs) of its rank-0 child, the one
    drawn from the draft and tested first, against the untouched target. Returns [B, D]
    overlaps and [B] how many were tested (a prefix: the accepted depth, plus one where the
    path's last node has a child)."""
    B, N = draft_probs.shape[:2]
    D = tree.accepted_nodes.shape[1]
    device = target_probs.device
    first = torch.tensor(shape.first_children(N), dtype=torch.int64, device=device)  # [N + 1]
    root = torch.full((B, 1), -1, dtype=torch.int64, device=device)
    at = torch.cat([root, tree.accepted_nodes], dim=1)[:, :D]  # [B, D] the path's node at depth d
    child = first[at + 1]  # [B, D] its rank-0 child, -1 if none
    d = torch.arange(D, device=device)[None, :]
    tested = (d <= tree.num_accepted[:, None]) & (child >= 0) & (child < num_nodes[:, None])  # [B, D]
    V = target_probs.shape[-1]
    target_at = target_probs.gather(1, (at + 1)[..., None].expand(B, D, V))  # [B, D, V] after the path's node
    draft_at = draft_probs.gather(1, child.clamp(min=0)[..., None].expand(B, D, V))  # [B, D, V] its rank-0 child's law
    overlap = torch.where(tested, torch.minimum(target_at, draft_at).sum(dim=-1), 0.0)  # [B, D]
    return overlap, tested.sum(dim=1)


def synthetic_accept(
    draft_token_ids: torch.Tensor,  # [B, K] int64
    num_draft_tokens: torch.Tensor,  # [B] int64, each in 0..K
    target_probs: torch.Tensor,  # [B, K + 1, V]
    accept_uniforms: torch.Tensor,  # [B, K] in [0, 1)
    final_uniforms: torch.Tensor,  # [B] in [0, 1)
    rate: float,
) -> RejectionOutput:
    """Capacity-planning stand-in for the rejection test (vLLM's "synthetic" acceptance):
    draft i is accepted iff accept_uniforms[:, i] < rate, whatever the two models say; the
    accepted prefix is kept as usual and the next token is drawn from the target right after
    it. Steps then cost what they would at acceptance rate `rate`, but the output is NOT
    distributed as the target's."""
    B, K = draft_token_ids.shape
    rows = torch.arange(B, device=target_probs.device)
    positions = torch.arange(K, device=target_probs.device)
    drafted = positions[None, :] < num_draft_tokens[:, None]  # [B, K]
    accepted = drafted & (accept_uniforms < rate)  # [B, K]
    num_accepted = accepted.int().cumprod(dim=1).sum(dim=1)  # [B] length of the accepted prefix
    final_tokens = sample_from_probs(target_probs[rows, num_accepted], final_uniforms)  # [B]
    return RejectionOutput.from_prefix(draft_token_ids, num_draft_tokens, num_accepted, final_tokens)
