"""Issue 19 item 5 (CPU half): tokens per target pass of draft trees, P = 1, 4, 16, 64 and the chain
(P = 0), beside Pankratov and Alistarh's speed-of-light bound from the measured target entropies.

SmolLM2-135M-Instruct (fp32, or `--dtype bfloat16`) with its shipped distilled draft (smollm2-135m-instruct-draft), K = 4
(the tree's depth limit; the chain's length), Spec-Bench first turns with the chat template,
round-robin over the 6 tasks, greedy (T = 0) and T = 1, fixed-length outputs (ignore_eos), one
SpecEngine batch of `--batch` rows, seeds = prompt index.

Tokens per pass = generated tokens / target forward passes, the bonus or recovered token
included (the pooled mean_acceptance_length). The bound is `theory.speed_of_light_bound(mu, mu2,
capacity)` with capacity = P + 1, the tokens one target forward reads per row (the pending token,
the tree's head, and the P nodes), and (mu, mu2) = `theory.entropy_moments` of the target's own
softmax (T = 1) on the contexts of the T = 1 chain run: every generated position of every prompt,
from one target forward over prompt + output. It is the leading term only (the O(1) term is
dropped), for capacity >= 2; the chain's row (P = 0) gets none (its capacity K + 1 is the P = K row's). Under greedy decoding the target is
deterministic (mu = 0, no finite bound); the T = 1 figure is shown beside it for scale.

Tokens/s is this CPU's, one thread: here the target's cost grows with the tokens it reads, so a
tree's extra nodes are paid in full. This is not where trees are meant to pay (a GPU with spare
verifier capacity at small batch is).

    python bench/tree_bench.py            # the documented run (docs/trees.md): 6 prompts x 32 tokens, batch 6
    python bench/tree_bench.py --quick    # smoke test
    python bench/tree_bench.py --per-task 2 --batch 1 --dtype bfloat16   # where this CPU's verifier has spare width

In bf16 (on an AVX512-BF16 CPU a pass over 8 tokens costs about 1.3 over 1) a tree's greedy rows may
differ from the chain's where the target's two best tokens are within rounding; each such row is checked
against the near-tie rule of tests/gpu/gpu_helpers.py, and anything else fails the run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # tests.gpu.gpu_helpers: the bf16 near-tie rule
from common import load_prompts, loadavg, machine  # noqa: E402

from raysd.core.sampling import SamplingParams  # noqa: E402
from raysd.core.theory import entropy_moments, speed_of_light_bound  # noqa: E402
from raysd.engine.drafters import DraftModelDrafter  # noqa: E402
from raysd.engine.engine import EngineConfig, SpecEngine  # noqa: E402
from raysd.engine.rows import Request  # noqa: E402
from raysd.models.loading import DEFAULT_MODEL, ModelSpec, eos_token_ids, load_model, load_tokenizer  # noqa: E402

DRAFT = "smollm2-135m-instruct-draft"


def run(target, draft, P, k, T, batch, prompts, max_new, eos):
    vocab = target.get_output_embeddings().weight.shape[0]
    engine = SpecEngine(target, DraftModelDrafter(draft, vocab),
                        EngineConfig(num_speculative_tokens=k, max_batch_size=batch, eos_token_ids=eos, tree_budget=P))
    requests = [Request(i, p["ids"], SamplingParams(temperature=T, seed=i, max_new_tokens=max_new, ignore_eos=True))
                for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    with torch.inference_mode():
        results = sorted(engine.generate(requests), key=lambda r: r.request_id)
    wall = time.perf_counter() - t0
    s = [r.stats for r in results]
    steps = sum(x.num_spec_steps for x in s)
    tokens = sum(len(r.token_ids) for r in results)
    t = engine.timings
    return {"P": P, "T": T, "tokens": tokens, "passes": steps, "tokens_per_pass": tokens / steps,
            "nodes_per_pass": sum(x.num_draft_tokens for x in s) / steps,
            "accepted_depth_per_pass": sum(x.num_accepted_draft_tokens for x in s) / steps,
            "branch_accepts": sum(x.num_branch_accepts for x in s), "wall_s": wall, "tok_s": tokens / wall,
            "draft_s_per_pass": t.draft_s / t.steps, "target_s_per_pass": t.target_s / t.steps,
            "token_ids": [r.token_ids for r in results]}


@torch.inference_mode()
def target_probs(target, prompts, outputs) -> np.ndarray:
    """The target's softmax (T = 1) at every generated position: [sum of output lengths, V]."""
    rows = []
    for p, out in zip(prompts, outputs):
        ids = torch.tensor([p["ids"] + list(out)])
        logits = target(input_ids=ids).logits[0, len(p["ids"]) - 1: ids.shape[1] - 1].double()
        rows.append(torch.softmax(logits, dim=-1).numpy())
    return np.concatenate(rows)


