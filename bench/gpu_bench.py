#!/usr/bin/env python3
"""GPU step-cost and throughput benchmark (issue 8).

Per batch size B it measures, on the real runner (raysd.models.runner.ModelRunner):

  T_target(B, 1), T_target(B, K+1), T_draft(B)   one forward at a context of P + N/2 tokens,
                                                 median of --reps, CUDA events on a GPU;

then generates B requests of P prompt tokens and N new tokens (greedy, EOS ignored) with

  AR      SpecEngine + NoDrafter (K = 0): the target's plain autoregressive decoding
  raysd   SpecEngine + DraftModelDrafter, K drafts, acceptance rate a
          (synthetic acceptance: EngineConfig(synthetic_acceptance_rate=a); "real" = the exact test)
  ray-mbM the Ray coordinator, draft and target actors sharing one GPU (num_gpus=0.5 each),
          M = 1 and 2 micro-batches of B/M rows (--ray)

and reports decode tokens/s = B (N - 1) / (wall(N) - wall(1)): the difference of two runs, so
prefill and admission cancel and only decode steps are counted. From the step costs it
computes the cost-model bounds of raysd.core.theory, with E = expected_tokens_per_step(a, K):

  AR bound          B / T_target(B,1)
  serial bound      B E / (T_target(B,K+1) + K T_draft(B))        (= AR bound x serial_speedup)
  overlapped bound  B E / max(T_target(B,K+1), K T_draft(B))      (= AR bound x overlapped_speedup)

and the fraction of each reached. On ONE GPU the draft and the target share its memory
bandwidth, so for memory-bound steps (B <= ~64 on an H100 for these shapes) their times add
up whatever the overlap: the serial bound is the physical one there, the overlapped bound
needs the two models on two devices (docs/gpu.md).

Shapes: `--pair random` builds random-weight Llama models of real shapes ("8b": Llama-3-8B,
"1b": Llama-3.2-1B) directly on the device in --dtype; `--pair smollm2` loads the real
SmolLM2-135M-Instruct weights (target) and its first --draft-layers layers (draft);
`--quick` uses tiny shapes that run on a CPU in well under two minutes: a check that the
script works, NOT a measurement of anything that matters.

    python bench/gpu_bench.py --quick                       # CPU smoke run
    python bench/gpu_bench.py --out out/gpu_bench --ray     # on a GPU: 8B/1B, B 1 8 32 64, a .6 .8 .9

Writes <out>.json (everything) and <out>.md (the table), and prints the table last.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from raysd.actors.local import start_local_ray  # noqa: E402
from raysd.core.sampling import SamplingParams  # noqa: E402
from raysd.core.theory import expected_tokens_per_step, overlapped_speedup, serial_speedup  # noqa: E402
from raysd.engine.drafters import DraftModelDrafter, NoDrafter  # noqa: E402
from raysd.engine.engine import EngineConfig, SpecEngine  # noqa: E402
from raysd.engine.rows import Request  # noqa: E402
from raysd.models.runner import ModelRunner  # noqa: E402

try:  # the engine warns on every synthetic-acceptance engine; the bench knows
    from raysd.engine.engine import SyntheticAcceptanceWarning
except ImportError:  # pragma: no cover
    SyntheticAcceptanceWarning = UserWarning

SHAPES = {
    # Llama-3-8B: 8.0B parameters, 16 GB in bf16.
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False),
    # Llama-3.2-1B: 1.24B parameters (tied embeddings), 2.5 GB in bf16.
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True),
    # --quick: tiny, for a CPU smoke run.
    "tiny-target": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=256, vocab_size=2048, tie_word_embeddings=False),
    "tiny-draft": dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, vocab_size=2048, tie_word_embeddings=True),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# ---------------------------------------------------------------- models


def build_random_llama(shape: str, dtype: str = "bfloat16", device: str = "cuda", seed: int = 0):
    """A random-weight LlamaForCausalLM of a real shape, built directly on `device` in `dtype`.

    Weights ~ N(0, 0.02) (norms 1): never zeros, which can time faster than real data."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if device == "cuda" and not torch.cuda.is_available():
        device = "cpu"
    cfg = LlamaConfig(max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, pad_token_id=0, **SHAPES[shape])
    old = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[dtype])
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return model.to(DTYPES[dtype]).eval()


def smollm2_source() -> str:
    path = os.environ.get("RAYSD_SMOLLM2_GGUF")
    if path:
        return path
    from raysd.models.loading import DEFAULT_MODEL

    return DEFAULT_MODEL


