"""Linear layers for decoding and verification on a CPU: prepacked oneDNN weights for a few rows.

A decode or verify forward multiplies each weight by M = rows x tokens activations, M = 1 to a few
dozen, and reads every weight from memory once per forward: the model is memory-bound, and a
product over M rows should cost about what one over a single row costs. PyTorch's `F.linear` on
the CPU does not: MKL's GEMM re-packs the weight on every call, so every extra row costs nearly
as much as the first, and a verify over K + 1 tokens costs a multiple of a decode step, which is
what decides whether speculation pays on a CPU.

oneDNN's linear over a weight packed once in its blocked layout (what Inductor's CPU freezing and
vLLM's CPU backend run) costs little more for a few rows than for one on the wide layers, and on
some CPUs its single-row product is the fastest there is (docs/history/benchmarks.md, "Linear
kernels"). Inside `with linears.active():`:
- 1 <= M <= 128: `torch.ops.mkldnn._linear_pointwise` on the packed copy, two or more rows padded
  up to one of `ROW_BUCKETS` (oneDNN caches a compiled primitive per shape: see there); larger M
  (prefill) `F.linear`.
The results differ from `F.linear`'s by float32 summation order only (~1e-6 relative), as MKL's
GEMM and GEMV already differ from each other; tests/models/test_linear.py holds the runners'
logits and the engine's greedy tokens to the stock kernels'.

Whether the packed copy is faster depends on the CPU: on some it is, at one row and at several;
on others MKL's own one-row product is faster and at 8 or more rows the two tie (docs/history/
benchmarks.md, Benchmark 18). `linear_kernels="auto"` therefore times both on the model's own
layers once per machine (`measure_choice`, kept in
raysd's cache: `auto_choice`) and takes the packed copy only for the row counts where it is
clearly faster (`KernelChoice`).

The copies cost memory: one packed copy of every linear weight (as much again as the weights). They are made on a model's first use, kept on the
model (`model_linears`), and made again if a weight changed since (distillation trains drafts in
place). Outside the block the model is stock, so the same object still runs Hugging Face
`generate` with PyTorch's own kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from raysd.models.gguf_cache import machine_entry, write_entry

LINEAR_KERNELS: tuple[str, ...] = ("auto", "packed", "stock")
PACK_ROWS_HINT = 8  # the row count oneDNN packs for: one packing serves M = 2..32 as well as one per M would
# oneDNN compiles and caches a primitive per input shape and keeps it: fed every row count a prefill
# produces, a process's memory grows with every new shape. Packed products therefore take these row
# counts only, the rows padded up to the next (fixed shapes, as a CUDA graph would); larger products
# (prefill, where oneDNN is no faster than MKL) run `F.linear`.
ROW_BUCKETS: tuple[int, ...] = (2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
_ATTR = "_raysd_linears"
_CHOICE_ATTR = "_raysd_linear_choice"
# "auto" takes the packed copy for a row count only where it measured under this fraction of the
# stock product's time: where the two tie, PyTorch's own kernels (and the same choice every run).
AUTO_MARGIN = 0.9
MEASURED_ROWS = (1, 8)  # a decode step at batch 1; a batch's decode step or a verify (as 2..128)


@dataclass(frozen=True)
class KernelChoice:
    """Which products take the packed copy: one row (decoding at batch 1), and 2..128 rows."""

    one_row: bool
    few_rows: bool

    def packed_for(self, rows: int) -> bool:
        return self.one_row if rows == 1 else self.few_rows and rows <= ROW_BUCKETS[-1]


PACKED = KernelChoice(one_row=True, few_rows=True)


def check_linear_kernels(kind: str) -> None:
    if kind not in LINEAR_KERNELS:
        raise ValueError(f"linear_kernels must be one of {LINEAR_KERNELS}, got {kind!r}")


def packed_supported(model: nn.Module) -> str | None:
    """Why `model` cannot run the packed kernels, or None: they are for float32 on a CPU with oneDNN."""
    param = next(model.parameters(), None)
    if param is None:
        return "packed linear kernels need a model with parameters"
    if param.device.type != "cpu":
        return f"packed linear kernels are for the CPU; this model is on {param.device}"
    if param.dtype != torch.float32:
        return f"packed linear kernels are for float32; this model is {param.dtype}"
    if not torch.backends.mkldnn.is_available():
        return "packed linear kernels need PyTorch built with oneDNN (mkldnn)"
    return None


def use_packed(model: nn.Module, kind: str) -> KernelChoice | None:
    """The products that take the packed copy, None for none. "auto": where supported, those
    `measure_choice` found faster on this machine (`auto_choice`); "packed": all of them, or a
    one-line error; "stock": none."""
    check_linear_kernels(kind)
    reason = packed_supported(model)
    if kind == "packed" and reason:
        raise ValueError(reason)
    if kind == "stock" or reason is not None:
        return None
    if kind == "packed":
        return PACKED
    choice = auto_choice(model)
    if choice.one_row or choice.few_rows:
        return choice
    linears = model.__dict__.get(_ATTR)
    if linears is not None:
        linears.release()  # packed to be measured: as much memory again as the weights, for nothing
    return None


def auto_choice(model: nn.Module) -> KernelChoice:
    """What "auto" takes for this model on this machine: read from raysd's cache, where it was
    measured once per machine, layer shapes and thread count (no load pays the timing again, and
    every process makes the same choice); else measured (packing the copies) and kept there. Kept
    on the model as well, beside its copies."""
    choice = model.__dict__.get(_CHOICE_ATTR)
    if choice is not None:
        return choice
    shapes = [(m.out_features, m.in_features, m.bias is not None) for m in model.modules() if type(m) is nn.Linear]
    path, _ = machine_entry("linear_kernels", {"shapes": shapes})
    try:
        choice = KernelChoice(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):  # not measured here yet, or an unreadable entry: measure (again)
        choice = measure_choice(model_linears(model))
        try:
            write_entry(path, dataclasses.asdict(choice))
        except OSError as exc:
            warnings.warn(f"raysd: could not keep the linear-kernel choice in {path.parent} ({exc}); "
                          "it is measured again at the next load", stacklevel=2)
    model.__dict__[_CHOICE_ATTR] = choice  # not a submodule or buffer: state_dict and .to() never see it
    return choice


def choose(stock_s: dict[int, float], packed_s: dict[int, float]) -> KernelChoice:
    """The packed copy for a row count where it took under AUTO_MARGIN of the stock product's time."""
    faster = {rows: packed_s[rows] < AUTO_MARGIN * stock_s[rows] for rows in MEASURED_ROWS}
    return KernelChoice(one_row=faster[1], few_rows=faster[MEASURED_ROWS[-1]])


