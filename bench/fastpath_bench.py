"""Benchmark 4 (issue 15): the engine's overhead around its models, SmolLM2-135M on this CPU.

One process, Spec-Bench first turns, greedy, EOS ignored so every variant makes the same
number of tokens. Variants interleaved within each repeat; medians over repeats.

1. Autoregressive: the engine with NoDrafter vs Hugging Face `generate` (same model,
   prompts, dtype, batch): goal >= 1.0x.
2. Step overhead: wall time of the engine's steps vs the time spent inside the models'
   forwards during those steps (K draft forwards + one verify): goal <= 10% overhead.
3. Speculative speedup vs the cost model: (tok/s with the draft) / (tok/s without) against
   E * T_target(1) / (T_target(K+1) + K * T_draft), with E (tokens per target pass) measured
   in the run and the three step times measured inside the same run's engine steps:
   goal >= 90% of the prediction.

    python bench/fastpath_bench.py                    # the documented run (docs/benchmarks.md)
    python bench/fastpath_bench.py --quick            # smoke test (not a measurement)
    python bench/fastpath_bench.py --runner dynamic   # the Hugging Face DynamicCache runner instead
    python bench/fastpath_bench.py --stock-ar         # also the engine's AR on PyTorch's own linears
                                                      # (raysd.models.linear): the packed kernels' gain
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import hf_generate, load_prompts, loadavg, machine, median  # noqa: E402

from raysd.core.sampling import SamplingParams  # noqa: E402
from raysd.core.theory import serial_speedup  # noqa: E402
from raysd.engine.drafters import DraftModelDrafter, NoDrafter  # noqa: E402
from raysd.engine.engine import EngineConfig, SpecEngine  # noqa: E402
from raysd.engine.rows import Request  # noqa: E402
from raysd.models.loading import DEFAULT_DRAFT, DEFAULT_MODEL, ModelSpec, eos_token_ids, load_model, load_tokenizer  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2, help="prompts per batch size: max(8, rounds x B), round-robin over the 6 tasks")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--k", type=int, default=3, help="K for the draft-model variant")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model for the speculative variant")
    p.add_argument("--runner", default="auto", choices=["auto", "static", "dynamic"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--stock-ar", action="store_true",
                   help="add the engine's AR with linear_kernels='stock' (PyTorch's own linears), interleaved")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "fastpath_bench.json"))
    p.add_argument("--quick", action="store_true", help="6 prompts, 8 tokens, 1 repeat, batch 1 and 2")
    a = p.parse_args()
    if a.quick:
        a.rounds, a.max_new_tokens, a.repeats, a.batch_sizes = 1, 8, 1, "1,2"
        a.out = str(Path(a.out).with_name("fastpath_bench_quick.json"))
    a.batch_sizes = [int(b) for b in a.batch_sizes.split(",")]
    return a


class ForwardClock:
    """Seconds spent inside a model's forward (hooks on the top-level module), split by phase."""

    def __init__(self, *models):
        self.phase, self.seconds, self.calls, self._t0 = "step", {}, {}, 0.0
        for m in models:
            m.register_forward_pre_hook(self._pre)
            m.register_forward_hook(self._post)

    def _pre(self, module, args):
        self._t0 = time.perf_counter()

    def _post(self, module, args, out):
        key = (self.phase, getattr(module, "_bench_name", "?"))
        self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - self._t0
        self.calls[key] = self.calls.get(key, 0) + 1

    def reset(self):
        self.seconds, self.calls = {}, {}

    def total(self, phase: str, name: str | None = None) -> float:
        return sum(v for (p, n), v in self.seconds.items() if p == phase and (name is None or n == name))

    def count(self, phase: str, name: str) -> int:
        return self.calls.get((phase, name), 0)


