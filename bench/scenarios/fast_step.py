"""fast_step: what raysd adds per step and per job when a step takes milliseconds, as on a GPU.

On a GPU an 8B target's decode step takes milliseconds; the embedded SmolLM2's on a CPU takes a
hundred or so, which hides what the actors and Ray Data cost. This scenario builds (once per run,
in a temporary directory) a random Llama target of hidden 256, 4 layers, vocabulary 8192, float32,
whose step costs a few milliseconds on a CPU, and drafts of the same shape: a random 1-layer
draft (`draft:K`, almost never accepted), the target's first half (`half:K`: its first layers with
its embedding and head, accepted often) and the target itself (`self:K`: every draft accepted);
token-id prompts of 16-64 random tokens; greedy, no EOS (every row makes --max-new-tokens). The
actors and pipeline sides run each replica shape of --shapes (colocated: the draft model in the
target's actor; split: an actor each).

    engine     SpecEngine.generate over every prompt (max_batch_size = B), models loaded first (untimed
               for tokens/s; `with_load_s` includes them)
    actors     a job's replica (GenerationReplica: its SpecCoordinator, same resources) in a Ray actor
               as Ray Data runs it, its generate; timed from its construction (actors and models)
               and without (`generate_s`)
    pipeline   raysd.jobs.runner.generate on a JSON Lines file of the prompts: its summary's wall,
               and the wall's phases (time_breakdown["wall"])

Reported per variant: tokens/s (of the whole call on each side, the models' load excluded on the
engine side, included on the others, as a user pays it), and:
    per_step_overhead_us  (this side's generate seconds - the engine's) / the engine's steps, paired
                          per repeat: what the side adds per step (actors: `generate_s`; pipeline:
                          its `generating` phase)
    fixed_s               the pipeline's wall less its `generating` phase: Ray, actors, models, first
                          block, last write, shutdown

    python -m bench run fast_step                                  # 256 prompts x 128 tokens, B = 8 and 32
    python -m bench run fast_step --drafters none,half:4,self:4 --shapes colocated,split --batch-sizes 8
"""

from __future__ import annotations

import functools
import json
import os
import random
import tempfile
import time

from bench.harness import Outcome, Variant, run_variants
from bench.measure import Counts, figures
from bench.workload import int_list, str_list

QUICK = {"prompts": 8, "max_new_tokens": 8, "batch_sizes": [4], "repeats": 1, "drafters": ["none", "half:4"],
         "shapes": ["colocated"]}
