"""Seamless request migration (DESIGN section 7): one client-visible stream over as many replica
dispatches as it takes.

MigratingStream remembers the prompt's token ids and every token and character it delivered.
When a replica fails in a way another replica can absorb, it quarantines the failed one and
resumes on another with the same budget, so the client sees one stream whose text deltas
concatenate to exactly what an uninterrupted run would have produced (exact for the native engine
with greedy or seeded decoding). It never re-dispatches a request that finished or was cancelled.

A backend without token ids (`openai` with `api: chat`) resumes from the delivered text alone: its
items say how many tokens they stand for (`EngineDelta.token_count`), and where the prompt's token
count is not known yet, the max_seq_len check estimates it as a quarter of the prompt's characters.

What the pipeline received decides how a request moves (it may have released none of it yet, but
its detectors have seen it, so it can never be taken back): nothing yet, the request goes again as
it came (a restart; tokens counted for text a replica held back are dropped with it); else the new
replica continues it, or, where it cannot continue a partial answer (a chat server without
`continue_final_message`), regenerates the answer and the delivered prefix is checked and skipped
(a replay, clients/replay.py: greedy or seeded decoding only). A replay that differs, or sampling
without a seed there, ends the stream with the original error and why (`_give_up`).

Tool-call fragments are held here until the model finished and go to the pipeline on the final
item: the pipeline releases a call only whole and judged, so holding them costs no latency, and
a replica that dies during a call has delivered nothing of it. The native engine's continuation
carries the token ids, the calls' tokens included: the new replica parses them again and sends
every call whole again, so the held ones are dropped and the stream goes on exactly. Without
token ids (`api: chat`), where nothing else was delivered, the request goes again as it came (a
restart); after delivered text it cannot move (a continuation carries text only) and ends with
the original error and why.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import AsyncGenerator
from types import TracebackType

from prometheus_client import CollectorRegistry, Counter

from .. import tracing
from ..config import MigrationConfig
from .advertised_limits import token_upper_bound
from .backend import (
    CannotContinue,
    Continuation,
    EngineDelta,
    EngineStream,
    GenerationError,
    GenerationRequest,
    ToolCallDelta,
    unavailable,
)
from .replay import Replay, ReplayMismatch, replayable
from .replicas import Replica, ReplicaPool

# What a replica's count of a prompt's tokens may pass advertised_limits.token_upper_bound by: a
# chat template's own text (a long default system prompt, tool-use instructions) is in no
# request, and a genuine count is not cut; a count beyond it is a lie, and is not charged.
TEMPLATE_ALLOWANCE_TOKENS = 4096

# The most text a stream may carry: MAX_CHARS_PER_TOKEN for every token of its budget, past a
# fixed allowance (resumed text, a detokenizer's flush). A token is a few characters (the
# longest of common vocabularies are runs of some hundred spaces); a replica sending more is
# broken or lying, and passing its text on let it fill the orchestrator's memory within any
# token budget (each line is bounded, line_transport.MAX_LINE_BYTES, but not their number: a
# chat server's usage can count its events as no tokens at all).
MAX_CHARS_PER_TOKEN = 1024
TEXT_ALLOWANCE_CHARS = 1 << 16

log = logging.getLogger("guardstream.migration")

# Replicas that answer one request with an internal error (HTTP 500) before it is given up: the
# first may be a replica's own fault (tried elsewhere, no quarantine), a second makes it the
# request's (a replica that answered 500 is alive; quarantining each in turn let one request
# take every replica of a model out)
INTERNAL_ERRORS_PER_REQUEST = 2


REPLAY_OUTCOMES = ("matched", "mismatched")


class MigrationMetrics:
    """Counters of migrations and of the failures migration could not absorb."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        # a private registry by default: tests build many, and the global one rejects duplicates
        r = registry if registry is not None else CollectorRegistry()
        self.registry = r
        self.migrations = Counter(
            "guardstream_migrations",
            "Replacement dispatches of a request to another replica",
            ["model_id", "kind"],  # kind: before_first_token | mid_stream
            registry=r,
        )
        self.exhausted = Counter(
            "guardstream_migrations_exhausted",
            "Requests that failed because the migration limit or the replicas ran out",
            ["model_id"],
            registry=r,
        )
        self.unmigratable = Counter(
            "guardstream_generation_unmigratable",
            "Generation failures that could not be migrated",
            # engine_error | max_seq_len | no_prompt_ids | cannot_continue | replay_mismatch |
            # tool_call (a tool call had begun: a continuation carries text only)
            ["model_id", "reason"],
            registry=r,
        )
        self.replays = Counter(
            "guardstream_migration_replays",
            "Migrations to a replica that cannot continue a partial answer, whose regeneration "
            "of the delivered text matched it or not",
            ["model_id", "outcome"],  # matched | mismatched
            registry=r,
        )
        self.replica_failures = Counter(
            "guardstream_replica_failures",
            "Failed dispatches by replica",
            ["model_id", "replica"],
            registry=r,
        )
        self.completed_locally = Counter(
            "guardstream_generation_completed_after_failure",
            "Streams whose replica failed after the model had finished (no re-dispatch)",
            ["model_id"],
            registry=r,
        )

    def known_model(self, model_id: str) -> None:
        """The model's replay outcomes shown at 0 from the start (a series that appears only
        at its first increase is invisible to rate() and increase() until then)."""
        for outcome in REPLAY_OUTCOMES:
            self.replays.labels(model_id, outcome)


