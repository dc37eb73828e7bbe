"""`server.workers`: `python -m orchestrator serve` as a supervisor of N worker processes on one
port (SO_REUSEPORT). Requests are served by every worker, any worker's `/metrics` is the sum over
all of them, managed engines are started once (by the supervisor) for all workers, and SIGTERM
drains every worker: a running stream completes, then everything exits 0."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.app import STREAMING_PATH
from tests.e2e_support import managed_model
from tests.fakes.engine import FakeEngine
from tests.orchestrator_support import (
    MODEL,
    SCRIPT,
    SseEvent,
    assert_contiguous,
    frames,
    generation_body,
    native_config,
    read_sse,
    serve,
    sse_events,
    terminal,
)
from tests.wait_support import finished, until, within

START_S = 120  # generous: two workers import the service at once on a busy machine
TEXT = "".join(SCRIPT)
PII = {"pii": {"builtin": "regex", "chunker_id": "sentence"}}


async def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """`/metrics` as {(sample name, sorted labels): value}."""
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def by_pid(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[int, float]:
    """`guardstream_worker_requests` of each live worker."""
    return {
        int(dict(labels)["pid"]): value
        for (name, labels), value in metrics.items()
        if name == "guardstream_worker_requests"
    }


async def one_stream(url: str, body: dict[str, Any]) -> list[SseEvent]:
    """A streaming request on a connection of its own: each is a new pick of a worker."""
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as s:
        async with s.post(url + STREAMING_PATH, json=body) as r:
            assert r.status == 200, await r.text()
            return sse_events(await r.text())


async def held_stream(url: str, seen: list[SseEvent]) -> list[SseEvent]:
    """A stream with the pii detector; `seen` holds its events so far while it runs."""
    async with aiohttp.ClientSession() as s:
        body = generation_body(output={"pii": {}})
        async with s.post(url + STREAMING_PATH, json=body) as r:
            assert r.status == 200
            return await read_sse(r, lambda events: seen.__setitem__(slice(None), events))


def exists(path: str) -> bool:
    return os.path.exists(path)


def check_completed(events: list[SseEvent]) -> None:
    assert terminal(events).name == "completed"
    assert assert_contiguous(frames(events)) == TEXT


async def test_workers_share_the_port_aggregate_metrics_and_drain_on_sigterm(
    tmp_path: Path,
) -> None:
    engine = FakeEngine(script=list(SCRIPT))
    await engine.start()
    config = native_config(engine.url, detectors=PII, server={"workers": 2})
    try:
        async with serve(tmp_path, config, start_s=START_S) as served:
            workers = {w.pid for w in served.workers()}
            assert len(workers) == 2 and served.engines() == []
            metrics_dir = psutil.Process(min(workers)).environ()["PROMETHEUS_MULTIPROC_DIR"]
            assert exists(metrics_dir)

            # rounds of requests on fresh connections until both workers have served some (the
            # kernel picks a worker per connection: 20 in a row to one of two is 1 in 500,000)
            streams = scrapes = 0
            served_by: dict[int, float] = {}
            for _ in range(10):
                body = generation_body(output={"pii": {}})
                results = await asyncio.gather(*(one_stream(served.url, body) for _ in range(20)))
                for events in results:
                    check_completed(events)
                streams += len(results)
                metrics = await scrape(served.url)
                scrapes += 1
                served_by = by_pid(metrics)
                if len([v for v in served_by.values() if v > 0]) == 2:
                    break
            assert set(served_by) == workers
            assert all(v > 0 for v in served_by.values())
            # one page for all workers: every request of both is counted on it (a scrape
            # counts itself once its page is written, so the earlier scrapes are on it). A
            # stream is counted when its handler returns, just after the client read its last
            # byte, so a scrape may come first: scrape again until all are there (a deadline)
            async with within(30):
                while sum(served_by.values()) < streams + scrapes - 1:
                    metrics = await scrape(served.url)
                    scrapes += 1
                    served_by = by_pid(metrics)
            assert sum(served_by.values()) == streams + scrapes - 1
            stream_key = ("endpoint", STREAMING_PATH), ("status", "200")
            assert metrics[("guardstream_requests_total", stream_key)] == streams
            assert metrics[("guardstream_terminal_events_total", (("event", "completed"),))] == (
                streams
            )
            calls = (
                "guardstream_detector_calls_total",
                (("detector_id", "pii"), ("outcome", "ok")),
            )
            assert metrics[calls] >= streams  # each stream judged both sentences
            assert metrics[("guardstream_active_streams", ())] == 0

            # SIGTERM while a stream waits at the engine: every worker drains, the stream
            # completes once the engine goes on, then the supervisor and its workers exit 0
            engine.hold_after = 6  # " What about" completes the first sentence; the rest waits
            seen: list[SseEvent] = []
            client = asyncio.create_task(held_stream(served.url, seen))
            await until(lambda: engine.holding == 1 and len(seen) == 1, 30)
            served.proc.send_signal(signal.SIGTERM)
            # the worker with the stream stays up, draining: a new stream gets 503 there (the
            # idle worker exits; a connection it was about to take may be refused meanwhile)
            refused = await until_draining(served.url)
            assert refused == {
                "code": 503,
                "details": "the server is shutting down",
                "type": "server_shutdown",
            }
            assert engine.holding == 1 and not client.done()
            engine.release.set()
            events = await finished(client, 30, "client")
            check_completed(events)
            assert await finished(served.proc.wait(), 60, "served.proc.wait()") == 0
            assert not any(psutil.pid_exists(pid) for pid in workers)
            assert not exists(metrics_dir)  # the supervisor removed it
    finally:
        await engine.close()


async def until_draining(url: str) -> Any:
    """Fresh requests until one is refused with 503; its body."""
    body = generation_body()

    async def refused() -> Any:
        try:
            connector = aiohttp.TCPConnector(force_close=True)
            async with (
                aiohttp.ClientSession(connector=connector) as s,
                s.post(url + STREAMING_PATH, json=body) as r,
            ):
                if r.status == 503:
                    return await r.json()
                r.close()  # a worker that had not begun to drain: the stream is dropped
        except aiohttp.ClientConnectionError:
            pass
        return None

    return await until(refused, what="a request refused with 503", poll_s=0.05)


async def _at_least(url: str, key: Any, n: int) -> Any:
    metrics = await scrape(url)
    return metrics if metrics.get(("guardstream_requests_total", key), 0) >= n else None


@pytest.mark.timeout(600)
async def test_managed_engines_are_started_once_for_all_workers(tmp_path: Path) -> None:
    config = {
        "server": {"host": "127.0.0.1", "port": 0, "workers": 2},
        "models": {
            MODEL: managed_model(
                1, fault_injection=False, start_timeout_s=300, migration={"limit": 0}
            )
        },
        "chunkers": {"sentence": {"type": "sentence"}},
        "detectors": PII,
    }
    async with serve(tmp_path, config, start_s=START_S) as served:
        workers = {w.pid for w in served.workers()}
        (engine,) = served.engines()  # one engine process, not one per worker
        assert len(workers) == 2
        body = generation_body(output={"pii": {}}, params={"max_new_tokens": 8})
        for events in await asyncio.gather(*(one_stream(served.url, body) for _ in range(6))):
            end = terminal(events)
            assert end.name in ("completed", "incomplete"), end
            assert end.data["generated_token_count"] > 0
            assert end.data["processed_index"] == len(assert_contiguous(frames(events)))
        stream_key = ("endpoint", STREAMING_PATH), ("status", "200")

        # a stream is counted once its handler returns, just after its last byte went out: a
        # client can scrape first (seen at load 8: 5 of 6)
        metrics = await until(
            lambda: _at_least(served.url, stream_key, 6), what="all six streams counted"
        )
        assert set(by_pid(metrics)) == workers
        assert metrics[("guardstream_requests_total", stream_key)] == 6
        served.proc.send_signal(signal.SIGTERM)
        assert await finished(served.proc.wait(), 120, "served.proc.wait()") == 0
        assert not any(psutil.pid_exists(pid) for pid in {*workers, engine.pid})


def gone(pid: int) -> bool:
    """Exited (a zombie that its new parent has not reaped yet counts as gone)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def test_workers_drain_and_exit_when_the_supervisor_is_killed(tmp_path: Path) -> None:
    """SIGKILL gives the supervisor no chance to stop its workers: each gets SIGTERM from the
    kernel (PR_SET_PDEATHSIG) and drains as on a SIGTERM of its own. A stream held at the engine
    ends with a `server_shutdown` terminal event once the drain's deadline passed, and no worker
    is left behind holding the port."""
    engine = FakeEngine(script=list(SCRIPT))
    engine.hold_after = 6
    await engine.start()
    config = native_config(engine.url, detectors=PII, server={"workers": 2, "drain_timeout_s": 1})
    try:
        async with serve(tmp_path, config, start_s=START_S) as served:
            workers = [w.pid for w in served.workers()]
            assert len(workers) == 2
            seen: list[SseEvent] = []
            client = asyncio.create_task(held_stream(served.url, seen))
            await until(lambda: engine.holding == 1 and len(seen) == 1, 30)
            served.proc.kill()
            await served.proc.wait()
            events = await finished(client, 30, "client")  # a guard, not a window
            end = terminal(events)  # a frame had been sent: `failed`, with the frames' end
            assert end.name == "failed"
            assert end.data["error"] == {
                "code": 503,
                "type": "server_shutdown",
                "message": "the server is shutting down",
            }
            released = frames(events)
            assert released and end.data["processed_index"] == released[-1]["processed_index"]
            await until(lambda: all(gone(pid) for pid in workers), 30)
    finally:
        engine.release.set()
        await engine.close()


