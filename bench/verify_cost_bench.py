"""What a target pass over T tokens per row costs against one over 1 token: T(K+1)/T(1), the verify
term of the cost model (1 - a^(K+1)) / ((1 - a)(cK + T(K+1)/T(1))), for each dtype and batch size.

Two parts, each the median of repeats on a quiet machine:
- the whole target (SmolLM2-135M-Instruct) through the runner the engine runs
  (`raysd.models.profile.time_forward`: rows prefilled to `--context` tokens, then one forward of
  T tokens per row, rolled back after each);
- its matrix products alone (`F.linear` at SmolLM2's shapes, M = rows x tokens), which say where
  the time goes.

    python bench/verify_cost_bench.py        # the run in docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import loadavg, machine  # noqa: E402

from raysd.models.loading import DEFAULT_MODEL, ModelSpec, load_model  # noqa: E402
from raysd.models.profile import time_forward  # noqa: E402

# (out_features, in_features) of SmolLM2-135M's linear layers
LINEARS = {"q/o 576x576": (576, 576), "k/v 192x576": (192, 576), "gate/up 1536x576": (1536, 576),
           "down 576x1536": (576, 1536), "head 49152x576": (49152, 576)}


def time_linear(out_f: int, in_f: int, m: int, dtype: torch.dtype, reps: int = 7, inner: int = 20) -> float:
    w = torch.randn(out_f, in_f, dtype=dtype)  # [N, K]
    x = torch.randn(m, in_f, dtype=dtype)  # [M, K]
    for _ in range(3):
        F.linear(x, w)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            F.linear(x, w)
        times.append((time.perf_counter() - t0) / inner)
    return sorted(times)[reps // 2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--tokens", default="1,2,3,4,5,6,8", help="T: tokens per row in one pass (K + 1)")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "verify_cost_bench.json"))
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    tokens = [int(t) for t in a.tokens.split(",")]
    out = {"machine": machine(), "loadavg_start": loadavg(), "args": vars(a), "model": {}, "linear": {}}
    for dt in a.dtypes.split(","):
        model = load_model(ModelSpec(DEFAULT_MODEL, dtype=dt))
        for b in (int(x) for x in a.batch_sizes.split(",")):
            with torch.inference_mode():
                s = time_forward(model, b, [t - 1 for t in tokens], context=a.context, reps=a.reps)
            ms = {t: s[t - 1] * 1e3 for t in tokens}
            out["model"][f"{dt} B={b}"] = ms
            print(f"{dt:8s} B={b}: " + "  ".join(f"T={t} {v:.1f} ms ({v / ms[1]:.2f})" for t, v in ms.items()), flush=True)
        del model
        torch_dt = getattr(torch, dt)
        for name, (n, k) in LINEARS.items():
            ms = {m: time_linear(n, k, m, torch_dt) * 1e3 for m in tokens}
            out["linear"][f"{dt} {name}"] = ms
            print(f"   {name:17s} " + "  ".join(f"M={m} {v:.3f}" for m, v in ms.items()), flush=True)
    out["loadavg_end"] = loadavg()
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"load average: {out['loadavg_start']:.2f} at the start, {out['loadavg_end']:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
