"""The detector interface every built-in implements, its errors, and params validation.

Params are validated with pydantic models (strict types, unknown keys rejected) so that a typo in a
config or a request is an error naming the parameter, never a silently ignored setting.

Config params and request params are validated differently (DESIGN 4, 6): a request's
detector_params may only set what the detector declares request-settable (`REQUEST_PARAMS`);
everything else (model folders, batching, custom regexes unless the config allows them) is
config-only, and a request naming it is refused before anything is merged, loaded or opened.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .api import Detection

# the errors live in errors.py (batching.py raises them too); imported from here as ever
from .errors import DetectorError as DetectorError
from .errors import InvalidParams as InvalidParams
from .errors import Overloaded as Overloaded

if TYPE_CHECKING:
    from .batching import MicroBatcher


def param_error_lines(prefix: str, exc: ValueError) -> list[str]:
    """`prefix.loc: message` per problem (`detectors.pii.params.patterns.x: ...`); any other
    ValueError is one `prefix: message` line."""
    problems = exc.problems if isinstance(exc, InvalidParams) else [("", str(exc))]
    return [f"{prefix}.{loc}: {msg}" if loc else f"{prefix}: {msg}" for loc, msg in problems]


class DetectorParams(BaseModel):
    """Base of every detector's params: strict types, unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class BatchingParams(DetectorParams):
    """Micro-batching settings of a model-backed detector; config-only (they take effect when
    the detector is built). `max_wait_ms` is accepted so existing configs still load, but has no
    effect: an idle model is called at once, and batches form from the requests that queue
    while it is busy (see batching.py). Batches are filled round-robin across requests;
    `max_queue` counts each waiting request's share of the next batch (at most
    `max_batch_size`), not its whole backlog, so one huge request only waits for itself."""

    batching: bool = True
    max_batch_size: int = Field(32, ge=1, le=4096)
    max_wait_ms: float = Field(0.0, ge=0, le=10_000)
    max_queue: int = Field(1024, ge=1, le=10_000_000)


class ScoredParams(BatchingParams):
    """Params of classifier-style detectors (one whole-content detection with a model score).

    Thresholding is the orchestrator's job (`score >= threshold`). To keep every clean sentence
    from coming back as a 0.01 detection, a detection is returned only when its score reaches
    `min_score`, or `threshold` when a caller of the detector service sets one (server-side
    filtering, as FMS detectors accept).
    """

    min_score: float = Field(0.1, ge=0, le=1)
    threshold: float | None = Field(None, ge=0, le=1)

    @property
    def floor(self) -> float:
        return self.min_score if self.threshold is None else self.threshold


BATCHING_KEYS = frozenset(BatchingParams.model_fields)
# Request-settable params of every classifier-style detector (ScoredParams).
SCORED_REQUEST_PARAMS = frozenset({"min_score", "threshold"})

P = TypeVar("P", bound=BaseModel)


def validation_problems(exc: ValidationError, model: type[BaseModel]) -> list[tuple[str, str]]:
    """(field.path, message) for each problem, in the order pydantic found them."""
    problems: list[tuple[str, str]] = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "params"
        if err["type"] == "extra_forbidden":
            known = ", ".join(sorted(model.model_fields))
            problems.append((loc, f"unknown parameter (expected one of: {known})"))
        else:
            msg = err["msg"]
            if msg.startswith("Value error, "):
                msg = msg[len("Value error, ") :]
            problems.append((loc, msg))
    return problems


def format_validation_error(exc: ValidationError, model: type[BaseModel]) -> str:
    """`field.path: message` for each problem, joined with "; "."""
    return "; ".join(f"{loc}: {msg}" for loc, msg in validation_problems(exc, model))


def parse_params(model: type[P], params: Mapping[str, Any] | None) -> P:
    """Validates `params` against `model`; InvalidParams names every bad parameter."""
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise InvalidParams(f"params: must be an object, got {type(params).__name__}")
    try:
        return model.model_validate(dict(params))
    except ValidationError as exc:
        problems = validation_problems(exc, model)
        message = "; ".join(f"{loc}: {msg}" for loc, msg in problems)
        raise InvalidParams(message, problems) from None


# Keys of a config entry's params that the orchestrator consumes itself (DESIGN 3): they never
# reach a detector built from that entry.
ORCHESTRATOR_PARAM_KEYS = frozenset({"threshold", "on_detection"})


