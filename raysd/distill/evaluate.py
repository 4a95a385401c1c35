"""Measure a draft against its target: acceptance per task, draft step cost, and the
end-to-end speedup of SpecEngine with the draft over SpecEngine with NoDrafter
(greedy, same prompts; the outputs are asserted token-identical)."""

from __future__ import annotations

import time
from typing import Sequence

import torch

from raysd.core.sampling import SamplingParams
from raysd.core.speculation import SpeculationConfig
from raysd.engine.drafters import DraftModelDrafter, NoDrafter
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.requests import Request
from raysd.models.dynamic_runner import DynamicRunner
from raysd.models.loading import eos_token_ids


class _Stepper:
    """Single-token decode steps of one model through raysd's DynamicRunner, after a prefill."""

    def __init__(self, model, context: Sequence[int], batch_size: int):
        self.runner = DynamicRunner(model)
        self.runner.add_rows(batch_size)
        ids = torch.tensor([list(context)] * batch_size, dtype=torch.int64)
        self.ones = torch.ones(batch_size, dtype=torch.int64)
        with torch.inference_mode():
            self.runner.forward(ids, torch.ones_like(ids, dtype=torch.bool), self.ones)
        self.tok = torch.zeros(batch_size, 1, dtype=torch.int64)
        self.valid = torch.ones(batch_size, 1, dtype=torch.bool)
        self.length = len(context)

    @torch.inference_mode()
    def time(self, steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            self.tok = self.runner.forward(self.tok, self.valid, self.ones)[:, -1].argmax(-1, keepdim=True)
        seconds = (time.perf_counter() - start) / steps
        self.runner.rollback(torch.full_like(self.ones, self.length))  # back to the prefill: same context each round
        return seconds


def step_costs(models: Sequence, context: Sequence[int], batch_size: int = 1, steps: int = 16, rounds: int = 7) -> list[float]:
    """Seconds per decode step of each model, interleaved over `rounds` and the fastest round kept,
    so that a busy machine slows every model alike and the ratio stays meaningful."""
    steppers = [_Stepper(m, context, batch_size) for m in models]
    for s in steppers:
        s.time(3)  # warm up
    best = [float("inf")] * len(models)
    for _ in range(rounds):
        for i, s in enumerate(steppers):
            best[i] = min(best[i], s.time(steps))
    return best


def _run(target, drafter, prompts, k, batch_size, max_new_tokens):
    speculation = SpeculationConfig(num_speculative_tokens=k, eos_token_ids=eos_token_ids(target))
    engine = SpecEngine(target, drafter, EngineConfig(speculation, max_batch_size=batch_size))
    reqs = [Request(i, p, SamplingParams(max_new_tokens=max_new_tokens)) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    results = engine.generate(reqs)
    return results, time.perf_counter() - start, engine.timings


def evaluate_draft(
    target,
    draft,
    prompts: Sequence[Sequence[int]],
    tasks: Sequence[str],
    *,
    num_speculative_tokens: int = 4,
    batch_sizes: Sequence[int] = (1, 8),
    max_new_tokens: int = 64,
    log=None,
    reference_out: dict | None = None,
) -> dict:
    """Greedy generation of every prompt with NoDrafter and with the draft, at each batch size.
    `reference_out`, if given, receives {batch size: the target-alone token ids} to check other runs against."""
    V = target.get_output_embeddings().weight.shape[0]
    ctx = list(prompts[0])
    report: dict = {"num_prompts": len(prompts), "max_new_tokens": max_new_tokens,
                    "num_speculative_tokens": num_speculative_tokens, "threads": torch.get_num_threads()}
    t_target, t_draft = step_costs([target, draft], ctx)
    report["target_step_s"], report["draft_step_s"] = t_target, t_draft
    report["draft_step_cost"] = t_draft / t_target
    report["step_cost_context_tokens"] = len(ctx)
    if 8 in batch_sizes:
        t8_target, t8_draft = step_costs([target, draft], ctx, batch_size=8, rounds=3)
        report["target_step_s_batch8"], report["draft_step_s_batch8"] = t8_target, t8_draft
        report["draft_step_cost_batch8"] = t8_draft / t8_target
    report["by_batch"] = {}
    for bs in batch_sizes:
        base, base_s, _ = _run(target, NoDrafter(V), prompts, 0, bs, max_new_tokens)
        spec, spec_s, timings = _run(target, DraftModelDrafter(draft, V), prompts, num_speculative_tokens, bs, max_new_tokens)
        mismatch = [i for i, (a, b) in enumerate(zip(base, spec)) if a.token_ids != b.token_ids]
        if mismatch:
            raise AssertionError(f"batch {bs}: outputs differ from the target's for prompts {mismatch}")
        tokens = sum(len(r.token_ids) for r in base)
        if reference_out is not None:
            reference_out[bs] = [r.token_ids for r in base]
        per_task: dict[str, dict] = {}
        for task, r in zip(tasks, spec):
            s = per_task.setdefault(task, {"overlap": 0.0, "tested": 0, "drafted": 0, "accepted": 0, "steps": 0})
            s["overlap"] += r.stats.overlap_sum
            s["tested"] += r.stats.num_tested_positions
            s["drafted"] += r.stats.num_draft_tokens
            s["accepted"] += r.stats.num_accepted_draft_tokens
            s["steps"] += r.stats.num_spec_steps
        alpha = {t: s["overlap"] / max(1, s["tested"]) for t, s in per_task.items()}
        entry = {
            "tokens": tokens, "target_only_s": base_s, "spec_s": spec_s, "speedup": base_s / spec_s,
            "draft_s": timings.draft_s, "verify_s": timings.verify_s,
            "alpha_by_task": alpha, "alpha_mean_over_tasks": sum(alpha.values()) / len(alpha),
            "acceptance_rate_by_task": {t: s["accepted"] / max(1, s["drafted"]) for t, s in per_task.items()},
            "mean_acceptance_length_by_task": {t: 1 + s["accepted"] / max(1, s["steps"]) for t, s in per_task.items()},
            "token_identical": True,
        }
        report["by_batch"][str(bs)] = entry
        if log:
            log(f"batch {bs}: {tokens} tokens, target alone {base_s:.1f} s, with draft {spec_s:.1f} s "
                f"({entry['speedup']:.2f}x), alpha {entry['alpha_mean_over_tasks']:.3f}; outputs identical")
    return report


def format_report(report: dict) -> str:
    """A markdown summary of evaluate_draft's result."""
    lines = [f"draft step {report['draft_step_s'] * 1e3:.1f} ms, target step {report['target_step_s'] * 1e3:.1f} ms "
             f"(cost ratio {report['draft_step_cost']:.3f}); K = {report['num_speculative_tokens']}, "
             f"{report['num_prompts']} prompts, max {report['max_new_tokens']} new tokens", ""]
    batches = list(report["by_batch"])
    tasks = list(report["by_batch"][batches[0]]["alpha_by_task"])
    lines.append("| task | " + " | ".join(f"alpha (T=0), batch {b}" for b in batches) + " | mean accepted length |")
    lines.append("| --- | " + " | ".join("---" for _ in batches) + " | --- |")
    for t in tasks:
        e0 = report["by_batch"][batches[0]]
        lines.append(f"| {t} | " + " | ".join(f"{report['by_batch'][b]['alpha_by_task'][t]:.3f}" for b in batches)
                     + f" | {e0['mean_acceptance_length_by_task'][t]:.2f} |")
    lines.append("| **mean over tasks** | " + " | ".join(f"**{report['by_batch'][b]['alpha_mean_over_tasks']:.3f}**" for b in batches) + " | |")
    lines.append("")
    lines.append("| batch | tokens | target alone (s) | with draft (s) | speedup |")
    lines.append("| --- | --- | --- | --- | --- |")
    for b in batches:
        e = report["by_batch"][b]
        lines.append(f"| {b} | {e['tokens']} | {e['target_only_s']:.1f} | {e['spec_s']:.1f} | {e['speedup']:.2f}x |")
    return "\n".join(lines)
