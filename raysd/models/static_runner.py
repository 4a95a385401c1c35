"""A runner over preallocated key/value buffers with one slot per row: the fast path's cache.

Same interface as `raysd.models.dynamic_runner.DynamicRunner` (rows, ragged right-aligned chunks,
`rollback`, `select`, `add_rows`, `add_prefilled`), but laid out as gpt-fast's static
cache, with a batch:

* keys and values live in buffers [S, H, L, D] per layer: row b is slot b, and its
  cached tokens sit at columns [0, lengths[b]), position p at column p. A chunk's real
  tokens are written in place at columns lengths[b] + t (one `scatter_` per layer);
  the chunk's padding writes to the last column, which no query ever reads.
* `rollback` moves each row's length: nothing is masked, copied or read back. The
  columns past a row's length hold stale keys that the next chunk overwrites, and that
  no query attends to (query at position p sees columns <= p).
* `select` copies only the rows that change slots; `add_rows` starts rows at length 0
  in the next free slots; `add_prefilled` runs a prompt forward over the new slots only.
  No other row is re-packed.
* the model gets a ready 4D mask [B, 1, T, W] over the first W columns, W the host's
  upper bound on the longest row rounded up to `width_bucket`, so a decode step has a
  fixed shape for many steps. Buffers grow (by doubling) only when a row would not fit.

Nothing in `forward` or `rollback` reads a device value on the host when the caller
passes `max_logits` (and, to keep W tight, `max_length` to `rollback`). For decoder
models whose attention takes a 4D mask and a Cache (Llama, Qwen2, Mistral, SmolLM2:
`supports_static`); other architectures keep DynamicRunner (`raysd.models.runner`).
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from raysd.models.attention import packed_gqa
from raysd.models.compat import cache_keyword
from raysd.models.cuda_graphs import GraphCounts, GraphedSteps, buffer_pointers
from raysd.models.dynamic_runner import right_aligned
from raysd.models.linear import linear_kernels, use_packed
from raysd.models.loading import output_vocab_size

if TYPE_CHECKING:  # annotations only: a process that only coordinates never imports the modeling stack
    from transformers import PreTrainedModel

SMALL_CHUNK = 16  # chunks up to this wide keep all their logits (verification: K + 1, drafting: 1)
# Compiled graphs kept per model code, all models of a process together (dynamo's default is 8): with
# symbolic shapes a model recompiles for T = 1 against T > 1, B = 1 against B > 1 and B against the
# slots' count (6 in tests/models/test_static_runner.py), and a target and its draft share the code.
COMPILES = 32
# What one more prefill forward costs, in prompt tokens: on a CPU, the embedded SmolLM2's one-token
# forward costs about as much as 32 more prompt tokens in a forward (docs/history/notes.md). (On a
# GPU the ratio is larger: splitting a prefill there costs a few extra weight reads at admission,
# nothing per step.)
PREFILL_CALL_TOKENS = 32
STATIC_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral"})  # tested: tests/models/test_static_runner.py


def supports_static(model: PreTrainedModel) -> bool:
    """Whether StaticRunner can run this model: an architecture whose attention reads
    keys/values from `Cache.update` and takes a 4D mask, with sdpa or eager attention."""
    impl = getattr(model.config, "_attn_implementation", "sdpa") or "sdpa"
    return model.config.model_type in STATIC_MODEL_TYPES and impl in ("sdpa", "eager")


def prefill_groups(lengths: Sequence[int], call_tokens: int = PREFILL_CALL_TOKENS) -> list[tuple[int, int]]:
    """Split rows 0..n-1 into runs [lo, hi) prefilled one forward each, minimising the padded
    tokens computed plus `call_tokens` per forward: a run costs call_tokens + (hi - lo) x its
    longest prompt (dynamic programming over the O(n^2) runs; n is at most the batch size).
    One forward for prompts of similar lengths; a 769-token prompt beside a 53-token one goes alone."""
    n = len(lengths)
    best, cut = [0] + [float("inf")] * n, [0] * (n + 1)  # best[i]: cost of rows < i; cut[i]: its last run's start
    for hi in range(1, n + 1):
        longest = 0
        for lo in range(hi - 1, -1, -1):
            longest = max(longest, lengths[lo])
            cost = best[lo] + call_tokens + (hi - lo) * longest
            if cost < best[hi]:
                best[hi], cut[hi] = cost, lo
    runs, hi = [], n
    while hi > 0:
        runs.append((cut[hi], hi))
        hi = cut[hi]
    return runs[::-1]


class _SlotLayer(CacheLayerMixin):
    """One layer's keys/values [S, H, L, D]; writes each chunk at the rows' own columns."""

    is_compileable = True

    def __init__(self, owner: "_SlotCache"):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        S, L = self.owner.capacity
        self.keys = key_states.new_zeros(S, key_states.shape[1], L, key_states.shape[-1])
        self.values = value_states.new_zeros(S, value_states.shape[1], L, value_states.shape[-1])
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        o = self.owner
        keys, values = self.keys[o.rows], self.values[o.rows]  # views [B, H, L, D] of the slots in use
        index = o.write_columns[:, None, :, None]  # [B, 1, T, 1]
        keys.scatter_(2, index.expand(-1, keys.shape[1], -1, keys.shape[3]), key_states)
        values.scatter_(2, index.expand(-1, values.shape[1], -1, values.shape[3]), value_states)
        return keys[:, :, : o.width], values[:, :, : o.width]

    def get_mask_sizes(self, query_length: int, *args, **kwargs) -> tuple[int, int]:
        return self.owner.width, 0

    def get_seq_length(self, *args, **kwargs) -> int:
        return 0  # positions come from position_ids; the mask is given ready

    def get_max_length(self) -> int:
        return self.owner.capacity[1]


class _SlotCache(Cache):
    """What the layers read during a forward: which slots, which columns to write, how wide to attend.
    Attribute names avoid Cache's own (e.g. `max_cache_len` is a read-only property in transformers 5.17)."""

    def __init__(self, num_layers: int, capacity: tuple[int, int]):
        self.capacity = capacity  # (slots S, columns L) of every layer's buffers
        self.rows = slice(0, 0)  # the slots this forward runs on
        self.write_columns: torch.Tensor | None = None  # [B, T] column of each chunk token
        self.width = 0  # columns attended: [0, width)
        super().__init__(layers=[_SlotLayer(self) for _ in range(num_layers)])


