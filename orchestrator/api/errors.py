"""The one error triple of the API (DESIGN section 4) and the exception that carries it.

An error is a `Failure` (code, type, message) from the moment it is known to the moment it is
written: `orchestrator.errors.describe` maps any exception to one, `ApiError` carries one, and
each surface renders it in its own shape (`ErrorBody.from_failure` here for the FMS surface,
`OpenAIErrorBody.from_failure` for the OpenAI ones, the writers for in-band errors). Nothing
converts a rendered body back into a `Failure`: the triple is never re-derived, so the surfaces
cannot drift apart on what an error was."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from pydantic import BaseModel


class ErrorType(StrEnum):
    INVALID_REQUEST = "invalid_request"
    NOT_FOUND = "not_found"
    UNAUTHORIZED = "unauthorized"
    DETECTOR_ERROR = "detector_error"
    CHUNKER_ERROR = "chunker_error"
    GENERATION_ERROR = "generation_error"
    GENERATION_UNAVAILABLE = "generation_unavailable"
    TIMEOUT = "timeout"
    OVERLOADED = "overloaded"
    SERVER_SHUTDOWN = "server_shutdown"
    SERVER_ERROR = "server_error"


@dataclass(frozen=True, slots=True)
class Failure:
    """What a client is told about an error: HTTP-style code, error type, message. A plain
    dataclass, not a wire model: each surface projects it into its own body."""

    code: int
    type: ErrorType
    message: str


class ErrorBody(BaseModel):
    """`{"code", "details", "type"}`: the FMS surfaces' error responses, the `error` terminal
    event and the stream-content error line."""

    code: int
    details: str
    type: ErrorType

    @classmethod
    def from_failure(cls, failure: Failure) -> ErrorBody:
        return cls(code=failure.code, details=failure.message, type=failure.type)

    def dump(self) -> dict[str, object]:
        return self.model_dump(mode="json")


class ApiError(Exception):
    """Raised anywhere in request handling; the error middleware renders its `failure` in the
    shape of the route's surface."""

    def __init__(self, code: int, error_type: ErrorType, details: str) -> None:
        super().__init__(details)
        self.failure = Failure(code, error_type, details)

    @staticmethod
    def of(failure: Failure) -> ApiError:
        """The error a pipeline reported before the first byte, raised as a real HTTP error."""
        return ApiError(failure.code, failure.type, failure.message)

    @property
    def code(self) -> int:
        return self.failure.code

    @property
    def error_type(self) -> ErrorType:
        return self.failure.type

    @property
    def details(self) -> str:
        return self.failure.message


def invalid(details: str, code: int = 422) -> ApiError:
    return ApiError(code, ErrorType.INVALID_REQUEST, details)


def not_found(details: str) -> ApiError:
    return ApiError(404, ErrorType.NOT_FOUND, details)