def plot(out: dict, path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for T, marker in ((0.0, "o"), (1.0, "s")):
        rows = [r for r in out["rows"] if r["T"] == T]
        trees = [r for r in rows if r["P"] > 0]
        line, = ax.plot([r["P"] for r in trees], [r["tokens_per_pass"] for r in trees], marker=marker, label=f"tree, T = {T:g}")
        chain = next(r for r in rows if r["P"] == 0)
        ax.axhline(chain["tokens_per_pass"], color=line.get_color(), ls=":", label=f"chain K = {out['args']['k']}, T = {T:g}")
    b = out["bound"]
    caps = np.arange(2, max(r["P"] for r in out["rows"]) + 2)
    ax.plot(caps - 1, [speed_of_light_bound(b["mu"], b["mu2"], int(c)) for c in caps], "k--",
            label="speed-of-light bound (T = 1 entropies)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tree budget P (nodes per row per step)")
    ax.set_ylabel("tokens per target pass")
    ax.set_title("SmolLM2-135M-Instruct + distilled draft, Spec-Bench")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--per-task", type=int, default=1, help="Spec-Bench prompts per task (6 tasks)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--budgets", default="0,1,4,16,64", help="tree budgets P (0: the chain)")
    p.add_argument("-k", type=int, default=4, help="the chain's length and the trees' depth limit")
    p.add_argument("--batch", type=int, default=6)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="target and draft dtype (bf16: greedy rows may differ from the chain's at near-ties, checked)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "tree_bench.json"))
    p.add_argument("--plot", default=str(Path(__file__).resolve().parent.parent / "notebooks" / "tree_bench.png"))
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    if a.quick:
        a.per_task, a.max_new_tokens, a.budgets = 1, 8, "0,4"
        a.out, a.plot = "/tmp/tree_bench_quick.json", "/tmp/tree_bench_quick.png"
    torch.set_num_threads(a.threads)
    tok = load_tokenizer(DEFAULT_MODEL)
    target = load_model(ModelSpec(DEFAULT_MODEL, dtype=a.dtype))
    draft = load_model(ModelSpec(DRAFT, dtype=a.dtype))
    prompts = load_prompts(tok, a.per_task)
    eos = eos_token_ids(target)
    budgets = [int(b) for b in a.budgets.split(",")]
    started, load_start = time.perf_counter(), loadavg()
    rows = []
    for T in (0.0, 1.0):
        for P in budgets:
            r = run(target, draft, P, a.k, T, a.batch, prompts, a.max_new_tokens, eos)
            rows.append(r)
            partial = {"partial": True, "args": vars(a), "rows": [{k: v for k, v in x.items() if k != "token_ids"} for x in rows]}
            Path(a.out).write_text(json.dumps(partial, indent=1))  # kept if the run is cut short
            print(f"T={T:g} P={P}: {r['tokens_per_pass']:.3f} tokens/pass, {r['nodes_per_pass']:.2f} nodes/pass, "
                  f"{r['branch_accepts']} branch accepts, {r['tok_s']:.1f} tok/s "
                  f"(draft {r['draft_s_per_pass'] * 1e3:.0f} ms + target {r['target_s_per_pass'] * 1e3:.0f} ms per pass)",
                  flush=True)
    greedy = [r for r in rows if r["T"] == 0.0]
    if a.dtype == "float32":
        assert all(r["token_ids"] == greedy[0]["token_ids"] for r in greedy), "greedy tree output differs from the chain's"
    else:  # a tree's verify rounds differently from the chain's: rows may differ, at near-ties only
        from tests.gpu.gpu_helpers import first_divergences, higher_precision_twin

        twin = higher_precision_twin(target)
        for r in greedy[1:]:
            identical, divs = first_divergences(target, twin, [q["ids"] for q in prompts], r["token_ids"], greedy[0]["token_ids"])
            assert all(d.allowed for d in divs), f"P = {r['P']}: divergences that are not bf16 near-ties: {divs}"
            r["rows_identical_to_chain"] = identical
            print(f"P={r['P']}: {identical}/{len(prompts)} greedy rows identical to the chain's, the others differ at a near-tie")
        del twin
    chain1 = next(r for r in rows if r["T"] == 1.0 and r["P"] == budgets[0])
    mu, mu2 = entropy_moments(target_probs(target, prompts, chain1["token_ids"]))
    mu0, mu20 = entropy_moments(target_probs(target, prompts, greedy[0]["token_ids"]))
    for r in rows:
        r["bound"] = speed_of_light_bound(mu, mu2, r["P"] + 1) if r["P"] >= 1 else None
        del r["token_ids"]
    out = {"machine": machine(), "loadavg_start": load_start, "loadavg_end": loadavg(),
           "elapsed_s": time.perf_counter() - started, "args": vars(a),
           "prompts": [{"question_id": q["question_id"], "task": q["task"], "len": len(q["ids"])} for q in prompts],
           "bound": {"mu": mu, "mu2": mu2, "contexts": "T = 1 chain run", "capacity": "P + 1",
                     "greedy_contexts_mu": mu0, "greedy_contexts_mu2": mu20},
           "rows": rows}
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"entropy moments (T = 1 contexts): mu {mu:.3f} nats, mu2 {mu2:.3f}; bound at P = "
          + ", ".join(f"{r['P']}: {r['bound']:.2f}" for r in rows if r["T"] == 1.0 and r["bound"]))
    if plot(out, Path(a.plot)):
        print(f"plot: {a.plot}")
    print(f"load average: {load_start:.2f} at the start, {out['loadavg_end']:.2f} at the end; {out['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
