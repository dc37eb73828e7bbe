"""docs/configuration.md, rendered from the config schema itself (orchestrator/config.py, the
chunkers' settings, the built-in detectors' params), so the reference cannot drift from what
`check-config` accepts: tests/test_docs_configuration.py fails when the file is stale.

    python -m orchestrator.config_reference > docs/configuration.md
"""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import annotated_types
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

import detectors
from chunkers.settings import ParagraphSettings, SentenceSettings, WholeDocSettings, WordsSettings

from .config import (
    ClientTlsConfig,
    Config,
    DecodingDefaults,
    DetectionCacheConfig,
    DetectorConfig,
    ManagedBackend,
    MigrationConfig,
    ModelConfig,
    ModelGuardrails,
    ModelLimits,
    NativeBackend,
    OpenAIBackend,
    ServerConfig,
    TenantConfig,
    TenantLimits,
    TlsConfig,
    TracingConfig,
)

ROOT = Path(__file__).resolve().parents[1]
HEADER = """\
# Configuration reference

Every key of `config.yaml`, generated from the schema the service validates it with
(`python -m orchestrator.config_reference > docs/configuration.md`; a test fails when this file is
stale). Unknown keys are errors; `python -m orchestrator check-config PATH` reports every mistake
of a file in one pass, each with its YAML path and, for a typo, the closest valid choice. Secrets
never appear in the file: keys are read from the environment variables it names (`*_env`).

The shipped [`config.yaml`](../config.yaml) is a complete, commented example; the column
*example* shows its value where it sets the key.
"""

# (heading, the YAML path of the section, its model)
SECTIONS: list[tuple[str, str, type[BaseModel]]] = [
    ("Top level", "", Config),
    ("`server`", "server", ServerConfig),
    ("`server.tls`", "server.tls", TlsConfig),
    ("`server.tracing`", "server.tracing", TracingConfig),
    ("`models.<model_id>`", "models.<model_id>", ModelConfig),
    ("`backends[]` with `type: managed`", "models.<model_id>.backends[]", ManagedBackend),
    ("`backends[]` with `type: native`", "models.<model_id>.backends[]", NativeBackend),
    ("`backends[]` with `type: openai`", "models.<model_id>.backends[]", OpenAIBackend),
    ("`backends[].tls` and `detectors.<id>.tls`", "…tls", ClientTlsConfig),
    ("`models.<model_id>.migration`", "models.<model_id>.migration", MigrationConfig),
    ("`models.<model_id>.limits`", "models.<model_id>.limits", ModelLimits),
    ("`models.<model_id>.guardrails`", "models.<model_id>.guardrails", ModelGuardrails),
    (
        "`models.<model_id>.decoding_defaults`",
        "models.<model_id>.decoding_defaults",
        DecodingDefaults,
    ),
    ("`chunkers.<chunker_id>` with `type: sentence`", "chunkers.<chunker_id>", SentenceSettings),
    ("`chunkers.<chunker_id>` with `type: paragraph`", "chunkers.<chunker_id>", ParagraphSettings),
    ("`chunkers.<chunker_id>` with `type: words`", "chunkers.<chunker_id>", WordsSettings),
    ("`chunkers.<chunker_id>` with `type: whole_doc`", "chunkers.<chunker_id>", WholeDocSettings),
    ("`detectors.<detector_id>`", "detectors.<detector_id>", DetectorConfig),
    ("`tenants.<tenant_id>`", "tenants.<tenant_id>", TenantConfig),
    (
        "`tenants.<tenant_id>.guardrails.<model_id>`",
        "tenants.<tenant_id>.guardrails.<model_id>",
        ModelGuardrails,
    ),
    ("`tenants.<tenant_id>.limits`", "tenants.<tenant_id>.limits", TenantLimits),
    ("`detection_cache`", "detection_cache", DetectionCacheConfig),
]