MAIL_SCRIPT = ["Mail", " ann@example.org", " now", "."]
ADMIN = {"Authorization": "Bearer the-admin-key"}


@pytest.mark.timeout(600)  # two worker starts and a restart, on a busy machine
async def test_a_reload_by_post_reaches_every_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """POST /admin/reload reaches the worker the kernel picked, and answers once every worker
    applied the new file (on 9a3c3dc the answer came once its own worker had, the others
    reloading on SIGHUP after it, and a failure there was a log line only): right after the
    answer both workers serve it (a guardrail added to the model redacts the answers of both),
    and a worker restarted later applies it too; so does every worker on the supervisor's
    SIGHUP, each one's result logged."""
    monkeypatch.setenv("ADMIN_KEYS", "the-admin-key")
    engine = FakeEngine(script=MAIL_SCRIPT)
    await engine.start()
    config = native_config(
        engine.url, detectors=PII, server={"workers": 2, "admin_keys_env": "ADMIN_KEYS"}
    )

    async def both_serve_the_new_file(workers: set[int]) -> None:
        """Streams on fresh connections until both workers served some (scrapes count
        themselves once written: a worker's count grew by more than the scrapes it may have
        answered), every one of them redacted."""
        base = by_pid(await finished(scrape(served.url), 60, "a scrape"))
        scrapes = 1
        for _ in range(10):
            body = generation_body()
            streams = asyncio.gather(*(one_stream(served.url, body) for _ in range(10)))
            for events in await finished(streams, 60, "a round of 10 streams"):
                assert terminal(events).name == "completed"
                assert assert_contiguous(frames(events)) == "Mail [email] now."
            now = by_pid(await finished(scrape(served.url), 60, "a scrape"))
            if set(now) == workers and all(now[p] - base[p] > scrapes for p in workers):
                return
            scrapes += 1
        pytest.fail(f"one worker served none of 100 streams: {base} -> {now}")

    try:
        async with serve(tmp_path, config, start_s=START_S) as served:
            workers = {w.pid for w in served.workers()}
            assert len(workers) == 2
            config["models"][MODEL]["guardrails"] = {"output": {"pii": {"on_detection": "redact"}}}
            (tmp_path / "config.yaml").write_text(json.dumps(config))
            async with within(60, "POST /admin/reload"), aiohttp.ClientSession() as s:
                async with s.post(served.url + "/admin/reload", headers=ADMIN) as r:
                    assert (r.status, await r.json()) == (
                        200,
                        {"reloaded": True, "tenants": ["default"]},
                    )

            def reloaded() -> int:
                return sum(m.startswith("config reloaded from") for m in served.messages())

            # both applied it before the answer (each logs it before it says so)
            assert reloaded() == 2
            await both_serve_the_new_file(workers)
            # a worker that dies is restarted from the config read at start-up: it reloads too
            killed = min(workers)
            os.kill(killed, signal.SIGKILL)
            await until(lambda: reloaded() == 3, START_S, "the restarted worker reloaded")
            workers = {w.pid for w in served.workers()}
            assert len(workers) == 2 and killed not in workers
            await both_serve_the_new_file(workers)
            assert reloaded() == 3
            # the supervisor's SIGHUP: an order to every worker, each one's result logged
            served.proc.send_signal(signal.SIGHUP)
            await until(lambda: reloaded() == 5, 60, "both workers reloaded on SIGHUP")
            logged = {f"worker {pid} reloaded the config" for pid in workers}
            await until(lambda: logged <= set(served.messages()), 30, "the supervisor's log")
    finally:
        await engine.close()