class _GaveUp(GenerationError):
    """A failure migration decided not to absorb (limit, max_seq_len, a replay that cannot be
    made): surfaced as it is, counted where it was decided."""


# Items one reader wake-up takes from a replica's buffered stream at most (next_batch).
BATCH_ITEMS = 256


class MigratingStream:
    """AsyncIterator[EngineDelta] over one or more replica dispatches; `next_batch()` gives
    the chunks of every item already buffered at once (the pipeline's reader uses it).

    Raises GenerationError when generation cannot go on; `aclose()` (or leaving `async with`)
    drops the engine connection and never re-dispatches."""

    def __init__(
        self,
        *,
        model_id: str,
        pool: ReplicaPool,
        request: GenerationRequest,
        migration: MigrationConfig,
        metrics: MigrationMetrics | None = None,
    ) -> None:
        self.model_id = model_id
        self.request = request
        self.migrations = 0
        self.finish_reason: str | None = None
        self.generated_token_count = 0
        self.input_token_count: int | None = None
        # the request's seed, or the one the engine drew and reported for a sampling request
        self.seed: int | None = request.params.seed
        self.replicas_used: list[str] = []
        self._pool = pool
        self._cfg = migration
        self._metrics = metrics
        self._prompt_ids: tuple[int, ...] | None = None
        self._prompt_bound: int | None = None  # token_upper_bound of the request, once needed
        self._ids: list[int] = []
        self._generated = 0  # len(self._ids), or the items' token_count where they carry no ids
        self._text: list[str] = []
        self._chars = 0  # the text the replicas sent, checked by `_check_text`
        self._calls: list[ToolCallDelta] = []  # tool-call fragments, held until the finish
        self._closed = False
        self._internal_errors = 0  # replicas that answered HTTP 500 (`replica_fault` False)
        self._failed_alive: Replica | None = None  # the last of them: the next try goes elsewhere
        self._busy: list[Replica] = []  # replicas that answered 429: never tried again
        self._current: EngineStream | None = None
        self._replay: Replay | None = None  # the prefix the current dispatch regenerates
        self._started = time.monotonic()
        self._gen: AsyncGenerator[list[EngineDelta], None] = self._run()
        self._pending: deque[EngineDelta] = deque()  # of a batch, for `__anext__`
        self._batch_items = BATCH_ITEMS

    # -- public ---------------------------------------------------------------------------------

    @property
    def text(self) -> str:
        """Everything delivered so far."""
        return "".join(self._text)

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(self._ids)

    def __aiter__(self) -> MigratingStream:
        return self

    async def __anext__(self) -> EngineDelta:
        if self._closed:
            raise StopAsyncIteration
        if not self._pending:
            self._pending.extend(await self._gen.__anext__())
        return self._pending.popleft()

    async def next_batch(self, max_items: int = BATCH_ITEMS) -> list[EngineDelta]:
        """The next chunk and every further one whose item the replica had already sent, up to
        `max_items` (one wake-up of the reader for a burst, not one per token);
        StopAsyncIteration at the end."""
        if self._closed:
            raise StopAsyncIteration
        if self._pending:
            batch = list(self._pending)
            self._pending.clear()
            return batch
        self._batch_items = max_items
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        """Cancel: drop the engine connection now; nothing is dispatched after this."""
        self._closed = True
        if self._current is not None:
            self._current.close()
        try:
            await self._gen.aclose()
        except RuntimeError:
            pass  # being iterated by another task; its read fails on the closed connection

    async def __aenter__(self) -> MigratingStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # -- the work -------------------------------------------------------------------------------

    async def _run(self) -> AsyncGenerator[list[EngineDelta], None]:
        rid = self.request.request_id or "-"
        original: GenerationError | None = None  # the first failure that was not a 429
        busy: GenerationError | None = None  # the first 429 (a replica at its bound)
        attempt = 0
        while True:
            replica = self._pool.acquire(avoid=self._failed_alive, exclude=self._busy)
            if replica is None:
                if original is None and busy is not None:
                    # turned away by every replica at its bound, and by nothing else: the
                    # fleet is overloaded, not broken (clients retry a 429 after Retry-After)
                    raise GenerationError(
                        f"every replica of model `{self.model_id}` is at capacity ({busy.message})",
                        error_type="overloaded",
                        code=429,
                    )
                if original is None:
                    raise GenerationError(
                        f"no healthy replica of model `{self.model_id}` is available",
                        error_type="generation_unavailable",
                        code=503,
                    )
                self._count_exhausted()
                why = "every other replica is busy or unavailable" if self._busy else ""
                raise self._give_up(original, why or "no other healthy replica")
            attempt += 1
            self.replicas_used.append(replica.name)
            if attempt > 1:
                log.info(
                    "request %s: attempt %d on replica %s after %d delivered tokens",
                    rid,
                    attempt,
                    replica.name,
                    self._generated,
                )
            # the attempt's span, named by the engine call's traceparent (None: tracing is off)
            traced = tracing.start_attempt(attempt, replica.name, self._generated)
            stream: EngineStream | None = None
            try:
                stream = self._dispatch(replica, original)
                while True:
                    try:
                        items = await self._read(stream)
                    except StopAsyncIteration:
                        break
                    except CannotContinue:
                        # the replica was just found to refuse a partial answer: replay there
                        if (
                            self._replay is not None
                            or replica.client.continuation_refused() is None
                        ):
                            raise
                        stream.close()
                        stream = self._dispatch(replica, original)
                        continue
                    items, too_much = self._within_text_bound(items, replica)
                    try:
                        chunks = self._take(items)
                    except ReplayMismatch as mismatch:
                        self._count_replay("mismatched")
                        self._count_unmigratable("replay_mismatch")
                        raise self._give_up(
                            original,
                            f"the answer regenerated on replica {replica.name} {mismatch.why}",
                        ) from None
                    if chunks:
                        yield chunks
                    if too_much is not None:
                        raise too_much
                if self.finish_reason is None:
                    if self._budget_spent():
                        yield [self._local_finish()]
                        return
                    raise GenerationError(
                        f"replica {replica.name} ended the stream without a finish_reason",
                        error_type="generation_unavailable",
                        code=503,
                        migratable=True,
                    )
                return
            except GenerationError as exc:
                if self._closed:
                    return  # aclose() dropped the connection under a running read
                if traced is not None:
                    traced.failed(exc.message, exc.error_type, exc.migratable)
                if isinstance(exc, _GaveUp):
                    raise  # counted where it was decided
                if exc.migratable and exc.busy:
                    # alive, at its bound, and nothing of this dispatch was delivered: elsewhere
                    # and not again, which is load balancing, not a migration (no count, no
                    # limit: the replicas bound it)
                    self._busy.append(replica)
                    busy = busy or exc
                    log.info(
                        "request %s: replica %s is busy (attempt %d); trying another",
                        rid,
                        replica.name,
                        attempt,
                    )
                    continue
                if exc.migratable and exc.replica_fault:
                    self._pool.quarantine(replica, exc.message)
                    if self._metrics is not None:
                        self._metrics.replica_failures.labels(self.model_id, replica.name).inc()
                elif exc.migratable:  # an internal error answered for this request
                    self._internal_errors += 1
                    self._failed_alive = replica
                    if self._internal_errors >= INTERNAL_ERRORS_PER_REQUEST:
                        self._count_unmigratable("internal_error")
                        raise GenerationError(
                            f"{exc.message} (not migrated: {self._internal_errors} replicas "
                            "answered this request with an internal error)",
                            error_type="generation_error",
                            code=502,
                        ) from None
                if self.finish_reason is not None or self._budget_spent():
                    # the model had finished: nothing to re-dispatch
                    log.warning(
                        "request %s: replica %s failed after the model finished (%d tokens): "
                        "%s; completing without re-dispatch",
                        rid,
                        replica.name,
                        self._generated,
                        exc.message,
                    )
                    if self._metrics is not None:
                        self._metrics.completed_locally.labels(self.model_id).inc()
                    if self.finish_reason is None:
                        yield [self._local_finish()]
                    return
                if not exc.migratable:
                    self._count_unmigratable("engine_error")
                    log.warning(
                        "request %s: replica %s failed (attempt %d, %d tokens delivered), "
                        "not migratable: %s",
                        rid,
                        replica.name,
                        attempt,
                        self._generated,
                        exc.message,
                    )
                    raise
                original = original or exc
                self._check_migratable(original, replica, attempt)
                kind = "mid_stream" if self._ids or self._text else "before_first_token"
                self.migrations += 1
                if traced is not None:
                    traced.migrating(kind, self.migrations)
                if self._metrics is not None:
                    self._metrics.migrations.labels(self.model_id, kind).inc()
                log.warning(
                    "request %s: replica %s failed (attempt %d, %d tokens delivered): %s; "
                    "migrating (%s, migration %d of at most %d)",
                    rid,
                    replica.name,
                    attempt,
                    self._generated,
                    exc.message,
                    kind,
                    self.migrations,
                    self._cfg.limit,
                )
            finally:
                if stream is not None:
                    stream.close()
                self._current = None
                self._replay = None
                self._pool.release(replica)
                if traced is not None:
                    traced.end(self._generated)

    def _check_migratable(self, original: GenerationError, replica: Replica, attempt: int) -> None:
        """Raise the give-up error when this request may not move to another replica."""
        rid = self.request.request_id or "-"
        if self.migrations >= self._cfg.limit:
            self._count_exhausted()
            log.warning(
                "request %s: migration limit %d reached (replica %s, attempt %d, %d tokens)",
                rid,
                self._cfg.limit,
                replica.name,
                attempt,
                self._generated,
            )
            raise self._give_up(original, f"migration limit {self._cfg.limit} reached")
        prompt_len = (
            len(self._prompt_ids)
            if self._prompt_ids is not None
            else self.input_token_count or self._estimated_prompt_len()
        )
        if prompt_len + self._generated > self._cfg.max_seq_len:
            self._count_unmigratable("max_seq_len")
            raise self._give_up(
                original,
                f"{prompt_len} prompt + {self._generated} generated tokens exceed "
                f"max_seq_len {self._cfg.max_seq_len}",
            )
        if self._calls and self._ids:
            # the native engine: the token ids carry the calls, which it sends again whole
            self._calls = []
        elif self._calls and self._text:
            # a continuation carries text only: another replica would not go on with the call
            self._count_unmigratable("tool_call")
            raise self._give_up(original, "a tool call had begun after delivered text")
        elif self._calls:  # only a call was under way, none of it delivered: a restart
            self._calls = []
            self._generated = self.generated_token_count = 0
        if self._ids and self._prompt_ids is None:
            self._count_unmigratable("no_prompt_ids")
            raise self._give_up(original, "the replica never sent the prompt's token ids")

    def _estimated_prompt_len(self) -> int:
        """A prompt whose token count no replica reported yet (`api: chat` fails before its usage
        chunk): about four characters a token."""
        r = self.request
        chars = sum(len(m.content) for m in r.messages) if r.messages is not None else len(r.prompt)
        return chars // 4

    def _give_up(self, original: GenerationError | None, why: str) -> GenerationError:
        """The error a migration that cannot be made ends with: the original failure, and why
        it was not migrated (DESIGN 7). `original` is None only before any failure, where no
        migration is attempted."""
        head = original.message if original is not None else "generation failed"
        return _GaveUp(
            f"{head} (not migrated: {why})", error_type="generation_unavailable", code=503
        )

    def _count_replay(self, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.replays.labels(self.model_id, outcome).inc()

    def _count_exhausted(self) -> None:
        if self._metrics is not None:
            self._metrics.exhausted.labels(self.model_id).inc()

    def _count_unmigratable(self, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.unmigratable.labels(self.model_id, reason).inc()

    def _dispatch(self, replica: Replica, original: GenerationError | None) -> EngineStream:
        """Start this attempt's stream: the request as it came when the pipeline received
        nothing yet (a restart), else a continuation of what it received; on a replica that
        cannot continue a partial answer, the request as it came again with the delivered
        prefix to replay (`Replay`), where the decoding is deterministic."""
        continuation = self._continuation()
        self._replay = None
        if continuation is None:
            # tokens counted for text the pipeline never received (held back by a replica's
            # stop-sequence gate) are generated again: the count restarts with the text
            self._generated = self.generated_token_count = 0
        else:
            refused = replica.client.continuation_refused()
            if refused is not None:
                if not replayable(self.request.params):
                    self._count_unmigratable("cannot_continue")
                    raise self._give_up(
                        original, f"{refused} and sampling without a seed cannot be regenerated"
                    )
                log.info(
                    "request %s: replica %s cannot continue a partial answer: regenerating "
                    "the %d delivered characters to check and skip them",
                    self.request.request_id or "-",
                    replica.name,
                    len(continuation.text),
                )
                self._replay = Replay(continuation.text, continuation.token_ids)
                continuation = None
        stream = replica.client.generate(
            self.request,
            continuation,
            stall_timeout_s=self._cfg.stall_timeout_s,
            max_time=self._remaining_time(),
        )
        self._current = stream
        return stream

    async def _read(self, stream: EngineStream) -> list[EngineDelta]:
        """The stream's next items: a buffered burst where the stream can give one."""
        next_batch = getattr(stream, "next_batch", None)
        if next_batch is not None:
            items: list[EngineDelta] = await next_batch(self._batch_items)
            return items
        return [await anext(stream)]

    def _within_text_bound(
        self, items: list[EngineDelta], replica: Replica
    ) -> tuple[list[EngineDelta], GenerationError | None]:
        """`items` up to the one that takes the stream's text past what its budget can carry
        (MAX_CHARS_PER_TOKEN), and then the replica's failure: what came before it is
        delivered (a migration resumes after it), nothing of it or after it."""
        limit = TEXT_ALLOWANCE_CHARS + MAX_CHARS_PER_TOKEN * self.request.params.max_new_tokens
        for k, item in enumerate(items):
            self._chars += len(item.text)
            if self._chars > limit:
                budget = self.request.params.max_new_tokens
                return items[:k], unavailable(
                    f"replica {replica.name} sent more than {limit} characters for a budget "
                    f"of {budget} tokens"
                )
        return items, None

    def _take(self, items: list[EngineDelta]) -> list[EngineDelta]:
        """The chunks of a read; during a replay, only what follows the delivered prefix."""
        if self._replay is None:
            return [c for c in map(self._accept, items) if c is not None]
        chunks = []
        for item in items:
            replay = self._replay
            if replay is not None:
                if self.input_token_count is None and item.input_token_count is not None:
                    self.input_token_count = self._believed_input_count(item.input_token_count)
                was_done = replay.done
                rest = replay.take(item)
                if not replay.done:
                    continue
                if not was_done:
                    # the prefix is regenerated: the count is the new replica's, as it would
                    # be without the failure (it also drops tokens counted for held-back text)
                    self._generated = self.generated_token_count = replay.tokens
                    self._count_replay("matched")
                if replay.finished:
                    self._replay = None
                if rest is None:
                    continue
                item = rest
            chunk = self._accept(item)
            if chunk is not None:
                chunks.append(chunk)
        return chunks

    def _continuation(self) -> Continuation | None:
        """None before the first token: a failure then re-sends the request as it came. Without
        token ids (`api: chat`) the continuation is the delivered text and its token count."""
        if self._ids and self._prompt_ids is not None:
            prompt_ids = self._prompt_ids
        elif not self._ids and self._text:
            prompt_ids = ()
        else:
            return None
        return Continuation(
            prompt_token_ids=prompt_ids,
            token_ids=tuple(self._ids),
            text=self.text,
            seed=self.seed,
            generated_token_count=self._generated,
        )

    def _remaining_time(self) -> float:
        max_time = self.request.params.max_time
        if max_time <= 0:
            return 0.0
        return max(0.001, max_time - (time.monotonic() - self._started))

    def _budget_spent(self) -> bool:
        p = self.request.params
        if self._generated >= p.max_new_tokens:
            return True
        return p.max_time > 0 and time.monotonic() - self._started >= p.max_time

    def _local_finish(self) -> EngineDelta:
        """The final chunk of a stream whose model finished but whose replica never said so."""
        p = self.request.params
        self.finish_reason = "MAX_TOKENS" if self._generated >= p.max_new_tokens else "TIME_LIMIT"
        return self._chunk((), "", self._take_calls())

    def _accept(self, item: EngineDelta) -> EngineDelta | None:
        if not self._ids and item.prompt_token_ids is not None:
            self._prompt_ids = item.prompt_token_ids
        if not self._ids and item.seed is not None and self.request.params.seed is None:
            self.seed = item.seed
        if self.input_token_count is None:
            if item.input_token_count is not None:
                self.input_token_count = self._believed_input_count(item.input_token_count)
            elif item.prompt_token_ids is not None:
                self.input_token_count = self._believed_input_count(len(item.prompt_token_ids))
        self._ids.extend(item.token_ids)
        n = len(item.token_ids) if item.token_count is None else item.token_count
        # no replica generates more than the budget it was asked for: a count past it (a server's
        # usage claiming 10**12 tokens) is not believed. It was reported to the client, counted
        # in the metrics and charged to the tenant's token budget.
        self._generated = min(self._generated + n, self.request.params.max_new_tokens)
        if item.text:
            self._text.append(item.text)
        self.generated_token_count = self._generated
        if item.finish_reason is not None:
            self.finish_reason = item.finish_reason
        if item.tool_calls:
            self._calls.extend(item.tool_calls)
        if item.finish_reason is None:
            if not item.token_ids and not item.text:
                return None
            return self._chunk(item.token_ids, item.text)
        return self._chunk(item.token_ids, item.text, self._take_calls())

    def _believed_input_count(self, count: int) -> int:
        """A replica's count of the prompt's tokens, at most what the prompt can hold: a count
        past it (a server's usage claiming 10**12 prompt tokens) is not believed. It was
        reported to the client, counted in the metrics and charged to the tenant's budget."""
        if self._prompt_bound is None:
            self._prompt_bound = token_upper_bound(self.request) + TEMPLATE_ALLOWANCE_TOKENS
        return min(count, self._prompt_bound)

    def _take_calls(self) -> tuple[ToolCallDelta, ...]:
        """The held tool-call fragments, for the final item."""
        calls, self._calls = tuple(self._calls), []
        return calls

    def _chunk(
        self, token_ids: tuple[int, ...], text: str, calls: tuple[ToolCallDelta, ...] = ()
    ) -> EngineDelta:
        return EngineDelta(
            token_ids,
            text,
            self.finish_reason,
            input_token_count=self.input_token_count or 0,
            generated_token_count=self._generated,
            tool_calls=calls,
        )
