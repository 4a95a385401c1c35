"""verify_cost and compile: what one target forward costs, through the runner the engine runs.

A step is one forward of T tokens per row (T = 1: a decode step; T = K + 1: a verification) on B
rows that each hold `--context` cached tokens, rolled back after each forward so every step sees
the same context; the figure is `step_s`, the median of `--reps` forwards (interleaved over the
variants of one batch size and dtype, after one untimed forward). Sides:
    packed     the engine's default on a CPU in float32: oneDNN-prepacked linear weights (raysd.models.linear)
    stock      PyTorch's own F.linear (EngineConfig(linear_kernels="stock"))
    compiled   StaticRunner(compile=True): Inductor, one graph per shape (the prefill runs eager);
               its compile time is the warm-up's, recorded under extra.compile_s
Ratios (the `--baseline` option): `tokens` (verify_cost): T(K+1)/T(1), each T against T = 1 of the
same side, dtype and B: the verify term of the cost model (1 - a^(K+1)) / ((1 - a)(cK + T(K+1)/T(1)));
`side` (compile): each side against `packed` at the same T.
Packed sides are left out for dtypes other than float32 (the kernels are float32 only). Not ported
from verify_cost_bench.py: the matrix products alone and the cold-cache linears.

    python -m bench run verify_cost                      # float32 packed and stock, bfloat16 stock; B 1, 8; T 1..8
    python -m bench run compile                          # packed, stock, compiled; B 1, 8; T 1, 4
"""

from __future__ import annotations

import statistics
import time

from bench.harness import Outcome, Variant, run_variants
from bench.workload import int_list, str_list

QUICK = {"batch_sizes": [1], "tokens": [1, 2], "reps": 3, "context": 32, "repeats": 1, "dtypes": ["float32"]}
SIDES = ("packed", "stock", "compiled")


def add_arguments(p) -> None:
    g = p.add_argument_group("steps")
    g.add_argument("--target", default="smollm2-135m-instruct")
    g.add_argument("--dtypes", type=str_list, default=["float32", "bfloat16"])
    g.add_argument("--sides", type=str_list, default=["packed", "stock"], help=f"any of {', '.join(SIDES)}")
    g.add_argument("--batch-sizes", type=int_list, default=[1, 8])
    g.add_argument("--tokens", type=int_list, default=[1, 2, 3, 4, 5, 6, 8], help="T: tokens per row per forward (K + 1)")
    g.add_argument("--context", type=int, default=256)
    g.add_argument("--reps", type=int, default=7, help="forwards per timed run (median)")
    g.add_argument("--baseline", choices=("tokens", "side"), default="tokens")


class Steps:
    """One prefilled runner per (dtype, side, B); `time(T)` is the median of `reps` forwards of T tokens per row."""

    def __init__(self, model, side: str, batch: int, context: int):
        import torch

        from raysd.models.loading import output_vocab_size
        from raysd.models.runner import make_runner
        from raysd.models.static_runner import StaticRunner

        self.vocab = output_vocab_size(model)
        if side == "compiled":
            self.runner = StaticRunner(model, vocab_size=self.vocab, max_cache_len=2 * context + 16, compile=True)
        else:
            self.runner = make_runner(model, "auto", vocab_size=self.vocab, linear_kernels="packed" if side == "packed" else "stock")
        self.runner.add_rows(batch)
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(3, self.vocab, (batch, context), generator=g)
        self.runner.forward(prompt, torch.ones_like(prompt, dtype=torch.bool), torch.ones(batch, dtype=torch.int64))  # eager
        self.base = self.runner.lengths.clone()
        self.batch, self.context = batch, context

    def step(self, T: int) -> float:
        import torch

        ids = torch.randint(3, self.vocab, (self.batch, T), generator=torch.Generator().manual_seed(T))
        start = time.perf_counter()
        self.runner.forward(ids, torch.ones_like(ids, dtype=torch.bool), torch.full((self.batch,), T))
        seconds = time.perf_counter() - start
        self.runner.rollback(self.base, self.context)  # the attended width back to the context's
        return seconds

    def time(self, T: int, reps: int) -> dict:
        seconds = [self.step(T) for _ in range(reps)]
        return {"step_s": statistics.median(seconds), "wall_s": sum(seconds)}


def run(a, log=print) -> Outcome:
    import torch

    from raysd.models.linear import packed_supported
    from raysd.models.loading import ModelSpec, load_model

    bad = [s for s in a.sides if s not in SIDES]
    if bad:
        raise SystemExit(f"--sides: unknown {bad}; choose from {SIDES}")
    variants, compile_s = [], {}
    for dtype in a.dtypes:
        model = load_model(ModelSpec(a.target, dtype))
        sides = [s for s in a.sides if s != "packed" or packed_supported(model) is None]
        for B in a.batch_sizes:
            for side in sides:
                box: dict = {}

                def steps(side=side, B=B, model=model, box=box) -> Steps:
                    if "s" not in box:
                        box["s"] = Steps(model, side, B, a.context)
                    return box["s"]

                for T in a.tokens:
                    def warm(side=side, B=B, T=T, steps=steps, dtype=dtype):
                        start = time.perf_counter()
                        with torch.inference_mode():
                            steps().step(T)
                        if side == "compiled":
                            compile_s[f"{dtype}, B={B}, T={T}"] = time.perf_counter() - start

                    base = (f"{dtype} {side}, B={B}, T={a.tokens[0]}" if a.baseline == "tokens" and T != a.tokens[0] else
                            f"{dtype} packed, B={B}, T={T}" if a.baseline == "side" and side != "packed" and "packed" in sides
                            else None)
                    variants.append(Variant(f"{dtype} {side}, B={B}, T={T}", {"dtype": dtype, "side": side, "batch": B, "tokens": T},
                                            lambda T=T, steps=steps: _timed(steps(), T, a.reps), base, warm))
    summaries, _ = run_variants(variants, a.repeats, ratio_keys=("step_s",), log=log)
    return Outcome(summaries, {"compile_s": compile_s, "context": a.context, "target": a.target})


def _timed(steps: Steps, T: int, reps: int) -> dict:
    import torch

    with torch.inference_mode():
        return steps.time(T, reps)
