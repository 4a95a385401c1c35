"""pipeline: `raysd generate` (the Ray Data pipeline) against the in-process engine on the same
prompts, batch size and drafter, and optionally the model actors alone.

Every side starts from models on disk, so each timed run includes its model loading:
    engine     load the target (and draft), SpecEngine.generate over every prompt with
               max_batch_size = B; `auto` K as a replica runs it (step costs learned from its own
               steps). Torch gets the threads the pipeline's target actor would get
               (`--num-cpus-per-actor auto`).
    actors     a SpecCoordinator built as a job's replica builds it (same actors and CPUs), its
               `generate` over every prompt, in each replica shape of --shapes, with --micro-batches M
               for the split shape (1: draft then verify; 2: one micro-batch drafts while the other
               verifies); timed from its construction. Fixed K only.
    pipeline   raysd.jobs.runner.generate on a JSON Lines file of the prompts' token ids (so every
               side decodes the same ids), `--batch-size B`, a fresh output, in each replica shape of
               --shapes; its summary's wall (reading, Ray Data's and the actors' start, loading,
               generation, writing).
Rows end at EOS on every side (a job has no flag to ignore it). The local Ray is started once before the first run; its start-up is recorded apart (extra.ray_start_s).
Ratios: each pipeline and actors variant against the engine variant of its drafter (when the
engine side runs), each engine drafter against the engine's `none`. Checked: greedy rows equal
across sides, none missing.

    python -m bench run pipeline                                     # none and ngram:auto, B = 16, 64 shortest prompts
    python -m bench run pipeline --prompt-set shortest --max-prompts 258 --batch-sizes 8,32 --drafters none
    python -m bench run pipeline --sides engine,actors --drafters ngram:4,draft:3 \\
        --micro-batches 1,2                                          # overlap_bench: serial against overlapped
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import time

from bench.harness import Outcome, Variant, run_variants
from bench.measure import Counts, figures
from bench.models import ALIASES
from bench.workload import add_workload_arguments, describe, int_list, load_prompts, str_list

QUICK = {"max_prompts": 4, "max_new_tokens": 8, "batch_sizes": [2], "repeats": 1, "drafters": ["none"],
         "sides": ["engine", "actors", "pipeline"]}
SIDES = ("engine", "actors", "pipeline")


def add_arguments(p) -> None:
    add_workload_arguments(p, max_new_tokens=64, batch_sizes="16", prompt_set="shortest", eos_flag=False)
    p.set_defaults(max_prompts=64)
    g = p.add_argument_group("pipeline")
    g.add_argument("--drafters", type=str_list, default=["none", "ngram:auto"],
                   help="DRAFTER[:K]: none, ngram, draft, eagle or a model; K a number or auto (default 4)")
    g.add_argument("--sides", type=str_list, default=["engine", "pipeline"], help=f"any of {', '.join(SIDES)}")
    g.add_argument("--micro-batches", type=int_list, default=[1], help="the actors side's micro-batch counts (split shape)")
    g.add_argument("--shapes", type=str_list, default=["colocated"], help="replica shapes: colocated, split")


def parse_drafter(text: str) -> tuple[str, int | str]:
    """"none" -> ("none", 0); "ngram" -> ("ngram", 4); "ngram:auto"; "draft:3" (the shipped draft's name)."""
    name, _, k = text.partition(":")
    name = ALIASES.get(name, name)
    return (name, 0) if name == "none" else (name, k if k == "auto" else int(k or 4))


def job_config(drafter: str, k, batch: int, max_new: int, shape: str = "auto", **paths):
    from raysd.jobs.config import GenerateConfig

    cfg = GenerateConfig(input=paths.get("input", "-"), output=paths.get("output", "-"), draft=drafter,
                         num_speculative_tokens=k if drafter != "none" else None, max_new_tokens=max_new,
                         batch_size=batch, quiet=True, overwrite=True, replica_shape=shape)
    return cfg.resolve_actor_cpus(os.cpu_count())  # as the runner resolves --num-cpus-per-actor auto on its own Ray


def engine_run(prompts, drafter, k, batch, a) -> dict:
    import torch

    from bench.models import Models
    from raysd.core.sampling import SamplingParams
    from raysd.core.speculation import AdaptiveConfig, SpeculationConfig
    from raysd.engine.engine import EngineConfig, SpecEngine
    from raysd.engine.requests import Request
    from raysd.jobs.config import AUTO_MAX_K
    from raysd.models.loading import ModelSpec, eos_token_ids, load_model

    torch.set_num_threads(job_config(drafter, k, batch, a.max_new_tokens).target_threads)  # the job's target actor's
    start = time.perf_counter()
    models = Models(target=load_model(ModelSpec()), with_tokenizer=False)
    adaptive, K = None, k
    if k == "auto":  # as a job's replica runs it: the step costs learned from its own steps
        K, adaptive = AUTO_MAX_K, AdaptiveConfig()
    spec = SpeculationConfig(K, adaptive=adaptive, eos_token_ids=eos_token_ids(models.target))
    engine = SpecEngine(models.target, models.drafter(drafter), EngineConfig(spec, max_batch_size=batch))
    loaded = time.perf_counter()
    params = SamplingParams(max_new_tokens=a.max_new_tokens)  # rows end at EOS, as in a job
    with torch.inference_mode():
        results = engine.generate([Request(str(i), p["ids"], params) for i, p in enumerate(prompts)])
    end = time.perf_counter()
    t = engine.timings
    return figures(Counts.of_results(results), end - start, timed="model load + SpecEngine.generate", load_s=loaded - start,
                   occupancy=t.row_steps / (t.steps * batch) if t.steps else None,
                   _rows={str(r.request_id): list(r.token_ids) for r in results})


def actors_run(prompts, drafter, k, batch, micro, a, shape="colocated") -> dict:
    from raysd.actors import ActorResources, CoordinatorConfig, DrafterSpec, SpecCoordinator
    from raysd.core.sampling import SamplingParams
    from raysd.core.speculation import SpeculationConfig
    from raysd.engine.requests import Request
    from raysd.models.loading import ModelSpec, eos_token_ids, load_model

    job = job_config(drafter, k, batch, a.max_new_tokens)
    (tc, dc), model = job.actor_cpus, job.draft_is_model
    start = time.perf_counter()
    eos = eos_token_ids(load_model(ModelSpec()))  # as the replica reads them (from the tokenizer's model)
    cfg = CoordinatorConfig(SpeculationConfig(k, eos_token_ids=eos), micro_batch_size=-(-batch // micro),
                            num_micro_batches=micro, target_resources=ActorResources(num_cpus=tc, num_gpus=0),
                            draft_resources=ActorResources(num_cpus=dc, num_gpus=0), measure_bytes=False)
    drafter_spec = DrafterSpec(functools.partial(load_model, ModelSpec(drafter)) if model else None, shape=shape)
    params = SamplingParams(max_new_tokens=a.max_new_tokens)  # rows end at EOS, as in a job
    with SpecCoordinator(functools.partial(load_model, ModelSpec()), drafter_spec, cfg) as coordinator:
        loaded = time.perf_counter()
        out = coordinator.generate([Request(str(i), p["ids"], params) for i, p in enumerate(prompts)])
    end = time.perf_counter()
    r = out.stats
    return figures(Counts.of_results(out.results), end - start, timed="actors' start and load + SpecCoordinator.generate",
                   load_s=loaded - start, occupancy=r.occupancy, overlap_efficiency=r.overlap_efficiency,
                   verify_s=r.verify_s, draft_s=r.draft_s,
                   _rows={str(x.request_id): list(x.token_ids) for x in out.results})


def pipeline_run(prompt_file, workdir, drafter, k, batch, a, shape="auto") -> dict:
    import pyarrow.parquet as pq

    from raysd.jobs.runner import generate

    out = tempfile.mkdtemp(dir=workdir)
    summary = generate(job_config(drafter, k, batch, a.max_new_tokens, shape, input=prompt_file, output=out)).latest_run
    rows = pq.read_table(out).to_pylist()
    return figures(Counts.of_rows(rows), summary.wall_s, timed="raysd generate, the job's wall (start-up included)",
                   occupancy=summary.occupancy, error_rows=sum(r["error"] is not None for r in rows),
                   start_s=summary.time_breakdown.get("start"), _rows={str(r["id"]): list(r["generated_token_ids"]) for r in rows})


def run(a, log=print) -> Outcome:
    import ray

    from raysd.actors.local import start_local_ray
    from raysd.models.loading import load_tokenizer

    bad = [s for s in a.sides if s not in SIDES]
    if bad:
        raise SystemExit(f"--sides: unknown {bad}; choose from {SIDES}")
    drafters = [parse_drafter(d) for d in a.drafters]
    prompts = load_prompts(load_tokenizer("smollm2-135m-instruct"), a.per_task, a.prompt_set, a.prompts_file, a.max_prompts)
    workdir = tempfile.mkdtemp(prefix="raysd-bench-pipeline-")
    prompt_file = os.path.join(workdir, "prompts.jsonl")
    with open(prompt_file, "w") as f:  # token ids: every side decodes exactly the same ids
        f.writelines(json.dumps({"id": str(i), "prompt": p["ids"]}) + "\n" for i, p in enumerate(prompts))
    ray_start_s = None
    if {"actors", "pipeline"} & set(a.sides):
        t0 = time.perf_counter()
        start_local_ray(num_cpus=(os.cpu_count() or 1) + 1, log_to_driver=False, configure_logging=False)
        ray_start_s = time.perf_counter() - t0
    variants = []
    for B in a.batch_sizes:
        for drafter, k in drafters:
            label = drafter.replace("smollm2-135m-instruct-", "") + ("" if drafter == "none" else f" K={k}")
            engine_name = f"engine {label}, B={B}"
            engine_base = None if drafter == "none" else f"engine none, B={B}"
            for side in a.sides:
                settings = {"side": side, "drafter": drafter, "k": k, "batch": B}
                if side == "engine":
                    variants.append(Variant(engine_name, settings, functools.partial(engine_run, prompts, drafter, k, B, a),
                                            engine_base))
                elif side == "pipeline":
                    for shape in a.shapes if drafter != "none" else a.shapes[:1]:
                        base = engine_name if "engine" in a.sides else (None if drafter == "none" else f"pipeline none, B={B}")
                        variants.append(Variant(f"pipeline {shape} {label}, B={B}", {**settings, "shape": shape},
                                                functools.partial(pipeline_run, prompt_file, workdir, drafter, k, B, a, shape), base))
                elif k == "auto":
                    log(f"actors side: skipped {label} (the coordinator alone runs a fixed K)")
                else:
                    for shape in a.shapes:
                        for m in a.micro_batches if shape == "split" else [1]:
                            variants.append(Variant(f"actors {shape} {label} M={m}, B={B}",
                                                    {**settings, "shape": shape, "micro_batches": m},
                                                    functools.partial(actors_run, prompts, drafter, k, B, m, a, shape),
                                                    engine_name if "engine" in a.sides else None))
    try:
        summaries, runs = run_variants(variants, a.repeats, log=log)
    finally:
        if ray.is_initialized():
            ray.shutdown()
    return Outcome(summaries, {"prompts": describe(prompts), "ray_start_s": ray_start_s}, {"rows_equal_across_sides": rows_check(variants, runs)})


def rows_check(variants, runs) -> dict:
    """Every side's rows (first repeat) against the first side's, per drafter and batch size: greedy, so equal."""
    groups: dict = {}
    for v in variants:
        groups.setdefault((v.settings["drafter"], v.settings["k"], v.settings["batch"]), []).append(v.name)
    bad, counts = [], {}
    for names in groups.values():
        ref = runs[names[0]][0]["_rows"]
        for n in names[1:]:
            mine = runs[n][0]["_rows"]
            equal = sum(mine.get(i) == t for i, t in ref.items())
            counts[n] = f"{equal}/{len(ref)} equal to {names[0]}"
            if equal != len(ref) or len(mine) != len(ref):
                bad.append(n)
    return {"ok": not bad, "mismatched": bad, "rows_equal": counts}
