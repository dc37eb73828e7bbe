"""The README's commands work as shown: every `curl` body it prints is accepted by the service
running the shipped config.yaml (its detectors, a fake engine in place of the managed smollm2),
and its terminal-client command runs with the flags it shows. (The outputs shown are real output
of `make run`; the model's words cannot be asserted here, the protocol can.)"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.fakes.engine import FakeEngine
from tests.orchestrator_support import Orchestrator
from tests.wait_support import within

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def shell_blocks() -> list[str]:
    return re.findall(r"```sh\n(.*?)```", README, flags=re.S)


def commands(program: str) -> list[list[str]]:
    """The README's shell blocks that run `program`, each split as a shell would (quotes may
    span lines)."""
    out = []
    for block in shell_blocks():
        argv = shlex.split(block.replace("\\\n", " "), comments=True)
        if argv and argv[0] == program:
            out.append(argv)
    return out


def shipped_config(engine_url: str) -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "config.yaml").read_text())
    data["server"].update(host="127.0.0.1", port=0)
    for model in data["models"].values():
        model["backends"] = [{"type": "native", "url": engine_url}]
    return data


def keyed(argv: list[str]) -> bool:
    """A command that sends an API key (the tenants section's)."""
    return any(a.lower().startswith("authorization:") for a in argv)


def tenants_section() -> str:
    return README.split("\n## Tenants\n", 1)[1].split("\n## ", 1)[0]


async def test_every_readme_curl_body_is_accepted_by_the_shipped_config() -> None:
    curls = [c for c in commands("curl") if not keyed(c)]
    urls = [next(a for a in c if a.startswith("http://127.0.0.1:8033")) for c in curls]
    assert {u.removeprefix("http://127.0.0.1:8033") for u in urls} == {
        "/api/v1/task/server-streaming-classification-with-text-generation",
        "/api/v2/text/detection/content",
        "/api/v2/text/detection/chat",
        "/api/v2/text/detection/generated",
        "/api/v2/text/generation-detection",
        "/api/v2/text/completions-detection",
    }
    engine = FakeEngine(script=["Cats", " purr", "."])
    await engine.start()
    try:
        async with Orchestrator(shipped_config(engine.url)) as orch:
            for command, url in zip(curls, urls, strict=True):
                body = json.loads(command[command.index("-d") + 1])
                status, reply = await orch.post(url.removeprefix("http://127.0.0.1:8033"), body)
                assert status == 200, (command, reply)
    finally:
        await engine.close()


async def test_the_readme_content_sample_is_the_bytes_the_service_sends() -> None:
    """The content endpoint's sample output, byte for byte (issue 41: the README showed spaced
    JSON, the service sends compact JSON)."""
    [(curl, shown)] = re.findall(
        r"```sh\n(curl -s http://127.0.0.1:8033/api/v2/text/detection/content.*?)```\n\n"
        r"```\n(.*?)\n```",
        README,
        flags=re.S,
    )
    argv = shlex.split(curl.replace("\\\n", " "))
    engine = FakeEngine(script=["Cats"])
    await engine.start()
    try:
        async with Orchestrator(shipped_config(engine.url)) as orch:
            assert orch.session is not None
            body = argv[argv.index("-d") + 1].encode()
            headers = {"content-type": "application/json"}
            url = orch.url + "/api/v2/text/detection/content"
            async with orch.session.post(url, data=body, headers=headers) as r:
                assert r.status == 200
                sent = await r.text()
    finally:
        await engine.close()
    assert sent == shown


async def test_the_readme_terminal_client_command_runs_as_shown() -> None:
    # the quickstart's (the migration demo's is a background job that needs a real model)
    argv = next(c for c in commands(".venv/bin/python") if c[2:4] == ["orchestrator", "stream"])
    assert argv[:3] == [".venv/bin/python", "-m", "orchestrator"]
    engine = FakeEngine(script=["Cats", " purr", "."])
    await engine.start()
    try:
        async with Orchestrator(shipped_config(engine.url)) as orch:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                *argv[1:],
                "--url",
                orch.url,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=ROOT,
            )
            async with within(60):
                out, err = await proc.communicate()
    finally:
        await engine.close()
    assert proc.returncode == 0, err.decode()
    lines = out.decode().splitlines()
    assert lines[0] == "Cats purr."
    assert lines[1].startswith('[completed] {"finish_reason": "EOS_TOKEN"')
    assert engine.requests[0].body["max_new_tokens"] == 60


async def test_the_readme_tenants_commands_answer_as_shown(monkeypatch) -> None:
    """The tenants section's config added to the shipped one, its keys set as it says: each
    curl is answered 200 with the headers and the body it shows."""
    section = tenants_section()
    [tenants_yaml] = re.findall(r"```yaml\n(.*?)```", section, flags=re.S)
    shown = re.findall(r"\n\n```\n(.*?)\n```", section, flags=re.S)
    for assignment in re.findall(r"(\w+_KEYS)=(\S+)", section):
        monkeypatch.setenv(*assignment)
    curls = [c for c in commands("curl") if keyed(c)]
    assert len(curls) == 2
    engine = FakeEngine(script=["Hello", "!"])
    await engine.start()
    try:
        config = shipped_config(engine.url) | yaml.safe_load(tenants_yaml)
        async with Orchestrator(config) as orch:
            assert orch.session is not None
            # ready as a load balancer sees it: the shipped `injection` (MiniLM since issue 34)
            # warmed up; on 2 busy cores its first load outlasted the detector's 10 s timeout
            await orch.info_until(lambda status, _: status == 200)
            replies = []
            for argv in curls:
                url = next(a for a in argv if a.startswith("http://127.0.0.1:8033"))
                headers = dict(
                    h.split(": ", 1) for h in (argv[i + 1] for i, a in enumerate(argv) if a == "-H")
                )
                data = argv[argv.index("-d") + 1] if "-d" in argv else None
                method = "POST" if data is not None else "GET"
                path = url.removeprefix("http://127.0.0.1:8033")
                async with orch.session.request(
                    method, orch.url + path, data=data, headers=headers
                ) as r:
                    assert r.status == 200, await r.text()
                    replies.append((r.headers, await r.text()))
    finally:
        await engine.close()
    (chat_headers, _), (_, usage) = replies
    status_line, *header_lines = shown[0].splitlines()
    assert status_line == "HTTP/1.1 200 OK"
    for line in header_lines:
        name, value = line.split(": ", 1)
        assert chat_headers[name] == value
    assert json.loads(usage) == json.loads(shown[-1])
