"""The schema of config.yaml (DESIGN section 3), its loader and its cross-reference checks.

Every error is reported with its YAML path (`detectors.hap.chunker_id: unknown chunker 'x'`) and
all errors are collected at once, so an operator fixes a config in one pass.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

import chunkers
import detectors
from servicekit.model_specs import spec_problem

from . import judge_templates
from .suggestions import closest, did_you_mean, fields_at

WHOLE_DOC_CHUNKER = "whole_doc_chunker"
NO_MODELS = "models: at least one model is required (clients name it as model_id)"
DEFAULT_REDACT_WITH = "[{entity}]"
MAX_REDACT_WITH = 256
CREDENTIAL_HEADERS = frozenset({"authorization", "cookie", "proxy-authorization"})
JUDGE_TYPE = "openai_judge"
ENGINE_JUDGE_TYPE = "engine_judge"
# the judge detectors: a safety model reading a template (DESIGN 6)
JUDGE_TYPES = (JUDGE_TYPE, ENGINE_JUDGE_TYPE)
JUDGE_FIELDS = (
    "model",
    "template",
    "api",
    "unsafe_tokens",
    "safe_tokens",
    "categories",
    "on_error",
)
ENGINE_JUDGE_FIELDS = ("replicas", "device", "urls")
# the types that judge text (input and output guardrails, the content endpoints)
TEXT_TYPES = ("text_contents", *JUDGE_TYPES)


class Strict(BaseModel):
    """Base for config sections: unknown keys are errors. Each field's docstring is its entry in
    the configuration reference (docs/configuration.md, generated from this schema)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class TlsConfig(Strict):
    """HTTPS for the service itself."""

    cert_path: str
    """PEM certificate chain the service presents."""
    key_path: str
    """PEM private key of that certificate."""
    client_ca_path: str | None = None
    """PEM CA bundle: when set, clients must present a certificate it signed (mutual TLS)."""


class ClientTlsConfig(Strict):
    """TLS options for calls to a remote engine or detector."""

    ca_path: str | None = None
    """PEM CA bundle that signs the peer's certificate (default: the system's)."""
    cert_path: str | None = None
    """PEM client certificate, for a peer that requires mutual TLS."""
    key_path: str | None = None
    """PEM private key of the client certificate."""
    insecure_skip_verify: bool = False
    """Accept any certificate (testing only: anyone on the path can read the traffic)."""


class TracingConfig(Strict):
    """OpenTelemetry traces over OTLP/HTTP (README "Tracing"). Without this section tracing is
    off unless the standard OTEL_* environment variables turn it on."""

    otlp_endpoint: str | None = None
    """The collector's base URL (spans go to <url>/v1/traces); unset: OTEL_EXPORTER_OTLP_* or
    http://localhost:4318."""
    service_name: str | None = None
    """The traces' service name; unset: OTEL_SERVICE_NAME, else `guardstream`."""
    sample_ratio: float | None = Field(None, ge=0, le=1)
    """Share of new traces sampled (parent-based: a client's sampled traceparent is followed);
    unset: OTEL_TRACES_SAMPLER."""

    @field_validator("otlp_endpoint")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return v


