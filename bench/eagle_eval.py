"""Offline acceptance of EAGLE drafts (issue 18) against the shipped layers draft, on held-out prompts.

Held out: the Spec-Bench prompts `raysd distill --holdout-per-task 4` kept out of training for the
trained tasks, `--translation N` prompts of the task held out entirely (translation), and N held-out
Python standard-library files (raysd.distill.eagle_data.code_prompts(heldout=True)). The target continues
each at temperature 0 and 1 (the continuations and its features are cached in --data, so several drafts
are measured on the same text). Every draft then drafts K-step chains along them: the EAGLE draft fed its
own hidden states from step 2 on, as a drafter feeds it (raysd.distill.eagle_eval).

    python bench/eagle_eval.py --eagle raysd/data/eagle --out bench/results/eagle_eval.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from raysd.distill.data import encode_prompt, read_prompts, split_holdout  # noqa: E402
from raysd.distill.eagle_data import code_prompts, generate_feature_data, load_feature_data, save_feature_data  # noqa: E402
from raysd.distill.eagle_eval import evaluate_offline, format_offline, step_cost  # noqa: E402
from raysd.models.loading import (DEFAULT_DRAFT, DEFAULT_MODEL, ModelSpec, eos_token_ids, load_eagle_draft,  # noqa: E402
                                  load_model, load_tokenizer)

SPEC_BENCH = "/work/shared/data/spec_bench/question.jsonl"


def heldout_prompts(tok, spec_bench: str, holdout_task: str, per_task: int, translation: int, code: int):
    prompts = read_prompts(spec_bench)
    kept = [p for p in prompts if p.task != holdout_task]
    _, held = split_holdout(kept, per_task)
    out_task = [p for p in prompts if p.task == holdout_task]
    held += [out_task[int((i + 0.5) * len(out_task) / translation)] for i in range(min(translation, len(out_task)))]
    enc = [(encode_prompt(tok, p.text), p.task) for p in held]
    enc += [(encode_prompt(tok, p.text, chat_template=False), "code") for p in code_prompts(code, heldout=True)]
    return enc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eagle", nargs="+", default=[], help="EAGLE draft directories (or names) to measure")
    ap.add_argument("--layers", default=DEFAULT_DRAFT, help="a layers draft to compare ('' for none)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--holdout-task", default="translation")
    ap.add_argument("--per-task", type=int, default=4)
    ap.add_argument("--translation", type=int, default=8, help="prompts of the held-out task")
    ap.add_argument("--code", type=int, default=8, help="held-out standard-library files")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--data", default="/tmp/eagle/eval_data.pt", help="cache of the held-out continuations")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--data-only", action="store_true", help="only build the held-out continuations (--data)")
    ap.add_argument("--out", default="bench/results/eagle_eval.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, tok = load_model(ModelSpec(DEFAULT_MODEL)), load_tokenizer(DEFAULT_MODEL)
    if Path(args.data).is_file():
        examples, meta = load_feature_data(args.data)
    else:
        enc = [(ids, t) for ids, t in heldout_prompts(tok, SPEC_BENCH, args.holdout_task, args.per_task, args.translation, args.code)
               if len(ids) <= args.max_prompt_tokens]
        examples, start = [], time.perf_counter()
        for temp in (0.0, 1.0):
            examples += generate_feature_data(target, [e for e, _ in enc], [t for _, t in enc], max_new_tokens=args.max_new_tokens,
                                              temperature=temp, batch_size=12, eos_token_ids=eos_token_ids(target),
                                              pad_token_id=2, seed=1000, log=print)
        meta = {"prompts_per_task": {t: [x for _, x in enc].count(t) for t in sorted({x for _, x in enc})},
                "generation_s": time.perf_counter() - start}
        Path(args.data).parent.mkdir(parents=True, exist_ok=True)
        save_feature_data(examples, args.data, meta)
    if args.data_only:
        return
    drafts = {name: ("eagle", load_eagle_draft(name, target)) for name in args.eagle}
    if args.layers:
        drafts["layers:" + Path(args.layers).name] = ("tokens", load_model(ModelSpec(args.layers)))
    report = {"command": " ".join(sys.argv), "k": args.k, "heldout": meta, "offline": evaluate_offline(target, drafts, examples, args.k, log=print)}
    print(format_offline(report["offline"], args.k))
    ctx = examples[0].input_ids[:256]
    report["cost"] = {}
    for name, (kind, d) in drafts.items():
        if kind == "eagle":
            report["cost"][name] = step_cost(target, d, ctx)
            c = report["cost"][name]
            print(f"{name}: draft step {c['draft_step_s'] * 1e3:.2f} ms, target step {c['target_step_s'] * 1e3:.2f} ms, "
                  f"c = {c['draft_step_cost']:.3f} (batch 1, {c['threads']} threads, context {c['context_tokens']})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
