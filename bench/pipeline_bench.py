"""Issue 17 item 3: `raysd generate` (the Ray Data pipeline) against the in-process engine, same
prompts, same batch size, same drafter, SmolLM2-135M-Instruct on this CPU, greedy.

Both sides start from models on disk and no Ray work running: the bench starts one local Ray first
(its start-up is timed separately and left out of both), then for every variant
- engine: load the target (and draft), `SpecEngine.generate` over every prompt with continuous
  batching at `max_batch_size = B`; timed from the load to the last token; with an auto K
  (`ngram:auto`), as a replica runs `-k auto`: K chosen each step from step costs profiled in
  process once per machine (cached as the replica's are; the first run pays the profiling);
- coordinator (`--sides` with `coordinator`): the pipeline's model actors without Ray Data: a
  `SpecCoordinator` built as a job's replica builds it (the same actors, CPUs, micro-batch and
  drafter), `generate` over every prompt; timed from its construction (actors started, models
  loaded) to the last token. It tells the actor layer's cost apart from Ray Data's;
- pipeline: `raysd.jobs.runner.generate` on the same prompts (a JSON Lines file of token-id prompts,
  so both decode exactly the same ids) at `--batch-size B`, fresh output directory; timed by the
  job's own summary (`wall_s`: reading, the model actors' start and load, generation, writing).
Each variant's tokens are compared row by row: the pipeline must give the engine's tokens.

    python bench/pipeline_bench.py                       # the documented run (docs/benchmarks.md)
    python bench/pipeline_bench.py --prompts 16 --batch-sizes 8 --repeats 1   # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_prompts, loadavg, machine, median  # noqa: E402

from raysd.core.sampling import SamplingParams  # noqa: E402
from raysd.engine.adaptive import AdaptiveConfig, profile_step_costs  # noqa: E402
from raysd.engine.drafters import DraftModelDrafter, NgramDrafter, NoDrafter  # noqa: E402
from raysd.engine.engine import EngineConfig, SpecEngine  # noqa: E402
from raysd.engine.rows import Request  # noqa: E402
from raysd.jobs.config import AUTO_MAX_K  # noqa: E402
from raysd.jobs.profiles import cached_step_costs  # noqa: E402
from raysd.models.loading import DEFAULT_MODEL, ModelSpec, eos_token_ids, load_model, load_tokenizer  # noqa: E402


def parse_variant(text: str) -> tuple[str, int | str]:
    """"none" -> ("none", 0); "ngram" -> ("ngram", 4) (K = 4 by default); "ngram:auto", "ngram:2"."""
    draft, _, k = text.partition(":")
    if draft == "none":
        return draft, 0
    return draft, (k if k == "auto" else int(k or 4))


def run_engine(prompts: list[dict], draft: str, k: int | str, batch: int, max_new: int) -> dict:
    t0 = time.perf_counter()
    target = load_model(ModelSpec())
    vocab = target.get_output_embeddings().weight.shape[0]
    draft_model = None
    if draft == "none":
        drafter = NoDrafter(vocab)
    elif draft == "ngram":
        drafter = NgramDrafter(vocab)
    else:  # a draft model by name or path (e.g. smollm2-135m-instruct-draft, the shipped distilled draft)
        draft_model = load_model(ModelSpec(draft))
        drafter = DraftModelDrafter(draft_model, vocab)
    adaptive = None
    if k == "auto":  # as a replica under `-k auto`: step costs profiled once per machine, K chosen each step
        k = AUTO_MAX_K
        key = {"side": "bench engine", "draft": draft, "k_max": k, "batch_sizes": sorted({1, batch}), "context": 64, "reps": 2}
        costs, _ = cached_step_costs(key, lambda: profile_step_costs(target, draft_model, k, sorted({1, batch}), context=64, reps=2))
        adaptive = AdaptiveConfig(costs)
    engine = SpecEngine(target, drafter, EngineConfig(num_speculative_tokens=k, max_batch_size=batch, adaptive=adaptive,
                                                      eos_token_ids=eos_token_ids(target)))
    loaded = time.perf_counter()
    params = SamplingParams(max_new_tokens=max_new)
    with torch.inference_mode():
        results = engine.generate([Request(str(p["row"]), p["ids"], params) for p in prompts])
    end = time.perf_counter()
    tokens = sum(len(r.token_ids) for r in results)
    t = engine.timings  # occupancy as the pipeline's summary counts it: rows decoded / (steps x batch size)
    return {"wall_s": end - t0, "load_s": loaded - t0, "generate_s": end - loaded, "tokens": tokens,
            "tok_s": tokens / (end - t0), "tok_s_generate": tokens / (end - loaded), "steps": t.steps,
            "occupancy": round(t.row_steps / (t.steps * batch), 4) if t.steps else None, "prefill_s": t.prefill_s,
            "rows": {r.request_id: list(r.token_ids) for r in results}}


def run_coordinator(prompts: list[dict], draft: str, k: int, batch: int, max_new: int) -> dict:
    import functools

    from raysd.actors import ActorResources, CoordinatorConfig, DrafterSpec, SpecCoordinator
    from raysd.jobs.config import GenerateConfig

    assert k != "auto", "the coordinator side runs a fixed K"
    job = GenerateConfig(input="-", output="-", draft=draft).resolve_actor_cpus(os.cpu_count())  # as the replica's
    cpus, gpus = job.actor_cpus, job.num_gpus_per_actor
    model = draft not in ("none", "ngram")
    t0 = time.perf_counter()
    eos = eos_token_ids(load_model(ModelSpec()))  # as the replica reads them; 0.1 s from the GGUF cache
    cfg = CoordinatorConfig(num_speculative_tokens=k, micro_batch_size=batch, num_micro_batches=1, eos_token_ids=eos,
                            target_resources=ActorResources(num_cpus=cpus[0], num_gpus=gpus),
                            draft_resources=ActorResources(num_cpus=cpus[1], num_gpus=gpus if model else 0), measure_bytes=False)
    drafter = DrafterSpec(functools.partial(load_model, ModelSpec(draft)) if model else None)
    with SpecCoordinator(functools.partial(load_model, ModelSpec()), drafter, cfg) as coordinator:
        loaded = time.perf_counter()
        out = coordinator.generate([Request(str(p["row"]), p["ids"], SamplingParams(max_new_tokens=max_new)) for p in prompts])
    end = time.perf_counter()
    tokens = sum(len(r.token_ids) for r in out.results)
    return {"wall_s": end - t0, "load_s": loaded - t0, "target_busy_s": out.report.target_busy_s, "tokens": tokens,
            "tok_s": tokens / (end - t0), "rows": {str(r.request_id): list(r.token_ids) for r in out.results}}


def actor_cpus(draft: str) -> float:
    """The target actor's CPUs under `raysd generate`'s default (`--num-cpus-per-actor auto` on a
    Ray it starts here): the engine runs as many torch threads, so both sides get the same cores.
    (The bench starts Ray itself, so it resolves auto as the runner would.)"""
    from raysd.jobs.config import GenerateConfig

    return GenerateConfig(input="-", output="-", draft=draft).resolve_actor_cpus(os.cpu_count()).actor_cpus[0]


def run_pipeline(prompt_file: str, draft: str, k: int | str, batch: int, max_new: int, workdir: str) -> dict:
    import pyarrow.parquet as pq

    from raysd.jobs.config import GenerateConfig
    from raysd.jobs.runner import generate

    out = tempfile.mkdtemp(dir=workdir)
    cfg = GenerateConfig(input=prompt_file, output=out, draft=draft, num_speculative_tokens=k,
                         max_new_tokens=max_new, batch_size=batch, quiet=True, overwrite=True,
                         num_cpus_per_actor=actor_cpus(draft))
    summary = generate(cfg).to_dict()
    table = pq.read_table(out, columns=["id", "generated_token_ids", "error"]).to_pylist()
    return {"wall_s": summary["wall_s"], "tokens": summary["generated_tokens"], "tok_s": summary["tokens_per_s"],
            "occupancy": summary["occupancy"], "time_breakdown": summary["time_breakdown"],
            "errors": sum(r["error"] is not None for r in table),
            "rows": {str(r["id"]): list(r["generated_token_ids"]) for r in table}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=256, help="Spec-Bench first turns, round-robin over the 6 tasks")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--batch-sizes", default="8,32")
    p.add_argument("--drafters", default="none,ngram",
                   help="variants: none, ngram (K = 4), ngram:K, ngram:auto, or a draft model's name with :K or :auto")
    p.add_argument("--sides", default="engine,pipeline",
                   help="engine,pipeline (both: the ratio) or one of them; add coordinator for the actors without Ray Data")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--shortest", action="store_true",
                   help="the N shortest prompts of all 480 rather than the first N/6 of each task: less prefill (the same "
                        "work on both sides), so the decoding loop, where the two differ, weighs more")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "pipeline_bench.json"))
    a = p.parse_args(argv)
    sides = a.sides.split(",")
    # Refuse before any model loads: the coordinator side runs a fixed K.
    auto = [v for v in a.drafters.split(",") if parse_variant(v)[1] == "auto"]
    if "coordinator" in sides and auto:
        p.error(f"the coordinator side runs a fixed K: drop {', '.join(auto)} or that side")

    import ray

    from raysd.actors.local import start_local_ray

    tok = load_tokenizer(DEFAULT_MODEL)
    if a.shortest:  # the N shortest of all 480 (every task keeps some), in round-robin order
        everything = load_prompts(tok, 10**6)
        keep = set(sorted(range(len(everything)), key=lambda i: (len(everything[i]["ids"]), i))[: a.prompts])
        prompts = [q for i, q in enumerate(everything) if i in keep]
    else:
        prompts = load_prompts(tok, -(-a.prompts // 6))[: a.prompts]
    for i, q in enumerate(prompts):
        q["row"] = i
    workdir = tempfile.mkdtemp(prefix="raysd-pipeline-bench-")
    prompt_file = os.path.join(workdir, "prompts.jsonl")
    with open(prompt_file, "w") as f:  # token ids: the pipeline decodes the engine's exact ids
        for q in prompts:
            f.write(json.dumps({"id": str(q["row"]), "prompt": q["ids"]}) + "\n")

    t0 = time.perf_counter()
    start_local_ray(num_cpus=(os.cpu_count() or 1) + 1, log_to_driver=False, configure_logging=False)
    ray_start_s = time.perf_counter() - t0
    info = {"machine": machine(), "prompts": len(prompts), "shortest": a.shortest,
            "tasks": {t: sum(q["task"] == t for q in prompts) for t in sorted({q["task"] for q in prompts})}, "max_new_tokens": a.max_new_tokens, "ray_start_s": ray_start_s,
            "prompt_tokens_mean": sum(len(q["ids"]) for q in prompts) / len(prompts), "loadavg_start": loadavg()}
    print(json.dumps(info), flush=True)
    results = []
    for b in [int(x) for x in a.batch_sizes.split(",")]:
        variants = a.drafters.split(",")
        all_runs = {v: {side: [] for side in sides} for v in variants}
        # Repeats interleave the variants (ABC CBA ...) and the sides, so a drifting load spreads over all.
        for rep in range(a.repeats):
            for variant in (variants if rep % 2 == 0 else variants[::-1]):
                draft, k = parse_variant(variant)
                torch.set_num_threads(int(actor_cpus(draft)))  # as the target actor runs
                for side in (sides if rep % 2 == 0 else sides[::-1]):
                    if side == "engine":
                        r = run_engine(prompts, draft, k, b, a.max_new_tokens)
                    elif side == "coordinator":
                        r = run_coordinator(prompts, draft, k, b, a.max_new_tokens)
                    else:
                        r = run_pipeline(prompt_file, draft, k, b, a.max_new_tokens, workdir)
                    r["loadavg"] = loadavg()
                    all_runs[variant][side].append(r)
                    print(json.dumps({"batch": b, "variant": variant, "side": side, "repeat": rep,
                                      **{k_: v for k_, v in r.items() if k_ != "rows"}}), flush=True)
        for variant in variants:
            draft, k = parse_variant(variant)
            runs = all_runs[variant]
            row = {"batch": b, "draft": draft, "k": k, "threads": int(actor_cpus(draft)), "loadavg": [r["loadavg"] for rs in runs.values() for r in rs]}
            if "engine" in runs:
                eng = runs["engine"]
                row.update({"engine_tok_s": median([r["tok_s"] for r in eng]),
                            "engine_tok_s_generate": median([r["tok_s_generate"] for r in eng]),
                            "engine_load_s": median([r["load_s"] for r in eng]), "engine_wall_s": median([r["wall_s"] for r in eng]),
                            "tokens": eng[0]["tokens"]})
            if "pipeline" in runs:
                pipe = runs["pipeline"]
                row.update({"pipeline_tok_s": median([r["tok_s"] for r in pipe]), "pipeline_wall_s": median([r["wall_s"] for r in pipe]),
                            "pipeline_tok_s_all": [r["tok_s"] for r in pipe],
                            "pipeline_tokens": pipe[0]["tokens"], "pipeline_errors": pipe[0]["errors"],
                            "occupancy": pipe[0]["occupancy"], "time_breakdown": pipe[0]["time_breakdown"],
                            "pipeline_rows": {k_: v for k_, v in pipe[0]["rows"].items()}})
            if "coordinator" in runs:
                co = runs["coordinator"]
                row.update({"coordinator_tok_s": median([r["tok_s"] for r in co]), "coordinator_wall_s": median([r["wall_s"] for r in co]),
                            "coordinator_target_busy_s": median([r["target_busy_s"] for r in co])})
                if "engine" in runs:  # back-to-back pairs, as the repeats ran
                    row["coordinator_vs_engine"] = median([c["tok_s"] / e["tok_s"] for c, e in zip(co, runs["engine"])])
                    row["coordinator_rows_mismatched"] = sum(co[0]["rows"].get(i) != t for i, t in runs["engine"][0]["rows"].items())
            if "engine" in runs and "pipeline" in runs:
                rows_e, rows_p = runs["engine"][0]["rows"], runs["pipeline"][0]["rows"]
                row["rows_missing"] = len(set(rows_e) - set(rows_p))
                row["rows_mismatched"] = sum(rows_p.get(i) != t for i, t in rows_e.items())
                row["pipeline_vs_engine"] = row["pipeline_tok_s"] / row["engine_tok_s"]
            results.append(row)
            print(json.dumps({k_: v for k_, v in row.items() if k_ != "pipeline_rows"}), flush=True)
    # Every pipeline variant at a batch size must give the same tokens (greedy: drafting changes nothing).
    for b in {r["batch"] for r in results}:
        same = [r["pipeline_rows"] for r in results if r["batch"] == b and "pipeline_rows" in r]
        assert all(x == same[0] for x in same), f"pipeline variants disagree at batch {b}"
    for r in results:
        r.pop("pipeline_rows", None)
        # Against the batch size's first variant, repeat by repeat (the two ran back to back).
        base = next(x for x in results if x["batch"] == r["batch"])
        if "pipeline_tok_s_all" in r:
            r["pipeline_vs_first"] = median([x / y for x, y in zip(r["pipeline_tok_s_all"], base["pipeline_tok_s_all"])])
    ray.shutdown()
    info["loadavg_end"] = loadavg()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"info": info, "results": results}, indent=1))
    print(f"{'B':>3} {'draft':>6} {'K':>4} {'engine tok/s':>12} {'(gen only)':>10} {'pipeline tok/s':>14} {'ratio':>6} {'occ':>5} {'mismatch':>8} "
          f"{'vs first':>8} {'drafted':>7}")
    for r in results:
        f = lambda key, spec: format(r[key], spec) if r.get(key) is not None else "-"  # noqa: E731
        print(f"{r['batch']:>3} {r['draft']:>6} {r['k']!s:>4} {f('engine_tok_s', '.1f'):>12} {f('engine_tok_s_generate', '.1f'):>10} "
              f"{f('pipeline_tok_s', '.1f'):>14} {f('pipeline_vs_engine', '.2f'):>6} {f('occupancy', '.2f'):>5} {f('rows_mismatched', 'd'):>8} "
              f"{f('pipeline_vs_first', '.3f'):>8} {(r.get('time_breakdown') or {}).get('drafted_steps')!s:>7}"
              + (f"  coordinator {f('coordinator_tok_s', '.1f')} tok/s = {f('coordinator_vs_engine', '.3f')} x engine" if "coordinator_tok_s" in r else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
