"""A ModelRunner over preallocated key/value buffers: the GPU fast path's cache (issue 8).

Same interface and column layout as `raysd.models.runner.ModelRunner` (column c of the
cache is column c of every row; a chunk is appended at the same columns for every row,
each row's real tokens right-aligned in it), but:

* keys and values live in buffers [B, H, L_max, D] per layer, written in place at the
  columns [w, w + T) of each chunk (`index_copy_`): no `torch.cat` of the whole cache per
  forward. The write column w is a host int (every chunk width is known on the host);
* `rollback` only clears bits of the validity mask: rolled-back columns become holes that
  no query attends to (positions come from `lengths`, so holes shift nothing). No gather,
  no host synchronisation. When a chunk would run past L_max, one compaction (the gather
  that ModelRunner does after every rollback) right-aligns the kept tokens;
* the model gets a ready 4D mask, so transformers skips its own mask building (and the
  `.all()` host synchronisation in it); padded query positions attend to their own
  column only, so no attention row is fully masked;
* a forward of T <= SMALL_CHUNK tokens keeps logits for all T positions and gathers each
  row's last `num_logits[b]`: no `int(num_logits.max())` unless the caller does not pass
  `max_logits` (the shape of the result is [B, max(num_logits), V], as ModelRunner's).

A decode step of fixed (B, T) therefore has static shapes and buffer addresses, apart from
the columns it writes (a small device tensor): the candidate for torch.compile and CUDA
graphs (docs/gpu.md). For decoder models whose attention takes a 4D mask and a Cache
(Llama, Qwen2, Mistral); other architectures keep ModelRunner.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin

from raysd.models.loading import output_vocab_size

SMALL_CHUNK = 16  # chunks up to this wide keep all their logits (verification: K + 1, drafting: 1)


class _ColumnLayer(CacheLayerMixin):
    """One layer's keys/values [B, H, L_max, D]; writes each chunk at the cache's columns."""

    is_compileable = True

    def __init__(self, owner: "_ColumnCache"):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        L = self.owner.max_cache_len
        self.keys = key_states.new_zeros(B, H, L, D)
        self.values = value_states.new_zeros(B, value_states.shape[1], L, value_states.shape[-1])
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        columns = self.owner.columns
        self.keys.index_copy_(2, columns, key_states)
        self.values.index_copy_(2, columns, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int, *args, **kwargs) -> tuple[int, int]:
        return self.owner.max_cache_len, 0

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.owner.write

    def get_max_length(self) -> int:
        return self.owner.max_cache_len


class _ColumnCache(Cache):
    def __init__(self, num_layers: int, max_cache_len: int):
        self.max_cache_len = max_cache_len
        self.write = 0  # host int: the first column of the chunk being written
        self.columns: torch.Tensor | None = None  # [T] device int64: the columns being written
        super().__init__(layers=[_ColumnLayer(self) for _ in range(num_layers)])


class StaticModelRunner:
    def __init__(self, model: PreTrainedModel, vocab_size: int | None = None, max_cache_len: int = 1024,
                 checks: bool = False, compile: bool = False):
        """`checks` turns on the assertions that need a host synchronisation (tests);
        `compile` runs the model through torch.compile (static shapes per (B, T))."""
        impl = getattr(model.config, "_attn_implementation", "sdpa") or "sdpa"
        if impl not in ("sdpa", "eager"):
            raise ValueError(f"StaticModelRunner passes a 4D mask; attention implementation {impl!r} is not supported")
        self.model = model
        self.device = next(model.parameters()).device
        self.vocab_size = vocab_size or output_vocab_size(model)
        self.num_embeddings = model.get_input_embeddings().num_embeddings
        self.max_cache_len = max_cache_len
        self.checks = checks
        self._additive_mask = impl == "eager"
        self._dtype = next(model.parameters()).dtype
        self.cache = _ColumnCache(model.config.num_hidden_layers, max_cache_len)
        self.valid = torch.zeros(0, max_cache_len, dtype=torch.bool, device=self.device)  # [B, L_max]
        self.lengths = torch.zeros(0, dtype=torch.int64, device=self.device)  # [B]
        self._model_call = torch.compile(model, dynamic=False) if compile else model
        # The write column on the device, and per-width column tensors: a step reads only
        # these (updated in place), never a host int, so it can be captured (CudaGraphStep).
        self._w = torch.zeros((), dtype=torch.int64, device=self.device)
        self._all_columns = torch.arange(max_cache_len, device=self.device)
        self._columns: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # T -> (arange(T), columns being written)

    @property
    def num_rows(self) -> int:
        return self.valid.shape[0]

    @property
    def write(self) -> int:
        """Columns [0, write) have been written; the next chunk starts here."""
        return self.cache.write

    @torch.inference_mode()
    def forward(self, chunks: torch.Tensor, chunk_valid: torch.Tensor, num_logits: torch.Tensor,
                max_logits: int | None = None) -> torch.Tensor:
        """As ModelRunner.forward. `max_logits` = max(num_logits) when the caller knows it on
        the host (saves a synchronisation); otherwise it is read from the device."""
        B, T = chunks.shape
        assert B == self.num_rows and chunk_valid.shape == (B, T) and num_logits.shape == (B,)
        self._make_room(T)
        n = max_logits if max_logits is not None else int(num_logits.max())
        keep = T if T <= SMALL_CHUNK else n  # logits computed; >= n
        self._w.fill_(self.cache.write)
        logits = self._device_step(chunks, chunk_valid, num_logits, n, keep)
        self.cache.write += T
        return logits

    def _make_room(self, T: int) -> None:
        if self.cache.write + T > self.max_cache_len:
            self._compact()
            if self.cache.write + T > self.max_cache_len:
                raise ValueError(f"a chunk of {T} tokens does not fit: {self.cache.write} of {self.max_cache_len} columns hold kept tokens")

    def _device_step(self, chunks, chunk_valid, num_logits, n: int, keep: int) -> torch.Tensor:
        """The step itself: device tensors in, device tensors out, runner state updated in
        place, no host synchronisation and nothing read from the host but shapes."""
        B, T = chunks.shape
        if T not in self._columns:
            self._columns[T] = (torch.arange(T, device=self.device), torch.zeros(T, dtype=torch.int64, device=self.device))
        offsets, cols = self._columns[T]
        torch.add(offsets, self._w, out=cols)  # [T] the columns written: w .. w + T - 1
        positions = (self.lengths[:, None] + chunk_valid.cumsum(dim=1) - 1).clamp(min=0)  # [B, T]
        chunks = chunks.masked_fill(chunks >= self.num_embeddings, 0)
        self.valid.scatter_(1, cols[None, :].expand(B, T), chunk_valid)
        self.cache.columns = cols
        out = self._model_call(
            input_ids=chunks,
            attention_mask=self._mask(cols),
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=keep,
        )
        self.lengths.add_(chunk_valid.sum(dim=1))
        logits = out.logits[:, -keep:, : self.vocab_size].float()  # [B, keep, V]
        shift = (keep - num_logits)[:, None] + torch.arange(n, device=self.device)  # [B, n]
        return logits.gather(1, shift.clamp(0, keep - 1)[..., None].expand(-1, -1, logits.shape[-1]))

    def _mask(self, cols: torch.Tensor) -> torch.Tensor:
        """[B, 1, T, L_max]: query t (column cols[t]) sees valid columns <= cols[t], and always itself."""
        all_cols, q = self._all_columns[None, None, :], cols[None, :, None]  # [1, 1, L], [1, T, 1]
        allowed = (self.valid[:, None, :] & (all_cols <= q)) | (all_cols == q)
        allowed = allowed[:, None]  # [B, 1, T, L]
        if self._additive_mask:
            return torch.zeros(allowed.shape, dtype=self._dtype, device=self.device).masked_fill_(
                ~allowed, torch.finfo(self._dtype).min)
        return allowed

    @torch.inference_mode()
    def rollback(self, lengths: torch.Tensor) -> None:
        """Keep only each row's first `lengths[b]` cached tokens (a mask update, no sync)."""
        assert lengths.shape == self.lengths.shape
        if self.checks:
            assert bool((lengths <= self.lengths).all()), "rollback cannot grow a row"
        self.valid &= self.valid.cumsum(dim=1) <= lengths[:, None]  # in place: buffers never move here
        self.lengths.copy_(lengths)

    @torch.inference_mode()
    def select(self, rows: Sequence[int]) -> None:
        """Keep the given rows, in the given order."""
        index = torch.as_tensor(list(rows), dtype=torch.int64, device=self.device)
        self.valid, self.lengths = self.valid[index], self.lengths[index]
        for layer in self._layers():
            layer.keys, layer.values = layer.keys[index], layer.values[index]
        if not len(rows):
            self.cache.write = 0

    @torch.inference_mode()
    def add_rows(self, n: int) -> None:
        """Append n empty rows at the end of the batch."""
        self.valid = torch.cat([self.valid, self.valid.new_zeros(n, self.max_cache_len)])
        self.lengths = torch.cat([self.lengths, self.lengths.new_zeros(n)])
        for layer in self._layers():
            layer.keys = torch.cat([layer.keys, layer.keys.new_zeros(n, *layer.keys.shape[1:])])
            layer.values = torch.cat([layer.values, layer.values.new_zeros(n, *layer.values.shape[1:])])

    @torch.inference_mode()
    def merge(self, other) -> None:
        """Append the rows of `other` (same model): a StaticModelRunner or a ModelRunner.

        Both sides' written columns are aligned to end at the same column
        W = max(self.write, other's width); unwritten columns are invalid, so shifting a
        side right only moves holes to its front."""
        if isinstance(other, StaticModelRunner):
            W_o, o_valid = other.write, other.valid[:, : other.write]
            o_layers = [(l.keys[:, :, : other.write], l.values[:, :, : other.write]) for l in other._layers()]
        else:  # ModelRunner: DynamicCache layers [B', H, W', D], right-aligned
            W_o, o_valid = other.valid.shape[1], other.valid
            o_layers = [(l.keys, l.values) for l in other._layers()]
        W = max(self.write, W_o)
        if W > self.max_cache_len:
            self._compact()
            W = max(self.write, W_o)
            if W > self.max_cache_len:
                raise ValueError(f"merged rows need {W} columns, the cache has {self.max_cache_len}")
        shift = W - self.write
        if shift:
            self.valid = self.valid.roll(shift, dims=1)
            for layer in self._layers():
                layer.keys, layer.values = layer.keys.roll(shift, dims=2), layer.values.roll(shift, dims=2)
        n_o, L = o_valid.shape[0], self.max_cache_len
        placed_valid = o_valid.new_zeros(n_o, L)
        placed_valid[:, W - W_o : W] = o_valid
        mine = self._layers()
        if o_layers and not mine:  # nothing written here yet: take the other's layer shapes
            for layer, (k, v) in zip(self.cache.layers, o_layers):
                layer.lazy_initialization(k.new_zeros(self.num_rows, *k.shape[1:]), v.new_zeros(self.num_rows, *v.shape[1:]))
            mine = self._layers()
        for layer, (k, v) in zip(mine, o_layers):
            pk = k.new_zeros(n_o, k.shape[1], L, k.shape[3])
            pv = v.new_zeros(n_o, v.shape[1], L, v.shape[3])
            pk[:, :, W - W_o : W], pv[:, :, W - W_o : W] = k, v
            layer.keys, layer.values = torch.cat([layer.keys, pk]), torch.cat([layer.values, pv])
        if mine and not o_layers:  # the other side never ran a forward: empty rows
            for layer in mine:
                layer.keys = torch.cat([layer.keys, layer.keys.new_zeros(n_o, *layer.keys.shape[1:])])
                layer.values = torch.cat([layer.values, layer.values.new_zeros(n_o, *layer.values.shape[1:])])
        self.valid = torch.cat([self.valid, placed_valid])
        self.lengths = torch.cat([self.lengths, other.lengths.to(self.lengths.dtype)])
        self.cache.write = W

    def _layers(self) -> list[_ColumnLayer]:
        return [layer for layer in self.cache.layers if layer.is_initialized]

    def _compact(self) -> None:
        """Right-align each row's kept tokens into columns [0, width), width = max(lengths).
        Synchronises (reads the width); runs only when the buffer is full."""
        keep, counts, L = self.valid, self.lengths, self.max_cache_len
        width = int(counts.max()) if counts.numel() else 0
        index = keep.to(torch.int8).sort(dim=1, stable=True).indices[:, L - width :]  # [B, width] kept columns in order
        for layer in self._layers():
            for buf in (layer.keys, layer.values):  # in place: captured graphs stay valid
                gather = index[:, None, :, None].expand(-1, buf.shape[1], -1, buf.shape[3])
                kept = buf.gather(2, gather)
                buf.zero_()
                buf[:, :, :width] = kept
        cols = self._all_columns
        self.valid.copy_((cols[None, :] < width) & (cols[None, :] >= (width - counts)[:, None]))
        self.cache.write = width