def load_smollm2(dtype: str, device: str):
    """Dequantized in fp32, then cast (a GGUF loaded straight "in bf16" may keep packed
    weights and compute in fp32)."""
    from raysd.models.loading import ModelSpec, load_model

    return load_model(ModelSpec(name=smollm2_source(), dtype="float32", device=device)).to(DTYPES[dtype])


def truncated(model, layers: int):
    import copy

    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:layers]
    draft.config.num_hidden_layers = layers
    if getattr(draft.config, "layer_types", None):
        draft.config.layer_types = draft.config.layer_types[:layers]
    return draft.eval()


def load_named(name: str, dtype: str, device: str):
    """Any model raysd.models.loading knows (HF id, path, GGUF, a distilled draft)."""
    from raysd.models.loading import ModelSpec, load_model

    return load_model(ModelSpec(name=name, dtype=dtype, device=device))


def truncated_smollm2(layers: int, dtype: str, device: str):
    """Picklable factory body for the Ray draft actor (--pair smollm2)."""
    return truncated(load_smollm2(dtype, device), layers)


# ---------------------------------------------------------------- timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """Median seconds of one region: CUDA events on a GPU (the region's span on the GPU's
    timeline, host launch gaps included), perf_counter after a synchronize elsewhere."""

    def __init__(self, device: torch.device):
        self.device = device
        self.samples: list[float] = []

    def __enter__(self):
        sync(self.device)
        if self.device.type == "cuda":
            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self._end.record()
            self._end.synchronize()
            self.samples.append(self._start.elapsed_time(self._end) / 1e3)
        else:
            self.samples.append(time.perf_counter() - self._t0)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: the noise of this measurement."""
        if len(self.samples) < 3:
            return float("nan")
        qs = statistics.quantiles(self.samples, n=10)
        return (qs[-1] - qs[0]) / self.median


def time_forward(model, batch: int, context: int, width: int, reps: int, warmup: int, vocab: int, seed: int = 0,
                 runner_kind: str = "dynamic") -> dict:
    """Median time of one runner forward appending `width` tokens to each of `batch` rows that
    hold `context` cached tokens, with logits at all `width` (as the engine asks).

    runner_kind: "static" = StaticModelRunner (slots; the engine's default for Llama-family
    models); "dynamic" = ModelRunner (HF DynamicCache, the other architectures); "graph" = the
    static step captured as a CUDA graph (CudaGraphStep, CUDA only)."""
    from raysd.models.static_runner import CudaGraphStep, StaticModelRunner

    if runner_kind == "dynamic":
        runner = ModelRunner(model)
    else:
        runner = StaticModelRunner(model, max_cache_len=context + 2 * width + 8)
    device = runner.device
    g = torch.Generator().manual_seed(seed)
    runner.add_rows(batch)
    prompt = torch.randint(3, vocab, (batch, context), generator=g).to(device)
    runner.forward(prompt, torch.ones_like(prompt, dtype=torch.bool), torch.ones(batch, dtype=torch.int64, device=device))
    chunk = torch.randint(3, vocab, (batch, width), generator=g).to(device)
    valid = torch.ones_like(chunk, dtype=torch.bool)
    num = torch.full((batch,), width, dtype=torch.int64, device=device)
    back = torch.full((batch,), context, dtype=torch.int64, device=device)
    if runner_kind == "graph":
        step = CudaGraphStep(runner, width, width)
        call = lambda: step(chunk, valid, num)  # noqa: E731
    elif runner_kind == "static":
        call = lambda: runner.forward(chunk, valid, num, max_logits=width)  # noqa: E731
    else:
        call = lambda: runner.forward(chunk, valid, num)  # noqa: E731
    timer = StepTimer(device)
    for i in range(warmup + reps):
        if i == warmup:
            timer.samples.clear()
        with timer:
            call()
        runner.rollback(back, context)  # untimed: back to `context` tokens
    del runner
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"median_s": timer.median, "spread": timer.spread, "reps": reps, "runner": runner_kind}


