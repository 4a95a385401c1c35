"""CUDA graphs of a StaticRunner's step programs: a forward, a draft's K steps, a verify.

Eager PyTorch spends a small model's step launching kernels (docs/performance.md, GPU). gpt-fast and
vLLM capture the decode step once per batch size and replay it; this does the same for the static
runner, whose buffers stay in place (rollback moves lengths only), so a captured step stays valid
until the buffers grow.

A program is a function `fn(attend, *inputs) -> tuple of tensors` of device tensors over the slots
0 .. R - 1 (R the inputs' rows) that reads nothing back to the host and changes the runner only on
the device (keys, values, lengths): one forward (`StaticRunner.forward`), a draft model's K steps
with their sampling, or a target's verify with its rejection test (raysd.engine). The runner runs it
eagerly (`StaticRunner.run`) or, with graphs, `GraphedSteps` replays a graph captured for it. A
graph has fixed shapes, so it is keyed by (the program's key, rows R, attended columns, the inputs'
trailing shapes and dtypes). Rows are padded up to a bucket (`row_bucket`: 1, 2, 4, then multiples
of 8, vLLM's capture sizes) within the buffers' slots: a batch's tail, where rows finish one by one,
replays the next bucket's graph instead of running eager or capturing a graph per size. A padding
row is fed zeros, which every program reads as "nothing" (no valid token, no draft): it writes only
the padding column, its length does not move, and its outputs are dropped; in a memory-bound step it
costs little. The attended width is rounded up to a power of two (at least MIN_ATTEND): the eager
path rounds to 64 columns, which would capture a new graph every 64 tokens; attending more columns
costs little (the extra columns are masked out) next to reading the weights.

A key is captured the `capture_after`-th time it is seen, or beforehand (`capture_at`: what a job
will need, before its first step), and at most `max_graphs` are kept, least recently used first
out, all in one memory pool: their scratch memory is shared, and what a replay returns is valid
until the same graph replays again. Buffer growth (doubling) drops every graph.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch

MIN_ATTEND = 256  # the narrowest attended width captured


@dataclass
class GraphCounts:
    """What a runner's forwards did, counted since it was made (cumulative: a caller takes differences)."""

    replays: int = 0  # programs replayed from a captured graph (a forward, a draft's K steps, a verify: one each)
    eager_forwards: int = 0  # model forwards of steps run eagerly (no graph for the program, or graphs off)
    prefill_forwards: int = 0  # prompt forwards at admission (always eager)
    captures: int = 0  # graphs captured
    capture_s: float = 0.0  # seconds capturing, torch.compile's compiles included
    compiles: int = 0  # graphs torch.compile made (dynamo's unique graphs), while capturing or not
    compile_s: float = 0.0  # seconds of the forwards that compiled
    bytes_read: int = 0  # weights and attended keys/values the steps' forwards read, padding rows and columns included

    def copy(self) -> GraphCounts:
        return GraphCounts(**{k: getattr(self, k) for k in self.__dataclass_fields__})

    def minus(self, other: GraphCounts) -> GraphCounts:
        return GraphCounts(**{k: getattr(self, k) - getattr(other, k) for k in self.__dataclass_fields__})


class GraphKey(NamedTuple):
    program: tuple  # what the program computes (its name and static parameters)
    rows: int  # slots it runs over: the rows' bucket
    attend: int  # columns it attends
    signature: tuple  # the inputs' trailing shapes and dtypes


