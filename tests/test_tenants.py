"""Tenants (issue 39, DESIGN 3a): each API key belongs to one tenant, which gets its own models,
guardrails on top of the model's, limits and usage, and every response says which tenant and
which policy judged it.

The real orchestrator on 127.0.0.1 with two tenants on the same fake native engine (which records
every prompt it receives), the in-process `regex` detector as tenant A's enforced `pii: redact`.
The token buckets run on a clock the test sets (`AppState.clock`): nothing waits for time."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import signal
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.app import (
    CHAT_DETECTION_ONLY_PATH,
    CHAT_PATH,
    CONTENT_PATH,
    CONTEXT_DETECTION_PATH,
    GENERATED_DETECTION_PATH,
    MODELS_PATH,
    STREAM_CONTENT_PATH,
    STREAMING_PATH,
    UNARY_PATH,
    USAGE_PATH,
)
from orchestrator.clients.registry import SEVERITY, EnforcedGuardrails, RequestedDetector
from orchestrator.config import ConfigError, TenantLimits, parse_config
from orchestrator.handlers.admin import RELOAD_PATH
from orchestrator.rate_limits import TokenBucket
from orchestrator.reload import managed_engines_changed
from orchestrator.server import start_server
from orchestrator.state import STATE
from orchestrator.tenants import RateLimited, TenantGate, per_worker, tenant_keys
from servicekit.auth import UNAUTHORIZED_MESSAGE
from tests.e2e_support import managed_model
from tests.fakes.engine import FakeEngine, prompt_text
from tests.orchestrator_support import (
    MODEL,
    NDJSON,
    Orchestrator,
    frames,
    generation_body,
    native_config,
    read_sse,
    serve,
    sse_events,
    terminal,
)
from tests.test_orchestrator_metrics import parse, value
from tests.wait_support import finished, until

PRIVATE = "private-model"
A_KEY, B_KEY = "key-of-tenant-a", "key-of-tenant-b"
A, B = {"Authorization": f"Bearer {A_KEY}"}, {"Authorization": f"Bearer {B_KEY}"}
MAIL_PROMPT = "Write to jo@example.com please"
REDACTED_PROMPT = "Write to [email] please"
SCRIPT = ["Mail", " ann@example.org", " now", "."]
TOKENS_PER_MINUTE = 60
FROZEN_AT = 1000.0


def tenants_config(engine_url: str, **limits_of_a: Any) -> dict[str, Any]:
    """Tenant `a`: both models, `pii: redact` on input and output of the shared one, its
    limits; tenant `b`: the shared model only, no guardrails of its own."""
    config = native_config(
        engine_url,
        detectors={
            "pii": {
                "type": "text_contents",
                "builtin": "regex",
                "chunker_id": "sentence",
                "on_detection": "annotate",
            }
        },
    )
    config["models"][PRIVATE] = dict(config["models"][MODEL])
    config["tenants"] = {
        "a": {
            "keys_env": "TENANT_A_KEYS",
            "models": [MODEL, PRIVATE],
            "guardrails": {
                MODEL: {
                    "input": {"pii": {"on_detection": "redact"}},
                    "output": {"pii": {"on_detection": "redact"}},
                }
            },
            "limits": limits_of_a,
        },
        "b": {"keys_env": "TENANT_B_KEYS", "models": [MODEL]},
    }
    return config


@pytest.fixture(autouse=True)
def keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TENANT_A_KEYS", f"{A_KEY}, another-key-of-a")
    monkeypatch.setenv("TENANT_B_KEYS", B_KEY)


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    engine = FakeEngine(script=SCRIPT)
    await engine.start()
    yield engine
    await engine.close()


def frozen(orch: Orchestrator) -> list[float]:
    """Sets the service's bucket clock to a value the test moves: [now]."""
    assert orch.runner is not None
    now = [FROZEN_AT]
    orch.runner.app[STATE].clock = lambda: now[0]
    return now


async def get(orch: Orchestrator, path: str, headers: dict[str, str]) -> tuple[int, Any, Any]:
    assert orch.session is not None
    async with orch.session.get(orch.url + path, headers=headers) as r:
        return r.status, await r.json(), r.headers


async def test_a_tenants_guardrails_judge_only_that_tenants_requests(engine) -> None:
    async with Orchestrator(tenants_config(engine.url)) as orch:
        body = generation_body(MAIL_PROMPT)
        # a request of `a` that names `pii` as annotate changes nothing about the enforced one
        weakened = generation_body(MAIL_PROMPT, input={"pii": {"on_detection": "annotate"}})
        a_events = await orch.stream(weakened, headers=A)
        b_events = await orch.stream(body, headers=B)
        assert [prompt_text(r.body) for r in engine.requests] == [REDACTED_PROMPT, MAIL_PROMPT]
        a_text = "".join(f.get("generated_text", "") for f in frames(a_events))
        b_text = "".join(f.get("generated_text", "") for f in frames(b_events))
        assert a_text == "Mail [email] now."
        assert b_text == "Mail ann@example.org now."
        assert terminal(a_events).name == terminal(b_events).name == "completed"

        # each response names its tenant and the policy that judged it: a's is not b's, and
        # b's is the model's own (b has no guardrails of its own), the same on every surface
        async with orch.session.post(orch.url + STREAMING_PATH, json=body, headers=A) as r:
            a_policy = r.headers["x-guardstream-policy"]
            assert r.headers["x-guardstream-tenant"] == "a"
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
        async with orch.session.post(orch.url + CHAT_PATH, json=chat, headers=B) as r:
            assert r.status == 200
            assert r.headers["x-guardstream-tenant"] == "b"
            b_policy = r.headers["x-guardstream-policy"]
        async with orch.session.post(orch.url + UNARY_PATH, json=body, headers=B) as r:
            assert r.headers["x-guardstream-policy"] == b_policy
        assert len(a_policy) == len(b_policy) == 12 and a_policy != b_policy
        # a route that names no model: the tenant's policy over all its models
        status, _, headers = await get(orch, MODELS_PATH, A)
        assert status == 200
        assert headers["x-guardstream-tenant"] == "a"
        assert headers["x-guardstream-policy"] not in (a_policy, b_policy)


async def test_a_tenant_cannot_see_another_tenants_model(engine) -> None:
    async with Orchestrator(tenants_config(engine.url)) as orch:
        # for b, the private model does not exist: exactly the body of a model that does not
        status, private = await orch.post(
            STREAMING_PATH, generation_body(model_id=PRIVATE), headers=B
        )
        missing_status, missing = await orch.post(
            STREAMING_PATH, generation_body(model_id="no-such-model"), headers=B
        )
        assert status == missing_status == 404
        assert private == {
            "code": 404,
            "details": f"model `{PRIVATE}` not found (available: {MODEL})",
            "type": "not_found",
        }
        assert missing["details"] == private["details"].replace(PRIVATE, "no-such-model")
        chat = {"model": PRIVATE, "messages": [{"role": "user", "content": "Hi"}]}
        status, body = await orch.post(CHAT_PATH, chat, headers=B)
        assert status == 404 and body["error"]["type"] == "not_found"
        assert engine.requests == []

        _, b_models, _ = await get(orch, MODELS_PATH, B)
        _, a_models, _ = await get(orch, MODELS_PATH, A)
        assert [m["id"] for m in b_models["data"]] == [MODEL]
        assert [m["id"] for m in a_models["data"]] == [MODEL, PRIVATE]
        _, info, _ = await get(orch, "/info", B)
        assert list(info["models"]) == [MODEL]
        # a's key streams from it
        events = await orch.stream(generation_body(model_id=PRIVATE), headers=A)
        assert terminal(events).name == "completed"