def measure_choice(linears: PackedLinears, rounds: int = 3) -> KernelChoice:
    """Time every linear layer of the model in turn, as a forward runs them (each weight read from
    memory, as in decoding), stock against packed, at each of MEASURED_ROWS rows: the median of
    `rounds` interleaved passes after one warm-up."""
    layers = list(linears.layers.items())
    g = torch.Generator().manual_seed(0)  # not the global generator: measuring draws nothing of the caller's
    inputs = {rows: [torch.randn(rows, m.in_features, generator=g) for m, _ in layers] for rows in MEASURED_ROWS}

    def one_pass(rows: int, packed: bool) -> float:
        start = time.perf_counter()
        for (_, copy), x in zip(layers, inputs[rows]):
            if packed:
                copy.forward(x, PACKED)
            else:
                F.linear(x, copy.weight, copy.bias)
        return time.perf_counter() - start

    times: dict[tuple[int, bool], list[float]] = {(r, p): [] for r in MEASURED_ROWS for p in (False, True)}
    with torch.no_grad():
        for i in range(rounds + 1):
            for key in times:
                elapsed = one_pass(*key)
                if i:  # round 0 warms oneDNN's primitives and the caches up
                    times[key].append(elapsed)
    median = {key: statistics.median(ts) for key, ts in times.items()}
    return choose({r: median[r, False] for r in MEASURED_ROWS}, {r: median[r, True] for r in MEASURED_ROWS})


