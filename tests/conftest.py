"""Shared fixtures. Engine: models loaded once per session, and one real tiny-random server."""

from __future__ import annotations

import os

# On a CPU the Triton kernels of `--batch-invariant` (generation/invariant_kernels.py) run in
# triton's interpreter, which triton reads when it is imported, and `import torch` imports triton
# where it is installed: so the switch comes before every other import (subprocesses inherit it).
if os.environ.get("GUARDSTREAM_TEST_DEVICE", "cpu").strip() in ("", "cpu"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest
import pytest_asyncio
import requests
from hypothesis import HealthCheck, settings

from generation import models
from generation.server import create_app
from tests.e2e_support import e2e_config
from tests.engine_processes import ThreadedServer
from tests.engine_support import SMOLLM2_DTYPE, load_test_model
from tests.fakes.clock import manual_detector_clock
from tests.fakes.engine import FakeEngine
from tests.fakes.openai_server import FakeOpenAI
from tests.fakes.upstream import FakeUpstream
from tests.orchestrator_support import SCRIPT, Orchestrator
from tests.tool_model_support import tool_model_folder

# No property test may fail because a machine is slow: hypothesis' default 200 ms deadline per
# example turns a loaded CI core into a flaky failure. Tests that set their own settings still
# may; the profile covers the rest. (`make test-stress` runs the suite beside a CPU hog.)
settings.register_profile(
    "guardstream", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("guardstream")


@pytest.fixture(scope="session")
def tiny_model() -> models.LoadedModel:
    """The tiny random GPT-2 (float64, on the test device: exact across batching and resume)."""
    return load_test_model("tiny-random")


@pytest.fixture(scope="session")
def smollm2_model() -> models.LoadedModel:
    """SmolLM2-135M-Instruct on the test device; the first run converts the GGUF into the cache
    (~20-45 s). Tests that use it skip, saying why, where the model cannot be had."""
    return load_test_model("smollm2-135m", dtype=SMOLLM2_DTYPE)


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> models.LoadedModel:
    """tiny-random with a chat template that takes tools (tests/tool_model_support.py)."""
    return load_test_model(str(tool_model_folder(tmp_path_factory.mktemp("tool-model"))))


@pytest.fixture(scope="session")
def tiny_server(tiny_model: models.LoadedModel) -> Iterator[ThreadedServer]:
    """A real engine server on 127.0.0.1 for synchronous (hypothesis) tests."""
    with ThreadedServer(lambda: create_app(tiny_model)) as server:
        yield server


@pytest_asyncio.fixture(loop_scope="session", scope="session")
async def e2e_orch() -> AsyncIterator[Orchestrator]:
    """The end-to-end deployment (tests/e2e_support.py), one engine pair for every file that
    uses it: each start of two engine processes loads torch twice. Its tests run on the session
    loop (`pytest.mark.asyncio(loop_scope="session")`)."""
    async with Orchestrator(e2e_config()) as orch:
        yield orch


@pytest.fixture(scope="module")
def http() -> Iterator[requests.Session]:
    """A synchronous HTTP client for the tests that run a served stack in a thread (fuzz)."""
    with requests.Session() as session:
        yield session


@pytest.fixture(autouse=True)
def detector_calls_time_out_only_when_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """No detector or judge call in this process times out on the clock: its `timeout_s` runs
    on a manual clock (tests/fakes/clock.py) that only a test moves. Seen: the shipped
    profanity model's first call past its 10 s on 2 loaded cores, a `detector_error` in a test
    of redaction (test_pipeline_disguised_text). A test of the timeout itself takes the clock
    with `manual_detector_clock` and runs it out when the call is under way."""
    manual_detector_clock(monkeypatch)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    """A client session for tests that call servers directly."""
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    """A fake native engine on a free port, answering every prompt with SCRIPT."""
    fake = FakeEngine(script=list(SCRIPT))
    await fake.start()
    yield fake
    await fake.close()


@pytest.fixture
async def servers() -> AsyncIterator[list[FakeUpstream]]:
    """Fake upstream servers a test started (appended here); closed at its end."""
    made: list[FakeUpstream] = []
    yield made
    for s in made:
        await s.close()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def openai_upstream() -> AsyncIterator[FakeOpenAI]:
    """One fake OpenAI-compatible server (tests/fakes/openai_server.py, default script) for a
    whole module, on the module's loop: for modules whose tests run on `loop_scope="module"` and
    share an orchestrator in front of it."""
    server = FakeOpenAI()
    await server.start()
    yield server
    await server.close()