async def test_a_token_budget_answers_429_while_another_tenant_streams(engine) -> None:
    config = tenants_config(engine.url, tokens_per_minute=TOKENS_PER_MINUTE)
    async with Orchestrator(config) as orch:
        now = frozen(orch)
        long_prompt = "x" * 100  # the fake engine counts a token per character
        first = terminal(await orch.stream(generation_body(long_prompt), headers=A)).data
        spent = first["input_token_count"] + first["generated_token_count"]
        assert spent == 100 + len(SCRIPT)
        # the bucket is at 60 - spent: positive again after (spent - 60) s at a token a second
        retry_after = math.floor(spent - TOKENS_PER_MINUTE) + 1

        engine.hold_after = 1  # b's stream stays open while a is refused
        seen: list[tuple[int, Any, str]] = []

        async def a_is_refused() -> None:
            async with orch.session.post(
                orch.url + STREAMING_PATH, json=generation_body(), headers=A
            ) as r:
                seen.append((r.status, await r.json(), r.headers["Retry-After"]))
                assert r.headers["x-guardstream-tenant"] == "a"
            engine.release.set()

        tasks: list[asyncio.Task[None]] = []

        def on_event(events: list[Any]) -> None:
            if not tasks:  # b's first frame reached b: its stream is running
                tasks.append(asyncio.create_task(a_is_refused()))

        b_events = await orch.stream(generation_body(), headers=B, on_event=on_event)
        await tasks[0]
        assert terminal(b_events).name == "completed"
        assert "".join(f.get("generated_text", "") for f in frames(b_events)) == "".join(SCRIPT)
        assert seen == [
            (
                429,
                {
                    "code": 429,
                    "details": f"tenant `a`: over its budget of {TOKENS_PER_MINUTE} tokens per "
                    "minute",
                    "type": "overloaded",
                },
                str(retry_after),
            )
        ]
        assert len(engine.requests) == 2  # the refused request never reached the engine
        # refilled continuously: one second short it is still refused, then admitted
        now[0] += retry_after - 1
        status, _ = await orch.post(STREAMING_PATH, generation_body(), headers=A)
        assert status == 429
        now[0] += 1
        assert terminal(await orch.stream(generation_body(), headers=A)).name == "completed"


