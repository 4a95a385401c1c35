"""Hugging Face `generate` as a baseline, timed and counted by the same definitions as the engine.

Greedy, the prompts in chunks of the batch size, left-padded. One timed run is the whole list:
tokens/s = generated tokens / wall seconds over all chunks (prefill included, as the engine's).
The model runs PyTorch's own kernels here: raysd's packed linear kernels are active only inside
the engine's forwards (raysd.models.linear).
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from bench.measure import Counts, figures


@torch.inference_mode()
def hf_generate(model, prompts: Sequence[dict], batch_size: int, max_new_tokens: int, pad_token_id: int,
                eos_token_ids: Sequence[int] = (), stop_at_eos: bool = False, num_beams: int = 1) -> dict:
    """One timed run's figures; `_tokens`: each row's tokens (cut after its first EOS when `stop_at_eos`).
    `num_beams` > 1: HF's beam search (do_sample=False), each prompt's best hypothesis."""
    eos = tuple(eos_token_ids)
    rows: list[list[int]] = []
    start = time.perf_counter()
    for s in range(0, len(prompts), batch_size):
        chunk = [list(p["ids"]) for p in prompts[s: s + batch_size]]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad_token_id] * (width - len(c)) + c for c in chunk])
        mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in chunk])
        stop = {"eos_token_id": list(eos)} if stop_at_eos and eos else {"min_new_tokens": max_new_tokens}
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                             pad_token_id=pad_token_id, num_beams=num_beams, **stop)
        for row in out[:, width:].tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row)) if stop_at_eos else len(row)
            rows.append(row[:cut])
    wall = time.perf_counter() - start
    return figures(Counts(sum(map(len, rows))), wall, _tokens=rows)
