"""`type: engine_judge` (orchestrator/clients/engine_judge.py): a judge detector on our engine's
judge sessions, one per stream, found by the judged text; exact against judging from scratch
(tiny-random, float64, `--batch-invariant`), rebuilt on another replica when its own dies, and
fail-closed on every surface like `openai_judge`. Real sockets: engines on 127.0.0.1 in
threads, the orchestrator, a fake native generation engine (tests/fakes/engine.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from generation.models import LoadedModel
from generation.server import STATE as ENGINE_STATE
from generation.server import create_app
from orchestrator.clients.engine_judge import EngineJudgeClient
from orchestrator.config import DetectorConfig, parse_config
from orchestrator.judge_templates import JudgeContext, JudgePrompt
from orchestrator.state import STATE
from tests.engine_processes import ThreadedServer
from tests.engine_support import load_test_model
from tests.fakes.engine import FakeEngine
from tests.fakes.judge_server import FakeJudge
from tests.orchestrator_support import Orchestrator, native_config
from tests.test_judges import CATEGORIES, PROMPT, SCRIPT, SURFACES, fms_end, raw
from tests.wait_support import until

MESSAGES = (("user", PROMPT),)
CHUNKS = ["Sure.", " Mix the bomb parts.", " Done.", " 😀 東京 x=1;", "", " The end."]


@pytest.fixture(scope="module")
def tiny_exact() -> LoadedModel:
    return load_test_model("tiny-random", batch_invariant=True)


@pytest.fixture
def replicas(
    tiny_exact: LoadedModel, request: pytest.FixtureRequest
) -> Iterator[list[ThreadedServer]]:
    """Two engine replicas; with the parameter "static" (indirect) A runs the static judge
    pass (generation/judge_graphs.py) and B the packed one."""
    static = getattr(request, "param", "packed") == "static"
    with (
        ThreadedServer(lambda: create_app(tiny_exact, static_judge=static)) as a,
        ThreadedServer(lambda: create_app(tiny_exact)) as b,
    ):
        yield [a, b]


def entry(urls: list[str], **extra: Any) -> dict[str, Any]:
    return {"type": "engine_judge", "urls": urls, "template": "zero_shot", **extra}


async def from_scratch(
    http: aiohttp.ClientSession, url: str, head: str, tail: str, chunks: list[str]
) -> float:
    """Judging head + all chunks + tail in one pass on a fresh session."""
    body = {"head": head, "tail": tail, "unsafe_tokens": ["unsafe"], "safe_tokens": ["safe"]}
    async with http.post(url + "/v1/judge/sessions", json={**body, "chunks": chunks}) as resp:
        assert resp.status == 200
        reply = await resp.json()
    async with http.delete(f"{url}/v1/judge/sessions/{reply['session_id']}"):
        pass
    return reply["score"]


@pytest.mark.parametrize("replicas", ["packed", "static"], indirect=True)
async def test_a_stream_is_judged_incrementally_and_moves_when_its_replica_dies(
    replicas: list[ThreadedServer],
) -> None:
    """Calls as the pipeline makes them (the answer so far in the context): every score equals
    judging the answer so far from scratch, bitwise; each call appends to the stream's one
    session (the engine's prefix grows, no re-judging); when replica A dies mid-stream the
    session is rebuilt on B from its chunks and the scores stay exact (with "static", A's
    static passes and B's packed ones, from scratch on B, agree bitwise)."""
    a, b = replicas
    assert a.app is not None and b.app is not None
    judges_a, judges_b = a.app[ENGINE_STATE].engine.judges, b.app[ENGINE_STATE].engine.judges
    head, tail = JudgePrompt("zero_shot", None, {}).split(JudgeContext(MESSAGES), output=True)
    config = DetectorConfig.model_validate(entry([a.url, b.url]))
    async with aiohttp.ClientSession() as http:
        client = EngineJudgeClient("guard", config, http)
        prefix = ""
        calls = [[CHUNKS[0]], CHUNKS[1:3], [CHUNKS[3]], CHUNKS[4:]]
        judged: list[str] = []
        sessions: list[list[str]] = []
        for n, contents in enumerate(calls):
            if n == 2:  # replica A (the stream's) dies
                a.app[ENGINE_STATE].engine.stop()
            found = await client.detect(contents, {}, JudgeContext(MESSAGES, prefix))
            for content, [detection] in zip(contents, found, strict=True):
                judged.append(content)
                expected = await from_scratch(http, b.url, head, tail, judged)
                assert detection.score == expected, (n, content)
                assert (detection.start, detection.end) == (0, len(content))
            prefix += "".join(contents)
            if n < 2:  # one session on A all along: appended to, never re-opened
                sessions.append(list(judges_a.sessions))
                assert len(sessions[-1]) == 1 and sessions[-1] == sessions[0]
            else:
                assert len(judges_b.sessions) == 1
        await client.close()
        assert judges_b.sessions == {}  # closing the client frees the stream's session


@pytest.mark.parametrize("categories", [True, False], ids=["categories", "codes-only"])
async def test_llama_guard_categories_name_the_detection(categories: bool) -> None:
    """The engine's answer after the verdict (Llama Guard's "unsafe\nS1,S9") is read by the
    parser `openai_judge` uses: the category names are the entity, the codes its metadata, on
    input and on output (the stream's session), and when a session is rebuilt with its chunks.
    The answer is asked for (`answer_tokens`, from the threshold up) only with `categories` or
    the `llama_guard` template. The fake speaks the engine's session protocol with a controlled
    answer text (a random tiny model's answer has no category line); the engine's answers
    themselves: tests/test_judge_sessions.py."""
    fake = FakeJudge()
    await fake.start()
    extra: dict[str, Any] = {"template": "llama_guard", "default_threshold": 0.25}
    if categories:
        extra["categories"] = CATEGORIES
    config = DetectorConfig.model_validate(entry([fake.url], **extra))
    names = "Violent Crimes,Indiscriminate Weapons" if categories else "unsafe"
    try:
        async with aiohttp.ClientSession() as http:
            client = EngineJudgeClient("guard", config, http)
            [[unsafe], [safe]] = await client.detect(["Mix the bomb parts.", "Hello."], {})
            [[streamed]] = await client.detect(["A bomb."], {}, JudgeContext(MESSAGES, "Sure."))
            [[again]] = await client.detect([" More."], {}, JudgeContext(MESSAGES, "Sure. A bomb."))
            fake.sessions.clear()  # the engine forgot the session: rebuilt with its chunks
            [[rebuilt]] = await client.detect(
                [" Done."], {}, JudgeContext(MESSAGES, "Sure. A bomb. More.")
            )
            await client.close()
    finally:
        await fake.close()
    for found in (unsafe, streamed, again, rebuilt):
        assert (found.detection, found.score) == (names, 0.96875)
        assert found.metadata == {"categories": ["S1", "S9"]}
    assert (safe.detection, safe.score, safe.metadata) == ("unsafe", 0.03125, None)
    asks = [r for r in fake.session_requests if "answer_tokens" in r]
    assert len(asks) == 6  # every judgement (input: 2, output: 3 appends, one with the rebuild)
    assert {(r["answer_tokens"], r["answer_min_score"]) for r in asks} == {(24, 0.25)}


async def test_a_judge_without_categories_asks_for_no_answer() -> None:
    fake = FakeJudge()
    await fake.start()
    try:
        async with aiohttp.ClientSession() as http:
            client = EngineJudgeClient(
                "guard", DetectorConfig.model_validate(entry([fake.url])), http
            )
            [[found]] = await client.detect(["Mix the bomb parts."], {})
            await client.close()
    finally:
        await fake.close()
    assert (found.detection, found.score, found.metadata) == ("unsafe", 0.96875, None)
    assert fake.session_requests and all("answer_tokens" not in r for r in fake.session_requests)


async def test_the_engine_judge_reads_what_a_reader_sees() -> None:
    """Chunks reach the judge engine without the characters a reader never sees
    (judge_templates.judged, `visible`), on opening a session and on appends."""
    fake = FakeJudge()
    await fake.start()
    try:
        async with aiohttp.ClientSession() as http:
            client = EngineJudgeClient(
                "guard", DetectorConfig.model_validate(entry([fake.url])), http
            )
            context = JudgeContext((("user", "Hi\u200b there"),), "Su\u2060re.")
            await client.detect([" A b\u200bomb."], {}, context)
            await client.detect(
                [" M\ufeffore."], {}, JudgeContext(context.messages, "Su\u2060re. A b\u200bomb.")
            )
            await client.close()
    finally:
        await fake.close()
    opened, appended = fake.session_requests
    assert opened["chunks"] == ["Sure.", " A bomb."]
    assert appended == {"chunk": " More."}


async def test_two_streams_never_share_a_session() -> None:
    """Two streams with the same conversation and the same answer so far (two tenants asking
    the same): the second opens a session of its own, it does not append to the first's (a
    hit would tell it, by its timing, what the other stream was sent and answered). A stream's
    `release` closes its own session and leaves the other's."""
    fake = FakeJudge()
    await fake.start()
    try:
        async with aiohttp.ClientSession() as http:
            client = EngineJudgeClient(
                "guard", DetectorConfig.model_validate(entry([fake.url])), http
            )
            one, two = object(), object()
            await client.detect(["Sure."], {}, JudgeContext(MESSAGES, "", one))
            await client.detect([" More."], {}, JudgeContext(MESSAGES, "Sure.", two))
            opened = [r for r in fake.session_requests if "head" in r]
            assert [r["chunks"] for r in opened] == [["Sure."], ["Sure.", " More."]]
            assert len(fake.sessions) == 2
            client.release(JudgeContext(MESSAGES, "Sure.", one))
            await until(lambda: len(fake.sessions) == 1, what="the first stream's session closed")
            await client.detect([" Done."], {}, JudgeContext(MESSAGES, "Sure. More.", two))
            assert [r for r in fake.session_requests if "head" in r] == opened  # appended
            await client.close()
    finally:
        await fake.close()


async def test_input_is_judged_alone_and_leaves_no_session(replicas: list[ThreadedServer]) -> None:
    a = replicas[0]
    assert a.app is not None
    config = DetectorConfig.model_validate(entry([a.url]))
    head, tail = JudgePrompt("zero_shot", None, {}).split(JudgeContext(), output=False)
    async with aiohttp.ClientSession() as http:
        client = EngineJudgeClient("guard", config, http)
        [[one], [two]] = await client.detect(["How do I build a bomb?", "Hello."], {})
        assert one.score == await from_scratch(http, a.url, head, tail, ["How do I build a bomb?"])
        assert two.score == await from_scratch(http, a.url, head, tail, ["Hello."])
        assert a.app[ENGINE_STATE].engine.judges.sessions == {}


# -- through the orchestrator --------------------------------------------------------------------


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    fake = FakeEngine(script=list(SCRIPT))
    await fake.start()
    yield fake
    await fake.close()


def judged_config(engine: FakeEngine, urls: list[str], **extra: Any) -> dict[str, Any]:
    detector = entry(urls, chunker_id="sentence", **{"on_detection": "block", **extra})
    return native_config(
        engine.url,
        detectors={"guard": detector},
        model={"guardrails": {"output": {"guard": {}}}},
    )


async def test_the_orchestrator_reports_the_engines_scores(
    engine: FakeEngine, replicas: list[ThreadedServer]
) -> None:
    """A judge with threshold 0 flags every sentence, annotating: each detection's score is the
    engine's score of the answer up to that sentence, judged from scratch."""
    a = replicas[0]
    config = judged_config(engine, [a.url], on_detection="annotate", default_threshold=0.0)
    head, tail = JudgePrompt("zero_shot", None, {}).split(JudgeContext(MESSAGES), output=True)
    async with Orchestrator(config) as orch:
        name, got, _ = fms_end(await raw(orch, "fms"))
    assert name == "completed"
    found = [d for f in got for d in f["token_classification_results"]["output"]]
    sentences = ["Sure.", " Mix the bomb parts.", " Done."]
    async with aiohttp.ClientSession() as http:
        expected = [
            await from_scratch(http, a.url, head, tail, sentences[: i + 1]) for i in range(3)
        ]
    assert [d["score"] for d in found] == expected
    assert [(d["start"], d["end"]) for d in found] == [(0, 5), (5, 25), (25, 31)]


@pytest.mark.parametrize("surface", SURFACES)
async def test_an_unreachable_judge_fails_closed(engine: FakeEngine, surface: str) -> None:
    """No judge engine answers: nothing of the answer reaches the client, on any surface."""
    config = judged_config(engine, ["http://127.0.0.1:9"])
    async with Orchestrator(config) as orch:
        data = await raw(orch, surface, status=(200, 502))
        errors = await orch.metric(
            "guardstream_detector_calls_total", detector_id="guard", outcome="error"
        )
    for leaked in (b"Sure", b"Mix", b"bomb", b"Done"):
        assert leaked not in data, (leaked, data)
    assert b"guard" in data
    assert errors >= 1


@pytest.mark.parametrize("surface", SURFACES)
@pytest.mark.parametrize("refusal", ["sessions_full", "context_exceeded"])
async def test_a_judge_engine_that_refuses_the_session_fails_closed(
    engine: FakeEngine, tiny_exact: LoadedModel, surface: str, refusal: str
) -> None:
    """A real engine that answers 429 (every judge session held) or 422 (the template with the
    conversation is past its context) judges nothing: no default verdict, nothing of the
    answer reaches the client, on any surface."""
    if refusal == "sessions_full":
        make = lambda: create_app(tiny_exact, max_judge_sessions=0)  # noqa: E731
        extra: dict[str, Any] = {}
    else:
        make = lambda: create_app(tiny_exact)  # noqa: E731
        policy = "word " * tiny_exact.max_context
        extra = {"template": "{{ policy }}\n{{ text }}\nAnswer:", "params": {"policy": policy}}
        extra |= {"unsafe_tokens": ["unsafe"], "safe_tokens": ["safe"]}
    # a full engine is the service at capacity (429 overloaded), a refused text a failed judge
    status = (200, 429) if refusal == "sessions_full" else (200, 502)
    with ThreadedServer(make) as judge_engine:
        async with Orchestrator(judged_config(engine, [judge_engine.url], **extra)) as orch:
            data = await raw(orch, surface, status=status)
        assert judge_engine.app is not None
        assert judge_engine.app[ENGINE_STATE].engine.judges.sessions == {}
    for leaked in (b"Sure", b"Mix", b"bomb", b"Done"):
        assert leaked not in data, (leaked, data)
    assert b"guard" in data


async def test_a_full_judge_engine_is_overloaded_not_a_broken_detector(
    engine: FakeEngine, tiny_exact: LoadedModel
) -> None:
    """Every judge replica answering 429 (all its sessions held by running streams) is the
    service at capacity, as a remote detector's 429 or 503 is: the stream ends with `overloaded`
    (429, retry), not `detector_error` (502, a broken dependency), and still nothing of the
    answer leaves. Repro: 502 detector_error "no judge engine could judge the text"."""
    with ThreadedServer(lambda: create_app(tiny_exact, max_judge_sessions=0)) as judge_engine:
        async with Orchestrator(judged_config(engine, [judge_engine.url])) as orch:
            name, got, data = fms_end(await raw(orch, "fms"))
    assert (name, got) == ("error", [])
    assert (data["code"], data["type"]) == (429, "overloaded")
    assert "guard" in data["details"]


async def test_annotate_on_error_lets_the_text_flow(engine: FakeEngine) -> None:
    """`on_error: annotate`: the text it could not judge flows, each chunk with a warning."""
    config = judged_config(engine, ["http://127.0.0.1:9"], on_error="annotate")
    async with Orchestrator(config) as orch:
        name, got, _ = fms_end(await raw(orch, "fms"))
    assert name == "completed"
    assert "".join(f.get("generated_text", "") for f in got) == "Sure. Mix the bomb parts. Done."
    found = [d for f in got for d in f["token_classification_results"]["output"]]
    assert [(d["entity_group"], d["entity"], d["start"], d["end"]) for d in found] == [
        ("judge_error", "unjudged", 0, 5),
        ("judge_error", "unjudged", 5, 25),
        ("judge_error", "unjudged", 25, 31),
    ]


def test_config_of_an_engine_judge() -> None:
    def errors(**det: Any) -> list[str]:
        config = native_config("http://127.0.0.1:1", detectors={"j": det})
        try:
            parse_config(config)
        except Exception as exc:  # ConfigError: one line per problem
            return str(exc).splitlines()
        return []

    assert errors(**entry(["http://e:1"])) == []
    assert errors(type="engine_judge", model="tiny-random", template="zero_shot", replicas=2) == []
    both = errors(**entry(["http://e:1"]), model="tiny-random")
    assert any("exactly one of 'model' and 'urls' is required" in e for e in both), both
    split = errors(
        **entry(["http://e:1"], template="{{ prefix }} {{ chunk }} Answer:"),
        unsafe_tokens=["unsafe"],
        safe_tokens=["safe"],
    )
    assert any("must use {{ text }} exactly once" in e for e in split), split
    stray = errors(type="text_contents", url="http://d:1", replicas=2)
    assert any("only a detector of type engine_judge takes it" in e for e in stray), stray


def test_the_readme_engine_judge_example_is_a_valid_config(tmp_path: Any) -> None:
    """The README's engine_judge block, its guard model folder standing in as an empty one."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("### Incremental judges on our engine", 1)[1]
    example = yaml.safe_load(section.split("```yaml\n", 1)[1].split("```", 1)[0])
    (tmp_path / "config.json").write_text("{}")
    example["detectors"]["llama-guard"]["model"] = str(tmp_path)
    config = parse_config(native_config("http://e:1", detectors=example["detectors"]))
    judge = config.detectors["llama-guard"]
    assert (judge.type, judge.replicas, judge.template) == ("engine_judge", 2, "llama_guard")


async def test_a_managed_engine_judge_starts_its_engine(engine: FakeEngine) -> None:
    """`model:` instead of `urls`: the orchestrator starts the judge's engine process (its own
    key) and stops it on shutdown."""
    detector = {
        "type": "engine_judge",
        "model": "tiny-random",
        "device": "cpu",
        "template": "zero_shot",
        "chunker_id": "sentence",
        "default_threshold": 0.0,
    }
    config = native_config(
        engine.url, detectors={"guard": detector}, model={"guardrails": {"output": {"guard": {}}}}
    )
    async with Orchestrator(config) as orch:
        name, got, _ = fms_end(await raw(orch, "fms"))
        assert orch.runner is not None
        client = orch.runner.app[STATE].detectors.clients()["guard"]
        assert isinstance(client, EngineJudgeClient)
        [replica] = client.replicas
        assert replica.process is not None and replica.process.running
    assert not replica.process.running
    assert name == "completed"
    found = [d for f in got for d in f["token_classification_results"]["output"]]
    assert [(d["start"], d["end"]) for d in found] == [(0, 5), (5, 25), (25, 31)]
    assert all(0.0 < d["score"] < 1.0 for d in found)


async def test_a_finished_stream_frees_its_judge_session(
    engine: FakeEngine, tiny_exact: LoadedModel
) -> None:
    """A stream that has ended holds no judge session: the engine's session slots are for
    streams being judged, not for the last 1,024 that were. A judge engine with 2 slots
    judges 4 streams one after the other (each ends `completed`, judged to its end), and once
    each has ended the engine holds no session and the orchestrator keeps none for it.
    (Kept, they filled the slots: the third stream got 429 and failed closed, and so would every
    stream of every tenant until the engine's idle timeout, 5 minutes, closed one.)"""
    with ThreadedServer(lambda: create_app(tiny_exact, max_judge_sessions=2)) as judge_engine:
        assert judge_engine.app is not None
        judges = judge_engine.app[ENGINE_STATE].engine.judges
        config = judged_config(
            engine, [judge_engine.url], on_detection="annotate", default_threshold=0.0
        )
        async with Orchestrator(config) as orch:
            assert orch.runner is not None
            client = orch.runner.app[STATE].detectors.clients()["guard"]
            assert isinstance(client, EngineJudgeClient)
            for n in range(4):
                # distinct conversations (the same one again would find its session)
                name, got, _ = fms_end(await raw(orch, "fms", f"Tell me story {n}."))
                assert name == "completed", (n, got)
                found = [d for f in got for d in f["token_classification_results"]["output"]]
                assert [(d["start"], d["end"]) for d in found] == [(0, 5), (5, 25), (25, 31)]
            await until(lambda: not judges.sessions, what="the streams' sessions closed")
            assert len(client._streams) == 0
