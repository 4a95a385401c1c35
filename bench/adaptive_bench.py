"""Adaptive speculation length (issue 9): auto vs the best fixed K vs plain decoding.

For each batch size, the same Spec-Bench prompts (first turns, chat template, greedy)
run through SpecEngine with: plain decoding (NoDrafter), every fixed K in --ks, and
--num-speculative-tokens auto (K in 0..max(ks) chosen each step from step costs
profiled once at start-up). Every configuration's tokens must equal plain decoding's.

    python bench/adaptive_bench.py                      # the documented run
    python bench/adaptive_bench.py --quick              # smoke test, < 1 minute
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import bf16_copy, load_prompts, loadavg, machine, median  # noqa: E402
from raysd.core.sampling import SamplingParams  # noqa: E402
from raysd.engine.adaptive import AdaptiveConfig, profile_step_costs  # noqa: E402
from raysd.engine.drafters import DraftModelDrafter, NgramDrafter, NoDrafter  # noqa: E402
from raysd.engine.engine import EngineConfig, SpecEngine  # noqa: E402
from raysd.engine.rows import Request  # noqa: E402
from raysd.models.loading import DEFAULT_MODEL, ModelSpec, eos_token_ids, load_model, load_tokenizer  # noqa: E402


def run(target, make_drafter, prompts, k, batch, max_new, adaptive=None):
    engine = SpecEngine(target, make_drafter(), EngineConfig(k, batch, eos_token_ids(target), adaptive=adaptive))
    reqs = [Request(p["question_id"], p["ids"], SamplingParams(max_new_tokens=max_new)) for p in prompts]
    start = time.perf_counter()
    results = engine.generate(reqs)
    wall = time.perf_counter() - start
    tokens = sum(len(r.token_ids) for r in results)
    mean_k = sum(r.stats.speculation_length_sum for r in results) / max(1, sum(r.stats.num_spec_steps for r in results))
    decode_s = wall - engine.timings.prefill_s  # prompt forwards are the same work whatever K is
    return {"tokens_per_s": tokens / decode_s, "e2e_tokens_per_s": tokens / wall, "wall_s": wall, "decode_s": decode_s,
            "tokens": tokens, "mean_k": mean_k}, [r.token_ids for r in results]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,8,32,64")
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("--draft", choices=["ngram", "bf16"], default="ngram")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--min-prompts", type=int, default=6, help="prompts per batch size: max(batch, this)")
    ap.add_argument("--out", default="bench/results/adaptive_bench.json")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a busy 2-core machine)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (medians reported)")
    ap.add_argument("--fixed-repeats", type=int, default=None,
                    help="timed runs of each fixed K (default: --repeats; 0: plain vs auto only, K in 0..max(--ks))")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.batch_sizes, args.ks, args.max_new_tokens, args.min_prompts, args.repeats = "1,4", "2,4", 8, 2, 1
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    ks = [int(x) for x in args.ks.split(",")]
    torch.set_num_threads(args.threads)
    target = load_model(ModelSpec(DEFAULT_MODEL))
    tok = load_tokenizer(DEFAULT_MODEL)
    vocab = target.get_output_embeddings().weight.shape[0]
    draft_model = bf16_copy(target) if args.draft == "bf16" else None
    make = (lambda: DraftModelDrafter(draft_model, vocab)) if draft_model is not None else (lambda: NgramDrafter(vocab))
    per_task = -(-max(max(sizes), args.min_prompts) // 6)
    all_prompts = load_prompts(tok, per_task)

    t0 = time.perf_counter()
    costs = profile_step_costs(target, draft_model, k_max=max(ks), batch_sizes=sizes, context=128, reps=3)
    profile_s = time.perf_counter() - t0
    adaptive = AdaptiveConfig(costs)
    rows = []
    for B in sizes:
        prompts = all_prompts[: max(B, args.min_prompts)]
        load = loadavg()
        fixed_repeats = args.repeats if args.fixed_repeats is None else args.fixed_repeats
        configs = {"plain": (lambda: NoDrafter(vocab), 0, None), **{k: (make, k, None) for k in ks},
                   "auto": (make, max(ks), adaptive)}
        timings: dict = {name: [] for name in configs}
        reference = None
        for rep in range(args.repeats):  # interleaved, so drifts in machine load hit every config alike
            for name, (drafter, k, adapt) in configs.items():
                if name not in ("plain", "auto") and rep >= fixed_repeats:
                    continue
                result, tokens = run(target, drafter, prompts, k, B, args.max_new_tokens, adapt)
                reference = tokens if reference is None else reference
                assert tokens == reference, f"{name} B={B}: tokens differ from plain decoding"
                timings[name].append(result)
        med = {name: {"tokens_per_s": median([r["tokens_per_s"] for r in rs]),
                      "e2e_tokens_per_s": median([r["e2e_tokens_per_s"] for r in rs]), "mean_k": rs[-1]["mean_k"]}
               for name, rs in timings.items() if rs}
        plain, auto, fixed = med["plain"], med["auto"], {k: med[k] for k in ks if k in med}
        row = {
            "batch_size": B, "prompts": len(prompts), "repeats": args.repeats, "fixed_repeats": fixed_repeats,
            "loadavg": [load, loadavg()], "plain_tok_s": plain["tokens_per_s"],
            **{f"k{k}_tok_s": fixed[k]["tokens_per_s"] for k in fixed},
            "auto_tok_s": auto["tokens_per_s"], "auto_mean_k": auto["mean_k"],
            "auto_vs_plain": auto["tokens_per_s"] / plain["tokens_per_s"],
            "e2e_auto_vs_plain": auto["e2e_tokens_per_s"] / plain["e2e_tokens_per_s"],
            # Each repeat's plain and auto ran back to back: their ratios show the run-to-run noise.
            "plain_runs_tok_s": [r["tokens_per_s"] for r in timings["plain"]],
            "auto_runs_tok_s": [r["tokens_per_s"] for r in timings["auto"]],
            "auto_vs_plain_per_repeat": [a["tokens_per_s"] / p["tokens_per_s"] for p, a in zip(timings["plain"], timings["auto"])],
        }
        if fixed:
            best_k = max(fixed, key=lambda k: fixed[k]["tokens_per_s"])
            row.update({
                "best_fixed_k": best_k,
                "auto_vs_best_fixed": auto["tokens_per_s"] / fixed[best_k]["tokens_per_s"],
                "best_fixed_vs_plain": fixed[best_k]["tokens_per_s"] / plain["tokens_per_s"],
                "e2e_auto_vs_best_fixed": auto["e2e_tokens_per_s"] / fixed[best_k]["e2e_tokens_per_s"],
            })
        rows.append(row)
        print(json.dumps(row), flush=True)

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    out = {"command": " ".join(sys.argv), "machine": machine(), "draft": args.draft, "profile_s": profile_s,
           "step_costs": {"batch_sizes": costs.batch_sizes, "target_s": costs.target_s, "draft_s": costs.draft_s}, "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=1))
    cols = ["batch_size", "plain_tok_s"] + [f"k{k}_tok_s" for k in ks] + ["auto_tok_s", "auto_mean_k", "best_fixed_k",
                                                                          "auto_vs_best_fixed", "auto_vs_plain"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.2f}" if isinstance(r.get(c), float) else str(r.get(c, "-")) for c in cols) + " |")


if __name__ == "__main__":
    main()