class CudaGraphStep:
    """One StaticModelRunner forward of fixed (B, T, max_logits) captured as a CUDA graph.

    Call it like `runner.forward(chunks, chunk_valid, num_logits)`: the inputs are copied
    into static tensors, the write column into the runner's device scalar, the graph is
    replayed, and the logits are returned (a copy). Valid while the runner's buffers stay
    where they were at capture: `rollback` and compaction work in place; `select`,
    `add_rows` and `merge` move them, after which a new capture is needed (they happen when
    rows finish or join, not per token). CUDA only.
    """

    def __init__(self, runner: StaticModelRunner, width: int, max_logits: int, warmup: int = 2):
        if runner.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        if not runner._layers():
            raise ValueError("run one forward (the prefill) before capturing a step")
        B, dev = runner.num_rows, runner.device
        self.runner, self.T, self.n = runner, width, max_logits
        self.keep = width if width <= SMALL_CHUNK else max_logits
        self.ids = torch.zeros(B, width, dtype=torch.int64, device=dev)
        self.chunk_valid = torch.ones(B, width, dtype=torch.bool, device=dev)
        self.num = torch.full((B,), max_logits, dtype=torch.int64, device=dev)
        runner._make_room(width)
        self._pointers = self._buffer_pointers()
        with torch.inference_mode():
            saved = runner.valid.clone(), runner.lengths.clone()
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):  # warm-up (allocator, cuBLAS handles) outside the graph
                for _ in range(warmup):
                    runner._w.fill_(runner.cache.write)
                    runner._device_step(self.ids, self.chunk_valid, self.num, self.n, self.keep)
                    runner.valid.copy_(saved[0])
                    runner.lengths.copy_(saved[1])
            torch.cuda.current_stream(dev).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = runner._device_step(self.ids, self.chunk_valid, self.num, self.n, self.keep)
            runner.valid.copy_(saved[0])  # capture ran no kernels, but be explicit
            runner.lengths.copy_(saved[1])

    def _buffer_pointers(self) -> list[int]:
        r = self.runner
        return [r.valid.data_ptr(), r.lengths.data_ptr()] + [t.data_ptr() for l in r._layers() for t in (l.keys, l.values)]

    @torch.inference_mode()
    def __call__(self, chunks: torch.Tensor, chunk_valid: torch.Tensor, num_logits: torch.Tensor) -> torch.Tensor:
        r = self.runner
        assert chunks.shape == self.ids.shape, (chunks.shape, self.ids.shape)
        r._make_room(self.T)  # a compaction, if any, is in place
        if self._buffer_pointers() != self._pointers:
            raise RuntimeError("the runner's buffers moved (select / add_rows / merge): capture a new step")
        self.ids.copy_(chunks)
        self.chunk_valid.copy_(chunk_valid)
        self.num.copy_(num_logits)
        r._w.fill_(r.cache.write)
        self.graph.replay()
        r.cache.write += self.T
        return self.out.clone()