def run_engine(target, drafter, k, batch, prompts, max_new, clock: ForwardClock, runner: str, kernels: str = "auto"):
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    engine = SpecEngine(target, drafter, EngineConfig(num_speculative_tokens=k, max_batch_size=batch, runner=runner,
                                                      linear_kernels=kernels))
    for side in (engine.verifier, engine.drafter):  # prefill forwards are timed apart from the steps
        add = side.add_rows

        def timed_add(prompts_, _add=add):
            clock.phase = "prefill"
            try:
                _add(prompts_)
            finally:
                clock.phase = "step"

        side.add_rows = timed_add
    clock.reset()
    t0 = time.perf_counter()
    results = engine.generate([Request(i, p["ids"], params) for i, p in enumerate(prompts)])
    wall = time.perf_counter() - t0
    st = [r.stats for r in results]
    steps = sum(s.num_spec_steps for s in st)
    step_wall = wall - engine.timings.prefill_s
    model_s = clock.total("step")
    return {
        "wall_s": wall, "tokens": [r.token_ids for r in results], "generated": sum(len(r.token_ids) for r in results),
        "step_wall_s": step_wall, "model_s": model_s, "overhead": 1 - model_s / step_wall, "engine_steps": engine.timings.steps,
        "t_target_step": clock.total("step", "target") / max(clock.count("step", "target"), 1),
        "t_draft_step": clock.total("step", "draft") / max(clock.count("step", "draft"), 1),
        "tokens_per_pass": 1 + sum(s.num_accepted_draft_tokens for s in st) / steps if steps else None,
        # mean rows per step / B: below 1 where rows finish at different steps and the queue is empty
        "occupancy": engine.timings.row_steps / (engine.timings.steps * batch),
        "acceptance": (sum(s.num_accepted_draft_tokens for s in st) / max(sum(s.num_draft_tokens for s in st), 1)),
    }


def same_until_eos(rows, reference, eos) -> bool:
    for row, ref in zip(rows, reference):
        n = next((j for j, t in enumerate(row) if t in eos), len(row))
        if row[:n] != ref[:n]:
            return False
    return len(rows) == len(reference)