class ServerConfig(Strict):
    """The HTTP service: where it listens, who may call it, and the bounds every request gets."""

    host: str = "0.0.0.0"
    """Address to listen on (`serve --host` overrides it; `make run` passes 127.0.0.1)."""
    port: int = Field(8033, ge=0, le=65535)
    """Port to listen on (`serve --port` overrides it; 0: any free port)."""
    api_keys_env: str | None = None
    """Name of an environment variable holding comma-separated API keys (the tenant `default`);
    when it or `tenants` is set, Bearer auth is required everywhere except /health, /info,
    /metrics (see public_metrics), /openapi.json."""
    max_request_bytes: int = Field(1_048_576, ge=1024)
    """Largest request body, streaming bodies included (413 beyond)."""
    max_detection_chars: int = Field(100_000, ge=1)
    """Most characters one detection request may ask to be judged (422 naming the field beyond,
    before any detector runs): `content`'s; chat's messages and tools (every string, keys of
    their objects included); context's content and context documents; generated's prompt and
    generated text; stream-content's lines so far (past it the stream ends with an in-band 422
    error line, the line that passed it unjudged). A detector model reads a text several times
    at a cost per character (`injection` ~270 ms of CPU per 1,000): the body limit alone let
    one request hold a CPU for minutes. A tenant's `limits.max_detection_chars` lowers it."""
    request_timeout_s: float = Field(600, gt=0)
    """Overall bound for one request on every endpoint, streaming included."""
    header_timeout_s: float = Field(75, gt=0)
    """A connection must complete a request's headers within this long of opening, or of its
    previous response (idle keep-alive included), else it is closed. Keep it above a load
    balancer's idle timeout (often 60 s), so the balancer closes first."""
    body_idle_timeout_s: float = Field(30, gt=0)
    """A request body that sends nothing this long: 408 (in-band on stream-content, which then
    frees its stream slot), and the connection is closed."""
    admin_keys_env: str | None = None
    """Name of an environment variable holding comma-separated admin keys: the only keys
    `POST /admin/reload` accepts (unset: it answers 401 to everyone; SIGHUP still reloads). An
    admin key cannot also be a tenant's."""
    public_metrics: bool = False
    """With api_keys_env set, /metrics needs a key unless this is true (its series name replicas
    and detectors); with `tenants`, an admin key (server.admin_keys_env: its per-tenant series
    hold every tenant's id and usage, which no tenant's key may read)."""
    max_concurrent_streams: int = Field(1024, ge=1)
    """Requests served at once; beyond it: 429 `overloaded` with Retry-After."""
    listen_backlog: int = Field(2048, ge=1, le=65535)
    """Connections the kernel queues for accept() while the event loop is busy (a burst of
    clients connecting at once); capped by net.core.somaxconn."""
    drain_timeout_s: float = Field(30, ge=0)
    """On SIGTERM, running streams get this long, then end with `server_shutdown`."""
    tls: TlsConfig | None = None
    """HTTPS for the service (unset: plain HTTP)."""
    forward_headers: list[str] = Field(default_factory=list)
    """Client headers forwarded to engines and detectors (never Authorization or cookies)."""
    sse_keepalive_s: float = Field(15, gt=0)
    """An SSE comment line after this many seconds of silence on every streaming endpoint, so
    proxies with idle timeouts do not cut a stream whose text is held back."""
    read_coalesce_tokens: float = Field(5, ge=0, le=16)
    """While the event loop is busy (see read_coalesce_min_lag_ms), an engine that streams at its
    own pace is read once per this many tokens' time (at most 50 ms) rather than once per token;
    bursts are read at once. 0: never."""
    read_coalesce_min_lag_ms: float = Field(2, ge=0)
    """"Busy" for read_coalesce_tokens: the event loop lags at least this much. 0: always."""
    workers: int | Literal["auto"] = 1
    """Orchestrator processes sharing the port (SO_REUSEPORT), 1 to 256; `auto`: one per usable
    CPU. The first process supervises them and starts managed engines once for all."""
    tracing: TracingConfig | None = None
    """OpenTelemetry traces (unset: off unless OTEL_* variables turn them on)."""

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
    """`managed`."""
    model: str
    """The engine's model: a built-in name (`smollm2-135m`, `tiny-random`) or a path to a Hugging
    Face model folder."""
    replicas: int = Field(1, ge=1, le=64)
    """Engine processes of this model; a stream migrates between them."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the engines run; `auto`: CUDA when there is a GPU."""
    dtype: Literal["auto", "float32", "bfloat16", "float16", "float64"] = "auto"
    """The engine's --dtype; `auto`: bf16 on CUDA, fp32 on a CPU (fp64 for tiny-random)."""
    batch_invariant: bool = False
    """Logits independent of the batch, so a migrated stream is token-exact at the engine's dtype
    (DESIGN section 7), at a throughput cost."""
    prefill_chunk_tokens: int | None = Field(None, ge=1)
    """The engine's --prefill-chunk-tokens: a prompt longer than this is prefilled a chunk per
    pass between decode steps (unset: the engine's default, 256 on a CPU, 2048 on CUDA)."""
    overlap: bool | None = None
    """The engine's --overlap / --no-overlap: launch each static (CUDA) decode step before the
    previous step's tokens are processed (unset: the engine's default, on)."""
    compile: bool = False
    """The engine's --compile: its static decode step through torch.compile (Inductor) before
    the CUDA graphs are captured (fewer, fused kernels per step; compiling adds to the start)."""
    enable_fault_injection: bool = False
    """Let tests inject faults into the engines (never in production)."""
    start_timeout_s: float = Field(300, gt=0)
    """How long an engine may take to load its model and answer /health."""


class NativeBackend(Strict):
    """An engine already running, speaking the native protocol (DESIGN section 7)."""

    type: Literal["native"]
    """`native`."""
    url: str
    """The engine's base URL (http:// or https://)."""
    api_key_env: str | None = None
    """Name of an environment variable holding the engine's key (its --api-keys-env), sent as a
    Bearer token."""
    tls: ClientTlsConfig | None = None
    """TLS options for an https:// engine."""


class OpenAIBackend(Strict):
    """An OpenAI-compatible server (vLLM, SGLang, TGI, Ollama, a Dynamo frontend, LiteLLM).
    `completions` resumes token-exactly; `chat` resumes by continuing the partial assistant
    message (DESIGN section 7)."""

    type: Literal["openai"]
    """`openai`."""
    url: str
    """The server's base URL (without /v1)."""
    model: str
    """The model name the server knows (what it lists in /v1/models)."""
    api: Literal["completions", "chat"] = "completions"
    """Which endpoint generates: `completions` (token-exact resume when the server returns token
    ids) or `chat` (resume by continuing the partial assistant message)."""
    api_key_env: str | None = None
    """Name of an environment variable holding the server's key, sent as a Bearer token."""
    tls: ClientTlsConfig | None = None
    """TLS options for an https:// server."""
    tokenizer: str | None = None
    """The served model's Hugging Face folder (tokenizer.json + chat template), for servers
    without /tokenize (transformers serve): `api: completions` templates chat requests with it,
    and prompts are counted with it."""
    forward_fields: list[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")]] = Field(
        default_factory=list, max_length=64
    )
    """`api: chat`: the server's own request fields (not OpenAI's) that Chat Completions
    clients may send through it, e.g. vLLM's `[top_k, min_p, repetition_penalty]`; any other
    field that is not OpenAI's is refused with 422. A server's own fields can change what the
    model reads past the input guardrails (vLLM's `chat_template`, `continue_final_message`)
    or cost it unbounded work (`guided_regex`): list only those you have read. Every string
    and number of a forwarded field is judged by the input detectors."""


