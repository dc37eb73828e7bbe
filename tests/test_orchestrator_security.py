"""What an operator exposing the service needs, black-box over real sockets: Bearer API keys,
HTTPS and mutual TLS (server side and towards remote detectors and engines), request limits
(body size, per-model caps, concurrent streams) and the request id and header allowlist that
reach every downstream call."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import trustme
from aiohttp import web
from multidict import CIMultiDict

from orchestrator.app import (
    CONTENT_PATH,
    STREAM_CONTENT_PATH,
    STREAMING_PATH,
    UNARY_PATH,
    forwardable,
)
from orchestrator.config import ConfigError, parse_config
from orchestrator.server import start_server
from orchestrator.state import STATE
from tests.fakes.detector import DetectorBehaviour, FakeDetectorServer
from tests.fakes.engine import FakeEngine, GatedEngine
from tests.orchestrator_support import (
    NDJSON,
    SCRIPT,
    Orchestrator,
    assert_contiguous,
    frames,
    generation_body,
    native_config,
    remote,
    sse_events,
    terminal,
)
from tests.wait_support import until

ROOT = Path(__file__).resolve().parent.parent
TEXT = "I am great. What about you?"
KEYS_ENV = "GUARDSTREAM_TEST_API_KEYS"
UNAUTHORIZED = {"code": 401, "details": "missing or invalid API key", "type": "unauthorized"}


# -- fakes that the shared ones lack: TLS, a gate, recorded headers ------------------------------


class TlsEngine(FakeEngine):
    """The fake engine served over HTTPS (FakeEngine.start has no TLS option)."""

    ssl_context: ssl.SSLContext | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/generate", self._generate)
        app.router.add_post("/v1/tokenize", self._tokenize)
        app.router.add_get("/health", self._health)
        self.port = await self._serve(app, ssl_context=self.ssl_context)
        return self.url


class RecordingDetectorServer(FakeDetectorServer):
    """The fake detector service, optionally over HTTPS, recording each call's headers."""

    def __init__(self, ssl_context: ssl.SSLContext | None = None) -> None:
        super().__init__(ssl_context)
        self.headers: list[CIMultiDict[str]] = []

    async def _contents(self, request: web.Request) -> web.Response:
        self.headers.append(CIMultiDict(request.headers))
        return await super()._contents(request)


@pytest.fixture
async def dets() -> AsyncIterator[RecordingDetectorServer]:
    server = RecordingDetectorServer()
    server.add("great", DetectorBehaviour(words={"great": 0.9}, detection="positive"))
    await server.start()
    yield server
    await server.close()


async def read_stream(resp: aiohttp.ClientResponse) -> list[Any]:
    assert resp.status == 200, await resp.text()
    return sse_events(await resp.text())


# -- 1. API keys ---------------------------------------------------------------------------------


@pytest.fixture
def keys(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    monkeypatch.setenv(KEYS_ENV, " key-one , key-two-is-longer,")
    return ["key-one", "key-two-is-longer"]


def auth_config(engine: FakeEngine) -> dict[str, Any]:
    return native_config(engine.url, server={"api_keys_env": KEYS_ENV})


@pytest.mark.parametrize("scheme", ["Bearer", "bearer"])
async def test_every_configured_key_is_accepted(engine, keys, scheme) -> None:
    async with Orchestrator(auth_config(engine)) as orch:
        for key in keys:
            events = await orch.stream(
                generation_body(), headers={"Authorization": f"{scheme} {key}"}
            )
            assert terminal(events).name == "completed"
            status, body = await orch.post(
                UNARY_PATH, generation_body(), headers={"Authorization": f"{scheme} {key}"}
            )
            assert status == 200, body
            assert body["generated_text"] == TEXT
    assert len(engine.requests) == 2 * len(keys)


@pytest.mark.parametrize(
    "authorization",
    [
        None,  # no header
        "",
        "Bearer",
        "Bearer ",
        "Bearer wrong-key",
        "Bearer key-on",  # a prefix of a key
        "Bearer key-one-and-more",
        "Bearer key-one,key-two-is-longer",  # the env value is not a key
        "Basic a2V5LW9uZQ==",  # the right key, base64, under another scheme
        "Token key-one",
        "key-one",  # no scheme
    ],
)
async def test_rejections_look_the_same_whatever_failed(engine, keys, authorization) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}
    async with Orchestrator(auth_config(engine)) as orch:
        assert orch.session is not None
        for path, body in [
            (STREAMING_PATH, generation_body()),
            (UNARY_PATH, generation_body()),
            (CONTENT_PATH, {"content": "x", "detectors": {}}),
            (STREAM_CONTENT_PATH, '{"content": "x"}\n'),
            ("/api/v1/no-such-endpoint", {}),
        ]:
            kwargs = {"data": body} if isinstance(body, str) else {"json": body}
            async with orch.session.post(orch.url + path, headers=headers, **kwargs) as r:
                assert r.status == 401, path
                assert r.headers["WWW-Authenticate"] == "Bearer"
                assert r.headers["Content-Type"].startswith("application/json")
                assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
                assert await r.json() == UNAUTHORIZED
    assert engine.requests == []  # nothing reached the model


