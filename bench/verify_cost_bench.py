"""What a target pass over T tokens per row costs against one over 1 token: T(K+1)/T(1), the verify
term of the cost model (1 - a^(K+1)) / ((1 - a)(cK + T(K+1)/T(1))), for each dtype and batch size.

Two parts, each the median of repeats on a quiet machine:
- the whole target (SmolLM2-135M-Instruct) through the runner the engine runs
  (`raysd.models.profile.time_forward`: rows prefilled to `--context` tokens, then one forward of
  T tokens per row, rolled back after each), with each of `--kernels` (raysd.models.linear:
  `stock` PyTorch linears, `packed` oneDNN-prepacked ones), interleaved round by round;
- its matrix products alone (`F.linear` at SmolLM2's shapes, M = rows x tokens), which say where
  the time goes.

    python bench/verify_cost_bench.py        # the run in docs/benchmarks.md
    python bench/verify_cost_bench.py --dtypes float32 --kernels stock,packed --rounds 3 --no-linear \
        --out bench/results/verify_cost_packed.json   # the linear kernels' run
    python bench/verify_cost_bench.py --cold-linears --out bench/results/linear_kernels_cold.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import loadavg, machine  # noqa: E402

from raysd.models.linear import PACK_ROWS_HINT  # noqa: E402
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


def time_linear_cold(out_f: int, in_f: int, ms, total_bytes: float = 2.5e8, reps: int = 5) -> dict[str, dict[int, float]]:
    """{kernel: {M: seconds per product}} with the weights cold in cache, as in a forward (each weight
    is read once per pass): enough copies of the weight to pass `total_bytes`, each multiplied in
    turn. Kernels: `F.linear` (stock), the oneDNN-packed weight (packed), and x @ W^T stored
    [in, out] (transposed), raysd.models.linear's three."""
    copies = max(2, int(total_bytes // (out_f * in_f * 4)))
    weights = [torch.randn(out_f, in_f) for _ in range(copies)]  # [N, K] each
    kernels = {
        "stock": (weights, lambda x, w: F.linear(x, w)),
        "packed": ([torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT) for w in weights],
                   lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")),
        "transposed": ([w.t().contiguous() for w in weights], lambda x, w: x @ w),
    }
    out = {}
    for name, (mats, fn) in kernels.items():
        out[name] = {}
        for m in ms:
            x = torch.randn(m, in_f)  # [M, K]
            for w in mats:
                fn(x, w)
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                for w in mats:
                    fn(x, w)
                times.append((time.perf_counter() - t0) / len(mats))
            out[name][m] = sorted(times)[reps // 2]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--tokens", default="1,2,3,4,5,6,8", help="T: tokens per row in one pass (K + 1)")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kernels", default="auto", help="linear kernels to compare (raysd.models.linear): auto, packed, stock")
    p.add_argument("--rounds", type=int, default=1, help="rounds over the kernels, interleaved; medians across rounds")
    p.add_argument("--no-linear", action="store_true", help="skip the matrix products alone")
    p.add_argument("--cold-linears", action="store_true",
                   help="only the products with weights cold in cache, per kernel (raysd.models.linear), M = 1..32")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "verify_cost_bench.json"))
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    tokens = [int(t) for t in a.tokens.split(",")]
    out = {"machine": machine(), "loadavg_start": loadavg(), "args": vars(a), "model": {}, "linear": {}}
    if a.cold_linears:
        ms = (1, 2, 3, 4, 5, 8, 16, 32)
        for name, (n, k) in LINEARS.items():
            got = time_linear_cold(n, k, ms)
            out.setdefault("linear_cold", {})[name] = got
            for kernel, t in got.items():
                print(f"{name:17s} {kernel:10s} " + "  ".join(f"M={m} {v * 1e3:.3f}" for m, v in t.items())
                      + f"   ({t[1] and n * k * 4 / t[1] / 1e9:.1f} GB/s at M=1)", flush=True)
        out["loadavg_end"] = loadavg()
        Path(a.out).write_text(json.dumps(out, indent=1))
        print(f"load average: {out['loadavg_start']:.2f} at the start, {out['loadavg_end']:.2f} at the end")
        return 0
    for dt in a.dtypes.split(","):
        model = load_model(ModelSpec(DEFAULT_MODEL, dtype=dt))
        for b in (int(x) for x in a.batch_sizes.split(",")):
            runs: dict[str, list[dict[int, float]]] = {k: [] for k in a.kernels.split(",")}
            for _ in range(a.rounds):
                for kernels, got in runs.items():
                    with torch.inference_mode():
                        s = time_forward(model, b, [t - 1 for t in tokens], context=a.context, reps=a.reps,
                                         linear_kernels=kernels)
                    got.append({t: s[t - 1] * 1e3 for t in tokens})
            for kernels, got in runs.items():
                ms = {t: statistics.median(r[t] for r in got) for t in tokens}
                key = f"{dt} B={b}" + ("" if kernels == "auto" else f" {kernels}")
                out["model"][key] = ms
                out.setdefault("model_rounds", {})[key] = got
                print(f"{key:22s}: " + "  ".join(f"T={t} {v:.1f} ms ({v / ms[1]:.2f})" for t, v in ms.items()), flush=True)
        del model
        if a.no_linear:
            continue
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
