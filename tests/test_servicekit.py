"""servicekit.auth: the one Bearer-key check and the one key loader of the orchestrator, the
engine and the detector service (each renders the 401 and the start-up error in its own shape;
their tests pin those: test_orchestrator_security, test_engine_chat_limits_auth,
test_detectors_hardening)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from servicekit.auth import (
    CHALLENGE,
    UNAUTHORIZED_MESSAGE,
    ApiKeysError,
    BearerKeys,
    api_keys_from_env,
)

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
