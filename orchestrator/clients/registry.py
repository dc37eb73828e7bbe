"""What the config declares, built once at start-up: chunkers and detector clients by id, and the
resolution of a request's `{detector_id: params}` map against them (404/422 before any byte)."""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal, Self

import aiohttp

import chunkers
import detectors

from ..api.errors import invalid, not_found
from ..api.fms_requests import DetectorMap, DetectorParams
from ..config import (
    DEFAULT_REDACT_WITH,
    ENGINE_JUDGE_TYPE,
    JUDGE_TYPE,
    JUDGE_TYPES,
    ORCHESTRATOR_PARAM_KEYS,
    WHOLE_DOC_CHUNKER,
    Config,
    DetectorConfig,
    ModelGuardrails,
    secret_env_names,
)
from .chunk_coverage import CheckedChunker
from .detectors import (
    CallRecorder,
    DetectorClient,
    HttpDetectorClient,
    InProcessDetectorClient,
)
from .engine_judge import EngineJudgeClient
from .judges import JudgeDetectorClient
from .tls import client_ssl_context


@dataclass(frozen=True, slots=True)
class RequestedDetector:
    """A detector as one request uses it: effective threshold, action and forwarded params."""

    detector_id: str
    client: DetectorClient
    chunker_id: str
    threshold: float
    on_detection: Literal["annotate", "block", "redact"]
    params: dict[str, Any]
    redact_with: str = DEFAULT_REDACT_WITH
    # a model's guardrail (DESIGN 1, 3): it judges the whole input and output, whatever the
    # request says (masks narrow only the request's own detectors)
    enforced: bool = False
    # a classifier, not a span detector (DetectorClient.judges_chunks)
    judges_chunks: bool = False
    # the detector API it speaks (config `type`): text_contents, or a kind of the FMS
    # detection endpoints (text_chat, text_context_doc, text_generation)
    kind: str = "text_contents"
    # what of the output it judges as an output detector (config `applies_to`)
    applies_to: tuple[str, ...] = ("text", "tool_calls")

    @property
    def whole_doc(self) -> bool:
        return self.chunker_id == WHOLE_DOC_CHUNKER

    @property
    def blocking(self) -> bool:
        return self.on_detection == "block"

    @property
    def redacting(self) -> bool:
        return self.on_detection == "redact"

    def replacement(self, entity: str) -> str:
        """What replaces a span this detector flagged as `entity`. A plain substitution, not
        `str.format`: a template is text, and braces in it are not an attack surface."""
        return self.redact_with.replace("{entity}", entity)


class ChunkerRegistry:
    """Configured chunkers by id, plus the reserved `whole_doc_chunker`. `keep`: chunkers
    already built (a reload's unchanged ones), used as they are."""

    def __init__(
        self, settings: dict[str, dict[str, Any]], keep: Mapping[str, Any] | None = None
    ) -> None:
        keep = keep or {}
        self._chunkers: dict[str, Any] = {
            cid: keep[cid] if cid in keep else chunkers.build(s) for cid, s in settings.items()
        }
        self._chunkers[WHOLE_DOC_CHUNKER] = chunkers.build({"type": "whole_doc"})

    def get(self, chunker_id: str) -> Any:
        """The chunker, its chunks checked to tile the text (`CheckedChunker`)."""
        return CheckedChunker(self._chunkers[chunker_id])

    def ids(self) -> list[str]:
        return list(self._chunkers)


