"""The shipped distilled draft (issue 7) on held-out Spec-Bench prompts: alpha per task at T = 0,
draft/target step cost, and speedup over the target alone with a fixed K and with auto K.

The held-out prompts are the ones `raysd distill --holdout-per-task 4` kept out of training
(4 per task, spread through each task). Greedy outputs are asserted token-identical.

    python bench/distill_eval.py                       # the documented run
    python bench/distill_eval.py --batch-sizes 1 --max-new-tokens 16   # a quick look
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import SPEC_BENCH, loadavg, machine  # noqa: E402
from raysd.core.sampling import SamplingParams  # noqa: E402
from raysd.distill.data import encode_prompt, read_prompts, split_holdout  # noqa: E402
from raysd.distill.evaluate import evaluate_draft, format_report  # noqa: E402
from raysd.engine.adaptive import AdaptiveConfig, profile_step_costs  # noqa: E402
from raysd.engine.drafters import DraftModelDrafter  # noqa: E402
from raysd.engine.engine import EngineConfig, SpecEngine  # noqa: E402
from raysd.engine.rows import Request  # noqa: E402
from raysd.models.loading import DEFAULT_DRAFT, DEFAULT_MODEL, ModelSpec, eos_token_ids, load_model, load_tokenizer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--auto-k-max", type=int, default=4)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/distill_eval.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    target, tok = load_model(ModelSpec(DEFAULT_MODEL)), load_tokenizer(DEFAULT_MODEL)
    draft = load_model(ModelSpec(args.draft))
    _, heldout = split_holdout(read_prompts(SPEC_BENCH), 4)
    prompts = [encode_prompt(tok, p.text) for p in heldout]
    load = loadavg()
    reference: dict = {}
    report = evaluate_draft(target, draft, prompts, [p.task for p in heldout], num_speculative_tokens=args.k,
                            batch_sizes=sizes, max_new_tokens=args.max_new_tokens, log=print, reference_out=reference)
    print(format_report(report))

    # Auto K (issue 9) with the same draft: step costs profiled here, K in 0..auto_k_max per step.
    costs = profile_step_costs(target, draft, k_max=args.auto_k_max, batch_sizes=sizes, context=256, reps=3)
    V = target.get_output_embeddings().weight.shape[0]
    for bs in sizes:
        engine = SpecEngine(target, DraftModelDrafter(draft, V),
                            EngineConfig(args.auto_k_max, bs, eos_token_ids(target), adaptive=AdaptiveConfig(costs)))
        start = time.perf_counter()
        results = engine.generate([Request(i, p, SamplingParams(max_new_tokens=args.max_new_tokens)) for i, p in enumerate(prompts)])
        auto_s = time.perf_counter() - start
        assert [r.token_ids for r in results] == reference[bs], f"batch {bs}: auto K changed the output"
        entry = report["by_batch"][str(bs)]
        steps = sum(r.stats.num_spec_steps for r in results)
        entry["auto"] = {"s": auto_s, "speedup": entry["target_only_s"] / auto_s,
                         "mean_k": sum(r.stats.speculation_length_sum for r in results) / max(1, steps), "token_identical": True}
        print(f"batch {bs}: auto K {auto_s:.1f} s ({entry['auto']['speedup']:.2f}x over the target alone), "
              f"mean K {entry['auto']['mean_k']:.2f}")
    out = {"command": " ".join(sys.argv), "machine": machine(), "loadavg": [load, loadavg()], "draft": args.draft,
           "report": report}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
