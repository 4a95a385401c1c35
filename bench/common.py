"""Shared helpers for the raysd benchmarks: Spec-Bench prompts, machine facts, model variants."""

from __future__ import annotations

import copy
import json
import os
import platform
import statistics
import time
from collections import Counter

import torch

SPEC_BENCH = "/work/shared/data/spec_bench/question.jsonl"
# Spec-Bench's six tasks; its MT-bench part is split over eight categories in the file.
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
TASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


def task_of(category: str) -> str:
    return "mt_bench" if category in MT_BENCH else category


def load_prompts(tokenizer, per_task: int, tasks=TASKS, path: str = SPEC_BENCH) -> list[dict]:
    """The first `per_task` questions of each task (file order), first turn, chat template applied."""
    by_task: dict[str, list[dict]] = {t: [] for t in tasks}
    with open(path) as f:
        for line in f:
            q = json.loads(line)
            task = task_of(q["category"])
            if task not in by_task or len(by_task[task]) >= per_task:
                continue
            ids = tokenizer.apply_chat_template([{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
            by_task[task].append({"question_id": q["question_id"], "task": task, "ids": [int(t) for t in ids]})
    # Round-robin over tasks, so every batch mixes short and long prompts.
    return [by_task[t][i] for i in range(per_task) for t in tasks if i < len(by_task[t])]


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    import ray
    import transformers

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "simd": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_vnni", "avx_vnni") if f in flags],
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "ray": ray.__version__,
    }


def loadavg() -> float:
    return round(os.getloadavg()[0], 2)


def median(xs):
    return statistics.median(xs) if xs else None


# ---------------------------------------------------------------- model variants


def weight_dtypes(model) -> dict:
    return dict(Counter(f"{type(m).__name__}:{m.weight.dtype}" for m in model.modules() if isinstance(m, torch.nn.Linear)))


def bf16_copy(model):
    """A bf16 deep copy; checks that its Linear layers really see bf16 operands."""
    draft = copy.deepcopy(model).to(torch.bfloat16)
    seen = []
    hook = draft.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append((i[0].dtype, m.weight.dtype, o.dtype)))
    with torch.inference_mode():
        draft(input_ids=torch.tensor([[1, 2, 3]]))
    hook.remove()
    assert seen and all(d == torch.bfloat16 for d in seen[0]), seen
    return draft


def int8_copy(model):
    """Dynamic int8 quantization of the decoder layers' Linear modules. The tied lm_head stays
    fp32: raysd reads `get_output_embeddings().weight.shape`, which a quantized Linear lacks."""
    from torch.ao.quantization import quantize_dynamic

    names = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("model.layers.")}
    return quantize_dynamic(model, names, dtype=torch.qint8)  # deep-copies


def truncated_copy(model, num_layers: int):
    """The target cut to its first `num_layers` decoder layers (shares no storage with it)."""
    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:num_layers]
    draft.config.num_hidden_layers = num_layers
    if getattr(draft.config, "layer_types", None):
        draft.config.layer_types = draft.config.layer_types[:num_layers]
    return draft


# ---------------------------------------------------------------- per-step times


def context_batch(prompts: list[dict], batch: int, length: int) -> torch.Tensor:
    """[batch, length] real tokens: each prompt tiled/truncated to `length` (no padding)."""
    rows = []
    for b in range(batch):
        ids = prompts[b % len(prompts)]["ids"]
        rows.append((ids * (length // len(ids) + 1))[:length])
    return torch.tensor(rows, dtype=torch.int64)


@torch.inference_mode()
def step_time(model, context: torch.Tensor, new_tokens: int = 1, reps: int = 7, warmup: int = 2) -> float:
    """Median seconds of one cached forward of `new_tokens` tokens per row after `context`."""
    from transformers import DynamicCache

    from raysd.models.compat import cache_keyword

    cache = DynamicCache()
    model(input_ids=context, **{cache_keyword(model): cache}, use_cache=True, logits_to_keep=1)
    chunk = context[:, -new_tokens:]
    times = []
    for _ in range(warmup + reps):
        t0 = time.perf_counter()
        model(input_ids=chunk, **{cache_keyword(model): cache}, use_cache=True, logits_to_keep=new_tokens)
        times.append(time.perf_counter() - t0)
        cache.crop(-new_tokens)
    return statistics.median(times[warmup:])


def ngram_step_time(context: torch.Tensor, k: int, vocab: int, reps: int = 7) -> float:
    """Median seconds of one NgramDrafter.propose over the rows of `context`."""
    from raysd.core.sampling import SamplingParams, SamplingTensors
    from raysd.engine.drafters import NgramDrafter

    d = NgramDrafter(vocab)
    d.add_rows(context.tolist())
    B = context.shape[0]
    sampling = SamplingTensors.from_params([SamplingParams()] * B)
    u = torch.full((B, k), 0.5)
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        d.propose([k] * B, sampling, u)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


@torch.inference_mode()
def hf_generate(target, batch: int, prompts: list[dict], max_new: int, pad: int, eos=(), assistant=None) -> dict:
    """HF `generate` (greedy) over `prompts` in chunks of `batch`, left-padded with `pad`. With
    `eos`, a row ends at its first EOS; without, every row makes exactly `max_new` tokens."""
    tokens, t0 = [], time.perf_counter()
    for s in range(0, len(prompts), batch):
        chunk = [p["ids"] for p in prompts[s : s + batch]]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(c)) + c for c in chunk])
        mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in chunk])
        stop = {"eos_token_id": list(eos)} if eos else {"min_new_tokens": max_new}
        extra = {"assistant_model": assistant} if assistant is not None else {}
        out = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
                              pad_token_id=pad, **stop, **extra)
        for row in out[:, width:].tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            tokens.append(row[:cut])
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": tokens, "generated": sum(map(len, tokens))}
