"""Issue 20 item 2: hierarchical speculation (n-gram -> draft model -> target) against the best
two-level pair (draft model -> target), on this CPU.

SmolLM2-135M-Instruct (fp32) as the target, its shipped distilled draft (smollm2-135m-instruct-draft)
as the middle level, n-gram prompt lookup drafting for the draft (raysd.engine.hierarchy). Spec-Bench
first turns with the chat template, `--per-task` per task, round-robin over the 6 tasks, fixed-length
outputs (ignore_eos), one SpecEngine batch of `--batch` rows, greedy (T = 0) and T = 1 (seed =
prompt index), one torch thread.

Configurations, each timed `--repeats` times, interleaved (medians):
  two:K          DraftModelDrafter, fixed K in --ks
  two:auto       DraftModelDrafter, -k auto (KController on profiled step costs)
  three:K/k      AssistedDraftModelDrafter, top K fixed, inner k fixed
  three:K/auto   top K fixed, inner k chosen by goodput on the draft model's profiled costs
  three:auto/auto both chosen by goodput
Greedy rows of every configuration must give the same tokens (checked).

Reported: decode tokens/s (wall minus the prompt forwards), tokens per target pass, seconds per
step in the drafter and the target, and for three levels the middle level's counters (tokens per
draft forward per row, the draft model's acceptance of the lookup's drafts, mean inner k), beside
theory's predictions: expected_tokens_per_step(alpha, K) from the measured alpha_estimate for the
top level, expected_tokens_per_step(alpha_in, k) for the middle one, and the serial step-time model
T_target(K + 1) + (K / E_in) T_draft(k + 1) from the profiled costs.

    python bench/hierarchy_bench.py             # the documented run (docs/hierarchy.md)
    python bench/hierarchy_bench.py --quick     # smoke test
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import load_prompts, loadavg, machine, median  # noqa: E402
from raysd.core.sampling import SamplingParams  # noqa: E402
from raysd.core.theory import expected_tokens_per_step  # noqa: E402
from raysd.engine.adaptive import AdaptiveConfig, profile_step_costs  # noqa: E402
from raysd.engine.drafters import DraftModelDrafter  # noqa: E402
from raysd.engine.engine import EngineConfig, SpecEngine  # noqa: E402
from raysd.engine.hierarchy import AssistedDraftModelDrafter, profile_inner_costs  # noqa: E402
from raysd.engine.rows import Request  # noqa: E402
from raysd.models.loading import DEFAULT_MODEL, ModelSpec, eos_token_ids, load_model, load_tokenizer  # noqa: E402

DRAFT = "smollm2-135m-instruct-draft"


def run(target, make_drafter, prompts, k, T, batch, max_new, eos, adaptive=None):
    drafter = make_drafter()
    engine = SpecEngine(target, drafter, EngineConfig(k, batch, eos, adaptive=adaptive))
    reqs = [Request(i, p["ids"], SamplingParams(temperature=T, seed=i, max_new_tokens=max_new, ignore_eos=True))
            for i, p in enumerate(prompts)]
    start = time.perf_counter()
    with torch.inference_mode():
        results = engine.generate(reqs)
    wall = time.perf_counter() - start
    s = [r.stats for r in results]
    tokens = sum(len(r.token_ids) for r in results)
    passes = sum(x.num_spec_steps for x in s)
    tested = sum(x.num_tested_positions for x in s)
    t = engine.timings
    row = {"tok_s": tokens / (wall - t.prefill_s), "wall_s": wall, "tokens": tokens, "passes": passes,
           "tokens_per_pass": tokens / passes, "alpha": sum(x.overlap_sum for x in s) / tested if tested else None,
           "mean_k": sum(x.speculation_length_sum for x in s) / passes,
           "draft_s_per_step": t.draft_s / t.steps, "target_s_per_step": t.target_s / t.steps}
    inner = getattr(drafter, "inner_stats", None)
    if inner is not None:
        row["inner"] = inner.to_dict()
        del row["inner"]["proposals"]
    return row, [r.token_ids for r in results]


def predict(result: dict) -> None:
    """Add theory's step time and tokens/s to every row, from the profiled step costs (in place):
    two levels T_target(B, K + 1) + K T_draft(B); three levels T_target(B, K + 1) + (K / E_in)
    T_draft(B, k + 1), E_in = expected_tokens_per_step(alpha_in, k) draft tokens per middle step;
    tokens/s = B expected_tokens_per_step(alpha, K) / step time, at the measured alpha, mean K and k."""
    from raysd.engine.adaptive import StepCosts

    sc, ic = result["step_costs"], result["inner_step_costs"]
    costs = StepCosts(tuple(sc["batch_sizes"]), tuple(map(tuple, sc["target_s"])), tuple(sc["draft_s"]))
    inner = StepCosts(tuple(ic["batch_sizes"]), tuple(map(tuple, ic["draft_s"])), tuple(0.0 for _ in ic["batch_sizes"]))
    B = result["args"]["batch"]
    for r in result["rows"]:
        if r["alpha"] is None or r["mean_k"] <= 0:
            continue
        K = min(round(r["mean_k"]), costs.k_max)
        draft = K * costs.draft(B)
        i = r.get("inner")
        if i and i["inner_acceptance_rate"] is not None and round(i["mean_inner_k"]) > 0:
            k = min(round(i["mean_inner_k"]), inner.k_max)
            draft = K / expected_tokens_per_step(i["inner_acceptance_rate"], k) * inner.target(B, k)
        step = costs.target(B, K) + draft
        r["predicted_step_s"] = step
        r["predicted_tok_s"] = B * expected_tokens_per_step(min(max(r["alpha"], 0.0), 1.0), K) / step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-task", type=int, default=1, help="Spec-Bench prompts per task (6 tasks)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=6)
    ap.add_argument("--ks", default="2,4", help="top-level K of the two-level runs")
    ap.add_argument("--three", default="4/2,4/auto,auto/auto", help="top K / inner k of the three-level runs")
    ap.add_argument("--k-max", type=int, default=8, help="the largest K under auto")
    ap.add_argument("--inner-k-max", type=int, default=4, help="the largest inner k under auto")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "hierarchy_bench.json"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--predict-only", action="store_true", help="add theory's predictions to an existing --out and exit")
    a = ap.parse_args(argv)
    if a.predict_only:
        result = json.loads(Path(a.out).read_text())
        predict(result)
        Path(a.out).write_text(json.dumps(result, indent=1))
        for r in result["rows"]:
            print(r["T"], r["config"], round(r["tok_s"], 2), round(r.get("predicted_tok_s") or 0, 2))
        return 0
    if a.quick:
        a.per_task, a.max_new_tokens, a.batch, a.ks, a.three, a.repeats = 1, 12, 6, "4", "4/2,4/auto", 1
        a.out = "/tmp/hierarchy_bench_quick.json"
    torch.set_num_threads(a.threads)
    tok = load_tokenizer(DEFAULT_MODEL)
    target = load_model(ModelSpec(DEFAULT_MODEL))
    draft = load_model(ModelSpec(DRAFT))
    vocab = target.get_output_embeddings().weight.shape[0]
    prompts = load_prompts(tok, a.per_task)
    eos = eos_token_ids(target)
    uptime_start = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    t0 = time.perf_counter()
    sizes = sorted({1, a.batch})
    with torch.inference_mode():
        costs = profile_step_costs(target, draft, k_max=a.k_max, batch_sizes=sizes, context=128, reps=3)
        inner_costs = profile_inner_costs(draft, a.inner_k_max, sizes, context=128, reps=3)
    profile_s = time.perf_counter() - t0
    top_auto, inner_auto = AdaptiveConfig(costs), AdaptiveConfig(inner_costs)

    configs = {f"two:{k}": (lambda: DraftModelDrafter(draft, vocab), k, None) for k in (int(x) for x in a.ks.split(","))}
    configs["two:auto"] = (lambda: DraftModelDrafter(draft, vocab), a.k_max, top_auto)
    for spec in a.three.split(","):
        top, inner = spec.split("/")
        k_in = a.inner_k_max if inner == "auto" else int(inner)
        make = (lambda k_in=k_in, adapt=(inner_auto if inner == "auto" else None):
                AssistedDraftModelDrafter(draft, vocab, inner_k=k_in, inner_adaptive=adapt))
        configs[f"three:{spec}"] = (make, a.k_max if top == "auto" else int(top), top_auto if top == "auto" else None)

    def save(rows, partial):
        """The results so far (after each temperature: a long run interrupted keeps its first half)."""
        result = {"command": "python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
                  "machine": machine(), "uptime": [uptime_start, subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()],
                  "args": vars(a), "profile_s": profile_s, "prompts": len(prompts), "partial": partial,
                  "step_costs": {"batch_sizes": costs.batch_sizes, "target_s": costs.target_s, "draft_s": costs.draft_s},
                  "inner_step_costs": {"batch_sizes": inner_costs.batch_sizes, "draft_s": inner_costs.target_s},
                  "rows": rows}
        predict(result)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
        return result

    rows = []
    for T in (0.0, 1.0):
        load = loadavg()
        runs: dict = {name: [] for name in configs}
        reference = None
        for _ in range(a.repeats):  # interleaved, so drifts in machine load hit every configuration alike
            for name, (make, k, adapt) in configs.items():
                row, tokens = run(target, make, prompts, k, T, a.batch, a.max_new_tokens, eos, adapt)
                if T == 0.0:
                    reference = tokens if reference is None else reference
                    assert tokens == reference, f"{name}: greedy tokens differ"
                runs[name].append(row)
                print(json.dumps({"T": T, "config": name, **row}), flush=True)
        for name, rs in runs.items():
            last = rs[-1]
            out = {"T": T, "config": name, "levels": 3 if name.startswith("three") else 2,
                   "tok_s": median([r["tok_s"] for r in rs]), "tok_s_runs": [r["tok_s"] for r in rs],
                   **{key: last[key] for key in ("tokens_per_pass", "alpha", "mean_k", "passes", "tokens")},
                   "draft_s_per_step": median([r["draft_s_per_step"] for r in rs]),
                   "target_s_per_step": median([r["target_s_per_step"] for r in rs]), "loadavg": [load, loadavg()]}
            # Theory: tokens per target pass at the measured alpha and mean K (fixed K: exact formula).
            if last["alpha"] is not None and last["mean_k"] > 0:
                out["predicted_tokens_per_pass"] = expected_tokens_per_step(min(max(last["alpha"], 0.0), 1.0),
                                                                            round(last["mean_k"]))
            if "inner" in last:
                inner = last["inner"]
                out["inner"] = inner
                if inner["inner_acceptance_rate"] is not None and inner["mean_inner_k"] > 0:
                    # The middle level's own tokens per draft forward, at its measured acceptance and mean k.
                    out["predicted_tokens_per_middle_step"] = expected_tokens_per_step(
                        inner["inner_acceptance_rate"], round(inner["mean_inner_k"]))
            rows.append(out)
        best_two = max((r for r in rows if r["T"] == T and r["levels"] == 2), key=lambda r: r["tok_s"])
        best_three = max((r for r in rows if r["T"] == T and r["levels"] == 3), key=lambda r: r["tok_s"])
        print(json.dumps({"T": T, "best_two": best_two["config"], "best_two_tok_s": best_two["tok_s"],
                          "best_three": best_three["config"], "best_three_tok_s": best_three["tok_s"],
                          "three_vs_two": best_three["tok_s"] / best_two["tok_s"]}), flush=True)
        save(rows, partial=T == 0.0)


    save(rows, partial=False)
    for r in rows:  # the table of docs/benchmarks.md, Benchmark 8
        i = r.get("inner") or {}
        acc = i.get("inner_acceptance_rate")
        print(f"| {r['T']:g} | {r['config']} | {r['tok_s']:.1f} | {r['mean_k']:.2f} | {r['tokens_per_pass']:.2f} | "
              f"{r['draft_s_per_step'] / r['target_s_per_step']:.2f} | {i.get('tokens_per_middle_step', 1.0):.2f} | "
              f"{'-' if acc is None else round(acc, 3)} | {i.get('mean_inner_k', 0.0):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