Backend = Annotated[ManagedBackend | NativeBackend | OpenAIBackend, Field(discriminator="type")]


class MigrationConfig(Strict):
    """What happens when a replica dies mid-stream (DESIGN section 7)."""

    limit: int = Field(3, ge=0)
    """Replacement attempts per request after a replica failed; 0 disables migration. A replica
    that answers 429 (busy) is passed over without counting: another one gets the request."""
    max_seq_len: int = Field(8192, ge=1)
    """Prompt + generated tokens above this: the request becomes unmigratable."""
    stall_timeout_s: float = Field(30, gt=0)
    """No item from a replica for this long: it is treated as dead."""
    quarantine_s: float = Field(5, ge=0)
    """A failed replica is not chosen again for this long."""


class ModelLimits(Strict):
    """Per-model caps that protect the service from oversized requests (422 beyond them)."""

    max_new_tokens: int = Field(2048, ge=1)
    """Largest token budget a request may ask for."""
    default_max_new_tokens: int = Field(256, ge=1)
    """The budget of a request that names none."""
    max_input_chars: int = Field(100_000, ge=1)
    """Largest prompt (all messages together), in characters."""


class DecodingDefaults(Strict):
    """Decoding settings for requests that leave them unset: a small model answers a chat request
    at OpenAI's default temperature (1) with garbled text, and greedy text loops without a
    repetition penalty. A request that sets a field always wins."""

    temperature: float | None = Field(None, gt=0, le=2)
    """Sampling temperature for requests without one."""
    top_p: float | None = Field(None, gt=0, le=1)
    """Nucleus sampling for requests without one."""
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    """Repetition penalty for requests without one (dropped for a server that refuses it)."""


class ModelGuardrails(Strict):
    """Detectors enforced on every request to a model, on every endpoint: `{detector_id: params}`
    with the same params a request may give (threshold, on_detection, redact_with, detector
    params). A request can add detectors; it can never remove or weaken these."""

    input: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Judge every piece of text a client sends, before the model sees it."""
    output: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Judge the generated text before any of it is released."""


class ModelConfig(Strict):
    """A generation model, keyed by the model_id clients send."""

    backends: list[Backend] = Field(min_length=1)
    """Replicas of the same model, any mix of types (`managed`, `native`, `openai`)."""
    migration: MigrationConfig = Field(default_factory=MigrationConfig)
    """Migration between the replicas."""
    limits: ModelLimits = Field(default_factory=ModelLimits)
    """Request bounds for this model."""
    chat: bool = False
    """FMS endpoints: apply the model's chat template to `inputs` (instruct models answer a raw
    prompt poorly)."""
    guardrails: ModelGuardrails = Field(default_factory=ModelGuardrails)
    """Detectors enforced on every request to this model."""
    decoding_defaults: DecodingDefaults = Field(default_factory=DecodingDefaults)
    """Decoding settings for requests that leave them unset."""


ALL_MODELS = "*"
DEFAULT_TENANT = "default"


class TenantLimits(Strict):
    """A tenant's share of the service, on top of the server's and the models' bounds (unset:
    none of its own). A request can never raise them; beyond them: 429 `overloaded` with
    Retry-After before any byte (max_new_tokens and max_detection_chars: 422, like the
    model's and the server's limits). With
    `server.workers` > 1 each worker counts what it serves, and enforces 1/N of
    max_concurrent_streams, requests_per_minute and tokens_per_minute (rounded up, at least 1):
    together the workers admit the limit (at most N - 1 more, from rounding), and a tenant whose
    requests land unevenly on the workers may meet one worker's share a little earlier."""

    max_concurrent_streams: int | None = Field(None, ge=1)
    """This tenant's requests served at once (the server's max_concurrent_streams still bounds
    all tenants together)."""
    requests_per_minute: int | None = Field(None, ge=1)
    """Requests per minute, a token bucket refilled continuously (a burst of up to this many)."""
    tokens_per_minute: int | None = Field(None, ge=1)
    """Prompt plus generated tokens per minute, a token bucket refilled continuously: a
    generation request is admitted while the bucket is positive, holds its max_new_tokens plus
    a quarter of its prompt's characters from then on (so requests started together each see
    the others'), and is charged the tokens it spent when it ends."""
    max_new_tokens: int | None = Field(None, ge=1)
    """Largest token budget a request may ask for (under the model's own limit)."""
    max_detection_chars: int | None = Field(None, ge=1)
    """Most characters one detection request may ask to be judged (under the server's
    max_detection_chars; 422 beyond, like it)."""


