"""draft_eval: offline acceptance of drafts along held-out continuations (from bench/eagle_eval.py).

Held out: the Spec-Bench prompts `raysd distill --holdout-per-task 4` kept out of the shipped
drafts' training (--per-task of each trained task), --translation prompts of the task held out
entirely, and --code held-out standard-library files. The target continues each at T = 0 and
T = 1 (the continuations and its features are cached in --data, so several drafts are measured on
the same text); every draft then drafts K-step chains along them, an EAGLE draft fed its own
hidden states from step 2 on, as a drafter feeds it (raysd.distill.eagle_eval). Per draft and
temperature: alpha (the engine's estimate) and the mean accepted drafts per step, by task and their
mean; and an EAGLE draft's step cost c at batch 1. No tokens/s: nothing is generated through the
engine here (`python -m bench run engine --prompt-set heldout` does that).

    python -m bench run draft_eval                       # the shipped EAGLE and distilled drafts
"""

from __future__ import annotations

import time
from pathlib import Path

from bench.harness import Outcome
from bench.workload import SPEC_BENCH, str_list

QUICK = {"per_task": 1, "translation": 1, "code": 1, "max_new_tokens": 8, "data": "/tmp/raysd-bench-draft-eval-quick.pt"}


def add_arguments(p) -> None:
    from raysd.models.loading import DEFAULT_DRAFT, DEFAULT_EAGLE

    g = p.add_argument_group("draft_eval")
    g.add_argument("--eagle", type=str_list, default=[DEFAULT_EAGLE], help="EAGLE drafts (names or directories)")
    g.add_argument("--layers", default=DEFAULT_DRAFT, help="a distilled (layers) draft to compare ('' for none)")
    g.add_argument("--k", type=int, default=4)
    g.add_argument("--holdout-task", default="translation")
    g.add_argument("--per-task", type=int, default=4)
    g.add_argument("--translation", type=int, default=8, help="prompts of the held-out task")
    g.add_argument("--code", type=int, default=8, help="held-out standard-library files")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--max-prompt-tokens", type=int, default=1024)
    g.add_argument("--data", default="/tmp/eagle/eval_data.pt", help="cache of the held-out continuations")
    g.add_argument("--data-only", action="store_true", help="only build the held-out continuations (--data)")


def heldout(tok, a) -> list[tuple[list[int], str]]:
    from raysd.distill.data import encode_prompt, read_prompts, split_holdout
    from raysd.distill.eagle_data import code_prompts

    prompts = read_prompts(SPEC_BENCH)
    _, held = split_holdout([p for p in prompts if p.task != a.holdout_task], a.per_task)
    out_task = [p for p in prompts if p.task == a.holdout_task]
    held += [out_task[int((i + 0.5) * len(out_task) / a.translation)] for i in range(min(a.translation, len(out_task)))]
    enc = [(encode_prompt(tok, p.text), p.task) for p in held]
    enc += [(encode_prompt(tok, p.text, chat_template=False), "code") for p in code_prompts(a.code, heldout=True)]
    return [(ids, t) for ids, t in enc if len(ids) <= a.max_prompt_tokens]


def run(a, log=print) -> Outcome:
    from raysd.distill.eagle_data import generate_feature_data, load_feature_data, save_feature_data
    from raysd.distill.eagle_eval import evaluate_offline, step_cost
    from raysd.models.loading import DEFAULT_MODEL, ModelSpec, eos_token_ids, load_eagle_draft, load_model, load_tokenizer

    target, tok = load_model(ModelSpec(DEFAULT_MODEL)), load_tokenizer(DEFAULT_MODEL)
    if Path(a.data).is_file():
        examples, meta = load_feature_data(a.data)
        log(f"held-out continuations read from {a.data}")
    else:
        enc, start = heldout(tok, a), time.perf_counter()
        examples = []
        for temp in (0.0, 1.0):
            examples += generate_feature_data(target, [e for e, _ in enc], [t for _, t in enc], max_new_tokens=a.max_new_tokens,
                                              temperature=temp, batch_size=12, eos_token_ids=eos_token_ids(target),
                                              pad_token_id=2, seed=1000, log=log)
        meta = {"prompts_per_task": {t: [x for _, x in enc].count(t) for t in sorted({x for _, x in enc})},
                "generation_s": time.perf_counter() - start}
        Path(a.data).parent.mkdir(parents=True, exist_ok=True)
        save_feature_data(examples, a.data, meta)
    if a.data_only:
        return Outcome([], {"heldout": meta})
    drafts = {name: ("eagle", load_eagle_draft(name, target)) for name in a.eagle}
    if a.layers:
        drafts["layers:" + Path(a.layers).name] = ("tokens", load_model(ModelSpec(a.layers)))
    report = evaluate_offline(target, drafts, examples, a.k, log=log)
    variants = []
    for name, by_temp in report.items():
        for temp, summ in by_temp.items():
            mean = summ["mean_over_tasks"]
            median = {"alpha": mean["alpha"], "alpha_step1": mean["alpha_step1"], "mean_accepted_per_step": mean["mean_accepted"]}
            variants.append({"name": f"{name}, {temp}", "settings": {"draft": name, "temperature": temp, "k": a.k},
                             "baseline": None, "median": median, "runs": [median]})
    cost = {name: step_cost(target, d, examples[0].input_ids[:256]) for name, (kind, d) in drafts.items() if kind == "eagle"}
    return Outcome(variants, {"heldout": meta, "offline": report, "step_cost": cost})
