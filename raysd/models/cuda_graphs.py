"""CUDA graphs of a StaticRunner's small forwards: decode (T = 1), verify (T = K + 1), draft.

On an H100 an 8B Llama's eager decode step took 26.0 ms at batch 1 and its CUDA-graph replay 9.2 ms
(the memory-bandwidth floor: 5.5 ms); a 1B draft's 21.3 ms and 2.8 ms (docs/performance.md, GPU):
eager PyTorch spends the step launching kernels. gpt-fast and vLLM capture the decode step once per
batch size and replay it; this does the same for the static runner, whose buffers stay in place
(rollback moves lengths only), so a captured step stays valid until the buffers grow.

A graph has fixed shapes, so it is keyed by (rows, chunk width T, logits kept n, attended
columns W). Rows are padded up to a bucket (`row_bucket`: 1, 2, 4, then multiples of 8, vLLM's
capture sizes) within the buffers' slots: a batch's tail, where rows finish one by one, replays the
next bucket's graph instead of running eager or capturing a graph per size. A padding row is a free
slot fed an all-padding chunk: it writes only the padding column and its length does not move
(StaticRunner._device_step), and its logits are dropped; in a memory-bound step it costs little. W
is rounded up to a power of two (at least MIN_ATTEND): the eager path rounds to 64 columns, which
would capture a new graph every 64 tokens; attending more columns costs little (the extra columns are
masked out) next to reading the weights. A key is captured the `capture_after`-th time it is seen,
and at most `max_graphs` are kept, least recently used first out, all in one memory pool (a replay's
logits are copied out before the next replay). Buffer growth (doubling) drops every graph.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch

MIN_ATTEND = 256  # the narrowest attended width captured


def row_bucket(rows: int, slots: int) -> int:
    """The rows a graph for `rows` real rows is captured with: 1, 2, 4, then the next multiple of 8,
    within the buffers' `slots` (never fewer than `rows`)."""
    bucket = rows if rows <= 2 else 4 if rows <= 4 else -(-rows // 8) * 8
    return max(rows, min(bucket, slots))


def buffer_pointers(runner) -> list[int]:
    """Where a StaticRunner's lengths and every layer's keys and values live: a captured graph reads
    and writes these addresses, so it is valid while they stay."""
    return [runner._lengths.data_ptr()] + [t.data_ptr() for layer in runner._layers() for t in (layer.keys, layer.values)]


def attend_bucket(columns: int, max_columns: int) -> int:
    """The attended width of a graph for rows of up to `columns` tokens: the next power of two
    (at least MIN_ATTEND), within `max_columns` when that is still enough."""
    w = MIN_ATTEND
    while w < columns:
        w *= 2
    return max(columns, min(w, max_columns))


class GraphedSteps:
    """A StaticRunner's captured forwards, by shape. `capture(runner, rows, width, max_logits, attend,
    pool)` builds one over the slots 0 .. rows - 1 (CudaGraphStep on CUDA; tests pass an eager stand-in
    with the same contract)."""

    def __init__(self, runner, capture: Callable, max_graphs: int = 32, capture_after: int = 2, pool=None):
        assert max_graphs >= 1 and capture_after >= 1
        self.runner, self.capture = runner, capture
        self.max_graphs, self.capture_after, self.pool = max_graphs, capture_after, pool
        self.graphs: OrderedDict[tuple, object] = OrderedDict()
        self.seen: dict[tuple, int] = {}
        self.captures = self.replays = 0
        self._pointers = None

    def __call__(self, chunks: torch.Tensor, chunk_valid: torch.Tensor, num_logits: torch.Tensor, n: int):
        """The logits of `runner.forward(chunks, chunk_valid, num_logits, n)` from a graph, or None
        where this shape is not (yet) captured: the caller then runs the eager forward."""
        r = self.runner
        B, T = chunks.shape
        if not r._layers():  # nothing cached yet: a capture needs the buffers a first forward makes
            return None
        if self.graphs and buffer_pointers(r) != self._pointers:  # the eager path grew the buffers
            self.graphs.clear()
        attend = attend_bucket(r._bound + T, r.max_cache_len)
        rows = row_bucket(B, r.cache.capacity[0])
        key = (rows, T, n, attend)
        step = self.graphs.get(key)
        if step is None:
            self.seen[key] = self.seen.get(key, 0) + 1
            if self.seen[key] < self.capture_after:
                return None
            step = self._capture(key)
        self.graphs.move_to_end(key)
        self.replays += 1
        if rows > B:  # padding rows: free slots fed nothing (all-padding chunks), their logits dropped
            pad = rows - B
            chunks = torch.cat([chunks, chunks.new_zeros(pad, T)])  # [rows, T]
            chunk_valid = torch.cat([chunk_valid, chunk_valid.new_zeros(pad, T)])  # [rows, T]
            num_logits = torch.cat([num_logits, num_logits.new_ones(pad)])  # [rows]
        return step(chunks, chunk_valid, num_logits)[:B]

    def _capture(self, key: tuple):
        rows, T, n, attend = key
        step = self.capture(self.runner, rows, T, n, attend, self.pool)  # may grow the buffers first
        pointers = buffer_pointers(self.runner)
        if pointers != self._pointers:  # the buffers moved: every earlier graph wrote the old ones
            self.graphs.clear()
            self._pointers = pointers
        self.graphs[key] = step
        self.captures += 1
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        return step