class TenantConfig(Strict):
    """A caller of the service (a team, an application) and its API keys: the models it sees,
    the guardrails it gets on top of each model's, and its limits. A key belongs to exactly one
    tenant; the keys of `server.api_keys_env` are the tenant `default` (every model, the
    models' guardrails, no limits of its own)."""

    keys_env: str
    """Name of an environment variable holding this tenant's comma-separated API keys."""
    models: list[str] | Literal["*"] = ALL_MODELS
    """The model ids it may use (`*`: every model); any other model is 404 for it, exactly
    like a model that does not exist, and is not listed in /v1/models."""
    guardrails: dict[str, ModelGuardrails] = Field(default_factory=dict)
    """Detectors enforced on this tenant's requests, by model id (`*`: every model), added to
    the model's own: they can tighten a model's guardrail (a stricter on_detection, a lower
    threshold), never loosen it; a request can only add to both. An entry for a detector the
    model (or the tenant's `*` entry) already enforces gives no detector params of its own, or
    the same ones: one detector judges with one set of params."""
    limits: TenantLimits = Field(default_factory=TenantLimits)
    """This tenant's limits."""

    @field_validator("models", mode="before")
    @classmethod
    def _models(cls, v: Any) -> Any:
        if v == ALL_MODELS or (isinstance(v, list) and all(isinstance(m, str) for m in v)):
            return v
        raise ValueError('must be "*" (every model) or a list of model ids')


class DetectorConfig(Strict):
    """A detector, keyed by the detector_id clients name: a built-in running in the orchestrator,
    or a remote service speaking the detector API (exactly one of `builtin` and `url`)."""

    type: Literal[
        "text_contents",
        "text_generation",
        "text_chat",
        "text_context_doc",
        "openai_judge",
        "engine_judge",
    ] = "text_contents"
    """The detector API it speaks: `text_contents` (input and output text, the content
    endpoints; every built-in), or a kind of the FMS detection endpoints, served by a remote
    detector: `text_chat` (/api/v2/text/detection/chat), `text_context_doc` (.../context),
    `text_generation` (.../generated and /api/v2/text/generation-detection); or `openai_judge`:
    a safety model (Llama Guard, Granite Guardian, ShieldGemma, any instruct model zero-shot)
    behind an OpenAI-compatible server at `url`, judging text like a `text_contents`
    classifier (README "Judge detectors"); or `engine_judge`: the same on our own engine, judged
    incrementally (a judge session per stream keeps the judged text in the engine's KV rows, so
    a chunk costs its own tokens and the template's tail, not the whole answer again)."""
    builtin: str | None = None
    """An in-process built-in: `regex`, `profanity`, `prompt_injection`, `topic`,
    `hf_classifier` (its settings go in `params`)."""
    url: str | None = None
    """A remote detector service's base URL (http:// or https://)."""
    chunker_id: str = WHOLE_DOC_CHUNKER
    """The chunker that cuts text for it: a configured chunker or the built-in
    `whole_doc_chunker` (the whole text, at the end of a stream)."""
    default_threshold: float = Field(0.5, ge=0, le=1)
    """A detection is kept when score >= threshold (a request's `threshold`, else this)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Built-in settings (e.g. `patterns`, `topics`, `model_path`), and default detector_params
    merged under a request's."""
    timeout_s: float = Field(10, gt=0)
    """How long one call may take before the request fails with `detector_error`."""
    on_detection: Literal["annotate", "block", "redact"] = "annotate"
    """What a detection does: `annotate` (reported), `block` (the stream stops, no flagged text
    leaves), `redact` (the flagged text is replaced by redact_with and the stream goes on)."""
    redact_with: StrictStr = Field(DEFAULT_REDACT_WITH, max_length=MAX_REDACT_WITH)
    """The replacement of each redacted span: a fixed string or a template with {entity} (the
    detection's name: `[{entity}]` gives `[email]`)."""
    api_key_env: str | None = None
    """Name of an environment variable holding a remote detector service's key, sent as a Bearer
    token."""
    applies_to: list[Literal["text", "tool_calls"]] = Field(
        default_factory=lambda: ["text", "tool_calls"], min_length=1
    )
    """What of the model's output it judges as an output detector: `text` (the answer's
    content) and `tool_calls` (the strings, keys and values, and the numbers of each tool
    call's arguments, DESIGN 4.8). Config only: a request cannot narrow it, so an enforced guardrail judges tool calls
    whatever the request says. Input detection judges every message (tool results included)."""
    judges: Literal["spans", "chunks"] | None = None
    """What its detections are: `spans`, entities inside the content (redaction must see each
    whole: judged over overlapping windows), or `chunks`, a classifier's verdict on the chunk it
    was given (it redacts that chunk, judged alone). Built-ins know their own; a remote detector
    is taken for a span detector unless this says `chunks`."""
    tls: ClientTlsConfig | None = None
    """TLS options for an https:// detector service."""
    cache: bool | None = None
    """Whether `detection_cache` keeps this detector's input verdicts. Unset: yes for an
    in-process built-in (its reply is a function of the text and params alone), no for a
    remote service (it may change under us); `true` opts a remote one in, `false` a built-in
    out. A judge never: its verdict reads the conversation around the text."""
    model: str | None = None
    """`openai_judge`: the model name the server knows (what it lists in /v1/models)."""
    template: str | None = None
    """`openai_judge`: the judge's prompt: a shipped template (`llama_guard`, `yes_no` for
    Granite Guardian/ShieldGemma-style yes/no questions, `zero_shot` for any instruct model,
    `classify` for a small model completing a "Label:") or
    an inline Jinja template (sandboxed; variables: `messages`, `role`, `prefix`, `chunk`,
    `text`, `categories` and the keys of `params`)."""
    api: Literal["completions", "chat"] | None = None
    """`openai_judge`: `completions` (the rendered template is the prompt; default) or `chat`
    (it is the one user message, for a server that only chats)."""
    unsafe_tokens: list[StrictStr] | None = Field(None, min_length=1)
    """`openai_judge`: the answer words that mean unsafe (default: the shipped template's;
    required with an inline template). The score is their probability over the safe and unsafe
    words at the answer's first token, from the server's logprobs, else 1.0 when the answer's
    first word is one of them."""
    safe_tokens: list[StrictStr] | None = Field(None, min_length=1)
    """`openai_judge`: the answer words that mean safe (see unsafe_tokens)."""
    categories: dict[str, StrictStr] | None = None
    """`openai_judge`: category code -> name (`{S1: Violent Crimes}`): the codes on the
    answer's second line (Llama Guard's `S1,S10`) become the detection's entity, the names
    joined by commas; the `llama_guard` template lists them as its policy (default: Llama
    Guard 3's fourteen). Only these codes are read from the answer: anything else on its line
    is dropped (the judge read the text it judges, and could quote it there)."""
    on_error: Literal["block", "annotate"] | None = None
    """`openai_judge`: what a judge that fails (an HTTP error, unreachable, a reply that is no
    verdict, over timeout_s) does: `block` (default: the request fails as for any detector
    error, and the text it did not judge never leaves) or `annotate` (the text flows, with an
    `unjudged` detection of type `judge_error` on it). Either way it counts as an `error` in
    guardstream_detector_calls."""
    replicas: int | None = Field(None, ge=1, le=64)
    """`engine_judge` with `model`: engine processes the orchestrator starts for the judge
    (default 1); a session whose engine dies is rebuilt on another from its text."""
    device: Literal["auto", "cpu", "cuda"] | None = None
    """`engine_judge` with `model`: where its engines run (default `auto`)."""
    urls: list[StrictStr] | None = Field(None, min_length=1)
    """`engine_judge`: engines already running (`python -m generation serve`), instead of a
    `model` the orchestrator starts (their key: `api_key_env`)."""


