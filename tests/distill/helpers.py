"""Tiny teacher data for the distillation tests."""

from __future__ import annotations

import torch

from raysd.distill.data import generate_teacher_data
from tests.conftest import EOS


def random_prompts(n: int, vocab: int, seed: int = 0, min_len: int = 3, max_len: int = 12) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(min_len, max_len, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def teacher_examples(target, n: int = 16, max_new_tokens: int = 12, seed: int = 0, temperature: float = 0.0):
    V = target.get_output_embeddings().weight.shape[0]
    return generate_teacher_data(target, random_prompts(n, V, seed), max_new_tokens=max_new_tokens, topk=V,
                                 eos_token_ids=(EOS,), batch_size=8, temperature=temperature, seed=seed)


def peaked(model, scale: float = 8.0):
    """Sharpen a random model's logits (scale its head) so that its distributions are far from uniform."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(scale)
    return model
