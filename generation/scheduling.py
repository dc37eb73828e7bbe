"""The engine's scheduling policy: which rows run, who joins, who leaves, which long prompt gets
the next prefill chunk (vLLM's `Scheduler`).

One of the three parts of the worker thread (scheduler.py's `Engine` drives them): this one
decides, model_runner.py runs the model, output_processor.py turns tokens into stream events.
No tensors here and no model: decisions over the worker's rows, so the policy reads in one place.

Policy. Each admission takes queued requests up to `max_batch_size` rows and a prefill token
budget (an iteration admits again those that arrived meanwhile, up to scheduler.py's
ADMISSION_ROUNDS, before its decode step); joiners are prefilled together in groups of similar length (`prefill_groups`: right-
padded, the padding at most `PREFILL_PADDING` of the tokens; on a CPU, 16 chat prompts of 34-49
tokens took 1.5 s in one pass against 2.5-2.9 s one by one, smollm2-135m: a short prefill is bound
by reading weights). A context longer than `prefill_chunk_tokens` is prefilled a chunk per
iteration instead, oldest first, and joins after its last chunk, so the running rows keep getting
a token per iteration (on a CPU, smollm2-135m: a 2,048-token prompt is one 3.9 s pass, or 8
passes of 0.3-0.65 s; 4 running streams then waited at most ~1 s for a token instead of 4 s).
Finished or cancelled rows leave between steps.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
from transformers.cache_utils import DynamicCache

from servicekit.text_gate import TextGate

from .detokenizer import Detokenizer
from .jobs import Job

#: Joiners of different lengths prefill in one right-padded forward pass while the padding adds at
#: most this share of computed tokens.
PREFILL_PADDING = 0.25
#: Tokens per prefill chunk by device: a chunk stalls the running rows for its forward pass.
PREFILL_CHUNK_TOKENS = {"cpu": 256, "cuda": 2048}
#: Rows of the running batch on a CPU by default (CUDA: from free memory, up to MAX_ROWS).
CPU_MAX_BATCH_SIZE = 64


def prefill_groups(lengths: list[int], padding: float = PREFILL_PADDING) -> list[list[int]]:
    """Indices of `lengths` grouped for padded prefill: by ascending length, a group closes when
    its rectangle (rows x longest) would exceed its tokens by more than `padding`."""
    groups: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        n = lengths[i]
        if current and (len(current) + 1) * n > (1 + padding) * (tokens + n):
            groups.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += n
    if current:
        groups.append(current)
    return groups


def equal_length_groups(lengths: list[int]) -> list[list[int]]:
    """Indices of `lengths` grouped by equal length: prefill without any padding (models whose
    cache cannot be merged, or that compute logits for every position)."""
    by_length: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_length.setdefault(n, []).append(i)
    return list(by_length.values())


class Row:
    """Per-request state inside the worker (worker thread only). `done`: the row finished, failed
    or was cancelled; a token computed for it afterwards (an overlapped step launched before its
    finish was known) is discarded."""

    __slots__ = (
        "detok",
        "done",
        "gate",
        "gated",
        "generated",
        "job",
        "kv_len",
        "limit",
        "next_input",
        "partial",
        "penalised",
        "prefilled",
        "prompt_length",
        "seen",
        "seen_new",
        "seen_tensor",
    )

    def __init__(self, job: Job, detokenizer: Callable[[], Detokenizer], max_context: int) -> None:
        """`max_context`: the engine's context (prompt and generated), for `limit`."""
        self.job = job
        self.done = False
        self.generated: list[int] = []
        self.detok = detokenizer()
        self.gate = TextGate(job.stop_sequences, already_delivered=job.resume_text_len)
        # False while the gate is transparent (no stop sequences, nothing held): a decode step
        # then emits the detokenizer's delta as is (OutputProcessor.accept_step)
        self.gated = not self.gate.transparent
        # generated tokens at which the row ends (its budget, or the context full)
        self.limit = min(job.max_new_tokens, max_context - len(job.prompt_ids))
        self.seen: set[int] = set(job.prompt_ids)  # after joining: penalised rows only
        self.penalised = job.sampling.repetition_penalty != 1.0
        self.prompt_length = len(job.prompt_ids)
        self.seen_new: list[int] = []  # seen ids not yet in seen_tensor (penalised rows only)
        self.seen_tensor: torch.Tensor | None = None  # unique seen ids on the model's device
        self.kv_len = 0  # tokens of this row in the KV cache
        self.next_input = -1  # sampled token not yet fed to the model (host-fed steps)
        self.partial: DynamicCache | None = None  # chunked prefill: the chunks done so far
        self.prefilled = 0  # chunked prefill: tokens in `partial`

    def context(self) -> list[int]:
        """What the model must have seen before this row's next token: prompt and generated."""
        return self.job.prompt_ids + self.generated

    def seen_ids(self, device: torch.device) -> torch.Tensor:
        """The unique token ids this row has seen (prompt and generated), as a device tensor."""
        if self.seen_tensor is None:
            self.seen_tensor = torch.tensor(sorted(self.seen), dtype=torch.long, device=device)
            self.seen_new = []
        elif self.seen_new:
            new = torch.tensor(self.seen_new, dtype=torch.long, device=device)
            self.seen_tensor = torch.cat([self.seen_tensor, new])
            self.seen_new = []
        return self.seen_tensor