class StaticRunner:
    def __init__(self, model: PreTrainedModel, vocab_size: int | None = None, max_cache_len: int = 256,
                 checks: bool = False, compile: bool = False, width_bucket: int = 64, linear_kernels: str = "auto",
                 cuda_graphs: bool = False):
        """`max_cache_len`: initial columns per row (buffers double when a row needs more);
        `checks` turns on the assertions that need a host synchronisation (tests);
        `compile` runs the steps (chunks of up to SMALL_CHUNK tokens per row: decode, verify, draft) through
        torch.compile with symbolic shapes: the attended width never recompiles, the chunk width and the rows
        only where they cross 1 and the rows where they reach the slots' count (`COMPILES`); prefills run eager. With `cuda_graphs`, the
        compiled kernels are what each graph captures (Inductor's fusions, then no launches);
        `linear_kernels`: raysd.models.linear's prepacked CPU kernels ("auto": float32 on a CPU, where measured faster);
        `cuda_graphs` replays the forwards of up to SMALL_CHUNK tokens per row (decode, verify, draft)
        as CUDA graphs captured per shape (raysd.models.cuda_graphs). CUDA only."""
        if not supports_static(model):
            impl = getattr(model.config, "_attn_implementation", None)
            raise ValueError(f"StaticRunner supports {sorted(STATIC_MODEL_TYPES)} with sdpa/eager attention, "
                             f"not {model.config.model_type!r} with {impl!r}; use DynamicRunner")
        assert max_cache_len >= 2 and width_bucket >= 1
        self.model = model
        self.device = next(model.parameters()).device
        self.vocab_size = vocab_size or output_vocab_size(model)
        self.num_embeddings = model.get_input_embeddings().num_embeddings
        self.checks = checks
        self.width_bucket = width_bucket
        self._additive_mask = model.config._attn_implementation == "eager"
        self._dtype = next(model.parameters()).dtype
        self.cache = _SlotCache(model.config.num_hidden_layers, (0, max_cache_len))
        self._lengths = torch.zeros(0, dtype=torch.int64, device=self.device)  # [S] cached tokens per slot
        self._num_rows = 0
        self._bound = 0  # host upper bound on max(lengths)
        self._compiled = torch.compile(model, dynamic=True) if compile else None
        self._packed = None if compile else use_packed(model, linear_kernels)  # Inductor packs its own
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs needs a model on a CUDA device, not {self.device}")
        if cuda_graphs and checks:
            raise ValueError("cuda_graphs replays captured kernels: not with checks")
        self.counts = GraphCounts()
        self._kind = "step"  # what `_run`'s forwards are counted as: "step", "prefill", or "graph" (captured)
        self._read = None  # (weight bytes, bytes of one column of one slot over every layer): `_bytes`
        self.graphs = GraphedSteps(self, cuda_graph_capture, pool=torch.cuda.graph_pool_handle()) if cuda_graphs else None

    @property
    def num_rows(self) -> int:
        return self._num_rows

    @property
    def lengths(self) -> torch.Tensor:
        """[B] cached tokens per row (a view of the slots' lengths)."""
        return self._lengths[: self._num_rows]

    @property
    def max_cache_len(self) -> int:
        return self.cache.capacity[1] - 1  # the last column takes the padding's writes

    @torch.inference_mode()
    def forward(self, chunks: torch.Tensor, chunk_valid: torch.Tensor, num_logits: torch.Tensor,
                max_logits: int | None = None) -> torch.Tensor:
        """As DynamicRunner.forward. `max_logits` = max(num_logits) when the caller knows it on
        the host (saves a synchronisation); otherwise it is read from the device. A chunk of up to
        SMALL_CHUNK tokens per row is a step: a program (`run`), replayed from a graph when the
        runner has them."""
        assert chunks.shape[0] == self.num_rows
        n = max_logits if max_logits is not None else int(num_logits.max())
        T = chunks.shape[1]
        if T > SMALL_CHUNK or not self.num_rows:
            return self._forward(slice(0, self.num_rows), chunks, chunk_valid, num_logits, n)
        replays = self.counts.replays
        logits, = self.run(("forward", T, n), functools.partial(self.step_slots, n=n), (chunks, chunk_valid, num_logits), T)
        return logits.clone() if self.counts.replays > replays else logits  # a graph's output is overwritten by its next replay

    @torch.inference_mode()
    def run(self, program: tuple, fn: Callable, inputs: Sequence[torch.Tensor], advance: int, forwards: int = 1) -> tuple:
        """`fn(attend, *inputs)`, a program over the slots 0 .. B - 1 (B = the inputs' rows = the
        runner's rows; raysd.models.cuda_graphs) of `forwards` model forwards that adds at most
        `advance` tokens to any row: replayed from a graph keyed by `program` when the runner has
        graphs, else run eagerly at the attended width the rows need. Returns its outputs (for the B rows)."""
        assert inputs[0].shape[0] == self.num_rows
        self._reserve(self._bound + advance)
        if self.graphs is not None:
            outputs = self.graphs.run(program, fn, inputs, advance, forwards)
            if outputs is not None:
                return outputs
        outputs = fn(self._attended(self._bound + advance), *inputs)
        self._bound += advance
        return outputs

    def feed_only(self, chunks: torch.Tensor, chunk_valid: torch.Tensor) -> None:
        """Append each row's valid chunk tokens (right-aligned, up to SMALL_CHUNK per row) to its
        cache, with no logits kept: a program (`run`), replayed from a graph when the runner has them."""
        assert chunks.shape[1] <= SMALL_CHUNK
        ones = torch.ones(chunks.shape[0], dtype=torch.int64, device=self.device)
        self.run(*self.feed_program(chunks.shape[1]), (chunks, chunk_valid, ones), chunks.shape[1])

    def feed_program(self, T: int) -> tuple[tuple, Callable]:
        """The key and function of `feed_only`'s program for chunks of T tokens per row; its inputs are
        the chunk [R, T], its validity [R, T] and ones [R]."""
        return ("feed", T), self._feed_slots

    def _feed_slots(self, attend: int, chunks, chunk_valid, ones) -> tuple:
        self.step_slots(attend, chunks, chunk_valid, ones, 1, keep=1)
        return ()

    def step_slots(self, attend: int, chunks: torch.Tensor, chunk_valid: torch.Tensor, num_logits: torch.Tensor,
                   n: int, keep: int | None = None) -> tuple[torch.Tensor]:
        """One forward over the slots 0 .. R - 1 (R = the chunks' rows), device tensors only: the
        chunk's tokens written after each slot's length, which grows by its valid tokens. Returns
        ([R, n, V] logits,) as `forward`; `keep` (>= n): positions the model computes logits at, the
        chunk's last (all of a small chunk by default; 1 when every row wants only its last).
        The program of a forward, and a part of larger programs."""
        rows = slice(0, chunks.shape[0])
        lengths = self._lengths[rows]  # [R] view
        T = chunks.shape[1]
        keep = keep or (T if T <= SMALL_CHUNK else n)
        logits = self._device_step(rows, lengths, chunks, chunk_valid, num_logits, n, keep, attend)
        lengths.add_(chunk_valid.sum(dim=1))
        return (logits,)

    @contextlib.contextmanager
    def counted_as(self, kind: str) -> Iterator[None]:
        """Count the forwards `_run` makes inside the block as `kind`: "step" (eager forwards of
        steps), "prefill", or "graph" (a capture's or a stand-in replay's, not counted)."""
        before, self._kind = self._kind, kind
        try:
            yield
        finally:
            self._kind = before

    @torch.inference_mode()
    def forward_rows(self, rows: slice, chunks: torch.Tensor, chunk_valid: torch.Tensor, num_logits: torch.Tensor,
                     max_logits: int) -> torch.Tensor:
        """As `forward`, on the contiguous rows `rows` only; the other rows keep their caches and
        lengths. A caller feeding a few rows many tokens (an EAGLE draft catching up on a new
        row's prompt) need not pad every row to them. The attended width grows by the chunk's
        width, an upper bound: `rollback` with the host's max length tightens it again."""
        assert 0 <= rows.start < rows.stop <= self.num_rows and chunks.shape[0] == rows.stop - rows.start
        return self._forward(rows, chunks, chunk_valid, num_logits, max_logits)

    def _forward(self, rows: slice, chunks, chunk_valid, num_logits, n: int) -> torch.Tensor:
        B, T = chunks.shape
        assert chunk_valid.shape == (B, T) and num_logits.shape == (B,) and rows.stop - rows.start == B
        self._reserve(self._bound + T)
        self._bound += T
        width = self._attended(self._bound)
        lengths = self._lengths[rows]  # [B] view
        keep = T if T <= SMALL_CHUNK else n  # logits computed; >= n
        logits = self._device_step(rows, lengths, chunks, chunk_valid, num_logits, n, keep, width)
        lengths.add_(chunk_valid.sum(dim=1))
        return logits

    def _device_step(self, rows: slice, lengths, chunks, chunk_valid, num_logits, n: int, keep: int, width: int):
        """The step itself: device tensors in, device tensors out, no host synchronisation."""
        positions = lengths[:, None] + chunk_valid.cumsum(dim=1) - 1  # [B, T]
        write = torch.where(chunk_valid, positions, self.max_cache_len)  # [B, T]; padding writes to the last column
        cols = torch.arange(width, device=self.device)[None, None, :]  # [1, 1, W]
        # A real token at position p sees columns <= p (its row's cache, then the chunk's
        # earlier tokens); padding sees column 0 only, so no attention row is empty.
        allowed = torch.where(chunk_valid[..., None], cols <= positions[..., None], cols == 0)  # [B, T, W]
        logits = self._run(rows, chunks, positions, write, allowed, keep, width)  # [B, keep, V]
        shift = (keep - num_logits)[:, None] + torch.arange(n, device=self.device)  # [B, n]
        return logits.gather(1, shift.clamp(0, keep - 1)[..., None].expand(-1, -1, logits.shape[-1]))

    def _run(self, rows: slice, chunks, positions, write, allowed, keep: int, width: int) -> torch.Tensor:
        """One model call: chunk tokens at RoPE `positions`, written at cache columns `write`,
        query t attending the columns `allowed[:, t]` ([B, T, W]); logits of the last `keep`."""
        self._count(chunks.shape[0], width)
        cache = self.cache
        cache.rows, cache.width, cache.write_columns = rows, width, write
        chunks = chunks.masked_fill(chunks >= self.num_embeddings, 0)
        # K + 1 query tokens without copying the cache per key/value group, and without re-packing
        # each weight per product on a CPU
        with packed_gqa(self.model), linear_kernels(self.model, self._packed):
            # steps only: a prompt's forward runs once per row, and its widths would each compile
            compiled = self._compiled is not None and chunks.shape[1] <= SMALL_CHUNK and self._kind != "prefill"
            call = self._compiled if compiled else self.model
            with self._compiles() if compiled else contextlib.nullcontext():
                out = call(
                    input_ids=chunks,
                    attention_mask=self._mask(allowed[:, None]),
                    position_ids=positions.clamp(min=0),
                    **{cache_keyword(self.model): cache},
                    use_cache=True,
                    logits_to_keep=keep,
                )
        return out.logits[:, -keep:, : self.vocab_size].float()  # [B, keep, V]

    @torch.inference_mode()
    def forward_tree(self, tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
                     start: int = 0) -> torch.Tensor:
        """Append a tree of candidate tokens to every row and return the logits at every node.

        Args:
            tokens: [B, T] token ids of nodes start .. start + T - 1; node t of row b is tokens[b, t - start].
            parents: [B, start + T] int64 tree-local parent of every node so far (-1: the row's last
                cached token), parents[b, t] < t.
            num_nodes: [B] real nodes among the T (a prefix of them).
            start: nodes of this tree already written by earlier calls (a tree drafted level by
                level): the new nodes attend to their ancestors among them.
        Returns:
            [B, T, V] float32: logits after each new node's path (context, ancestors, the node).

        Node t sits at RoPE position length + depth(t) - 1 and is written at column length + t,
        so siblings never share a column. The rows' lengths do not move: `keep_path` then keeps
        one root-to-node path (the accepted branch) and drops the rest, per row.
        """
        from raysd.core.tree import tree_attention_mask, tree_depths

        B, T = tokens.shape
        N = start + T
        assert parents.shape == (B, N) and num_nodes.shape == (B,) and B == self.num_rows
        self._reserve(self._bound + T)
        width = self._attended(self._bound + T)
        lengths = self.lengths  # [B]
        valid = torch.arange(T, device=self.device)[None, :] < num_nodes[:, None]  # [B, T]
        positions = lengths[:, None] + tree_depths(parents)[:, start:] - 1  # [B, T]
        columns = lengths[:, None] + torch.arange(start, N, device=self.device)  # [B, T]
        write = torch.where(valid, columns, self.max_cache_len)  # [B, T]
        cols = torch.arange(width, device=self.device)[None, None, :]  # [1, 1, W]
        rel = cols - lengths[:, None, None]  # [B, 1, W] column -> node index
        ancestors = tree_attention_mask(parents)[:, start:]  # [B, T, N]
        in_tree = (rel >= 0) & (rel < N) & ancestors.gather(2, rel.clamp(0, N - 1).expand(B, T, width))  # [B, T, W]
        allowed = torch.where(valid[..., None], (rel < 0) | in_tree, cols == 0)  # [B, T, W]
        logits = self._run(slice(0, B), tokens, positions, write, allowed, T, width)
        self._bound += T
        return logits

    @torch.inference_mode()
    def keep_path(self, nodes: torch.Tensor, counts: torch.Tensor, max_length: int | None = None) -> None:
        """After `forward_tree`: keep each row's accepted branch. nodes [B, D] chunk-local node
        indices along the path (increasing), counts [B] how many are kept; the branch's
        keys/values move to the columns right after the row's length, which grows by counts.
        Only these columns of these rows are copied."""
        B, D = nodes.shape
        assert counts.shape == (B,) and B == self.num_rows
        if D == 0:
            if max_length is not None:
                self._bound = max_length
            return
        lengths = self.lengths
        j = torch.arange(D, device=self.device)[None, :]  # [1, D]
        keep = j < counts[:, None]  # [B, D]
        src = (lengths[:, None] + nodes.clamp(min=0)).clamp(max=self.max_cache_len)  # [B, D]
        dst = torch.where(keep, lengths[:, None] + j, self.max_cache_len)  # [B, D]
        for layer in self._layers():
            for buf in (layer.keys, layer.values):
                view = buf[: self.num_rows]  # [B, H, L, Dh]
                idx = lambda c: c[:, None, :, None].expand(-1, view.shape[1], -1, view.shape[3])  # noqa: E731
                moved = view.gather(2, idx(src))  # gather every source before any write
                view.scatter_(2, idx(dst), moved)
        lengths.add_(counts)
        if max_length is not None:
            self._bound = max_length

    @contextlib.contextmanager
    def _compiles(self) -> Iterator[None]:
        """A call of the compiled model, within the recompile limit, counting the graphs torch.compile
        makes in it (dynamo's unique graphs) and the call's seconds when it made one."""
        from torch._dynamo.utils import counters

        before, t0 = counters["stats"]["unique_graphs"], time.perf_counter()
        with torch._dynamo.config.patch(recompile_limit=COMPILES):
            yield
        made = counters["stats"]["unique_graphs"] - before
        if made:
            self.counts.compiles += made
            self.counts.compile_s += time.perf_counter() - t0

    def _count(self, rows: int, width: int) -> None:
        """One forward over `rows` slots attending `width` columns, counted by the kind of the
        moment (`counted_as`), a step's with the bytes it reads. A graph's replays are counted by GraphedSteps."""
        if self._kind == "prefill":
            self.counts.prefill_forwards += 1
        elif self._kind == "step":
            self.counts.eager_forwards += 1
            self.counts.bytes_read += self.bytes_per_forward(rows, width)

    def bytes_per_forward(self, rows: int, width: int) -> int:
        """What one forward over `rows` slots attending `width` columns reads at least: every weight
        (the input embedding only as the rows it looks up, unless it is also the output head), then the
        keys and values of every attended column of every slot, masked or not (padding rows and columns
        included: what a memory-bound step pays for them)."""
        if self._read is None:
            embed = self.model.get_input_embeddings().weight
            head = getattr(self.model.get_output_embeddings(), "weight", None)  # a method on a quantized head
            tied = isinstance(head, torch.Tensor) and head.data_ptr() == embed.data_ptr()
            weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
            if not tied:
                weights -= embed.numel() * embed.element_size()
            c = self.model.config
            kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
            head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
            self._read = (weights, 2 * c.num_hidden_layers * kv_heads * head_dim * self._dtype.itemsize)
        weights, column = self._read
        return weights + column * rows * width

    def _mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """The model's 4D mask from `allowed` [B, 1, T, W]: bool for sdpa, additive for eager."""
        if self._additive_mask:
            return torch.zeros(allowed.shape, dtype=self._dtype, device=self.device).masked_fill_(
                ~allowed, torch.finfo(self._dtype).min)
        return allowed

    @torch.inference_mode()
    def rollback(self, lengths: torch.Tensor, max_length: int | None = None) -> None:
        """Keep only each row's first `lengths[b]` cached tokens: the lengths move, nothing else.
        `max_length` (the host's max(lengths), if known) keeps the attended width tight."""
        assert lengths.shape == (self.num_rows,)
        if self.checks:
            assert bool((lengths <= self.lengths).all()), "rollback cannot grow a row"
            assert max_length is None or not lengths.numel() or int(lengths.max()) <= max_length
        self.lengths.copy_(lengths)
        if max_length is not None:
            self._bound = max_length

    @torch.inference_mode()
    def select(self, rows: Sequence[int]) -> None:
        """Keep the given rows, in the given order: row i moves to slot i. Only the rows whose
        slot changes are copied (a caller that fills holes with the last rows moves few)."""
        assert len(set(rows)) == len(rows), "select keeps distinct rows (gather copies)"
        self.gather(rows)

    @torch.inference_mode()
    def gather(self, rows: Sequence[int]) -> None:
        """Row i becomes a copy of row rows[i] (a row may be copied to several slots, as beam
        search's reordering does); the slots past len(rows) are dropped. Every source is read
        before any slot is written, and only the slots whose source is another row are copied,
        with the columns of a tree fed since (`forward_tree`), which `keep_path` then keeps."""
        rows = [int(r) for r in rows]
        assert all(0 <= r < self.num_rows for r in rows)
        moved = [(i, r) for i, r in enumerate(rows) if i != r]
        if moved:
            self._copy_rows(torch.tensor([r for _, r in moved], device=self.device),
                            torch.tensor([i for i, _ in moved], device=self.device))
        self._num_rows = len(rows)
        if not rows:
            self._bound = 0

    @torch.inference_mode()
    def fork(self, rows: Sequence[int]) -> None:
        """Append copies of the given rows (their cached keys, values and lengths) in the next
        slots: rows that share a prompt are prefilled once (CacheRows.add_rows)."""
        start = self.num_rows
        self.add_rows(len(rows))
        if rows:
            self._copy_rows(torch.tensor([int(r) for r in rows], device=self.device),
                            torch.arange(start, start + len(rows), device=self.device))

    def _copy_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Row dst[i] of every layer's keys and values (up to the longest row) and of the lengths
        becomes a copy of row src[i]."""
        used = min(self._bound, self.max_cache_len)
        for layer in self._layers():
            for buf in (layer.keys, layer.values):
                head = buf[:, :, :used]
                head.index_copy_(0, dst, head.index_select(0, src))
        self._lengths.index_copy_(0, dst, self._lengths.index_select(0, src))

    @torch.inference_mode()
    def add_rows(self, n: int) -> None:
        """Append n empty rows (length 0) in the next slots."""
        B = self.num_rows + n
        if B > self.cache.capacity[0]:
            self._grow(max(B, 2 * self.cache.capacity[0]), self.cache.capacity[1])
        self._lengths[self.num_rows : B] = 0
        self._num_rows = B

    @torch.inference_mode()
    def add_prefilled(self, prefixes: Sequence[Sequence[int]]) -> None:
        """Append len(prefixes) rows whose caches hold the given tokens: forwards over the new
        slots only (an empty prefix is an empty row), consecutive rows of similar lengths
        together (`prefill_groups`), so that a short prompt is not padded to a long one's length."""
        start = self.num_rows
        self.add_rows(len(prefixes))
        bound = self._bound
        self.prefill_calls = []  # the new rows each forward ran (runners.py)
        for lo, hi in prefill_groups([len(p) for p in prefixes]):
            ids, valid = right_aligned(prefixes[lo:hi], self.device)  # [n, W]
            width = ids.shape[1]
            if width == 0:
                continue
            self.prefill_calls.append(list(range(lo, hi)))
            ones = torch.ones(hi - lo, dtype=torch.int64, device=self.device)
            self._bound = 0  # the new rows start empty: attend W columns, not the old rows' bound + W
            with self.counted_as("prefill"):
                self._forward(slice(start + lo, start + hi), ids, valid, ones, 1)
            bound = max(bound, width)
        self._bound = bound  # the old rows did not grow

    def know_longest(self, max_length: int) -> None:
        """The rows' longest length, as the host knows it exactly (a caller that counted what it fed):
        the attended width follows it rather than an upper bound."""
        self._bound = max_length

    @torch.inference_mode()
    def reserve(self, slots: int, columns: int) -> None:
        """Buffers of at least `slots` slots, with room for rows of `columns` tokens, made now: growing
        them later drops every captured graph, so a job that captures its steps beforehand reserves
        what they will need first. Before any forward the buffers do not exist yet (their shapes come
        from the model's keys): one forward of one token over a free slot makes them."""
        S, L = self.cache.capacity
        if slots > S:
            self._grow(slots, L)
        self._reserve(columns)
        if not self._layers():
            n, bound = self._num_rows, self._bound
            if n == self.cache.capacity[0]:
                self._grow(n + 1, self.cache.capacity[1])
            one = torch.ones(1, 1, dtype=torch.int64, device=self.device)
            with self.counted_as("prefill"):
                self._forward(slice(n, n + 1), one, one.bool(), one[0], 1)
            self._lengths[n] = 0
            self._bound = bound

    def _attended(self, columns: int) -> int:
        """Columns a forward attends: `columns` rounded up to `width_bucket` (fewer shapes), within the buffer."""
        return min(-(-columns // self.width_bucket) * self.width_bucket, self.max_cache_len)

    def _reserve(self, columns: int) -> None:
        """Make room for rows of `columns` tokens (plus the padding column)."""
        if columns + 1 > self.cache.capacity[1]:
            L = self.cache.capacity[1]
            while L < columns + 1:
                L *= 2
            self._grow(self.cache.capacity[0], L)

    def _grow(self, slots: int, columns: int) -> None:
        """New buffers [slots, H, columns, D]; rows keep their slots and columns. Rare: doubling."""
        S_old, L_old = self.cache.capacity
        for layer in self._layers():
            for name in ("keys", "values"):
                old = getattr(layer, name)
                new = old.new_zeros(slots, old.shape[1], columns, old.shape[3])
                keep = min(L_old - 1, columns - 1)  # the old padding column is not worth copying
                new[:S_old, :, :keep] = old[:, :, :keep]
                setattr(layer, name, new)
        lengths = self._lengths.new_zeros(slots)
        lengths[:S_old] = self._lengths
        self._lengths = lengths
        self.cache.capacity = (slots, columns)

    def _layers(self) -> list[_SlotLayer]:
        return [layer for layer in self.cache.layers if layer.is_initialized]


def cuda_graph_capture(runner: StaticRunner, fn: Callable, inputs: Sequence[torch.Tensor], attend: int, pool) -> "CudaGraphProgram":
    """GraphedSteps' capture on CUDA."""
    return CudaGraphProgram(runner, fn, inputs, attend, pool=pool)


class CudaGraphProgram:
    """A program (raysd.models.cuda_graphs: `fn(attend, *inputs)`, device tensors over the slots
    0 .. R - 1, R the inputs' rows) captured as one CUDA graph. Calling it with inputs of the same
    shapes copies them into its static inputs, replays the graph and returns fn's outputs: its own
    static tensors, valid until it replays again. Valid while the runner's buffers stay where they
    were at capture and its rows fit in R: rollback, select and add_rows work in place; only buffer
    growth (doubling) moves them, after which a new capture is needed. CUDA only.

    Before capture, `fn` runs `warmup` times on a side stream (allocator, cuBLAS handles, and
    torch.compile's compiles under a compiled runner), each time on the inputs given: what it writes
    past the rows' lengths is overwritten before any query reads it, and the lengths are restored."""

    def __init__(self, runner: StaticRunner, fn: Callable, inputs: Sequence[torch.Tensor], attend: int, warmup: int = 2,
                 pool=None):
        if runner.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        if not runner._layers():
            raise ValueError("run one forward (the prefill) before capturing a step")
        R, dev = inputs[0].shape[0], runner.device
        if not 1 <= R <= runner.cache.capacity[0]:
            raise ValueError(f"a step over {R} rows needs 1 <= rows <= the {runner.cache.capacity[0]} slots")
        self.runner, self.rows, self.attend = runner, R, attend
        runner._reserve(attend)
        self.inputs = [t.clone() for t in inputs]
        self._pointers = buffer_pointers(runner)
        with torch.inference_mode(), runner.counted_as("graph"):
            runner._lengths[runner.num_rows : R] = 0  # free slots, whose stale lengths could put the warm-up's writes past the buffer
            saved = runner._lengths[:R].clone()
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):  # warm-up outside the graph
                for _ in range(warmup):
                    fn(attend, *self.inputs)
                    runner._lengths[:R].copy_(saved)
            torch.cuda.current_stream(dev).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):  # a pool shared by a runner's graphs (GraphedSteps)
                self.outputs = fn(attend, *self.inputs)
            runner._lengths[:R].copy_(saved)  # capture ran no kernels, but be explicit

    @torch.inference_mode()
    def __call__(self, *inputs: torch.Tensor) -> tuple:
        r = self.runner
        if r.num_rows > self.rows:
            raise RuntimeError(f"the runner has {r.num_rows} rows, the step was captured for {self.rows}: capture a new step")
        if buffer_pointers(r) != self._pointers:
            raise RuntimeError("the runner's buffers moved (they grew): capture a new step")
        for static, t in zip(self.inputs, inputs, strict=True):
            assert static.shape == t.shape and static.dtype == t.dtype, (static.shape, t.shape)
            static.copy_(t)
        self.graph.replay()
        return self.outputs