class DetectionCacheConfig(Strict):
    """Input verdicts kept per tenant (DESIGN 4.5): a chat client sends the whole conversation
    again every turn, and input detectors judge every message, so each turn would judge the
    earlier messages again, with the same result. A detector's reply to a content is kept under
    the hash of the content (never the text), the detector and everything that can change its
    reply (its config entry, the params sent); only the new contents reach the detector. Each
    tenant has a partition of its own (another tenant's text never answers a lookup), least
    recently used entries go first."""

    enabled: bool = True
    """Keep input verdicts (false: every input content is sent to its detectors)."""
    max_entries_per_tenant: int = Field(10_000, ge=1)
    """Contents one tenant's partition holds, over all its detectors (a 20-turn conversation
    with 3 detectors is about 60 to a few hundred entries; an entry without detections is
    about 140 bytes, one with detections at most ~1.5 KB)."""
    max_entries: int = Field(100_000, ge=1)
    """Contents all partitions hold together; beyond it the largest partition gives up its
    least recently used entry (a busy tenant cannot push out a quiet one's conversations)."""


class Config(Strict):
    """config.yaml."""

    # the file it was read from (load_config): what SIGHUP and /admin/reload read again; and
    # what that file said, where this config was derived from it (a worker's)
    _source: str | None = PrivateAttr(default=None)
    _as_read: Config | None = PrivateAttr(default=None)

    server: ServerConfig = Field(default_factory=ServerConfig)
    """The HTTP service."""
    models: dict[str, ModelConfig] = Field(default_factory=dict)
    """Generation models, keyed by the model_id clients send."""
    chunkers: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Chunkers, keyed by chunker_id (`whole_doc_chunker` is reserved and built in)."""
    detectors: dict[str, DetectorConfig] = Field(default_factory=dict)
    """Detectors, keyed by the detector_id clients name."""
    tenants: dict[str, TenantConfig] = Field(default_factory=dict)
    """Callers with their own keys, models, guardrails and limits, keyed by tenant id (the id
    in metrics, logs and the x-guardstream-tenant header)."""
    detection_cache: DetectionCacheConfig = Field(default_factory=DetectionCacheConfig)
    """Input verdicts kept per tenant, so a conversation sent again judges only its new text."""

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
    config: Config,
    present_detectors: set[str] | None = None,
    require_models: bool = False,
    present_models: set[str] | None = None,
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
        if det.type in JUDGE_TYPES:
            errors.extend(judge_errors(path, det))
        else:
            errors.extend(
                f"{path}.{name}: only a detector of type openai_judge or engine_judge takes it"
                for name in JUDGE_FIELDS
                if getattr(det, name) is not None
            )
        if det.type != ENGINE_JUDGE_TYPE:
            errors.extend(
                f"{path}.{name}: only a detector of type engine_judge takes it"
                for name in ENGINE_JUDGE_FIELDS
                if getattr(det, name) is not None
            )
        if det.cache and det.type in JUDGE_TYPES:
            errors.append(
                f"{path}.cache: a judge's verdicts are never cached (its verdict reads the "
                "conversation around the text, not the text alone)"
            )
        if det.type not in JUDGE_TYPES and (det.builtin is None) == (det.url is None):
            errors.append(f"{path}: exactly one of 'builtin' and 'url' is required")
        if det.builtin is not None and det.type not in ("text_contents", *JUDGE_TYPES):
            errors.append(
                f"{path}.type: a built-in detector speaks text_contents (the other kinds are "
                "remote detectors'; a built-in serves chat and generated detection as it is)"
            )
        if det.builtin is not None:
            if det.builtin not in detectors.BUILTINS:
                errors.append(
                    f"{path}.builtin: unknown built-in detector '{det.builtin}'"
                    + did_you_mean(det.builtin, detectors.BUILTINS)
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
            errors.append(
                f"{path}.chunker_id: unknown chunker '{det.chunker_id}'"
                + did_you_mean(det.chunker_id, [*config.chunkers, WHOLE_DOC_CHUNKER])
            )
    for model_id, model in config.models.items():
        errors.extend(
            _guardrail_errors(
                config, f"models.{model_id}.guardrails", model.guardrails, present_detectors
            )
        )
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
    errors.extend(tenant_errors(config, present_models))
    return errors


def _guardrail_errors(
    config: Config, where: str, guardrails: Any, present_detectors: set[str] | None
) -> list[str]:
    """A guardrails section (a model's, a tenant's): known text detectors, valid params."""
    errors: list[str] = []
    for direction in ("input", "output"):
        enforced: dict[str, dict[str, Any]] = getattr(guardrails, direction)
        for detector_id, params in enforced.items():
            path = f"{where}.{direction}.{detector_id}"
            det = config.detectors.get(detector_id)
            if det is None:
                if detector_id not in (present_detectors or set()):
                    errors.append(
                        f"{path}: unknown detector '{detector_id}'"
                        + did_you_mean(detector_id, config.detectors)
                    )
            elif det.type not in TEXT_TYPES:
                errors.append(f"{path}: detector type '{det.type}' cannot judge text")
            if not isinstance(params, dict):
                errors.append(f"{path}: must be a mapping of detector params")
                continue
            action = params.get("on_detection")
            if action not in (None, "annotate", "block", "redact"):
                errors.append(
                    f"{path}.on_detection: must be annotate, block or redact"
                    + closest(action, ("annotate", "block", "redact"))
                )
            errors.extend(_redact_with_errors(params, path))
            errors.extend(_threshold_errors(f"{path}.threshold", params.get("threshold")))
    return errors


def tenant_errors(config: Config, present_models: set[str] | None = None) -> list[str]:
    """References of the `tenants:` section: known models, one owner per key variable, and the
    tenant `default` left to `server.api_keys_env`. `present_models`: models whose own entry
    failed the schema (reported there)."""
    errors: list[str] = []
    known = set(config.models) | (present_models or set())
    owners: dict[str, str] = {}
    if config.server.api_keys_env:
        owners[config.server.api_keys_env] = "server.api_keys_env"
        if DEFAULT_TENANT in config.tenants:
            errors.append(
                f"tenants.{DEFAULT_TENANT}: reserved: the keys of server.api_keys_env are the "
                f"tenant '{DEFAULT_TENANT}' (name this tenant otherwise, or drop api_keys_env)"
            )
    for tenant_id, tenant in config.tenants.items():
        path = f"tenants.{tenant_id}"
        if tenant.keys_env in owners:
            errors.append(
                f"{path}.keys_env: {tenant.keys_env} already holds the keys of "
                f"{owners[tenant.keys_env]} (a key belongs to exactly one tenant)"
            )
        owners.setdefault(tenant.keys_env, path)
        visible = known if tenant.models == ALL_MODELS else set(tenant.models)
        if tenant.models != ALL_MODELS:
            for i, model_id in enumerate(tenant.models):
                if model_id not in known:
                    errors.append(
                        f"{path}.models.{i}: unknown model '{model_id}'"
                        + did_you_mean(model_id, config.models)
                    )
        for model_id, guardrails in tenant.guardrails.items():
            where = f"{path}.guardrails.{model_id}"
            if model_id != ALL_MODELS and model_id not in known:
                errors.append(
                    f"{where}: unknown model '{model_id}'"
                    + did_you_mean(model_id, [*config.models, ALL_MODELS])
                )
            elif model_id != ALL_MODELS and model_id not in visible:
                errors.append(f"{where}: '{model_id}' is not among this tenant's models")
            errors.extend(_guardrail_errors(config, where, guardrails, None))
        errors.extend(_merged_params_errors(config, tenant_id, visible))
    return errors


def _detector_params(params: Any) -> dict[str, Any]:
    """A guardrail entry's detector params: what is forwarded to the detector."""
    if not isinstance(params, dict):
        return {}
    return {k: v for k, v in params.items() if k not in ORCHESTRATOR_PARAM_KEYS}