async def test_usage_and_metrics_are_read_off_the_event_loop(
    engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GET /v1/usage (any tenant's key) and GET /metrics read the series off the event loop.
    Repro: both collected the registry on the loop: 5 ms (usage) and 14 ms (/metrics) a call
    with one process, 77 and 95 ms under `server.workers` 16 (every worker's file read and
    merged), each call stalling every stream of the worker; a tenant polling its usage ~13
    times a second held a worker's loop all the time. Checked by where the reads run (thread
    identities), never by the clock. With one process the usage is read from the tenant
    series alone, not the whole registry."""
    monkeypatch.setenv("METRICS_ADMIN_KEYS", "the-scrapers-key")
    config = tenants_config(engine.url)
    config["server"]["admin_keys_env"] = "METRICS_ADMIN_KEYS"
    async with Orchestrator(config) as orch:
        assert orch.runner is not None and orch.session is not None
        metrics = orch.runner.app[STATE].metrics
        reads: list[tuple[str, int]] = []
        for name, collector in [("registry", metrics.registry), *metrics.tenant_series.items()]:

            def spy(real: Any = collector.collect, name: str = name) -> Any:
                reads.append((name, threading.get_ident()))
                return real()

            monkeypatch.setattr(collector, "collect", spy)
        terminal(await orch.stream(generation_body(), headers=A))
        async with orch.session.get(orch.url + USAGE_PATH, headers=A) as r:
            assert r.status == 200
            assert (await r.json())["requests"] == 1
        assert reads and {name for name, _ in reads} == set(metrics.tenant_series)
        scraper = {"Authorization": "Bearer the-scrapers-key"}
        async with orch.session.get(orch.url + "/metrics", headers=scraper) as r:
            assert r.status == 200
            assert 'guardstream_tenant_requests_total{tenant="a"} 2.0' in await r.text()
        assert "registry" in {name for name, _ in reads}
    loop_thread = threading.get_ident()
    assert loop_thread not in {ident for _, ident in reads}


async def test_per_tenant_metrics_and_usage_are_exact_and_each_tenants_own(
    engine, caplog, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("METRICS_ADMIN_KEYS", "the-scrapers-key")
    config = tenants_config(engine.url)
    config["server"]["admin_keys_env"] = "METRICS_ADMIN_KEYS"
    async with Orchestrator(config) as orch:
        caplog.set_level(logging.INFO, "guardstream.access")
        a_done = terminal(await orch.stream(generation_body(MAIL_PROMPT), headers=A)).data
        b_done = terminal(await orch.stream(generation_body(), headers=B)).data
        # b asks for its own blocking `pii`: an input hit ends it before the model, a refusal
        blocking = generation_body(MAIL_PROMPT, input={"pii": {"on_detection": "block"}})
        refused = terminal(await orch.stream(blocking, headers=B)).data
        assert refused["incomplete_details"] == {"reason": "content_filter"}
        status, _ = await orch.post(STREAMING_PATH, generation_body(model_id=PRIVATE), headers=B)
        assert status == 404
        assert orch.session is not None
        # /metrics holds every tenant's usage: a tenant's key never reads it, an admin key does
        for headers in (A, B, {}):
            async with orch.session.get(orch.url + "/metrics", headers=headers) as r:
                assert (r.status, (await r.json())["type"]) == (401, "unauthorized")
        scraper = {"Authorization": "Bearer the-scrapers-key"}
        async with orch.session.get(orch.url + "/metrics", headers=scraper) as r:
            assert r.status == 200
            samples = parse(await r.text())

        def tenant(name: str, who: str) -> float:
            return value(samples, f"guardstream_tenant_{name}_total", tenant=who)

        a_usage = {
            "requests": 1,
            "prompt_tokens": a_done["input_token_count"],
            "generated_tokens": a_done["generated_token_count"],
            "detections": 2,  # the e-mail in a's prompt (input) and the one in the output
            "refusals": 0,
        }
        b_usage = {
            "requests": 3,  # the 404 counts
            "prompt_tokens": b_done["input_token_count"] + (refused.get("input_token_count") or 0),
            "generated_tokens": b_done["generated_token_count"],
            "detections": 1,
            "refusals": 1,
        }
        assert a_usage["generated_tokens"] == b_usage["generated_tokens"] == len(SCRIPT)
        assert {k: tenant(k, "a") for k in a_usage} == a_usage
        assert {k: tenant(k, "b") for k in b_usage} == b_usage
        # only the config's tenant ids are label values
        assert {dict(labels)["tenant"] for name, labels in samples if "tenant" in dict(labels)} == {
            "a",
            "b",
        }
        # each key reads its own usage, whatever it asks for
        for headers, usage, who in ((A, a_usage, "a"), (B, b_usage, "b")):
            for path in (USAGE_PATH, USAGE_PATH + "?tenant=a", USAGE_PATH + "?tenant=b"):
                status, body, _ = await get(orch, path, headers)
                assert status == 200
                # the usage requests themselves count: those made before this one
                assert body.pop("requests") >= usage["requests"]
                assert body == {"object": "usage", "tenant": who} | {
                    k: v for k, v in usage.items() if k != "requests"
                }
        # a header naming another tenant changes nothing: the key says who is calling
        status, body, headers = await get(orch, USAGE_PATH, {**A, "x-guardstream-tenant": "b"})
        assert (status, body["tenant"], headers["x-guardstream-tenant"]) == (200, "a", "a")
        status, body, _ = await get(orch, USAGE_PATH, {})
        assert status == 401
    lines = [r for r in caplog.records if r.name == "guardstream.access"]
    assert [(r.path, r.status, r.tenant) for r in lines][:4] == [
        (STREAMING_PATH, 200, "a"),
        (STREAMING_PATH, 200, "b"),
        (STREAMING_PATH, 200, "b"),
        (STREAMING_PATH, 404, "b"),
    ]
    assert lines[-1].tenant is None  # the 401: no tenant


async def test_limits_cannot_be_raised_from_a_request(engine) -> None:
    config = tenants_config(engine.url, max_new_tokens=3, max_concurrent_streams=1)
    async with Orchestrator(config) as orch:
        status, body = await orch.post(
            STREAMING_PATH, generation_body(params={"max_new_tokens": 4}), headers=A
        )
        assert (status, body) == (
            422,
            {
                "code": 422,
                "details": "text_gen_parameters.max_new_tokens: 4 exceeds this tenant's limit of 3",
                "type": "invalid_request",
            },
        )
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 9}
        status, body = await orch.post(CHAT_PATH, chat, headers=A)
        assert status == 422
        assert body["error"]["message"] == "max_tokens: 9 exceeds this tenant's limit of 3"
        # a request without a budget gets the tenant's; b's is the model's default
        await orch.stream(generation_body(), headers=A)
        await orch.stream(generation_body(), headers=B)
        assert [r.body["max_new_tokens"] for r in engine.requests] == [3, 256]

        # one stream at a time for a; b is not counted against it
        engine.hold_after = 1
        engine.release.clear()
        results: list[tuple[int, Any, str | None]] = []

        async def second_of_a() -> None:
            async with orch.session.post(
                orch.url + STREAMING_PATH, json=generation_body(), headers=A
            ) as r:
                results.append((r.status, await r.json(), r.headers.get("Retry-After")))
            engine.hold_after = None  # new streams run through; a's stays held
            b_events = await orch.stream(generation_body(), headers=B)
            assert terminal(b_events).name == "completed"  # while a's stream runs
            engine.release.set()

        tasks: list[asyncio.Task[None]] = []

        def on_event(events: list[Any]) -> None:
            if not tasks:
                tasks.append(asyncio.create_task(second_of_a()))

        # the private model: a's `pii` on the shared one would hold the first frame back
        events = await orch.stream(generation_body(model_id=PRIVATE), headers=A, on_event=on_event)
        await tasks[0]
        ended = terminal(events)  # a's budget: 3 of the script's 4 tokens
        assert (ended.name, ended.data["generated_token_count"]) == ("incomplete", 3)
        assert results == [
            (
                429,
                {
                    "code": 429,
                    "details": "tenant `a`: too many concurrent streams (limit 1)",
                    "type": "overloaded",
                },
                "1",
            )
        ]


async def test_requests_per_minute_refill_continuously(engine) -> None:
    async with Orchestrator(tenants_config(engine.url, requests_per_minute=2)) as orch:
        now = frozen(orch)
        for _ in range(2):  # a burst of the whole minute
            status, _, _ = await get(orch, MODELS_PATH, A)
            assert status == 200
        status, body, headers = await get(orch, MODELS_PATH, A)
        assert (status, headers["Retry-After"]) == (429, "30")  # a request every 30 s
        assert body == {
            "error": {
                "message": "tenant `a`: over its limit of 2 requests per minute",
                "type": "overloaded",
                "param": None,
                "code": 429,
            }
        }
        assert headers["x-guardstream-tenant"] == "a"
        status, _ = await orch.post(STREAMING_PATH, generation_body(), headers=A)
        assert status == 429
        assert (await get(orch, MODELS_PATH, B))[0] == 200  # b has no limit
        now[0] += 29
        assert (await get(orch, MODELS_PATH, A))[0] == 429
        now[0] += 1
        assert (await get(orch, MODELS_PATH, A))[0] == 200
        assert (await get(orch, "/health", A))[0] == 200  # probes are not a tenant's usage
        assert engine.requests == []


async def test_every_key_is_compared_whichever_tenant_it_belongs_to(
    engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """100 tenants with 10 keys each: a key of the first tenant, of the last, one that nearly
    matches a key, and a wrong one each cost exactly 1,000 comparisons (no early exit)."""
    config = native_config(engine.url)
    config["tenants"] = {f"t{i}": {"keys_env": f"TENANT_{i}_KEYS"} for i in range(100)}
    for i in range(100):
        monkeypatch.setenv(f"TENANT_{i}_KEYS", ",".join(f"key-{i}-{j}" for j in range(10)))
    calls = [0]
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls[0] += 1
        return real(a, b)

    async with Orchestrator(config) as orch:
        monkeypatch.setattr(hmac, "compare_digest", counting)
        for key, tenant in (("key-0-0", "t0"), ("key-99-9", "t99"), ("key-99-", None), ("x", None)):
            calls[0] = 0
            status, _, headers = await get(orch, MODELS_PATH, {"Authorization": f"Bearer {key}"})
            assert calls[0] == 1000
            assert status == (200 if tenant else 401)
            assert headers.get("x-guardstream-tenant") == tenant


def test_a_key_in_two_tenants_stops_start_up_without_printing_it() -> None:
    config = parse_config(
        {
            "server": {"api_keys_env": "SERVER_KEYS"},
            "tenants": {
                "a": {"keys_env": "A_KEYS"},
                "b": {"keys_env": "B_KEYS"},
                "c": {"keys_env": "C_KEYS"},
            },
        }
    )
    environ = {"SERVER_KEYS": "shared-secret", "A_KEYS": "own, shared-secret", "B_KEYS": " , "}
    with pytest.raises(ConfigError) as info:
        tenant_keys(config, environ)
    assert info.value.errors == [
        "tenants.a.keys_env: a key in A_KEYS is also a key of the tenant 'default' (a key "
        "belongs to exactly one tenant)",
        "tenants.b.keys_env: environment variable B_KEYS holds no key",
        "tenants.c.keys_env: environment variable C_KEYS is not set",
    ]
    assert "shared-secret" not in str(info.value)
    assert tenant_keys(config, environ | {"A_KEYS": "own", "B_KEYS": "b", "C_KEYS": "c"}) == [
        ("shared-secret", "default"),
        ("own", "a"),
        ("b", "b"),
        ("c", "c"),
    ]


async def test_start_up_refuses_a_key_shared_by_two_tenants(engine, monkeypatch) -> None:
    monkeypatch.setenv("TENANT_B_KEYS", f"{B_KEY},another-key-of-a")
    with pytest.raises(ConfigError) as info:
        await start_server(parse_config(tenants_config(engine.url)), "127.0.0.1", 0)
    assert info.value.errors == [
        "tenants.b.keys_env: a key in TENANT_B_KEYS is also a key of the tenant 'a' (a key "
        "belongs to exactly one tenant)"
    ]


def test_tenant_mistakes_are_reported_in_one_pass_with_the_closest_choice() -> None:
    backend = {"backends": [{"type": "native", "url": "http://127.0.0.1:9"}]}
    with pytest.raises(ConfigError) as info:
        parse_config(
            {
                "server": {"api_keys_env": "K"},
                "models": {"m": backend, "priv": backend},
                "detectors": {"pii": {"builtin": "regex"}},
                "tenants": {
                    "default": {"keys_env": "D"},
                    "a": {
                        "keys_env": "K",
                        "models": ["m", "prv"],
                        "guardrails": {"priv": {"output": {"pi": {}}}, "zz": {}},
                        "limits": {"tokens_per_minut": 3},
                    },
                    "b": {"keys_env": "B", "models": "m*", "limits": {"max_new_tokens": 0}},
                },
            }
        )
    assert info.value.errors == [
        "tenants.a.limits.tokens_per_minut: unknown key (did you mean 'tokens_per_minute'?)",
        'tenants.b.models: must be "*" (every model) or a list of model ids',
        "tenants.b.limits.max_new_tokens: Input should be greater than or equal to 1",
        "tenants.default: reserved: the keys of server.api_keys_env are the tenant 'default' "
        "(name this tenant otherwise, or drop api_keys_env)",
        "tenants.a.keys_env: K already holds the keys of server.api_keys_env (a key belongs to "
        "exactly one tenant)",
        "tenants.a.models.1: unknown model 'prv' (did you mean 'priv'?)",
        "tenants.a.guardrails.priv: 'priv' is not among this tenant's models",
        "tenants.a.guardrails.priv.output.pi: unknown detector 'pi' (did you mean 'pii'?)",
        "tenants.a.guardrails.zz: unknown model 'zz' (expected one of: *, m, priv)",
    ]


def test_a_tenants_detector_params_on_a_detector_the_model_enforces_are_a_config_error() -> None:
    """A detector has one set of params per request: where a tenant's entry names a detector
    the model (or the tenant's `*` entry) already enforces, only the tightening settings
    (threshold, on_detection, redact_with) can merge. Its own detector params were dropped in
    silence: a tenant whose `pii` was to find phone numbers too got the model's e-mails only,
    and a phone number passed its enforced guardrail."""
    backend = {"backends": [{"type": "native", "url": "http://127.0.0.1:9"}]}
    with pytest.raises(ConfigError) as info:
        parse_config(
            {
                "models": {
                    "m": {**backend, "guardrails": {"input": {"pii": {"kinds": ["email"]}}}},
                    "n": backend,
                },
                "detectors": {"pii": {"builtin": "regex"}},
                "tenants": {
                    "a": {
                        "keys_env": "A",
                        "guardrails": {
                            "*": {"output": {"pii": {"kinds": ["phone"]}}},
                            "m": {
                                # a stricter action alone merges with the model's params
                                "input": {"pii": {"on_detection": "block"}},
                                "output": {"pii": {"kinds": ["phone", "email"]}},
                            },
                        },
                    },
                    "b": {
                        "keys_env": "B",
                        "guardrails": {"m": {"input": {"pii": {"kinds": ["email", "phone"]}}}},
                    },
                },
            }
        )
    assert info.value.errors == [
        'tenants.a.guardrails.m.output.pii: detector params {"kinds": ["phone", '
        '"email"]} differ from {"kinds": ["phone"]} of tenants.a.guardrails.*.output'
        ".pii, which judges the same requests (one detector judges with one set of params: "
        "give them once, or only threshold, on_detection and redact_with here)",
        'tenants.b.guardrails.m.input.pii: detector params {"kinds": ["email", '
        '"phone"]} differ from {"kinds": ["email"]} of models.m.guardrails.input.pii, '
        "which judges the same requests (one detector judges with one set of params: give them "
        "once, or only threshold, on_detection and redact_with here)",
    ]


@settings(max_examples=20, deadline=None)
@given(
    model=st.sampled_from(["annotate", "redact", "block"]),
    tenant=st.sampled_from(["annotate", "redact", "block"]),
    thresholds=st.tuples(st.floats(0, 1), st.floats(0, 1)),
)
def test_a_tenants_guardrail_only_tightens_the_models(
    model: str, tenant: str, thresholds: tuple[float, float]
) -> None:
    def det(action: str, threshold: float, replacement: str) -> RequestedDetector:
        return RequestedDetector(
            "pii", None, "sentence", threshold, action, {}, replacement, enforced=True
        )  # type: ignore[arg-type]

    base = EnforcedGuardrails(output=(det(model, thresholds[0], "[model]"),))
    own = EnforcedGuardrails(output=(det(tenant, thresholds[1], "[tenant]"),))
    (merged,) = base.tightened_by(own).output
    assert SEVERITY[merged.on_detection] == max(SEVERITY[model], SEVERITY[tenant])
    assert merged.threshold == min(thresholds)
    assert merged.redact_with == ("[tenant]" if SEVERITY[tenant] > SEVERITY[model] else "[model]")


# -- reload ---------------------------------------------------------------------------------------

ADMIN = {"Authorization": "Bearer the-admin-key"}


def write(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


async def reload(orch: Orchestrator, headers: dict[str, str] = ADMIN) -> tuple[int, Any]:
    return await orch.post(RELOAD_PATH, b"", headers=headers)


@pytest.fixture
def admin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADMIN_KEYS", "the-admin-key")


def reloadable(engine_url: str) -> dict[str, Any]:
    config = tenants_config(engine_url)
    config["server"]["admin_keys_env"] = "ADMIN_KEYS"
    del config["tenants"]["a"]["guardrails"]  # a starts with the model's guardrails only
    return config


async def test_a_reload_applies_to_new_requests_while_a_running_stream_finishes_unchanged(
    engine, admin, tmp_path: Path
) -> None:
    config = reloadable(engine.url)
    path = write(tmp_path / "config.yaml", config)
    async with Orchestrator(path) as orch:
        engine.hold_after = 1
        tasks: list[asyncio.Task[None]] = []
        seen: dict[str, Any] = {}

        async def reload_then_ask() -> None:
            config["tenants"]["a"]["guardrails"] = {
                MODEL: {"output": {"pii": {"on_detection": "redact"}}}
            }
            write(path, config)
            seen["reload"] = await reload(orch)
            engine.hold_after = None
            async with orch.session.post(
                orch.url + STREAMING_PATH, json=generation_body(), headers=A
            ) as r:
                seen["policy"] = r.headers["x-guardstream-policy"]
                seen["new"] = sse_events(await r.text())
            engine.release.set()

        def on_event(events: list[Any]) -> None:
            if not tasks:
                tasks.append(asyncio.create_task(reload_then_ask()))

        assert orch.session is not None
        async with orch.session.post(
            orch.url + STREAMING_PATH, json=generation_body(), headers=A
        ) as r:
            old_policy = r.headers["x-guardstream-policy"]
            running = await read_sse(r, on_event)
        await tasks[0]
    assert seen["reload"] == (200, {"reloaded": True, "tenants": ["a", "b"]})
    # the running stream: judged by the policy it started with
    assert "".join(f["generated_text"] for f in frames(running)) == "".join(SCRIPT)
    # the next one: a's new guardrail
    assert "".join(f["generated_text"] for f in frames(seen["new"])) == "Mail [email] now."
    assert seen["policy"] != old_policy


async def late_body(
    orch: Orchestrator,
    body: bytes,
    gate: asyncio.Event,
    path: str = STREAMING_PATH,
    content_type: str = "application/json",
) -> tuple[int, str, bytes]:
    """A request whose head (and a first part of the body) is sent now and the rest once `gate`
    is set: raw HTTP/1.0, so the reply is read to the end of the connection. Its status, its
    policy header (or "") and its body."""
    host, port = orch.url.rsplit("/", 1)[-1].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    head = (
        f"POST {path} HTTP/1.0\r\nHost: x\r\nContent-Type: {content_type}"
        f"\r\nAuthorization: Bearer {A_KEY}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    try:
        writer.write(head.encode() + body[:10])
        await gate.wait()
        writer.write(body[10:])
        raw = await reader.read()
    finally:
        writer.close()
    head_bytes, _, reply = raw.partition(b"\r\n\r\n")
    status_line, *lines = head_bytes.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines)
    return int(status_line.split()[1]), headers.get("x-guardstream-policy", ""), reply


async def reload_while_a_body_is_awaited(
    orch: Orchestrator,
    path: Path,
    config: dict[str, Any],
    request: tuple[str, bytes, str] | None = None,
) -> tuple[int, str, bytes]:
    """`late_body` of a request (a generation request, else `request`: its path, body and
    content type), admitted (its head read) before `config` is written and reloaded, its body
    sent after."""
    state = orch.runner.app[STATE]
    gate = asyncio.Event()
    path_to, body, content_type = request or (
        STREAMING_PATH,
        json.dumps(generation_body()).encode(),
        "application/json",
    )
    early = asyncio.create_task(late_body(orch, body, gate, path_to, content_type))
    await until(lambda: state.admitted.running == 1, 10, "the request admitted")
    write(path, config)
    assert await reload(orch) == (200, {"reloaded": True, "tenants": ["a", "b"]})
    gate.set()
    return await finished(early, 30, "the request sent after the reload")


async def test_a_request_whose_body_comes_after_a_reload_gets_the_new_guardrails(
    engine, admin, tmp_path: Path
) -> None:
    """A client may open requests (headers only) before a reload that tightens a guardrail and
    send their bodies after it: what judges a request is the policy in force when its pipeline
    is built, never the one its headers met (else pre-opened requests would keep the old policy
    for as long as the request timeout lets them wait)."""
    config = reloadable(engine.url)
    path = write(tmp_path / "config.yaml", config)
    async with Orchestrator(path) as orch:
        assert orch.session is not None
        config["tenants"]["a"]["guardrails"] = {
            MODEL: {"output": {"pii": {"on_detection": "redact"}}}
        }
        status, policy, reply = await reload_while_a_body_is_awaited(orch, path, config)
        async with orch.session.post(
            orch.url + STREAMING_PATH, json=generation_body(), headers=A
        ) as r:
            new_policy = r.headers["x-guardstream-policy"]
            await r.read()
    events = sse_events(reply.decode())
    assert status == 200
    assert "".join(f["generated_text"] for f in frames(events)) == "Mail [email] now."
    assert terminal(events).name == "completed"
    assert policy == new_policy
    assert b"ann@" not in reply


@pytest.mark.parametrize(
    "change",
    [{"chunker_id": "whole_doc_chunker"}, {"applies_to": ["text"]}],
    ids=["chunker", "applies_to"],
)
async def test_a_reload_that_changes_how_a_guardrail_judges_changes_the_policy_hash(
    engine, admin, tmp_path: Path, change: dict[str, Any]
) -> None:
    """What the enforced pii judges at once (a chunk, or the whole text) or what it applies to
    (tool calls too) changes its verdicts: the policy a client is told must change with it."""
    config = with_detectors(engine.url)
    path = write(tmp_path / "config.yaml", config)
    async with Orchestrator(path) as orch:
        _, _, before = await get(orch, MODELS_PATH, A)
        config["detectors"]["pii"].update(change)
        write(path, config)
        assert await reload(orch) == (200, {"reloaded": True, "tenants": ["a", "b"]})
        _, _, after = await get(orch, MODELS_PATH, A)
    assert after["x-guardstream-policy"] != before["x-guardstream-policy"]


async def test_a_bad_file_changes_nothing_and_says_why(engine, admin, tmp_path: Path) -> None:
    config = reloadable(engine.url)
    path = write(tmp_path / "config.yaml", config)
    async with Orchestrator(path) as orch:
        _, _, before = await get(orch, MODELS_PATH, A)
        broken = json.loads(json.dumps(config))
        broken["tenants"]["a"]["guardrails"] = {MODEL: {"output": {"pi": {}}}}
        broken["tenants"]["b"]["limits"] = {"tokens_per_minut": 5}
        broken["detectors"]["pii"]["default_threshold"] = 0.9
        broken["models"][MODEL]["limits"] = {"max_new_tokens": 5}
        write(path, broken)
        status, body = await reload(orch)
        errors = [
            "tenants.b.limits.tokens_per_minut: unknown key (did you mean 'tokens_per_minute'?)",
            f"tenants.a.guardrails.{MODEL}.output.pi: unknown detector 'pi' (did you mean 'pii'?)",
        ]
        assert (status, body) == (
            422,
            {
                "code": 422,
                "details": f"config not reloaded: 2 error(s): {'; '.join(errors)}",
                "type": "invalid_request",
                "errors": errors,
            },
        )
        # valid, but beyond what a reload applies
        fixed = json.loads(json.dumps(broken))
        fixed["tenants"]["a"]["guardrails"] = {}
        fixed["tenants"]["b"]["limits"] = {}
        fixed["server"].update(port=8033, workers=2)
        write(path, fixed)
        status, body = await reload(orch)
        assert status == 422
        reason = (
            "changed (a reload applies only tenants, models, detectors, chunkers, "
            "detection_cache, server.api_keys_env and server.admin_keys_env; restart for this)"
        )
        assert body["errors"] == [f"server.port: {reason}", f"server.workers: {reason}"]
        _, _, after = await get(orch, MODELS_PATH, A)
        assert after["x-guardstream-policy"] == before["x-guardstream-policy"]
        assert terminal(await orch.stream(generation_body(), headers=B)).name == "completed"
        # only an admin key reloads
        assert (await reload(orch, A))[0] == 401
        assert (await reload(orch, {}))[0] == 401


async def test_a_rotated_key_is_refused_after_a_reload(
    engine, admin, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = reloadable(engine.url)
    path = write(tmp_path / "config.yaml", config)
    monkeypatch.setenv("TENANT_A_KEYS_NEXT", "the-new-key-of-a")
    async with Orchestrator(path) as orch:
        assert (await get(orch, MODELS_PATH, A))[0] == 200
        config["tenants"]["a"]["keys_env"] = "TENANT_A_KEYS_NEXT"
        # a request admitted with the old key before the reload, whose body comes after it
        late, _, reply = await reload_while_a_body_is_awaited(orch, path, config)
        assert (await get(orch, MODELS_PATH, A))[0] == 401
        status, _, headers = await get(
            orch, MODELS_PATH, {"Authorization": "Bearer the-new-key-of-a"}
        )
        assert (status, headers["x-guardstream-tenant"]) == (200, "a")
    # refused as well, before the model was called
    assert (late, json.loads(reply)) == (
        401,
        {"code": 401, "details": UNAUTHORIZED_MESSAGE, "type": "unauthorized"},
    )
    assert engine.requests == []


MAIL = "Mail jo@example.com."


@pytest.mark.parametrize(
    "request_",
    [
        (CONTENT_PATH, {"content": MAIL, "detectors": {"pii": {}}}),
        (
            CHAT_DETECTION_ONLY_PATH,
            {"messages": [{"role": "user", "content": MAIL}], "detectors": {"pii": {}}},
        ),
        (
            GENERATED_DETECTION_PATH,
            {"prompt": "Who?", "generated_text": MAIL, "detectors": {"pii": {}}},
        ),
        (STREAM_CONTENT_PATH, {"content": MAIL, "detectors": {"pii": {}}}),
    ],
    ids=["content", "chat", "generated", "stream-content"],
)
async def test_a_key_a_reload_took_away_is_refused_on_every_endpoint_once_the_body_comes(
    engine, admin, tmp_path: Path, request_: tuple[str, dict[str, Any]]
) -> None:
    """Repro: only the generation endpoints resolved a request's key again once its body had
    come (README "Tenants": "a key the reload took away is a 401"). A client that opened
    detection requests (headers only) with a key, which the operator then rotated away, sent
    their bodies afterwards and was served on /content, /chat, /generated and stream-content,
    for as long as the request timeout let it wait: 200 with the detections."""
    config = reloadable(engine.url)
    path = write(tmp_path / "config.yaml", config)
    url_path, body = request_
    ndjson = url_path == STREAM_CONTENT_PATH
    raw = json.dumps(body).encode() + (b"\n" if ndjson else b"")
    content_type = NDJSON if ndjson else "application/json"
    async with Orchestrator(path) as orch:
        config["tenants"]["a"]["keys_env"] = "TENANT_A_KEYS_NEXT"
        with pytest.MonkeyPatch.context() as env:
            env.setenv("TENANT_A_KEYS_NEXT", "the-new-key-of-a")
            status, _, reply = await reload_while_a_body_is_awaited(
                orch, path, config, (url_path, raw, content_type)
            )
    assert (status, json.loads(reply)) == (
        401,
        {"code": 401, "details": UNAUTHORIZED_MESSAGE, "type": "unauthorized"},
    )


async def test_a_request_whose_body_comes_after_a_reload_gets_the_new_limits(
    engine, admin, tmp_path: Path
) -> None:
    """Repro: a request whose body came after a reload was judged by the new guardrails, but
    counted against the limits its tenant had before: the gate took the new limits only at the
    tenant's next request head. A tenant that opened requests (headers only) before the operator
    held it to one stream at a time sent their bodies after the reload, and as long as it sent
    no new request, every one of them streamed at once. Now the limits are resolved again with
    the tenant: the second is refused, before any byte."""
    config = reloadable(engine.url)
    path = write(tmp_path / "config.yaml", config)
    async with Orchestrator(path) as orch:
        assert orch.runner is not None
        state = orch.runner.app[STATE]
        engine.hold_after = 1  # the first stream stays open after its first token
        raw = json.dumps(generation_body(model_id=PRIVATE)).encode()
        gates = [asyncio.Event(), asyncio.Event()]
        early = [asyncio.create_task(late_body(orch, raw, gate)) for gate in gates]
        await until(lambda: state.admitted.running == 2, 10, "both requests admitted")
        config["tenants"]["a"]["limits"] = {"max_concurrent_streams": 1}
        write(path, config)
        assert await reload(orch) == (200, {"reloaded": True, "tenants": ["a", "b"]})
        gates[0].set()
        await engine.wait_requests(1)
        gates[1].set()
        status, _, reply = await finished(early[1], 30, "the second request")
        assert (status, json.loads(reply)) == (
            429,
            {
                "code": 429,
                "details": "tenant `a`: too many concurrent streams (limit 1)",
                "type": "overloaded",
            },
        )
        engine.release.set()
        status, _, reply = await finished(early[0], 30, "the first request")
    assert status == 200 and terminal(sse_events(reply.decode())).name == "completed"
    assert len(engine.requests) == 1


async def test_sighup_reloads_the_served_config(engine, admin, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TENANT_A_KEYS_NEXT", "the-new-key-of-a")
    config = reloadable(engine.url)
    async with serve(tmp_path, config) as served, aiohttp.ClientSession() as session:

        async def status_of(key: str) -> int:
            headers = {"Authorization": f"Bearer {key}"}
            async with session.get(served.url + MODELS_PATH, headers=headers) as r:
                return r.status

        assert await status_of(A_KEY) == 200
        config["tenants"]["a"]["keys_env"] = "TENANT_A_KEYS_NEXT"
        write(tmp_path / "config.yaml", config)
        served.proc.send_signal(signal.SIGHUP)
        await served.wait_logged("config reloaded from")
        assert await status_of(A_KEY) == 401
        assert await status_of("the-new-key-of-a") == 200


@settings(max_examples=50, deadline=None)
@given(
    per_minute=st.integers(1, 10_000),
    charges=st.lists(st.integers(0, 20_000), min_size=1, max_size=5),
    waited=st.lists(st.floats(0, 120), min_size=1, max_size=5),
)
def test_a_bucket_refills_continuously_and_retry_after_is_exact(
    per_minute: int, charges: list[int], waited: list[float]
) -> None:
    """The level never exceeds the minute's capacity, and a refusal's Retry-After is the first
    whole second at which the same request is admitted: one second earlier it is not."""
    now = [0.0]
    bucket = TokenBucket(per_minute, lambda: now[0])
    for charge, wait in zip(charges, waited, strict=False):
        bucket.charge(charge)
        now[0] += wait
        assert bucket.level() <= per_minute
    retry_after = bucket.positive()
    if retry_after is None:
        assert bucket.level() > 0
        return
    start = now[0]
    now[0] = start + retry_after - 1
    assert bucket.positive() is not None
    now[0] = start + retry_after
    assert bucket.positive() is None


@settings(max_examples=50, deadline=None)
@given(
    limit=st.one_of(st.none(), st.integers(1, 100_000)),
    workers=st.integers(1, 64),
)
def test_each_worker_enforces_its_share_of_a_tenants_limits(
    limit: int | None, workers: int
) -> None:
    """server.workers > 1: each worker counts only what it serves, so each gets 1/N of the
    rates and streams, rounded up and at least 1: together at least the limit, at most N - 1
    over it (not N times it); max_new_tokens bounds one request and is not divided."""
    limits = TenantLimits(
        max_concurrent_streams=limit,
        requests_per_minute=limit,
        tokens_per_minute=limit,
        max_new_tokens=limit,
    )
    share = per_worker(limits, workers)
    assert share.max_new_tokens == limit
    for got in (share.max_concurrent_streams, share.requests_per_minute, share.tokens_per_minute):
        if limit is None:
            assert got is None
        else:
            assert got == max(1, -(-limit // workers))
            assert limit <= got * workers < limit + workers or got == 1
    assert per_worker(limits, 1) is limits


def test_a_workers_gate_refuses_beyond_its_share_and_says_so() -> None:
    gate = TenantGate(
        TenantLimits(max_concurrent_streams=3, requests_per_minute=5), lambda: FROZEN_AT, 2
    )
    for _ in range(3):
        gate.admit_request("a")
    with pytest.raises(RateLimited) as refused:
        gate.admit_request("a")
    assert refused.value.details == (
        "tenant `a`: over its limit of 5 requests per minute, 3 on each of 2 workers"
    )
    gate.take_stream("a")
    gate.take_stream("a")
    with pytest.raises(RateLimited) as refused:
        gate.take_stream("a")
    assert refused.value.details == (
        "tenant `a`: too many concurrent streams (limit 3, 2 on each of 2 workers)"
    )


def with_detectors(engine_url: str) -> dict[str, Any]:
    """`reloadable`, with the model's output judged by `pii` (redact) and a detector `keep`
    that no reload changes."""
    config = reloadable(engine_url)
    config["detectors"]["keep"] = {"builtin": "regex", "chunker_id": "sentence"}
    config["models"][MODEL]["guardrails"] = {"output": {"pii": {"on_detection": "redact"}}}
    return config


async def hold_one_stream_while(
    orch: Orchestrator, engine: FakeEngine, body: dict[str, Any], step: Any
) -> list[Any]:
    """A stream that the engine holds after its first token while `step()` runs (its gate
    opens once `step` has returned); the stream's events. (Held at the engine, not once a frame
    reached the client: a redacting guardrail sends nothing before the sentence ends.)"""
    engine.hold_after = 1
    stream = asyncio.create_task(orch.stream(body, headers=A))
    try:
        await until(lambda: engine.holding == 1, 10, "the stream held at the engine")
        await step()
    finally:
        engine.release.set()
    return await finished(stream, 30, "the held stream")


async def test_a_reload_rebuilds_changed_detectors_keeps_unchanged_ones_and_spares_running_streams(
    engine, admin, tmp_path: Path
) -> None:
    config = with_detectors(engine.url)
    path = write(tmp_path / "config.yaml", config)
    async with Orchestrator(path) as orch:
        state = orch.runner.app[STATE]
        before = state.detectors.clients()
        seen: dict[str, Any] = {}

        async def reload_then_ask() -> None:
            # pii's params change, `word` is new and enforced on the model's output
            config["detectors"]["pii"]["params"] = {"patterns": {"mailword": "Mail"}}
            config["detectors"]["word"] = {
                "builtin": "regex",
                "chunker_id": "sentence",
                "params": {"kinds": ["ipv6"], "patterns": {"nowword": "now"}},
            }
            config["models"][MODEL]["guardrails"]["output"]["word"] = {"on_detection": "redact"}
            write(path, config)
            assert await reload(orch) == (200, {"reloaded": True, "tenants": ["a", "b"]})
            seen["retired while running"] = state.retiring.done()
            engine.hold_after = None
            seen["new"] = await orch.stream(generation_body(), headers=A)

        running = await hold_one_stream_while(orch, engine, generation_body(), reload_then_ask)
        await finished(state.retiring, 10, "the replaced clients closed")
        after = state.detectors.clients()
    # the running stream: the detectors and the policy it started with
    assert "".join(f["generated_text"] for f in frames(running)) == "Mail [email] now."
    # the next one: pii's new params and the new enforced detector
    assert "".join(f["generated_text"] for f in frames(seen["new"])) == (
        "[mailword] [email] [nowword]."
    )
    assert after["keep"] is before["keep"]  # unchanged: not rebuilt
    assert after["pii"] is not before["pii"] and "word" in after
    assert seen["retired while running"] is False  # pii's old client outlived the stream


async def test_a_reload_adds_and_removes_models_while_a_running_stream_finishes(
    engine, admin, tmp_path: Path
) -> None:
    config = reloadable(engine.url)
    path = write(tmp_path / "config.yaml", config)
    fresh = "fresh-model"
    async with Orchestrator(path) as orch:
        state = orch.runner.app[STATE]
        kept = state.backends[MODEL]
        seen: dict[str, Any] = {}

        async def reload_then_ask() -> None:
            config["models"][fresh] = config["models"].pop(PRIVATE)
            config["tenants"]["a"]["models"] = [MODEL, fresh]
            write(path, config)
            assert await reload(orch) == (200, {"reloaded": True, "tenants": ["a", "b"]})
            seen["retired while running"] = state.retiring.done()
            engine.hold_after = None
            seen["models"] = (await get(orch, MODELS_PATH, A))[1]
            seen["fresh"] = await orch.stream(generation_body(model_id=fresh), headers=A)
            seen["removed"] = await orch.post(
                STREAMING_PATH, generation_body(model_id=PRIVATE), headers=A
            )

        running = await hold_one_stream_while(
            orch, engine, generation_body(model_id=PRIVATE), reload_then_ask
        )
        await finished(state.retiring, 10, "the removed model's backend closed")
        assert state.backends[MODEL] is kept  # unchanged: the same backend
    assert [m["id"] for m in seen["models"]["data"]] == [MODEL, fresh]
    assert terminal(seen["fresh"]).name == "completed"
    assert "".join(f["generated_text"] for f in frames(seen["fresh"])) == "".join(SCRIPT)
    assert seen["removed"] == (
        404,
        {
            "code": 404,
            "details": f"model `{PRIVATE}` not found (available: {MODEL}, {fresh})",
            "type": "not_found",
        },
    )
    # the stream on the removed model finished on its backend, which closed after it
    assert terminal(running).name == "completed"
    assert "".join(f["generated_text"] for f in frames(running)) == "".join(SCRIPT)
    assert seen["retired while running"] is False


async def test_a_reload_whose_new_parts_cannot_start_changes_nothing(
    engine, admin, tmp_path: Path
) -> None:
    """Valid, but a new model's backend cannot be built (its key variable is unset): the error
    names it, and nothing of the file applies (not the new detector built beside it)."""
    config = with_detectors(engine.url)
    path = write(tmp_path / "config.yaml", config)
    async with Orchestrator(path) as orch:
        state = orch.runner.app[STATE]
        before = (state.config, state.detectors, dict(state.backends), state.tenants)
        config["detectors"]["word"] = {"builtin": "regex", "chunker_id": "sentence"}
        config["models"]["keyed"] = {
            "backends": [{"type": "native", "url": engine.url, "api_key_env": "NO_SUCH_KEY"}]
        }
        write(path, config)
        status, body = await reload(orch)
        assert status == 422
        assert body["errors"] == [
            "models.keyed.backends.0.api_key_env: environment variable NO_SUCH_KEY is not set"
        ]
        assert (state.config, state.detectors, state.backends, state.tenants) == before
        assert state.retiring is None
        assert terminal(await orch.stream(generation_body(), headers=A)).name == "completed"


async def test_a_changed_model_gets_a_new_backend_while_its_running_stream_finishes_on_the_old(
    engine, admin, tmp_path: Path
) -> None:
    config = reloadable(engine.url)
    path = write(tmp_path / "config.yaml", config)
    async with Orchestrator(path) as orch:
        state = orch.runner.app[STATE]
        old = state.backends[MODEL]
        seen: dict[str, Any] = {}

        async def reload_then_ask() -> None:
            config["models"][MODEL]["limits"] = {"max_new_tokens": 5}
            write(path, config)
            assert (await reload(orch))[0] == 200
            seen["retired while running"] = state.retiring.done()
            seen["new backend"] = state.backends[MODEL] is not old
            engine.hold_after = None
            seen["over"] = await orch.post(
                STREAMING_PATH, generation_body(params={"max_new_tokens": 6}), headers=A
            )

        running = await hold_one_stream_while(orch, engine, generation_body(), reload_then_ask)
        await finished(state.retiring, 10, "the old backend closed")
    assert seen == {
        "retired while running": False,
        "new backend": True,
        "over": (
            422,
            {
                "code": 422,
                "details": "text_gen_parameters.max_new_tokens: 6 exceeds this model's limit of 5",
                "type": "invalid_request",
            },
        ),
    }
    assert terminal(running).name == "completed"
    assert "".join(f["generated_text"] for f in frames(running)) == "".join(SCRIPT)


def test_with_several_workers_a_model_with_managed_engines_cannot_change() -> None:
    """The supervisor starts managed engines once for every worker: a worker's reload refuses
    a change to such a model (its guardrails still reload), and to nothing else."""
    config = tenants_config("http://127.0.0.1:9")
    config["models"]["managed"] = managed_model(1)
    old = parse_config(config)
    config["models"]["managed"]["guardrails"] = {"output": {"pii": {}}}
    config["models"][MODEL]["limits"] = {"max_new_tokens": 5}
    assert managed_engines_changed(old, parse_config(config)) == []
    config["models"]["managed"]["migration"] = {"limit": 1}
    config["models"]["added"] = managed_model(1)
    assert managed_engines_changed(old, parse_config(config)) == [
        f"models.{m}: a model with a managed backend cannot change while server.workers > 1 "
        "(the supervisor starts its engines once for every worker; restart for this)"
        for m in ("added", "managed")
    ]


async def test_a_stream_the_client_leaves_is_still_charged_to_its_tenant(engine) -> None:
    """Repro: a tenant's tokens were charged only when its stream reached a terminal event. A
    client that read the text it wanted and disconnected before the end (or retried instead of
    waiting) was never charged: with a budget of 60 tokens per minute, 101-token streams left
    after their first frame were admitted again and again, and /v1/usage counted none."""
    config = tenants_config(engine.url, tokens_per_minute=TOKENS_PER_MINUTE)
    async with Orchestrator(config) as orch:
        frozen(orch)
        assert orch.session is not None
        engine.hold_after = 1  # the stream waits after its first token: the client leaves then
        body = generation_body("x" * 100, model_id=PRIVATE)  # a token per character: 100
        async with orch.session.post(orch.url + STREAMING_PATH, json=body, headers=A) as r:
            assert r.status == 200
            first = json.loads((await r.content.readuntil(b"\n\n")).decode()[len("data: ") :])
            assert first["generated_text"] == SCRIPT[0]
        await engine.wait_disconnects(1)  # the client's leaving ended the generation

        async def charged() -> bool:
            _, usage, _ = await get(orch, USAGE_PATH, A)
            return usage["generated_tokens"] == 1

        await until(charged, what="the left stream's tokens in a's usage")
        _, usage, _ = await get(orch, USAGE_PATH, A)
        assert (usage["prompt_tokens"], usage["generated_tokens"]) == (100, 1)
        # 101 tokens of a budget of 60: the next request waits (42 s at a token a second)
        status, refused = await orch.post(STREAMING_PATH, generation_body(), headers=A)
        assert (status, refused["details"]) == (
            429,
            f"tenant `a`: over its budget of {TOKENS_PER_MINUTE} tokens per minute",
        )


async def test_detection_requests_count_against_a_tenants_concurrent_streams(engine) -> None:
    """Repro: a tenant's max_concurrent_streams ("its requests served at once") bounded its
    generations and stream-content, not its requests to the detection endpoints: a tenant held
    to one stream ran any number of /content, /chat and /generated requests at once, each a
    share of every detector's queue (fair per request), crowding out the other tenants."""
    config = tenants_config(engine.url, max_concurrent_streams=1)
    release = asyncio.Event()

    async def held_body() -> AsyncIterator[bytes]:
        yield json.dumps({"content": "Hello.", "detectors": {"pii": {}}}).encode() + b"\n"
        await release.wait()

    mail = "Mail jo@example.com."
    requests = [
        (CONTENT_PATH, {"content": mail, "detectors": {"pii": {}}}),
        (
            CHAT_DETECTION_ONLY_PATH,
            {"messages": [{"role": "user", "content": mail}], "detectors": {"pii": {}}},
        ),
        (
            CONTEXT_DETECTION_PATH,
            {"content": mail, "context_type": "docs", "context": ["x"], "detectors": {"pii": {}}},
        ),
        (
            GENERATED_DETECTION_PATH,
            {"prompt": "Who?", "generated_text": mail, "detectors": {"pii": {}}},
        ),
    ]
    over = {
        "code": 429,
        "details": "tenant `a`: too many concurrent streams (limit 1)",
        "type": "overloaded",
    }
    async with Orchestrator(config) as orch:
        assert orch.session is not None and orch.runner is not None
        gate = orch.runner.app[STATE].gates
        session = orch.session

        async def hold() -> int:
            async with session.post(
                orch.url + STREAM_CONTENT_PATH,
                data=held_body(),
                headers={"Content-Type": NDJSON, **A},
            ) as r:
                await r.read()
                return r.status

        holder = asyncio.create_task(hold())
        await until(lambda: "a" in gate and gate["a"].streams == 1, what="a's stream running")
        for path, body in requests:
            assert await orch.post(path, body, headers=A) == (429, over), path
            status, _ = await orch.post(path, body, headers=B)  # b is not a's limit
            assert status == (422 if path == CONTEXT_DETECTION_PATH else 200), path
        release.set()
        assert await finished(holder) == 200
        assert gate["a"].streams == 0
        status, reply = await orch.post(CONTENT_PATH, requests[0][1], headers=A)
        assert (status, [d["text"] for d in reply["detections"]]) == (200, ["jo@example.com"])
        assert gate["a"].streams == 0  # given back when the request ended


async def test_a_token_budget_bounds_a_tenants_streams_running_at_once(engine) -> None:
    """Repro: a tenant's tokens were charged only when a stream ended, and a request was
    admitted while the bucket was positive: streams started together were all admitted. With a
    budget of 60 tokens per minute (and no limit on its streams), a tenant held one 100-token
    stream open and started as many more as it liked, each admitted against the untouched 60,
    the whole engine spent on its behalf while the other tenants waited. Now a request holds
    its token budget plus a quarter of its prompt's characters from admission until it ends
    (then it is charged what it spent): the second stream is refused while the first runs,
    the other tenant is not, and once the first ends the bucket is what it spent left."""
    config = tenants_config(engine.url, tokens_per_minute=TOKENS_PER_MINUTE)
    async with Orchestrator(config) as orch:
        frozen(orch)
        assert orch.session is not None and orch.runner is not None
        gate = orch.runner.app[STATE].gates
        # a request refused after its hold was taken (its masks lie past its text) gives it back
        beyond = generation_body("Hi", model_id=PRIVATE)
        beyond["guardrail_config"] = {"input": {"masks": [[0, 5]]}}
        assert (await orch.post(STREAMING_PATH, beyond, headers=A))[0] == 422
        assert gate["a"].tokens is not None and gate["a"].tokens.level() == TOKENS_PER_MINUTE
        engine.hold_after = 1  # every stream waits after its first token until released
        long_prompt = "x" * 100  # the fake engine counts a token per character
        # the private model: a has no output guardrail there to hold the first token back
        held = generation_body(long_prompt, params={"max_new_tokens": 8}, model_id=PRIVATE)
        async with orch.session.post(orch.url + STREAMING_PATH, json=held, headers=A) as first:
            assert first.status == 200
            frame = json.loads((await first.content.readuntil(b"\n\n")).decode()[len("data: ") :])
            assert frame["generated_text"] == SCRIPT[0]
            # 8 + 100 // 4 = 33 of 60 held: a's bucket holds 27, and a's next request of the
            # same size is admitted against it; the one after is refused, before any byte
            second = asyncio.create_task(orch.stream(held, headers=A))
            await engine.wait_requests(2)
            async with orch.session.post(orch.url + STREAMING_PATH, json=held, headers=A) as r:
                assert r.status == 429  # before reading: an admitted stream is held open
                refused = (r.status, await r.json(), r.headers["Retry-After"])
            # 60 - 2 * 33 = -6: positive again after 7 s at a token a second
            assert refused == (
                429,
                {
                    "code": 429,
                    "details": f"tenant `a`: over its budget of {TOKENS_PER_MINUTE} tokens per "
                    "minute",
                    "type": "overloaded",
                },
                "7",
            )
            assert len(engine.requests) == 2  # the refused request never reached the engine
            # b's own budget is untouched (it has none): served while a's streams run
            b_done = asyncio.create_task(orch.stream(generation_body(), headers=B))
            await engine.wait_requests(3)
            engine.release.set()
            rest = await first.read()
        assert terminal(sse_events(rest.decode())).name == "completed"
        assert terminal(await finished(second)).name == "completed"
        assert terminal(await finished(b_done)).name == "completed"
        # each stream charged what it spent (100 + 4 tokens), its hold given back: 60 - 208
        assert gate["a"].tokens.level() == TOKENS_PER_MINUTE - 2 * 104
        status, _ = await orch.post(STREAMING_PATH, generation_body(), headers=A)
        assert status == 429
