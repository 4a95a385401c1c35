"""gpu: step costs, plain and speculative tokens/s, and the cost model's bounds. Meant for a GPU; `--quick` runs tiny shapes on a CPU in about a minute, a check
that the scenario works, NOT a measurement.

Per batch size B, on the real runners (`--runners`; the bounds use the first):
    T_target(B, 1), T_target(B, K+1), T_draft(B)   one forward at a context of P + N/2 tokens,
                                                    median of --reps, CUDA events on a GPU;
then B requests of P prompt tokens and N new tokens (greedy, EOS ignored), as variants:
    AR, B=b            SpecEngine + NoDrafter: the target's plain decoding (the baseline)
    raysd a=R, B=b     SpecEngine + DraftModelDrafter, K drafts, acceptance `synthetic:R` (each draft
                       accepted with probability R whatever the models say), or `real` (the exact test)
    ray S mbM a=R, B=b (--ray) the Ray coordinator on the GPU, each model's share num_gpus 0.5, in
                       replica shape S (--shapes: colocated, both models in one actor; split, an
                       actor each), M micro-batches of ceil(B / M) rows (colocated: 1)
Each variant keeps one engine across its runs (its CUDA graphs captured in the warm-up are replayed
after), as a job's replica does. Each timed run generates twice, N and 1 new tokens: tokens/s is bench.measure's (the N-token call,
prefill included); `decode_tokens_per_s` = (tokens(N) - tokens(1)) / (wall(N) - wall(1)), prefill
cancelled. The bounds (raysd.core.theory, E = expected_tokens_per_step(a, K) or the measured tokens
per pass for `real`):
    AR bound          B / T_target(B,1)
    serial bound      B E / (T_target(B,K+1) + K T_draft(B))
    overlapped bound  B E / max(T_target(B,K+1), K T_draft(B))
On ONE GPU draft and target share its memory bandwidth: for memory-bound steps the serial bound is
the physical one (docs/contributing/gpu_runbook.md). Shapes: `--pair random` builds random-weight Llamas of real shapes on
the device ("8b": Llama-3-8B, "1b": Llama-3.2-1B); `--pair smollm2` loads SmolLM2-135M-Instruct and
its first --draft-layers layers (or --draft-model) and prompts from examples/prompts.jsonl.

Each engine variant's runs also carry what its steps' forwards did (graph replays per step, forwards run
eagerly and graphs captured during the run, bytes read per step and per second of stepping, the K -k auto
chose) and its start-up (captures, torch.compile's compiles and their seconds). `--auto` adds a -k auto
variant at each rate; `--kernels` the target's decode and verify forwards' GPU time by kernel kind.

    python -m bench run gpu --quick                                   # CPU smoke run
    python -m bench run gpu --ray --out $OUT/gpu_8b_1b                # on a GPU: 8B/1B, B 1 8 32 64, a .6 .8 .9
    python -m bench run gpu --cuda-graphs on --runners graph --auto --kernels --count-syncs --rates 0.8  # graphs, kernels, syncs
Writes the result JSON and, beside it, a .md with the table.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
import warnings

import torch

from bench.environment import ROOT
from bench.harness import Outcome, Variant, run_variants, summary
from bench.measure import Counts, decode_tokens_per_s, figures
from bench.scenarios.gpu_parts import (DTYPES, build_random_llama, ceilings, count_syncs, floor_step_s, kernel_times,
                                       load_named, load_smollm2, sync, time_forward, truncated, truncated_smollm2)

CUDA = torch.cuda.is_available()
QUICK = {"target_shape": "tiny-target", "draft_shape": "tiny-draft", "pair": "random", "batches": [1, 8], "prompt_len": 16,
         "new_tokens": 16, "reps": 5, "warmup": 2, "repeats": 2, "dtype": "bfloat16" if CUDA else "float32",
         "threads": None if CUDA else 1}


def add_arguments(p) -> None:
    p.set_defaults(repeats=1)
    g = p.add_argument_group("gpu")
    g.add_argument("--pair", choices=["random", "smollm2"], default="random")
    g.add_argument("--target-shape", default="8b")
    g.add_argument("--draft-shape", default="1b")
    g.add_argument("--draft-layers", type=int, default=6, help="--pair smollm2: layers kept in the truncated draft")
    g.add_argument("--draft-model", default=None, help="--pair smollm2: a draft to load instead (e.g. smollm2-135m-instruct-draft)")
    g.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    g.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    g.add_argument("--rates", nargs="+", default=["0.6", "0.8", "0.9"], help='acceptance rates; "real" = the exact test')
    g.add_argument("-k", type=int, default=4)
    g.add_argument("--prompt-len", type=int, default=128)
    g.add_argument("--new-tokens", type=int, default=128)
    g.add_argument("--reps", type=int, default=20, help="timed forwards per step-cost median")
    g.add_argument("--warmup", type=int, default=5)
    g.add_argument("--ray", action="store_true", help="also the Ray coordinator, --micro-batches")
    g.add_argument("--runners", nargs="+", default=None, choices=["dynamic", "static", "graph", "compiled-graph"],
                   help="runners whose step costs are timed (default: static dynamic, + graph on CUDA)")
    g.add_argument("--compile", action="store_true",
                   help="the graphed variants' forwards through torch.compile (EngineConfig/DraftModelDrafter compile)")
    g.add_argument("--steps-only", action="store_true", help="the ceilings and the runners' step costs only: no generation")
    g.add_argument("--count-syncs", action="store_true", help="count host synchronisations per engine step (CUDA)")
    g.add_argument("--auto", action="store_true", help="also -k auto (learned costs, the device's crossover) at each rate")
    g.add_argument("--kernels", action="store_true",
                   help="the target's decode and K + 1 verify forwards' kernel time by kind (GEMM, attention, copies, ...)")
    g.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2], help="a split replica's (a colocated one runs 1)")
    g.add_argument("--shapes", nargs="+", default=["colocated", "split"], choices=["colocated", "split"])
    g.add_argument("--cuda-graphs", choices=["off", "on", "both"], default="both" if CUDA else "off",
                   help="the engine's forwards as CUDA graphs (EngineConfig/DraftModelDrafter cuda_graphs): both = each "
                        "variant eager and graphed, the graphed AR's baseline the eager AR")


def models(a, device):
    """(target, draft, target_factory, draft_factory, prompts): the factories rebuild them in a Ray actor."""
    where = "cuda" if device.type == "cuda" else "cpu"
    if a.pair == "random":
        return (build_random_llama(a.target_shape, a.dtype, device.type, 0), build_random_llama(a.draft_shape, a.dtype, device.type, 1),
                functools.partial(build_random_llama, a.target_shape, a.dtype, where, 0),
                functools.partial(build_random_llama, a.draft_shape, a.dtype, where, 1), None)
    from raysd.models.loading import DEFAULT_MODEL, load_tokenizer

    target = load_smollm2(a.dtype, device.type)
    if a.draft_model:
        draft, draft_factory = load_named(a.draft_model, a.dtype, device.type), functools.partial(load_named, a.draft_model, a.dtype, where)
    else:
        draft, draft_factory = truncated(target, a.draft_layers), functools.partial(truncated_smollm2, a.draft_layers, a.dtype, where)
    tok = load_tokenizer(os.environ.get("RAYSD_SMOLLM2_GGUF") or DEFAULT_MODEL)  # the weights load_smollm2 read
    prompts = []
    for line in (ROOT / "examples" / "prompts.jsonl").read_text().splitlines():
        if line.strip():
            prompt = json.loads(line)["prompt"]  # text, or chat messages (one line of the examples is)
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            ids = tok.apply_chat_template(messages, add_generation_prompt=True)
            prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return target, draft, functools.partial(load_smollm2, a.dtype, where), draft_factory, prompts


def requests(batch: int, prompt_len: int, new_tokens: int, vocab: int, prompts=None) -> list:
    from raysd.core.sampling import SamplingParams
    from raysd.engine.requests import Request

    params = [SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, seed=i) for i in range(batch)]  # own draws per row
    if prompts:
        return [Request(i, prompts[i % len(prompts)], params[i]) for i in range(batch)]
    g = torch.Generator().manual_seed(0)
    return [Request(i, torch.randint(3, vocab, (prompt_len,), generator=g).tolist(), params[i]) for i in range(batch)]


def speculation(k: int, rate: str, eos=(), auto: bool = False):
    """K drafts (under `auto`, -k auto's controller with learned costs, up to K), at acceptance `rate`."""
    from raysd.core.speculation import AdaptiveConfig, SpeculationConfig

    return SpeculationConfig(k, acceptance="exact" if rate == "real" else f"synthetic:{rate}", eos_token_ids=eos,
                             adaptive=AdaptiveConfig() if auto else None)


def decode_run(generate, make) -> dict:
    """Two calls, N and 1 new tokens: the N-token call's figures, and the decode-only rate."""
    full, one = generate(make(None)), generate(make(1))
    return {**full, "decode_tokens_per_s": decode_tokens_per_s(full, one), "prefill_and_first_step_s": one["wall_s"]}


def engine_generate(target, drafter, k, batch, rate, device, reqs, graphs: bool = False, engines: dict | None = None,
                    compile: bool = False, auto: bool = False) -> dict:
    """One SpecEngine.generate. With `engines`, the variant's engine is made on its first run and kept
    for the next (its warm-up's, then the timed ones), as a job's replica keeps one: the CUDA graphs it
    captured (every program its steps replay, before its first step) are replayed, not captured again.
    Beside the rates: the run's steps, what their forwards did (graph replays, eager forwards and
    captures during the run: 0 and 0 in steady state) and the bytes they read per step and per second
    of stepping; and the engine's start-up so far (captures, their seconds, torch.compile's compiles)."""
    from raysd.engine.engine import EngineConfig, SpecEngine

    key = (k, batch, rate, graphs, compile, auto)
    engine = None if engines is None else engines.get(key)
    if engine is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the synthetic-acceptance warning: the variant says so
            engine = SpecEngine(target, drafter(), EngineConfig(speculation(k, rate, auto=auto), max_batch_size=batch,
                                                                cuda_graphs=graphs, compile=compile))
        if engines is not None:
            engines[key] = engine
    before = dataclasses.replace(engine.timings)
    sync(device)
    start = time.perf_counter()
    results = engine.generate(reqs)
    sync(device)
    t = engine.timings
    steps, stepping_s = t.steps - before.steps, (t.draft_s - before.draft_s) + (t.verify_s - before.verify_s)
    bytes_read = t.bytes_read - before.bytes_read
    chosen = {} if engine.k_controller is None else {f"k{k}": n for (k, _), n in sorted(engine.k_controller.chosen.items())}
    return figures(Counts.of_results(results), time.perf_counter() - start, timed="SpecEngine.generate",
                   draft_s=t.draft_s - before.draft_s, verify_s=t.verify_s - before.verify_s, steps=steps,
                   graph_replays_per_step=(t.graph_replays - before.graph_replays) / max(steps, 1),
                   eager_forwards=t.eager_forwards - before.eager_forwards,
                   run_captures=t.graph_captures - before.graph_captures,
                   bytes_per_step=bytes_read / max(steps, 1), read_tb_s=bytes_read / stepping_s / 1e12 if stepping_s else None,
                   startup_captures=t.graph_captures, startup_capture_s=t.capture_s, startup_compiles=t.compiles,
                   startup_compile_s=t.compile_s, k_chosen=chosen)


def ray_variants(a, target_factory, draft_factory, V, prompts, baselines: dict, log) -> tuple[list[Variant], dict]:
    """For each micro-batch count M: one coordinator (its actors load the models once), every (B, a) point."""
    import ray

    from raysd.actors import ActorResources, CoordinatorConfig, DrafterSpec, SpecCoordinator
    from raysd.actors.local import start_local_ray

    start_local_ray(num_cpus=4, num_gpus=1 if CUDA else 0, log_to_driver=False, configure_logging=False)
    res = ActorResources(num_cpus=1, num_gpus=0.5 if CUDA else 0.0)
    variants, runs = [], {}
    try:
        for shape in a.shapes:
            for M in (a.micro_batches if shape == "split" else [1]):
                config = CoordinatorConfig(speculation(a.k, "real"), micro_batch_size=1, num_micro_batches=M,
                                           draft_resources=res, target_resources=res, measure_bytes=False)
                with SpecCoordinator(target_factory, DrafterSpec(draft_factory, shape=shape), config) as c:
                    mine = []
                    for B in a.batches:
                        for rate in a.rates:
                            def generate(reqs, B=B, rate=rate):
                                c.config = dataclasses.replace(config, speculation=speculation(a.k, rate), micro_batch_size=math.ceil(B / M))
                                start = time.perf_counter()
                                out = c.generate(reqs)
                                return figures(Counts.of_results(out.results), time.perf_counter() - start, timed="SpecCoordinator.generate",
                                               overlap_efficiency=out.stats.overlap_efficiency)

                            make = functools.partial(lambda n, B: requests(B, a.prompt_len, n or a.new_tokens, V, prompts), B=B)
                            mine.append(Variant(f"ray {shape} mb{M} a={rate}, B={B}",
                                                {"side": "ray", "shape": shape, "micro_batches": M, "batch": B, "rate": rate},
                                                functools.partial(decode_run, generate, make), baselines[B],
                                                functools.partial(generate, requests(B, a.prompt_len, 4, V, prompts))))
                    _, r = run_variants(mine, a.repeats, ratio_keys=("decode_tokens_per_s",), log=log)
                    variants, runs = variants + mine, {**runs, **r}
    finally:
        ray.shutdown()
    return variants, runs


def run(a, log=print) -> Outcome:
    from raysd.core.theory import expected_tokens_per_step, overlapped_speedup, serial_speedup
    from raysd.engine.drafters import DraftModelDrafter, NoDrafter

    device = torch.device("cuda" if CUDA else "cpu")
    if not CUDA and not a.quick:
        log("WARNING: no CUDA device; these are CPU numbers, not GPU numbers")
    target, draft, target_factory, draft_factory, prompts = models(a, device)
    V, K = target.get_output_embeddings().weight.shape[0], a.k
    ctx = a.prompt_len + a.new_tokens // 2
    runners = a.runners or (["static", "dynamic"] + (["graph"] if CUDA else []))
    ceiling = ceilings(device)  # measured in this run, before the models' steps
    if ceiling:
        log(f"ceilings: bf16 matmul {ceiling['bf16_tflops']:.0f} TFLOP/s, copy {ceiling['copy_tb_s']:.2f} TB/s")
    steps, syncs, kernels, variants, baselines, errors = {}, {}, {}, [], {}, {}
    engines = {}  # one engine per variant, kept across its runs (engine_generate)
    graph_modes = {"off": [False], "on": [True], "both": [False, True]}[a.cuda_graphs]
    if True in graph_modes:  # a first graphed run on this device: if capture fails, the eager figures still come
        try:
            smoke = requests(2, a.prompt_len, 8, V, prompts)
            engine_generate(target, lambda: NoDrafter(V, device), 0, 2, "real", device, smoke, graphs=True)
            engine_generate(target, lambda: DraftModelDrafter(draft, V, cuda_graphs=True, compile=False), K, 2, "real", device, smoke,
                            graphs=True)
        except Exception as e:
            errors["cuda_graphs"] = f"{type(e).__name__}: {e}"[:500]
            log(f"CUDA graphs FAILED, graphed variants left out: {errors['cuda_graphs']}")
            graph_modes = [g for g in graph_modes if not g] or [False]
    for B in a.batches:
        steps[B] = {}
        for kind in runners:
            try:
                steps[B][kind] = {name: time_forward(m, B, ctx, w, a.reps, a.warmup, V, runner_kind=kind)
                                  for name, m, w in (("target_1", target, 1), ("target_k1", target, K + 1), ("draft", draft, 1))}
            except Exception as e:  # one runner failing (say a CUDA graph capture) is a result; the others still run
                if kind == runners[0]:
                    raise
                errors[f"B={B} {kind}"] = f"{type(e).__name__}: {e}"[:500]
                log(f"B={B} [{kind}] FAILED: {errors[f'B={B} {kind}']}")
        log(f"B={B}: " + "; ".join(f"[{k}] " + ", ".join(f"{n} {t['median_s'] * 1e3:.2f} ms" for n, t in s.items())
                                  for k, s in steps[B].items()))
        if a.steps_only:
            continue
        if a.kernels and CUDA:
            kernels[B] = {f"target_{w}": kernel_times(target, B, ctx, w, V) for w in (1, K + 1)}
            log(f"B={B} kernels: " + "; ".join(f"{name}: " + ", ".join(f"{kind} {ms:.2f}" for kind, ms in k["ms_by_kind"].items())
                                              for name, k in kernels[B].items()))
        if a.count_syncs:
            syncs[B] = {f"{'graphs' if g else 'eager'}": count_syncs(target, draft, V, K, B,
                                                                    lambda n, B=B: requests(B, a.prompt_len, n, V, prompts), device, g)
                        for g in graph_modes}
        make = functools.partial(lambda n, B: requests(B, a.prompt_len, n or a.new_tokens, V, prompts), B=B)
        baselines[B] = f"AR, B={B}"
        for graphs in graph_modes:
            compiled = a.compile and graphs
            tag = (" graphs" if graphs else "") + (" compiled" if compiled else "")
            ar_name = f"AR{tag}, B={B}"
            ar = functools.partial(engine_generate, target, lambda: NoDrafter(V, device), 0, B, "real", device, graphs=graphs,
                                   engines=engines, compile=compiled)
            variants.append(Variant(ar_name, {"side": "engine", "batch": B, "k": 0, "graphs": graphs, "compile": compiled},
                                    functools.partial(decode_run, ar, make), None if ar_name == baselines[B] else baselines[B],
                                    functools.partial(ar, make(4))))
            for rate in a.rates:
                for auto in (False, True) if a.auto else (False,):
                    sd = functools.partial(engine_generate, target,
                                           lambda g=graphs, c=compiled: DraftModelDrafter(draft, V, cuda_graphs=g, compile=c),
                                           K, B, rate, device, graphs=graphs, engines=engines, compile=compiled, auto=auto)
                    name = f"raysd{tag}{' auto' if auto else ''} a={rate}, B={B}"
                    variants.append(Variant(name, {"side": "engine", "batch": B, "k": K, "rate": rate, "graphs": graphs,
                                                   "compile": compiled, "auto": auto},
                                            functools.partial(decode_run, sd, make), ar_name, functools.partial(sd, make(4))))
    _, runs = run_variants(variants, a.repeats, ratio_keys=("decode_tokens_per_s",), log=log)
    params = {"target_params": sum(p.numel() for p in target.parameters()), "draft_params": sum(p.numel() for p in draft.parameters())}
    target_config, target_element = target.config, next(target.parameters()).element_size()
    target_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    if a.ray:
        del target, draft
        if CUDA:
            torch.cuda.empty_cache()
        more, more_runs = ray_variants(a, target_factory, draft_factory, V, prompts, baselines, log)
        variants, runs = variants + more, {**runs, **more_runs}
    summaries = [summary(v, runs, ("tokens_per_s", "decode_tokens_per_s")) for v in variants]
    def timed(st) -> dict:  # the step costs a variant is held to: the graph replay's for a graphed one, when timed
        B = st["batch"]
        for kind, wanted in (("compiled-graph", st.get("compile")), ("graph", st.get("graphs"))):
            if wanted and kind in steps[B]:
                return steps[B][kind]
        return steps[B][runners[0]]

    floors, step_floors = {}, {}
    if ceiling:
        floor_s = {B: floor_step_s(target_config, target_bytes, target_element, B, ctx, ceiling["copy_tb_s"] * 1e12) for B in steps}
        for B, by_kind in steps.items():  # each runner's one-token step against the bandwidth floor's
            step_floors[str(B)] = {kind: floor_s[B] / t["target_1"]["median_s"] for kind, t in by_kind.items()}
            log(f"B={B} step of floor ({floor_s[B] * 1e3:.2f} ms): " + ", ".join(f"[{k}] {f:.2f}" for k, f in step_floors[str(B)].items()))
        for v in summaries:
            st = v["settings"]
            if st.get("side") == "engine" and not st["k"]:
                B, key = st["batch"], f"{st['batch']}" + (" graphs" if st.get("graphs") else "") + (" compiled" if st.get("compile") else "")
                floor = B / floor_s[B]
                got = v["median"].get("decode_tokens_per_s")
                floors[key] = {"floor_tokens_per_s": floor, "ar_decode_tokens_per_s": got,
                                  "of_floor": got / floor if got else None,
                                  "step_of_floor": (B / timed(st)["target_1"]["median_s"]) / floor}
    bounds = []
    for v in summaries:
        st = v["settings"]
        if st.get("side") != "engine" or not st["k"] or st.get("auto"):  # -k auto's K varies: no one E
            continue
        t1, tk, td = (timed(st)[x]["median_s"] for x in ("target_1", "target_k1", "draft"))
        rate, B = st["rate"], st["batch"]
        E = v["median"]["mean_acceptance_length"] if rate == "real" else expected_tokens_per_step(float(rate), K)
        serial, over = B / t1 * serial_speedup(E, t1, tk, td, K), B / t1 * overlapped_speedup(E, t1, tk, td, K)
        got = v["median"].get("decode_tokens_per_s")
        bounds.append({"batch": B, "rate": rate, "graphs": bool(st.get("graphs")), "E": E, "t_target_1_ms": t1 * 1e3, "t_target_k1_ms": tk * 1e3,
                       "t_draft_ms": td * 1e3, "ar_bound": B / t1, "serial_bound": serial, "overlapped_bound": over,
                       "of_serial": got / serial if got else None, "of_overlapped": got / over if got else None})
    env = {"device": torch.cuda.get_device_name(0) if CUDA else "cpu", **params}
    extra = {"env": env, "ceilings": ceiling, "floors": floors, "step_floors": step_floors, "runner_errors": errors,
             "step_costs": {str(b): s for b, s in steps.items()}, "host_syncs": {str(b): s for b, s in syncs.items()},
             "kernels": {str(b): k for b, k in kernels.items()},
             "bounds": bounds}
    return Outcome(summaries, extra, markdown=markdown(a, env, summaries, bounds, floors, ceiling))


def markdown(a, env, summaries, bounds, floors=None, ceiling=None) -> str:
    from bench.measure import fmt

    head = (f"{env['device']}, {a.dtype}, target {env['target_params'] / 1e9:.2f}B / draft {env['draft_params'] / 1e9:.2f}B "
            f"params, K={a.k}, prompt {a.prompt_len}, {a.new_tokens} new tokens, greedy"
            + (" (QUICK: tiny shapes, not a measurement)" if a.quick else ""))
    lines = [head, "", "| variant | tok/s | decode tok/s | decode / AR | tokens/pass |", "|---|---|---|---|---|"]
    for v in summaries:
        m = v["median"]
        lines.append(f"| {v['name']} | {fmt(m.get('tokens_per_s'), 1)} | {fmt(m.get('decode_tokens_per_s'), 1)} | "
                     f"{fmt(v.get('ratio', {}).get('decode_tokens_per_s', {}).get('median'))} | {fmt(m.get('mean_acceptance_length'))} |")
    lines += ["", "| B | a | E | T_t(B,1) ms | T_t(B,K+1) ms | T_d(B) ms | AR bound | serial bound | overlapped bound | "
              "% serial | % overlapped |", "|" + "---|" * 11]
    for b in bounds:
        pct = lambda x: "-" if x is None else f"{x:.0%}"  # noqa: E731
        lines.append(f"| {b['batch']} | {b['rate']}{' graphs' if b.get('graphs') else ''} | {b['E']:.2f} | {b['t_target_1_ms']:.2f} | {b['t_target_k1_ms']:.2f} | "
                     f"{b['t_draft_ms']:.2f} | {b['ar_bound']:.0f} | {b['serial_bound']:.0f} | {b['overlapped_bound']:.0f} | "
                     f"{pct(b['of_serial'])} | {pct(b['of_overlapped'])} |")
    if floors:
        lines += ["", f"Ceilings measured in this run: bf16 matmul {ceiling['bf16_tflops']:.0f} TFLOP/s, copy {ceiling['copy_tb_s']:.2f} TB/s "
                  "(read + write). Floor: weights + KV cache read once per step at that rate.", "",
                  "| B | floor tok/s | AR decode tok/s | AR / floor | one forward / floor (static; graphs: its replay) |", "|---|---|---|---|---|"]
        for B, f in floors.items():
            lines.append(f"| {B} | {f['floor_tokens_per_s']:.0f} | {fmt(f['ar_decode_tokens_per_s'], 1)} | "
                         f"{fmt(f['of_floor'])} | {f['step_of_floor']:.2f} |")
    return "\n".join(lines) + "\n"
