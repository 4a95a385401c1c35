"""Step costs on the machine at hand: T_target(B, K) and T_draft(B).

T_target(B, K) is one target forward of K + 1 tokens per row (the last committed token plus
K drafts; K = 0 is plain decoding) on B rows that each hold `context` cached tokens, with
K + 1 logits per row as the verifier asks. T_draft(B) is one draft forward of one token per
row on the same context (a model drafter makes K of them per step), or one n-gram lookup
over B histories. Each time is the median of `reps` runs after one warm-up run; the K of one
profile are timed in interleaved rounds (K = 0, 1, 2, .., then again), so that a burst of
other work on the machine (a second actor loading its model at start-up) lands on every K
alike instead of on whichever was being timed.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Callable, Sequence

import torch

from raysd.core.speculation import StepCosts
from raysd.models.loading import output_vocab_size
from raysd.models.runner import Runner, make_runner


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_times(fns: dict, reps: int, device: torch.device, after: Callable[[], None] = lambda: None) -> dict:
    """{key: median seconds of fns[key]()} over `reps` interleaved rounds (each round calls every
    function once, in order), after one warm-up round that is dropped; `after` runs after each call."""
    times: dict = {key: [] for key in fns}
    for i in range(reps + 1):
        for key, fn in fns.items():
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            if i:
                times[key].append(time.perf_counter() - t0)
            after()
    return {key: statistics.median(t) for key, t in times.items()}


def median_time(fn: Callable[[], None], reps: int, device: torch.device, after: Callable[[], None] = lambda: None) -> float:
    return median_times({0: fn}, reps, device, after)[0]


def _prefilled_runner(model, batch_size: int, context: int, vocab: int, kind: str, seed: int = 0,
                      linear_kernels: str = "auto") -> Runner:
    runner = make_runner(model, kind, vocab_size=vocab, linear_kernels=linear_kernels)
    runner.add_rows(batch_size)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch_size, context), generator=g).to(runner.device)  # [B, context]
    ones = torch.ones(batch_size, dtype=torch.int64, device=runner.device)
    runner.forward(ids, torch.ones_like(ids, dtype=torch.bool), ones)
    return runner


def time_forward(model, batch_size: int, ks: Sequence[int], context: int = 128, reps: int = 3,
                 runner: str = "auto", linear_kernels: str = "auto") -> dict[int, float]:
    """{K: seconds of one forward of K + 1 tokens per row on batch_size rows}, through the runner
    the engine would run the model on (`runner`: raysd.models.runner.make_runner's kind): the
    static runner's verify and Hugging Face's DynamicCache cost differently per extra token."""
    vocab = output_vocab_size(model)
    runner = _prefilled_runner(model, batch_size, context, vocab, runner, linear_kernels=linear_kernels)
    base = runner.lengths.clone()  # [B]
    calls = {}
    for k in ks:
        ids = torch.randint(3, vocab, (batch_size, k + 1)).to(runner.device)  # [B, K + 1]
        valid = torch.ones_like(ids, dtype=torch.bool)
        n = torch.full((batch_size,), k + 1, dtype=torch.int64, device=runner.device)
        calls[k] = functools.partial(runner.forward, ids, valid, n)
    return median_times(calls, reps, runner.device, lambda: runner.rollback(base))


def nondecreasing(values: Sequence[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators). A forward
    over more tokens per row does not cost less, so a measured dip is noise; left in, it makes the
    adaptive controller see a K > 0 step as cheaper than plain decoding and draft where drafting
    loses (docs/history/benchmarks.md, Benchmark 6: `-k auto` against `--draft none`)."""
    blocks: list[list[float]] = []  # [mean, count] of each pooled run
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, c2 = blocks.pop()
            m1, c1 = blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return [m for m, c in blocks for _ in range(int(c))]


def time_forward_upto(model, batch_size: int, k_max: int, context: int = 128, reps: int = 3,
                      runner: str = "auto") -> list[float]:
    """[k_max + 1] seconds of one forward of K + 1 tokens per row, K = 0..k_max: measured at K = 0
    and the powers of two up to k_max (and k_max), linear in between. A forward's time is close to
    piecewise linear in its tokens, and the adaptive controller weighs steps, not microseconds:
    measuring a few points instead of all of them keeps the profile cheaper than what it saves.
    The measured points are made non-decreasing in K first (`nondecreasing`)."""
    ks = sorted({0, k_max, *(2**i for i in range(k_max.bit_length()) if 2**i <= k_max)})
    raw = time_forward(model, batch_size, ks, context, reps, runner)
    measured = dict(zip(ks, nondecreasing([raw[k] for k in ks])))
    out = []
    for k in range(k_max + 1):
        hi = next(x for x in ks if x >= k)
        lo = max(x for x in ks if x <= k)
        w = 0.0 if hi == lo else (k - lo) / (hi - lo)
        out.append((1 - w) * measured[lo] + w * measured[hi])
    return out


def crossover_tokens(model, size: int = 4096, copy_bytes: int = 1 << 29, reps: int = 5) -> float | None:
    """Tokens per forward (rows x tokens per row) past which `model`'s forward turns compute-bound on
    its device: N* = F W / (2 P BW), from a matrix product's FLOP/s F in the model's dtype and a copy's
    bandwidth BW (bytes read and written per second), for W bytes of P parameters (Williams et al.
    2009's ridge point, in tokens: a forward reads its weights once and multiplies each by every
    token, 2 FLOP per parameter per token). Measured in a fraction of a second; None off CUDA, where
    the learned costs need no such prior (a CPU's verify cost is not a roofline's)."""
    p = next(model.parameters())
    if p.device.type != "cuda":
        return None
    x = torch.randn(size, size, device=p.device, dtype=p.dtype)
    a = torch.empty(copy_bytes, dtype=torch.uint8, device=p.device)
    b = torch.empty_like(a)
    flops = 2 * size**3 / median_time(lambda: x @ x, reps, p.device)
    bandwidth = 2 * copy_bytes / median_time(lambda: b.copy_(a), reps, p.device)
    params = sum(q.numel() for q in model.parameters())
    weights = sum(q.numel() * q.element_size() for q in model.parameters())
    return flops * weights / (2 * params * bandwidth)


def profile_step_costs(target, draft=None, k_max: int = 8, batch_sizes: Sequence[int] = (1, 4, 16, 64),
                       context: int = 128, reps: int = 3, runner: str = "auto") -> StepCosts:
    """Measure StepCosts on the machine at hand: T_target(B, K + 1) for K = 0..k_max and one
    draft forward per batch size (a model-free drafter counts as free), both on the runner the
    engine runs them on (EngineConfig.runner, DraftModelDrafter's runner)."""
    target_s, draft_s = [], []
    for B in batch_sizes:
        target_s.append(tuple(time_forward_upto(target, B, k_max, context, reps, runner)))
        draft_s.append(time_forward(draft, B, [0], context, reps, runner)[0] if draft is not None else 0.0)
    return StepCosts(tuple(batch_sizes), tuple(target_s), tuple(draft_s))
