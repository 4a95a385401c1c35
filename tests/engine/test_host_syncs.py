"""The engine's speculative step reads back from the device once: the verdict.

On the CPU a read-back does not stall anything, so it is counted where it happens: a
dispatch mode counts the ops that return a value to Python (`aten._local_scalar_dense`
behind `.item()`, `int()`, `bool()`; `aten.nonzero`; `aten.equal`; `aten.is_nonzero`),
and `Tensor.tolist` / `Tensor.numpy` / `Tensor.item` are wrapped to count copies to the host.
On a GPU, tests/gpu sets `torch.cuda.set_sync_debug_mode("error")` over the same step.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from raysd.core.sampling import SamplingParams
from raysd.core.speculation import SpeculationConfig
from raysd.engine.drafters import DraftModelDrafter, FeatureDrafter, NgramDrafter, NoDrafter
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.requests import Request
from raysd.models.eagle_draft import EagleDraft
from tests.conftest import EOS, VOCAB, tiny_model

SYNC_OPS = {"_local_scalar_dense", "nonzero", "equal", "is_nonzero", "item"}
STEP_BUDGET = 1  # the verdict


class HostReads(TorchDispatchMode):
    """Counts ops that hand a device value to the host."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNC_OPS:
            self.count += 1
            self.names.append(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_host_reads(monkeypatch):
    reads = HostReads()
    for method in ("tolist", "numpy"):
        original = getattr(torch.Tensor, method)

        def wrapped(self, *a, _original=original, _name=method, **kw):
            reads.count += 1
            reads.names.append(_name)
            return _original(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, method, wrapped)
    with reads:
        yield reads
    monkeypatch.undo()


def drafter_of(kind: str, target):
    if kind == "eagle":
        return FeatureDrafter(EagleDraft.from_target(target), VOCAB)
    if kind == "model":
        return DraftModelDrafter(tiny_model("llama", seed=5, layers=1), VOCAB)
    return NgramDrafter(VOCAB) if kind == "ngram" else NoDrafter(VOCAB)


def count_reads_per_step(engine: SpecEngine, monkeypatch) -> list[tuple[int, list]]:
    """Wrap engine.step: each step appends (host reads, their op names) to the returned list."""
    per_step = []
    step = engine.step

    def counted_step():
        with count_host_reads(monkeypatch) as reads:
            outcome = step()
        per_step.append((reads.count, reads.names))
        return outcome

    engine.step = counted_step
    return per_step


@pytest.mark.parametrize("kind", ["model", "eagle", "ngram", "none"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_speculative_step_reads_back_once(kind, temperature, monkeypatch):
    target = tiny_model("llama", seed=0)
    speculation = SpeculationConfig(num_speculative_tokens=4, eos_token_ids=(EOS,))
    engine = SpecEngine(target, drafter_of(kind, target), EngineConfig(speculation, max_batch_size=4))
    per_step = count_reads_per_step(engine, monkeypatch)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 3, 7, 4, 6)]
    params = SamplingParams(temperature=temperature, max_new_tokens=12, seed=3, ignore_eos=True)
    results = engine.generate([Request(i, p, params) for i, p in enumerate(prompts)])
    assert all(len(r.token_ids) == 12 for r in results)
    assert per_step and all(n <= STEP_BUDGET for n, _ in per_step), per_step


def test_the_counter_sees_reads():
    """The instrument itself: an .item(), a bool() and a tolist() are three reads."""
    x = torch.arange(4)
    mp = pytest.MonkeyPatch()
    with count_host_reads(mp) as reads:
        x.sum().item()
        bool((x > 2).any())
        x.tolist()
    assert reads.count == 3, reads.names


class OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def ops_per_step(kind: str, batch: int, temperature: float) -> list[int]:
    """Tensor operations of each engine step of `batch` rows, the model's forwards included."""
    target = tiny_model("llama", seed=0)
    speculation = SpeculationConfig(num_speculative_tokens=4, eos_token_ids=(EOS,))
    config = EngineConfig(speculation, max_batch_size=batch, linear_kernels="stock")  # as on a GPU: no row buckets
    engine = SpecEngine(target, drafter_of(kind, target), config)
    per_step, step = [], engine.step

    def counted_step():
        with OpCount() as ops:
            outcome = step()
        per_step.append(ops.count)
        return outcome

    engine.step = counted_step
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=temperature, max_new_tokens=8, seed=3, ignore_eos=True)
    engine.generate([Request(i, torch.randint(3, VOCAB, (6,), generator=g).tolist(), params) for i in range(batch)])
    return per_step


@pytest.mark.parametrize("kind", ["model", "none"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_steps_tensor_operations_do_not_grow_with_the_batch(kind, temperature):
    """No per-row tensor work in a step: on a GPU each operation is a kernel launch or a host
    tensor op (~5-10 us of host time), so work per row would cost B launches a step. Every row has
    the same prompt length and tokens to make, so the steps after the first (the prefill) are alike."""
    two, eight = ops_per_step(kind, 2, temperature), ops_per_step(kind, 8, temperature)
    assert len(two) == len(eight) and two[1:] == eight[1:], (two, eight)