async def test_probes_stay_open(engine, keys) -> None:
    """Kubelet probes carry no key; everything else needs one, /metrics included (it names
    replicas and detectors) unless `server.public_metrics` opens it."""
    async with Orchestrator(auth_config(engine)) as orch:
        assert orch.session is not None
        for path in ["/health", "/openapi.json"]:
            async with orch.session.get(orch.url + path) as r:
                assert r.status == 200, path
        async with orch.session.get(orch.url + "/info") as r:
            assert r.status in (200, 503)  # readiness, not an auth failure
            assert "status" in await r.json()
        async with orch.session.get(orch.url + "/metrics") as r:
            assert r.status == 401
            assert await r.json() == UNAUTHORIZED
        async with orch.session.get(orch.url + "/no-such-page") as r:
            assert r.status == 401  # deny by default: unknown paths do not answer 404
            assert await r.json() == UNAUTHORIZED


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (None, f"server.api_keys_env: environment variable {KEYS_ENV} is not set"),
        (" , ,", f"server.api_keys_env: environment variable {KEYS_ENV} holds no key"),
    ],
)
async def test_missing_keys_are_a_config_error_at_startup(
    engine, monkeypatch, value, message
) -> None:
    if value is None:
        monkeypatch.delenv(KEYS_ENV, raising=False)
    else:
        monkeypatch.setenv(KEYS_ENV, value)
    with pytest.raises(ConfigError) as info:
        await start_server(parse_config(auth_config(engine)), "127.0.0.1", 0)
    assert info.value.errors == [message]


