"""A newcomer's first commands: `serve --hint` (what `make run` starts) prints its examples only
once the service is ready, and the printed request works as printed."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
from pathlib import Path

import aiohttp
import pytest

from orchestrator.app import STREAMING_PATH
from tests.fakes.engine import FakeEngine
from tests.orchestrator_support import MODEL, native_config, serve
from tests.wait_support import finished

ROOT = Path(__file__).resolve().parents[1]


async def test_serve_hint_prints_working_commands_once_ready(tmp_path: Path) -> None:
    engine = FakeEngine(script=["Cats", " purr", "."])
    await engine.start()
    config = native_config(
        engine.url,
        detectors={
            "pii": {"builtin": "regex", "chunker_id": "sentence"},
            "hap": {"builtin": "profanity", "chunker_id": "sentence"},
        },
    )
    try:
        async with serve(tmp_path, config, "--hint") as served:
            assert served.proc.stdout is not None
            lines: list[str] = []
            while not lines or lines[-1] != "guardstream is ready. In another terminal, try:":
                raw = await finished(
                    served.proc.stdout.readline(), 60, "served.proc.stdout.readline()"
                )
                assert raw, served.stderr.read_text()
                lines.append(raw.decode().rstrip("\n"))
            hint = [
                (await finished(served.proc.stdout.readline(), 10, "served.proc.stdout.readline()"))
                .decode()
                .rstrip("\n")
                for _ in range(7)
            ]
            # the hint came after the in-process detectors warmed up: /info is ready now
            async with aiohttp.ClientSession() as session:
                async with session.get(served.url + "/info") as r:
                    assert r.status == 200
                curl = shlex.split(" ".join(line.rstrip("\\") for line in hint[1:4]))
                assert curl[:3] == ["curl", "-N", served.url + STREAMING_PATH]
                body = json.loads(curl[curl.index("-d") + 1])
                async with session.post(curl[2], json=body) as r:
                    assert r.status == 200
                    stream = await r.text()
    finally:
        await engine.close()
    assert body["model_id"] == MODEL
    assert body["text_gen_parameters"] == {"max_new_tokens": 60}
    assert re.search(r"event: completed\ndata: \{.*\"finish_reason\":\"EOS_TOKEN\"", stream)
    assert hint[5].endswith(
        f"-m orchestrator stream --url {served.url} --max-new-tokens 60 "
        "--output-detector pii --output-detector hap 'Tell me about cats in one sentence.'"
    )


async def test_the_hint_follows_the_config_and_sends_the_key_without_printing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 41 item 3: with other detectors and API keys on, the printed commands name a
    detector that exists and send a key read from the shell (on de9ac67: `hap`, a 404, and no
    Authorization header, a 401)."""
    secret = "k-" + "s3cret" * 4
    monkeypatch.setenv("QUICKSTART_KEYS", f"{secret},other-key")
    engine = FakeEngine(script=["Cats", " purr", "."])
    await engine.start()
    config = native_config(
        engine.url,
        detectors={"mail": {"builtin": "regex", "chunker_id": "sentence"}},
        server={"api_keys_env": "QUICKSTART_KEYS"},
    )
    try:
        async with serve(tmp_path, config, "--hint") as served:
            assert served.proc.stdout is not None
            printed: list[str] = []
            while not printed or not printed[-1].lstrip().startswith("or: "):
                raw = await finished(
                    served.proc.stdout.readline(), 60, "served.proc.stdout.readline()"
                )
                assert raw, served.stderr.read_text()
                printed.append(raw.decode().rstrip("\n"))
            start = next(i for i, line in enumerate(printed) if line.lstrip().startswith("curl "))
            curl = "\n".join(printed[start : start + 4])
            assert printed[-1].lstrip().startswith("or: GUARDSTREAM_API_KEY=${QUICKSTART_KEYS%%,*}")
            assert "--output-detector mail 'Tell me" in printed[-1]
            done = await asyncio.create_subprocess_exec(
                "bash", "-c", curl, stdout=asyncio.subprocess.PIPE, env=dict(os.environ)
            )
            stream = (await finished(done.communicate(), 30, "curl"))[0].decode()
    finally:
        await engine.close()
    assert secret not in "\n".join(printed)
    assert '"models": {"mail": {}}' in curl
    assert re.search(r"event: completed\ndata: \{.*\"finish_reason\":\"EOS_TOKEN\"", stream), stream
