"""Token selection for the CUDA-graph decode step: sampling.py's semantics with every per-row
setting in static device buffers, so the whole selection replays from a graph.

Why beside sampling.py. `sampling.select` takes its per-row settings as Python objects, computes
the uniforms `u = uniform(seed, i)` on the host and, on a CPU, orders only the top candidates and
retries the rows a tier leaves unresolved (a host read per tier). That is the fastest way on a
CPU and stays the CPU default. A graph cannot read the host or branch on data, so here:

- each slot's settings (temperature, top-k, top-p, seed, repetition penalty, min_new_tokens), its
  generated count and the set of token ids it has seen (prompt and generated, a bool row over the
  logits' width) live in device tensors written by `set_row` / `move_row` / `clear_row` between
  steps, and `sample` advances the count and the seen set in place;
- `u` is splitmix64 computed on the device with int64 ops (+ and * wrap mod 2**64 as unsigned
  arithmetic does; >> is arithmetic on int64, so every shift is masked; torch has no uint64
  shift on a CPU), bit for bit what `sampling.uniform` returns;
- every row gets both its argmax and a draw from one full stable sort (`candidates=None`, what
  sampling.py does on a GPU), and `torch.where` keeps the argmax for greedy rows (temperature 0):
  no host branch, and greedy and sampling batches cost the same.

The arithmetic is sampling.py's own (`_candidates` with a full sort, `row_weight`, `_resolve`),
and the masks are the scheduler's (`Engine._select`): logits cast to float32 when half precision,
columns past the vocabulary -inf, EOS ids -inf while a row has fewer than min_new_tokens, the CTRL
repetition penalty on seen ids. So a row draws here exactly what `select(..., candidates=None)`
draws after the same masks, whatever shares the batch, including padding rows of a bucket.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from .sampling import (
    SPLITMIX_FINAL_SHIFT,
    SPLITMIX_GAMMA,
    SPLITMIX_ROUNDS,
    UNIFORM_BITS,
    SamplingParams,
    _candidates,
    _resolve,
    row_weight,
)

_MASK64 = (1 << 64) - 1
# Column layout of the per-slot buffers (one host->device copy per buffer in `set_row`).
_TEMPERATURE, _TOP_P, _PENALTY = 0, 1, 2  # float64 columns; temperature 0 = greedy
_TOP_K, _SEED, _GENERATED, _MIN_NEW = 0, 1, 2, 3  # int64 columns


def _signed(value: int) -> int:
    """The int64 with the same 64 bits as `value` mod 2**64."""
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


def _shift_right(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical (unsigned) right shift of int64 bits: >> is arithmetic on int64, so mask."""
    return torch.bitwise_and(x >> shift, (1 << (64 - shift)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    x = x + _signed(SPLITMIX_GAMMA)
    for shift, multiplier in SPLITMIX_ROUNDS:
        x = torch.bitwise_xor(x, _shift_right(x, shift)) * _signed(multiplier)
    return torch.bitwise_xor(x, _shift_right(x, SPLITMIX_FINAL_SHIFT))


def device_uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`sampling.uniform(seed, position)` for int64 tensors of seeds (their 64 bits, as
    `seed & (2**64 - 1)`) and positions, as float64, computed where the tensors are."""
    bits = _splitmix64(torch.bitwise_xor(_splitmix64(seeds), positions))
    return _shift_right(bits, 64 - UNIFORM_BITS).to(torch.float64) * (1.0 / (1 << UNIFORM_BITS))


class DeviceSampler:
    """Per-slot sampling state in static device buffers; `sample` is capturable in a CUDA graph.

    `sample` advances the state of every slot it covers, padding slots included (harmless: a
    slot is fully rewritten by `set_row` before a request uses it). Warm-up runs before a
    capture advance it too, so call `reset` once the graphs are captured."""

    def __init__(
        self,
        slots: int,
        vocab_size: int,
        logits_width: int,
        eos_ids: Sequence[int],
        device: torch.device,
    ) -> None:
        """`slots` rows of state; logits are `[n, logits_width]` (columns from `vocab_size` on
        are padding of the output layer, never tokens); `eos_ids` are suppressed while a row has
        fewer than its min_new_tokens."""
        if not 0 < vocab_size <= logits_width:
            raise ValueError(f"vocab_size {vocab_size} must be in 1..logits_width {logits_width}")
        eos = sorted(set(eos_ids))
        if eos and not 0 <= eos[0] <= eos[-1] < logits_width:
            raise ValueError(f"EOS ids {eos} outside the logits' width {logits_width}")
        self.slots = slots
        self.vocab_size = vocab_size
        self.logits_width = logits_width
        self.device = torch.device(device)
        self._floats = torch.zeros((slots, 3), dtype=torch.float64, device=self.device)
        self._ints = torch.zeros((slots, 4), dtype=torch.int64, device=self.device)
        self._seen = torch.zeros((slots, logits_width), dtype=torch.bool, device=self.device)
        self._slot_index = torch.arange(slots, dtype=torch.long, device=self.device)
        self._ones = torch.ones(slots, dtype=torch.int64, device=self.device)
        self._true = torch.ones((), dtype=torch.bool, device=self.device)
        self._padding_columns = torch.arange(logits_width, device=self.device) >= vocab_size
        eos_columns = torch.zeros(logits_width, dtype=torch.bool)
        eos_columns[eos] = True
        self._eos_columns = eos_columns.to(self.device)
        self._has_eos = bool(eos)
        self.reset()

    def set_row(
        self,
        slot: int,
        params: SamplingParams,
        *,
        min_new_tokens: int,
        generated: int,
        seen_ids: Iterable[int],
    ) -> None:
        """Give `slot` a request's settings, its generated-token count (the position of its
        next draw) and the ids it has seen (prompt and generated; a set will do).
        Host->device writes, between steps (never inside a captured graph)."""
        self._check_slot(slot)
        greedy = params.greedy or params.temperature <= 0
        floats = [0.0 if greedy else params.temperature, params.top_p, params.repetition_penalty]
        ints = [
            min(max(params.top_k, 0), self.logits_width),  # (0 and >= width both mean "none")
            _signed(params.seed),
            generated,
            min_new_tokens,
        ]
        self._floats[slot] = torch.tensor(floats, dtype=torch.float64).to(self.device)
        self._ints[slot] = torch.tensor(ints, dtype=torch.int64).to(self.device)
        seen = self._seen[slot]
        seen.zero_()
        ids = torch.tensor(list(seen_ids), dtype=torch.long)
        if ids.numel():
            if int(ids.min()) < 0 or int(ids.max()) >= self.logits_width:
                raise ValueError(f"seen ids outside 0..{self.logits_width - 1}")
            seen[ids.to(self.device)] = True

    def move_row(self, src: int, dst: int) -> None:
        """Copy slot `src`'s state into `dst` (the cache compacts rows into freed slots)."""
        self._check_slot(src)
        self._check_slot(dst)
        if src != dst:
            self._floats[dst] = self._floats[src]
            self._ints[dst] = self._ints[src]
            self._seen[dst] = self._seen[src]

    def reorder(self, order: Sequence[int], previous_rows: int) -> None:
        """Slot i takes the state slot `order[i]` had (the order `SlotCache.keep` returns, or
        any permutation), and slots `len(order)..previous_rows-1` are cleared: one gather per
        buffer instead of a `move_row` per moved row."""
        count = len(order)
        for slot in order:
            self._check_slot(slot)
        if list(order) != list(range(count)):
            index = torch.tensor(list(order), dtype=torch.long).to(self.device)
            for buffer in (self._floats, self._ints, self._seen):
                buffer[:count] = buffer.index_select(0, index)  # a copy: any permutation is safe
        for slot in range(count, min(previous_rows, self.slots)):
            self.clear_row(slot)

    def reset(self) -> None:
        """Clear every slot (after warm-up and capture, or when the batch empties)."""
        self._floats.copy_(torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64).to(self.device))
        self._ints.zero_()
        self._seen.zero_()

    def clear_row(self, slot: int) -> None:
        """Reset `slot` to a greedy row with nothing seen (what padding rows of a bucket hold)."""
        self._check_slot(slot)
        self._floats[slot] = torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64).to(self.device)
        self._ints[slot].zero_()
        self._seen[slot].zero_()

    def sample(self, logits: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The next token of every row of `logits` `[n, logits_width]`, row r being slot r (or
        slot `rows[r]`, a long tensor on the device, for an eager step over chosen slots);
        long `[n]` on the device. Static shapes, no host read, no branch on data; advances each
        sampled slot's generated count and seen set in place. Rows of a padded bucket are
        computed like any other and change nothing in the real rows."""
        n, width = logits.shape
        if width != self.logits_width:
            raise ValueError(f"logits are {width} wide, the sampler {self.logits_width}")
        slots = self._slot_index[:n] if rows is None else rows
        floats = self._floats.index_select(0, slots)
        ints = self._ints.index_select(0, slots)
        generated = ints[:, _GENERATED]
        x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        if width > self.vocab_size:  # padding rows of the output layer are not tokens
            x = x.masked_fill(self._padding_columns, float("-inf"))
        if self._has_eos:  # min_new_tokens: no EOS before it
            suppress = (generated < ints[:, _MIN_NEW])[:, None] & self._eos_columns
            x = x.masked_fill(suppress, float("-inf"))
        # repetition penalty (CTRL, sampling.apply_repetition_penalties) on the ids seen so far
        penalty = floats[:, _PENALTY : _PENALTY + 1]
        penalised = self._seen.index_select(0, slots) & (penalty != 1.0)
        factor = penalty.to(x.dtype)
        x = torch.where(penalised, torch.where(x > 0, x / factor, x * factor), x)

        temperature = floats[:, _TEMPERATURE : _TEMPERATURE + 1]
        sampled = temperature > 0
        temperature = torch.where(sampled, temperature, 1.0)  # greedy rows: any finite value
        top_k = ints[:, _TOP_K : _TOP_K + 1]
        kth_rank = torch.where((top_k > 0) & (top_k < width), top_k, width)
        uniforms = device_uniform(ints[:, _SEED], generated)[:, None]
        values, ids, exact = _candidates(x, width)  # the full stable sort
        x_max = values[:, :1].to(torch.float64)
        drawn, _ = _resolve(
            values,
            ids,
            exact,
            vocab=width,
            x_max=x_max,
            temperature=temperature,
            kth_rank=kth_rank,
            top_p=floats[:, _TOP_P : _TOP_P + 1],
            uniforms=uniforms,
            whole_weight=row_weight(x, x_max, temperature),
        )
        tokens = torch.where(sampled.squeeze(-1), drawn, x.argmax(dim=-1))
        generated_column = self._ints[:, _GENERATED]
        generated_column.index_add_(0, slots, self._ones[:n])
        self._seen.index_put_((slots, tokens), self._true)
        return tokens

    def state(self, slot: int) -> dict[str, object]:
        """One slot's settings as the host sees them (tests and debugging; reads the device)."""
        self._check_slot(slot)
        floats = self._floats[slot].tolist()
        ints = self._ints[slot].tolist()
        return {
            "temperature": floats[_TEMPERATURE],
            "top_p": floats[_TOP_P],
            "repetition_penalty": floats[_PENALTY],
            "top_k": ints[_TOP_K],
            "seed": ints[_SEED] & _MASK64,
            "generated": ints[_GENERATED],
            "min_new_tokens": ints[_MIN_NEW],
            "seen_ids": self._seen[slot].nonzero().flatten().tolist(),
        }

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} outside 0..{self.slots - 1}")
