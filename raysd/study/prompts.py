"""Study prompts: Spec-Bench's question.jsonl (read at run time, never copied) or any JSONL
whose lines carry `prompt_token_ids`, `prompt` or `turns`, and a `task` or `category`."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import raysd

# Spec-Bench's six tasks; its eight MT-bench categories (10 prompts each) form one task.
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
SPEC_BENCH_ENV = "RAYSD_SPEC_BENCH"


@dataclass(frozen=True)
class StudyPrompt:
    task: str
    token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError(f"empty prompt in task {self.task!r}")


def default_prompts_path() -> Path:
    """$RAYSD_SPEC_BENCH, else the shared Spec-Bench file next to the repository (a checkout's: an
    installed package has none, and `raysd study` then asks for --prompts)."""
    if os.environ.get(SPEC_BENCH_ENV):
        return Path(os.environ[SPEC_BENCH_ENV])
    return Path(raysd.__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"


def task_of(name: str | None) -> str:
    """The Spec-Bench task a prompt file's `task` or `category` names: MT-bench's categories are one
    task, "mt_bench"; no name is "default"."""
    if not name:
        return "default"
    return "mt_bench" if name in MT_BENCH_CATEGORIES else str(name)


def load_prompts(path: str | Path, per_task: int, tokenizer=None, max_prompt_tokens: int = 512) -> list[StudyPrompt]:
    """The first `per_task` prompts of each task, in file order, as token ids.

    Text prompts (`prompt`, or the first of `turns`) need a tokenizer; with a chat template
    they are wrapped as one user turn. Longer prompts keep their first max_prompt_tokens
    text tokens.
    """
    if per_task < 1 or max_prompt_tokens < 1:
        raise ValueError("per_task and max_prompt_tokens must be >= 1")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} not found (pass --prompts or set ${SPEC_BENCH_ENV})")
    by_task: dict[str, list[StudyPrompt]] = defaultdict(list)
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            task = task_of(record.get("task") or record.get("category"))
            if len(by_task[task]) >= per_task:
                continue
            if "prompt_token_ids" in record:
                ids = [int(t) for t in record["prompt_token_ids"]][:max_prompt_tokens]
            else:
                text = record.get("prompt") or (record.get("turns") or [None])[0]
                if text is None:
                    raise ValueError(f"{path}:{line_no}: needs prompt_token_ids, prompt or turns")
                ids = _tokenize(text, tokenizer, max_prompt_tokens, f"{path}:{line_no}")
            by_task[task].append(StudyPrompt(task, tuple(ids)))
    return [p for prompts in by_task.values() for p in prompts]


def _tokenize(text: str, tokenizer, max_tokens: int, where: str) -> list[int]:
    if tokenizer is None:
        raise ValueError(f"{where}: a text prompt needs a tokenizer; the target has none (use prompt_token_ids)")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) > max_tokens:
        text = tokenizer.decode(ids[:max_tokens])
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)
    return list(tokenizer(text)["input_ids"])
