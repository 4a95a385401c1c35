"""Issue 18 item 5: the shipped EAGLE feature draft against the target alone, SmolLM2-135M-Instruct
on this CPU, on the Spec-Bench task held entirely out of its training (translation), greedy.

Engine tokens/s of plain decoding (NoDrafter) and of the EAGLE draft at K = 1, 2, 3, batch 1 and 8,
the variants interleaved in each repeat (medians reported), with the measured acceptance and the
cost model's prediction (1 - a^(K+1)) / ((1 - a)(cK + T(K+1)/T(1))) beside each, from the run's own
step times.

    python bench/eagle_bench.py                     # the documented run (docs/benchmarks.md)
    python bench/eagle_bench.py --quick             # smoke test
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
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
    return {"tok_s": tokens / wall, "tokens": [r.token_ids for r in results], "alpha": accepted / drafted if drafted else None,
            "tokens_per_step": tokens / steps, "draft_s_per_step": t.draft_s / t.steps, "target_s_per_step": t.target_s / t.steps}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8, help="held-out translation prompts")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--ks", default="1,2,3")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "eagle_bench.json"))
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    if a.quick:
        a.prompts, a.max_new_tokens, a.repeats, a.batch_sizes, a.ks = 2, 8, 1, "1", "2"
    torch.set_num_threads(a.threads)
    tok = load_tokenizer(DEFAULT_MODEL)
    target = load_model(ModelSpec(DEFAULT_MODEL))
    eagle = load_eagle_draft(DEFAULT_EAGLE, target)
    prompts = load_prompts(tok, a.prompts, tasks=("translation",))
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
            assert all(r["tokens"] == base[0]["tokens"] for r in rs), "greedy output differs from plain decoding"
            alpha = median([r["alpha"] for r in rs])
            tk, td = median([r["target_s_per_step"] for r in rs]), median([r["draft_s_per_step"] for r in rs])
            predicted = expected_tokens_per_step(alpha, k) / ((td + tk) / t1)
            measured = median([r["tok_s"] for r in rs]) / median([r["tok_s"] for r in base])
            rows.append({"batch": B, "k": k, "alpha": alpha, "tokens_per_step": median([r["tokens_per_step"] for r in rs]),
                         "c": td / k / t1, "target_ratio": tk / t1, "speedup": measured, "predicted": predicted,
                         "tok_s": median([r["tok_s"] for r in rs]), "tok_s_plain": median([r["tok_s"] for r in base])})
            r = rows[-1]
            print(f"B={B} K={k}: {r['tok_s']:.1f} tok/s vs plain {r['tok_s_plain']:.1f} -> {r['speedup']:.2f}x "
                  f"(predicted {r['predicted']:.2f}x; alpha {alpha:.2f}, c {r['c']:.3f}, T(K+1)/T(1) {r['target_ratio']:.2f})",
                  flush=True)
    out = {"machine": machine(), "loadavg_end": loadavg(), "args": vars(a), "rows": rows}
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"load average at the end: {out['loadavg_end']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
