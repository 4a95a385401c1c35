"""Benchmark 5 (issue 15, item 4): does torch.compile help the static runner's decode step on this CPU?

SmolLM2-135M (fp32), B rows holding a Spec-Bench-like context of `--context` tokens; the
step is one StaticModelRunner forward of T tokens per row (T = 1: a draft or plain decode
step; T = K + 1: a verification). Three sides are timed interleaved, medians of `--reps`:
`eager` (the engine's default: raysd's prepacked linear kernels, raysd.models.linear), `stock`
(eager with PyTorch's own `F.linear`) and `compiled` (`StaticModelRunner(compile=True)`:
Inductor, `torch.compile(model, dynamic=False)`, one graph per (B, T, attended width), its own
kernels); with `--freezing` a fourth, `frozen`: the same with Inductor's freezing (weights folded
in as constants and prepacked for oneDNN, as raysd's eager kernels are). The lengths are rolled
back after each step so every step sees the same context. Compile time is reported apart.

    python bench/compile_bench.py                 # the documented run (docs/benchmarks.md)
    python bench/compile_bench.py --quick
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
from common import loadavg, machine  # noqa: E402

from raysd.models.loading import ModelSpec, load_model  # noqa: E402
from raysd.models.static_runner import StaticModelRunner  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--widths", default="1,4", help="tokens per row per step (1: decode; K + 1: verify)")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "compile_bench.json"))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--freezing", action="store_true", help="add the side `frozen`: Inductor with freezing=True")
    a = p.parse_args()
    if a.quick:
        a.batch_sizes, a.widths, a.reps, a.context = "1", "1", 3, 32
        a.out = str(Path(a.out).with_name("compile_bench_quick.json"))
    a.batch_sizes = [int(x) for x in a.batch_sizes.split(",")]
    a.widths = [int(x) for x in a.widths.split(",")]
    return a


# Each side's StaticModelRunner options; "frozen" (--freezing) swaps in its own compiled call below.
SIDES = {"eager": {}, "stock": {"linear_kernels": "stock"}, "compiled": {"compile": True}, "frozen": {"compile": True}}


def prefilled(model, B, context, side):
    runner = StaticModelRunner(model, max_cache_len=2 * context, **SIDES[side])
    runner.add_rows(B)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 1000, (B, context), generator=g)
    call = torch.compile(model, dynamic=False, options={"freezing": True}) if side == "frozen" else runner._model_call
    runner._model_call = model  # prefill eager: only the decode shapes are compiled
    runner.forward(prompt, torch.ones_like(prompt, dtype=torch.bool), torch.ones(B, dtype=torch.int64), max_logits=1)
    runner._model_call = call
    return runner


def main():
    a = parse_args()
    torch.set_num_threads(a.threads)
    model = load_model(ModelSpec())
    sides = [side for side in SIDES if side != "frozen" or a.freezing]
    rows = []
    for B in a.batch_sizes:
        for T in a.widths:
            runners = {side: prefilled(model, B, a.context, side) for side in sides}
            ids = torch.randint(3, 1000, (B, T), generator=torch.Generator().manual_seed(1))
            valid, num = torch.ones_like(ids, dtype=torch.bool), torch.full((B,), T)
            back = torch.full((B,), a.context)

            def step(r):
                t0 = time.perf_counter()
                r.forward(ids, valid, num, max_logits=T)
                dt = time.perf_counter() - t0
                r.rollback(back, a.context)
                return dt

            compile_s = {}
            for side in runners:
                if side in ("compiled", "frozen"):
                    t0 = time.perf_counter()
                    step(runners[side])  # compiles
                    compile_s[side] = time.perf_counter() - t0
            for r in runners.values():  # warm-up
                step(r)
            times = {k: [] for k in runners}
            la = loadavg()
            for _ in range(a.reps):
                for k, r in runners.items():
                    times[k].append(step(r))
            with torch.inference_mode():  # same logits
                out = {k: r.forward(ids, valid, num, max_logits=T) for k, r in runners.items()}
            err = max(float((out["eager"] - o).abs().max()) for o in out.values())
            med = {k: statistics.median(v) for k, v in times.items()}
            row = {"B": B, "T": T, **{f"{k}_ms": med[k] * 1e3 for k in sides},
                   "speedup": med["eager"] / med["compiled"], "speedup_vs_stock": med["stock"] / med["compiled"],
                   **({"speedup_frozen": med["eager"] / med["frozen"]} if "frozen" in med else {}),
                   "compile_s": compile_s["compiled"], "compile_s_all": compile_s, "max_abs_logit_diff": err, "loadavg": la}
            rows.append(row)
            print(f"B={B} T={T}: eager {row['eager_ms']:.1f} ms, stock {row['stock_ms']:.1f} ms, compiled "
                  f"{row['compiled_ms']:.1f} ms (x{row['speedup']:.2f} of eager, x{row['speedup_vs_stock']:.2f} of stock)"
                  + (f", frozen {row['frozen_ms']:.1f} ms (x{row['speedup_frozen']:.2f} of eager)" if "frozen" in med else "")
                  + f", compile {compile_s}, max |dlogit| {err:.1e}, load {la}", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"machine": machine(), "args": vars(a), "rows": rows, "loadavg_end": loadavg()}, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
