"""Wire models of the detector API (DESIGN 6), defined once: the detector service speaks them and
the orchestrator imports them to call remote detectors and to read in-process results."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Detection(BaseModel):
    """One detection; `start`/`end` are code-point offsets into the content it was found in."""

    start: int
    end: int
    text: str
    detection: str
    detection_type: str
    score: float
    evidence: list[dict[str, Any]] | None = None
    metadata: dict[str, Any] | None = None


class ContentsRequest(BaseModel):
    """Body of `POST /api/v1/text/contents`; unknown fields are a client error (422)."""

    model_config = ConfigDict(extra="forbid")

    contents: list[str]
    detector_params: dict[str, Any] = Field(default_factory=dict)


class ErrorBody(BaseModel):
    """Every non-200 reply of the detector service."""

    code: int
    message: str


def dump_reply(reply: list[list[Detection]]) -> list[list[dict[str, Any]]]:
    """The JSON form of a reply: one list per content, null evidence/metadata left out."""
    return [[d.model_dump(exclude_none=True) for d in per_content] for per_content in reply]
