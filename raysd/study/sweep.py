"""The study: profile step costs, run the measured sweep, predict from the theory, and
return one tidy row per (drafter, K, batch_size, task).

Rows with task "all" pool every prompt of a run and carry the measured throughput; per-task
rows carry acceptance only (the tasks share each batch, so their times are not separable).
Predictions cover every profiled K, measured or not; measured columns are None where a
(drafter, K, batch_size) was not run.

`StudyConfig.acceptance` runs every drafter under one acceptance rule ("exact", or the lossy
"relaxed:LAMBDA" dial of Yin et al. 2024). Every row then also carries the front of Yin et al.
(arXiv 2411.00841, Theorems 4-5) beside the measurement: the measured TV(target, draft) over the
tested positions (1 - alpha), the measured rejection rate per tested position, the front's
rejection rate (1 - LAMBDA) TV and the output's TV to the target, LAMBDA TV (closed form: a drafted
position emits (1 - LAMBDA) target + LAMBDA draft). The predictions use the acceptance rate of the
rule, 1 - (1 - LAMBDA) TV (alpha itself when exact).
"""

from __future__ import annotations

import itertools
import math
import sys
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np
import torch

from raysd.core import theory
from raysd.core.sampling import SamplingParams
from raysd.core.speculation import Acceptance, SpeculationConfig
from raysd.engine.drafters import Drafter, DraftModelDrafter, NgramDrafter, NoDrafter
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.requests import GenerationResult, Request
from raysd.models.profile import median_time, time_forward
from raysd.study.prompts import StudyPrompt

BASELINE = "none"


@dataclass(frozen=True)
class StudyConfig:
    batch_sizes: tuple[int, ...] = (1, 4, 16, 64)
    ks: tuple[int, ...] = tuple(range(1, 9))  # measured; the profile and predictions cover 0..max(8, max(ks))
    max_new_tokens: int = 128
    temperature: float = 0.0  # Spec-Bench is greedy
    ignore_eos: bool = False
    profile_context: int = 128  # cached tokens per row while profiling
    profile_reps: int = 3
    acceptance: str = "exact"  # the drafters' rule: "exact" or "relaxed:LAMBDA" (lossy; the baseline drafts nothing)

    def __post_init__(self) -> None:
        rule = Acceptance.parse(self.acceptance)  # a one-line ValueError for a bad rule
        if rule.synthetic_rate is not None:
            raise ValueError("a study compares exact or relaxed rules, not a synthetic acceptance rate")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch_sizes must be non-empty and >= 1, got {self.batch_sizes}")
        if not self.ks or min(self.ks) < 0 or max(self.ks) > 64:
            raise ValueError(f"ks must be non-empty and in 0..64, got {self.ks}")
        if self.max_new_tokens < 1 or self.profile_context < 1 or self.profile_reps < 1:
            raise ValueError("max_new_tokens, profile_context and profile_reps must be >= 1")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        object.__setattr__(self, "batch_sizes", tuple(sorted(set(int(b) for b in self.batch_sizes))))
        object.__setattr__(self, "ks", tuple(sorted(set(int(k) for k in self.ks))))

    @property
    def profile_ks(self) -> tuple[int, ...]:
        return tuple(range(max(8, *self.ks) + 1))


@dataclass
class Pool:
    """Acceptance statistics summed over some results."""

    k: int
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    overlap: float = 0.0
    tested: int = 0
    tokens: int = 0

    def __post_init__(self) -> None:
        self.histogram = np.zeros(self.k + 1, dtype=np.int64)  # [K + 1] steps accepting exactly j

    def add(self, r: GenerationResult) -> None:
        s = r.stats
        self.steps += s.num_spec_steps
        self.drafted += s.num_draft_tokens
        self.accepted += s.num_accepted_draft_tokens
        self.overlap += s.overlap_sum
        self.tested += s.num_tested_positions
        self.tokens += len(r.token_ids)
        self.histogram += np.asarray(s.acceptance_histogram, dtype=np.int64)

    @property
    def alpha(self) -> float | None:
        return self.overlap / self.tested if self.tested else None

    @property
    def rejection_rate(self) -> float | None:
        """Rejections per tested position: each step's test stops at its one rejection, if any."""
        return (self.tested - self.accepted) / self.tested if self.tested else None

    def columns(self) -> dict:
        return {
            "alpha": self.alpha,
            "rejection_rate": self.rejection_rate,
            "mean_acceptance_length": 1.0 + self.accepted / self.steps if self.steps else None,
            "draft_acceptance_rate": self.accepted / self.drafted if self.drafted else None,
            "num_steps": self.steps,
            "num_draft_tokens": self.drafted,
            "num_accepted_draft_tokens": self.accepted,
            "generated_tokens": self.tokens,
            "acceptance_histogram": self.histogram.tolist(),
        }