def count_syncs(target, draft, V: int, K: int, batch: int, prompt_len: int, device) -> dict:
    """Host synchronisations per engine step (CUDA only): torch warns on each synchronising
    CUDA call under set_sync_debug_mode("warn"); counted over a short greedy generation."""
    if device.type != "cuda":
        return {}
    out = {}
    for name, drafter in (("ar", lambda: NoDrafter(V, device)), ("raysd", lambda: DraftModelDrafter(draft, V))):
        k = 0 if name == "ar" else K
        engine = SpecEngine(target, drafter(), EngineConfig(num_speculative_tokens=k, max_batch_size=batch))
        reqs = make_requests(batch, prompt_len, 16, V)
        engine.generate(make_requests(batch, prompt_len, 1, V))  # admission/prefill syncs not counted below
        engine.timings.steps = 0
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.generate(reqs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchroniz" in str(w.message) for w in caught)
        out[name] = {"syncs": syncs, "steps": engine.timings.steps,
                     "syncs_per_step_incl_prefill": syncs / max(engine.timings.steps, 1)}
    return out


# ---------------------------------------------------------------- generation runs


def make_requests(batch: int, prompt_len: int, new_tokens: int, vocab: int, prompts=None, seed: int = 0) -> list[Request]:
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    if prompts:
        return [Request(i, prompts[i % len(prompts)], params) for i in range(batch)]
    g = torch.Generator().manual_seed(seed)
    return [Request(i, torch.randint(3, vocab, (prompt_len,), generator=g).tolist(), params) for i in range(batch)]


def _summary(results, wall: float) -> dict:
    steps = sum(r.stats.num_spec_steps for r in results)
    acc = sum(r.stats.num_accepted_draft_tokens for r in results)
    tested = sum(r.stats.num_tested_positions for r in results)
    return {"wall_s": wall, "tokens": sum(len(r.token_ids) for r in results),
            "mean_tokens_per_step": (1 + acc / steps) if steps else float("nan"),
            "acceptance": acc / tested if tested else float("nan")}


def engine_run(target, drafter_factory, k: int, batch: int, reqs, rate, device) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntheticAcceptanceWarning)
        engine = SpecEngine(target, drafter_factory(), EngineConfig(num_speculative_tokens=k, max_batch_size=batch,
                                                                    synthetic_acceptance_rate=rate))
    sync(device)
    t0 = time.perf_counter()
    results = engine.generate(reqs)
    sync(device)
    out = _summary(results, time.perf_counter() - t0)
    out["engine_draft_s"], out["engine_target_s"] = engine.timings.draft_s, engine.timings.target_s
    return out


def decode_tps(run, reqs_full, reqs_one, repeats: int = 1) -> dict:
    """tokens/s of decode alone: B (N - 1) / (wall(N) - wall(1)), best of `repeats`."""
    full = min((run(reqs_full) for _ in range(repeats)), key=lambda r: r["wall_s"])
    one = min((run(reqs_one) for _ in range(repeats)), key=lambda r: r["wall_s"])
    extra = full["tokens"] - one["tokens"]
    dt = full["wall_s"] - one["wall_s"]
    full["decode_tokens_per_s"] = extra / dt if dt > 0 else float("nan")
    full["e2e_tokens_per_s"] = full["tokens"] / full["wall_s"]
    full["prefill_and_first_step_s"] = one["wall_s"]
    return full


# ---------------------------------------------------------------- Ray coordinator


def _synthetic_target_actor_class():
    """A TargetActor whose verify applies the synthetic accept rule at a rate set by `set_rate`
    (None: the exact test), drawing its own acceptance uniforms.

    Stand-in until the coordinator carries synthetic_acceptance_rate itself (docs/gpu.md,
    needed changes): the coordinator's greedy rows send uniforms of 0.5, so the actor draws
    its own acceptance uniforms, as SpecEngine.step does for greedy rows."""
    from raysd.actors.model_actors import TargetActor, VerifyResult
    from raysd.actors.transport import decode_proposal
    from raysd.core.sampling import SamplingTensors

    class SyntheticTargetActor(TargetActor):
        rate = None

        def set_rate(self, rate):
            self.rate = rate

        def verify(self, mb, update, wire, uniforms):
            start = time.perf_counter()
            state = self.store.apply(mb, update)
            sampling = SamplingTensors.from_params(state.params, self.device)
            proposal = decode_proposal(wire, self.device)
            u = torch.tensor(uniforms, device=self.device)
            Kp = proposal.draft_token_ids.shape[1]
            accept = u[:, :Kp] if self.rate is None else torch.rand(u.shape[0], Kp, device=self.device)
            out = state.side.verify(proposal, sampling, accept, u[:, -1], self.rate)
            tokens, _, accepted, overlaps = out.per_row()
            drafted = proposal.num_draft_tokens.tolist()
            return VerifyResult(tokens, drafted, accepted, overlaps, time.perf_counter() - start)

    return SyntheticTargetActor


