"""Benchmark 2 (issue 3): serial vs overlapped draft/verify in two Ray actors.

SpecCoordinator with num_micro_batches=1 (draft, then verify, strictly in turn) against
num_micro_batches=2 (one micro-batch drafts while the other verifies), same prompts, same
actors, for the SmolLM2 target with (a) its bf16 copy as draft and (b) the n-gram drafter.
Each actor gets 1 CPU and 1 torch thread. The single-process SpecEngine is the reference.

The serial and overlapped runs share one coordinator (its actors load the GGUF once): the
bench swaps `coordinator.config` between `generate` calls; every call starts its
micro-batches from a reset, so nothing carries over.

    python bench/overlap_bench.py            # the documented run (docs/benchmarks.md)
    python bench/overlap_bench.py --quick    # smoke test
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import os
import sys
import time
from pathlib import Path

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_prompts, loadavg, machine, median  # noqa: E402

from raysd.actors import ActorResources, CoordinatorConfig, DrafterSpec, SpecCoordinator  # noqa: E402
from raysd.actors.local import start_local_ray  # noqa: E402
from raysd.core.sampling import SamplingParams  # noqa: E402
from raysd.engine.drafters import DraftModelDrafter, NgramDrafter  # noqa: E402
from raysd.engine.engine import EngineConfig, SpecEngine  # noqa: E402
from raysd.engine.rows import Request  # noqa: E402
from raysd.models.loading import DEFAULT_MODEL, ModelSpec, eos_token_ids, load_model, load_tokenizer  # noqa: E402


# Factories run inside the actors (defined here so Ray pickles them by value).
def target_factory(threads: int):
    torch.set_num_threads(threads)
    return load_model(ModelSpec())


def bf16_draft_factory(threads: int):
    torch.set_num_threads(threads)
    return load_model(ModelSpec()).to(torch.bfloat16)  # what copy.deepcopy(target).to(bf16) gives


def actor_threads():
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "torch_threads_default": torch.get_num_threads()}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=8, help="Spec-Bench first turns, round-robin over the 6 tasks")
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--drafters", default="ngram,bf16")
    p.add_argument("--repeats", type=int, default=1, help="generate calls per mode (median reported)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per actor, and for the SpecEngine reference")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "overlap_bench.json"))
    p.add_argument("--quick", action="store_true", help="2 short prompts, 4 tokens, n-gram only")
    a = p.parse_args()
    if a.quick:
        a.num_prompts, a.max_new_tokens, a.drafters, a.micro_batch_size = 2, 4, "ngram", 1
        a.out = str(Path(a.out).with_name("overlap_bench_quick.json"))
    a.drafters = a.drafters.split(",")
    return a


def summarize(name, mode, results, wall, report=None):
    tokens = [r.token_ids for r in results]
    st = [r.stats for r in results]
    steps = sum(s.num_spec_steps for s in st)
    row = {"drafter": name, "mode": mode, "wall_s": wall, "generated": sum(map(len, tokens)),
           "tok_s": sum(map(len, tokens)) / wall, "loadavg": loadavg(),
           "mean_acceptance_length": 1 + sum(s.num_accepted_draft_tokens for s in st) / steps if steps else None}
    if report is not None:
        row.update(draft_busy_s=report.draft_busy_s, target_busy_s=report.target_busy_s,
                   overlap_efficiency=report.overlap_efficiency, mb_steps=report.steps,
                   proposal_bytes_per_step=report.transfer.proposal / max(report.transfer.steps, 1))
    return row, tokens


def main():
    a = parse_args()
    torch.set_num_threads(a.threads)
    tok = load_tokenizer(DEFAULT_MODEL)
    prompts = load_prompts(tok, per_task=(a.num_prompts + 5) // 6)[: a.num_prompts]
    if a.quick:
        prompts = [p for p in prompts if len(p["ids"]) < 120][:2]
    params = SamplingParams(max_new_tokens=a.max_new_tokens)
    reqs = [Request(i, p["ids"], params) for i, p in enumerate(prompts)]
    warm = [Request("w", prompts[0]["ids"], SamplingParams(max_new_tokens=2))]
    info = {"machine": machine(), "args": vars(a), "prompt_tokens": [len(p["ids"]) for p in prompts],
            "tasks": [p["task"] for p in prompts], "loadavg_start": loadavg()}
    rows, tokens = [], {}

    start_local_ray(num_cpus=2, log_to_driver=False)  # never join another user's cluster; loopback only
    info["actor_env"] = ray.get(ray.remote(num_cpus=1)(actor_threads).remote())
    eos = None
    for name in a.drafters:
        spec = DrafterSpec(functools.partial(bf16_draft_factory, a.threads) if name == "bf16" else None)
        one_cpu = ActorResources(num_cpus=1, num_gpus=0)
        cfg = CoordinatorConfig(num_speculative_tokens=a.k, micro_batch_size=a.micro_batch_size, num_micro_batches=2,
                                eos_token_ids=(2,), draft_resources=one_cpu, target_resources=one_cpu)
        t0 = time.perf_counter()
        coord = SpecCoordinator(functools.partial(target_factory, a.threads), spec, cfg)
        info[f"actor_startup_s_{name}"] = time.perf_counter() - t0
        print(f"{name}: actors up in {info[f'actor_startup_s_{name}']:.1f}s; load {loadavg()}", flush=True)
        try:
            for nmb in (1, 2):  # warm-up, both modes
                coord.config = dataclasses.replace(cfg, num_micro_batches=nmb)
                coord.generate(warm)
            for r in range(a.repeats):
                for nmb, mode in ((1, "serial"), (2, "overlapped")):
                    coord.config = dataclasses.replace(cfg, num_micro_batches=nmb)
                    out = coord.generate(reqs)
                    row, toks = summarize(name, mode, out.results, out.report.wall_s, out.report)
                    row["repeat"] = r
                    rows.append(row)
                    tokens.setdefault((name, mode), toks)
                    print(f"[{r}] {name} {mode}: {row['tok_s']:.2f} tok/s, overlap eff {row['overlap_efficiency']:.2f}, load {row['loadavg']}", flush=True)
        finally:
            coord.shutdown()
    ray.shutdown()

    # Reference: the single-process engine, same prompts, as many rows in flight as the overlapped run.
    target = load_model(ModelSpec())
    eos = eos_token_ids(target)
    vocab = target.get_output_embeddings().weight.shape[0]
    draft = copy.deepcopy(target).to(torch.bfloat16) if "bf16" in a.drafters else None
    for name in a.drafters:
        for r in range(a.repeats + 1):  # the first call is the warm-up
            drafter = DraftModelDrafter(draft, vocab, name="bf16") if name == "bf16" else NgramDrafter(vocab)
            engine = SpecEngine(target, drafter, EngineConfig(a.k, max_batch_size=2 * a.micro_batch_size, eos_token_ids=eos))
            t0 = time.perf_counter()
            res = engine.generate(reqs if r else warm)
            if r:
                row, toks = summarize(name, "SpecEngine", res, time.perf_counter() - t0)
                row.update(repeat=r - 1, draft_busy_s=engine.timings.draft_s, target_busy_s=engine.timings.target_s)
                rows.append(row)
                tokens.setdefault((name, "SpecEngine"), toks)
                print(f"[{r - 1}] {name} SpecEngine: {row['tok_s']:.2f} tok/s, load {row['loadavg']}", flush=True)

    # Exactness: every mode gives the engine's tokens.
    same = {f"{n}/{m}": tokens[(n, m)] == tokens[(n, "SpecEngine")] for n, m in tokens}
    table = []
    for name in a.drafters:
        for mode in ("serial", "overlapped", "SpecEngine"):
            rs = [r for r in rows if r["drafter"] == name and r["mode"] == mode]
            pick = lambda k: median([r[k] for r in rs if r.get(k) is not None])  # noqa: E731
            table.append({"drafter": name, "mode": mode, **{k: pick(k) for k in ("tok_s", "wall_s", "draft_busy_s", "target_busy_s",
                          "overlap_efficiency", "mean_acceptance_length", "proposal_bytes_per_step")},
                          "loadavg": [r["loadavg"] for r in rs], "same_tokens_as_engine": same[f"{name}/{mode}"]})
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**info, "rows": rows, "table": table, "loadavg_end": loadavg()}, indent=1))
    f = lambda v, p=2: "–" if v is None else f"{v:.{p}f}"  # noqa: E731
    print("\n| drafter | mode | tok/s | wall s | draft busy s | target busy s | overlap eff. | mean acc. len | = engine |")
    print("|---|---|---|---|---|---|---|---|---|")
    for t in table:
        print(f"| {t['drafter']} | {t['mode']} | {f(t['tok_s'])} | {f(t['wall_s'], 1)} | {f(t['draft_busy_s'], 1)} | "
              f"{f(t['target_busy_s'], 1)} | {f(t['overlap_efficiency'])} | {f(t['mean_acceptance_length'])} | {t['same_tokens_as_engine']} |")
    print(f"wrote {out}")
    assert all(same.values()), same


if __name__ == "__main__":
    main()
