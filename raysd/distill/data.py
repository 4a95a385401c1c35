"""Training data for distillation: prompts, the target's own continuations, and the
target's token distributions along them (top-k log-probabilities per position).

Everything is built offline from prompts the user passes; the target writes the
continuations (greedy or sampled at temperature 1), so the draft learns the
distribution it will be verified against, on the kind of text it will draft.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from raysd.study.prompts import task_of

_TEXT_FIELDS = ("prompt", "text", "instruction", "question", "input")


@dataclass(frozen=True)
class Prompt:
    text: str | tuple[int, ...]  # the prompt's text, or its token ids (for targets without a tokenizer)
    task: str  # Spec-Bench task (mt_bench, translation, ...), a file's "category"/"task", or "default"
    id: str
    raw: bool = False  # encode as raw text even when the tokenizer has a chat template (code prompts)


def read_prompts(path: str | Path) -> list[Prompt]:
    """Prompts from a .jsonl file (Spec-Bench / MT-bench `turns`, or a prompt/text/instruction/question
    field; the first turn is used) or a text file with one prompt per line."""
    path = Path(path).expanduser()
    out: list[Prompt] = []
    if path.suffix in (".jsonl", ".json"):
        for n, line in enumerate(path.read_text().splitlines()):
            if not line.strip():
                continue
            rec = json.loads(line)
            if isinstance(rec, str):
                text, cat = rec, None
            elif rec.get("turns"):
                text, cat = rec["turns"][0], rec.get("category")
            elif isinstance(rec.get("prompt"), list):  # token ids, as `raysd generate` accepts
                text, cat = tuple(int(t) for t in rec["prompt"]), rec.get("category") or rec.get("task")
            else:
                text = next((rec[k] for k in _TEXT_FIELDS if isinstance(rec.get(k), str)), None)
                if text is None:
                    raise ValueError(f"{path}:{n + 1}: no prompt field (turns, {', '.join(_TEXT_FIELDS)})")
                cat = rec.get("category") or rec.get("task")
            out.append(Prompt(text, task_of(cat), str(rec.get("question_id", n) if isinstance(rec, dict) else n)))
    else:
        out = [Prompt(line, "default", str(n)) for n, line in enumerate(path.read_text().splitlines()) if line.strip()]
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def split_holdout(prompts: Sequence[Prompt], per_task: int) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held out): `per_task` prompts of every task, evenly spaced through the task's
    prompts in file order (so MT-bench's held-out prompts span its categories), are held out."""
    if per_task <= 0:
        return list(prompts), []
    by_task: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_task.setdefault(p.task, []).append(p)
    held = set()
    for ps in by_task.values():
        n = min(per_task, len(ps))
        held |= {id(ps[int((i + 0.5) * len(ps) / n)]) for i in range(n)}
    return [p for p in prompts if id(p) not in held], [p for p in prompts if id(p) in held]


def select_training_prompts(
    prompts: Sequence[Prompt],
    encode: Callable[[str], list[int]],
    max_prompt_tokens: int,
    *,
    max_per_task: int = 0,
    skip_per_task: int = 0,
    max_prompts: int = 0,
) -> tuple[list[list[int]], list[str], int]:
    """(token ids, tasks, number skipped as too long) of the training prompts, in file order.

    Per task, the first `skip_per_task` usable prompts (at most `max_prompt_tokens` tokens) are
    left out and at most `max_per_task` are kept after them (0: all), so runs with
    `max_per_task=N` and then `skip_per_task=N` use disjoint prompts."""
    encoded, tasks, skipped, usable = [], [], 0, {}
    limit = skip_per_task + max_per_task if max_per_task else 0
    for p in prompts:
        if limit and usable.get(p.task, 0) >= limit:
            continue  # this task is full: no need to tokenize
        ids = encode(p.text)
        if len(ids) > max_prompt_tokens:
            skipped += 1
            continue
        usable[p.task] = usable.get(p.task, 0) + 1
        if usable[p.task] > skip_per_task:
            encoded.append(ids)
            tasks.append(p.task)
    if max_prompts:
        encoded, tasks = encoded[:max_prompts], tasks[:max_prompts]
    return encoded, tasks, skipped


