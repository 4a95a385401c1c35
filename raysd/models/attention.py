"""Grouped-query attention over a masked chunk without repeating keys and values.

transformers' `sdpa` attention, given a mask (the static runner always passes one), runs
grouped-query attention by repeating every key/value head `num_key_value_groups` times
(`repeat_kv`): a copy of the whole attended cache, per layer, per forward, which SDPA then reads
G times over. Transformers 5.25 folds a single query token instead (`pack_gqa`), but not under
torch.compile, and 5.17 never does; verification feeds K + 1 tokens per row, which it always
repeats. On SmolLM2-135M (9 query heads over 3 key/value heads) the copy makes a verify's attention
on a CPU several times slower than folded (docs/history/notes.md). On a GPU the copy is bandwidth:
a decode step of a Llama-3-8B shape (32 layers, 8 key/value heads of 128, G = 4, bf16) at batch 64
over 256 columns writes 8.6 GB of repeated keys and values and reads them back, about as many bytes
as its 16 GB of weights, where at batch 1 it is a sixty-fourth of that: the copy grows with the
batch, the weights do not.

`packed_gqa_attention` folds the group for every chunk length, one token included, as
FlashAttention-style GQA kernels do: query [B, Hkv * G, T, D] -> [B, Hkv, G * T, D] (the G query
heads of a key/value head become G x T queries of it), the mask [B, 1, T, W] -> [B, 1, G * T, W]
(every head of a group sees the same columns; for T = 1 the mask broadcasts as it is), then SDPA
on the key/value heads as they are. Each (head, token) output is the same dot products and
softmax as before (tests/models/test_attention.py).

`packed_gqa(model)` switches a model to it for the duration of a call; the model's own
config is restored afterwards, so the same model object still runs stock Hugging Face
`generate` elsewhere.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # light: not the modeling stack

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PACKED_SDPA = "raysd_packed_sdpa"


def packed_gqa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, H, T, D], key/value [B, Hkv, W, D],
    a mask [B, 1, T, W] (bool or additive); returns ([B, T, H, D], None). Anything it does not
    fold (no groups, no mask, a per-head mask, extra terms) goes to `sdpa` unchanged."""
    groups = getattr(module, "num_key_value_groups", 1)
    B, H, T, D = query.shape
    plain = (groups == 1 or attention_mask is None or attention_mask.dim() != 4
             or attention_mask.shape[1] != 1 or kwargs.get("position_bias") is not None
             or kwargs.get("softcap") is not None or kwargs.get("cache") is not None)
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    assert H == key.shape[1] * groups and key.shape == value.shape[:-1] + (key.shape[-1],)
    folded = query.reshape(B, H // groups, groups * T, D)  # (B, Hkv, G*T, D): head kv*G + g, token t -> row g*T + t
    mask = attention_mask.expand(B, 1, T, attention_mask.shape[-1])  # (B, 1, T, W)
    if T > 1:  # row g*T + t of a group sees token t's columns; one token's mask broadcasts over the G rows
        mask = mask.repeat(1, 1, groups, 1)  # (B, 1, G*T, W)
    out = F.scaled_dot_product_attention(folded, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.reshape(B, H, T, value.shape[-1]).transpose(1, 2).contiguous(), None  # (B, T, H, Dv)


@functools.cache
def _register() -> None:
    """Make PACKED_SDPA an attention implementation transformers knows; once per process, at the
    first use rather than at import: transformers' attention and mask registries live in its
    modeling stack (seconds to import), which a process that only coordinates never loads."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_SDPA, packed_gqa_attention)
    AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)  # the same masks as sdpa where the model builds its own


@contextmanager
def packed_gqa(model: PreTrainedModel) -> Iterator[None]:
    """Run `model` with `packed_gqa_attention` inside the block when it uses sdpa with grouped
    key/value heads; otherwise (eager, flash, one key/value head per query head) leave it as it is."""
    config = model.config
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if config._attn_implementation != "sdpa" or heads == kv_heads:
        yield
        return
    _register()
    config._attn_implementation = PACKED_SDPA
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"