def _log(msg: str) -> None:
    print(f"[raysd study] {msg}", file=sys.stderr, flush=True)


def time_ngram(batch_size: int, vocab: int, context: int = 128, reps: int = 3) -> float:
    """Seconds of one n-gram proposal (of one token) over batch_size histories."""
    drafter = NgramDrafter(vocab)
    g = torch.Generator().manual_seed(0)
    drafter.add_rows(torch.randint(3, vocab, (batch_size, context), generator=g).tolist())
    return median_time(lambda: drafter.propose([1] * batch_size, None, None), reps, torch.device("cpu"))


def run_requests(target, drafter: Drafter, prompts: Sequence[StudyPrompt], k: int, batch_size: int,
                 params: SamplingParams, eos: Sequence[int], acceptance: str = "exact") -> tuple[list[GenerationResult], SpecEngine]:
    """Every prompt once, cycled up to batch_size requests so that the batch is full."""
    speculation = SpeculationConfig(num_speculative_tokens=k, eos_token_ids=tuple(eos), acceptance=acceptance)
    engine = SpecEngine(target, drafter, EngineConfig(speculation, max_batch_size=batch_size))
    chosen = list(itertools.islice(itertools.cycle(prompts), max(len(prompts), batch_size)))
    reqs = [Request(i, p.token_ids, replace(params, seed=i)) for i, p in enumerate(chosen)]
    return engine.generate(reqs), engine


def entropy_by_task(target, prompts: Sequence[StudyPrompt], results: Sequence[GenerationResult],
                    temperature: float) -> dict[str, tuple[float, float]]:
    """(mu, mu2) of the target's distributions (at `temperature`, 1 when greedy) along the
    generated outputs, per task and "all" (theory.entropy_moments, weighted by positions)."""
    sums: dict[str, np.ndarray] = {}
    device = next(target.parameters()).device
    for p, r in zip(prompts, results):
        if not r.token_ids:
            continue
        ids = torch.tensor([list(p.token_ids) + r.token_ids], device=device)  # [1, L]
        with torch.inference_mode():
            logits = target(ids).logits[0, len(p.token_ids) - 1 : -1].float()  # [n, V] before each output token
        probs = torch.softmax(logits / (temperature or 1.0), dim=-1).cpu().numpy()
        mu, mu2 = theory.entropy_moments(probs)
        for task in (p.task, "all"):
            sums.setdefault(task, np.zeros(3))
            sums[task] += (mu * len(probs), mu2 * len(probs), len(probs))
    return {t: (s[0] / s[2], s[1] / s[2]) for t, s in sums.items()}


