"""config.yaml schema: the shipped default is valid; every error names its YAML path; the CLI
prints them all and exits 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.config import ConfigError, load_config, parse_config

ROOT = Path(__file__).resolve().parents[1]


def minimal(**extra: object) -> dict:
    base: dict = {
        "models": {"m": {"backends": [{"type": "native", "url": "http://127.0.0.1:1"}]}},
        "chunkers": {"sentence": {"type": "sentence"}},
        "detectors": {"pii": {"builtin": "regex", "chunker_id": "sentence"}},
    }
    base.update(extra)
    return base


def errors_of(data: object) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return info.value.errors


def test_default_config_is_valid() -> None:
    config = load_config(ROOT / "config.yaml")
    assert config.server.port == 8033
    backend = config.models["smollm2-135m"].backends[0]
    assert backend.type == "managed" and backend.replicas == 2
    # PII beyond patterns by default (issue 34); the fast path under its own id
    assert config.detectors["pii"].builtin == "pii_ner"
    assert config.detectors["pii_regex"].builtin == "regex"


def test_defaults_fill_in() -> None:
    config = parse_config(minimal())
    assert config.models["m"].migration.limit == 3
    assert config.models["m"].migration.stall_timeout_s == 30
    assert config.detectors["pii"].default_threshold == 0.5
    assert config.detectors["pii"].on_detection == "annotate"
    assert config.server.max_request_bytes == 1048576


def test_unknown_chunker_names_its_path() -> None:
    data = minimal()
    data["detectors"]["hap"] = {"builtin": "profanity", "chunker_id": "sentense"}
    assert errors_of(data) == [
        "detectors.hap.chunker_id: unknown chunker 'sentense' (did you mean 'sentence'?)"
    ]


def test_unknown_keys_are_errors_with_their_path() -> None:
    data = minimal()
    data["server"] = {"prot": 8033}
    data["models"]["m"]["migration"] = {"limt": 3}
    errs = errors_of(data)
    assert "server.prot: unknown key (did you mean 'port'?)" in errs
    assert "models.m.migration.limt: unknown key (did you mean 'limit'?)" in errs


def test_every_error_is_reported_at_once() -> None:
    data = minimal()
    data["detectors"]["a"] = {"builtin": "regex", "url": "http://x", "chunker_id": "sentence"}
    data["detectors"]["b"] = {"chunker_id": "sentence"}
    data["detectors"]["c"] = {"builtin": "nope", "chunker_id": "sentence"}
    data["chunkers"]["w"] = {"type": "words", "max_words": 0}
    errs = errors_of(data)
    assert "detectors.a: exactly one of 'builtin' and 'url' is required" in errs
    assert "detectors.b: exactly one of 'builtin' and 'url' is required" in errs
    assert any(e.startswith("detectors.c.builtin: unknown built-in detector 'nope'") for e in errs)
    assert any(e.startswith("chunkers.w.max_words") for e in errs), errs


def test_backend_type_and_fields_are_checked() -> None:
    data = minimal()
    data["models"]["m"]["backends"] = [{"type": "native"}, {"type": "grpc", "url": "http://x"}]
    errs = errors_of(data)
    assert any(e.startswith("models.m.backends.0.url: Field required") for e in errs), errs
    assert any(e.startswith("models.m.backends.1") for e in errs), errs


def test_reserved_chunker_id_and_bad_values() -> None:
    data = minimal()
    data["chunkers"]["whole_doc_chunker"] = {"type": "sentence"}
    data["server"] = {"port": 70000}
    errs = errors_of(data)
    assert "chunkers.whole_doc_chunker: 'whole_doc_chunker' is reserved and built in" in errs
    assert any(e.startswith("server.port:") for e in errs)


def test_not_a_mapping() -> None:
    assert errors_of([1, 2]) == ["(root): the config must be a mapping"]


def _check_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", "check-config", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


def test_check_config_cli(tmp_path: Path) -> None:
    ok = _check_config(ROOT / "config.yaml")
    assert ok.returncode == 0, ok.stderr
    assert "OK" in ok.stdout
    bad = minimal()
    bad["detectors"]["hap"] = {"builtin": "profanity", "chunker_id": "sentense", "colour": 1}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    out = _check_config(path)
    assert out.returncode == 1
    assert "detectors.hap.colour: unknown key" in out.stderr
    # cross-reference checks run only once the schema passes; the schema error is named
    (tmp_path / "broken.yaml").write_text("models: [\n")
    broken = _check_config(tmp_path / "broken.yaml")
    assert broken.returncode == 1 and "invalid YAML" in broken.stderr
    missing = _check_config(tmp_path / "nope.yaml")
    assert missing.returncode == 1 and "cannot read" in missing.stderr


def test_chat_api_backends_cannot_mix_with_native_ones() -> None:

    cfg = {
        "models": {
            "m": {
                "backends": [
                    {"type": "openai", "url": "http://a:8000", "model": "x", "api": "chat"},
                    {"type": "native", "url": "http://b:8090"},
                ]
            }
        }
    }
    with pytest.raises(ConfigError) as info:
        parse_config(cfg)
    assert info.value.errors == [
        "models.m.backends: `openai` backends with `api: chat` cannot be mixed with `native` or "
        "`managed` ones (a migration between them cannot be exact)"
    ]


@pytest.mark.parametrize("header", ["Authorization", "cookie", "Proxy-Authorization"])
def test_forward_headers_refuses_credentials(header: str) -> None:

    with pytest.raises(ConfigError) as info:
        parse_config({"server": {"forward_headers": ["x-tenant", header]}})
    (error,) = info.value.errors
    assert error.startswith(f"server.forward_headers: {header.lower()} must never be forwarded")


def test_enforced_guardrails_name_configured_detectors() -> None:

    cfg = {
        "models": {
            "m": {
                "backends": [{"type": "native", "url": "http://b:8090"}],
                "guardrails": {"output": {"nope": {}, "pii": {"on_detection": "drop"}}},
            }
        },
        "detectors": {"pii": {"builtin": "regex"}},
    }
    with pytest.raises(ConfigError) as info:
        parse_config(cfg)
    assert info.value.errors == [
        "models.m.guardrails.output.nope: unknown detector 'nope' (expected one of: pii)",
        "models.m.guardrails.output.pii.on_detection: must be annotate, block or redact",
    ]


@pytest.mark.parametrize("value", [5, -1, 1.5, -0.01])
def test_thresholds_outside_zero_to_one_are_errors(value: float) -> None:
    """A threshold above 1 silently turned a detector off (scores are in [0, 1]); below 0 it
    flagged everything. Config defaults, detector params and enforced guardrails all say so."""
    data = minimal()
    data["detectors"]["pii"]["default_threshold"] = value
    data["detectors"]["hap"] = {
        "builtin": "profanity",
        "chunker_id": "sentence",
        "params": {"threshold": value},
    }
    data["models"]["m"]["guardrails"] = {"output": {"pii": {"threshold": value}}}
    errs = errors_of(data)
    assert any(e.startswith("detectors.pii.default_threshold: Input should be") for e in errs)
    assert f"detectors.hap.params.threshold: must be between 0 and 1, got {value}" in errs
    assert f"models.m.guardrails.output.pii.threshold: must be between 0 and 1, got {value}" in errs


def test_a_broken_file_reports_every_section_in_one_pass() -> None:
    """Schema errors in server, models and chunkers used to hide every detector reference error:
    a second run found three more. Now one pass names them all."""
    data = minimal()
    data["server"] = {"port": "eighty"}
    data["models"]["m"]["migration"] = {"limt": 3}
    data["chunkers"]["w"] = {"type": "words", "max_words": 0}
    data["detectors"]["hap"] = {"builtin": "profanity", "chunker_id": "sentense"}
    data["detectors"]["x"] = {"builtin": "nope", "chunker_id": "sentence"}
    data["detectors"]["y"] = {"chunker_id": "sentence"}
    data["detectors"]["z"] = {"builtin": "regex", "colour": 1}
    data["models"]["n"] = {
        "backends": [{"type": "managed", "model": "smollm3-999m"}],
        "guardrails": {"input": {"ghost": {}, "z": {}}},
    }
    errs = errors_of(data)
    assert any(e.startswith("server.port:") for e in errs), errs
    assert "models.m.migration.limt: unknown key (did you mean 'limit'?)" in errs
    assert any(e.startswith("chunkers.w.max_words") for e in errs), errs
    assert any(e.startswith("detectors.z.colour: unknown key (expected one of: ") for e in errs)
    assert "detectors.hap.chunker_id: unknown chunker 'sentense' (did you mean 'sentence'?)" in errs
    assert any(e.startswith("detectors.x.builtin: unknown built-in detector 'nope'") for e in errs)
    assert "detectors.y: exactly one of 'builtin' and 'url' is required" in errs
    assert (
        "models.n.backends.0.model: model spec 'smollm3-999m' is neither a built-in "
        "(smollm2-135m, tiny-random) nor a folder with a config.json"
    ) in errs
    assert any(
        e.startswith("models.n.guardrails.input.ghost: unknown detector 'ghost'") for e in errs
    )
    # z exists but its own entry is broken: reported once, under detectors.z, not as unknown
    assert not any(e.startswith("models.n.guardrails.input.z") for e in errs), errs
    assert len(errs) == len(set(errs)), errs


def test_managed_model_spec_must_name_a_model(tmp_path: Path) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    data = minimal()
    data["models"]["m"]["backends"] = [{"type": "managed", "model": str(folder)}]
    assert errors_of(data) == [
        f"models.m.backends.0.model: model spec '{folder}' is neither a built-in "
        "(smollm2-135m, tiny-random) nor a folder with a config.json"
    ]
    (folder / "config.json").write_text("{}")
    assert parse_config(data).models["m"].backends[0].model == str(folder)
    data["models"]["m"]["backends"] = [{"type": "managed", "model": "tiny-random"}]
    parse_config(data)


def test_check_config_requires_a_model(tmp_path: Path) -> None:
    """serve accepts a detection-only config (content endpoints); check-config says it has no
    model, which is almost always a mistake."""
    data = minimal()
    del data["models"]
    assert parse_config(data).models == {}
    path = tmp_path / "nomodels.yaml"
    path.write_text(yaml.safe_dump(data))
    out = _check_config(path)
    assert out.returncode == 1
    assert out.stderr.splitlines() == [
        "models: at least one model is required (clients name it as model_id)",
        f"{path}: 1 error(s)",
    ]
