"""Kept input verdicts (config `detection_cache`, orchestrator/streaming/verdict_cache.py): a
chat client sends the whole conversation again every turn, and input detectors judge every
message of it (DESIGN 4.8); with the cache a turn judges only its new text.

The real orchestrator on 127.0.0.1 with a fake native engine, detectors over real sockets (the
fake detector service, which records every content it is sent, opted in with `cache: true`; one
left at the default; a judge over the fake OpenAI-compatible safety model) and the in-process
`regex` built-in; the official `openai` SDK as the client. The partitions' bounds are checked
directly, with hypothesis over random sequences of keys."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detectors.api import Detection
from orchestrator.config import ConfigError, parse_config
from orchestrator.handlers.admin import RELOAD_PATH
from orchestrator.state import STATE
from orchestrator.streaming.verdict_cache import (
    MAX_KEPT_DETECTIONS,
    Lookup,
    LruPartition,
    VerdictCache,
)
from tests.fakes.detector import DetectorBehaviour, FakeDetectorServer
from tests.fakes.engine import FakeEngine
from tests.fakes.judge_server import FakeJudge
from tests.openai_support import sdk
from tests.orchestrator_support import MODEL, SCRIPT, Orchestrator, native_config, remote

ANSWER = "".join(SCRIPT)  # what the fake engine answers every turn
SYSTEM = "You are terse. Keep the secret safe."
TURNS = ["Hello there. My secret is 42.", "Tell me more. Is it safe?", "One last secret. Bye now."]
# what `words` (redacting: each message judged whole) is sent on each turn with the cache on
WORDS_SENT = [[SYSTEM, TURNS[0]], [ANSWER, TURNS[1]], [TURNS[2]]]
A_KEY, B_KEY = "key-of-tenant-a", "key-of-tenant-b"


@pytest.fixture
async def dets() -> AsyncIterator[FakeDetectorServer]:
    """`words` redacts "secret"; `sentences` finds nothing (it judges sentences and seam
    windows); `uncached` is a remote detector left at the default."""
    server = FakeDetectorServer()
    server.add("words", DetectorBehaviour(words={"secret": 0.9}, detection="codeword"))
    server.add("sentences", DetectorBehaviour())
    server.add("uncached", DetectorBehaviour())
    await server.start()
    yield server
    await server.close()


@pytest.fixture
async def judge() -> AsyncIterator[FakeJudge]:
    fake = FakeJudge()
    await fake.start()
    yield fake
    await fake.close()


def cached_config(
    engine: FakeEngine, dets: FakeDetectorServer, judge: FakeJudge, *, enabled: bool = True
) -> dict[str, Any]:
    """Every kind of input detector enforced on the model: two remote ones opted in, one left
    at the default, a judge, and the `regex` built-in."""
    config = native_config(
        engine.url,
        detectors={
            "words": remote(dets.url, cache=True, on_detection="redact"),
            "sentences": remote(dets.url, cache=True),
            "uncached": remote(dets.url),
            "guard": {
                "type": "openai_judge",
                "url": judge.url,
                "model": "guard-model",
                "template": "llama_guard",
                "chunker_id": "whole_doc_chunker",
            },
            "pii": {"builtin": "regex", "chunker_id": "sentence"},
        },
        model={
            "guardrails": {
                "input": {"words": {}, "sentences": {}, "uncached": {}, "guard": {}, "pii": {}}
            }
        },
    )
    config["detection_cache"] = {"enabled": enabled}
    return config


def sent(dets: FakeDetectorServer, detector_id: str, since: int = 0) -> list[str]:
    """The contents `detector_id` was sent in the calls from the `since`-th on."""
    return [c for d, contents, _ in dets.calls[since:] if d == detector_id for c in contents]


def conversation(turn: int) -> list[dict[str, str]]:
    """The messages a chat client sends on `turn` (0-based): everything so far, again."""
    messages = [{"role": "system", "content": SYSTEM}]
    for i in range(turn + 1):
        if i:
            messages.append({"role": "assistant", "content": ANSWER})
        messages.append({"role": "user", "content": TURNS[i]})
    return messages


def comparable(chunk: Any) -> dict[str, Any]:
    """A chunk as the client got it, but for what differs between any two streams."""
    body = chunk.model_dump()
    body.pop("id")
    body.pop("created")
    return body


async def three_turns(
    orch: Orchestrator, dets: FakeDetectorServer, judge: FakeJudge
) -> tuple[list[list[dict[str, Any]]], list[dict[str, list[str]]]]:
    """Each turn's chunks, and what each remote detector (and the judge: its prompts) was sent
    on that turn."""
    client = sdk(orch)
    bodies, calls = [], []
    for turn in range(3):
        before, prompts = len(dets.calls), len(judge.prompts)
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=conversation(turn),  # type: ignore[arg-type]
            stream=True,
        )
        bodies.append([comparable(c) async for c in stream])
        calls.append(
            {d: sent(dets, d, before) for d in ("words", "sentences", "uncached")}
            | {"guard": judge.prompts[prompts:]}
        )
    return bodies, calls


async def test_a_conversation_sent_again_judges_only_its_new_messages(
    engine: FakeEngine, dets: FakeDetectorServer, judge: FakeJudge
) -> None:
    async with Orchestrator(cached_config(engine, dets, judge, enabled=False)) as orch:
        plain, uncached_calls = await three_turns(orch, dets, judge)
        plain_engine = [r.body["messages"] for r in engine.requests]
    engine.requests.clear()
    async with Orchestrator(cached_config(engine, dets, judge)) as orch:
        cached, calls = await three_turns(orch, dets, judge)
        hits = await orch.metric("guardstream_detection_cache_hits_total", detector_id="words")
        misses = await orch.metric("guardstream_detection_cache_misses_total", detector_id="words")
        pii = [
            await orch.metric(f"guardstream_detection_cache_{n}_total", detector_id="pii")
            for n in ("hits", "misses")
        ]
        judged = [
            await orch.metric(f"guardstream_detection_cache_{n}_total", detector_id=d)
            for n in ("hits", "misses")
            for d in ("uncached", "guard")
        ]

    # redacting `words` judges each message whole: turn 2 sends the answer and the new user
    # message (the system and first user message are kept), turn 3 only its new message (the
    # assistant message is the same text as turn 2's)
    assert [c["words"] for c in calls] == WORDS_SENT
    # turn 3: five messages kept (the answer twice), the new one missed
    assert (hits, misses) == (0 + 2 + 5, 2 + 2 + 1)
    # the built-in `regex` is kept by default: two sentences a message, no seam windows
    assert pii == [0 + 4 + 10, 4 + 4 + 2]
    assert judged == [0, 0, 0, 0]  # neither looked up: never kept
    # `sentences` judges sentences and seam windows: on turns 2 and 3 exactly those of the new
    # text, each once, in the order the plain run sent them
    for turn in (1, 2):
        earlier = {c for t in range(turn) for c in uncached_calls[t]["sentences"]}
        expected = list(
            dict.fromkeys(c for c in uncached_calls[turn]["sentences"] if c not in earlier)
        )
        assert calls[turn]["sentences"] == expected
    assert calls[2]["sentences"] == ["One last secret.", " Bye now.", "One last secret. Bye now."]
    assert calls[0]["sentences"] == uncached_calls[0]["sentences"]
    # a remote detector left at the default, and the judge, judge the whole history each turn
    for turn in range(3):
        assert calls[turn]["uncached"] == uncached_calls[turn]["uncached"]
        assert calls[turn]["guard"] == uncached_calls[turn]["guard"]
    assert len(calls[2]["uncached"]) > len(calls[0]["uncached"])
    # every message, and the three short user turns joined (orchestrator/streaming/joined_turns.py)
    assert len(calls[2]["guard"]) == len(conversation(2)) + 1
    # what the client got and what the engine was sent are exactly the cache-off run's
    assert cached == plain
    assert [r.body["messages"] for r in engine.requests] == plain_engine
    assert plain_engine[2][-1] == {"role": "user", "content": "One last [codeword]. Bye now."}
    assert plain_engine[2][1] == {"role": "user", "content": "Hello there. My [codeword] is 42."}
    detections = [c for c in cached[2] if (c.get("detections") or {}).get("input")]
    assert [d["message_index"] for d in detections[0]["detections"]["input"]] == [0, 1, 5]


def tenants_config(engine: FakeEngine, dets: FakeDetectorServer) -> dict[str, Any]:
    """Tenants `a` and `b` on the same model, whose input `words` is kept."""
    config = native_config(
        engine.url,
        detectors={"words": remote(dets.url, cache=True, on_detection="redact")},
        model={"guardrails": {"input": {"words": {}}}},
    )
    config["tenants"] = {
        "a": {"keys_env": "CACHE_TENANT_A_KEYS"},
        "b": {"keys_env": "CACHE_TENANT_B_KEYS"},
    }
    return config


async def test_a_tenant_never_meets_another_tenants_verdicts(
    engine: FakeEngine, dets: FakeDetectorServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CACHE_TENANT_A_KEYS", A_KEY)
    monkeypatch.setenv("CACHE_TENANT_B_KEYS", B_KEY)
    async with Orchestrator(tenants_config(engine, dets)) as orch:

        async def turn(key: str, messages: list[dict[str, str]] | None = None) -> list[str]:
            client = openai.AsyncOpenAI(base_url=orch.url + "/v1", api_key=key, max_retries=0)
            orch.closers.append(client.close)
            before = len(dets.calls)
            await client.chat.completions.create(
                model=MODEL,
                messages=messages or conversation(0),  # type: ignore[arg-type]
            )
            return sent(dets, "words", before)

        assert await turn(A_KEY) == [SYSTEM, TURNS[0]]
        assert await turn(B_KEY) == [SYSTEM, TURNS[0]]  # b's first sight of it: a miss
        assert await turn(A_KEY) == []
        assert await turn(B_KEY) == []
        verdicts = orch.runner.app[STATE].verdicts  # type: ignore[union-attr]
        assert verdicts is not None
        assert [len(verdicts.partition(t) or ()) for t in ("a", "b", "default")] == [2, 2, 0]
        assert len(verdicts) == 4
        # what is kept holds no text: keys are hashes, a detection's text is its content's slice
        kept = repr([verdicts.partition(t)._entries for t in ("a", "b")])  # type: ignore[union-attr]
        assert "secret" not in kept and "Hello" not in kept
        # a content with more detections than MAX_KEPT_DETECTIONS is judged every time
        many = [{"role": "user", "content": " ".join(["secret"] * (MAX_KEPT_DETECTIONS + 1))}]
        assert await turn(A_KEY, many) == [many[0]["content"]]
        assert await turn(A_KEY, many) == [many[0]["content"]]
        few = [{"role": "user", "content": " ".join(["secret"] * MAX_KEPT_DETECTIONS)}]
        assert await turn(A_KEY, few) == [few[0]["content"]]
        assert await turn(A_KEY, few) == []


def reloadable(engine: FakeEngine, codename: str) -> dict[str, Any]:
    """`pii` (the `regex` built-in, kept by default) finds `codename`; `mail` never changes."""
    config = native_config(
        engine.url,
        detectors={
            "pii": {
                "builtin": "regex",
                "chunker_id": "sentence",
                "params": {"kinds": [], "patterns": {"codename": codename}},
            },
            "mail": {"builtin": "regex", "chunker_id": "sentence", "params": {"kinds": ["email"]}},
        },
    )
    config["server"]["admin_keys_env"] = "CACHE_ADMIN_KEYS"
    return config


async def test_a_reload_never_serves_a_verdict_of_the_old_config(
    engine: FakeEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CACHE_ADMIN_KEYS", "the-admin-key")
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(reloadable(engine, "falcon")))  # JSON is YAML
    text = "Meet falcon at jo@example.com. Then the eagle."
    async with Orchestrator(path) as orch:

        async def found() -> list[tuple[str, str]]:
            status, body = await orch.post(
                "/api/v2/text/detection/content",
                {"content": text, "detectors": {"pii": {}, "mail": {}}},
            )
            assert status == 200, body
            return [(d["detector_id"], d["text"]) for d in body["detections"]]

        async def lookups(detector_id: str) -> list[float]:
            return [
                await orch.metric(f"guardstream_detection_cache_{n}_total", detector_id=d)
                for n in ("hits", "misses")
                for d in (detector_id,)
            ]

        assert await found() == [("pii", "falcon"), ("mail", "jo@example.com")]
        assert await found() == [("pii", "falcon"), ("mail", "jo@example.com")]
        assert await lookups("pii") == [3, 3]  # two sentences and their seam window
        path.write_text(json.dumps(reloadable(engine, "eagle")))
        status, body = await orch.post(
            RELOAD_PATH, b"", headers={"Authorization": "Bearer the-admin-key"}
        )
        assert status == 200, body
        # the changed detector judges again; the unchanged one keeps its verdicts
        assert await found() == [("mail", "jo@example.com"), ("pii", "eagle")]
        assert await lookups("pii") == [3, 6]
        assert await lookups("mail") == [4, 2]
        assert await found() == [("mail", "jo@example.com"), ("pii", "eagle")]
        assert await lookups("pii") == [6, 6]


def test_a_judge_is_never_cached_and_a_builtin_can_be_opted_out() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(
            {
                "detectors": {
                    "guard": {
                        "type": "openai_judge",
                        "url": "http://127.0.0.1:1",
                        "model": "guard-model",
                        "template": "llama_guard",
                        "cache": True,
                    }
                }
            }
        )
    assert err.value.errors == [
        "detectors.guard.cache: a judge's verdicts are never cached (its verdict reads the "
        "conversation around the text, not the text alone)"
    ]


async def test_a_builtin_opted_out_and_a_disabled_cache_judge_everything_again(
    engine: FakeEngine,
) -> None:
    config = reloadable(engine, "falcon")
    config["detectors"]["mail"]["cache"] = False
    del config["server"]["admin_keys_env"]
    async with Orchestrator(config) as orch:
        for _ in range(2):
            status, _ = await orch.post(
                "/api/v2/text/detection/content",
                {"content": "Meet falcon. Bye.", "detectors": {"pii": {}, "mail": {}}},
            )
            assert status == 200
        assert await orch.metric("guardstream_detection_cache_hits_total", detector_id="pii") == 3
        assert (
            await orch.metric("guardstream_detection_cache_misses_total", detector_id="mail") == 0
        )
        assert orch.runner.app[STATE].verdicts is not None  # type: ignore[union-attr]
    config["detection_cache"] = {"enabled": False}
    async with Orchestrator(config) as orch:
        assert orch.runner.app[STATE].verdicts is None  # type: ignore[union-attr]


# -- the bounds ---------------------------------------------------------------------------------


def entry(detector_id: str = "d") -> tuple[str, tuple[()]]:
    return (detector_id, ())


def test_every_hit_gets_evidence_and_metadata_of_its_own() -> None:
    """A request that changes a kept detection's dicts (a writer adding a field) never changes
    what the next request of the same content is given."""
    cache = VerdictCache(4, 4)
    lookup = Lookup(cache.tenant("t"), "d", b"fingerprint")
    content = "call me at 555-0100"
    found = Detection(
        start=11,
        end=19,
        text="555-0100",
        detection="PhoneNumber",
        detection_type="pii",
        score=1.0,
        evidence=[{"name": "pattern", "value": "local"}],
        metadata={"kind": "phone", "spans": [[11, 19]]},
    )
    [key] = lookup.keys([content])
    lookup.put(key, content, [found.model_copy(deep=True)])
    [[first]] = lookup.get([key], [content])
    assert first == found
    first.metadata["kind"] = "changed"  # type: ignore[index]
    first.metadata["spans"].append([0, 4])  # type: ignore[index]
    first.evidence.append({"name": "added"})  # type: ignore[union-attr]
    [[second]] = lookup.get([key], [content])
    assert second == found
    assert second.metadata is not first.metadata and second.evidence is not first.evidence


def test_a_partition_evicts_its_least_recently_used_entry() -> None:
    partition = LruPartition(2)
    partition.put(b"a", entry())
    partition.put(b"b", entry())
    assert partition.get(b"a") is not None  # a is now the most recently used
    assert partition.put(b"c", entry()) == [entry()]
    assert partition.keys() == [b"a", b"c"]
    assert partition.get(b"b") is None


OPS = st.lists(
    st.tuples(st.sampled_from(["get", "put"]), st.sampled_from("xyz"), st.integers(0, 7)),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(ops=OPS, per_tenant=st.integers(1, 4), overall=st.integers(1, 8))
def test_partitions_never_exceed_their_bounds_and_evict_least_recently_used(
    ops: list[tuple[str, str, int]], per_tenant: int, overall: int
) -> None:
    """Against a model: per tenant an ordered dict, least recently used first; beyond the
    overall bound the largest partition (the first of equals, in creation order) gives up its
    oldest entry."""
    evicted: list[str] = []
    cache = VerdictCache(per_tenant, overall, on_evict=evicted.append)
    model: dict[str, OrderedDict[bytes, None]] = {}
    expected_evictions = 0
    for op, tenant, k in ops:
        key = bytes([k])
        if op == "get":
            got = cache._get(tenant, key)
            mine = model.get(tenant, OrderedDict())
            assert (got is not None) == (key in mine)
            if key in mine:
                mine.move_to_end(key)
            continue
        cache._put(tenant, key, entry(tenant))
        mine = model.setdefault(tenant, OrderedDict())
        mine[key] = None
        mine.move_to_end(key)
        while len(mine) > per_tenant:
            mine.popitem(last=False)
            expected_evictions += 1
        while sum(map(len, model.values())) > overall:
            max(model.values(), key=len).popitem(last=False)
            expected_evictions += 1
        for t, keys in model.items():
            partition = cache.partition(t)
            assert partition is not None
            assert partition.keys() == list(keys)
            assert len(partition) <= per_tenant
        assert len(cache) == sum(map(len, model.values())) <= overall
    assert len(evicted) == expected_evictions