class Detector(ABC):
    """A built-in detector. `detect` judges contents independently; spans are relative to each
    content. A request's params (only the `REQUEST_PARAMS` ones) are merged shallowly over the
    params the detector was built with."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    Params: ClassVar[type[DetectorParams]] = DetectorParams
    # What a request's detector_params may set; every other param is config-only.
    REQUEST_PARAMS: ClassVar[frozenset[str]] = frozenset()
    # A span detector finds entities inside a content (their spans are what redaction replaces,
    # so it must see each entity whole); any other detector is a classifier that judges each
    # content whole (DESIGN 4.6a: it redacts exactly the chunk it was given, judged alone).
    finds_spans: ClassVar[bool] = False

    def __init__(self, params: Mapping[str, Any] | None = None, *, device: str = "auto") -> None:
        self._raw_params: dict[str, Any] = dict(params or {})
        self.params = self.parse_params(self._raw_params)
        self.device = device

    @property
    def config_params(self) -> dict[str, Any]:
        """The params the detector was built with (its config's), as given."""
        return dict(self._raw_params)

    @classmethod
    def parse_params(cls, params: Mapping[str, Any] | None) -> Any:
        """Validated config params; subclasses add checks that need more than types (reading a
        model's config.json, compiling patterns), never a model load."""
        return parse_params(cls.Params, params)

    @classmethod
    def request_param_names(cls, config: Mapping[str, Any]) -> frozenset[str]:
        """The params a request may set on a detector built from `config`."""
        return cls.REQUEST_PARAMS

    @classmethod
    def validate_request(cls, config: Mapping[str, Any], request: Any) -> Any:
        """The params a request gets: `request` checked against the allowlist first (nothing
        merged, nothing opened), then merged over `config` and validated by pydantic alone.
        Subclasses add checks of request values (compiling request patterns, label names)
        that never touch a path a request could influence. InvalidParams names the problem."""
        if request is None:
            request = {}
        if not isinstance(request, Mapping):
            raise InvalidParams(f"detector_params: must be an object, got {type(request).__name__}")
        allowed = cls.request_param_names(config)
        problems: list[tuple[str, str]] = []
        for key in request:
            if key in allowed:
                continue
            settable = ", ".join(sorted(allowed)) or "nothing"
            if key in cls.Params.model_fields:
                problems.append(
                    (str(key), f"set in the detector's config only (a request may set: {settable})")
                )
            else:
                problems.append((str(key), f"unknown parameter (a request may set: {settable})"))
        if problems:
            message = "; ".join(f"{loc}: {msg}" for loc, msg in problems)
            raise InvalidParams(message, problems)
        return parse_params(cls.Params, {**config, **request})

    def check_request(self, params: Mapping[str, Any] | None) -> Any:
        """`validate_request` against this detector's own config params."""
        return self.validate_request(self._raw_params, params)

    def effective_params(self, params: Mapping[str, Any] | None) -> Any:
        """The built params with a request's params merged over them, validated."""
        if params is None or (isinstance(params, Mapping) and not params):
            return self.params
        return self.check_request(params)

    def crosses_natural_cuts(self, params: Mapping[str, Any] | None) -> bool:
        """Whether a span this detector finds with a request's `params` may cross a natural cut
        (`chunkers.base.natural_cut`: whitespace after a sentence end, or a line break). True
        unless a detector proves otherwise: the orchestrator then judges a seam window across
        every chunk boundary, not only across the cuts that are not natural (a name such as
        "Dr. Smith" or an address with "St. " in it crosses a sentence end)."""
        return True

    @abstractmethod
    async def detect(
        self, contents: list[str], params: dict[str, Any] | None = None
    ) -> list[list[Detection]]:
        """One list of detections per content, in order ([] for none)."""

    def open_tail(
        self, text: str, params: dict[str, Any] | None = None, *, cut: bool = False
    ) -> Detection | None:
        """A span detector's verdict on a text that ended early (a stream cut by a stop
        sequence or a token budget, DESIGN 4.6a): the tail that could still grow into a match,
        as a detection of what it would be; None for none. `cut`: the model did not end the
        answer (a budget, a stop sequence): any beginning of an entity past its first group
        counts, not only one with an open stream's evidence. Cheap (a bounded tail, no model),
        so callers may ask on the event loop. Classifiers judge what they got: None."""
        return None

    def held_from(self, text: str, at: int, params: dict[str, Any] | None = None) -> int | None:
        """Where an entity that may go on across `at` starts, when a stream's window of `text`
        is cut there: what lies from it on must not be released yet (DESIGN 4.6a), though a
        seam window's reach (SEAM_CHARS) ends before the entity would; None for none. Cheap
        (a bounded stretch, no model). Most detectors: None (a window's reach covers their
        entities)."""
        return None

    async def warmup(self) -> None:
        """Loads models now rather than on the first request (the service calls it at start)."""
        return None

    async def close(self) -> None:
        """Stops background work; shared model weights stay cached for other detectors."""
        return None

    @property
    def batcher(self) -> MicroBatcher[Any, Any] | None:
        """The micro-batcher of a model-backed detector, None for the others."""
        return None

    @property
    def forward_passes(self) -> int:
        """Batched model calls so far (0 for detectors without a model)."""
        return self.batcher.forward_passes if self.batcher is not None else 0

    def describe(self) -> dict[str, Any]:
        """For GET /registry: the builtin, what it does, its params and their schema/defaults,
        and which params a request may set."""
        defaults = {
            name: field.get_default(call_default_factory=True)
            for name, field in self.Params.model_fields.items()
            if not field.is_required()
        }
        return {
            "builtin": self.name,
            "description": self.description,
            "params": self.params.model_dump(mode="json"),
            "request_params": sorted(self.request_param_names(self._raw_params)),
            "defaults": _jsonable(defaults),
            "schema": self.Params.model_json_schema(),
        }


def _jsonable(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, frozenset, set)):
        return [_jsonable(v) for v in value]
    return value


def text_bounds(content: str) -> tuple[int, int]:
    """[start, end) of `content` without leading and trailing whitespace; the whole content when
    it is only whitespace."""
    end = len(content.rstrip())
    if end == 0:
        return 0, len(content)
    return len(content) - len(content.lstrip()), end


def whole_content(
    content: str,
    *,
    label: str,
    detection_type: str,
    score: float,
    metadata: dict[str, Any] | None = None,
) -> Detection:
    """A classifier detection: the whole content is the span (models judge it as one text),
    without the whitespace around it (a sentence chunk starts with the space before it)."""
    start, end = text_bounds(content)
    return Detection(
        start=start,
        end=end,
        text=content[start:end],
        detection=label,
        detection_type=detection_type,
        score=float(score),
        metadata=metadata,
    )