class CudaGraphStep:
    """One StaticRunner forward of fixed (B, T, max_logits, attended width) captured as a CUDA graph
    (a CudaGraphProgram of `StaticRunner.step_slots`), over the slots 0 .. B - 1 (`rows`: at least the
    runner's rows, within its slots; the runner's rows by default). Call it like
    `runner.forward(chunks, chunk_valid, num_logits)` with B rows (the runner's, then all-padding rows
    for its free slots); it returns a copy of the logits. It refuses to run once a row outgrows the
    attended width (`attend`, the buffer's columns by default). CUDA only."""

    def __init__(self, runner: StaticRunner, width: int, max_logits: int, attend: int | None = None, warmup: int = 2,
                 pool=None, rows: int | None = None):
        B, dev = rows or runner.num_rows, runner.device
        if not runner.num_rows <= B:
            raise ValueError(f"a step over {B} rows needs at least the runner's {runner.num_rows}")
        self.runner, self.T = runner, width
        attend = attend or runner.max_cache_len
        inputs = (torch.zeros(B, width, dtype=torch.int64, device=dev), torch.ones(B, width, dtype=torch.bool, device=dev),
                  torch.full((B,), max_logits, dtype=torch.int64, device=dev))
        self.program = CudaGraphProgram(runner, functools.partial(runner.step_slots, n=max_logits), inputs, attend, warmup, pool)
        self.attend = self.program.attend

    def __call__(self, chunks: torch.Tensor, chunk_valid: torch.Tensor, num_logits: torch.Tensor) -> torch.Tensor:
        r = self.runner
        if r._bound + self.T > self.attend:
            raise RuntimeError(f"rows outgrew the captured width {self.attend}: capture a wider step")
        logits, = self.program(chunks, chunk_valid, num_logits)
        r._bound += self.T
        return logits.clone()
