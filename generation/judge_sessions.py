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
the same session waits for the next pass) runs in one forward pass per worker iteration, packed
(`_Pack`): the sessions' new tokens (chunk, then tail) are one row `[1, sum of counts]`, each
token at its own session's position, so every linear layer (the FLOPs) runs once over all of
them with no padding; the attention (`packed_attention`) runs per session, the model's own
attention function on the session's own buffer (columns `0..P_i + t_i`): no prefix is copied and
no session attends over another's length. With grouped-query attention each key/value head's
query heads go in as one group of rows (`[1, kv_heads, groups * t, d]`): transformers' functions
would repeat every key/value head per query head whenever a mask is given (`repeat_kv`), a copy
of the session's whole prefix per layer and pass. (The first version copied every prefix into a
padded rectangle per layer: memory traffic of 16 sessions x 2,000 columns x 30 layers per pass
on smollm2, and every row padded to the longest chunk.)

The packed pass is eager, its shapes new at every append (a prefix that grows), so on a GPU
its cost is mostly the host's: the forward's kernel launches (~7,000 aten ops for smollm2), a
few more per session and layer for the session's attention (the writes are one multi-tensor copy
per layer), and whatever the attention backend does per new shape. cuDNN attention builds a plan
per shape, so passes leave it out (attention_backends.py); the verdicts' probabilities reach the
host in one copy per pass (`_answer_probabilities`), and the pass's ids, positions and answer
rows reach the device in one. On CUDA the static pass (judge_graphs.py) is therefore the
default: the sessions in slots of a fixed pool, the pass padded to bucketed shapes and replayed
from CUDA graphs; the packed pass stays the CPU's default, where a pass is bound by arithmetic
and padding would cost real FLOPs. bench/judge.py prints the time per pass next to a plain
forward of as many tokens, and `--profile` where a pass's time goes.

Answers. An append may ask for the judge's answer text (Llama Guard's category line after the
verdict): when its score reaches `answer_min_score`, the verdict token and greedy tokens after
it are generated in the scratch columns after the tail, a pass per token (Q = 1) for every
session that wants one (`_answers`).

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
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import psutil
import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer

from .attention_backends import changing_shapes
from .decode_graphs import describe_error, plan_free_memory, row_buckets, width_buckets
from .judge_attention import active, as_kind, grouped_attention, install, mask_kind
from .judge_graphs import (
    CPU_POOL_CAPACITY,
    CPU_POOL_SLOTS,
    JUDGE_MEMORY_FRACTION,
    POOL_CAPACITY,
    QUERY_BUCKETS,
    JudgePool,
    StaticJudge,
)
from .models import LoadedModel

log = logging.getLogger("guardstream.engine")

#: Sessions held at once by default (each holds KV rows of its judged prefix).
MAX_SESSIONS = 256
#: A session not used for this long is closed (its KV rows freed) at the next open or append.
IDLE_TIMEOUT_S = 300.0
#: At most this many appends (and tokens through the model) per batched forward pass.
MAX_BATCH = 32
TOKEN_BUDGET = 4096
_COLUMN_QUANTUM = 64
#: The packed pass's sessions grow their own KV rows: together they hold at most this share of
#: the host memory available when the engine starts (a session's buffer may be twice its
#: tokens while it doubles). Without it 256 sessions of smollm2-135m (float32, 45 KB a token)
#: at its 8,192-token context were 90 GiB: the engine killed for memory, every stream with it.
#: The static pass's pool is sized once and bounded by its slots.
PACKED_MEMORY_FRACTION = 0.25


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
    answer_ids: list[int] | None = None  # the answer generated after the tail, when asked


