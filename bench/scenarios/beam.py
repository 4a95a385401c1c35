"""beam: speculative beam search (raysd.engine.beam) against raysd's own beam search without a
drafter and against Hugging Face `generate(num_beams=W)`, greedy, the target's EOS ending rows.

One process, the target (default the embedded SmolLM2-135M-Instruct) and the shipped distilled
draft loaded once, Spec-Bench prompts (bench.workload; default the questions held out of the
draft's training). Per batch size B (prompts decoded together, W rows each) the variants are:
    beam plain W=w, B=b         BeamSearchEngine with no drafter: one level per target pass (the baseline)
    beam DRAFTER K=k W=w, B=b   with the draft model's own beam search K levels deep (`draft`), or an
                                n-gram / suffix lookup tree of --lookup-budget nodes per beam
    HF beam W=w, B=b            `generate(num_beams=w, do_sample=False)`, prompts left-padded in chunks of b
Tokens are each prompt's best hypothesis (num_return_sequences 1), so every variant that returns
the target's beams counts the same tokens; tokens/s = those / wall seconds. `mean_acceptance_length`
is the levels advanced per target pass (SpecDecodeStats' beam terms).

Checked: every engine variant's rows equal plain beam search's at the same B (float32), and
HF's at B = 1 (HF's padded batches compute in other shapes: recorded, not enforced).
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.harness import Outcome, Variant, run_variants
from bench.hf import hf_generate
from bench.measure import Counts, figures
from bench.models import Models
from bench.workload import add_workload_arguments, describe, int_list, load_prompts, str_list

QUICK = {"prompt_set": "shortest", "per_task": 1, "max_new_tokens": 8, "batch_sizes": [1, 2], "repeats": 1,
         "drafters": ["draft", "ngram"], "ks": [2]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_arguments(p, per_task=3, max_new_tokens=64, prompt_set="heldout", eos_flag=False)
    g = p.add_argument_group("beam")
    g.add_argument("--target", default="smollm2-135m-instruct")
    g.add_argument("--beam-width", type=int, default=4)
    g.add_argument("--drafters", type=str_list, default=["draft"], help="draft, ngram, suffix, or a model name/path")
    g.add_argument("--ks", type=int_list, default=[3], help="tree depths K")
    g.add_argument("--draft-width", type=int, default=0, help="W' draft beams per level (0: the target's W)")
    g.add_argument("--lookup-budget", type=int, default=8, help="an n-gram or suffix tree's nodes per beam")
    g.add_argument("--hf-batch-sizes", type=int_list, default=None, help="HF generate's batch sizes (default: --batch-sizes)")


def beam_drafter(models: Models, name: str, a, k: int):
    from raysd.engine.beam_drafters import DraftBeamSearch, LookupBeams

    if name in ("ngram", "suffix"):
        return LookupBeams(models.drafter(name), a.lookup_budget, k)
    return DraftBeamSearch(models.draft_model(name), models.vocab_size, width=a.draft_width or None,
                           eos_token_ids=models.eos, name=name)


def engine_run(models: Models, drafter: str, k: int, B: int, prompts: list[dict], a) -> dict:
    from raysd.core.beam import BeamConfig
    from raysd.core.sampling import SamplingParams
    from raysd.engine.beam import BeamEngineConfig, BeamSearchEngine
    from raysd.engine.requests import Request

    config = BeamEngineConfig(BeamConfig(a.beam_width), num_speculative_tokens=k, max_batch_size=B, eos_token_ids=models.eos)
    engine = BeamSearchEngine(models.target, None if drafter == "none" else beam_drafter(models, drafter, a, k), config)
    requests = [Request(i, p["ids"], SamplingParams(max_new_tokens=a.max_new_tokens)) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    with torch.inference_mode():
        results = [rs[0] for rs in engine.generate(requests)]
    wall = time.perf_counter() - start
    t = engine.timings
    return figures(Counts.of_results(results), wall, timed="BeamSearchEngine.generate", prefill_s=t.prefill_s,
                   draft_s=t.draft_s, verify_s=t.verify_s, reorder_s=t.reorder_s, target_passes=t.passes,
                   nodes_selected=sum(r.stats.num_beam_nodes_selected for r in results),
                   error_rows=sum(r.finish_reason == "error" for r in results), _tokens=[r.token_ids for r in results])


def run(a, log=print) -> Outcome:
    torch.manual_seed(0)
    models = Models(a.target, "float32")
    prompts = load_prompts(models.tokenizer, a.per_task, a.prompt_set, a.prompts_file, a.max_prompts)
    warm = prompts[:2]
    short = argparse.Namespace(**{**vars(a), "max_new_tokens": 4})
    W, variants = a.beam_width, []
    pad = models.tokenizer.pad_token_id if models.tokenizer.pad_token_id is not None else models.eos[0]
    for B in a.batch_sizes:
        base = f"beam plain W={W}, B={B}"
        grid = [("none", 0, base)] + [(d, k, f"beam {d} K={k} W={W}, B={B}") for d in a.drafters for k in a.ks]
        for d, k, name in grid:
            variants.append(Variant(name, {"drafter": d, "k": k, "beam_width": W, "batch": B},
                                    lambda d=d, k=k, B=B: engine_run(models, d, k, B, prompts, a),
                                    None if name == base else base,
                                    lambda d=d, k=k, B=B: engine_run(models, d, k, B, warm, short)))
    for B in a.batch_sizes if a.hf_batch_sizes is None else a.hf_batch_sizes:
        run_hf = lambda B=B, ps=prompts, n=a.max_new_tokens: hf_generate(models.target, ps, B, n, pad, models.eos, True, W)  # noqa: E731
        variants.append(Variant(f"HF beam W={W}, B={B}", {"hf_generate": True, "beam_width": W, "batch": B}, run_hf,
                                f"beam plain W={W}, B={B}" if B in a.batch_sizes else None,
                                lambda B=B: run_hf(B, warm, 4)))
    summaries, runs = run_variants(variants, a.repeats, log=log)
    extra = {"prompts": describe(prompts), "target": a.target, "dtype": "float32", "beam_width": W}
    return Outcome(summaries, extra, same_beams(variants, runs))


def same_beams(variants: list[Variant], runs: dict) -> dict:
    """Each variant's rows against plain beam search's at its B (first repeat); HF's at B = 1 enforced."""
    checks = {}
    for v in variants:
        if not v.baseline:
            continue
        mine, ref = runs[v.name][0]["_tokens"], runs[v.baseline][0]["_tokens"]
        equal = sum(x == y for x, y in zip(mine, ref))
        hf_padded = v.settings.get("hf_generate") and v.settings["batch"] > 1
        checks[f"same beams: {v.name}"] = {"ok": equal == len(ref) or bool(hf_padded), "rows_equal": equal,
                                           "rows": len(ref), "enforced": not hf_padded}
    return checks