class Scheduler:
    """The running batch (`rows`: row r is slot r of the runner's cache), the long contexts being
    prefilled chunk by chunk (`prefilling`, in order), and the rules for who joins."""

    def __init__(
        self, max_batch_size: int, prefill_token_budget: int, prefill_chunk_tokens: int
    ) -> None:
        self.max_batch_size = max(1, max_batch_size)
        self.prefill_token_budget = max(1, prefill_token_budget)
        self.prefill_chunk_tokens = max(1, prefill_chunk_tokens)
        self.rows: list[Row] = []
        self.prefilling: deque[Row] = deque()

    @property
    def busy(self) -> bool:
        """Rows to decode or contexts to prefill: the worker has an iteration to run."""
        return bool(self.rows or self.prefilling)

    def choose_joiners(self, inbox: deque[Job], batchable: bool | None) -> list[Job]:
        """Pop the queued requests that join now: as many as free rows allow (one at a time for
        a model whose cache cannot be merged, and only one while the cache layout is unknown),
        within the prefill token budget (the first always joins)."""
        free = self.max_batch_size - len(self.rows) - len(self.prefilling)
        if batchable is False:  # a cache we cannot merge: one request at a time
            free = 0 if self.rows else 1
        joiners: list[Job] = []
        budget = self.prefill_token_budget
        while inbox and len(joiners) < free:
            job = inbox[0]
            cost = len(job.prompt_ids) + len(job.resume_ids)
            if joiners and cost > budget:
                break
            joiners.append(inbox.popleft())
            budget -= cost
            if batchable is None:  # learn the cache layout from one request first
                break
        return joiners

    def needs_chunks(self, row: Row) -> bool:
        """Whether a row's context is prefilled chunk by chunk (between decode steps)."""
        return len(row.job.prompt_ids) + len(row.generated) > self.prefill_chunk_tokens

    def next_chunk(self) -> tuple[Row, int, int]:
        """The oldest long context and the [start, end) of its next chunk."""
        row = self.prefilling[0]
        start = row.prefilled
        return row, start, min(len(row.context()), start + self.prefill_chunk_tokens)

    def drop_prefilling(self, row: Row) -> None:
        """A long context leaves the chunk queue (its last chunk ran, or it failed)."""
        if self.prefilling and self.prefilling[0] is row:
            self.prefilling.popleft()
        elif row in self.prefilling:
            self.prefilling.remove(row)

    def cancelled(self) -> list[Row]:
        """Remove cancelled long contexts from the chunk queue; return them, and the cancelled
        rows of the running batch (which leave through the runner's `keep`)."""
        gone = [row for row in self.prefilling if row.job.cancelled]
        if gone:
            self.prefilling = deque(row for row in self.prefilling if not row.job.cancelled)
        return gone + [row for row in self.rows if row.job.cancelled]

    def leaving(self) -> list[int] | None:
        """Rows that stay (indices into `rows`) when some are done, else None."""
        keep = [i for i, row in enumerate(self.rows) if not row.done]
        return keep if len(keep) != len(self.rows) else None
