"""Benchmark 1 (issue 2): drafters for the embedded SmolLM2-135M target on this machine.

One process, Spec-Bench first turns, greedy. Tokens/s of the autoregressive baseline in the
engine (NoDrafter), SpecEngine with each drafter, HF `generate` and HF assisted generation,
with per-step times, acceptance and the predicted gain next to each.

    python bench/engine_bench.py            # the documented run (docs/benchmarks.md)
    python bench/engine_bench.py --quick    # smoke test, < 1 minute after the model loads
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (bf16_copy, context_batch, hf_generate, int8_copy, load_prompts, loadavg, machine, median,  # noqa: E402
                    ngram_step_time, step_time, truncated_copy, weight_dtypes)

from raysd.core.sampling import SamplingParams  # noqa: E402
from raysd.core.theory import expected_walltime_improvement, serial_speedup  # noqa: E402
from raysd.engine.drafters import DraftModelDrafter, NgramDrafter, NoDrafter  # noqa: E402
from raysd.engine.engine import EngineConfig, SpecEngine  # noqa: E402
from raysd.engine.rows import Request  # noqa: E402
from raysd.models.loading import DEFAULT_MODEL, ModelSpec, eos_token_ids, load_model, load_tokenizer  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--per-task", type=int, default=1, help="Spec-Bench prompts per task (6 tasks)")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--k", type=int, default=4, help="K for every model drafter")
    p.add_argument("--ngram-k", type=int, default=4)
    p.add_argument("--k-sweep", default="2,4,6", help="K values tried for the bf16 draft at batch 1")
    p.add_argument("--cut-layers", type=int, default=0, help="also draft with the target's first N layers (0: skip)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per variant (median reported)")
    p.add_argument("--step-reps", type=int, default=9, help="repeats of each per-step timing (median)")
    p.add_argument("--step-context", type=int, default=256, help="cached tokens per row when timing one step")
    p.add_argument("--threads", type=int, default=1, help="torch threads (2 OMP threads collapse on a busy 2-core box)")
    p.add_argument("--no-hf", action="store_true", help="skip HF generate / assisted generation")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "engine_bench.json"))
    p.add_argument("--quick", action="store_true", help="2 prompts, 8 tokens, 1 repeat, no K sweep / cut draft")
    a = p.parse_args()
    if a.quick:
        a.per_task, a.max_new_tokens, a.repeats, a.step_reps, a.k_sweep, a.cut_layers = 1, 8, 1, 3, "", 0
        a.batch_sizes, a.out = "1,2", str(Path(a.out).with_name("engine_bench_quick.json"))
    a.prompts = 2 if a.quick else 0  # quick: the first two (short) prompts only
    a.batch_sizes = [int(b) for b in a.batch_sizes.split(",")]
    a.k_sweep = [int(k) for k in a.k_sweep.split(",") if k]
    return a


def run_engine(target, drafter, k, batch, prompts, max_new, eos):
    params = SamplingParams(max_new_tokens=max_new)
    engine = SpecEngine(target, drafter, EngineConfig(num_speculative_tokens=k, max_batch_size=batch, eos_token_ids=eos))
    reqs = [Request(i, p["ids"], params) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    results = engine.generate(reqs)
    wall = time.perf_counter() - t0
    tokens = [r.token_ids for r in results]
    st = [r.stats for r in results]
    tested = sum(s.num_tested_positions for s in st)
    steps = sum(s.num_spec_steps for s in st)
    return {
        "wall_s": wall, "tokens": tokens, "generated": sum(map(len, tokens)),
        "alpha": sum(s.overlap_sum for s in st) / tested if tested else None,
        "mean_acceptance_length": 1 + sum(s.num_accepted_draft_tokens for s in st) / steps if steps else None,
        "draft_s": engine.timings.draft_s, "target_s": engine.timings.target_s, "engine_steps": engine.timings.steps,
    }


def run_hf(target, batch, prompts, max_new, eos, assistant=None):
    """HF generate over `prompts` in chunks of `batch` (left padding); tokens cut after the first EOS."""
    return hf_generate(target, batch, prompts, max_new, eos[0], eos, assistant)


def main():
    a = parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    t_load = time.perf_counter()
    target = load_model(ModelSpec())
    tok = load_tokenizer(DEFAULT_MODEL)
    eos = eos_token_ids(target)
    vocab = target.get_output_embeddings().weight.shape[0]
    drafts = {"bf16": bf16_copy(target), "int8": int8_copy(target)}
    if a.cut_layers:
        drafts[f"cut{a.cut_layers}"] = truncated_copy(target, a.cut_layers)
    load_s = time.perf_counter() - t_load
    prompts = load_prompts(tok, a.per_task)
    prompts = prompts[: a.prompts] if a.prompts else prompts
    info = {"machine": machine(), "args": vars(a), "load_s": load_s, "num_prompts": len(prompts),
            "prompt_tokens": [len(p["ids"]) for p in prompts], "tasks": [p["task"] for p in prompts],
            "weights": {"target": weight_dtypes(target), **{n: weight_dtypes(m) for n, m in drafts.items()}}}
    print(f"loaded in {load_s:.1f}s; {len(prompts)} prompts; load {loadavg()}", flush=True)

    # Variants: (name, kind, K, batch sizes).
    variants = [("AR (NoDrafter)", "none", 0, a.batch_sizes), (f"ngram K={a.ngram_k}", "ngram", a.ngram_k, a.batch_sizes)]
    variants += [(f"{n} K={a.k}", n, a.k, a.batch_sizes) for n in drafts]
    variants += [(f"bf16 K={k}", "bf16", k, [1]) for k in a.k_sweep if k != a.k]
    if not a.no_hf:
        variants += [("HF generate", "hf", 0, a.batch_sizes), ("HF assisted (bf16)", "hf_assist", 0, [1])]

    def run(kind, k, b, ps, max_new):
        if kind in ("hf", "hf_assist"):
            return run_hf(target, b, ps, max_new, eos, drafts["bf16"] if kind == "hf_assist" else None)
        drafter = {"none": lambda: NoDrafter(vocab), "ngram": lambda: NgramDrafter(vocab)}.get(kind)
        drafter = drafter() if drafter else DraftModelDrafter(drafts[kind], vocab, name=kind)
        return run_engine(target, drafter, k, b, ps, max_new, eos)

    # Warm-up: every variant once on two prompts, short.
    for name, kind, k, bss in variants:
        for b in bss:
            run(kind, k, b, prompts[:2], 4)
    print(f"warm-up done; load {loadavg()}", flush=True)

    # Timed runs, variants interleaved within each repeat so drift in machine load hits all alike.
    runs: dict[tuple, list] = {}
    for r in range(a.repeats):
        for name, kind, k, bss in variants:
            for b in bss:
                la = loadavg()
                out = run(kind, k, b, prompts, a.max_new_tokens)
                out["loadavg"] = la
                runs.setdefault((name, b), []).append(out)
                print(f"[{r}] {name:22s} B={b}: {out['generated'] / out['wall_s']:7.1f} tok/s  load {la}", flush=True)

    # Per-step times: one decode step of each model at each batch size (median of step_reps).
    steps = {}
    for b in a.batch_sizes:
        ctx = context_batch(prompts, b, a.step_context)
        s = {"target_1": step_time(target, ctx, 1, a.step_reps)}
        for k in sorted({a.k, a.ngram_k, *a.k_sweep}):
            s[f"target_{k + 1}"] = step_time(target, ctx, k + 1, a.step_reps)
        for n, m in drafts.items():
            s[n] = step_time(m, ctx, 1, a.step_reps)
        s["ngram"] = ngram_step_time(ctx, a.ngram_k, vocab, a.step_reps) / a.ngram_k  # per drafted token
        steps[b] = s
        print(f"step times B={b} (ms): " + ", ".join(f"{n}={v * 1e3:.2f}" for n, v in s.items()), flush=True)

    # Summaries; exactness against the NoDrafter baseline at the same batch size.
    rows, mismatches = [], []
    for name, kind, k, bss in variants:
        for b in bss:
            rs = runs[(name, b)]
            base, first = runs[("AR (NoDrafter)", b)], rs[0]
            tps = [x["generated"] / x["wall_s"] for x in rs]
            base_tps = median([x["generated"] / x["wall_s"] for x in base])
            same = sum(t == u for t, u in zip(first["tokens"], base[0]["tokens"]))
            row = {"variant": name, "kind": kind, "batch": b, "K": k, "tok_s": median(tps), "tok_s_all": tps,
                   "vs_ar": median(tps) / base_tps, "generated": first["generated"], "same_as_ar": f"{same}/{len(prompts)}",
                   "loadavg": [x["loadavg"] for x in rs]}
            if kind not in ("none", "hf", "hf_assist"):
                s = steps[b]
                c = s[kind] / s["target_1"]
                alpha, mal = first["alpha"], first["mean_acceptance_length"]
                row.update(alpha=alpha, mean_acceptance_length=mal, c=c, draft_share=first["draft_s"] / (first["draft_s"] + first["target_s"]),
                           pred_thm38=expected_walltime_improvement(min(alpha, 1.0), k, c),
                           pred_serial=serial_speedup(mal, s["target_1"], s[f"target_{k + 1}"], s[kind], k))
            if kind in ("none", "ngram") or kind in drafts:
                bad = [i for i, (t, u) in enumerate(zip(first["tokens"], base[0]["tokens"])) if t != u]
                if bad:
                    mismatches.append((name, b, bad))
            rows.append(row)

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**info, "step_times_s": steps, "rows": rows, "mismatches": mismatches,
                               "loadavg_end": loadavg()}, indent=1))
    print_table(rows)
    print(f"wrote {out}")
    assert not mismatches, f"engine variants differ from the NoDrafter baseline: {mismatches}"


def print_table(rows):
    f = lambda v, p=2: "–" if v is None else f"{v:.{p}f}"  # noqa: E731
    print("\n| variant | B | tok/s | vs AR | alpha | mean acc. len | c | pred. gain (Thm 3.8) | pred. (measured T(K+1)) | = AR |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['batch']} | {f(r['tok_s'], 1)} | {f(r['vs_ar'])} | {f(r.get('alpha'))} | "
              f"{f(r.get('mean_acceptance_length'))} | {f(r.get('c'), 3)} | {f(r.get('pred_thm38'))} | {f(r.get('pred_serial'))} | {r['same_as_ar']} |")


if __name__ == "__main__":
    main()
