"""The schema of config.yaml (DESIGN section 3), its loader and its cross-reference checks.

Every error is reported with its YAML path (`detectors.hap.chunker_id: unknown chunker 'x'`) and
all errors are collected at once, so an operator fixes a config in one pass.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

import chunkers
import detectors
from generation.specs import spec_problem

WHOLE_DOC_CHUNKER = "whole_doc_chunker"
NO_MODELS = "models: at least one model is required (clients name it as model_id)"
DEFAULT_REDACT_WITH = "[{entity}]"
MAX_REDACT_WITH = 256
CREDENTIAL_HEADERS = frozenset({"authorization", "cookie", "proxy-authorization"})
DETECTOR_TYPES = ("text_contents", "text_generation", "text_chat", "text_context_doc")


class Strict(BaseModel):
    """Base for config sections: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


class TlsConfig(Strict):
    cert_path: str
    key_path: str
    client_ca_path: str | None = None


class ClientTlsConfig(Strict):
    """TLS options for calls to a remote engine or detector."""

    ca_path: str | None = None
    cert_path: str | None = None
    key_path: str | None = None
    insecure_skip_verify: bool = False


class TracingConfig(Strict):
    """OpenTelemetry traces over OTLP/HTTP (README "Tracing"). Without this section tracing is
    off unless the standard OTEL_* environment variables turn it on."""

    # the collector's base URL (spans go to <url>/v1/traces); None: OTEL_EXPORTER_OTLP_* or
    # http://localhost:4318
    otlp_endpoint: str | None = None
    service_name: str | None = None  # None: OTEL_SERVICE_NAME, else "guardstream"
    # parent-based: a client's sampled traceparent is followed; None: OTEL_TRACES_SAMPLER
    sample_ratio: float | None = Field(None, ge=0, le=1)

    @field_validator("otlp_endpoint")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return v


class ServerConfig(Strict):
    host: str = "0.0.0.0"
    port: int = Field(8033, ge=0, le=65535)
    api_keys_env: str | None = None
    max_request_bytes: int = Field(1_048_576, ge=1024)
    request_timeout_s: float = Field(600, gt=0)
    # a connection must complete a request's headers within this long of opening, or of its
    # previous response (idle keep-alive included); else it is closed. Above common load
    # balancers' idle timeouts (60 s), so they close first and never reuse a closing connection
    header_timeout_s: float = Field(75, gt=0)
    # a request body that sends nothing for this long: 408 (in-band on stream-content, which
    # then frees its stream slot), and the connection is closed
    body_idle_timeout_s: float = Field(30, gt=0)
    # with api_keys_env set, /metrics needs a key unless this is true (its series name
    # replicas and detectors)
    public_metrics: bool = False
    max_concurrent_streams: int = Field(1024, ge=1)
    # connections the kernel queues for accept() while the event loop is busy (a burst of
    # clients connecting at once); capped by net.core.somaxconn (aiohttp's default is 128)
    listen_backlog: int = Field(2048, ge=1, le=65535)
    drain_timeout_s: float = Field(30, ge=0)
    tls: TlsConfig | None = None
    forward_headers: list[str] = Field(default_factory=list)
    # an SSE comment line after this many seconds of silence on every streaming endpoint, so
    # proxies with idle timeouts do not cut a stream whose text is held back (DESIGN 4.3)
    sse_keepalive_s: float = Field(15, gt=0)
    # while the event loop lags by at least read_coalesce_min_lag_ms (it is busy), an engine that
    # streams at its own pace is read once per read_coalesce_tokens tokens' time (at most 50 ms)
    # rather than once per token: fewer wake-ups, a frame released up to that much later; bursts
    # are read at once. tokens 0: never; min_lag 0: always (see ReadPacer, LoopLag)
    read_coalesce_tokens: float = Field(5, ge=0, le=16)
    read_coalesce_min_lag_ms: float = Field(2, ge=0)
    # orchestrator processes sharing the port (SO_REUSEPORT); "auto": one per usable CPU. The
    # first process supervises them and starts managed engines once for all of them.
    workers: int | Literal["auto"] = 1
    tracing: TracingConfig | None = None

    @field_validator("workers", mode="before")
    @classmethod
    def _workers(cls, v: Any) -> Any:
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 256):
            return v
        raise ValueError('must be an integer from 1 to 256, or "auto"')

    @field_validator("forward_headers")
    @classmethod
    def _no_credentials(cls, v: list[str]) -> list[str]:
        # a client's credentials are for guardstream; forwarding them would hand them to every
        # engine and detector service (and an engine key must come from api_key_env)
        bad = sorted({h.strip().lower() for h in v} & CREDENTIAL_HEADERS)
        if bad:
            raise ValueError(
                f"{', '.join(bad)} must never be forwarded (credentials stay with guardstream; "
                "downstream keys come from api_key_env)"
            )
        return v