def ray_runs(args, target_factory, draft_factory, rows, V, prompts) -> None:
    """For each micro-batch count M: one coordinator (models loaded once), then every
    (B, a) point with micro-batches of ceil(B / M) rows; results go into row.ray["mbM"]."""
    import dataclasses

    import ray

    import raysd.actors.coordinator as coord
    from raysd.actors import ActorResources, CoordinatorConfig, DrafterSpec, SpecCoordinator

    gpu = 0.5 if torch.cuda.is_available() else 0.0
    res = ActorResources(num_cpus=1, num_gpus=gpu)
    for mbs in args.micro_batches:
        config = CoordinatorConfig(num_speculative_tokens=args.k, micro_batch_size=1, num_micro_batches=mbs,
                                   draft_resources=res, target_resources=res, measure_bytes=False)
        original, coord.TargetActor = coord.TargetActor, _synthetic_target_actor_class()
        try:
            with SpecCoordinator(target_factory, DrafterSpec(draft_factory), config) as c:
                for row in rows:
                    B, rate = row.batch, None if row.rate == "real" else float(row.rate)
                    c.config = dataclasses.replace(config, micro_batch_size=math.ceil(B / mbs))  # the actors never read it
                    ray.get(c.target.set_rate.remote(rate))

                    def run(reqs):
                        o = c.generate(reqs)
                        s = _summary(o.results, o.report.wall_s)
                        s["overlap_efficiency"] = o.report.overlap_efficiency
                        s["draft_busy_s"], s["target_busy_s"] = o.report.draft_busy_s, o.report.target_busy_s
                        return s

                    reqs_one = make_requests(B, args.prompt_len, 1, V, prompts)
                    run(make_requests(B, args.prompt_len, 4, V, prompts))  # warm-up at this batch size
                    r = decode_tps(run, make_requests(B, args.prompt_len, args.new_tokens, V, prompts), reqs_one, args.repeats)
                    row.ray[f"mb{mbs}"] = r
                    print(f"  B={B} a={row.rate} ray mb{mbs}: {r['decode_tokens_per_s']:.1f} tok/s "
                          f"(overlap efficiency {r['overlap_efficiency']:.2f})", flush=True)
        finally:
            coord.TargetActor = original


# ---------------------------------------------------------------- main


