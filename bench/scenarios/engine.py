"""engine: the single-process SpecEngine over a grid of drafters, K, draft trees, acceptance
rules, batch sizes and temperatures, against its own plain decoding and Hugging Face `generate`.

One process, the target (default the embedded SmolLM2-135M-Instruct) loaded once, Spec-Bench
prompts (bench.workload), fixed-length outputs unless --stop-at-eos. Per batch size B and
temperature T the variants are:
    plain, B=b[, T=t]      the engine with NoDrafter (K = 0): every ratio's baseline
    HF generate, B=b       Hugging Face `generate`, greedy (T = 0 and B in --hf-batch-sizes)
    DRAFTER K=k [P=p] [ACCEPTANCE] [LINEARS linears], B=b[, T=t]
                           for every drafter (bench.models), K (a number, or `auto`: K, and the tree,
                           chosen each step by goodput from step costs profiled here once per drafter,
                           recorded under extra.step_costs), tree budget P, acceptance rule, linear kernels
Combinations the engine refuses (a tree with a lossy rule, a tree over draft+ngram) are left out.
Each variant's figures are bench.measure's; the engine's own timings (prefill, draft and verify
seconds, steps, occupancy, the mean K offered) come beside them.

Checked: at T = 0, every exact variant's tokens equal plain decoding's at the same B, row for
row (float32; in bfloat16 near-ties may differ, so the check is recorded, not enforced).

The old scripts' runs, on this scenario:
    python -m bench run engine                                   # drafters, fixed K and auto (engine_bench)
    python -m bench run engine --drafters none,eagle --ks 1,2,3 --prompt-set heldout --per-task 2  # eagle_bench
    python -m bench run engine --drafters none,draft --ks 3,auto --prompt-set heldout --per-task 4 \\
        --max-new-tokens 64                                      # distill_eval
    python -m bench run engine --drafters none,draft --ks 3 --linear-kernels auto,stock --hf-batch-sizes 1,8,32 \\
        --batch-sizes 1,8,32                                      # fastpath_bench (AR vs HF, packed kernels)
The presets adaptive, tree, relaxed and draft_assist (bench.registry) are this scenario with
other defaults.
"""

from __future__ import annotations

import argparse
import functools
import time
import warnings
from dataclasses import dataclass

import torch

from bench.harness import Outcome, Variant, run_variants
from bench.hf import hf_generate
from bench.measure import Counts, figures
from bench.models import ASSISTED, Models
from bench.workload import add_workload_arguments, describe, int_list, k_list, load_prompts, str_list

QUICK = {"prompt_set": "shortest", "per_task": 1, "max_new_tokens": 8, "batch_sizes": [1, 2], "repeats": 1, "auto_k_max": 4,
         "profile_reps": 1}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_arguments(p)
    g = p.add_argument_group("engine")
    g.add_argument("--target", default="smollm2-135m-instruct")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    g.add_argument("--drafters", type=str_list, default=str_list("none,ngram,draft,eagle"),
                   help="none, ngram, draft, eagle, draft+ngram, or a model name/path (bench.models)")
    g.add_argument("--ks", type=k_list, default=k_list("3,auto"), help="K per drafter: numbers and/or auto")
    g.add_argument("--auto-k-max", type=int, default=8, help="the largest K (a tree's depth) under auto")
    g.add_argument("--tree-budgets", type=int_list, default=[0], help="P per drafter (0: a chain)")
    g.add_argument("--acceptances", type=str_list, default=["exact"], help="exact, relaxed:LAMBDA, synthetic:RATE")
    g.add_argument("--temperatures", type=lambda s: [float(x) for x in str_list(s)], default=[0.0])
    g.add_argument("--linear-kernels", type=str_list, default=["auto"], help="auto, packed, stock (raysd.models.linear)")
    g.add_argument("--hf-batch-sizes", type=int_list, default=[1], help="batch sizes of the HF generate baseline ('' for none)")
    g.add_argument("--profile-reps", type=int, default=2, help="repeats of each step-cost timing (auto K, profiled)")
    g.add_argument("--auto-costs", choices=("learned", "profiled"), default="learned",
                   help="auto K's step costs: learned from the run's own steps, as a job does (raysd.engine.adaptive."
                        "LearnedStepCosts), or profiled once beforehand")


@dataclass(frozen=True)
class Spec:
    drafter: str
    k: int | str
    tree_budget: int
    acceptance: str
    kernels: str
    batch: int
    temperature: float

    @property
    def tail(self) -> str:
        return f", B={self.batch}" + (f", T={self.temperature:g}" if self.temperature else "")

    @property
    def name(self) -> str:
        if self.drafter == "none":
            head = "plain"
        else:
            head = f"{self.drafter} K={self.k}" + (f" P={self.tree_budget}" if self.tree_budget else "")
            head += "" if self.acceptance == "exact" else f" {self.acceptance}"
        return head + ("" if self.kernels == "auto" else f" {self.kernels} linears") + self.tail


def specs(a) -> list[Spec]:
    out = []
    for B in a.batch_sizes:
        for T in a.temperatures:
            out.append(Spec("none", 0, 0, "exact", "auto", B, T))
            for d in a.drafters:
                for kern in a.linear_kernels:
                    if d == "none":
                        if kern != "auto":
                            out.append(Spec("none", 0, 0, "exact", kern, B, T))
                        continue
                    for k in a.ks:
                        for P in a.tree_budgets:
                            for acc in a.acceptances:
                                if P and (acc != "exact" or d == ASSISTED or k == 0):
                                    continue
                                out.append(Spec(d, k, P, acc, kern, B, T))
    return list(dict.fromkeys(out))