def _version_of(weight: torch.Tensor) -> tuple[int, int | None]:
    """Where a weight lives and how often it was written in place. A tensor made under inference_mode
    keeps no version counter: its storage alone says whether it was replaced."""
    return weight.data_ptr(), None if weight.is_inference() else weight._version


class _Packed:
    """One nn.Linear's copies and the forward that picks between them by row count."""

    def __init__(self, module: nn.Linear):
        weight = module.weight.detach()  # [N, K]
        self.weight, self.bias = weight, None if module.bias is None else module.bias.detach()
        self.version = _version_of(weight)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)  # oneDNN blocked [N, K]

    def stale(self, module: nn.Linear) -> bool:
        w = module.weight
        return _version_of(w) != self.version or (module.bias is None) != (self.bias is None)

    def forward(self, x: torch.Tensor, choice: KernelChoice) -> torch.Tensor:  # x (..., K) -> (..., N)
        rows = x.numel() // x.shape[-1]
        if not choice.packed_for(rows):  # prefill, or where stock measured as fast
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, x.shape[-1])  # (rows, K)
        if rows > 1:  # (bucket, K): zero rows below; one row is its own shape
            flat = F.pad(flat, (0, 0, 0, next(b for b in ROW_BUCKETS if b >= rows) - rows))
        y = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")[:rows]  # (rows, N)
        return y.reshape(*x.shape[:-1], y.shape[-1])


class PackedLinears:
    """The packed copies of one model's nn.Linear layers; `active()` switches them in."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.layers: dict[nn.Linear, _Packed] = {}
        self._depth = 0  # nested blocks (a draft that is the target's own model) switch once
        self.refresh()

    def release(self) -> None:
        """Drop the copies (a later `active()` makes them again)."""
        self.layers.clear()

    def __reduce__(self):
        """A copied or pickled model leaves its copies behind and packs its own on first use
        (`copy.deepcopy(model).to(torch.bfloat16)` must not carry float32 oneDNN tensors along)."""
        return _dropped, ()

    def refresh(self) -> None:
        """(Re)make the copies of layers whose weights changed since they were made, or are new."""
        with torch.no_grad():
            for module in self.model.modules():
                if type(module) is nn.Linear and (module not in self.layers or self.layers[module].stale(module)):
                    self.layers[module] = _Packed(module)

    @contextmanager
    def active(self, choice: KernelChoice = PACKED) -> Iterator[None]:
        """Inside the block every plain nn.Linear of the model runs its packed forward for the row
        counts `choice` names. Only without autograd (the runners' inference mode): the copies
        carry no gradient."""
        if torch.is_grad_enabled() or self._depth:
            yield
            return
        if not self.layers or any(p.stale(m) for m, p in self.layers.items()):
            self.refresh()
        for module, packed in self.layers.items():
            module.forward = functools.partial(packed.forward, choice=choice)  # shadows nn.Linear.forward
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            for module in self.layers:
                del module.forward


def _dropped() -> None:
    return None


def model_linears(model: nn.Module) -> PackedLinears:
    """The model's packed linears, made on first use and kept on the model itself, so every runner
    over the same model (the verifier's, a profile's, a draft sharing the target) shares one copy."""
    linears = model.__dict__.get(_ATTR)
    if linears is None:
        linears = PackedLinears(model)
        model.__dict__[_ATTR] = linears  # not a submodule or buffer: state_dict and .to() never see it
    return linears


@contextmanager
def linear_kernels(model: nn.Module, choice: KernelChoice | None) -> Iterator[None]:
    """The runners' switch: the packed kernels inside the block for what `choice` names (use_packed's)."""
    if choice is None:
        yield
        return
    with model_linears(model).active(choice):
        yield
