"""servicekit: the one Bearer-key check and the one key loader of the orchestrator, the engine
and the detector service (each renders the 401 and the start-up error in its own shape; their
tests pin those: test_orchestrator_security, test_engine_chat_limits_auth,
test_detectors_hardening); the engine's and the detector service's shared flags; spans."""

from __future__ import annotations

import argparse
import hmac
import json
import re
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from servicekit.auth import (
    CHALLENGE,
    UNAUTHORIZED_MESSAGE,
    ApiKeysError,
    BearerKeys,
    KeyRing,
    api_keys_from_env,
)
from servicekit.cli import add_service_flags, service_flags
from servicekit.tracing import ServiceTracing
from tests.engine_processes import child_environment

KEYS = BearerKeys(["alpha-key", "beta-key"])
# what a key can be: printable text without the whitespace the header parsing strips
key_text = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=40)


@pytest.mark.parametrize(
    ("header", "accepted"),
    [
        ("Bearer alpha-key", True),
        ("Bearer beta-key", True),
        ("bearer alpha-key", True),  # the scheme is case-insensitive (RFC 7235)
        ("BEARER  alpha-key ", True),  # surrounding blanks of the token do not count
        ("Bearer alpha-ke", False),
        ("Bearer alpha-keyy", False),
        ("Basic alpha-key", False),
        ("alpha-key", False),
        ("Bearer", False),
        ("", False),
        ("Bearer \udcff", False),  # undecodable bytes as aiohttp hands them over
    ],
)
def test_only_a_bearer_header_with_a_known_key_is_accepted(header: str, accepted: bool) -> None:
    assert KEYS.accepts({"Authorization": header}) is accepted


def test_no_header_and_no_keys_accept_nothing() -> None:
    assert KEYS.accepts({}) is False
    assert BearerKeys([]).accepts({"Authorization": "Bearer "}) is False


@given(keys=st.lists(key_text, min_size=1, max_size=4), given_key=key_text)
def test_a_token_is_accepted_exactly_when_it_is_one_of_the_keys(
    keys: list[str], given_key: str
) -> None:
    accepted = BearerKeys(keys).accepts({"Authorization": f"Bearer {given_key}"})
    assert accepted is (given_key in keys)


def test_the_services_share_one_message_and_challenge() -> None:
    assert UNAUTHORIZED_MESSAGE == "missing or invalid API key"
    assert CHALLENGE == {"WWW-Authenticate": "Bearer"}


def test_api_keys_come_comma_separated_from_the_named_variable() -> None:
    assert api_keys_from_env(None, "--api-keys-env", {"K": "a"}) is None  # auth off
    assert api_keys_from_env("K", "--api-keys-env", {"K": " key-one , ,second "}) == [
        "key-one",
        "second",
    ]


@pytest.mark.parametrize(
    ("environ", "state"),
    [({}, "is not set"), ({"K": " , "}, "holds no key"), ({"K": ""}, "holds no key")],
)
def test_a_named_variable_without_keys_is_an_error_that_names_the_setting(
    environ: dict[str, str], state: str
) -> None:
    """Never open by accident; the message starts with what named the variable."""
    with pytest.raises(ApiKeysError) as info:
        api_keys_from_env("K", "server.api_keys_env", environ)
    assert str(info.value) == f"server.api_keys_env: environment variable K {state}"


def test_console_spans_are_one_json_object_per_line(capsys: pytest.CaptureFixture[str]) -> None:
    """An engine's console spans reach the orchestrator's JSON log line by line (its stdout is
    relayed that way): the console exporter writes each span as one line (issue 41; the
    default indented JSON made a dozen records of one span)."""
    import json

    from servicekit.tracing import build_provider

    provider = build_provider(service_name="t", environ={"OTEL_TRACES_EXPORTER": "console"})
    with provider.get_tracer("t").start_as_current_span("one"):
        pass
    with provider.get_tracer("t").start_as_current_span("two"):
        pass
    provider.shutdown()  # flushes the batch processor
    lines = [line for line in capsys.readouterr().out.splitlines() if line]
    assert [json.loads(line)["name"] for line in lines] == ["one", "two"]


def flags(argv: list[str], *, tracing: bool = True) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_service_flags(parser, tracing=tracing)
    return parser.parse_args(argv)


def test_the_shared_flags_and_their_defaults() -> None:
    assert vars(flags([])) == {"otlp_endpoint": None, "log_level": "info"}
    given = flags(["--otlp-endpoint", "http://c:4318", "--log-level", "warning"])
    assert vars(given) == {"otlp_endpoint": "http://c:4318", "log_level": "warning"}
    assert vars(flags([], tracing=False)) == {"log_level": "info"}  # the engine's `prepare`
    with pytest.raises(SystemExit):
        flags(["--otlp-endpoint", "http://c:4318"], tracing=False)


def test_tracing_is_on_for_the_block_and_its_spans_leave_however_the_block_is_left(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")  # the environment turns it on
    tracing = ServiceTracing(default_service_name="svc", tracer_name="t", untraced=frozenset())
    with pytest.raises(RuntimeError), service_flags(flags([]), tracing):
        assert tracing.tracer is not None
        with tracing.tracer.start_as_current_span("inside"):
            pass
        raise RuntimeError("the command failed")
    assert tracing.tracer is None  # shut down: exported, then off
    lines = [line for line in capsys.readouterr().out.splitlines() if line]
    assert [json.loads(line)["name"] for line in lines] == ["inside"]


def test_tracing_stays_off_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "OTEL_TRACES_EXPORTER",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    ):
        monkeypatch.delenv(name, raising=False)
    tracing = ServiceTracing(default_service_name="svc", tracer_name="t", untraced=frozenset())
    with service_flags(flags([]), tracing):
        assert tracing.tracer is None


# A fresh interpreter: in this one pytest's handlers already sit on the root logger, where
# `logging.basicConfig` (what the flag sets, as a service's first logging call) does nothing.
LOG_PROBE = """
import argparse, logging
from servicekit.cli import add_service_flags, service_flags
parser = argparse.ArgumentParser()
add_service_flags(parser, tracing=False)
with service_flags(parser.parse_args(["--log-level", "warning"]), None):
    logging.getLogger("svc").info("hidden")
    logging.getLogger("svc").warning("shown")
"""


def test_the_log_level_flag_sets_the_level_and_the_one_line_format() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", LOG_PROBE],
        env=child_environment(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} WARNING svc: shown", line), line


@given(
    keys=st.lists(key_text, min_size=1, max_size=8, unique=True),
    pick=st.integers(min_value=0, max_value=7),
    known=st.booleans(),
)
def test_a_key_ring_names_the_owner_and_compares_every_key(
    keys: list[str], pick: int, known: bool
) -> None:
    """Whose key it is, with every key compared whichever matched (or came close): the time a
    check takes says nothing about which key, or whose, the token nearly was."""
    calls: list[tuple[bytes, bytes]] = []

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return hmac.compare_digest(a, b)

    ring = KeyRing([(k, f"owner-{i}") for i, k in enumerate(keys)], counting)
    token = keys[pick % len(keys)] if known else keys[pick % len(keys)] + "x"
    owner = ring.owner({"Authorization": f"Bearer {token}"})
    assert owner == (f"owner-{keys.index(token)}" if token in keys else None)
    assert len(calls) == len(keys)
    assert len({b for _, b in calls}) == len(keys)  # each key once
    assert ring.owner({"Authorization": f"Basic {keys[0]}"}) is None  # the scheme counts
