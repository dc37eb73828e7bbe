"""A slot KV cache: rows join and leave a running batch without copying the other rows' cache.

Why not `DynamicCache`: it appends each step's keys with `torch.cat` (a copy of the whole cache
every decode step), and merging a joining request or dropping a finished one means
concatenating or `index_select`-ing every layer of every row. Why not transformers'
`StaticCache`: all its rows write at one shared position, so rows of different lengths need
left padding, and joining still shifts or copies. Why not its paged cache: it lives inside
`ContinuousBatchingManager` (one global sampling generator) and its CPU path gathers the pages
into a dense copy every step anyway.

Layout. Each layer owns two preallocated buffers `[slots, kv_heads, capacity, head_dim]`. The
running batch's row r lives in slot r (rows are always slots `0..n-1`), right-padded: its tokens
occupy columns `0..length_r-1`. A decode step writes each row's new key at its own column
`length_r` (one indexed write per layer) and attention reads the view
`[:n, :, :max(length)+1]` with a padding mask, so masked columns carry zero weight and a row's
arithmetic is that of the row alone up to kernel blocking in the last bits.

Costs. Join: the joiners' prefill cache is copied into free slots (their tokens only).
Leave: the highest rows move into the freed slots (the moved rows' tokens only; no copy when the
last rows leave). Capacity and slot count grow by doubling and shrink when a quarter is used, so
reallocation copies are amortised O(1) per token. Memory is `slots x capacity`: a rectangle as
wide as the longest running row (a paged cache would avoid that; it needs custom attention
kernels).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache

_COLUMN_QUANTUM = 64  # capacity is a multiple of this
_MIN_SLOTS = 4


def _round_up(n: int, quantum: int) -> int:
    return -(-n // quantum) * quantum


class SlotLayer(CacheLayerMixin):
    """One layer's buffers; `update` is called by the model's attention during a decode step."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: SlotCache) -> None:
        super().__init__()
        self._owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("SlotLayer buffers are allocated by SlotCache.add_rows")

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write each row's new key/value at its own column; return the batch's live window."""
        owner = self._owner
        if key_states.shape[-2] != 1 or owner.step_positions is None:
            raise RuntimeError("SlotCache serves decode steps (one new token per row) only")
        assert self.keys is not None and self.values is not None
        rows, columns, width, n = owner.row_index, owner.step_positions, owner.width, owner.rows
        self.keys[rows, :, columns] = key_states[:, :, 0]
        self.values[rows, :, columns] = value_states[:, :, 0]
        return self.keys[:n, :, :width], self.values[:n, :, :width]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._owner.width - 1 + query_length, 0

    def get_seq_length(self) -> int:
        return max(self._owner.width - 1, 0)

    def get_max_length(self) -> int:
        return -1


class SlotCache(Cache):
    """The running batch's KV cache (worker thread only). See the module docstring.

    Protocol per decode step: `begin_step(lengths)` with each row's current token count (also
    its position id), one forward pass with `past_key_values=self`, then `end_step()`.
    """

    def __init__(self, num_layers: int, max_slots: int, max_length: int) -> None:
        self._slot_layers = [SlotLayer(self) for _ in range(num_layers)]
        super().__init__(layers=list(self._slot_layers))
        self.max_slots = max(1, max_slots)
        self.max_length = max(1, max_length)
        self.lengths: list[int] = []  # tokens held per row, row r in slot r
        self.step_positions: torch.Tensor | None = None
        self.row_index = torch.zeros(0, dtype=torch.long)
        self.width = 0
        self.copied_bytes = 0  # bytes moved by joins, leaves and reallocation (for benchmarks)

    # ----- sizes ---------------------------------------------------------------------------------

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def slots(self) -> int:
        keys = self._slot_layers[0].keys
        return 0 if keys is None else keys.shape[0]

    @property
    def capacity(self) -> int:
        keys = self._slot_layers[0].keys
        return 0 if keys is None else keys.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes allocated by all layers' buffers."""
        return sum(
            layer.keys.nbytes + layer.values.nbytes
            for layer in self._slot_layers
            if layer.keys is not None and layer.values is not None
        )

    # ----- joining and leaving -----------------------------------------------------------------

    def add_rows(
        self, prefill: DynamicCache, select: Sequence[int], lengths: Sequence[int]
    ) -> None:
        """Append rows `select` of a prefill cache as the last rows, `lengths[j]` tokens for
        row `select[j]` (a right-padded prefill: columns past a row's length are padding, masked
        until its own tokens overwrite them)."""
        first = self.rows
        length = prefill.layers[0].keys.shape[2]  # the prefill's width: every row's columns
        assert len(lengths) == len(select) and max(lengths) <= length
        self._reserve(first + len(select), length + 1, template=prefill)
        index = torch.tensor(list(select), dtype=torch.long, device=self._device)
        everything = len(select) == prefill.layers[0].keys.shape[0]
        for layer, source in zip(self._slot_layers, prefill.layers, strict=True):
            keys = source.keys if everything else source.keys.index_select(0, index)
            values = source.values if everything else source.values.index_select(0, index)
            layer.keys[first : first + len(select), :, :length] = keys
            layer.values[first : first + len(select), :, :length] = values
            self.copied_bytes += keys.nbytes + values.nbytes
        self.lengths.extend(lengths)
        self._refresh_index()

    def keep(self, keep: Sequence[int]) -> list[int]:
        """Drop every row not in `keep`; return the new row order as old row indices.

        Rows beyond the new row count move into the freed slots below it, so only the moved
        rows' tokens are copied; the order of the other rows is unchanged."""
        count = len(keep)
        kept = set(keep)
        holes = [i for i in range(count) if i not in kept]
        movers = [i for i in range(count, self.rows) if i in kept]
        order = list(range(count))
        for hole, mover in zip(holes, movers, strict=True):
            order[hole] = mover
            width = self.lengths[mover]  # slice copies: no index tensors, no temporaries
            for layer in self._slot_layers:
                assert layer.keys is not None and layer.values is not None
                layer.keys[hole, :, :width].copy_(layer.keys[mover, :, :width])
                layer.values[hole, :, :width].copy_(layer.values[mover, :, :width])
            self.copied_bytes += self._row_bytes(width)
        self.lengths = [self.lengths[i] for i in order]
        if not self.lengths:
            self.clear()
        else:
            self._maybe_shrink()
            self._refresh_index()
        return order

    def clear(self) -> None:
        """Forget every row and free the buffers."""
        for layer in self._slot_layers:
            layer.keys = layer.values = None
            layer.is_initialized = False
        self.lengths = []
        self.step_positions = None
        self.width = 0
        self._refresh_index()

    # ----- decode steps ----------------------------------------------------------------------------

    def begin_step(self) -> torch.Tensor:
        """Prepare a decode step; return each row's position (its token count, which is also
        the column its new token is written to), shape `[rows]`."""
        width = max(self.lengths) + 1
        self._reserve(self.rows, width)
        self.step_positions = torch.tensor(self.lengths, dtype=torch.long, device=self._device)
        self.width = width
        return self.step_positions

    def attention_mask(self) -> torch.Tensor:
        """The step's 2D padding mask `[rows, width]`: row r sees columns `0..length_r`."""
        assert self.step_positions is not None
        columns = torch.arange(self.width, device=self._device)
        return (columns[None, :] <= self.step_positions[:, None]).long()

    def end_step(self) -> None:
        self.lengths = [n + 1 for n in self.lengths]
        self.step_positions = None

    # ----- buffers -----------------------------------------------------------------------------

    @property
    def _device(self) -> torch.device:
        keys = self._slot_layers[0].keys
        return torch.device("cpu") if keys is None else keys.device

    def _refresh_index(self) -> None:
        if self.row_index.numel() != self.rows or self.row_index.device != self._device:
            self.row_index = torch.arange(self.rows, dtype=torch.long, device=self._device)

    def _reserve(self, rows: int, columns: int, template: DynamicCache | None = None) -> None:
        """Make room for `rows` rows of `columns` tokens, doubling what is short."""
        slots, capacity = self.slots, self.capacity
        if rows <= slots and columns <= capacity:
            return
        new_slots = slots
        if rows > slots:
            new_slots = min(max(rows, 2 * slots, _MIN_SLOTS), max(self.max_slots, rows))
        new_capacity = capacity
        if columns > capacity:
            limit = max(_round_up(self.max_length, _COLUMN_QUANTUM), columns)
            new_capacity = min(_round_up(max(columns, 2 * capacity), _COLUMN_QUANTUM), limit)
        self._reallocate(new_slots, new_capacity, template)

    def _maybe_shrink(self) -> None:
        slots, capacity = self.slots, self.capacity
        used_columns = max(self.lengths) + 1
        new_slots = slots
        if self.rows * 4 <= slots and slots > _MIN_SLOTS:
            new_slots = max(2 * self.rows, _MIN_SLOTS)
        new_capacity = capacity
        if used_columns * 4 <= capacity and capacity > _COLUMN_QUANTUM:
            new_capacity = _round_up(2 * used_columns, _COLUMN_QUANTUM)
        if (new_slots, new_capacity) != (slots, capacity):
            self._reallocate(new_slots, new_capacity, None)

    def _reallocate(self, slots: int, capacity: int, template: DynamicCache | None) -> None:
        rows = self.rows
        width = max(self.lengths, default=0)
        for i, layer in enumerate(self._slot_layers):
            old_keys, old_values = layer.keys, layer.values
            like_keys = old_keys if old_keys is not None else template.layers[i].keys  # type: ignore[union-attr]
            like_values = old_values if old_values is not None else template.layers[i].values  # type: ignore[union-attr]
            heads, key_dim = like_keys.shape[1], like_keys.shape[3]
            value_heads, value_dim = like_values.shape[1], like_values.shape[3]
            layer.keys = like_keys.new_zeros((slots, heads, capacity, key_dim))
            layer.values = like_values.new_zeros((slots, value_heads, capacity, value_dim))
            layer.dtype, layer.device = layer.keys.dtype, layer.keys.device
            layer.is_initialized = True
            if old_keys is not None and old_values is not None and rows and width:
                layer.keys[:rows, :, :width] = old_keys[:rows, :, :width]
                layer.values[:rows, :, :width] = old_values[:rows, :, :width]
        self.copied_bytes += self._row_bytes(width) * rows
        self._refresh_index()

    def _row_bytes(self, columns: int) -> int:
        """Bytes of `columns` tokens of one row, all layers, keys and values."""
        total = 0
        for layer in self._slot_layers:
            if layer.keys is not None and layer.values is not None:
                per_column_keys = layer.keys[0, :, 0].nbytes
                per_column_values = layer.values[0, :, 0].nbytes
                total += columns * (per_column_keys + per_column_values)
        return total