class ManagedBackend(Strict):
    """Engine processes the orchestrator starts and supervises on this machine."""

    type: Literal["managed"]
    model: str
    replicas: int = Field(1, ge=1, le=64)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # the engine's --dtype: auto is bf16 on CUDA, fp32 on a CPU (fp64 for tiny-random)
    dtype: Literal["auto", "float32", "bfloat16", "float16", "float64"] = "auto"
    # the engine's --batch-invariant: logits independent of the batch, so a migrated stream is
    # token-exact at the engine's dtype (DESIGN section 7), at a throughput cost
    batch_invariant: bool = False
    # the engine's --prefill-chunk-tokens: contexts longer than this prefill a chunk per pass
    # between decode steps (null: the engine's default, 256 on a CPU, 2048 on CUDA)
    prefill_chunk_tokens: int | None = Field(None, ge=1)
    enable_fault_injection: bool = False
    start_timeout_s: float = Field(300, gt=0)


class NativeBackend(Strict):
    """An engine already running, speaking the native protocol (DESIGN section 7)."""

    type: Literal["native"]
    url: str
    api_key_env: str | None = None  # the engine's --api-keys-env key, sent as a Bearer token
    tls: ClientTlsConfig | None = None


class OpenAIBackend(Strict):
    """An OpenAI-compatible server (vLLM, SGLang, TGI, Ollama, a Dynamo frontend, LiteLLM).
    `completions` resumes token-exactly; `chat` resumes by continuing the partial assistant
    message (DESIGN section 7)."""

    type: Literal["openai"]
    url: str
    model: str
    api: Literal["completions", "chat"] = "completions"
    api_key_env: str | None = None
    tls: ClientTlsConfig | None = None
    # the served model's Hugging Face folder (tokenizer.json + chat template), for servers
    # without `/tokenize` (transformers serve): `api: completions` templates chat requests with
    # it, and prompts are counted with it
    tokenizer: str | None = None


Backend = Annotated[ManagedBackend | NativeBackend | OpenAIBackend, Field(discriminator="type")]


class MigrationConfig(Strict):
    limit: int = Field(3, ge=0)
    max_seq_len: int = Field(8192, ge=1)
    stall_timeout_s: float = Field(30, gt=0)
    quarantine_s: float = Field(5, ge=0)


class ModelLimits(Strict):
    """Per-model caps that protect the service from oversized requests (422 beyond them)."""

    max_new_tokens: int = Field(2048, ge=1)
    default_max_new_tokens: int = Field(256, ge=1)
    max_input_chars: int = Field(100_000, ge=1)


class DecodingDefaults(Strict):
    """Decoding settings for requests that leave them unset: a small model answers a chat request
    at OpenAI's default temperature (1) with garbled text, and greedy text loops without a
    repetition penalty. A request that sets a field always wins."""

    temperature: float | None = Field(None, gt=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)


class ModelGuardrails(Strict):
    """Detectors enforced on every request to a model, on every endpoint: `{detector_id: params}`
    with the same params a request may give (threshold, on_detection, detector params)."""

    input: dict[str, dict[str, Any]] = Field(default_factory=dict)
    output: dict[str, dict[str, Any]] = Field(default_factory=dict)


class ModelConfig(Strict):
    backends: list[Backend] = Field(min_length=1)
    migration: MigrationConfig = Field(default_factory=MigrationConfig)
    limits: ModelLimits = Field(default_factory=ModelLimits)
    # Apply the model's chat template to `inputs` (instruct models answer a raw prompt poorly).
    chat: bool = False
    guardrails: ModelGuardrails = Field(default_factory=ModelGuardrails)
    decoding_defaults: DecodingDefaults = Field(default_factory=DecodingDefaults)


class DetectorConfig(Strict):
    type: Literal["text_contents", "text_generation", "text_chat", "text_context_doc"] = (
        "text_contents"
    )
    builtin: str | None = None
    url: str | None = None
    chunker_id: str = WHOLE_DOC_CHUNKER
    default_threshold: float = Field(0.5, ge=0, le=1)  # scores are in [0, 1]
    params: dict[str, Any] = Field(default_factory=dict)
    timeout_s: float = Field(10, gt=0)
    on_detection: Literal["annotate", "block", "redact"] = "annotate"
    # redact (DESIGN 4.6a): the replacement of each flagged span, a fixed string or a template
    # with {entity} (the detection's name: `[{entity}]` gives `[email]`)
    redact_with: StrictStr = Field(DEFAULT_REDACT_WITH, max_length=MAX_REDACT_WITH)
    api_key_env: str | None = None  # a remote detector service's key, sent as a Bearer token
    tls: ClientTlsConfig | None = None