def run_study(target, drafters: dict[str, Callable[[], Drafter]], prompts: Sequence[StudyPrompt],
              cfg: StudyConfig, eos: Sequence[int] = (), labels: dict | None = None) -> list[dict]:
    """Profile, sweep, predict. `drafters` maps a name to a factory of fresh drafters."""
    vocab = target.get_output_embeddings().weight.shape[0]
    params = SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens, ignore_eos=cfg.ignore_eos)
    tasks = list(dict.fromkeys(p.task for p in prompts))

    # 1. Profile: T_target(B, K) for every profiled K, T_draft(B) per drafter.
    t_target, t_draft = {}, {}
    for B in cfg.batch_sizes:
        t_target[B] = time_forward(target, B, cfg.profile_ks, cfg.profile_context, cfg.profile_reps)
        for name, make in drafters.items():
            d = make()
            if isinstance(d, DraftModelDrafter):
                t_draft[name, B] = time_forward(d.rows.runner.model, B, [0], cfg.profile_context, cfg.profile_reps)[0]
            elif isinstance(d, NgramDrafter):
                t_draft[name, B] = time_ngram(B, vocab, cfg.profile_context, cfg.profile_reps)
            else:
                t_draft[name, B] = 0.0
        _log(f"profiled B={B}: T_target(K=0)={t_target[B][0] * 1e3:.1f} ms, "
             + ", ".join(f"T_draft[{n}]={t_draft[n, B] * 1e3:.2f} ms" for n in drafters))

    # 2. Measured sweep: the baseline (no drafter, K = 0) and every drafter at every K > 0.
    runs = [(BASELINE, 0, B) for B in cfg.batch_sizes]
    runs += [(name, k, B) for name in drafters for k in cfg.ks if k > 0 for B in cfg.batch_sizes]
    run_requests(target, NoDrafter(vocab), prompts[:2], 0, 2, replace(params, max_new_tokens=4), eos)  # warm-up
    measured: dict[tuple, dict] = {}
    entropy: dict[str, tuple[float, float]] = {}
    for name, k, B in runs:
        drafter = NoDrafter(vocab) if name == BASELINE else drafters[name]()
        results, engine = run_requests(target, drafter, prompts, k, B, params, eos,
                                       "exact" if name == BASELINE else cfg.acceptance)
        pools = {t: Pool(k) for t in ["all", *tasks]}
        for i, r in enumerate(results):
            pools["all"].add(r)
            pools[prompts[i % len(prompts)].task].add(r)
        tm = engine.timings
        tps = pools["all"].tokens / tm.wall_s
        measured[name, k, B] = {"pools": pools, "tokens_per_s": tps, "wall_s": tm.wall_s,
                                "t_target_step_s": tm.verify_s / tm.steps, "t_draft_step_s": tm.draft_s / tm.steps}
        if name == BASELINE and not entropy:
            entropy = entropy_by_task(target, prompts, results[: len(prompts)], cfg.temperature)
        _log(f"measured {name} K={k} B={B}: {tps:.1f} tok/s, mean acceptance length "
             f"{pools['all'].columns()['mean_acceptance_length']:.2f}")

    # 3. Acceptance per (drafter, task), pooled over the drafter's runs: what the theory is fed.
    alpha_task: dict[tuple[str, str], float | None] = {}
    reject_task: dict[tuple[str, str], float | None] = {}
    for name in drafters:
        for task in ["all", *tasks]:
            pooled = [m["pools"][task] for (n, k, B), m in measured.items() if n == name]
            tested = sum(p.tested for p in pooled)
            alpha_task[name, task] = sum(p.overlap for p in pooled) / tested if tested else None
            reject_task[name, task] = (tested - sum(p.accepted for p in pooled)) / tested if tested else None

    # 4. One row per (drafter, K, B, task): predictions for every profiled K, measurements where run.
    rows = []
    base_labels = dict(labels or {}, temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                       num_prompts=len(prompts))
    for name, B, task in itertools.product([BASELINE, *drafters], cfg.batch_sizes, ["all", *tasks]):
        ks = [0] if name == BASELINE else cfg.profile_ks
        a = 0.0 if name == BASELINE else alpha_task[name, task]
        td = 0.0 if name == BASELINE else t_draft[name, B]
        if name == BASELINE:  # drafts nothing: no TV, no rule to relax
            front = _front(None, "exact", None)
        else:
            front = _front(a, cfg.acceptance, reject_task[name, task])
        alpha_rule = a if front["alpha_rule"] is None else front["alpha_rule"]
        preds = {k: _predict(alpha_rule, k, t_target[B], td) for k in ks}
        best = {mode: max(ks, key=lambda k: (_nan0(preds[k][mode]), -k)) for mode in ("serial", "overlapped")}
        for k in ks:
            m = measured.get((name, k, B))
            row = dict(base_labels, drafter=name, k=k, batch_size=B, task=task, measured=m is not None, **front,
                       t_target_1_s=t_target[B][0], t_target_k_s=t_target[B][k], t_draft_s=td,
                       cost_ratio=td / t_target[B][0], alpha_task=a,
                       predicted_mean_acceptance_length=preds[k]["e"], predicted_speedup=preds[k]["serial"],
                       predicted_speedup_overlapped=preds[k]["overlapped"], predicted_speedup_leviathan=preds[k]["leviathan"],
                       predicted_best_k=best["serial"], predicted_best_k_overlapped=best["overlapped"])
            row.update(_measured_columns(m, task, measured.get((BASELINE, 0, B)), t_target[B], td, k))
            mu, mu2 = entropy.get(task, (None, None))
            row.update(entropy_mu=mu, entropy_mu2=mu2,
                       speed_of_light_bound=theory.speed_of_light_bound(mu, mu2, k + 1) if mu and k >= 1 else None)
            rows.append(row)
    return rows


