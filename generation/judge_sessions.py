"""Judge sessions: incremental safety judgement of a growing text on the engine's model.

Why. A judge model (Llama Guard, a yes/no guardian, any LM zero-shot) reads a prompt template:
a head (instructions, the conversation), the text under judgement, and a closing tail ending
where the answer token goes. Judging a stream chunk by chunk by re-sending head + text so far +
tail at every chunk costs the sum of all prefixes. A session keeps the judged prefix (head and
the chunks so far) in its own KV rows instead, so an append runs the model over the new chunk's
tokens and the tail only: O(chunk + tail) tokens through the model, never O(prefix) (attention
still reads the prefix's keys, as any decode step does).

Layout. A session owns one buffer per layer, `[1, kv_heads, capacity, head_dim]` (capacity
doubles, so growth is amortised O(1) per token). Its first `length` columns are the judged
prefix. An append writes the chunk's keys at `length..` and the tail's right after them, in
scratch columns the next append overwrites; only the chunk's columns join the prefix. The
answer's logits are read at the tail's last position; the score is P(unsafe tokens) /
(P(unsafe tokens) + P(safe tokens)) there, in float64.

Batching. Every append queued when the worker gets to it (one per session; a second append to
the same session waits for the next pass) runs in one forward pass per worker iteration: the
sessions' prefixes are copied into a rectangle (row i's prefix at columns `0..P_i`, its new
tokens right after, at its own positions `P_i..`), with an explicit 4D mask, and the new
columns are copied back into the sessions' buffers afterwards. A lone append runs on its
session's own buffer with no copy. The copies are memory traffic of the order of what the
attention reads anyway; the FLOPs per append stay O(chunk + tail).

Exactness: in `--batch-invariant` mode (batch_invariant.py) a row's logits are bitwise
independent of its batch and of how its prefix was prefilled, so a session's score after an
append equals judging head + all chunks + tail from scratch, alone or batched, and after the
session is rebuilt on another replica from its chunks (tests/test_judge_sessions.py). In the
default mode the same holds up to the last bits of kernel blocking.

Threads: the event loop opens, closes and queues appends (under `lock`); the worker thread runs
`run_pending` between its other work and answers each append through a concurrent Future.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import secrets
import threading
import time
from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .models import LoadedModel

#: Sessions held at once by default (each holds KV rows of its judged prefix).
MAX_SESSIONS = 256
#: A session not used for this long is closed (its KV rows freed) at the next open or append.
IDLE_TIMEOUT_S = 300.0
#: At most this many appends (and tokens through the model) per batched forward pass.
MAX_BATCH = 32
TOKEN_BUDGET = 4096
_COLUMN_QUANTUM = 64


class JudgeSessionError(Exception):
    """A session request that cannot be served: `status` 404 (unknown), 422 (too long), 429 (full)."""

    def __init__(self, status: int, message: str, type_: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    """One judgement: the score and the probabilities it comes from, and the work it took."""

    score: float
    p_unsafe: float
    p_safe: float
    judged_tokens: int  # the prefix in the session's KV rows after the append
    forward_tokens: int  # tokens through the model for this append (new prefix tokens + tail)


class JudgeSession:
    """A session's state; its buffers are touched by the worker thread only."""

    __slots__ = (
        "closed",
        "id",
        "keys",
        "last_used",
        "length",
        "pending",
        "safe",
        "tail",
        "unsafe",
        "values",
    )

    def __init__(
        self, session_id: str, head: list[int], tail: list[int], unsafe: list[int], safe: list[int]
    ) -> None:
        self.id = session_id
        self.tail = tail
        self.unsafe = unsafe
        self.safe = safe
        self.pending: list[int] = list(head)  # prefix tokens not yet in the KV rows
        self.length = 0  # prefix tokens in the KV rows
        self.keys: list[torch.Tensor] = []  # per layer [1, kv_heads, capacity, head_dim]
        self.values: list[torch.Tensor] = []
        self.closed = False
        self.last_used = time.monotonic()

    @property
    def tokens(self) -> int:
        """The judged prefix, in the KV rows or queued: what the context limit counts."""
        return self.length + len(self.pending)

    def reserve(self, columns: int, like: torch.Tensor, layers: int) -> None:
        """Room for `columns` columns per layer (doubling); `like` gives shape and dtype."""
        capacity = self.keys[0].shape[2] if self.keys else 0
        if columns <= capacity:
            return
        new = max(columns, 2 * capacity)
        new = -(-new // _COLUMN_QUANTUM) * _COLUMN_QUANTUM
        _b, heads, _n, dim = like.shape
        shape = (1, heads, new, dim)
        for store in (self.keys, self.values):
            old = list(store)
            store.clear()
            for layer in range(layers):
                buffer = like.new_zeros(shape)
                if old:
                    buffer[:, :, : self.length] = old[layer][:, :, : self.length]
                store.append(buffer)


@dataclasses.dataclass(slots=True)
class _Append:
    session: JudgeSession
    ids: list[int]  # new prefix tokens (queued head and the chunk)
    future: concurrent.futures.Future[Verdict]


class _RectLayer(CacheLayerMixin):
    """One layer of an append pass: writes each row's new keys at its own columns, returns the
    rectangle the rows attend over (a lone session's own buffer, or a copy of the prefixes)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: _AppendCache, index: int) -> None:
        super().__init__()
        self._owner = owner
        self._index = index

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("allocated by _AppendCache")

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._owner.write(self._index, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._owner.width, 0

    def get_seq_length(self) -> int:
        return self._owner.width - self._owner.query_length

    def get_max_length(self) -> int:
        return -1


class _AppendCache(Cache):
    """The cache of one append pass over `batch` (worker thread only)."""

    def __init__(self, layers: int, batch: list[_Append]) -> None:
        super().__init__(layers=[_RectLayer(self, i) for i in range(layers)])
        self.num_layers = layers
        self.batch = batch
        self.starts = [a.session.length for a in batch]
        self.counts = [len(a.ids) + len(a.session.tail) for a in batch]
        self.query_length = max(self.counts)
        self.width = max(p + t for p, t in zip(self.starts, self.counts, strict=True))
        self.rect_keys: list[torch.Tensor] = []
        self.rect_values: list[torch.Tensor] = []
        self._index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _scatter_index(
        self, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._index is None:
            rows, columns, sources = [], [], []
            for i, (p, t) in enumerate(zip(self.starts, self.counts, strict=True)):
                rows += [i] * t
                columns += range(p, p + t)
                sources += range(t)
            self._index = tuple(
                torch.tensor(x, dtype=torch.long, device=device) for x in (rows, columns, sources)
            )  # type: ignore[assignment]
        assert self._index is not None
        return self._index

    def write(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        width = self.width
        if len(self.batch) == 1:  # the session's own buffer: no copy of its prefix
            session = self.batch[0].session
            session.reserve(width, keys, self.num_layers)
            p, t = self.starts[0], self.counts[0]
            session.keys[layer][:, :, p : p + t] = keys
            session.values[layer][:, :, p : p + t] = values
            return session.keys[layer][:, :, :width], session.values[layer][:, :, :width]
        b, heads, _q, dim = keys.shape
        rect_k = keys.new_zeros((b, heads, width, dim))
        rect_v = values.new_zeros((b, heads, width, dim))
        for i, a in enumerate(self.batch):
            p = self.starts[i]
            if p:
                rect_k[i, :, :p] = a.session.keys[layer][0, :, :p]
                rect_v[i, :, :p] = a.session.values[layer][0, :, :p]
        rows, columns, sources = self._scatter_index(keys.device)
        rect_k[rows, :, columns] = keys[rows, :, sources]
        rect_v[rows, :, columns] = values[rows, :, sources]
        self.rect_keys.append(rect_k)
        self.rect_values.append(rect_v)
        return rect_k, rect_v

    def write_back(self) -> None:
        """A batched pass: each session's new prefix columns into its own buffers."""
        if len(self.batch) == 1:
            return
        for i, a in enumerate(self.batch):
            session, p, n = a.session, self.starts[i], len(a.ids)
            session.reserve(
                p + n + len(session.tail), self.rect_keys[0][i : i + 1], self.num_layers
            )
            for layer in range(self.num_layers):
                session.keys[layer][0, :, p : p + n] = self.rect_keys[layer][i, :, p : p + n]
                session.values[layer][0, :, p : p + n] = self.rect_values[layer][i, :, p : p + n]


class JudgeSessions:
    """The engine's judge sessions: the registry (event loop) and the append passes (worker)."""

    def __init__(
        self,
        loaded: LoadedModel,
        max_sessions: int = MAX_SESSIONS,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        max_batch: int = MAX_BATCH,
        token_budget: int = TOKEN_BUDGET,
        wake: threading.Condition | None = None,
    ) -> None:
        self.loaded = loaded
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.max_batch = max(1, max_batch)
        self.token_budget = max(1, token_budget)
        self.lock = wake or threading.Condition()
        self.sessions: dict[str, JudgeSession] = {}
        self.queue: list[_Append] = []
        self.passes = 0  # forward passes run (for tests and metrics)
        self.batch_sizes: dict[int, int] = {}  # appends per pass -> passes
        self.forward_tokens = 0
        self._layers = int(getattr(loaded.model.config, "num_hidden_layers", 0)) or len(
            getattr(loaded.model.config, "layer_types", []) or []
        )
        self._eager_mask = getattr(loaded.model.config, "_attn_implementation", "") == "eager"
        self._ids = itertools.count()

    # ----- event-loop side (any thread; under the lock) ----------------------------------------

    def open(
        self, head: list[int], tail: list[int], unsafe: list[int], safe: list[int]
    ) -> JudgeSession:
        """A new session (429 when `max_sessions` are held after closing idle ones)."""
        with self.lock:
            self._expire()
            if len(self.sessions) >= self.max_sessions:
                raise JudgeSessionError(
                    429, f"all {self.max_sessions} judge sessions are in use", "too_many_sessions"
                )
            session_id = f"js-{next(self._ids)}-{secrets.token_hex(6)}"
            session = JudgeSession(session_id, head, tail, unsafe, safe)
            self.sessions[session_id] = session
            return session

    def get(self, session_id: str) -> JudgeSession:
        with self.lock:
            self._expire()
            session = self.sessions.get(session_id)
            if session is None:
                raise JudgeSessionError(404, f"no judge session {session_id!r}", "not_found")
            session.last_used = time.monotonic()
            return session

    def append(
        self, session: JudgeSession, ids: Sequence[int]
    ) -> concurrent.futures.Future[Verdict]:
        """Queue `ids` for the session's prefix; the future gets the verdict after them."""
        future: concurrent.futures.Future[Verdict] = concurrent.futures.Future()
        with self.lock:
            if session.closed:
                raise JudgeSessionError(404, f"no judge session {session.id!r}", "not_found")
            total = session.tokens + len(ids) + len(session.tail)
            limit = self.loaded.max_context
            if total > limit:
                raise JudgeSessionError(
                    422,
                    f"the judged text would be {total} tokens with the template, over the "
                    f"model's context of {limit}",
                    "context_exceeded",
                )
            new = session.pending + list(ids)
            if not new and not session.tail:
                raise JudgeSessionError(422, "nothing to judge: no new text and no tail", "empty")
            session.pending = []  # counted as prefix from now on (the limit above)
            self.queue.append(_Append(session, new, future))
            session.last_used = time.monotonic()
            self.lock.notify_all()
        return future

    def close(self, session_id: str) -> bool:
        with self.lock:
            session = self.sessions.pop(session_id, None)
            if session is None:
                return False
            session.closed = True
            return True

    def close_all(self, error: BaseException) -> None:
        """The engine stops: every queued append fails."""
        with self.lock:
            queued, self.queue = self.queue, []
            for session in self.sessions.values():
                session.closed = True
            self.sessions.clear()
        for a in queued:
            if not a.future.done():
                a.future.set_exception(error)

    @property
    def has_work(self) -> bool:
        """Appends are queued (read under the lock by the worker's wait)."""
        return bool(self.queue)

    def _expire(self) -> None:
        deadline = time.monotonic() - self.idle_timeout_s
        for session_id in [
            s.id for s in self.sessions.values() if s.last_used < deadline and not self._queued(s)
        ]:
            self.sessions.pop(session_id).closed = True

    def _queued(self, session: JudgeSession) -> bool:
        return any(a.session is session for a in self.queue)

    # ----- worker side -------------------------------------------------------------------------

    def take_batch(self) -> list[_Append]:
        """The appends of the next pass: oldest first, one per session, within the budgets."""
        with self.lock:
            batch: list[_Append] = []
            rest: list[_Append] = []
            seen: set[int] = set()
            tokens = 0
            for a in self.queue:
                cost = len(a.ids) + len(a.session.tail)
                fits = len(batch) < self.max_batch and (
                    not batch or tokens + cost <= self.token_budget
                )
                if id(a.session) in seen or not fits:
                    rest.append(a)
                    continue
                seen.add(id(a.session))
                batch.append(a)
                tokens += cost
            self.queue = rest
            return batch

    def run_pending(self) -> int:
        """One append pass over the queued appends (worker thread); returns the appends run."""
        batch = self.take_batch()
        live: list[_Append] = []
        for a in batch:
            if a.session.closed:
                if a.future.set_running_or_notify_cancel():
                    a.future.set_exception(
                        JudgeSessionError(404, f"no judge session {a.session.id!r}", "not_found")
                    )
            elif a.future.set_running_or_notify_cancel():
                live.append(a)
            else:  # its caller gave up: the session would lack the chunk, so it is closed
                self.close(a.session.id)
        if not live:
            return len(batch)
        try:
            verdicts = self.forward(live)
        except Exception as exc:  # the sessions' KV rows may be half-written: they are lost
            with self.lock:
                for a in live:
                    self.sessions.pop(a.session.id, None)
                    a.session.closed = True
            for a in live:
                a.future.set_exception(exc)
            return len(batch)
        for a, verdict in zip(live, verdicts, strict=True):
            a.future.set_result(verdict)
        return len(batch)

    @torch.inference_mode()
    def forward(self, batch: list[_Append]) -> list[Verdict]:
        """One forward pass over the batch's new tokens and tails (module docstring)."""
        device = self.loaded.device
        cache = _AppendCache(self._layers, batch)
        width, q_len = cache.width, cache.query_length
        inputs, positions = [], []
        for a, p, t in zip(batch, cache.starts, cache.counts, strict=True):
            row = a.ids + a.session.tail
            inputs.append(row + [row[-1]] * (q_len - t))
            positions.append(list(range(p, p + q_len)))
        ids = torch.tensor(inputs, dtype=torch.long, device=device)
        position_ids = torch.tensor(positions, dtype=torch.long, device=device)
        columns = torch.arange(width, device=device)
        # query j of row i sees columns 0..P_i+j (its prefix, then its own new tokens causally)
        mask = (columns[None, None, :] <= position_ids[:, :, None])[:, None]
        attention_mask: torch.Tensor = mask
        if self._eager_mask:
            dtype = self.loaded.model.dtype
            attention_mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(
                ~mask, torch.finfo(dtype).min
            )
        ends = [t - 1 for t in cache.counts]
        keep = sorted(set(ends))
        out = self.loaded.model(
            input_ids=ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=torch.tensor(keep, dtype=torch.long, device=device),
        )
        cache.write_back()
        pick = torch.tensor([keep.index(e) for e in ends], dtype=torch.long, device=device)
        logits = out.logits[torch.arange(len(batch), device=device), pick].to(torch.float64)
        vocab = self.loaded.vocab_size
        if logits.shape[-1] > vocab:  # padding rows of the output layer are not tokens
            logits = logits[:, :vocab]
        probs = torch.softmax(logits, dim=-1)
        verdicts = []
        self.passes += 1
        self.batch_sizes[len(batch)] = self.batch_sizes.get(len(batch), 0) + 1
        for i, (a, t) in enumerate(zip(batch, cache.counts, strict=True)):
            session = a.session
            session.length += len(a.ids)
            self.forward_tokens += t
            p_unsafe = float(probs[i, session.unsafe].sum()) if session.unsafe else 0.0
            p_safe = float(probs[i, session.safe].sum()) if session.safe else 0.0
            total = p_unsafe + p_safe
            score = p_unsafe / total if total > 0 else 0.5
            verdicts.append(Verdict(score, p_unsafe, p_safe, session.length, t))
        return verdicts


def answer_token_ids(tokenizer: object, words: Sequence[str]) -> list[int]:
    """The token ids whose probability counts for `words`: each word's first token, alone and
    after a space (a template ending in "Answer:" is followed by " safe"). Runs on the tokenizer
    thread."""
    ids: list[int] = []
    for word in words:
        for variant in (word, " " + word.lstrip()):
            encoded = tokenizer(variant, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
            if encoded and encoded[0] not in ids:
                ids.append(int(encoded[0]))
    return ids