def test_serve_without_the_keys_variable_exits_1_with_the_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = native_config("http://127.0.0.1:9", server={"api_keys_env": KEYS_ENV})
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    env = {k: v for k, v in os.environ.items() if k != KEYS_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", "serve", "--config", str(path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    assert f"server.api_keys_env: environment variable {KEYS_ENV} is not set" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "listening" not in proc.stdout


# -- 2. TLS --------------------------------------------------------------------------------------


class Pki:
    """A private CA and the files a config points at, in tmp_path."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca = trustme.CA()
        self.ca_path = self._write("ca.pem", [self.ca.cert_pem.bytes()])
        self.server = self.ca.issue_cert("127.0.0.1", "localhost")
        self.server_cert, self.server_key = self.write_cert("server", self.server)
        self.client = self.ca.issue_cert("guardstream-client.example")
        self.client_cert, self.client_key = self.write_cert("client", self.client)

    def _write(self, name: str, pems: list[bytes]) -> str:
        path = self.root / name
        path.write_bytes(b"".join(pems))
        return str(path)

    def write_cert(self, name: str, cert: trustme.LeafCert) -> tuple[str, str]:
        chain = self._write(f"{name}.pem", [p.bytes() for p in cert.cert_chain_pems])
        key = self._write(f"{name}-key.pem", [cert.private_key_pem.bytes()])
        return chain, key

    def server_context(self, *, require_client_cert: bool = False) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.server.configure_cert(ctx)
        if require_client_cert:
            self.ca.configure_trust(ctx)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def client_context(self, *, with_cert: bool = False) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca_path)
        if with_cert:
            self.client.configure_cert(ctx)
        return ctx


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path)


@asynccontextmanager
async def https_orchestrator(config: dict[str, Any]) -> AsyncIterator[str]:
    runner, port = await start_server(parse_config(config), "127.0.0.1", 0, device="cpu")
    try:
        yield f"https://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def get_health(url: str, ssl_ctx: ssl.SSLContext | bool | None) -> int:
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/health", ssl=ssl_ctx) as r:
            assert (await r.json())["status"] == "ok"
            return r.status


async def test_https_handshake_with_the_ca(engine, pki) -> None:
    tls = {"cert_path": pki.server_cert, "key_path": pki.server_key}
    async with https_orchestrator(native_config(engine.url, server={"tls": tls})) as url:
        assert await get_health(url, pki.client_context()) == 200
        async with aiohttp.ClientSession() as session:
            async with session.post(
                url + STREAMING_PATH, json=generation_body(), ssl=pki.client_context()
            ) as r:
                assert terminal(await read_stream(r)).name == "completed"
        # a client that does not trust the CA refuses the server
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await get_health(url, ssl.create_default_context())
        # plain HTTP on the TLS port gets nothing it can read as HTTP
        with pytest.raises(aiohttp.ClientError):
            await get_health(url.replace("https://", "http://"), None)


async def test_client_certificates_are_required_and_verified(engine, pki) -> None:
    tls = {
        "cert_path": pki.server_cert,
        "key_path": pki.server_key,
        "client_ca_path": pki.ca_path,
    }
    async with https_orchestrator(native_config(engine.url, server={"tls": tls})) as url:
        # without a client certificate the handshake fails (TLS 1.3 reports it on first read)
        with pytest.raises(aiohttp.ClientError):
            await get_health(url, pki.client_context())
        # a certificate from another CA fails too
        stranger = trustme.CA().issue_cert("stranger.example")
        ctx = pki.client_context()
        stranger.configure_cert(ctx)
        with pytest.raises(aiohttp.ClientError):
            await get_health(url, ctx)
        # one signed by the configured CA is in
        assert await get_health(url, pki.client_context(with_cert=True)) == 200


@pytest.mark.parametrize(
    "field", ["cert_path", "key_path", "client_ca_path"], ids=["cert", "key", "client-ca"]
)
async def test_unloadable_tls_files_are_config_errors(engine, pki, tmp_path, field) -> None:
    tls = {
        "cert_path": pki.server_cert,
        "key_path": pki.server_key,
        "client_ca_path": pki.ca_path,
        field: str(tmp_path / "missing.pem"),
    }
    with pytest.raises(ConfigError) as info:
        await start_server(parse_config(native_config(engine.url, server={"tls": tls})), "", 0)
    (line,) = info.value.errors
    reported = "cert_path" if field == "key_path" else field  # the key loads with its cert
    assert line.startswith(f"server.tls.{reported}: cannot load ")


async def https_detectors(pki: Pki, *, require_client_cert: bool = False) -> FakeDetectorServer:
    server = RecordingDetectorServer(pki.server_context(require_client_cert=require_client_cert))
    server.add("great", DetectorBehaviour(words={"great": 0.9}, detection="positive"))
    await server.start()
    return server


@pytest.mark.parametrize(
    "tls",
    ["ca", "mtls", "insecure"],
)
async def test_remote_detector_over_https(engine, pki, tls) -> None:
    dets = await https_detectors(pki, require_client_cert=tls == "mtls")
    client_tls = {
        "ca": {"ca_path": pki.ca_path},
        "mtls": {
            "ca_path": pki.ca_path,
            "cert_path": pki.client_cert,
            "key_path": pki.client_key,
        },
        "insecure": {"insecure_skip_verify": True},
    }[tls]
    config = native_config(engine.url, detectors={"great": remote(dets.url, tls=client_tls)})
    try:
        async with Orchestrator(config) as orch:
            events = await orch.stream(generation_body(output={"great": {}}))
    finally:
        await dets.close()
    assert terminal(events).name == "completed"
    assert assert_contiguous(frames(events)) == TEXT
    (found,) = [d for f in frames(events) for d in f["token_classification_results"]["output"]]
    assert (found["start"], found["end"], found["detector_id"]) == (5, 10, "great")


@pytest.mark.parametrize("tls", ["no-ca", "mtls-without-cert"])
async def test_untrusted_detector_is_a_detector_error_naming_it(engine, pki, tls) -> None:
    dets = await https_detectors(pki, require_client_cert=tls == "mtls-without-cert")
    client_tls = None if tls == "no-ca" else {"ca_path": pki.ca_path}
    config = native_config(engine.url, detectors={"great": remote(dets.url, tls=client_tls)})
    try:
        async with Orchestrator(config) as orch:
            events = await orch.stream(generation_body(output={"great": {}}))
            # the service is fine: a request without that detector is served normally
            after = await orch.stream(generation_body())
    finally:
        await dets.close()
    end = terminal(events)
    assert end.name == "error"  # no frame went out: the first sentence was never judged
    assert set(end.data) == {"code", "details", "type"}
    assert end.data["code"] == 502
    assert end.data["type"] == "detector_error"
    assert end.data["details"].startswith("detector `great`: request failed: ")
    if tls == "no-ca":
        assert "certificate verify failed" in end.data["details"].lower()
    assert terminal(after).name == "completed"


async def test_native_engine_over_https(pki) -> None:
    engine = TlsEngine(script=list(SCRIPT))
    engine.ssl_context = pki.server_context()
    await engine.start()
    config = native_config(engine.url)
    config["models"]["fake-model"]["backends"][0]["tls"] = {"ca_path": pki.ca_path}
    try:
        async with Orchestrator(config) as orch:
            events = await orch.stream(generation_body())
        # without the CA the replica cannot be reached: unavailable, not a crash
        config["models"]["fake-model"]["backends"][0].pop("tls")
        async with Orchestrator(config) as orch:
            failed = await orch.stream(generation_body())
    finally:
        await engine.close()
    assert terminal(events).name == "completed"
    assert assert_contiguous(frames(events)) == TEXT
    end = terminal(failed)
    assert end.name == "error"
    assert end.data["type"] == "generation_unavailable"
    assert len(engine.requests) == 1


# -- 3. limits -----------------------------------------------------------------------------------

LIMIT = 1024


def too_large() -> dict[str, Any]:
    return {
        "code": 413,
        "details": f"request body too large (limit {LIMIT} bytes)",
        "type": "invalid_request",
    }


async def test_request_body_over_max_request_bytes_is_413(engine) -> None:
    config = native_config(engine.url, server={"max_request_bytes": LIMIT})
    async with Orchestrator(config) as orch:
        big = generation_body("x" * (LIMIT + 1))
        for path in (STREAMING_PATH, UNARY_PATH):
            assert await orch.post(path, big) == (413, too_large())
        assert await orch.post(CONTENT_PATH, {"content": "x" * LIMIT, "detectors": {}}) == (
            413,
            too_large(),
        )
        # just under the limit is served
        body = generation_body()
        body["inputs"] = "x" * (LIMIT - len(json.dumps(body)) - 10)
        events = await orch.stream(body)
        assert terminal(events).name == "completed"
    assert len(engine.requests) == 1


async def test_stream_content_body_over_max_request_bytes_is_413(engine, dets) -> None:
    """stream-content bounds the WHOLE body, not only each line: a stream is no excuse for
    unbounded input (DESIGN section 4)."""
    config = native_config(
        engine.url,
        server={"max_request_bytes": LIMIT},
        detectors={"great": remote(dets.url)},
    )
    too_large = {
        "code": 413,
        "details": f"request body too large (limit {LIMIT} bytes)",
        "type": "invalid_request",
    }
    first = json.dumps({"detectors": {"great": {}}, "content": "y" * LIMIT})
    async with Orchestrator(config) as orch:
        # over the limit before the first line is complete: a real 413
        assert await orch.post(STREAM_CONTENT_PATH, first) == (413, too_large)
        # within the limit, in several lines: fine
        lines = [json.dumps({"detectors": {"great": {}}, "content": "great. "})]
        lines += [json.dumps({"content": "So great. "})] * 10
        status, text = await orch.post(STREAM_CONTENT_PATH, "\n".join(lines) + "\n")
        assert status == 200
        results = [json.loads(line) for line in text.splitlines()]
        assert results[-1]["processed_index"] == len("great. ") + 10 * len("So great. ")
        # far over the limit in short lines, after the reply started (the rest of the body is
        # gated on the reply's headers): the reply ends with an in-band 413 error line
        started = asyncio.Event()

        async def body() -> AsyncIterator[bytes]:
            yield (lines[0] + "\n").encode()
            await started.wait()
            for _ in range(200):
                yield (json.dumps({"content": "So great. "}) + "\n").encode()

        assert orch.session is not None
        async with orch.session.post(
            orch.url + STREAM_CONTENT_PATH, data=body(), headers={"Content-Type": NDJSON}
        ) as r:
            assert r.status == 200
            started.set()
            reply = await r.text()
        assert json.loads(reply.splitlines()[-1]) == too_large


async def test_stream_content_newline_terminated_line_over_the_limit_is_413(engine, dets) -> None:
    config = native_config(
        engine.url,
        server={"max_request_bytes": LIMIT},
        detectors={"great": remote(dets.url)},
    )
    first = json.dumps({"detectors": {"great": {}}, "content": "y" * LIMIT}) + "\n"
    async with Orchestrator(config) as orch:
        reply = await orch.post(STREAM_CONTENT_PATH, first)
    assert reply == (
        413,
        {
            "code": 413,
            "details": f"request body too large (limit {LIMIT} bytes)",
            "type": "invalid_request",
        },
    )


@pytest.mark.parametrize("path", [STREAMING_PATH, UNARY_PATH])
async def test_per_model_limits_are_422_naming_the_field(engine, path) -> None:
    config = native_config(
        engine.url, model={"limits": {"max_new_tokens": 10, "max_input_chars": 20}}
    )
    async with Orchestrator(config) as orch:
        assert await orch.post(path, generation_body("x" * 21)) == (
            422,
            {
                "code": 422,
                "details": "inputs: 21 characters exceed this model's limit of 20",
                "type": "invalid_request",
            },
        )
        assert await orch.post(path, generation_body(params={"max_new_tokens": 11})) == (
            422,
            {
                "code": 422,
                "details": "text_gen_parameters.max_new_tokens: 11 exceeds this model's "
                "limit of 10",
                "type": "invalid_request",
            },
        )
        assert engine.requests == []
        # at the limits: served, and the default budget is capped at the model's maximum
        status, _ = await orch.post(path, generation_body("x" * 20))
        assert status == 200
        status, _ = await orch.post(path, generation_body(params={"max_new_tokens": 10}))
        assert status == 200
    assert [r.body["max_new_tokens"] for r in engine.requests] == [10, 10]


async def test_max_concurrent_streams_is_429_until_a_slot_frees() -> None:
    engine = GatedEngine(script=list(SCRIPT))
    await engine.start()
    config = native_config(engine.url, server={"max_concurrent_streams": 2})
    overloaded = {
        "code": 429,
        "details": "too many concurrent streams (limit 2)",
        "type": "overloaded",
    }
    try:
        async with Orchestrator(config) as orch:
            assert orch.session is not None and orch.runner is not None
            state = orch.runner.app[STATE]
            held = [
                await orch.session.post(orch.url + STREAMING_PATH, json=generation_body())
                for _ in range(2)
            ]
            assert [r.status for r in held] == [200, 200]
            await until(lambda: engine.held == 2 and state.active_streams == 2)
            for path in (STREAMING_PATH, UNARY_PATH):
                async with orch.session.post(orch.url + path, json=generation_body()) as r:
                    assert r.status == 429
                    assert r.headers["Retry-After"] == "1"
                    assert r.headers["Content-Type"].startswith("application/json")
                    assert await r.json() == overloaded
            assert engine.held == 2  # the rejected requests never reached the engine
            engine.gate.set()
            for r in held:
                assert terminal(await read_stream(r)).name == "completed"
            await until(lambda: state.active_streams == 0)
            events = await orch.stream(generation_body())
            assert terminal(events).name == "completed"
    finally:
        await engine.close()
    assert engine.held == 3


# -- 4. request id and forwarded headers ---------------------------------------------------------


def forward_config(engine: FakeEngine, dets: FakeDetectorServer) -> dict[str, Any]:
    return native_config(
        engine.url,
        server={"forward_headers": ["X-Tenant", "traceparent", "Content-Length", "Detector-Id"]},
        detectors={"great": remote(dets.url)},
    )


async def test_request_id_from_the_client_reaches_engine_and_detectors(engine, dets) -> None:
    async with Orchestrator(forward_config(engine, dets)) as orch:
        assert orch.session is not None
        async with orch.session.post(
            orch.url + STREAMING_PATH,
            json=generation_body(output={"great": {}}),
            headers={"x-request-id": "req-42.a:b_c"},
        ) as r:
            assert r.headers["x-request-id"] == "req-42.a:b_c"
            assert terminal(await read_stream(r)).name == "completed"
    assert CIMultiDict(engine.requests[0].headers)["x-request-id"] == "req-42.a:b_c"
    assert dets.headers and all(h["x-request-id"] == "req-42.a:b_c" for h in dets.headers)
    assert all(h["detector-id"] == "great" for h in dets.headers)


@pytest.mark.parametrize("given", [None, "", "has space", "x" * 129, "semi;colon", "ünï"], ids=repr)
async def test_missing_or_unsafe_request_id_is_replaced(engine, dets, given) -> None:
    headers = {} if given is None else {"x-request-id": given}
    async with Orchestrator(forward_config(engine, dets)) as orch:
        assert orch.session is not None
        async with orch.session.post(
            orch.url + STREAMING_PATH,
            json=generation_body(output={"great": {}}),
            headers=headers,
        ) as r:
            rid = r.headers["x-request-id"]
            assert terminal(await read_stream(r)).name == "completed"
        # error responses carry one too
        async with orch.session.post(
            orch.url + STREAMING_PATH, json=generation_body(model_id="nope"), headers=headers
        ) as r:
            assert r.status == 404
            other = r.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", rid) and re.fullmatch(r"[0-9a-f]{32}", other)
    assert rid != other
    assert CIMultiDict(engine.requests[0].headers)["x-request-id"] == rid
    assert all(h["x-request-id"] == rid for h in dets.headers)


async def test_only_allowlisted_headers_go_downstream(engine, dets) -> None:
    sent = {
        "X-Tenant": "tenant-7",
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "X-Secret": "do-not-forward",
        "Cookie": "session=1",
        "Authorization": "Bearer client-credential",
        "Detector-Id": "spoofed",  # allowlisted in the config, but it routes detector calls
    }
    async with Orchestrator(forward_config(engine, dets)) as orch:
        events = await orch.stream(generation_body(output={"great": {}}), headers=sent)
    assert terminal(events).name == "completed"
    downstream = [CIMultiDict(engine.requests[0].headers), *dets.headers]
    assert len(downstream) >= 2
    for headers in downstream:
        assert headers["x-tenant"] == "tenant-7"
        assert headers["traceparent"] == sent["traceparent"]
        for name in ("x-secret", "cookie", "authorization"):
            assert name not in headers
        assert headers.getall("x-request-id") == [headers["x-request-id"]]
    for headers in dets.headers:
        assert headers.getall("detector-id") == ["great"]


def test_forward_allowlist_drops_hop_by_hop_headers() -> None:
    assert forwardable(["X-Tenant", " traceparent ", "Host", "content-length", "Connection"]) == {
        "x-tenant",
        "traceparent",
    }
    assert forwardable([]) == frozenset()


def test_a_busy_port_fails_before_any_engine_starts(tmp_path: Path) -> None:
    """The port is bound before start-up: a second server on a taken port used to fail only after
    loading its managed engines (~10 s)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = {
            "models": {"m": {"backends": [{"type": "managed", "model": "tiny-random"}]}},
        }
        path = tmp_path / "config.yaml"
        path.write_text(json.dumps(config))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "orchestrator",
                "serve",
                "--config",
                str(path),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--log-format",
                "text",
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 1, proc.stderr
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in proc.stderr
    assert "engine managed-0 started" not in proc.stderr
    assert "Traceback" not in proc.stderr
