"""Issue 19 item 5: the tree chosen each step (`adaptive` with a tree budget) against the chain,
the chain with adaptive K, and fixed trees, in one run on this machine.

SmolLM2-135M-Instruct (fp32) with its shipped distilled draft (or, `--draft eagle`, its shipped
EAGLE feature draft, whose trees FeatureDrafter.propose_tree grows), Spec-Bench first turns with the
chat template (round-robin over the 6 tasks), greedy, fixed-length outputs (ignore_eos), one
SpecEngine per variant and repeat, the variants interleaved within each repeat. The adaptive
variants share one step-cost profile (`profile_step_costs`: the target at 1..P + 1 tokens and one
draft forward, at the batch size run), measured once at the start and reported.

Every variant's greedy rows must equal the first variant's (the chain's): the run fails otherwise.

    python bench/tree_auto_bench.py                 # docs/trees.md: 12 prompts x 32 tokens, batch 1, 2 repeats
    python bench/tree_auto_bench.py --draft eagle --out bench/results/tree_auto_bench_eagle.json
    python bench/tree_auto_bench.py --quick         # smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_prompts, loadavg, machine  # noqa: E402

from raysd.core.sampling import SamplingParams  # noqa: E402
from raysd.engine.adaptive import AdaptiveConfig, profile_step_costs  # noqa: E402
from raysd.engine.drafters import DraftModelDrafter, FeatureDrafter  # noqa: E402
from raysd.engine.engine import EngineConfig, SpecEngine  # noqa: E402
from raysd.engine.rows import Request  # noqa: E402
from raysd.models.features import EagleCausalLM  # noqa: E402
from raysd.models.loading import (DEFAULT_EAGLE, DEFAULT_MODEL, ModelSpec, eos_token_ids, load_eagle_draft,  # noqa: E402
                                  load_model, load_tokenizer)

DRAFT = "smollm2-135m-instruct-draft"


def variants(k: int, budget: int) -> list[tuple[str, int, int, bool]]:
    """(name, K, tree budget, adaptive)."""
    return [("chain", k, 0, False), (f"tree P={budget}", k, budget, False), ("tree P=4", k, 4, False),
            ("auto chain", k, 0, True), (f"auto tree P<={budget}", k, budget, True)]


def run(target, draft, eagle, k, P, adaptive, batch, prompts, max_new, eos) -> dict:
    vocab = target.get_output_embeddings().weight.shape[0]
    drafter = FeatureDrafter(draft, vocab) if eagle else DraftModelDrafter(draft, vocab)
    engine = SpecEngine(target, drafter, EngineConfig(
        num_speculative_tokens=k, max_batch_size=batch, eos_token_ids=eos, tree_budget=P, adaptive=adaptive))
    requests = [Request(i, p["ids"], SamplingParams(max_new_tokens=max_new, ignore_eos=True)) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    with torch.inference_mode():
        results = sorted(engine.generate(requests), key=lambda r: r.request_id)
    wall = time.perf_counter() - t0
    tokens = sum(len(r.token_ids) for r in results)
    steps = engine.timings.steps
    chosen = engine.k_controller.chosen if engine.k_controller is not None else {(k, P): steps}
    tree_steps = sum(n for (kk, pp), n in chosen.items() if pp)
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "steps": steps,
            "tokens_per_pass": sum(r.stats.num_accepted_draft_tokens + r.stats.num_spec_steps for r in results)
            / max(1, sum(r.stats.num_spec_steps for r in results)),
            "tree_step_share": tree_steps / max(1, sum(chosen.values())),
            "chosen": {f"k={kk},P={pp}": n for (kk, pp), n in sorted(chosen.items())},
            "rank_rates": None if engine.k_controller is None else engine.k_controller.rank_rates().tolist(),
            "token_ids": [r.token_ids for r in results]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--per-task", type=int, default=2, help="Spec-Bench prompts per task (6 tasks)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--budget", type=int, default=16, help="P: the fixed tree's budget and the adaptive trees' largest")
    p.add_argument("-k", type=int, default=4, help="the chain's length and the trees' depth limit")
    p.add_argument("--draft", choices=("distilled", "eagle"), default="distilled",
                   help=f"{DRAFT} (a two-layer draft model) or {DEFAULT_EAGLE} (the EAGLE feature draft)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "tree_auto_bench.json"))
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    if a.quick:
        a.per_task, a.max_new_tokens, a.repeats, a.budget = 1, 8, 1, 8
        a.out = f"/tmp/tree_auto_bench_quick_{a.draft}.json"
    torch.set_num_threads(a.threads)
    tok = load_tokenizer(DEFAULT_MODEL)
    target = load_model(ModelSpec(DEFAULT_MODEL))
    eagle = a.draft == "eagle"
    draft = load_eagle_draft(DEFAULT_EAGLE, target) if eagle else load_model(ModelSpec(DRAFT))
    timed_draft = EagleCausalLM(draft, zero_features=True) if eagle else draft  # its forward, features zero
    prompts = load_prompts(tok, a.per_task)
    eos = eos_token_ids(target)
    load_start, started = loadavg(), time.perf_counter()
    with torch.inference_mode():
        costs = profile_step_costs(target, timed_draft, k_max=max(a.k, a.budget), batch_sizes=(a.batch,), context=64, reps=3,
                                   runner="static")
    print(f"step costs at B = {a.batch}: target ms by tokens per row "
          + ", ".join(f"{n + 1}: {t * 1e3:.0f}" for n, t in enumerate(costs.target_s[0]))
          + f"; draft {costs.draft_s[0] * 1e3:.1f} ms", flush=True)
    adaptive = AdaptiveConfig(costs)
    rows = []
    for rep in range(a.repeats):
        for name, k, P, auto in variants(a.k, a.budget):
            r = run(target, draft, eagle, k, P, adaptive if auto else None, a.batch, prompts, a.max_new_tokens, eos)
            r.update(variant=name, repeat=rep, load=loadavg())
            rows.append(r)
            print(f"[{rep}] {name}: {r['tok_s']:.2f} tok/s, {r['tokens_per_pass']:.2f} tokens/pass, "
                  f"tree steps {r['tree_step_share']:.0%}, {r['chosen']}, load {r['load']:.2f}", flush=True)
    reference = rows[0]["token_ids"]
    bad = [r["variant"] for r in rows if r["token_ids"] != reference]
    assert not bad, f"greedy rows differ from the chain's: {bad}"
    summary = {}
    for name, *_ in variants(a.k, a.budget):
        mine = [r for r in rows if r["variant"] == name]
        ratios = [m["tok_s"] / c["tok_s"] for m, c in zip(mine, (r for r in rows if r["variant"] == "chain"))]
        summary[name] = {"tok_s_median": statistics.median(m["tok_s"] for m in mine),
                         "vs_chain_per_repeat": ratios, "tokens_per_pass": statistics.median(m["tokens_per_pass"] for m in mine),
                         "tree_step_share": statistics.median(m["tree_step_share"] for m in mine)}
        print(f"{name}: median {summary[name]['tok_s_median']:.2f} tok/s, vs chain per repeat "
              + ", ".join(f"{x:.3f}" for x in ratios))
    for r in rows:
        del r["token_ids"]
    out = {"machine": machine(), "args": vars(a), "loadavg_start": load_start, "loadavg_end": loadavg(),
           "elapsed_s": time.perf_counter() - started,
           "step_costs": {"batch": a.batch, "target_s": costs.target_s[0], "draft_s": costs.draft_s[0]},
           "prompts": [{"question_id": q["question_id"], "task": q["task"], "len": len(q["ids"])} for q in prompts],
           "greedy_rows_identical": True, "summary": summary, "rows": rows}
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"load average {load_start:.2f} at the start, {out['loadavg_end']:.2f} at the end; {out['elapsed_s']:.0f} s; {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
