"""Issue 18 item 5: the shipped EAGLE feature draft against the target alone, SmolLM2-135M-Instruct
on this CPU, on prompts held out from its training, greedy. `--set heldout` (the default): the
Spec-Bench prompts `raysd distill --holdout-per-task 4` kept out (4 per trained task), the task kept
entirely out (translation) and held-out standard-library files (code), round-robin over the tasks;
`--set translation`: translation prompts only (the first run's set).

Engine tokens/s of plain decoding (NoDrafter) and of the EAGLE draft at K = 1, 2, 3, batch 1 and 8,
the variants interleaved in each repeat (medians reported), with the measured acceptance and the
cost model's prediction (1 - a^(K+1)) / ((1 - a)(cK + T(K+1)/T(1))) beside each, from the run's own
step times.

In bf16 (`--dtype bfloat16`) a row may differ from plain decoding where the target's two best tokens are
within rounding of each other (a K + 1-token verify rounds differently from a 1-token step); every such
row is checked against the near-tie rule of tests/gpu/gpu_helpers.py, and anything else fails the run.
In float32 every row must equal plain decoding's.

    python bench/eagle_bench.py --take 2 --ks 1,2,3,4 --repeats 2 --dtype bfloat16   # docs/benchmarks.md
    python bench/eagle_bench.py --quick             # smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # tests.gpu.gpu_helpers: the bf16 near-tie rule
from common import load_prompts, loadavg, machine, median  # noqa: E402

from raysd.core.sampling import SamplingParams  # noqa: E402
from raysd.core.theory import expected_tokens_per_step  # noqa: E402
from raysd.engine.drafters import FeatureDrafter, NoDrafter  # noqa: E402
from raysd.engine.engine import EngineConfig, SpecEngine  # noqa: E402
from raysd.engine.rows import Request  # noqa: E402
from raysd.models.loading import DEFAULT_EAGLE, DEFAULT_MODEL, ModelSpec, eos_token_ids, load_eagle_draft, load_model, load_tokenizer  # noqa: E402


def run(target, drafter, k, batch, prompts, max_new, eos):
    engine = SpecEngine(target, drafter, EngineConfig(num_speculative_tokens=k, max_batch_size=batch, eos_token_ids=eos))
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    t0 = time.perf_counter()
    with torch.inference_mode():
        results = engine.generate([Request(i, p["ids"], params) for i, p in enumerate(prompts)])
    wall = time.perf_counter() - t0
    steps = sum(r.stats.num_spec_steps for r in results)
    drafted = sum(r.stats.num_draft_tokens for r in results)
    accepted = sum(r.stats.num_accepted_draft_tokens for r in results)
    tokens = sum(len(r.token_ids) for r in results)
    t = engine.timings
    per_row = [(r.stats.num_draft_tokens, r.stats.num_accepted_draft_tokens) for r in results]
    return {"tok_s": tokens / wall, "per_row": per_row, "tokens": [r.token_ids for r in results], "alpha": accepted / drafted if drafted else None,
            "tokens_per_step": tokens / steps, "draft_s_per_step": t.draft_s / t.steps, "target_s_per_step": t.target_s / t.steps}


def _rows_identical(tokens: list[list[int]], plain: list[list[int]]) -> int:
    return sum(a == b for a, b in zip(tokens, plain))


@functools.cache
def _fp32_twin(model):
    from tests.gpu.gpu_helpers import higher_precision_twin
    return higher_precision_twin(model)


def _check_near_ties(target, prompts, got, plain) -> list[dict]:
    """The rows that differ from plain decoding must first differ at a near-tie of the target (the
    rule of tests/gpu/gpu_helpers.py: both tokens within 4x the measured bf16 logit error of the fp32
    maximum); anything else is a bug, not rounding."""
    from tests.gpu.gpu_helpers import first_divergences
    _, divs = first_divergences(target, _fp32_twin(target), [p["ids"] for p in prompts], got, plain)
    bad = [d for d in divs if not d.allowed]
    assert not bad, f"divergences from plain decoding that are not bf16 near-ties: {bad}"
    return [dataclasses.asdict(d) for d in divs]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", choices=("heldout", "translation"), default="heldout")
    p.add_argument("--per-task", type=int, default=4,
                   help="--set heldout: the --holdout-per-task the draft was trained with (which prompts are held out)")
    p.add_argument("--take", type=int, default=0, help="--set heldout: run only the first N held-out prompts of each task (0: all)")
    p.add_argument("--prompts", type=int, default=8, help="prompts of the held-out task (translation) and of code")
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--ks", default="1,2,3")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="target and draft dtype (on a CPU with AVX512-BF16 a bf16 pass over 2-5 tokens costs about one over 1)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "eagle_bench.json"))
    p.add_argument("--eagle", default=DEFAULT_EAGLE, help="EAGLE draft: name or directory (default: the shipped one)")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    if a.quick:
        a.prompts, a.max_new_tokens, a.repeats, a.batch_sizes, a.ks = 2, 8, 1, "1", "2"
    torch.set_num_threads(a.threads)
    tok = load_tokenizer(DEFAULT_MODEL)
    target = load_model(ModelSpec(DEFAULT_MODEL, dtype=a.dtype))
    eagle = load_eagle_draft(a.eagle, target, dtype=a.dtype)
    if a.set == "translation":
        prompts = load_prompts(tok, a.prompts, tasks=("translation",))
    else:
        from eagle_eval import SPEC_BENCH, heldout_prompts

        enc = [(ids, t) for ids, t in heldout_prompts(tok, SPEC_BENCH, "translation", a.per_task, a.prompts, a.prompts)
               if len(ids) <= a.max_prompt_tokens]
        by_task = {t: [ids for ids, x in enc if x == t][: a.take or None] for t in dict.fromkeys(x for _, x in enc)}
        prompts = [{"ids": ids, "task": t} for i in range(max(map(len, by_task.values())))
                   for t, ps in by_task.items() if i < len(ps) for ids in [ps[i]]]
        if a.quick:
            prompts = prompts[:2]
    eos = eos_token_ids(target)
    ks = [int(k) for k in a.ks.split(",")]
    rows = []
    for B in (int(b) for b in a.batch_sizes.split(",")):
        runs: dict[int, list[dict]] = {k: [] for k in [0] + ks}
        for _ in range(a.repeats):
            for k in [0] + ks:
                drafter = NoDrafter(target.config.vocab_size) if k == 0 else FeatureDrafter(eagle, target.config.vocab_size)
                runs[k].append(run(target, drafter, k, B, prompts, a.max_new_tokens, eos))
        base = runs[0]
        t1 = median([r["target_s_per_step"] for r in base])
        for k in ks:
            rs = runs[k]
            # fp32: every row equals plain decoding's. bf16: a verify over K + 1 tokens rounds differently
            # from a 1-token step, so a near-tie may resolve the other way; count the rows that differ.
            identical = _rows_identical(rs[0]["tokens"], base[0]["tokens"])
            assert a.dtype != "float32" or identical == len(prompts), "greedy output differs from plain decoding"
            near_ties = _check_near_ties(target, prompts, rs[0]["tokens"], base[0]["tokens"]) if identical < len(prompts) else []
            alpha = median([r["alpha"] for r in rs])
            tk, td = median([r["target_s_per_step"] for r in rs]), median([r["draft_s_per_step"] for r in rs])
            predicted = expected_tokens_per_step(alpha, k) / ((td + tk) / t1)
            measured = median([r["tok_s"] for r in rs]) / median([r["tok_s"] for r in base])
            rows.append({"batch": B, "k": k, "alpha": alpha, "tokens_per_step": median([r["tokens_per_step"] for r in rs]),
                         "c": td / k / t1, "target_ratio": tk / t1, "speedup": measured, "predicted": predicted,
                         "tok_s": median([r["tok_s"] for r in rs]), "tok_s_plain": median([r["tok_s"] for r in base]),
                         "rows_identical_to_plain": identical, "rows": len(prompts), "near_ties": near_ties})
            first = rs[0]["per_row"]  # greedy: every repeat drafts and accepts the same tokens
            by_task = {}
            for p_, (d, acc) in zip(prompts, first):
                t = by_task.setdefault(p_.get("task", "translation"), [0, 0])
                t[0], t[1] = t[0] + d, t[1] + acc
            rows[-1]["alpha_by_task"] = {t: acc / d if d else None for t, (d, acc) in by_task.items()}
            r = rows[-1]
            print(f"B={B} K={k}: {r['tok_s']:.1f} tok/s vs plain {r['tok_s_plain']:.1f} -> {r['speedup']:.2f}x "
                  f"(predicted {r['predicted']:.2f}x; alpha {alpha:.2f}, c {r['c']:.3f}, T(K+1)/T(1) {r['target_ratio']:.2f})",
                  flush=True)
            print(f"   rows identical to plain decoding: {identical}/{len(prompts)}; the others diverge at a bf16 near-tie: "
                  + ", ".join(f"row {d['row']} token {d['position']}" for d in near_ties))
            print("   alpha by task: " + ", ".join(f"{t} {v:.2f}" for t, v in r["alpha_by_task"].items() if v is not None))
    out = {"machine": machine(), "loadavg_end": loadavg(), "args": vars(a), "rows": rows}
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"load average at the end: {out['loadavg_end']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