def _merged_params_errors(config: Config, tenant_id: str, visible: set[str]) -> list[str]:
    """A tenant's entry for a detector that already judges the same requests (the model's
    guardrail, or the tenant's own `*` entry) merges into it (tenants.py, `tightened_by`): the
    threshold, action and replacement tighten, and one set of detector params judges. Params of
    its own that differ would be dropped in silence (a tenant's `pii` for phone numbers judged
    with the model's e-mails only), so they are an error."""
    tenant = config.tenants[tenant_id]
    path = f"tenants.{tenant_id}.guardrails"
    errors: list[str] = []
    seen: set[str] = set()
    for model_id in sorted(visible & set(config.models)):
        layers = [(f"models.{model_id}.guardrails", config.models[model_id].guardrails)]
        for key in (ALL_MODELS, model_id):
            if key in tenant.guardrails:
                layers.append((f"{path}.{key}", tenant.guardrails[key]))
        for direction in ("input", "output"):
            first: dict[str, tuple[str, dict[str, Any]]] = {}
            for where, guardrails in layers:
                for detector_id, entry in getattr(guardrails, direction).items():
                    params = _detector_params(entry)
                    at = f"{where}.{direction}.{detector_id}"
                    have = first.setdefault(detector_id, (at, params))
                    if have[0] == at or not params or params == have[1]:
                        continue
                    line = (
                        f"{at}: detector params {json.dumps(params)} differ from "
                        f"{json.dumps(have[1])} of {have[0]}, which judges the same requests "
                        "(one detector judges with one set of params: give them once, or only "
                        "threshold, on_detection and redact_with here)"
                    )
                    if line not in seen:
                        seen.add(line)
                        errors.append(line)
    return errors