class Config(Strict):
    server: ServerConfig = Field(default_factory=ServerConfig)
    models: dict[str, ModelConfig] = Field(default_factory=dict)
    chunkers: dict[str, dict[str, Any]] = Field(default_factory=dict)
    detectors: dict[str, DetectorConfig] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _cross_references(self) -> Config:
        errors = cross_reference_errors(self)
        if errors:
            raise ConfigError(errors)
        return self


class ConfigError(ValueError):
    """A config that cannot run; `errors` holds one `yaml.path: message` line per problem."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


def cross_reference_errors(
    config: Config, present_detectors: set[str] | None = None, require_models: bool = False
) -> list[str]:
    """Checks that the schema alone cannot express: references between sections, settings of
    chunkers and built-in detectors (validated by their own libraries, without loading models),
    managed model specs. `present_detectors`: ids of detectors whose own entry failed the schema
    (reported there), so a reference to them is not also reported as unknown. `require_models`
    (check-config): a config without models is an error there; `serve` accepts it, for a
    detection-only deployment (the content endpoints), and logs a warning."""
    errors: list[str] = []
    if require_models and not config.models:
        errors.append(NO_MODELS)
    errors.extend(chunker_errors(config.chunkers))
    for detector_id, det in config.detectors.items():
        path = f"detectors.{detector_id}"
        errors.extend(_threshold_errors(f"{path}.params.threshold", det.params.get("threshold")))
        if (det.builtin is None) == (det.url is None):
            errors.append(f"{path}: exactly one of 'builtin' and 'url' is required")
        if det.builtin is not None:
            if det.builtin not in detectors.BUILTINS:
                errors.append(
                    f"{path}.builtin: unknown built-in detector '{det.builtin}' "
                    f"(expected one of {', '.join(detectors.BUILTINS)})"
                )
            else:
                try:
                    detectors.validate_params(det.builtin, _detector_params(det.params))
                except ValueError as exc:  # one line per problem: detectors.x.params.patterns.y
                    errors.extend(detectors.param_error_lines(f"{path}.params", exc))
        if det.url is not None and not det.url.startswith(("http://", "https://")):
            errors.append(f"{path}.url: must start with http:// or https://")
        errors.extend(_redact_with_errors(det.params, f"{path}.params"))
        if det.chunker_id != WHOLE_DOC_CHUNKER and det.chunker_id not in config.chunkers:
            errors.append(f"{path}.chunker_id: unknown chunker '{det.chunker_id}'")
    for model_id, model in config.models.items():
        for direction in ("input", "output"):
            enforced: dict[str, dict[str, Any]] = getattr(model.guardrails, direction)
            for detector_id, params in enforced.items():
                path = f"models.{model_id}.guardrails.{direction}.{detector_id}"
                det = config.detectors.get(detector_id)
                if det is None:
                    if detector_id not in (present_detectors or set()):
                        errors.append(f"{path}: unknown detector '{detector_id}'")
                elif det.type != "text_contents":
                    errors.append(f"{path}: detector type '{det.type}' cannot judge text")
                if not isinstance(params, dict):
                    errors.append(f"{path}: must be a mapping of detector params")
                    continue
                if params.get("on_detection") not in (None, "annotate", "block", "redact"):
                    errors.append(f"{path}.on_detection: must be annotate, block or redact")
                errors.extend(_redact_with_errors(params, path))
                errors.extend(_threshold_errors(f"{path}.threshold", params.get("threshold")))
        chat_api = [b for b in model.backends if isinstance(b, OpenAIBackend) and b.api == "chat"]
        if chat_api and any(isinstance(b, ManagedBackend | NativeBackend) for b in model.backends):
            # a chat replica delivers text without token ids: a native engine could not resume
            # its stream exactly, so the two cannot share one model's migrations
            errors.append(
                f"models.{model_id}.backends: `openai` backends with `api: chat` cannot be mixed "
                "with `native` or `managed` ones (a migration between them cannot be exact)"
            )
        for i, backend in enumerate(model.backends):
            path = f"models.{model_id}.backends.{i}"
            if isinstance(backend, ManagedBackend):
                problem = spec_problem(backend.model)
                if problem is not None:
                    errors.append(f"{path}.model: {problem}")
            url = getattr(backend, "url", None)
            if url is not None and not url.startswith(("http://", "https://")):
                errors.append(f"{path}.url: must start with http:// or https://")
    return errors


def _threshold_errors(path: str, t: Any) -> list[str]:
    """A threshold outside [0, 1] silently turns a detector off (above 1) or flags everything."""
    if t is None:
        return []
    if isinstance(t, bool) or not isinstance(t, int | float) or t != t:
        return [f"{path}: must be a number"]
    if not 0 <= t <= 1:
        return [f"{path}: must be between 0 and 1, got {t}"]
    return []


def _redact_with_errors(params: dict[str, Any], path: str) -> list[str]:
    if "redact_with" not in params:
        return []
    value = params["redact_with"]
    if not isinstance(value, str):
        return [f"{path}.redact_with: must be a string"]
    if len(value) > MAX_REDACT_WITH:
        return [f"{path}.redact_with: at most {MAX_REDACT_WITH} characters"]
    return []


def chunker_errors(section: Any) -> list[str]:
    """Problems in the `chunkers:` section; also run on the raw YAML when other sections fail
    schema validation, so one pass reports everything."""
    if not isinstance(section, dict):
        return []
    errors: list[str] = []
    for chunker_id, settings in section.items():
        path = f"chunkers.{chunker_id}"
        if chunker_id == WHOLE_DOC_CHUNKER:
            errors.append(f"{path}: '{WHOLE_DOC_CHUNKER}' is reserved and built in")
            continue
        if not isinstance(settings, dict):
            continue  # the schema reports it
        try:
            chunkers.build(settings)
        except ValueError as exc:
            errors.append(f"{path}.{exc}" if _names_field(exc) else f"{path}: {exc}")
    return errors


def _names_field(exc: ValueError) -> bool:
    """Chunker errors start with the field name (`max_words: must be >= 1`)."""
    head = str(exc).split(":", 1)[0]
    return bool(head) and " " not in head


def _detector_params(params: dict[str, Any]) -> dict[str, Any]:
    """Params minus the keys the orchestrator consumes itself."""
    return {k: v for k, v in params.items() if k not in ORCHESTRATOR_PARAM_KEYS}


ORCHESTRATOR_PARAM_KEYS = frozenset({"threshold", "on_detection", "redact_with"})


def _format_validation_error(exc: ValidationError) -> list[str]:
    lines = []
    for err in exc.errors():
        loc = [str(part) for part in err["loc"]]
        # Discriminated unions insert the tag into the location; it is not a YAML key.
        loc = [p for p in loc if p not in ("managed", "native", "openai")]
        if err["type"] == "value_error" and isinstance(
            err.get("ctx", {}).get("error"), ConfigError
        ):
            lines.extend(err["ctx"]["error"].errors)
            continue
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        path = ".".join(loc) if loc else "(root)"
        lines.append(f"{path}: {msg}")
    return lines


def parse_config(data: Any, require_models: bool = False) -> Config:
    """Validates an already-parsed YAML document; raises ConfigError with every problem."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(["(root): the config must be a mapping"])
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        errors = _format_validation_error(exc)
        errors += [e for e in _salvaged_errors(data, require_models) if e not in errors]
        raise ConfigError(errors) from None
    if require_models and not config.models:
        raise ConfigError([NO_MODELS])
    return config