class JudgeSession:
    """A session's state; its buffers are touched by the worker thread only."""

    __slots__ = (
        "closed",
        "id",
        "keys",
        "last_used",
        "length",
        "pending",
        "queued",
        "safe",
        "slot",
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
        self.queued = 0  # prefix tokens of its queued appends (joining the KV rows)
        self.length = 0  # prefix tokens in the KV rows
        self.keys: list[torch.Tensor] = []  # per layer [1, kv_heads, capacity, head_dim]
        self.values: list[torch.Tensor] = []
        self.closed = False
        self.last_used = time.monotonic()
        self.slot = -1  # its slot of the static pass's pool (judge_graphs.py); -1: none

    @property
    def tokens(self) -> int:
        """The judged prefix, in the KV rows or queued (appends not yet run included: a client
        sending appends concurrently cannot pass the limit): what the context limit counts."""
        return self.length + self.queued + len(self.pending)

    def reserve(self, columns: int, like: torch.Tensor, layers: int) -> None:
        """Room for `columns` columns per layer (doubling); `like` gives shape and dtype. Every
        column is kept, the scratch ones too: an answer is generated after the tail's."""
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
                    buffer[:, :, :capacity] = old[layer]
                store.append(buffer)


@dataclasses.dataclass(slots=True)
class _Append:
    session: JudgeSession
    ids: list[int]  # new prefix tokens (queued head and the chunk)
    future: concurrent.futures.Future[Verdict]
    answer_tokens: int = 0  # generate up to this many answer tokens ...
    answer_min_score: float = 0.5  # ... when the score reaches this


class _PackLayer(CacheLayerMixin):
    """One layer of an append pass: writes each session's new keys into its own buffer."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: _Pack, index: int) -> None:
        super().__init__()
        self._owner = owner
        self._index = index

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("the sessions' buffers are allocated by _Pack")

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._owner.write(self._index, key_states, value_states)
        return key_states, value_states  # unused: `packed_attention` reads the sessions' buffers

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1


class _Pack(Cache):
    """One append pass over `batch` (worker thread only). The sessions' new tokens (each its
    chunk, then the tail) are packed into one row, `[1, sum of counts]`, each at its own
    positions: every linear layer runs once over all of them, with no padding. The attention
    (`packed_attention`) runs per session on the session's own buffer, columns `0..P_i+t_i`: its
    prefix is read where it lies, never copied into a shared rectangle, and no session attends
    over another's width."""

    def __init__(
        self, layers: int, rows: list[tuple[JudgeSession, int, list[int]]], mask_kind: str
    ) -> None:
        """`rows`: (session, first position, tokens): an append's chunk and tail at the end of
        its prefix, or an answer's next token after its tail."""
        super().__init__(layers=[_PackLayer(self, i) for i in range(layers)])
        self.num_layers = layers
        self.sessions = [session for session, _p, _ids in rows]
        self.tokens = [t for _s, _p, ids in rows for t in ids]
        self.positions = [q for _s, p, ids in rows for q in range(p, p + len(ids))]
        self.mask_kind = mask_kind  # see `mask_kind`
        self.starts = [p for _s, p, _ids in rows]
        self.counts = [len(ids) for _s, _p, ids in rows]
        self.offsets = list(itertools.accumulate(self.counts, initial=0))[:-1]  # row starts
        self.masks: list[torch.Tensor] = []
        self.masks_groups = 0

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Each session's new keys and values into its buffer: one multi-tensor copy per layer
        (`_foreach_copy_`: on CUDA a launch or a few instead of two per session)."""
        if layer == 0:
            for session, p, t in zip(self.sessions, self.starts, self.counts, strict=True):
                session.reserve(p + t, keys[:, :, :1], self.num_layers)
        targets = [s.keys[layer][:, :, p : p + t] for s, p, t in self._rows()]
        targets += [s.values[layer][:, :, p : p + t] for s, p, t in self._rows()]
        sources = [*keys.split(self.counts, dim=2), *values.split(self.counts, dim=2)]
        torch._foreach_copy_(targets, sources)

    def _rows(self) -> zip[tuple[JudgeSession, int, int]]:
        return zip(self.sessions, self.starts, self.counts, strict=True)

    def session_masks(
        self, dtype: torch.dtype, device: torch.device, groups: int
    ) -> list[torch.Tensor]:
        """Per session `[1, 1, groups * t, P + t]`: query j sees its prefix and its own new tokens
        up to itself, once per query head of a key/value group (`packed_attention`), as the
        attention function takes it (`mask_kind`). Built once per pass, used by every layer."""
        if self.masks_groups != groups:
            self.masks, self.masks_groups = [], groups
            for p, t in zip(self.starts, self.counts, strict=True):
                columns = torch.arange(p + t, device=device)
                rows = torch.arange(p, p + t, device=device)
                mask = columns[None, :] <= rows[:, None]
                if groups > 1:
                    mask = mask.repeat(groups, 1)
                self.masks.append(as_kind(mask, self.mask_kind, dtype)[None, None])
        return self.masks

    def attend(
        self, base: Callable[..., Any], module: torch.nn.Module, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, None]:
        return packed_attention(base, self, module, *args, **kwargs)


def packed_attention(
    base: Callable[..., Any],
    pack: _Pack,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Each session's queries against its own buffer, with the model's own attention function
    `base`: the same call, on the same shapes, as the session judged alone, whatever else is in
    the pass. `query` `[1, H, N, d]` packed; returns `[1, N, H, d]`. With grouped-query
    attention the queries go in grouped per key/value head (`grouped_attention`): the model's
    function would repeat the session's whole prefix per query head (~10% of a 16-stream pass
    of smollm2 on a CPU)."""
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    heads = query.shape[1]
    groups = heads // pack.sessions[0].keys[layer].shape[1]
    masks = pack.session_masks(query.dtype, query.device, groups)
    outputs = []
    for session, (p, q, mask) in zip(
        pack.sessions,
        zip(pack.starts, query.split(pack.counts, dim=2), masks, strict=True),
        strict=True,
    ):
        t = q.shape[2]
        keys = session.keys[layer][:, :, : p + t]
        values = session.values[layer][:, :, : p + t]
        outputs.append(
            grouped_attention(
                base, module, q, keys, values, mask, scaling=scaling, dropout=dropout, **kwargs
            )
        )
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)), None


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
        *,
        static: bool | None = None,
        cuda_graphs: bool | None = None,
        pool_slots: int | None = None,
        pool_capacity: int | None = None,
        memory_fraction: float = JUDGE_MEMORY_FRACTION,
        max_tokens: int | None = None,
    ) -> None:
        """`static`: passes over the static pool (judge_graphs.py; default: on CUDA), replayed
        from CUDA graphs with `cuda_graphs` (default: on CUDA; never on a CPU). The pool is
        allocated by `set_up` (the engine's start): `max_sessions` slots at most (its slots are
        the sessions held) of the model's context up to `pool_capacity` columns (default:
        POOL_CAPACITY on CUDA, CPU_POOL_CAPACITY on a CPU); `pool_slots` fixes the slots
        (default: on CUDA as many as `memory_fraction` of free memory holds, on a CPU
        CPU_POOL_SLOTS). `max_tokens`: the tokens the packed pass's sessions hold together
        (default: PACKED_MEMORY_FRACTION of the host's available memory on a CPU; none on CUDA,
        where the static pool is the default); 429 beyond."""
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
        self.pass_tokens = 0  # tokens the passes put through the model (static: with padding)
        self.packed_passes = 0  # packed forward passes (appends' and answer tokens')
        self._layers = int(getattr(loaded.model.config, "num_hidden_layers", 0)) or len(
            getattr(loaded.model.config, "layer_types", []) or []
        )
        self._mask_kind = mask_kind(getattr(loaded.model.config, "_attn_implementation", ""))
        self._ids = itertools.count()
        self._attention = getattr(loaded.model.config, "_attn_implementation", None) or "eager"
        install(self._attention)
        on_cuda = loaded.device.type == "cuda"
        self.static = on_cuda if static is None else static
        self.cuda_graphs = on_cuda and (cuda_graphs is None or cuda_graphs)
        self.pool_slots = pool_slots
        self.pool_capacity = pool_capacity
        self.memory_fraction = memory_fraction
        self.max_tokens = max_tokens if max_tokens is not None else _packed_budget(loaded)
        self.static_judge: StaticJudge | None = None  # `set_up` makes it (static passes)
        # an engine's worker thread builds the pool when a session first needs it (`ready`);
        # without one (a JudgeSessions on its own), the thread that opens the first session
        self._worker = wake is not None
        self._pool_wanted: concurrent.futures.Future[None] | None = None

    def set_up(self) -> None:
        """The static pass's pool (worker thread): at the engine's start when asked for
        (`Engine(judge_pool_at_start=)`: before the decode cache's plan, which then sees its
        memory gone), else when the first session opens (`ready`), from the memory free then,
        so an engine that never judges holds no pool. A model whose cache is not plain
        per-layer keys and values (sliding windows) keeps the packed pass."""
        if not self.static or self.static_judge is not None:
            return
        loaded = self.loaded
        with torch.inference_mode():
            ids = torch.zeros((1, 1), dtype=torch.long, device=loaded.device)
            template = loaded.model(input_ids=ids, use_cache=True).past_key_values
        if not isinstance(template, DynamicCache) or any(
            type(layer) is not DynamicLayer for layer in template.layers
        ):
            log.warning("this model's KV cache has no static judge pool; judge passes run packed")
            self.static = False
            return
        on_cuda = loaded.device.type == "cuda"
        context = min(
            loaded.max_context,
            self.pool_capacity or (POOL_CAPACITY if on_cuda else CPU_POOL_CAPACITY),
        )
        if on_cuda and self.pool_slots is None:
            plan = plan_free_memory(template, self.memory_fraction, context, self.max_sessions)
            slots, capacity = plan.rows, plan.capacity
        else:
            slots = min(self.max_sessions, self.pool_slots or CPU_POOL_SLOTS)
            capacity = context
        rows = row_buckets(self.max_batch)
        pool = JudgePool(template, slots, capacity, rows[-1], QUERY_BUCKETS[-1])
        self.static_judge = StaticJudge(
            loaded.model,
            pool,
            mask_kind=self._mask_kind,
            rows=rows,
            queries=QUERY_BUCKETS,
            widths=width_buckets(capacity),
            cuda_graphs=self.cuda_graphs,
        )
        self.max_sessions = slots
        log.info(
            "judge sessions: static pool of %d slots x %d tokens, %.1f MiB%s",
            slots,
            capacity,
            pool.nbytes / 2**20,
            ", CUDA graphs" if self.cuda_graphs else "",
        )

    def ready(self) -> concurrent.futures.Future[None] | None:
        """None when sessions can open now; else the future of the pool's building, which the
        worker does at its next iteration (an open's route awaits it, off the event loop's
        back: a pool takes a model call and a large allocation)."""
        with self.lock:
            if not self.static or self.static_judge is not None:
                return None
            if self._pool_wanted is None:
                self._pool_wanted = concurrent.futures.Future()
                self.lock.notify_all()
            return self._pool_wanted

    def _build_pool(self) -> None:
        """`set_up` for the waiting `ready` future (worker thread, or the opening thread without
        a worker). A pool that cannot be built (no memory left for it) leaves the packed pass,
        with a warning: judging goes on, only without graphs."""
        with self.lock:
            wanted = self._pool_wanted
        if wanted is None:
            return
        try:
            self.set_up()
        except Exception as exc:  # torch.OutOfMemoryError above all
            log.warning("no static judge pool (%s): judge passes run packed", describe_error(exc))
            self.static_judge = None
            self.static = False
            if self.loaded.device.type == "cuda":
                torch.cuda.empty_cache()
        finally:
            with self.lock:
                self._pool_wanted = None
            wanted.set_result(None)

    def info(self) -> dict[str, object]:
        """How passes run, for /health, /metrics and the bench: `mode` packed, static or
        cuda_graphs; the pool's slots and capacity, its graphs and their captures and replays."""
        judge = self.static_judge
        if judge is None:
            return {
                # static: the pool is built when the first session opens (`ready`)
                "mode": "static" if self.static else "packed",
                "slots": 0,
                "capacity": self.loaded.max_context,
                "graphs": 0,
                "captures": 0,
                "replays": 0,
                "eager_passes": self.packed_passes,
                "graph_error": None,
            }
        return {
            "mode": "cuda_graphs" if judge.cuda_graphs or judge.graphs else "static",
            "slots": judge.pool.slots,
            "capacity": judge.pool.capacity,
            "graphs": judge.graphs,
            "captures": judge.captures,
            "replays": judge.replays,
            "eager_passes": judge.eager_passes,
            "graph_error": judge.graph_error,
        }

    # ----- event-loop side (any thread; under the lock) ----------------------------------------

    def open(
        self, head: list[int], tail: list[int], unsafe: list[int], safe: list[int]
    ) -> JudgeSession:
        """A new session (429 when `max_sessions` are held after closing idle ones). The
        static pass's pool is built first when it is not yet (`ready`: an engine's route awaits
        that before it calls this, so this waits only for callers off the event loop)."""
        pending = self.ready()
        if pending is not None:
            if self._worker:
                pending.result()
            else:
                self._build_pool()
        with self.lock:
            self._expire()
            # the head is checked here, not at the first append: a session is not held for it
            self._check_room(len(head) + len(tail))
            full = len(self.sessions) >= self.max_sessions
            judge = self.static_judge
            slot: int | None = -1
            if not full and judge is not None:  # the static pass: a slot of the pool
                slot = judge.pool.take()
            if full or slot is None:
                raise JudgeSessionError(
                    429, f"all {self.max_sessions} judge sessions are in use", "too_many_sessions"
                )
            session_id = f"js-{next(self._ids)}-{secrets.token_hex(6)}"
            session = JudgeSession(session_id, head, tail, unsafe, safe)
            session.slot = slot
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
        self,
        session: JudgeSession,
        ids: Sequence[int],
        answer_tokens: int = 0,
        answer_min_score: float = 0.5,
    ) -> concurrent.futures.Future[Verdict]:
        """Queue `ids` for the session's prefix; the future gets the verdict after them (with
        the generated answer when `answer_tokens` > 0 and the score reaches
        `answer_min_score`)."""
        future: concurrent.futures.Future[Verdict] = concurrent.futures.Future()
        with self.lock:
            if session.closed:
                raise JudgeSessionError(404, f"no judge session {session.id!r}", "not_found")
            self._check_room(session.tokens + len(ids) + len(session.tail) + answer_tokens)
            self._check_budget(len(ids) + len(session.tail) + answer_tokens)
            new = session.pending + list(ids)
            if not new and not session.tail:
                raise JudgeSessionError(422, "nothing to judge: no new text and no tail", "empty")
            session.pending = []  # counted as prefix from now on (the limit above)
            session.queued += len(new)
            self.queue.append(_Append(session, new, future, answer_tokens, answer_min_score))
            session.last_used = time.monotonic()
            self.lock.notify_all()
        return future

    def _check_room(self, total: int) -> None:
        """422 when a session's tokens would pass the model's context (the static pool's
        capacity), under the lock."""
        judge = self.static_judge
        limit = self.loaded.max_context if judge is None else judge.pool.capacity
        if total > limit:
            room = "model's context" if judge is None else "judge pool's capacity"
            raise JudgeSessionError(
                422,
                f"the judged text would be {total} tokens with the template, over the "
                f"{room} of {limit}",
                "context_exceeded",
            )

    def _check_budget(self, more: int) -> None:
        """429 when the packed pass's sessions would hold more than `max_tokens` with `more`
        (an append's new tokens, its tail and answer), under the lock."""
        if self.static_judge is not None or self.static or self.max_tokens is None:
            return
        held = sum(s.tokens + len(s.tail) for s in self.sessions.values())
        if held + more > self.max_tokens:
            raise JudgeSessionError(
                429,
                f"the judge sessions hold {held} tokens: {more} more would pass this engine's "
                f"{self.max_tokens}",
                "too_many_tokens",
            )

    def close(self, session_id: str) -> bool:
        with self.lock:
            session = self.sessions.pop(session_id, None)
            if session is None:
                return False
            self._closed(session)
            return True

    def _closed(self, session: JudgeSession) -> None:
        """`session` (just removed from `sessions`) is closed and its slot free (under the
        lock). A pass running it may still write the slot: a session that takes the slot next
        writes its columns before it reads them, and its passes come after."""
        session.closed = True
        if session.slot >= 0 and self.static_judge is not None:
            self.static_judge.pool.give(session.slot)

    def close_all(self, error: BaseException) -> None:
        """The engine stops: every queued append fails."""
        with self.lock:
            queued, self.queue = self.queue, []
            for session in self.sessions.values():
                self._closed(session)
            self.sessions.clear()
        for a in queued:
            if not a.future.done():
                a.future.set_exception(error)

    @property
    def has_work(self) -> bool:
        """Appends are queued, or the pool is wanted (read under the lock by the worker's
        wait)."""
        return bool(self.queue) or self._pool_wanted is not None

    def _expire(self) -> None:
        deadline = time.monotonic() - self.idle_timeout_s
        for session_id in [
            s.id for s in self.sessions.values() if s.last_used < deadline and not self._queued(s)
        ]:
            self._closed(self.sessions.pop(session_id))

    def _queued(self, session: JudgeSession) -> bool:
        return any(a.session is session for a in self.queue)

    # ----- worker side -------------------------------------------------------------------------

    def take_batch(self) -> list[_Append]:
        """The appends of the next pass: oldest first, one per session, within the budgets."""
        with self.lock:
            batch: list[_Append] = []
            rest: list[_Append] = []
            seen: set[int] = set()
            tokens = longest = 0
            judge = self.static_judge
            for a in self.queue:
                cost = len(a.ids) + len(a.session.tail)
                if judge is None:
                    spent = tokens + cost
                else:  # a static pass puts its padded rectangle through the model
                    rows, queries, _width = judge.shape(
                        [max(longest, cost)] * (len(batch) + 1), [1]
                    )
                    spent = rows * queries
                fits = len(batch) < self.max_batch and (not batch or spent <= self.token_budget)
                if id(a.session) in seen or not fits:
                    rest.append(a)
                    continue
                seen.add(id(a.session))
                batch.append(a)
                tokens += cost
                longest = max(longest, cost)
            self.queue = rest
            return batch

    def run_pending(self) -> int:
        """One append pass over the queued appends (worker thread), after building the pool
        when a session waits for it; returns the appends run."""
        self._build_pool()
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
                    if self.sessions.pop(a.session.id, None) is not None:
                        self._closed(a.session)
            for a in live:
                a.future.set_exception(exc)
            return len(batch)
        for a, verdict in zip(live, verdicts, strict=True):
            a.future.set_result(verdict)
        return len(batch)

    @torch.inference_mode()
    def forward(self, batch: list[_Append]) -> list[Verdict]:
        """One forward pass over the batch's new tokens and tails, packed (`_Pack`); then the
        answers asked for, a token per pass for every session that wants one."""
        rows = [(a.session, a.session.length, a.ids + a.session.tail) for a in batch]
        probs = torch.softmax(self._run(rows), dim=-1)
        answer_probs = _answer_probabilities(probs, [a.session for a in batch])
        verdicts = []
        self.passes += 1
        self.batch_sizes[len(batch)] = self.batch_sizes.get(len(batch), 0) + 1
        for a, (_s, _p, tokens), (unsafe, safe) in zip(batch, rows, answer_probs, strict=True):
            session = a.session
            session.length += len(a.ids)
            session.queued -= len(a.ids)  # (after: a limit read meanwhile counts them twice)
            self.forward_tokens += len(tokens)
            p_unsafe = float(unsafe.sum()) if session.unsafe else 0.0
            p_safe = float(safe.sum()) if session.safe else 0.0
            total = p_unsafe + p_safe
            score = p_unsafe / total if total > 0 else 0.5
            verdicts.append(Verdict(score, p_unsafe, p_safe, session.length, len(tokens)))
        answers = self._answers(batch, answer_probs, verdicts)
        for i, ids in answers.items():
            verdicts[i] = dataclasses.replace(verdicts[i], answer_ids=ids)
        return verdicts

    def _answers(
        self,
        batch: list[_Append],
        answer_probs: list[tuple[torch.Tensor, torch.Tensor]],
        verdicts: list[Verdict],
    ) -> dict[int, list[int]]:
        """The answer of each append that asks for one and whose score reaches its
        `answer_min_score`: the verdict (its most probable unsafe token), then greedy tokens up
        to `answer_tokens` or an end-of-sequence token (Llama Guard's category line follows the
        verdict: "unsafe\nS1,S10"). They sit after the tail, in scratch columns the next append
        overwrites."""
        answers: dict[int, list[int]] = {}
        at: dict[int, int] = {}
        for i, (a, verdict) in enumerate(zip(batch, verdicts, strict=True)):
            session = a.session
            if a.answer_tokens and session.unsafe and verdict.score >= a.answer_min_score:
                unsafe = answer_probs[i][0].tolist()
                answers[i] = [session.unsafe[max(range(len(unsafe)), key=unsafe.__getitem__)]]
                at[i] = session.length + len(session.tail)
        eos = self.loaded.eos_token_ids
        while live := [
            i
            for i, ids in answers.items()
            if len(ids) < batch[i].answer_tokens and ids[-1] not in eos
        ]:
            logits = self._run([(batch[i].session, at[i], answers[i][-1:]) for i in live])
            for i, token in zip(live, logits.argmax(dim=-1).tolist(), strict=True):
                answers[i].append(int(token))
                at[i] += 1
        return answers

    def _run(self, rows: list[tuple[JudgeSession, int, list[int]]]) -> torch.Tensor:
        """One forward pass over `rows` (the static pass, or packed); the float64 logits at each
        row's last token."""
        install(self._attention)  # (again: a model loaded after us may have re-registered it)
        judge = self.static_judge
        if judge is not None:
            before = judge.padded_tokens
            logits = judge.run([(s.slot, p, ids) for s, p, ids in rows])
            self.pass_tokens += judge.padded_tokens - before
        else:
            logits = self._packed(rows)
        logits = logits.to(torch.float64)
        vocab = self.loaded.vocab_size
        return logits[:, :vocab] if logits.shape[-1] > vocab else logits  # (padding rows)

    def _packed(self, rows: list[tuple[JudgeSession, int, list[int]]]) -> torch.Tensor:
        """One packed forward pass over `rows` (`_Pack`); the logits at each row's last token."""
        device = self.loaded.device
        pack = _Pack(self._layers, rows, self._mask_kind)
        ends = [o + t - 1 for o, t in zip(pack.offsets, pack.counts, strict=True)]
        active(pack)
        try:
            # every pass attends at shapes of its own (a prefix that grows with every append):
            # no cuDNN attention, which builds a plan per new shape on CUDA (attention_backends)
            # the pass's ids, positions and answer rows reach the device in one copy
            n = len(pack.tokens)
            host = torch.tensor(pack.tokens + pack.positions + ends, dtype=torch.long)
            inputs = host.to(device)
            with changing_shapes(device):
                out = self.loaded.model(
                    input_ids=inputs[None, :n],
                    position_ids=inputs[None, n : 2 * n],
                    # a prepared 4D mask is taken as is: none is built (the sessions' are in `pack`)
                    attention_mask=torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device),
                    past_key_values=pack,
                    use_cache=True,
                    logits_to_keep=inputs[2 * n :],
                )
        finally:
            active(None)
        self.pass_tokens += len(pack.tokens)
        self.packed_passes += 1
        return out.logits[0]  # type: ignore[no-any-return]