def encode_prompt(tokenizer, text, chat_template: bool = True) -> list[int]:
    """Token ids of a prompt: the tokenizer's chat template with a generation prompt when it has one.
    A prompt given as token ids is returned as it is (no tokenizer needed)."""
    if isinstance(text, (list, tuple)):
        return [int(t) for t in text]
    if chat_template and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer(text)["input_ids"]]


@dataclass
class TeacherExample:
    """One training sequence: prompt + the target's continuation, and the target's distribution
    (top-k log-probabilities over the full vocabulary) at every continuation position."""

    input_ids: list[int]  # prompt + continuation
    prompt_len: int
    topk_ids: torch.Tensor  # [T, k] int64: the target's k most likely next tokens at continuation position t
    topk_logprobs: torch.Tensor  # [T, k] float32: their log-probabilities (full-vocabulary softmax)
    task: str = "default"

    @property
    def continuation(self) -> list[int]:
        return self.input_ids[self.prompt_len:]

    def to_dict(self) -> dict:
        return {"input_ids": torch.tensor(self.input_ids, dtype=torch.int64), "prompt_len": self.prompt_len,
                "topk_ids": self.topk_ids, "topk_logprobs": self.topk_logprobs, "task": self.task}

    @staticmethod
    def from_dict(d: dict) -> "TeacherExample":
        return TeacherExample(d["input_ids"].tolist(), int(d["prompt_len"]), d["topk_ids"], d["topk_logprobs"], d["task"])


@torch.no_grad()
def generate_teacher_data(
    target,
    prompts: Sequence[Sequence[int]],
    tasks: Sequence[str] | None = None,
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    topk: int = 32,
    batch_size: int = 8,
    eos_token_ids: Sequence[int] = (),
    pad_token_id: int = 0,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> list[TeacherExample]:
    """Let the target continue every prompt (HF generate, greedy or sampled at `temperature`) and
    keep its top-`topk` log-probabilities at every generated position. Rows stop at EOS."""
    if temperature not in (0.0, 1.0):
        raise ValueError(f"continuations are generated at temperature 0 or 1, got {temperature}")
    tasks = list(tasks) if tasks is not None else ["default"] * len(prompts)
    device = next(target.parameters()).device
    V = target.get_output_embeddings().weight.shape[0]
    k = min(topk, V)
    eos = set(int(e) for e in eos_token_ids)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a batch
    out: dict[int, TeacherExample] = {}
    start, done_tokens = time.perf_counter(), 0
    for b0 in range(0, len(order), batch_size):
        idx = order[b0 : b0 + batch_size]
        L = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), L), pad_token_id, dtype=torch.int64)
        mask = torch.zeros(len(idx), L, dtype=torch.int64)
        for r, i in enumerate(idx):
            p = torch.as_tensor(list(prompts[i]), dtype=torch.int64)
            ids[r, L - len(p):], mask[r, L - len(p):] = p, 1
        torch.manual_seed(seed + b0)
        sample = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if temperature else dict(do_sample=False, temperature=None, top_k=None, top_p=None)
        gen = target.generate(
            ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
            output_logits=True, return_dict_in_generate=True, pad_token_id=pad_token_id,
            eos_token_id=sorted(eos) or None, **sample,
        )
        logits = torch.stack(gen.logits, dim=1).float()  # [B, S, V] raw (unprocessed) logits
        cont = gen.sequences[:, L:].cpu()
        for r, i in enumerate(idx):
            toks = cont[r].tolist()
            T = next((t + 1 for t, tok in enumerate(toks) if tok in eos), len(toks))
            lp = torch.log_softmax(logits[r, :T, :V], dim=-1)
            vals, top = lp.topk(k, dim=-1)
            out[i] = TeacherExample(list(prompts[i]) + toks[:T], len(prompts[i]), top.cpu(), vals.cpu(), tasks[i])
            done_tokens += T
        if log:
            log(f"teacher data: {len(out)}/{len(prompts)} prompts, {done_tokens} continuation tokens, "
                f"{time.perf_counter() - start:.0f} s")
    return [out[i] for i in range(len(prompts))]