SIDES = ("engine", "actors", "pipeline")
SHAPE = {"vocab_size": 8192, "hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 2048}
# --device cuda: Llama-3.2-1B's shape (16 layers; the draft keeps 1), in bfloat16, both actors on the one GPU.
GPU_SHAPE = {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
             "num_key_value_heads": 8, "max_position_embeddings": 2048, "rope_theta": 500000.0, "tie_word_embeddings": True}


def add_arguments(p) -> None:
    g = p.add_argument_group("fast_step")
    g.add_argument("--prompts", type=int, default=256)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--batch-sizes", type=int_list, default=[8, 32])
    g.add_argument("--drafters", type=str_list, default=["none", "draft:4"],
                   help="none, draft:K (the random 1-layer draft, K a number or auto), half:K (the target's first "
                        "half), self:K (the target itself), ngram:K, suffix:K")
    g.add_argument("--shapes", type=str_list, default=["colocated"],
                   help="the replica shapes of the actors and pipeline sides: colocated, split")
    g.add_argument("--sides", type=str_list, default=list(SIDES), help=f"any of {', '.join(SIDES)}")
    g.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: a 1B-shaped bf16 target on the GPU, the job's actors sharing it (0.5 GPU each)")
    g.add_argument("--cuda-graphs", action="store_true",
                   help="every side replays its small forwards as CUDA graphs (EngineConfig / raysd generate --cuda-graphs); "
                        "with --device cuda")


def build_models(root: str, device: str = "cpu") -> tuple[str, str]:
    """The target and a 1-layer draft, random, saved as safetensors under `root`: on the CPU 4 layers of
    SHAPE in float32, on a GPU GPU_SHAPE's 16 in bfloat16 (built on the device: faster); and beside
    them `half`, the target's first half of layers (its embedding and head kept)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape, layers, dtype = (GPU_SHAPE, 16, torch.bfloat16) if device == "cuda" else (SHAPE, 4, torch.float32)
    paths = []
    for name, n, seed in (("target", layers, 0), ("draft", 1, 1)):
        torch.manual_seed(seed)
        # No EOS: every side (the engine, and a job, which has no flag to ignore it) makes max_new_tokens per row.
        config = LlamaConfig(num_hidden_layers=n, bos_token_id=None, eos_token_id=None, pad_token_id=0, **shape)
        path = os.path.join(root, name)
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = LlamaForCausalLM(config).eval()
        finally:
            torch.set_default_dtype(old)
        model.save_pretrained(path)
        paths.append(path)
        if name == "target":  # its first half: the same embedding, head and first layers
            model.model.layers = model.model.layers[: n // 2]
            model.config.num_hidden_layers = n // 2
            model.save_pretrained(os.path.join(root, "half"))
    return paths[0], paths[1]


def parse_drafter(text: str, draft_dir: str, target_dir: str) -> tuple[str, str, int | str]:
    """(label, --draft value, K): "none", "draft:4" (the random 1-layer draft), "half:4" (the target's
    first half), "self:4" (the target), "ngram:auto", "suffix:4"."""
    name, _, k = text.partition(":")
    if name == "none":
        return "none", "none", 0
    dirs = {"draft": draft_dir, "half": os.path.join(os.path.dirname(target_dir), "half"), "self": target_dir}
    return f"{name} K={k or 4}", dirs.get(name, name), k if k == "auto" else int(k or 4)


def job_config(target: str, draft: str, k, batch: int, max_new: int, device: str = "cpu", cuda_graphs: bool = False,
               shape: str = "auto", **paths):
    from raysd.jobs.config import GenerateConfig

    cfg = GenerateConfig(input=paths.get("input", "-"), output=paths.get("output", "-"), target=target, draft=draft,
                         num_speculative_tokens=None if draft == "none" else k, max_new_tokens=max_new, batch_size=batch,
                         quiet=True, overwrite=True, num_gpus_per_actor=0.5 if device == "cuda" else 0.0, cuda_graphs=cuda_graphs,
                         replica_shape=shape)
    return cfg.resolve_actor_cpus(os.cpu_count())  # as a job resolves --num-cpus-per-actor auto on its own Ray


def requests(prompts, max_new: int):
    from raysd.core.sampling import SamplingParams
    from raysd.engine.requests import Request

    params = SamplingParams(max_new_tokens=max_new)
    return [Request(str(i), p, params) for i, p in enumerate(prompts)]


def engine_run(target_dir, draft, k, batch, prompts, a) -> dict:
    import torch

    from raysd.engine.drafters import DraftModelDrafter, NgramDrafter, NoDrafter
    from raysd.engine.engine import EngineConfig, SpecEngine
    from raysd.engine.suffix import SuffixDrafter
    from raysd.models.loading import ModelSpec, load_model

    cfg = job_config(target_dir, draft, k, batch, a.max_new_tokens, a.device, a.cuda_graphs)
    torch.set_num_threads(cfg.target_threads)  # what the job's target actor gets
    start = time.perf_counter()
    spec = ModelSpec(target_dir, cfg.target_dtype, device=a.device).resolved()  # the job's dtype on this device
    target = load_model(spec)
    V = target.config.vocab_size
    device = torch.device(a.device)
    drafter = (NoDrafter(V, device) if draft == "none" else NgramDrafter(V, device) if draft == "ngram" else SuffixDrafter(V)
               if draft == "suffix" else DraftModelDrafter(load_model(ModelSpec(draft, spec.dtype, device=a.device)), V,
                                                          cuda_graphs=a.cuda_graphs, compile=False))
    # as the job's: graphs as --cuda-graphs says, no torch.compile (raysd generate's --compile)
    engine = SpecEngine(target, drafter, EngineConfig(cfg.speculation, max_batch_size=batch, cuda_graphs=a.cuda_graphs,
                                                      compile=False))
    loaded = time.perf_counter()
    with torch.inference_mode():
        results = engine.generate(requests(prompts, a.max_new_tokens))
    if device.type == "cuda":
        torch.cuda.synchronize()
    end = time.perf_counter()
    return figures(Counts.of_results(results), end - loaded, timed="SpecEngine.generate", with_load_s=end - start,
                   generate_s=end - loaded, steps=engine.timings.steps,
                   _rows={str(r.request_id): list(r.token_ids) for r in results})


def actors_run(target_dir, draft, k, batch, prompts, a, shape="auto") -> dict:
    import ray

    from raysd.actors.local import start_local_ray
    from raysd.jobs.replica import GenerationReplica

    cfg = job_config(target_dir, draft, k, batch, a.max_new_tokens, a.device, a.cuda_graphs, shape)
    gpus = {"num_gpus": 1} if a.device == "cuda" else {}
    start_local_ray(num_cpus=(os.cpu_count() or 1) + 1, log_to_driver=False, configure_logging=False, **gpus)  # untimed
    try:
        # The job's own replica (coordinator, actors, micro-batches, K) in a Ray actor as Ray Data runs
        # it (a Ray worker, at Ray's worker niceness), without Ray Data; the prompts travel with the call.
        start = time.perf_counter()
        replica = ray.remote(num_cpus=0)(GenerationReplica).remote(cfg)
        try:
            ray.get(replica.__ray_ready__.remote())
            built = time.perf_counter()
            per_prompt, stats, _ = ray.get(replica.generate.remote([{"id": str(i), "prompt": p} for i, p in enumerate(prompts)]))
            end = time.perf_counter()
            rows = [r for [r] in per_prompt]  # one sample per prompt
        finally:
            ray.get(replica.shutdown.remote())
    finally:
        ray.shutdown()
    return figures(Counts.of_rows(rows), end - start, timed="the replica's start (actors, models) + its generate",
                   generate_s=end - built, start_s=built - start, steps=stats.steps,
                   _rows={str(i): list(r["generated_token_ids"]) for i, r in enumerate(rows)})


def pipeline_run(target_dir, draft, k, batch, prompt_file, workdir, a, shape="auto") -> dict:
    import pyarrow.parquet as pq

    from raysd.jobs.runner import generate

    out = tempfile.mkdtemp(dir=workdir)
    run = generate(job_config(target_dir, draft, k, batch, a.max_new_tokens, a.device, a.cuda_graphs, shape, input=prompt_file,
                              output=out)).latest_run
    rows = pq.read_table(out).to_pylist()
    wall = run.time_breakdown["wall"]
    return figures(Counts.of_rows(rows), run.wall_s, timed="raysd generate: the run's wall", generate_s=wall.get("generating"),
                   fixed_s=run.wall_s - wall.get("generating", 0.0), wall_phases=wall, occupancy=run.occupancy,
                   _rows={str(r["id"]): list(r["generated_token_ids"]) for r in rows})


def run(a, log=print) -> Outcome:
    import ray

    if a.cuda_graphs and a.device != "cuda":
        raise ValueError("fast_step: --cuda-graphs needs --device cuda")
    root = tempfile.mkdtemp(prefix="raysd-bench-fast-step-")
    target_dir, draft_dir = build_models(root, a.device)
    rng = random.Random(0)
    vocab = (GPU_SHAPE if a.device == "cuda" else SHAPE)["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 64))] for _ in range(a.prompts)]
    prompt_file = os.path.join(root, "prompts.jsonl")
    with open(prompt_file, "w") as f:
        f.writelines(json.dumps({"id": str(i), "prompt": p}) + "\n" for i, p in enumerate(prompts))
    variants = []  # the actors and pipeline sides each start (and stop) their own local Ray, as a job does
    for B in a.batch_sizes:
        for text in a.drafters:
            label, draft, k = parse_drafter(text, draft_dir, target_dir)
            engine_name = f"engine {label}, B={B}"
            settings = {"drafter": text, "batch": B}
            if "engine" in a.sides:
                variants.append(Variant(engine_name, {**settings, "side": "engine"},
                                        functools.partial(engine_run, target_dir, draft, k, B, prompts, a)))
            base = engine_name if "engine" in a.sides else None
            for shape in a.shapes if draft != "none" else a.shapes[:1]:  # plain decoding has one shape
                make = {"actors": functools.partial(actors_run, target_dir, draft, k, B, prompts, a, shape),
                        "pipeline": functools.partial(pipeline_run, target_dir, draft, k, B, prompt_file, root, a, shape)}
                for side in (s for s in a.sides if s != "engine"):
                    variants.append(Variant(f"{side} {shape} {label}, B={B}", {**settings, "side": side, "shape": shape},
                                            make[side], base))
    try:
        summaries, runs = run_variants(variants, a.repeats, log=log)
    finally:
        if ray.is_initialized():
            ray.shutdown()
    overhead_per_step(variants, summaries, runs)
    shape = {**GPU_SHAPE, "num_hidden_layers": 16, "dtype": "bfloat16"} if a.device == "cuda" else SHAPE
    return Outcome(summaries, {"shape": shape, "device": a.device, "prompts": len(prompts), "max_new_tokens": a.max_new_tokens},
                   {"rows_equal_across_sides": rows_check(variants, runs, NearTie(target_dir, a.device, prompts))})


def overhead_per_step(variants, summaries, runs) -> None:
    """Each side's per-step overhead against its engine variant, paired per repeat (median, in us)."""
    import statistics

    by_name = {s["name"]: s for s in summaries}
    for v in variants:
        if v.baseline is None:
            continue
        pairs = [(mine["generate_s"] - base["generate_s"]) / base["steps"] * 1e6
                 for mine, base in zip(runs[v.name], runs[v.baseline]) if mine.get("generate_s") is not None]
        if pairs:
            by_name[v.name]["median"]["per_step_overhead_us"] = statistics.median(pairs)


def rows_check(variants, runs, near_tie=None) -> dict:
    """Greedy: every side's rows equal the engine's (first repeat). Where a row differs, at which token
    first; a row whose first difference is a near-tie of the target (`near_tie(row, prefix, a, b)`, the
    prefix the common tokens before it, a and b the two sides' tokens there:
    rounding, not a bug: another batch shape picks the other of two tokens) is listed apart and passes."""
    bad, ties = {}, {}
    for v in variants:
        if v.baseline is None:
            continue
        mine, base = runs[v.name][0]["_rows"], runs[v.baseline][0]["_rows"]
        for row, tokens in base.items():
            got = mine.get(row, [])
            if got == tokens:
                continue
            j = next((i for i, (a, b) in enumerate(zip(got, tokens)) if a != b), min(len(got), len(tokens)))
            tie = (near_tie(row, tokens[:j], got[j], tokens[j])
                   if near_tie is not None and len(got) == len(tokens) and j < len(tokens) else None)
            (ties if tie and tie["near_tie"] else bad).setdefault(v.name, {})[row] = {"position": j, **(tie or {})}
    return {"ok": not bad, "mismatched": bad, "near_ties": ties}


class NearTie:
    """tests/gpu/gpu_helpers.py's rule at one position: the target's logits over prompt + prefix in
    higher precision (float64 for a float32 model, float32 for bfloat16) and in its own dtype; err is
    their largest difference over the 32 best tokens and the two in question, and the two tokens are a
    near-tie when each is within 4 err of the maximum. Models load on first use, once."""

    def __init__(self, target_dir: str, device: str, prompts: list[list[int]]):
        self.target_dir, self.device, self.prompts, self.models = target_dir, device, prompts, None

    def __call__(self, row: str, prefix: list[int], a: int, b: int) -> dict:
        import torch
        from transformers import LlamaForCausalLM

        if self.models is None:
            own = torch.bfloat16 if self.device == "cuda" else torch.float32
            ref = torch.float32 if own == torch.bfloat16 else torch.float64
            self.models = [LlamaForCausalLM.from_pretrained(self.target_dir, dtype=d).to(self.device).eval() for d in (own, ref)]
        ids = torch.tensor([self.prompts[int(row)] + list(prefix)], device=self.device)
        with torch.no_grad():
            low, ref = (m(ids).logits[0, -1].double().cpu() for m in self.models)
        top = torch.topk(ref, 32).indices.tolist()
        err = float((low - ref)[top + [a, b]].abs().max())
        gap_a, gap_b = float(ref.max() - ref[a]), float(ref.max() - ref[b])
        return {"near_tie": max(gap_a, gap_b) <= 4 * err + 1e-6, "gaps": [gap_a, gap_b], "err": err}