@dataclass
class Row:
    batch: int
    rate: str
    E: float
    t_target_1_ms: float
    t_target_k1_ms: float
    t_draft_ms: float
    ar_tps: float
    raysd_tps: float
    speedup: float
    serial_bound_tps: float
    overlapped_bound_tps: float
    frac_serial: float
    frac_overlapped: float
    speedup_over_overlapped_speedup: float
    measured_tokens_per_step: float
    ray: dict = field(default_factory=dict)  # "mb1", "mb2": the coordinator's runs
    detail: dict = field(default_factory=dict)  # "engine", "ar": the in-process runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes, CPU-sized; checks the script, measures nothing real")
    ap.add_argument("--pair", choices=["random", "smollm2"], default="random")
    ap.add_argument("--target-shape", default="8b")
    ap.add_argument("--draft-shape", default="1b")
    ap.add_argument("--draft-layers", type=int, default=6, help="--pair smollm2: layers kept in the truncated draft")
    ap.add_argument("--draft-model", default=None,
                    help="--pair smollm2: a draft to load instead of the truncated one (e.g. the distilled "
                         "smollm2-135m-instruct-draft, once shipped)")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--rates", nargs="+", default=["0.6", "0.8", "0.9"], help='acceptance rates; "real" = exact test')
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20, help="timed forwards per step-cost median")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=1, help="generation runs per point (best of)")
    ap.add_argument("--ray", action="store_true", help="also run the Ray coordinator, 1 and 2 micro-batches")
    ap.add_argument("--runners", nargs="+", default=None, choices=["dynamic", "static", "graph"],
                    help="runners whose step costs are timed (default: static dynamic, + graph on CUDA); "
                         "the bounds use the first (static: what the engine runs for Llama-family models)")
    ap.add_argument("--count-syncs", action="store_true", help="count host synchronisations per engine step (CUDA)")
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", default="out/gpu_bench", help="writes <out>.json and <out>.md")
    args = ap.parse_args(argv)
    if args.quick:
        args.target_shape, args.draft_shape, args.pair = "tiny-target", "tiny-draft", "random"
        args.batches = [b for b in args.batches if b <= 8] or [1, 8]
        args.prompt_len, args.new_tokens, args.reps, args.warmup = 16, 12, 5, 2
        args.dtype = "float32" if not torch.cuda.is_available() else args.dtype
        args.new_tokens, args.repeats = 16, max(args.repeats, 2)
        if not torch.cuda.is_available():
            torch.set_num_threads(1)  # tiny models: threads only add contention
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.quick:
        print("WARNING: no CUDA device; these are CPU numbers, not GPU numbers", file=sys.stderr)

    t_start = time.perf_counter()
    prompts = None
    if args.pair == "random":
        target = build_random_llama(args.target_shape, args.dtype, device.type, seed=0)
        draft = build_random_llama(args.draft_shape, args.dtype, device.type, seed=1)
        target_factory = functools.partial(build_random_llama, args.target_shape, args.dtype, "cuda", 0)
        draft_factory = functools.partial(build_random_llama, args.draft_shape, args.dtype, "cuda", 1)
    else:
        where = "cuda" if device.type == "cuda" else "cpu"
        target = load_smollm2(args.dtype, device.type)
        target_factory = functools.partial(load_smollm2, args.dtype, where)
        if args.draft_model:
            draft = load_named(args.draft_model, args.dtype, device.type)
            draft_factory = functools.partial(load_named, args.draft_model, args.dtype, where)
        else:
            draft = truncated(target, args.draft_layers)
            draft_factory = functools.partial(truncated_smollm2, args.draft_layers, args.dtype, where)
        from raysd.models.loading import load_tokenizer

        tok = load_tokenizer(smollm2_source())
        lines = [json.loads(x) for x in (Path(__file__).resolve().parents[1] / "examples" / "prompts.jsonl").read_text().splitlines() if x.strip()]
        prompts = []
        for item in lines:
            msgs = item["prompt"] if isinstance(item["prompt"], list) else [{"role": "user", "content": item["prompt"]}]
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
            prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    V = target.get_output_embeddings().weight.shape[0]
    K = args.k
    ctx = args.prompt_len + args.new_tokens // 2
    n_params = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    env = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "python": platform.python_version(), "quick": args.quick,
           "target_params": n_params(target), "draft_params": n_params(draft)}
    import transformers

    env["transformers"] = transformers.__version__
    print(f"# {env}", flush=True)

    runners = args.runners or (["static", "dynamic"] + (["graph"] if device.type == "cuda" else []))
    rows: list[Row] = []
    steps = {}
    syncs = {}
    for B in args.batches:
        steps[B] = {}
        for kind in runners:
            t = {"target_1": time_forward(target, B, ctx, 1, args.reps, args.warmup, V, runner_kind=kind),
                 "target_k1": time_forward(target, B, ctx, K + 1, args.reps, args.warmup, V, runner_kind=kind),
                 "draft": time_forward(draft, B, ctx, 1, args.reps, args.warmup, V, runner_kind=kind)}
            steps[B][kind] = t
            print(f"B={B} [{kind}]: T_target(B,1)={t['target_1']['median_s']*1e3:.2f} ms  "
                  f"T_target(B,K+1)={t['target_k1']['median_s']*1e3:.2f} ms  T_draft(B)={t['draft']['median_s']*1e3:.2f} ms",
                  flush=True)
        tt1, ttk, td = (steps[B][runners[0]][x] for x in ("target_1", "target_k1", "draft"))
        if args.count_syncs:
            syncs[B] = count_syncs(target, draft, V, K, B, args.prompt_len, device)
            print(f"B={B}: host syncs {syncs[B]}", flush=True)
        reqs_full = make_requests(B, args.prompt_len, args.new_tokens, V, prompts)
        reqs_one = make_requests(B, args.prompt_len, 1, V, prompts)
        warm = make_requests(B, args.prompt_len, 4, V, prompts)
        ar_run = lambda reqs: engine_run(target, lambda: NoDrafter(V, device), 0, B, reqs, None, device)  # noqa: E731
        ar_run(warm)
        ar = decode_tps(ar_run, reqs_full, reqs_one, args.repeats)
        for rate_s in args.rates:
            rate = None if rate_s == "real" else float(rate_s)
            sd_run = lambda reqs: engine_run(target, lambda: DraftModelDrafter(draft, V), K, B, reqs, rate, device)  # noqa: E731
            sd_run(warm)
            sd = decode_tps(sd_run, reqs_full, reqs_one, args.repeats)
            E = expected_tokens_per_step(rate, K) if rate is not None else sd["mean_tokens_per_step"]
            t1, tk, tdr = tt1["median_s"], ttk["median_s"], td["median_s"]
            s_serial, s_over = serial_speedup(E, t1, tk, tdr, K), overlapped_speedup(E, t1, tk, tdr, K)
            serial_b, over_b = B / t1 * s_serial, B / t1 * s_over
            row = Row(B, rate_s, E, t1 * 1e3, tk * 1e3, tdr * 1e3, ar["decode_tokens_per_s"], sd["decode_tokens_per_s"],
                      sd["decode_tokens_per_s"] / ar["decode_tokens_per_s"], serial_b, over_b,
                      sd["decode_tokens_per_s"] / serial_b, sd["decode_tokens_per_s"] / over_b,
                      (sd["decode_tokens_per_s"] / ar["decode_tokens_per_s"]) / s_over, sd["mean_tokens_per_step"])
            row.detail = {"engine": sd, "ar": ar}
            rows.append(row)
            print(f"  a={rate_s}: AR {row.ar_tps:.1f} tok/s, raysd {row.raysd_tps:.1f} tok/s (x{row.speedup:.2f}), "
                  f"{row.frac_serial:.0%} of serial / {row.frac_overlapped:.0%} of overlapped bound", flush=True)
    if args.ray:
        del target, draft
        if device.type == "cuda":
            torch.cuda.empty_cache()
        import ray

        start_local_ray(num_cpus=4, num_gpus=1 if device.type == "cuda" else 0, log_to_driver=False, configure_logging=False)
        try:
            ray_runs(args, target_factory, draft_factory, rows, V, prompts)
        finally:
            ray.shutdown()

    table = markdown(rows, args, env)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"env": env, "args": vars(args), "step_costs": {str(b): v for b, v in steps.items()},
              "step_cost_table": step_cost_markdown(steps, runners), "host_syncs": {str(b): v for b, v in syncs.items()},
              "rows": [asdict(r) for r in rows], "elapsed_s": time.perf_counter() - t_start}
    out.with_suffix(".json").write_text(json.dumps(record, indent=1, default=float))
    table += "\n" + step_cost_markdown(steps, runners)
    out.with_suffix(".md").write_text(table)
    print(table)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')} in {record['elapsed_s']:.0f} s")
    return 0