def judge_errors(path: str, det: DetectorConfig) -> list[str]:
    """What an `openai_judge` entry needs: a server, a model, a template that exists (or
    compiles) and answer words for it, never a built-in."""
    errors: list[str] = []
    if det.type == ENGINE_JUDGE_TYPE:
        errors.extend(_engine_judge_errors(path, det))
    else:
        if det.builtin is not None:
            errors.append(f"{path}.builtin: a judge is a model behind `url`, not a built-in")
        if det.url is None:
            errors.append(f"{path}.url: a judge needs the OpenAI-compatible server's base URL")
        if det.model is None:
            errors.append(f"{path}.model: a judge needs the model name its server knows")
    if det.judges == "spans":
        errors.append(f"{path}.judges: a judge judges chunks (its verdict is on the whole chunk)")
    if det.template is None:
        errors.append(
            f"{path}.template: a judge needs a template: "
            f"{', '.join(sorted(judge_templates.SHIPPED))} or an inline Jinja template"
        )
        return errors
    problem = judge_templates.template_problem(det.template)
    if problem is not None:
        errors.append(f"{path}.template: {problem}")
    elif judge_templates.is_inline(det.template):
        for name in ("unsafe_tokens", "safe_tokens"):
            if getattr(det, name) is None:
                errors.append(f"{path}.{name}: required with an inline template")
    shipped = judge_templates.SHIPPED.get(det.template)
    unsafe = det.unsafe_tokens or (shipped.unsafe_tokens if shipped else ())
    safe = det.safe_tokens or (shipped.safe_tokens if shipped else ())
    for name, words in (("unsafe_tokens", unsafe), ("safe_tokens", safe)):
        if any(not w.strip() for w in words):
            errors.append(f"{path}.{name}: an answer word cannot be blank")
    both = {w.strip().lower() for w in unsafe} & {w.strip().lower() for w in safe}
    if both:
        errors.append(
            f"{path}.safe_tokens: {', '.join(sorted(both))} cannot mean both safe and unsafe"
        )
    return errors


def _engine_judge_errors(path: str, det: DetectorConfig) -> list[str]:
    """An `engine_judge` runs on engines: a `model` the orchestrator starts, or `urls` of
    running ones (exactly one); its template must leave the judged text whole (`{{ text }}`
    once), since the text grows between the template's head and tail. The `api` of a
    server does not apply."""
    errors: list[str] = []
    if det.builtin is not None or det.url is not None:
        name = "builtin" if det.builtin is not None else "url"
        errors.append(f"{path}.{name}: an engine judge names `model` (started here) or `urls`")
    if (det.model is None) == (det.urls is None):
        errors.append(f"{path}: exactly one of 'model' and 'urls' is required")
    if det.urls is not None:
        errors.extend(
            f"{path}.urls.{i}: '{u}' is not an http(s) URL"
            for i, u in enumerate(det.urls)
            if not u.startswith(("http://", "https://"))
        )
        for name in ("replicas", "device"):
            if getattr(det, name) is not None:
                errors.append(f"{path}.{name}: only with `model` (engines started here)")
    if det.model is not None and (problem := spec_problem(det.model)) is not None:
        errors.append(f"{path}.model: {problem}")
    if det.api is not None:
        errors.append(f"{path}.api: an engine judge speaks the engine's judge sessions")
    if det.template is not None and judge_templates.template_problem(det.template) is None:
        try:
            judge_templates.JudgePrompt(det.template, det.categories, {}).split(
                judge_templates.JudgeContext(), output=True
            )
        except ValueError as exc:
            errors.append(f"{path}.template: {exc}")
        except Exception as exc:  # the sandbox refusing, a filter failing: the config's fault
            errors.append(f"{path}.template: does not render: {exc}")
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
            for message in getattr(exc, "messages", None) or [str(exc)]:
                named = _names_field(message)
                errors.append(f"{path}.{message}" if named else f"{path}: {message}")
    return errors


