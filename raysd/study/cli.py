"""`raysd study`: profile a target/draft pair on this machine, measure acceptance per task,
predict the best K per batch size, run the measured sweep, and write a tidy Parquet.

    raysd study --draft ngram --batch-sizes 1,4 --ks 1,2,4 --prompts-per-task 2 \\
        --max-new-tokens 32 --output study.parquet

`--acceptance relaxed:LAMBDA` runs the drafters under the lossy quality-speed dial (Yin et al.
2024) and prints, per drafter, the measured rejection rate and TV(target, draft) beside the
front's prediction (1 - LAMBDA) TV and the output's TV to the target, LAMBDA TV.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from raysd.cli import comma_list
from raysd.models.loading import DEFAULT_MODEL, ModelSpec, eos_token_ids, load_model, load_tokenizer

ASSIST = "+ngram"  # `--draft MODEL+ngram`: n-gram lookup drafts for the draft model MODEL (raysd.engine.draft_assist)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_MODEL, help=f"HF id or path of the target (default: embedded {DEFAULT_MODEL})")
    p.add_argument("--draft", action="append", default=None,
                   help="a drafter: HF id/path of a draft model, 'ngram', or 'none'; MODEL+ngram: three levels, n-gram "
                        "lookup drafting for the draft model MODEL; repeat for several (default: ngram). "
                        "The no-draft baseline is always run.")
    p.add_argument("--prompts", default=None,
                   help="JSONL of prompts (prompt_token_ids, prompt or turns; task or category); default: Spec-Bench's "
                        "question.jsonl from $RAYSD_SPEC_BENCH, or in a checkout ../shared/data/spec_bench")
    p.add_argument("--prompts-per-task", type=int, default=4)
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--batch-sizes", type=comma_list(int), default=(1, 4, 16, 64))
    p.add_argument("--ks", type=comma_list(int), default=tuple(range(1, 9)), help="K values to measure (predictions cover 0..8)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--acceptance", default="exact",
                   help="the drafters' acceptance rule: 'exact' (default) or 'relaxed:LAMBDA', LAMBDA in [0, 1]: lossy, "
                        "outputs LAMBDA x TV(target, draft) from the target per drafted position (Yin et al. 2024's front)")
    p.add_argument("--profile-context", type=int, default=128, help="cached tokens per row while timing forwards")
    p.add_argument("--profile-reps", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--output", "-o", default="study.parquet")


def run(args: argparse.Namespace) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from raysd.engine.drafters import DraftModelDrafter, NgramDrafter
    from raysd.study.prompts import SPEC_BENCH_ENV, default_prompts_path, load_prompts
    from raysd.study.sweep import BASELINE, StudyConfig, run_study

    try:
        cfg = StudyConfig(args.batch_sizes, args.ks, args.max_new_tokens, args.temperature, args.ignore_eos,
                          args.profile_context, args.profile_reps, args.acceptance)
    except ValueError as exc:
        print(f"raysd study: {exc}", file=sys.stderr)
        return 2
    # Before any model loads: an installed raysd has no default prompt file (it lives beside a checkout).
    prompts_path = Path(args.prompts) if args.prompts else default_prompts_path()
    if not prompts_path.is_file():
        print(f"raysd study: no prompt file {prompts_path}: pass --prompts FILE.jsonl (or set ${SPEC_BENCH_ENV} to "
              "Spec-Bench's question.jsonl)", file=sys.stderr)
        return 2
    start = time.perf_counter()
    target = load_model(ModelSpec(args.target, args.dtype, args.device))
    vocab = target.get_output_embeddings().weight.shape[0]
    drafters = {}
    for name in dict.fromkeys(args.draft or ["ngram"]):
        if name == BASELINE:
            continue
        if name == "ngram":
            drafters[name] = lambda: NgramDrafter(vocab, args.device)
        elif name.endswith(ASSIST):  # three levels: n-gram lookup drafts for the draft model (docs/draft_assist.md)
            from raysd.core.speculation import AdaptiveConfig
            from raysd.engine.draft_assist import DraftAssistDrafter, profile_assist_costs

            model = load_model(ModelSpec(name[: -len(ASSIST)], args.dtype, args.device))
            with torch.inference_mode():  # the inner k by goodput on the draft model's own step costs
                inner = AdaptiveConfig(profile_assist_costs(model, 4, args.batch_sizes, args.profile_context, args.profile_reps))
            drafters[name] = lambda model=model, name=name, draft_assist=inner: DraftAssistDrafter(
                model, vocab, name=name, assist_adaptive=inner)
        else:
            model = load_model(ModelSpec(name, args.dtype, args.device))
            drafters[name] = lambda model=model, name=name: DraftModelDrafter(model, vocab, name=name)
    try:
        prompts = load_prompts(prompts_path, args.prompts_per_task,
                               load_tokenizer(args.target), args.max_prompt_tokens)
    except (OSError, ValueError) as exc:
        print(f"raysd study: {exc}", file=sys.stderr)
        return 2
    rows = run_study(target, drafters, prompts, cfg, eos_token_ids(target),
                     labels={"target": args.target, "device": args.device, "dtype": args.dtype,
                             "torch_threads": torch.get_num_threads()})
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out)
    _print_best_k(rows)
    _print_front(rows)
    print(f"raysd study: {len(rows)} rows -> {out} ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    return 0


def _print_best_k(rows: list[dict]) -> None:
    """Per drafter and batch size (all tasks pooled): predicted best K, and the best measured K."""
    print("drafter\tbatch_size\tpredicted_best_k\tpredicted_best_k_overlapped\tmeasured_best_k\tmeasured_speedup")
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["task"] == "all" and r["drafter"] != "none":
            groups.setdefault((r["drafter"], r["batch_size"]), []).append(r)
    for (drafter, B), rs in groups.items():
        done = [r for r in rs if r["measured"]]
        top = max(done, key=lambda r: r["measured_speedup"]) if done else None
        best = f"{top['k']}\t{top['measured_speedup']:.3f}" if top else "-\t-"
        print(f"{drafter}\t{B}\t{rs[0]['predicted_best_k']}\t{rs[0]['predicted_best_k_overlapped']}\t{best}")


def _print_front(rows: list[dict]) -> None:
    """Per drafter (all tasks and runs pooled): the rule, the measured TV(target, draft) and rejection
    rate per tested position, and Yin et al.'s front at that TV: its rejection rate (1 - LAMBDA) TV
    and the output's TV to the target, LAMBDA TV (closed form; 0 for the exact rule)."""
    print("drafter\tacceptance\ttv_target_draft\tmeasured_rejection_rate\tfront_rejection_rate\tfront_tv_to_target")
    seen = set()
    for r in rows:
        if r["task"] != "all" or r["drafter"] == "none" or r["drafter"] in seen:
            continue
        seen.add(r["drafter"])
        cells = [r["tv_target_draft"], r["measured_rejection_rate_task"], r["front_rejection_rate"], r["front_tv_to_target"]]
        print("\t".join([r["drafter"], r["acceptance"], *("-" if c is None else f"{c:.3f}" for c in cells)]))