def main():
    a = parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    target = load_model(ModelSpec())
    draft = load_model(ModelSpec(a.draft))
    target._bench_name, draft._bench_name = "target", "draft"
    clock = ForwardClock(target, draft)
    tok = load_tokenizer(DEFAULT_MODEL)
    vocab = target.get_output_embeddings().weight.shape[0]
    eos = set(eos_token_ids(target))
    count = {b: max(8, a.rounds * b) for b in a.batch_sizes}
    prompts = load_prompts(tok, -(-max(count.values()) // 6))
    pad = int(tok.pad_token_id if tok.pad_token_id is not None else 0)
    info = {"machine": machine(), "args": vars(a), "prompts_per_batch_size": count,
            "prompt_tokens": [len(p["ids"]) for p in prompts]}
    print(f"prompts per batch size {count}; load {loadavg()}", flush=True)

    variants = {
        "engine AR": lambda b, ps, n: run_engine(target, NoDrafter(vocab), 0, b, ps, n, clock, a.runner),
        "HF generate": lambda b, ps, n: hf_generate(target, b, ps, n, pad),
        f"engine draft K={a.k}": lambda b, ps, n: run_engine(target, DraftModelDrafter(draft, vocab, runner=a.runner), a.k, b, ps, n, clock, a.runner),
    }
    if a.stock_ar:
        variants["engine AR stock"] = lambda b, ps, n: run_engine(target, NoDrafter(vocab), 0, b, ps, n, clock, a.runner, "stock")
    for name, fn in variants.items():  # warm-up
        for b in a.batch_sizes:
            fn(b, prompts[:2], 4)
    print(f"warm-up done; load {loadavg()}", flush=True)
    runs: dict[tuple, list] = {}
    for r in range(a.repeats):
        for b in a.batch_sizes:
            for name, fn in variants.items():
                la = loadavg()
                out = fn(b, prompts[: count[b]], a.max_new_tokens)
                out["loadavg"] = la
                runs.setdefault((name, b), []).append(out)
                extra = f" overhead {out['overhead']:.1%}" if "overhead" in out else ""
                print(f"[{r}] {name:18s} B={b:2d}: {out['generated'] / out['wall_s']:7.1f} tok/s{extra}  load {la}", flush=True)

    rows, mismatches = [], []
    spec = f"engine draft K={a.k}"
    for b in a.batch_sizes:
        tps = {name: median([x["generated"] / x["wall_s"] for x in runs[(name, b)]]) for name in variants}
        ar, sp, hf = runs[("engine AR", b)], runs[(spec, b)], runs[("HF generate", b)]
        # HF's min_new_tokens masks EOS until the last token; the engine's ignore_eos keeps the
        # target's own argmax, EOS included, and goes on: compare up to a row's first EOS.
        if not same_until_eos(ar[0]["tokens"], hf[0]["tokens"], eos) or not same_until_eos(sp[0]["tokens"], hf[0]["tokens"], eos):
            mismatches.append(b)
        t1 = median([x["t_target_step"] for x in ar])
        tk1 = median([x["t_target_step"] for x in sp])
        td = median([x["t_draft_step"] for x in sp])
        e = median([x["tokens_per_pass"] for x in sp])
        predicted = serial_speedup(e, t1, tk1, td, a.k)
        measured = tps[spec] / tps["engine AR"]  # end to end, prefill included
        step_tps = {n: median([x["generated"] / x["step_wall_s"] for x in runs[(n, b)]]) for n in ("engine AR", spec)}
        measured_steps = step_tps[spec] / step_tps["engine AR"]  # decoding steps only, as the cost model counts
        rows.append({
            "batch": b, "tok_s": tps, "ar_vs_hf": tps["engine AR"] / tps["HF generate"],
            "ar_overhead": median([x["overhead"] for x in ar]), "spec_overhead": median([x["overhead"] for x in sp]),
            "tokens_per_pass": e, "acceptance": median([x["acceptance"] for x in sp]),
            "occupancy_ar": median([x["occupancy"] for x in ar]), "occupancy_spec": median([x["occupancy"] for x in sp]),
            "t_target_1_ms": t1 * 1e3, "t_target_k1_ms": tk1 * 1e3, "t_draft_ms": td * 1e3,
            "spec_speedup": measured, "spec_speedup_steps": measured_steps, "predicted_speedup": predicted,
            "of_prediction": measured / predicted, "of_prediction_steps": measured_steps / predicted,
            "loadavg": [x["loadavg"] for name in variants for x in runs[(name, b)]],
        })
        if a.stock_ar:  # paired per repeat: the packed kernels' gain on the same prompts, same load
            stock = runs[("engine AR stock", b)]
            rows[-1]["ar_vs_stock"] = median([x["wall_s"] / y["wall_s"] for x, y in zip(stock, ar)])
            rows[-1]["t_target_1_stock_ms"] = median([x["t_target_step"] for x in stock]) * 1e3
            if not same_until_eos(stock[0]["tokens"], hf[0]["tokens"], eos):
                mismatches.append(b)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({**info, "rows": rows, "mismatches": mismatches, "loadavg_end": loadavg()}, indent=1))
    print(f"\n{'B':>3} {'AR tok/s':>9} {'HF tok/s':>9} {'AR/HF':>6} {'AR ovh':>7} {'spec ovh':>8} {'E':>5} "
          f"{'T1 ms':>6} {'TK1 ms':>7} {'Td ms':>6} {'speedup':>8} {'steps':>6} {'pred':>6} {'of pred':>7} {'steps':>6} {'occ AR':>6} {'occ sp':>6}")
    for r in rows:
        t = r["tok_s"]
        print(f"{r['batch']:>3} {t['engine AR']:9.1f} {t['HF generate']:9.1f} {r['ar_vs_hf']:6.2f} {r['ar_overhead']:7.1%} "
              f"{r['spec_overhead']:8.1%} {r['tokens_per_pass']:5.2f} {r['t_target_1_ms']:6.1f} {r['t_target_k1_ms']:7.1f} "
              f"{r['t_draft_ms']:6.2f} {r['spec_speedup']:8.2f} {r['spec_speedup_steps']:6.2f} {r['predicted_speedup']:6.2f} "
              f"{r['of_prediction']:7.1%} {r['of_prediction_steps']:6.1%} {r['occupancy_ar']:6.2f} {r['occupancy_spec']:6.2f}")
    for r in rows:
        if "ar_vs_stock" in r:
            print(f"B={r['batch']}: engine AR packed / stock linears {r['ar_vs_stock']:.2f}x (paired), "
                  f"T1 {r['t_target_1_ms']:.1f} vs {r['t_target_1_stock_ms']:.1f} ms")
    print(f"wrote {a.out}")
    assert not mismatches, f"greedy tokens differ from HF generate at batch sizes {mismatches}"


if __name__ == "__main__":
    main()