def row_bucket(rows: int, slots: int) -> int:
    """The rows a graph for `rows` real rows is captured with: 1, 2, 4, then the next multiple of 8,
    within the buffers' `slots` (never fewer than `rows`)."""
    bucket = rows if rows <= 2 else 4 if rows <= 4 else -(-rows // 8) * 8
    return max(rows, min(bucket, slots))


def row_buckets(rows: int, slots: int) -> list[int]:
    """Every bucket a batch of 1 .. `rows` rows replays."""
    return sorted({row_bucket(b, slots) for b in range(1, rows + 1)})


def buffer_pointers(runner) -> list[int]:
    """Where a StaticRunner's lengths and every layer's keys and values live: a captured graph reads
    and writes these addresses, so it is valid while they stay."""
    return [runner._lengths.data_ptr()] + [t.data_ptr() for layer in runner._layers() for t in (layer.keys, layer.values)]


def attend_bucket(columns: int, max_columns: int | None = None) -> int:
    """The attended width of a graph for rows of up to `columns` tokens: the next power of two
    (at least MIN_ATTEND), within `max_columns` when that is still enough."""
    w = MIN_ATTEND
    while w < columns:
        w *= 2
    return w if max_columns is None else max(columns, min(w, max_columns))


def attend_buckets(columns: int, max_columns: int) -> list[int]:
    """Every attended width a graph for rows of up to `columns` tokens may have (the buckets a job's
    rows grow through)."""
    out, w = [], MIN_ATTEND
    while True:
        out.append(attend_bucket(min(w, columns), max_columns))
        if w >= columns:
            return sorted(set(out))
        w *= 2


def signature(inputs: Sequence[torch.Tensor]) -> tuple:
    return tuple((tuple(t.shape[1:]), t.dtype) for t in inputs)


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """`t` with zero rows appended up to `rows` (zeros: a padding row is fed nothing)."""
    return t if t.shape[0] == rows else torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


class GraphedSteps:
    """A StaticRunner's captured programs, by GraphKey. `capture(runner, fn, inputs, attend, pool)`
    captures `fn` over the inputs' rows (CudaGraphProgram on CUDA; tests pass an eager stand-in with
    the same contract) and returns a callable of the inputs that returns fn's outputs."""

    def __init__(self, runner, capture: Callable, max_graphs: int = 256, capture_after: int = 1, pool=None):
        assert max_graphs >= 1 and capture_after >= 1
        self.runner, self.capture = runner, capture
        self.max_graphs, self.capture_after, self.pool = max_graphs, capture_after, pool
        self.graphs: OrderedDict[GraphKey, object] = OrderedDict()
        self.seen: dict[GraphKey, int] = {}
        self._pointers = None

    def run(self, program: tuple, fn: Callable, inputs: Sequence[torch.Tensor], advance: int,
            forwards: int = 1) -> tuple | None:
        """`fn`'s outputs from a graph, for the runner's rows, or None where this shape is not (yet)
        captured: the caller then runs `fn` eagerly. `advance`: columns the program adds to the
        longest row (its tokens per row); `forwards`: the model forwards it makes (for bytes_read)."""
        r = self.runner
        if not r._layers():  # nothing cached yet: a capture needs the buffers a first forward makes
            return None
        self._check_buffers()
        B = inputs[0].shape[0]
        key = GraphKey(program, row_bucket(B, r.cache.capacity[0]), attend_bucket(r._bound + advance, r.max_cache_len),
                       signature(inputs))
        step = self.graphs.get(key)
        padded = [pad_rows(t, key.rows) for t in inputs]
        if step is None:
            self.seen[key] = self.seen.get(key, 0) + 1
            if self.seen[key] < self.capture_after:
                return None
            step = self._capture(key, fn, padded)
        self.graphs.move_to_end(key)
        r.counts.replays += 1
        r.counts.bytes_read += forwards * r.bytes_per_forward(key.rows, key.attend)
        outputs = step(*padded)
        r._bound += advance
        return tuple(o[:B] for o in outputs)

    @torch.inference_mode()
    def capture_at(self, program: tuple, fn: Callable, inputs: Sequence[torch.Tensor], attend: int) -> bool:
        """Capture `fn` beforehand for inputs of R = their rows and `attend` columns (the runner's
        slots and columns must hold them already: growing the buffers drops every graph). Returns
        whether it captured (False: it was already). The inputs should be zeros: the capture runs
        `fn` on them, and zeros feed nothing."""
        r = self.runner
        assert r._layers(), "capture after the first forward (the buffers' shapes come from it)"
        self._check_buffers()
        key = GraphKey(program, inputs[0].shape[0], attend, signature(inputs))
        if key in self.graphs:
            return False
        self._capture(key, fn, inputs)
        return True

    def _check_buffers(self) -> None:
        if self.graphs and buffer_pointers(self.runner) != self._pointers:  # the eager path grew the buffers
            self.graphs.clear()

    def _capture(self, key: GraphKey, fn: Callable, inputs: Sequence[torch.Tensor]):
        r = self.runner
        t0 = time.perf_counter()
        step = self.capture(r, fn, inputs, key.attend, self.pool)  # may grow the buffers first
        pointers = buffer_pointers(r)
        if pointers != self._pointers:  # the buffers moved: every earlier graph wrote the old ones
            self.graphs.clear()
            self._pointers = pointers
        self.graphs[key] = step
        r.counts.captures += 1
        r.counts.capture_s += time.perf_counter() - t0
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        return step