class DetectorRegistry:
    """Detector clients by configured id; in-process built-ins share model loads."""

    def __init__(
        self,
        config: Config,
        session: aiohttp.ClientSession,
        *,
        device: str = "auto",
        on_call: CallRecorder | None = None,
        keep: Mapping[str, DetectorClient] | None = None,
    ) -> None:
        """`on_call` hears of every detector call (the metrics); `keep`: clients already built
        (a reload's unchanged detectors), used as they are: their models are not loaded again."""
        extra: dict[str, CallRecorder] = {"on_call": on_call} if on_call is not None else {}
        self._configs: dict[str, DetectorConfig] = dict(config.detectors)
        self._clients: dict[str, DetectorClient] = {}
        for detector_id, det in self._configs.items():
            if keep is not None and detector_id in keep:
                self._clients[detector_id] = keep[detector_id]
            elif det.builtin is not None:
                params = {k: v for k, v in det.params.items() if k not in ORCHESTRATOR_PARAM_KEYS}
                built = detectors.build(det.builtin, params, device=device)
                self._clients[detector_id] = InProcessDetectorClient(
                    detector_id, det, built, **extra
                )
            else:
                ctx: ssl.SSLContext | bool | None = client_ssl_context(
                    det.tls, where=f"detectors.{detector_id}.tls"
                )
                if det.type == ENGINE_JUDGE_TYPE:
                    self._clients[detector_id] = EngineJudgeClient(
                        detector_id, det, session, hidden_env=secret_env_names(config), **extra
                    )
                    continue
                remote = JudgeDetectorClient if det.type == JUDGE_TYPE else HttpDetectorClient
                self._clients[detector_id] = remote(
                    detector_id, det, session, ssl_context=ctx, **extra
                )

    def clients(self) -> dict[str, DetectorClient]:
        return dict(self._clients)

    def resolve(
        self,
        requested: DetectorMap,
        direction: str,
        path: str,
        *,
        kinds: tuple[str, ...] = ("text_contents",),
        fms_wording: bool = False,
    ) -> list[RequestedDetector]:
        """Turns a request's detector map into RequestedDetectors, sorted by id; raises the API's
        404 for an unknown id and 422 for a detector whose type is not one of `kinds`.
        `fms_wording`: the FMS orchestrator's exact texts (its detection endpoints), which
        clients written against it may compare."""
        out: list[RequestedDetector] = []
        for detector_id in sorted(requested):
            params = requested[detector_id]
            det = self._configs.get(detector_id)
            if det is None:
                hint = f" (available: {', '.join(sorted(self._configs)) or 'none'})"
                raise not_found(f"detector `{detector_id}` not found{'' if fms_wording else hint}")
            # a judge judges text as a text_contents classifier does
            kind = "text_contents" if det.type in JUDGE_TYPES else det.type
            if kind not in kinds:
                if fms_wording:
                    raise invalid(f"detector `{detector_id}` is not supported by this endpoint")
                raise invalid(
                    f"detector `{detector_id}` is of type `{det.type}` and cannot be used "
                    f"for {direction} detection (only `text_contents` detectors can)"
                )
            threshold = params.threshold
            if threshold is None:
                threshold = float(det.params.get("threshold", det.default_threshold))
            forwarded = params.detector_params()
            for key in ORCHESTRATOR_PARAM_KEYS:
                forwarded.pop(key, None)
            if det.type in JUDGE_TYPES and forwarded:
                # a judge's template and its variables come from the config, never a request
                raise invalid(
                    f"{path}.{detector_id}: a judge takes no detector params "
                    f"(got {', '.join(sorted(forwarded))}; its prompt comes from the config)"
                )
            if det.builtin is not None and forwarded:
                # only what the built-in declares request-settable, checked before anything is
                # merged: no path, no batching setting, no regex unless the config allows it
                try:
                    detectors.validate_request_params(det.builtin, det.params, forwarded)
                except ValueError as exc:
                    raise invalid(f"{path}.{detector_id}: {exc}") from None
            out.append(
                RequestedDetector(
                    detector_id=detector_id,
                    client=self._clients[detector_id],
                    chunker_id=det.chunker_id,
                    threshold=threshold,
                    # the content endpoints judge text the client already has: nothing to withhold
                    on_detection="annotate"
                    if direction == "content"
                    else (params.on_detection or det.on_detection),
                    params=forwarded,
                    redact_with=params.redact_with
                    if params.redact_with is not None
                    else str(det.params.get("redact_with", det.redact_with)),
                    judges_chunks=self._clients[detector_id].judges_chunks,
                    kind=kind,
                    applies_to=tuple(det.applies_to),
                )
            )
        return out

    async def start(self) -> None:
        """Start what detectors run themselves (an engine judge's managed engines)."""
        for client in self._clients.values():
            if isinstance(client, EngineJudgeClient):
                await client.start()

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()


# how strict an action is: a tenant's guardrail may move a model's up this scale, never down
SEVERITY = {"annotate": 0, "redact": 1, "block": 2}


@dataclass(frozen=True)
class EnforcedGuardrails:
    """A model's enforced detectors (config `guardrails`), resolved once at start-up with the
    model's backends: a request can add detectors; it can never remove or weaken these
    (DESIGN 3). A tenant's are added the same way (`tightened_by`)."""

    input: tuple[RequestedDetector, ...] = ()
    output: tuple[RequestedDetector, ...] = ()

    @classmethod
    def of_models(cls, config: Config, registry: DetectorRegistry) -> dict[str, EnforcedGuardrails]:
        return {
            model_id: cls.of(registry, model.guardrails, f"models.{model_id}.guardrails")
            for model_id, model in config.models.items()
        }

    @classmethod
    def of(cls, registry: DetectorRegistry, guardrails: ModelGuardrails, path: str) -> Self:
        """A guardrails section of the config (a model's, a tenant's), resolved."""
        return cls(
            input=_enforced(registry, guardrails.input, "input", f"{path}.input"),
            output=_enforced(registry, guardrails.output, "output", f"{path}.output"),
        )

    def tightened_by(self, other: EnforcedGuardrails) -> EnforcedGuardrails:
        """These guardrails plus `other`'s: a detector in both keeps the stricter action (block
        over redact over annotate, with that action's replacement) and the lower threshold, so
        `other` can only tighten (a tenant's guardrails on a model's)."""
        return EnforcedGuardrails(
            input=_tightened(self.input, other.input), output=_tightened(self.output, other.output)
        )


def _tightened(
    base: tuple[RequestedDetector, ...], extra: tuple[RequestedDetector, ...]
) -> tuple[RequestedDetector, ...]:
    merged = {d.detector_id: d for d in base}
    for d in extra:
        have = merged.get(d.detector_id)
        if have is None:
            merged[d.detector_id] = d
            continue
        stricter = d if SEVERITY[d.on_detection] > SEVERITY[have.on_detection] else have
        merged[d.detector_id] = replace(
            have,
            on_detection=stricter.on_detection,
            redact_with=stricter.redact_with,
            threshold=min(have.threshold, d.threshold),
        )
    return tuple(merged[k] for k in sorted(merged))


def _enforced(
    registry: DetectorRegistry, configured: dict[str, dict[str, object]], direction: str, path: str
) -> tuple[RequestedDetector, ...]:
    if not configured:
        return ()
    resolved = registry.resolve(
        {k: DetectorParams.model_validate(v) for k, v in configured.items()}, direction, path
    )
    return tuple(replace(d, enforced=True) for d in resolved)
