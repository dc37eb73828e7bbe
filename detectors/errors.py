"""The errors of a detector, apart from the interface (base.py) so that the micro-batcher
(batching.py), which base.py hands out, can raise them without importing base.py."""

from __future__ import annotations


class DetectorError(Exception):
    """A detector failed to judge its contents (model error, ...)."""


class InvalidParams(DetectorError, ValueError):
    """Bad params or a custom pattern that does not compile; the service answers 422.

    `problems` holds one (location, message) per problem, the location relative to the params
    (`patterns.ssn`, `kinds.0`, or "" for the params as a whole), so a config loader can name
    each one with its full YAML path; str() is the same problems joined with "; "."""

    def __init__(self, message: str, problems: list[tuple[str, str]] | None = None) -> None:
        super().__init__(message)
        self.problems: list[tuple[str, str]] = problems or [("", message)]

    @classmethod
    def at(cls, loc: str, message: str) -> InvalidParams:
        """One problem at one location: str() is `loc: message`."""
        return cls(f"{loc}: {message}" if loc else message, [(loc, message)])


class Overloaded(DetectorError):
    """The detector's micro-batch queue is full; the service answers 503."""