def head_vocabulary(examples: Sequence[TeacherExample], size: int, vocab_size: int, always: Sequence[int] = ()) -> torch.Tensor:
    """FR-Spec: the `size` most frequent tokens of the training continuations (then the target's
    top-k candidates by frequency, then the lowest ids), always including `always` (e.g. EOS)."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"head vocabulary size must be in (0, {vocab_size}], got {size}")
    counts = Counter(t for ex in examples for t in ex.continuation)
    backup = Counter(int(t) for ex in examples for t in ex.topk_ids.flatten().tolist())
    chosen: list[int] = []
    seen: set[int] = set()

    def take(tokens):
        for t in tokens:
            if len(chosen) >= size:
                return
            if t not in seen and 0 <= t < vocab_size:
                seen.add(t)
                chosen.append(t)

    take(int(t) for t in always)
    take(t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    take(t for t, _ in sorted(backup.items(), key=lambda kv: (-kv[1], kv[0])))
    take(range(vocab_size))
    return torch.tensor(sorted(chosen), dtype=torch.int64)


def save_teacher_data(examples: Sequence[TeacherExample], path: str | Path, meta: dict | None = None) -> None:
    torch.save({"examples": [ex.to_dict() for ex in examples], "meta": dict(meta or {})}, str(path))


def load_teacher_data(path: str | Path) -> tuple[list[TeacherExample], dict]:
    blob = torch.load(str(path), weights_only=True)
    return [TeacherExample.from_dict(d) for d in blob["examples"]], blob.get("meta", {})


_SUMMED = ("num_prompts", "continuation_tokens", "prompt_tokens", "skipped_long")


def merge_teacher_meta(metas: Sequence[dict]) -> dict:
    """One description of teacher data built in parts (shards, or several prompt files): counts
    summed, prompt files and per-task counts combined, other settings kept once, or listed where
    the parts disagree."""
    merged: dict = {"parts": len(metas)}
    merged.update({k: sum(m.get(k, 0) for m in metas) for k in _SUMMED if any(k in m for m in metas)})
    per_task: dict = {}
    for m in metas:
        for task, n in m.get("prompts_per_task", {}).items():
            per_task[task] = per_task.get(task, 0) + n
    if per_task:
        merged["prompts_per_task"] = dict(sorted(per_task.items()))
    merged["prompt_files"] = sorted({f for m in metas for f in m.get("prompt_files", [])})
    if any("generation_s" in m for m in metas):
        merged["generation_s"] = max(m.get("generation_s", 0.0) for m in metas)  # shards run side by side
    for k in sorted({k for m in metas for k in m} - set(merged)):
        values = [m[k] for m in metas if k in m]
        merged[k] = values[0] if all(v == values[0] for v in values) else values
    return merged


@dataclass
class DistillResult:
    """What `raysd distill` returns (either kind)."""

    output: str | None
    draft: object | None
    history: list[dict]
    evaluation: dict | None
    data: dict


def prompt_encoder(tokenizer, chat_template: bool):
    """prompt -> token ids: ids as given, text through the tokenizer (and its chat template)."""

    def encode(prompt):
        if isinstance(prompt.text, (list, tuple)):
            return [int(t) for t in prompt.text]
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer (give token-id prompts for a target without one)")
        return encode_prompt(tokenizer, prompt.text, chat_template and not prompt.raw)
    return encode
