"""One Hugging Face causal LM with a batched KV cache whose rows hold different lengths.

Every row's cached tokens sit right-aligned in the cache, left-padded: column c of
the cache is column c of every row, so one `attention_mask` [B, L] and explicit
`position_ids` let an unmodified HF model run rows of different lengths side by
side. A step appends a chunk of columns; `rollback` drops each row's rejected tail
by masking it out (a hole: positions count valid tokens only, so the model computes
exactly what it would without it), and accepted tokens are never recomputed. Rows are
re-packed (a gather over the sequence axis) only when holes widen the cache by more
than `repack_fraction`, and whenever `select` drops finished rows; `add_rows` makes
room for new ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from raysd.core.device import host_to_device, padded_rows
from raysd.models.compat import cache_keyword
from raysd.models.linear import linear_kernels, use_packed
from raysd.models.loading import output_vocab_size

if TYPE_CHECKING:  # annotations only: a process that only coordinates never imports the modeling stack
    from transformers import PreTrainedModel


class DynamicRunner:
    def __init__(self, model: PreTrainedModel, vocab_size: int | None = None, repack_fraction: float = 0.25,
                 linear_kernels: str = "auto"):
        """repack_fraction: re-pack once holes make the cache wider than the longest row by this
        fraction (0: after every rollback). A re-pack copies every layer's cache, which on CPU
        cost more than half a decode step when done at every step; holes cost attention width.
        linear_kernels: raysd.models.linear's prepacked CPU kernels ("auto": float32 on a CPU, where measured faster)."""
        assert repack_fraction >= 0
        self.model = model
        self.linear_kernels = linear_kernels
        self._packed = use_packed(model, linear_kernels)
        self.repack_fraction = repack_fraction
        self.device = next(model.parameters()).device
        self.vocab_size = vocab_size or output_vocab_size(model)
        self.num_embeddings = model.get_input_embeddings().num_embeddings
        self.cache = DynamicCache()  # full-attention layers for every model; see max_model_len
        self.valid = torch.zeros(0, 0, dtype=torch.bool, device=self.device)  # [B, L] real tokens
        self.lengths = torch.zeros(0, dtype=torch.int64, device=self.device)  # [B] = valid.sum(1)

    @property
    def num_rows(self) -> int:
        return self.valid.shape[0]

    @torch.inference_mode()
    def forward(self, chunks: torch.Tensor, chunk_valid: torch.Tensor, num_logits: torch.Tensor,
                max_logits: int | None = None) -> torch.Tensor:
        """Append a chunk to every row and return the logits of each row's last tokens.

        Args:
            chunks: [B, T] token ids; each row's real tokens right-aligned (left padding).
            chunk_valid: [B, T] bool, True on real tokens.
            num_logits: [B] how many of each row's last real tokens need logits (>= 1).
            max_logits: max(num_logits), if the caller knows it on the host.
        Returns:
            [B, n, V] float32 with n = max(num_logits); row b's logits are left-aligned,
            entries past num_logits[b] are not meaningful.
        """
        B, T = chunks.shape
        assert B == self.num_rows and chunk_valid.shape == (B, T) and num_logits.shape == (B,)
        positions = (self.lengths[:, None] + chunk_valid.cumsum(dim=1) - 1).clamp(min=0)  # [B, T]
        # A draft with a narrower vocabulary cannot embed every target token; it reads a
        # stand-in instead, which can only cost acceptance, never exactness.
        chunks = chunks.masked_fill(chunks >= self.num_embeddings, 0)
        mask = torch.cat([self.valid, chunk_valid], dim=1)  # [B, L + T]
        n = max_logits if max_logits is not None else int(num_logits.max())
        with linear_kernels(self.model, self._packed):
            out = self.model(
                input_ids=chunks,
                attention_mask=mask.long(),
                position_ids=positions,
                **{cache_keyword(self.model): self.cache},
                use_cache=True,
                logits_to_keep=n,
            )
        self.valid = mask
        self.lengths = self.lengths + chunk_valid.sum(dim=1)
        logits = out.logits[:, -n:, : self.vocab_size].float()  # [B, n, V]
        if bool((num_logits != n).any()):
            shift = (n - num_logits)[:, None] + torch.arange(n, device=self.device)  # [B, n]
            logits = logits.gather(1, shift.clamp(max=n - 1)[..., None].expand(-1, -1, logits.shape[-1]))
        return logits

    def rollback(self, lengths: torch.Tensor, max_length: int | None = None) -> None:
        """Keep only each row's first `lengths[b]` cached tokens (`max_length`: unused here,
        see StaticRunner)."""
        assert lengths.shape == self.lengths.shape
        if bool((lengths == self.lengths).all()):
            return
        assert bool((lengths <= self.lengths).all()), "rollback cannot grow a row"
        keep = self.valid & (self.valid.cumsum(dim=1) <= lengths[:, None])  # [B, L]
        self.valid, self.lengths = keep, keep.sum(dim=1)
        self._trim()
        longest = int(self.lengths.max()) if self.num_rows else 0
        if self.repack_fraction == 0 or self.valid.shape[1] > longest * (1 + self.repack_fraction):
            self._pack(self.valid)

    def select(self, rows: Sequence[int]) -> None:
        """Keep the given rows, in the given order."""
        index = torch.as_tensor(list(rows), dtype=torch.int64, device=self.device)
        self.valid, self.lengths = self.valid[index], self.lengths[index]
        for layer in self._layers():
            layer.keys, layer.values = layer.keys[index], layer.values[index]
        self._pack(self.valid)

    def fork(self, rows: Sequence[int]) -> None:
        """Append copies of the given rows (their caches) at the end of the batch."""
        self.select(list(range(self.num_rows)) + [int(r) for r in rows])

    def add_rows(self, n: int) -> None:
        """Append n empty rows at the end of the batch."""
        L = self.valid.shape[1]
        self.valid = torch.cat([self.valid, self.valid.new_zeros(n, L)])
        self.lengths = torch.cat([self.lengths, self.lengths.new_zeros(n)])
        for layer in self._layers():
            _, H, _, D = layer.keys.shape
            layer.keys = torch.cat([layer.keys, layer.keys.new_zeros(n, H, L, D)])
            layer.values = torch.cat([layer.values, layer.values.new_zeros(n, H, L, layer.values.shape[-1])])

    def add_prefilled(self, prefixes: Sequence[Sequence[int]]) -> None:
        """Append len(prefixes) rows whose caches hold the given tokens. The prefixes are
        prefilled apart and merged in, so one long prompt does not widen the old rows'
        forward; an empty prefix is an empty row."""
        n_old = self.num_rows
        with_prefix = [i for i, p in enumerate(prefixes) if len(p)]
        fresh = DynamicRunner(self.model, self.vocab_size, self.repack_fraction, self.linear_kernels)
        self.prefill_calls = [with_prefix] if with_prefix else []  # the new rows each forward ran (runners.py)
        if with_prefix:
            fresh.add_rows(len(with_prefix))
            ids, valid = right_aligned([prefixes[i] for i in with_prefix], self.device)
            fresh.forward(ids, valid, torch.ones(len(with_prefix), dtype=torch.int64, device=self.device), 1)
        self.merge(fresh)
        empty = [i for i in range(len(prefixes)) if not len(prefixes[i])]
        self.add_rows(len(empty))
        if empty and with_prefix:
            slot = {row: n_old + k for k, row in enumerate(with_prefix + empty)}
            self.select(list(range(n_old)) + [slot[i] for i in range(len(prefixes))])

    def merge(self, other: "DynamicRunner") -> None:
        """Append the rows of `other` (same model) after this runner's rows."""
        mine, theirs = self._layers(), other._layers()
        if not theirs:
            self.add_rows(other.num_rows)
            return
        if not mine:  # nothing cached yet: adopt other's layer shapes
            empty = self.num_rows
            self.cache, self.valid, self.lengths = other.cache, other.valid, other.lengths
            if empty:
                self.add_rows(empty)
                self.select(list(range(other.num_rows, other.num_rows + empty)) + list(range(other.num_rows)))
            return
        L = max(self.valid.shape[1], other.valid.shape[1])
        for a, b in zip(mine, theirs):
            a.keys = torch.cat([_left_pad(a.keys, L, dim=2), _left_pad(b.keys, L, dim=2)])
            a.values = torch.cat([_left_pad(a.values, L, dim=2), _left_pad(b.values, L, dim=2)])
        self.valid = torch.cat([_left_pad(self.valid, L, dim=1), _left_pad(other.valid, L, dim=1)])
        self.lengths = torch.cat([self.lengths, other.lengths])

    def _layers(self) -> list[DynamicLayer]:
        layers = [layer for layer in self.cache.layers if getattr(layer, "keys", None) is not None]
        for layer in layers:
            if type(layer) is not DynamicLayer:
                raise TypeError(f"raysd needs full-attention KV caches; {type(layer).__name__} is not supported")
        return layers

    def _trim(self) -> None:
        """Drop the columns no row uses at either end (views: nothing is copied)."""
        used = self.valid.any(dim=0).nonzero()  # [n, 1] columns some row uses
        L = self.valid.shape[1]
        first, end = (int(used[0]), int(used[-1]) + 1) if used.numel() else (L, L)
        if (first, end) == (0, L):
            return
        self.valid = self.valid[:, first:end]
        for layer in self._layers():
            layer.keys, layer.values = layer.keys[:, :, first:end], layer.values[:, :, first:end]

    def _pack(self, keep: torch.Tensor) -> None:
        """Right-align each row's kept columns and trim columns no row uses."""
        counts = keep.sum(dim=1)  # [B]
        width = int(counts.max()) if counts.numel() else 0
        L = keep.shape[1]
        # Already packed when the kept columns of every row end at the last column.
        tail = torch.arange(L, device=self.device)[None, :] >= (L - counts)[:, None]  # [B, L]
        if bool((tail == keep).all()):
            index = None
        else:
            # A stable sort puts dropped columns first, kept ones after in their order.
            index = keep.to(torch.int8).sort(dim=1, stable=True).indices[:, L - width :]  # [B, width]
        for layer in self._layers():
            if index is None:
                layer.keys, layer.values = layer.keys[:, :, L - width :], layer.values[:, :, L - width :]
            else:
                gather = index[:, None, :, None]
                layer.keys = layer.keys.gather(2, gather.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3]))
                layer.values = layer.values.gather(2, gather.expand(-1, layer.values.shape[1], -1, layer.values.shape[3]))
        self.valid = keep[:, L - width :] if index is None else keep.gather(1, index)
        self.lengths = counts


def right_aligned(rows: Sequence[Sequence[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, W] token ids and validity of `rows` right-aligned (left-padded) to the longest, on `device`."""
    ids, valid = padded_rows(rows, max((len(r) for r in rows), default=0), right_aligned=True)
    return (host_to_device(torch.from_numpy(ids), torch.int64, device),
            host_to_device(torch.from_numpy(valid), torch.bool, device))


def _left_pad(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)