def _front(alpha: float | None, rule: str, rejection_rate: float | None) -> dict:
    """The rule's columns: its LAMBDA, Yin et al.'s front at the measured TV(target, draft) = 1 - alpha
    (the rejection rate (1 - LAMBDA) TV and the output's TV to the target LAMBDA TV, per tested
    position: theory.relaxed_rule_point), the rejection rate measured over the same positions (all
    of the drafter's runs pooled), and the acceptance rate the rule gives, 1 - (1 - LAMBDA) TV."""
    lam = Acceptance.parse(rule).relax or 0.0
    cols = dict(acceptance=rule, relax_lambda=lam, tv_target_draft=None,
                front_rejection_rate=None, front_tv_to_target=None, measured_rejection_rate_task=rejection_rate,
                alpha_rule=alpha)
    if alpha is not None:
        tv = 1.0 - min(max(alpha, 0.0), 1.0)
        reject, loss = theory.relaxed_rule_point(tv, lam)
        cols.update(tv_target_draft=tv, front_rejection_rate=reject, front_tv_to_target=loss, alpha_rule=1.0 - reject)
    return cols


def _nan0(x: float | None) -> float:
    return -math.inf if x is None or math.isnan(x) else x


def _predict(alpha: float | None, k: int, t_target: dict[int, float], t_draft: float) -> dict:
    if alpha is None:
        return {"e": None, "serial": None, "overlapped": None, "leviathan": None}
    e = theory.expected_tokens_per_step(alpha, k)
    t1, tk = t_target[0], t_target[k]
    return {"e": e, "serial": theory.serial_speedup(e, t1, tk, t_draft, k),
            "overlapped": theory.overlapped_speedup(e, t1, tk, t_draft, k),
            "leviathan": theory.expected_walltime_improvement(alpha, k, t_draft / t1)}


def _measured_columns(m: dict | None, task: str, base: dict | None, t_target: dict[int, float], t_draft: float, k: int) -> dict:
    keys = ["alpha", "rejection_rate", "mean_acceptance_length", "draft_acceptance_rate", "num_steps", "num_draft_tokens",
            "num_accepted_draft_tokens", "generated_tokens", "acceptance_histogram", "measured_tokens_per_s",
            "measured_speedup", "predicted_speedup_measured_e", "wall_s", "measured_t_target_step_s", "measured_t_draft_step_s"]
    if m is None:
        return dict.fromkeys(keys)
    cols = m["pools"][task].columns()
    e = cols["mean_acceptance_length"]
    pooled = task == "all"  # throughput belongs to the whole batch, not to one task in it
    cols.update(
        measured_tokens_per_s=m["tokens_per_s"] if pooled else None,
        measured_speedup=m["tokens_per_s"] / base["tokens_per_s"] if pooled and base else None,
        predicted_speedup_measured_e=theory.serial_speedup(e, t_target[0], t_target[k], t_draft, k) if e else None,
        wall_s=m["wall_s"] if pooled else None,
        measured_t_target_step_s=m["t_target_step_s"] if pooled else None,
        measured_t_draft_step_s=m["t_draft_step_s"] if pooled else None,
    )
    return cols