def _names_field(message: str) -> bool:
    """Chunker errors start with the field name (`max_words: must be >= 1`)."""
    head = message.split(":", 1)[0]
    return bool(head) and " " not in head


def _detector_params(params: dict[str, Any]) -> dict[str, Any]:
    """Params minus the keys the orchestrator consumes itself."""
    return {k: v for k, v in params.items() if k not in ORCHESTRATOR_PARAM_KEYS}


ORCHESTRATOR_PARAM_KEYS = frozenset({"threshold", "on_detection", "redact_with"})


def _format_validation_error(
    exc: ValidationError, root: type[BaseModel] = BaseModel, prefix: tuple[Any, ...] = ()
) -> list[str]:
    """One `yaml.path: message` line per problem; an unknown key or a value outside a fixed set
    names the closest valid one, or lists them all. `prefix`: where `root` sits in the file."""
    lines = []
    for err in exc.errors():
        raw_loc = err["loc"]
        # Discriminated unions insert the tag into the location; it is not a YAML key.
        loc = [str(p) for p in (*prefix, *raw_loc) if p not in ("managed", "native", "openai")]
        if err["type"] == "value_error" and isinstance(
            err.get("ctx", {}).get("error"), ConfigError
        ):
            lines.extend(err["ctx"]["error"].errors)
            continue
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key" + did_you_mean(raw_loc[-1], fields_at(root, raw_loc[:-1]))
        elif err["type"] == "literal_error":
            expected = re.findall(r"'([^']*)'", str(err.get("ctx", {}).get("expected", "")))
            msg += closest(err.get("input"), expected)
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
        errors = _format_validation_error(exc, Config)
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
        """The entry, or what is left of it without the keys the schema rejected (their
        defaults instead): `builtin: profanty` is still checked beside `on_detection: blok`."""
        try:
            return model.model_validate(value)
        except ConfigError:
            return None
        except ValidationError as exc:
            if not isinstance(value, dict):
                return None
            bad = {err["loc"][0] for err in exc.errors() if err["loc"]}
            rest = {k: v for k, v in value.items() if k not in bad}
            try:
                return model.model_validate(rest)
            except (ValidationError, ConfigError):
                return None

    models = {k: m for k, v in section("models").items() if (m := valid(ModelConfig, v))}
    dets = {k: valid(DetectorConfig, v) for k, v in section("detectors").items()}
    tenants = {k: t for k, v in section("tenants").items() if (t := valid(TenantConfig, v))}
    server = valid(ServerConfig, data.get("server", {})) or ServerConfig.model_construct()
    salvaged = Config.model_construct(
        server=server,
        models=models,
        chunkers=section("chunkers"),
        detectors={k: d for k, d in dets.items() if d is not None},
        tenants=tenants,
    )
    # models that are there but failed the schema are reported by it, not as missing
    return cross_reference_errors(
        salvaged, set(dets), require_models and not section("models"), set(section("models"))
    )


def read_yaml(path: str | os.PathLike[str]) -> Any:
    """The parsed YAML document at `path`; ConfigError (never a bare traceback)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"{p}: cannot read: {exc.strerror or exc}"]) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError([f"{p}: invalid YAML: {exc}"]) from None


def load_config(path: str | os.PathLike[str], require_models: bool = False) -> Config:
    """Reads and validates a config file; raises ConfigError (never a bare traceback)."""
    config = parse_config(read_yaml(path), require_models)
    config._source = str(path)
    return config


def config_source(config: Config) -> str | None:
    """The file `config` was read from (None: built in memory)."""
    return config._source


def as_read(config: Config) -> Config:
    """The config as its file said (a worker's runs its managed engines as native backends)."""
    return config._as_read or config


def with_source(config: Config, source: str | None, read: Config | None = None) -> Config:
    """`config`, derived from `read`, which came from the file `source` (a worker's)."""
    config._source = source
    config._as_read = read
    return config


def is_detector_service_config(data: Any) -> bool:
    """The detector service's file (`python -m detectors serve --config`, DESIGN 6): the same
    format, with detectors and neither `models:` nor `chunkers:` (it serves no generation and
    judges whole contents). An orchestrator file without models is still a mistake."""
    return isinstance(data, dict) and "detectors" in data and not {"models", "chunkers"} & set(data)


def secret_env_names(config: Config) -> frozenset[str]:
    """Every environment variable the config names as holding a key (the server's API keys,
    engines' and detector services' keys): what a child process (a managed engine) must not
    inherit, since it needs none of them and a compromised engine would get them all."""
    names = {config.server.api_keys_env, config.server.admin_keys_env}
    for model in config.models.values():
        names.update(getattr(backend, "api_key_env", None) for backend in model.backends)
    names.update(detector.api_key_env for detector in config.detectors.values())
    names.update(tenant.keys_env for tenant in config.tenants.values())
    return frozenset(n for n in names if n)
