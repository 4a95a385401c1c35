"""Logits to probabilities, and sampling that takes its randomness as an argument.

Draft and target go through the same `logits_to_probs`, so the distributions
compared by the rejection test are the ones each model actually samples from.
Temperature 0 is an exact argmax: its "distribution" is one-hot, and every
rejection test against it is decided without looking at a random number.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from raysd.core.params import SamplingParams  # its home is torch-free; callers also import it from here


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters of a batch, as tensors on the logits' device.

    The three flags say which transforms the batch needs. They are plain bools known on
    the host (from the params, or read once here), so `logits_to_probs` never reads a
    device value back per call."""

    temperature: torch.Tensor  # [B] float32, 0 for greedy rows
    top_k: torch.Tensor  # [B] int64, 0 disables
    top_p: torch.Tensor  # [B] float32, 1 disables
    any_greedy: bool | None = None
    any_top_k: bool | None = None  # some row keeps fewer than all tokens by top-k (for V > top_k)
    any_top_p: bool | None = None
    all_greedy: bool | None = None  # every row greedy: one-hot distributions, built without a softmax

    def __post_init__(self) -> None:
        if self.any_greedy is None:
            object.__setattr__(self, "any_greedy", bool((self.temperature == 0).any()))
        if self.all_greedy is None:
            object.__setattr__(self, "all_greedy", bool((self.temperature == 0).all()))
        if self.any_top_k is None:
            object.__setattr__(self, "any_top_k", bool((self.top_k > 0).any()))
        if self.any_top_p is None:
            object.__setattr__(self, "any_top_p", bool((self.top_p < 1.0).any()))

    @staticmethod
    def from_params(params: Sequence[SamplingParams], device: torch.device | str = "cpu") -> "SamplingTensors":
        return SamplingTensors(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            any_greedy=any(p.greedy for p in params),
            any_top_k=any(p.top_k > 0 for p in params),
            any_top_p=any(p.top_p < 1.0 for p in params),
            all_greedy=all(p.greedy for p in params),
        )

    def to(self, device: torch.device | str) -> "SamplingTensors":
        return SamplingTensors(self.temperature.to(device), self.top_k.to(device), self.top_p.to(device),
                               self.any_greedy, self.any_top_k, self.any_top_p, self.all_greedy)


ARGMAX_BLOCK = 128


def argmax_last(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)`, the same indices (the first maximum; NaN counts as the maximum).

    On the CPU PyTorch's argmax over the last dimension is a scalar loop, several times slower
    than the vectorised `amax` over a vocabulary-wide row. So there it runs in two passes: the maximum of each block of 128 (vectorised), torch's argmax over those block maxima
    (the first block holding the maximum), then inside that block (its first maximum)."""
    V = x.shape[-1]
    if x.device.type != "cpu" or V % ARGMAX_BLOCK or V < 4 * ARGMAX_BLOCK:
        return x.argmax(dim=-1)
    blocks = x.reshape(*x.shape[:-1], V // ARGMAX_BLOCK, ARGMAX_BLOCK)  # [..., V / 128, 128]
    best = blocks.amax(dim=-1).argmax(dim=-1, keepdim=True)  # [..., 1]
    inner = blocks.gather(-2, best[..., None].expand(*best.shape, ARGMAX_BLOCK))[..., 0, :].argmax(dim=-1)  # [...]
    return best[..., 0] * ARGMAX_BLOCK + inner


def logits_to_probs(logits: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
    """Turn logits into the distribution each row samples from.

    Order as in HF generate: temperature, then top-k, then top-p.

    Args:
        logits: [B, V] or [B, T, V]; any float dtype.
        sampling: per-row parameters, each [B].
    Returns:
        float32 probabilities of the same shape; one-hot at argmax for greedy rows.
    """
    squeeze = logits.dim() == 2
    if squeeze:
        logits = logits[:, None]
    B, T, V = logits.shape
    assert sampling.temperature.shape == (B,), (sampling.temperature.shape, B)
    if sampling.all_greedy:  # the one-hots below, without a softmax over the vocabulary nobody reads
        probs = torch.zeros((B, T, V), dtype=torch.float32, device=logits.device)  # [B, T, V]
        probs.scatter_(-1, argmax_last(logits)[..., None], 1.0)
        return probs[:, 0] if squeeze else probs
    logits = logits.float()

    greedy = sampling.temperature == 0  # [B]
    temperature = torch.where(greedy, 1.0, sampling.temperature)[:, None, None]  # [B, 1, 1]
    scaled = logits / temperature  # [B, T, V]
    if sampling.any_top_k or sampling.any_top_p:  # host flags: no read-back
        scaled = _apply_top_k_top_p(scaled, sampling.top_k, sampling.top_p)
    probs = torch.softmax(scaled, dim=-1)  # [B, T, V]

    if sampling.any_greedy:
        one_hot = torch.zeros_like(probs).scatter_(-1, argmax_last(logits)[..., None], 1.0)
        probs = torch.where(greedy[:, None, None], one_hot, probs)
    return probs[:, 0] if squeeze else probs


def _apply_top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus with -inf.

    Written as HF's TopKLogitsWarper then TopPLogitsWarper (ascending sort, drop
    tokens whose cumulative mass is <= 1 - top_p, keep the largest), vectorised
    over rows that each carry their own k and p.
    """
    B, T, V = scaled.shape
    sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=False)  # [B, T, V]
    # top-k: keep logits >= the k-th largest, so ties at the boundary survive.
    k = torch.where((top_k > 0) & (top_k < V), top_k, V)  # [B]
    kth = sorted_logits.gather(-1, (V - k)[:, None, None].expand(B, T, 1))  # [B, T, 1]
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    # top-p on what top-k left.
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [B, T, V]
    drop = (cumulative <= (1.0 - top_p)[:, None, None]) & (top_p < 1.0)[:, None, None]
    drop[..., -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, sorted_idx, sorted_logits)


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor, one_hot: bool = False) -> torch.Tensor:
    """Draw one token per row by inverting the CDF with a given uniform.

    The probabilities need not be normalised. A token of zero probability is never
    returned: searchsorted(right=True) lands on the first index whose CDF exceeds
    the draw, and a zero-probability token never raises the CDF.

    Args:
        probs: [N, V] non-negative weights with a positive sum per row.
        uniforms: [N] in [0, 1).
        one_hot: the caller knows every row is one-hot (`logits_to_probs` of an all-greedy
            batch): the draw is the hot index whatever the uniform, taken without the CDF.
    Returns:
        [N] int64 token ids.
    """
    assert probs.dim() == 2 and uniforms.shape == probs.shape[:1], (probs.shape, uniforms.shape)
    if one_hot:
        return argmax_last(probs)
    cdf = probs.double().cumsum(dim=-1)  # [N, V]; float64 so a 128k vocabulary loses nothing
    draw = uniforms.double()[:, None] * cdf[:, -1:]  # [N, 1]
    tokens = torch.searchsorted(cdf, draw, right=True)[:, 0]
    return tokens.clamp_(max=probs.shape[-1] - 1)