def step_cost_markdown(steps: dict, runners: list[str]) -> str:
    """Step costs per runner (ms, median): what the static cache and CUDA graphs buy."""
    head = ["B"] + [f"{what} [{kind}]" for kind in runners for what in ("T_t(B,1)", "T_t(B,K+1)", "T_d(B)")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for B, per in steps.items():
        cells = [str(B)] + [f"{per[k][w]['median_s']*1e3:.2f}" for k in runners for w in ("target_1", "target_k1", "draft")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def markdown(rows: list[Row], args, env) -> str:
    ray_cols = [f"mb{m}" for m in args.micro_batches] if args.ray else []
    head = ["B", "a", "E", "T_t(B,1) ms", "T_t(B,K+1) ms", "T_d(B) ms", "AR tok/s", "raysd tok/s", "x AR",
            "serial bound", "overlapped bound", "% serial", "% overlapped"] + [f"ray {c} tok/s" for c in ray_cols]
    lines = [f"{env['device']}, {args.dtype}, target {env['target_params']/1e9:.2f}B / draft {env['draft_params']/1e9:.2f}B params, "
             f"K={args.k}, prompt {args.prompt_len}, {args.new_tokens} new tokens, greedy"
             + (" (QUICK: tiny shapes, not a measurement)" if args.quick else ""), "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.batch, r.rate, f"{r.E:.2f}", f"{r.t_target_1_ms:.2f}", f"{r.t_target_k1_ms:.2f}", f"{r.t_draft_ms:.2f}",
                 f"{r.ar_tps:.0f}", f"{r.raysd_tps:.0f}", f"{r.speedup:.2f}", f"{r.serial_bound_tps:.0f}",
                 f"{r.overlapped_bound_tps:.0f}", f"{r.frac_serial:.0%}", f"{r.frac_overlapped:.0%}"]
        cells += [f"{r.ray[c]['decode_tokens_per_s']:.0f}" if c in r.ray else "-" for c in ray_cols]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