def _type(annotation: Any) -> str:
    """How a value of `annotation` is written in YAML, in words."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Annotated:
        return _type(args[0])
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        present = [a for a in args if a is not type(None)]
        rendered = " \\| ".join(_type(a) for a in present)
        return rendered + (" (optional)" if len(present) < len(args) else "")
    if origin is dict:
        return f"mapping of name → {_type(args[1])}"
    if origin is list:
        return f"list of {_type(args[0])}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    names = {str: "string", int: "integer", float: "number", bool: "boolean", Any: "any"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _bounds(info: FieldInfo) -> str:
    parts = []
    for m in info.metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if isinstance(m, getattr(annotated_types, attr.capitalize())):
                parts.append(f"{sign} {getattr(m, attr)}")
        if isinstance(m, annotated_types.MinLen):
            parts.append(f"at least {m.min_length} item(s)")
        if isinstance(m, annotated_types.MaxLen):
            parts.append(f"at most {m.max_length} characters")
    return ", ".join(parts)


def _value(value: Any) -> str:
    if value is None or value is PydanticUndefined:
        return ""
    if isinstance(value, BaseModel):
        return ""
    return f"`{json.dumps(value)}`"


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    if info.default_factory is not None:
        made = info.default_factory()  # type: ignore[call-arg]
        return "" if isinstance(made, BaseModel) else _value(made)
    return _value(info.default)


def _shipped(path: str, key: str, model: type[BaseModel]) -> str:
    """The shipped config.yaml's value of `path.key`: at an `<id>` or `[]` step, the first entry
    of the kind `model` describes (its `type`, when it has one)."""
    kind = model.model_fields.get("type")
    kinds = typing.get_args(kind.annotation) if kind is not None else ()
    node: Any = yaml.safe_load((ROOT / "config.yaml").read_text(encoding="utf-8"))
    for part in [p for p in path.split(".") if p]:
        many = part.startswith("<") or part.endswith("[]")
        name = part.removesuffix("[]")
        if not name.startswith("<"):
            node = node.get(name) if isinstance(node, dict) else None
        if many:
            entries = list(node.values()) if isinstance(node, dict) else node or []
            matching = [e for e in entries if isinstance(e, dict)]
            if kinds and part == path.split(".")[-1]:
                matching = [e for e in matching if e.get("type") in kinds]
            node = matching[0] if matching else None
    if not isinstance(node, dict) or key not in node or isinstance(node[key], dict | list):
        return ""
    return _value(node[key])


def _clean(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


def _table(path: str, model: type[BaseModel]) -> list[str]:
    rows = [
        "| key | type | default | bounds | example | what it does |",
        "|---|---|---|---|---|---|",
    ]
    for name, info in model.model_fields.items():
        example = _shipped(path, name, model) if path and path != "…tls" else ""
        rows.append(
            f"| `{name}` | {_type(info.annotation)} | {_default(info)} | {_bounds(info)} "
            f"| {example} | {_clean(info.description)} |"
        )
    return rows


def _builtin_params() -> list[str]:
    out = ["## Built-in detectors' `params`", ""]
    out.append(
        "A built-in detector's settings go in its entry's `params`. A request's "
        "`detector_params` may set only the request-settable ones; every other param is "
        "config-only (a request naming one is a 422, and no path is ever opened for it)."
    )
    out.append("")
    for builtin in detectors.BUILTINS:
        cls = detectors.detector_class(builtin)
        out += [f"### `builtin: {builtin}`", "", _clean(cls.description), ""]
        settable = cls.REQUEST_PARAMS
        out += [
            "| param | type | default | bounds | request-settable |",
            "|---|---|---|---|---|",
        ]
        for name, info in cls.Params.model_fields.items():
            out.append(
                f"| `{name}` | {_type(info.annotation)} | {_default(info)} | {_bounds(info)} "
                f"| {'yes' if name in settable else ''} |"
            )
        out.append("")
    return out


def render() -> str:
    lines = [HEADER]
    for heading, path, model in SECTIONS:
        lines += [f"## {heading}", "", _clean(model.__doc__), ""]
        lines += _table(path, model)
        lines.append("")
    lines += _builtin_params()
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":
    print(render(), end="")
