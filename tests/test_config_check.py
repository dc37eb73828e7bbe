"""check-config in one pass (issue 41 item 2): N independent mistakes in a valid file give N
errors, each with its YAML path, and a typo names the closest valid choice. On de9ac67 the
six-mistake file below gave five errors (never `profanty`: the entry's other error hid it) and
no "did you mean"; the detector service's own file failed for want of models."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.__main__ import main
from orchestrator.config import ConfigError, parse_config

ROOT = Path(__file__).resolve().parents[1]
SHIPPED: dict[str, Any] = yaml.safe_load((ROOT / "config.yaml").read_text())
MODEL = next(iter(SHIPPED["models"]))

SIX = """\
server:
  hots: 127.0.0.1
models:
  m:
    backends: [{type: native, url: "http://127.0.0.1:9"}]
    guardrails: {input: {injection: {}}, output: {pii: {}, hap: {}}}
chunkers:
  sentence: {type: sentense}
detectors:
  hap: {builtin: profanty, chunker_id: sentence, on_detection: blok}
  pii: {builtin: regex, chunker_id: sentense}
  injection: {builtin: prompt_injection, chunker_id: whole_doc_chunker, default_threshold: 5}
"""


def test_six_mistakes_give_six_errors_with_did_you_mean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(SIX)
    assert main(["check-config", str(path)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert sorted(err[:-1]) == sorted(
        [
            "server.hots: unknown key (did you mean 'host'?)",
            "chunkers.sentence.type: unknown chunker type 'sentense' (did you mean 'sentence'?)",
            "detectors.hap.builtin: unknown built-in detector 'profanty' "
            "(did you mean 'profanity'?)",
            "detectors.hap.on_detection: Input should be 'annotate', 'block' or 'redact' "
            "(did you mean 'block'?)",
            "detectors.pii.chunker_id: unknown chunker 'sentense' (did you mean 'sentence'?)",
            "detectors.injection.default_threshold: Input should be less than or equal to 1",
        ]
    )
    assert err[-1] == f"{path}: 6 error(s)"


def test_an_unknown_key_without_a_close_match_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"server": {"zzzz": 1}})
    [line] = caught.value.errors
    assert line.startswith(
        "server.zzzz: unknown key (expected one of: admin_keys_env, api_keys_env, body_idle"
    )


def test_the_detector_service_file_is_checked_without_models(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["check-config", str(ROOT / "deploy" / "detectors.yaml")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{ROOT / 'deploy' / 'detectors.yaml'}: OK (detector service config: ")


def test_a_detector_service_file_with_a_typo_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "detectors.yaml"
    path.write_text("detectors:\n  pii: {builtin: regx}\n")
    assert main(["check-config", "--detectors", str(path)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "detectors.pii.builtin: unknown built-in detector 'regx' (did you mean 'regex'?)",
        f"{path}: 1 error(s)",
    ]


# -- the property: independent mistakes, each reported once -------------------------------------

Mistake = Callable[[dict[str, Any]], None]


def _set(path: str, value: Any) -> Mistake:
    def apply(config: dict[str, Any]) -> None:
        *parents, key = path.split("/")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        node[key] = value

    return apply


# (what to break, the YAML path its error must name); each is independent of the others
MISTAKES: list[tuple[Mistake, str]] = [
    (_set("server/hots", "x"), "server.hots: unknown key (did you mean 'host'?)"),
    (_set("server/port", "eighty"), "server.port: "),
    (_set("chunkers/sentence/type", "sentense"), "chunkers.sentence.type: "),
    (_set("chunkers/paragraph/max_chars", 0), "chunkers.paragraph.max_chars: must be >= 1"),
    (_set("detectors/hap/builtin", "profanty"), "detectors.hap.builtin: "),
    (_set("detectors/hap/on_detection", "blok"), "detectors.hap.on_detection: "),
    (_set("detectors/pii/chunker_id", "sentense"), "detectors.pii.chunker_id: "),
    (_set("detectors/injection/default_threshold", 5), "detectors.injection.default_threshold"),
    (_set("detectors/injection/timeout_s", -1), "detectors.injection.timeout_s: "),
    (_set(f"models/{MODEL}/migration/limt", 3), f"models.{MODEL}.migration.limt: unknown key"),
    (_set(f"models/{MODEL}/limits/max_new_tokens", 0), f"models.{MODEL}.limits.max_new_tokens"),
    (
        _set(f"models/{MODEL}/guardrails/output/pii/on_detection", "redakt"),
        f"models.{MODEL}.guardrails.output.pii.on_detection: must be annotate, block or redact "
        "(did you mean 'redact'?)",
    ),
    (
        _set(f"models/{MODEL}/guardrails/input/pi", {}),
        f"models.{MODEL}.guardrails.input.pi: unknown detector 'pi' (did you mean 'pii'?)",
    ),
]


def test_the_shipped_config_is_valid() -> None:
    parse_config(copy.deepcopy(SHIPPED), require_models=True)


@settings(max_examples=40, deadline=None, database=None)
@given(chosen=st.sets(st.integers(0, len(MISTAKES) - 1), min_size=1))
def test_n_independent_mistakes_give_n_errors(chosen: set[int]) -> None:
    config = copy.deepcopy(SHIPPED)
    for i in chosen:
        MISTAKES[i][0](config)
    with pytest.raises(ConfigError) as caught:
        parse_config(config, require_models=True)
    errors = caught.value.errors
    assert len(errors) == len(chosen), errors
    for i in chosen:
        expected = MISTAKES[i][1]
        assert [e for e in errors if e.startswith(expected)], (expected, errors)


def test_a_builtin_speaks_text_contents_only() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"detectors": {"pii": {"builtin": "regex", "type": "text_chat"}}})
    [line] = caught.value.errors
    assert line.startswith("detectors.pii.type: a built-in detector speaks text_contents")


JUDGED = """\
server: {max_concurrent_streams: %d}
models:
  m:
    backends: [{type: native, url: "http://127.0.0.1:9"}]
    guardrails: {output: {judge: {}}}
chunkers:
  sentence: {type: sentence}
detectors:
  judge:
    type: engine_judge
    urls: ["http://127.0.0.1:9", "http://127.0.0.1:10"]
    template: zero_shot
    chunker_id: sentence
"""


@pytest.mark.parametrize("streams", [1024, 512])
def test_streams_past_an_engine_judges_sessions_are_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], streams: int
) -> None:
    """An engine judge holds one session per stream it judges, and an engine at most 256
    (`--max-judge-sessions`), 429 beyond: the default max_concurrent_streams (1024) admits
    streams whose judge then ends them `overloaded`. The config is valid (a judge may judge
    only some streams), so check-config says so as a warning, and so does serve's log."""
    path = tmp_path / "config.yaml"
    path.write_text(JUDGED % streams)
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr()
    warnings = [line for line in out.err.splitlines() if line.startswith("warning: ")]
    if streams == 512:  # two engines of 256: every stream can hold a session
        assert warnings == []
        return
    assert warnings == [
        "warning: server.max_concurrent_streams: 1024 streams, but detector `judge` holds at "
        "most 512 judge sessions (2 engine(s), 256 each): a stream it judges past them ends "
        "`overloaded` (429); start more of its engines or lower max_concurrent_streams"
    ]
