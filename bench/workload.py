"""What the scenarios generate for: Spec-Bench prompts and the options that pick them.

Spec-Bench's 480 questions (first turns, chat template applied) are read in place from
`SPEC_BENCH`. Its six tasks (MT-bench's eight categories are one task) are interleaved round-robin,
so every batch mixes short and long prompts. Prompt sets:
- `spec_bench`: the first `--per-task` questions of each task, in file order;
- `shortest`: the `--max-prompts` (default 6 x `--per-task`) shortest of all 480, round-robin;
- `heldout`: the questions `raysd distill --holdout-per-task 4` kept out of the shipped drafts'
  training (4 per task, spread through each task), the first `--per-task` of each;
- `repetitive`: a dataset built from a template, as users build theirs: one instruction filled
  with `--max-prompts` (default 200) different records, each asking for one JSON object
  (`repetitive_prompts`; the records drawn with a fixed seed).
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Sequence

from raysd.cli import comma_list
from raysd.distill.data import encode_prompt, read_prompts, split_holdout

SPEC_BENCH = "/work/shared/data/spec_bench/question.jsonl"
TASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
PROMPT_SETS = ("spec_bench", "shortest", "heldout", "repetitive")
DISTILL_HOLDOUT_PER_TASK = 4  # what `raysd distill --holdout-per-task` kept out of the shipped drafts


int_list, str_list = comma_list(int), comma_list(str)  # "1,8" -> [1, 8]; "" -> []


def k_list(text: str) -> list[int | str]:
    """"2,4,auto" -> [2, 4, "auto"]."""
    return [x if x == "auto" else int(x) for x in str_list(text)]


def add_workload_arguments(p: argparse.ArgumentParser, per_task: int = 1, max_new_tokens: int = 32,
                           batch_sizes: str = "1,8", prompt_set: str = "spec_bench", eos_flag: bool = True) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--prompt-set", choices=PROMPT_SETS, default=prompt_set)
    g.add_argument("--per-task", type=int, default=per_task, help="prompts per Spec-Bench task (6 tasks)")
    g.add_argument("--max-prompts", type=int, default=0,
                   help="at most this many (0: all); with --prompt-set shortest, the N shortest of all 480")
    g.add_argument("--prompts-file", default=SPEC_BENCH, help="Spec-Bench's question.jsonl, read in place")
    g.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    g.add_argument("--batch-sizes", type=int_list, default=int_list(batch_sizes), help="comma-separated")
    if eos_flag:
        g.add_argument("--stop-at-eos", action="store_true",
                       help="rows end at EOS (default: every row makes exactly --max-new-tokens, so variants compare alike)")


def round_robin(prompts: Sequence[dict], per_task: int | None = None) -> list[dict]:
    by_task: dict[str, list[dict]] = {}
    for q in prompts:
        by_task.setdefault(q["task"], []).append(q)
    order = [t for t in TASKS if t in by_task] + sorted(set(by_task) - set(TASKS))
    longest = max((len(v) for v in by_task.values()), default=0)
    n = longest if per_task is None else min(per_task, longest)
    return [by_task[t][i] for i in range(n) for t in order if i < len(by_task[t])]


TEMPLATE = ("Turn this record into one JSON object with the keys \"name\", \"city\", \"age\", \"occupation\" "
            "and \"hobbies\" (a list). Answer with the JSON object only.\n\nName: {name}\nCity: {city}\nAge: {age}\n"
            "Occupation: {occupation}\nHobbies: {hobbies}")
NAMES = ("Alice Martin", "Bruno Costa", "Chen Wei", "Dana Levi", "Emeka Obi", "Farah Khan", "Gustav Berg", "Hana Sato",
         "Ivan Petrov", "Julia Rossi", "Kofi Mensah", "Lena Novak", "Mateo Cruz", "Nadia Haddad", "Oskar Lind", "Priya Nair")
CITIES = ("Lisbon", "Nairobi", "Osaka", "Toronto", "Lyon", "Krakow", "Quito", "Perth", "Bergen", "Austin", "Porto", "Seoul")
JOBS = ("nurse", "carpenter", "data analyst", "teacher", "pilot", "chef", "architect", "librarian", "plumber", "biologist")
HOBBIES = ("chess", "hiking", "painting", "cycling", "baking", "photography", "gardening", "climbing", "piano", "sailing")


def repetitive_prompts(tokenizer, n: int = 200, seed: int = 0) -> list[dict]:
    """`n` prompts from one template (TEMPLATE), each a different record: a dataset of the kind raysd's
    users build (the same instruction and output format in every row)."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        record = {"name": rng.choice(NAMES), "city": rng.choice(CITIES), "age": rng.randint(19, 78),
                  "occupation": rng.choice(JOBS), "hobbies": ", ".join(rng.sample(HOBBIES, rng.randint(1, 3)))}
        out.append({"question_id": f"record-{i}", "task": "repetitive", "ids": encode_prompt(tokenizer, TEMPLATE.format(**record))})
    return out


def load_prompts(tokenizer, per_task: int, prompt_set: str = "spec_bench", path: str = SPEC_BENCH,
                 max_prompts: int = 0) -> list[dict]:
    """[{"question_id", "task", "ids"}], round-robin over the tasks (see the module docstring), at
    most `max_prompts` of them (0: no limit; `shortest`: the `max_prompts` shortest)."""
    if prompt_set not in PROMPT_SETS:
        raise ValueError(f"prompt set must be one of {PROMPT_SETS}, got {prompt_set!r}")
    if per_task < 1:
        raise ValueError(f"--per-task must be >= 1, got {per_task}")
    if prompt_set == "repetitive":
        return repetitive_prompts(tokenizer, max_prompts or 200)
    everything = read_prompts(path)
    if prompt_set == "heldout":
        everything = split_holdout(everything, DISTILL_HOLDOUT_PER_TASK)[1]
    chosen, seen = [], Counter()
    for q in everything:  # spec_bench: only the first per_task of each task need encoding
        if prompt_set != "spec_bench" or seen[q.task] < per_task:
            chosen.append(q)
            seen[q.task] += 1
    encoded = [{"question_id": q.id, "task": q.task, "ids": encode_prompt(tokenizer, q.text)} for q in chosen]
    if prompt_set == "shortest":
        n = max_prompts or per_task * len({q["task"] for q in encoded})
        keep = set(sorted(range(len(encoded)), key=lambda i: (len(encoded[i]["ids"]), i))[:n])
        return round_robin([q for i, q in enumerate(encoded) if i in keep])
    out = round_robin(encoded, per_task)
    return out[:max_prompts] if max_prompts else out


def describe(prompts: Sequence[dict]) -> dict:
    """What a result file records about its prompts."""
    return {"count": len(prompts), "tasks": {t: sum(q["task"] == t for q in prompts) for t in sorted({q["task"] for q in prompts})},
            "question_ids": [q["question_id"] for q in prompts], "prompt_tokens": [len(q["ids"]) for q in prompts]}