def _answer_probabilities(
    probs: torch.Tensor, sessions: list[JudgeSession]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each session's probabilities of its unsafe and of its safe tokens (row i of `probs` is
    `sessions[i]`'s answer position), on the host, in the sessions' token order: one gather and
    one copy for the whole pass (indexing each session's tokens on a GPU cost two host syncs
    per append). The sums over them are the same as over the device's values, in the same
    order."""
    columns = sorted({t for s in sessions for t in (*s.unsafe, *s.safe)})
    where = {t: j for j, t in enumerate(columns)}
    index = torch.tensor(columns, dtype=torch.long, device=probs.device)
    host = probs.index_select(1, index).cpu()
    return [
        (host[i, [where[t] for t in s.unsafe]], host[i, [where[t] for t in s.safe]])
        for i, s in enumerate(sessions)
    ]


def _packed_budget(loaded: LoadedModel) -> int | None:
    """PACKED_MEMORY_FRACTION of the host's available memory in KV tokens (a CPU engine), at
    least one session of the whole context; None on an accelerator."""
    if loaded.device.type != "cpu":
        return None
    config = getattr(loaded.model, "config", None)
    layers = int(getattr(config, "num_hidden_layers", 0) or 1)
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or getattr(config, "hidden_size", 0) // heads)
    # the loaded dtype (a module need not say its own: bench/engine_host.py's null model)
    per_token = layers * kv_heads * max(1, head_dim) * 2 * loaded.dtype.itemsize
    budget = int(psutil.virtual_memory().available * PACKED_MEMORY_FRACTION) // per_token
    return max(budget, loaded.max_context)


def answer_token_ids(tokenizer: object, words: Sequence[str]) -> list[int]:
    """The token ids whose probability counts for `words`: each word's first token that is not
    blank, alone and after a space (a template ending in "Answer:" is followed by " safe"). A
    blank token is no answer ("\nsafe" counted the newline's probability as safe's, and a
    tokenizer that writes " safe" as a space and "safe" the space's). Runs on the tokenizer
    thread."""
    ids: list[int] = []
    for word in words:
        for variant in (word, " " + word.lstrip()):
            encoded = tokenizer(variant, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
            first = next((int(t) for t in encoded if tokenizer.decode([t]).strip()), None)  # type: ignore[attr-defined]
            if first is not None and first not in ids:
                ids.append(first)
    return ids
