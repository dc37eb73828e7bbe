"""The one error body of the API (DESIGN section 4) and the exception that carries it."""

from __future__ import annotations

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


class ErrorBody(BaseModel):
    """`{"code", "details", "type"}`: every error response and the `error` terminal event."""

    code: int
    details: str
    type: ErrorType

    def dump(self) -> dict[str, object]:
        return self.model_dump(mode="json")


class ApiError(Exception):
    """Raised anywhere in request handling; the error middleware turns it into an ErrorBody."""

    def __init__(self, code: int, error_type: ErrorType, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.error_type = error_type
        self.details = details

    def body(self) -> ErrorBody:
        return ErrorBody(code=self.code, details=self.details, type=self.error_type)


def invalid(details: str, code: int = 422) -> ApiError:
    return ApiError(code, ErrorType.INVALID_REQUEST, details)


def not_found(details: str) -> ApiError:
    return ApiError(404, ErrorType.NOT_FOUND, details)
