"""Issue 20 item 1: the relaxed acceptance dial (`--acceptance relaxed:LAMBDA`) measured, beside
Yin et al. 2024's Pareto front (NeurIPS 2024, arXiv 2411.00841, Theorems 4-5).

The relaxed test verifies the drafts against the mixture m = (1 - lam) p + lam q (p the target's
distribution, q the draft's, at the row's temperature). At a drafted position it emits exactly m,
so, with TV = TV(p, q) there:

    P(reject) = (1 - lam) TV        TV(output, target) = lam TV        (sum: TV, the front)

(raysd.core.rejection.rejection_sample's docstring, theory.relaxed_rule_point). The bonus token,
drawn when all drafts pass, is the target's own.

Two parts:

1. Real model, Spec-Bench. SmolLM2-135M-Instruct (fp32) with its shipped distilled draft
   (smollm2-135m-instruct-draft), K = 4, T = 1, the first `--per-task` questions of each of the 6
   tasks (first turn, chat template), one SpecEngine batch, `--max-new-tokens` fixed-length
   outputs (ignore_eos), seed = prompt index, one torch thread. Per lam:
   - measured by the engine's own statistics, pooled over rows: acceptance rate (accepted /
     drafted), rejection rate per tested position ((tested - accepted) / tested: each rejection
     ends a step), tokens per target pass, tok/s (median of `--repeats` runs, each run's 1-minute
     load average beside it; the tokens are checked identical across repeats);
   - TV(p, q) over the positions the run tested: 1 - alpha_estimate, the engine's mean over
     tested positions of sum_x min(p(x), q(x)), computed on the step's own target_probs and
     draft_probs (verifier.py: the true target, not the mixture);
   - TV(output, target) per tested position, estimated in closed form: lam x that TV (the
     position's output law is the mixture); per emitted token: x tested / emitted;
   - the theory beside: the front's rejection rate at that TV ((1 - lam) TV) and the tokens per
     pass Leviathan et al.'s eq. 1 predicts at the acceptance rate 1 - (1 - lam) TV.
   The rejection rate is the empirical coordinate (accept/reject draws); the TV coordinate is the
   closed form on measured distributions. Part 2 checks that closed form empirically.

2. Tiny vocabulary, exact. Two random tiny Llamas (V = 6 tokens, logits spread), K = 2, 3 new
   tokens after a fixed prompt. The relaxed process is enumerated exactly (every prefix, every
   within-step state, the engine's draft budget min(K, tokens left - 1)), which gives the exact
   law of the 6^3 output sequences and, per position, E_prefix[TV(out(.|prefix), p(.|prefix))].
   Against it, `--tiny-rows` engine rows (seeds 0..N-1): the empirical law's distances (plug-in,
   biased upward by sampling noise: lam = 0's row shows the floor), and the engine's estimator
   lam (1 - alpha_estimate) tested / emitted.

Greedy (T = 0) is not run: both distributions are one-hot, TV is 0 or 1 per position, and the
relaxed test accepts a draft that differs from the target's argmax with probability lam; the
figures above are for sampling.

    nice -n 15 python bench/relaxed_bench.py           # the documented run (docs/benchmarks.md)
    nice -n 15 python bench/relaxed_bench.py --quick   # smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # raysd from this checkout
from common import load_prompts, loadavg, machine  # noqa: E402

from raysd.core import theory  # noqa: E402
from raysd.core.sampling import SamplingParams  # noqa: E402
from raysd.engine.drafters import DraftModelDrafter  # noqa: E402
from raysd.engine.engine import EngineConfig, LossyAcceptanceWarning, SpecEngine  # noqa: E402
from raysd.engine.rows import Request  # noqa: E402

DRAFT = "smollm2-135m-instruct-draft"
ROOT = Path(__file__).resolve().parents[1]


def rule(lam: float) -> str:
    return "exact" if lam == 0 else f"relaxed:{lam:g}"


def engine_run(target, draft, lam, k, batch, requests):
    vocab = target.get_output_embeddings().weight.shape[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LossyAcceptanceWarning)
        engine = SpecEngine(target, DraftModelDrafter(draft, vocab),
                            EngineConfig(num_speculative_tokens=k, max_batch_size=batch, eos_token_ids=(), acceptance=rule(lam)))
    load = loadavg()
    t0 = time.perf_counter()
    with torch.inference_mode():
        results = sorted(engine.generate(requests), key=lambda r: r.request_id)
    wall = time.perf_counter() - t0
    t = engine.timings
    return results, wall, load, {"prefill_s": t.prefill_s, "draft_s": t.draft_s, "target_s": t.target_s, "steps": t.steps}


def pooled(results, lam: float, k: int) -> dict:
    s = [r.stats for r in results]
    steps, drafted = sum(x.num_spec_steps for x in s), sum(x.num_draft_tokens for x in s)
    accepted, tested = sum(x.num_accepted_draft_tokens for x in s), sum(x.num_tested_positions for x in s)
    tokens = sum(len(r.token_ids) for r in results)
    assert {r.acceptance for r in results} == {rule(lam)}
    tv = 1.0 - sum(x.overlap_sum for x in s) / tested
    reject = (tested - accepted) / tested
    pred_reject, loss = theory.relaxed_rule_point(tv, lam)
    return {"lam": lam, "acceptance": rule(lam), "tokens": tokens, "passes": steps, "drafted": drafted,
            "accepted": accepted, "tested": tested,
            "acceptance_rate": accepted / drafted, "rejection_rate": reject, "tokens_per_pass": tokens / steps,
            "tv_target_draft": tv, "tv_out_target_per_tested": loss, "tv_out_target_per_token": loss * tested / tokens,
            "front_rejection_rate": pred_reject, "front_tv_loss_at_measured_rejection": theory.pareto_front_tv_loss(min(reject, tv), tv),
            "predicted_tokens_per_pass": theory.expected_tokens_per_step(1.0 - pred_reject, k)}


def real_model(a) -> dict:
    from raysd.models.loading import DEFAULT_MODEL, ModelSpec, load_model, load_tokenizer

    tok = load_tokenizer(DEFAULT_MODEL)
    target, draft = load_model(ModelSpec(DEFAULT_MODEL)), load_model(ModelSpec(DRAFT))
    prompts = load_prompts(tok, a.per_task)
    requests = [Request(i, p["ids"], SamplingParams(temperature=1.0, seed=a.seed_offset + i, max_new_tokens=a.max_new_tokens, ignore_eos=True))
                for i, p in enumerate(prompts)]
    engine_run(target, draft, 0.0, a.k, len(requests), requests[:2])  # warm-up
    rows = []
    for lam in a.lams:
        walls, loads, timings, tokens = [], [], [], None
        for rep in range(a.repeats):
            results, wall, load, timing = engine_run(target, draft, lam, a.k, len(requests), requests)
            timings.append(timing)
            ids = [r.token_ids for r in results]
            assert tokens is None or ids == tokens, "a fixed seed must reproduce the run"
            tokens, stats = ids, (pooled(results, lam, a.k) if rep == 0 else stats)
            walls.append(wall)
            loads.append(load)
        row = dict(stats, tok_s=stats["tokens"] / statistics.median(walls), wall_s=walls, loadavg=loads, timings=timings,
                   decode_tok_s=stats["tokens"] / statistics.median(w - t["prefill_s"] for w, t in zip(walls, timings)))
        rows.append(row)
        print(f"lam={lam:<5g} accept {row['acceptance_rate']:.3f}  reject/tested {row['rejection_rate']:.3f} "
              f"(front {row['front_rejection_rate']:.3f})  TV(p,q) {row['tv_target_draft']:.3f}  "
              f"TV(out,p)/tested {row['tv_out_target_per_tested']:.3f}  tok/pass {row['tokens_per_pass']:.2f} "
              f"(eq.1 {row['predicted_tokens_per_pass']:.2f})  {row['tok_s']:.1f} tok/s ({row['decode_tok_s']:.1f} without prefill)  load {loads}", flush=True)
    return {"prompts": [{"question_id": p["question_id"], "task": p["task"], "len": len(p["ids"])} for p in prompts],
            "rows": rows}


# ---------------------------------------------------------------- tiny vocabulary, exact


def tiny_llama(seed: int, vocab: int, spread: float):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64, bos_token_id=1, eos_token_id=None, pad_token_id=0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(spread)  # spread the logits: distributions far from uniform
    return model.eval()


class Conditionals:
    """p(.|prompt + prefix) at T = 1 in float64, memoised by prefix."""

    def __init__(self, model, prompt):
        self.model, self.prompt, self.cache = model, list(prompt), {}

    def __call__(self, prefix: tuple) -> np.ndarray:
        if prefix not in self.cache:
            with torch.inference_mode():
                logits = self.model(torch.tensor([self.prompt + list(prefix)])).logits[0, -1].double()
            self.cache[prefix] = torch.softmax(logits, -1).numpy()
        return self.cache[prefix]


def enumerate_relaxed(P, Q, V: int, n: int, K: int, lam: float) -> dict:
    """The exact law of the first n tokens of the relaxed process, as the engine runs it: each step
    drafts d = min(K, n - emitted - 1) tokens; at a drafted position token x is accepted (the step
    goes on) with probability min(q(x), m(x)) and emitted as the recovered token (the step ends)
    with probability max(0, m(x) - q(x)), m = (1 - lam) p + lam q; after d accepts the bonus is
    drawn from p. Also: per position t, E_prefix[TV(out_t(.|prefix), p(.|prefix))]; expected
    tested positions and rejections."""
    def budget(length):
        return min(K, n - length - 1)

    states = {((), 0, budget(0)): 1.0}  # (prefix, drafts passed in this step, drafts this step) -> prob
    tested = rejects = 0.0
    pos_tv = []
    for _ in range(n):
        new: dict = defaultdict(float)
        out_given_prefix: dict = defaultdict(lambda: np.zeros(V))  # the law of this token given the prefix (unnormalised)
        for (prefix, j, d), w in states.items():
            p = P(prefix)
            if j < d:
                q = Q(prefix)
                m = (1 - lam) * p + lam * q
                acc, rej = np.minimum(q, m), np.maximum(m - q, 0.0)
                tested += w
                rejects += w * rej.sum()
                for x in range(V):
                    nxt = prefix + (x,)
                    if acc[x] > 0:
                        new[nxt, j + 1, d] += w * acc[x]
                    if rej[x] > 0:
                        new[nxt, 0, budget(len(nxt))] += w * rej[x]
                out_given_prefix[prefix] += w * m
            else:  # the bonus (or, with no drafts, a plain target token)
                for x in range(V):
                    nxt = prefix + (x,)
                    new[nxt, 0, budget(len(nxt))] += w * p[x]
                out_given_prefix[prefix] += w * p
        pos_tv.append(sum(0.5 * np.abs(o - o.sum() * P(prefix)).sum() for prefix, o in out_given_prefix.items()))
        states = new
    law = defaultdict(float)
    for (prefix, _, _), w in states.items():
        law[prefix] += w
    return {"law": dict(law), "pos_tv": pos_tv, "tested": tested, "rejects": rejects}


def target_law(P, V: int, n: int) -> dict:
    law = {(): 1.0}
    for _ in range(n):
        law = {s + (x,): w * P(s)[x] for s, w in law.items() for x in range(V)}
    return law


def tv_laws(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(s, 0.0) - b.get(s, 0.0)) for s in set(a) | set(b))


def empirical_pos_tv(seqs: list[tuple], P, n: int) -> list[float]:
    """Per position t: sum over prefixes of freq(prefix) TV(empirical next-token law, p(.|prefix))."""
    N, out = len(seqs), []
    for t in range(n):
        groups: dict = defaultdict(Counter)
        for s in seqs:
            groups[s[:t]][s[t]] += 1
        tv = 0.0
        for prefix, c in groups.items():
            cnt = sum(c.values())
            emp = np.array([c.get(x, 0) for x in range(len(P(prefix)))]) / cnt
            tv += cnt / N * 0.5 * np.abs(emp - P(prefix)).sum()
        out.append(tv)
    return out


def tiny(a) -> dict:
    V, n, K, prompt = 6, 3, 2, [1, 4, 2]
    target, draft = tiny_llama(0, V, a.tiny_spread), tiny_llama(1, V, a.tiny_spread)
    P, Q = Conditionals(target, prompt), Conditionals(draft, prompt)
    exact_target = target_law(P, V, n)
    rows = []
    for lam in a.lams:
        ex = enumerate_relaxed(P, Q, V, n, K, lam)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LossyAcceptanceWarning)
            engine = SpecEngine(target, DraftModelDrafter(draft, V),
                                EngineConfig(num_speculative_tokens=K, max_batch_size=a.tiny_batch, eos_token_ids=(), acceptance=rule(lam)))
        reqs = [Request(i, prompt, SamplingParams(temperature=1.0, seed=i, max_new_tokens=n, ignore_eos=True)) for i in range(a.tiny_rows)]
        with torch.inference_mode():
            results = engine.generate(reqs)
        seqs = [tuple(r.token_ids) for r in results]
        N = len(seqs)
        emp = {s: c / N for s, c in Counter(seqs).items()}
        st = pooled(results, lam, K)
        emp_pos = empirical_pos_tv(seqs, P, n)
        row = {"lam": lam, "rows": N,
               "exact_tv_per_token": sum(ex["pos_tv"]) / n, "empirical_tv_per_token": sum(emp_pos) / n,
               "estimator_tv_per_token": st["tv_out_target_per_token"],
               "exact_tv_per_position": ex["pos_tv"], "empirical_tv_per_position": emp_pos,
               "exact_sequence_tv": tv_laws(ex["law"], exact_target), "empirical_sequence_tv": tv_laws(emp, exact_target),
               "empirical_vs_exact_law_tv": tv_laws(emp, ex["law"]),
               "exact_rejection_rate": ex["rejects"] / ex["tested"], "measured_rejection_rate": st["rejection_rate"],
               "exact_tested_per_row": ex["tested"], "measured_tested_per_row": st["tested"] / N,
               "tv_target_draft_tested": st["tv_target_draft"]}
        rows.append(row)
        print(f"tiny lam={lam:<5g} TV/token exact {row['exact_tv_per_token']:.4f} empirical {row['empirical_tv_per_token']:.4f} "
              f"estimator {row['estimator_tv_per_token']:.4f} | sequence TV exact {row['exact_sequence_tv']:.4f} "
              f"empirical {row['empirical_sequence_tv']:.4f} (empirical vs exact law {row['empirical_vs_exact_law_tv']:.4f}) | "
              f"reject exact {row['exact_rejection_rate']:.4f} measured {row['measured_rejection_rate']:.4f}", flush=True)
    return {"V": V, "new_tokens": n, "K": K, "prompt": prompt, "spread": a.tiny_spread, "rows": rows}


# ---------------------------------------------------------------- plot


def plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ax = axes[0]
    rows = out["real"]["rows"]
    tv = float(np.mean([r["tv_target_draft"] for r in rows]))
    ax.plot([0, tv], [tv, 0], "k--", lw=1, label=f"front: P(reject) + TV = TV(p, q) (mean {tv:.3f})")
    for r in rows:
        ax.plot([0, r["tv_target_draft"]], [r["tv_target_draft"], 0], color="0.85", lw=0.6, zorder=0)
    ax.scatter([r["rejection_rate"] for r in rows], [r["tv_out_target_per_tested"] for r in rows], c="C0", zorder=3,
               label="measured rejection rate, lam TV(p, q)")
    for r in rows:
        ax.annotate(f"lam={r['lam']:g}", (r["rejection_rate"], r["tv_out_target_per_tested"]), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")
    # The tiny vocabulary: measured rejection rate against the exact TV per tested position.
    tiny = out["tiny"]["rows"]
    tt = float(np.mean([r["tv_target_draft_tested"] for r in tiny]))
    ax.plot([0, tt], [tt, 0], ":", color="C1", lw=1, label=f"tiny V = {out['tiny']['V']}: front at its TV {tt:.3f}")
    ax.scatter([r["measured_rejection_rate"] for r in tiny],
               [r["exact_tv_per_token"] * out["tiny"]["new_tokens"] / r["exact_tested_per_row"] for r in tiny],
               marker="x", color="C1", zorder=3, label="tiny: measured rejection rate, exact TV (enumeration)")
    ax.set_xlabel("rejection rate per tested position")
    ax.set_ylabel("TV(output, target) per tested position")
    ax.set_title("SmolLM2-135M + distilled draft, Spec-Bench, T = 1, K = 4", fontsize=9)
    ax.legend(fontsize=6.5)
    ax2 = axes[1]
    lams = [r["lam"] for r in rows]
    ax2.plot(lams, [r["tokens_per_pass"] for r in rows], "o-", label="tokens / target pass (measured)")
    ax2.plot(lams, [r["predicted_tokens_per_pass"] for r in rows], "x--", label="eq. 1 at 1 - (1 - lam) TV")
    ax2.set_xlabel("lam")
    ax2.set_ylabel("tokens per target pass")
    ax3 = ax2.twinx()
    ax3.plot(lams, [r["tok_s"] for r in rows], "s:", color="C2", label="tok/s (median)")
    ax3.set_ylabel("tok/s (this CPU, 1 thread)")
    h1, l1 = ax2.get_legend_handles_labels()
    h2, l2 = ax3.get_legend_handles_labels()
    ax2.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper left")
    ax2.set_title("speed against lam", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lams", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 0.1, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--per-task", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tiny-rows", type=int, default=100000)
    p.add_argument("--tiny-batch", type=int, default=1024)
    p.add_argument("--tiny-spread", type=float, default=8.0)
    p.add_argument("--skip-real", action="store_true")
    p.add_argument("--skip-tiny", action="store_true")
    p.add_argument("--seed-offset", type=int, default=0, help="real model: seed = offset + prompt index")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "relaxed_bench.json"))
    p.add_argument("--plot", default=str(ROOT / "notebooks" / "relaxed_front.png"))
    p.add_argument("--replot", action="store_true", help="only redraw --plot from the results in --out")
    p.add_argument("--quick", action="store_true", help="smoke test: 1 prompt per task, 8 tokens, 1 repeat, 2,000 tiny rows, /tmp")
    a = p.parse_args()
    if a.quick:
        a.per_task, a.max_new_tokens, a.repeats, a.tiny_rows, a.lams = 1, 8, 1, 2000, [0.0, 0.5, 1.0]
        a.out, a.plot = "/tmp/relaxed_bench_quick.json", "/tmp/relaxed_bench_quick.png"
    if a.replot:
        plot(json.loads(Path(a.out).read_text()), a.plot)
        return
    torch.set_num_threads(a.threads)
    started, load_start = time.perf_counter(), loadavg()
    out = {"machine": machine(), "args": vars(a), "loadavg_start": load_start}
    if not a.skip_tiny:
        out["tiny"] = tiny(a)
    if not a.skip_real:
        out["real"] = real_model(a)
    out.update(loadavg_end=loadavg(), elapsed_s=time.perf_counter() - started)
    Path(a.out).write_text(json.dumps(out, indent=1))
    if "real" in out and "tiny" in out:
        plot(out, a.plot)
    print(f"load average: {load_start:.2f} at the start, {out['loadavg_end']:.2f} at the end; {out['elapsed_s']:.0f} s -> {a.out}")


if __name__ == "__main__":
    main()