def _salvaged_errors(data: dict[str, Any], require_models: bool) -> list[str]:
    """Cross-reference errors among the entries that pass the schema on their own. Without this,
    a schema error anywhere hid every reference error, and a broken file needed several passes."""

    def section(name: str) -> dict[str, Any]:
        value = data.get(name)
        return value if isinstance(value, dict) else {}

    def valid(model: type[BaseModel], value: Any) -> Any:
        try:
            return model.model_validate(value)
        except (ValidationError, ConfigError):
            return None

    models = {k: m for k, v in section("models").items() if (m := valid(ModelConfig, v))}
    dets = {k: valid(DetectorConfig, v) for k, v in section("detectors").items()}
    salvaged = Config.model_construct(
        server=ServerConfig.model_construct(),
        models=models,
        chunkers=section("chunkers"),
        detectors={k: d for k, d in dets.items() if d is not None},
    )
    # models that are there but failed the schema are reported by it, not as missing
    return cross_reference_errors(salvaged, set(dets), require_models and not section("models"))


def load_config(path: str | os.PathLike[str], require_models: bool = False) -> Config:
    """Reads and validates a config file; raises ConfigError (never a bare traceback)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"{p}: cannot read: {exc.strerror or exc}"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError([f"{p}: invalid YAML: {exc}"]) from None
    return parse_config(data, require_models)


def secret_env_names(config: Config) -> frozenset[str]:
    """Every environment variable the config names as holding a key (the server's API keys,
    engines' and detector services' keys): what a child process (a managed engine) must not
    inherit, since it needs none of them and a compromised engine would get them all."""
    names = {config.server.api_keys_env}
    for model in config.models.values():
        names.update(getattr(backend, "api_key_env", None) for backend in model.backends)
    names.update(detector.api_key_env for detector in config.detectors.values())
    return frozenset(n for n in names if n)