def engine_run(models: Models, s: Spec, prompts: list[dict], a, costs) -> dict:
    from raysd.core.sampling import SamplingParams
    from raysd.core.speculation import AdaptiveConfig, SpeculationConfig
    from raysd.engine.engine import EngineConfig, SpecEngine
    from raysd.engine.requests import Request

    auto = s.k == "auto"
    K = a.auto_k_max if auto else s.k
    spec = SpeculationConfig(K, s.tree_budget, s.acceptance, AdaptiveConfig(costs) if auto else None, models.eos)  # costs None: learned
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the lossy/synthetic warnings: the variant's name says so
        engine = SpecEngine(models.target, models.drafter(s.drafter, tuple(a.batch_sizes)),
                            EngineConfig(spec, max_batch_size=s.batch, linear_kernels=s.kernels))
    params = [SamplingParams(temperature=s.temperature, seed=i, max_new_tokens=a.max_new_tokens, ignore_eos=not a.stop_at_eos)
              for i in range(len(prompts))]
    requests = [Request(i, p["ids"], params[i]) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    with torch.inference_mode():
        results = engine.generate(requests)
    wall = time.perf_counter() - start
    t = engine.timings
    offered = sum(r.stats.speculation_length_sum for r in results)
    passes = sum(r.stats.num_spec_steps for r in results)
    return figures(Counts.of_results(results), wall, timed="SpecEngine.generate", prefill_s=t.prefill_s,
                   draft_s=t.draft_s, verify_s=t.verify_s, steps=t.steps,
                   occupancy=t.row_steps / (t.steps * s.batch) if t.steps else None,
                   mean_k_offered=offered / passes if passes else None,
                   error_rows=sum(r.finish_reason == "error" for r in results), _tokens=[r.token_ids for r in results])


def step_costs(models: Models, a, log) -> dict:
    """StepCosts per drafter that runs `auto`, profiled once on this machine (K up to max(auto K, P))."""
    from raysd.models.profile import profile_step_costs

    if "auto" not in a.ks or a.auto_costs == "learned":
        return {}
    out = {}
    k_max = max([a.auto_k_max, *a.tree_budgets])
    for d in a.drafters:
        if d != "none":
            timed = models.timed_draft(d)  # loaded outside inference mode: the packed kernels track weight versions
            start = time.perf_counter()
            with torch.inference_mode():
                out[d] = profile_step_costs(models.target, timed, k_max, sorted(set(a.batch_sizes)), context=64,
                                            reps=a.profile_reps)
            log(f"step costs for {d}: profiled in {time.perf_counter() - start:.1f} s")
    return out


def run(a, log=print) -> Outcome:
    torch.manual_seed(0)
    models = Models(a.target, a.dtype)
    prompts = load_prompts(models.tokenizer, a.per_task, a.prompt_set, a.prompts_file, a.max_prompts)
    costs = step_costs(models, a, log)
    warm = prompts[:2]
    variants, plain = [], {}
    for s in specs(a):
        base = Spec("none", 0, 0, "exact", "auto", s.batch, s.temperature)
        short = argparse.Namespace(**{**vars(a), "max_new_tokens": 4})
        variants.append(Variant(s.name, vars(s), lambda s=s: engine_run(models, s, prompts, a, costs.get(s.drafter)),
                                None if s == base else base.name,
                                lambda s=s: engine_run(models, s, warm, short, costs.get(s.drafter))))
        plain.setdefault((s.batch, s.temperature), base.name)
    pad = models.tokenizer.pad_token_id if models.tokenizer.pad_token_id is not None else models.eos[0]
    for B in a.hf_batch_sizes:
        if 0.0 in a.temperatures:
            run_hf = functools.partial(hf_generate, models.target, prompts, B, a.max_new_tokens, pad, models.eos, a.stop_at_eos)
            variants.append(Variant(f"HF generate, B={B}", {"hf_generate": True, "batch": B, "temperature": 0.0}, run_hf,
                                    plain.get((B, 0.0)), lambda B=B: hf_generate(models.target, warm, B, 4, pad)))
    summaries, runs = run_variants(variants, a.repeats, log=log)
    checks = greedy_check(variants, runs, a.dtype)
    extra = {"prompts": describe(prompts), "target": a.target, "dtype": a.dtype,
             "step_costs": {d: {"batch_sizes": c.batch_sizes, "target_s": c.target_s, "draft_s": c.draft_s}
                            for d, c in costs.items()}}
    return Outcome(summaries, extra, checks)


def greedy_check(variants: list[Variant], runs: dict, dtype: str) -> dict:
    """At T = 0, the rows of every exact engine variant against plain decoding's (first repeat)."""
    same, bad = {}, []
    for v in variants:
        st = v.settings
        if not v.baseline or st.get("temperature") or st.get("acceptance", "exact") != "exact":
            continue
        mine, ref = runs[v.name][0]["_tokens"], runs[v.baseline][0]["_tokens"]
        equal = sum(x == y for x, y in zip(mine, ref))
        same[v.name] = f"{equal}/{len(ref)}"
        if equal != len(ref) and not st.get("hf_generate"):
            bad.append(v.name)
    return {"greedy_rows_equal_plain": {"ok": not bad or dtype != "float32", "enforced": dtype == "float32",
                                        "mismatched": bad, "rows_equal": same}}
