"""Fault injection for migration tests (`--enable-fault-injection`): the next `times` generate
streams fail in `mode` once `after_tokens` tokens have been delivered in that stream. Mode
`script` is not a failure: the next streams answer `token_ids` as if the model had generated
them (tests of what parses the output, e.g. tool calls: a tiny random model writes no call),
then generate on from there; with `after_tokens`, the stream is then cut (`close`) there."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

FaultMode = Literal["close", "stall", "error", "script"]


@dataclass(frozen=True)
class Fault:
    after_tokens: int
    mode: FaultMode
    token_ids: tuple[int, ...] = ()  # `script`: the answer's first tokens


class FaultInjector:
    """A queue of armed faults; each generate stream takes at most one when it starts."""

    def __init__(self) -> None:
        self._armed: deque[Fault] = deque()

    def arm(
        self, after_tokens: int, mode: FaultMode, times: int, token_ids: tuple[int, ...] = ()
    ) -> None:
        self._armed.extend([Fault(after_tokens, mode, token_ids)] * times)

    def clear(self) -> None:
        self._armed.clear()

    def take(self) -> Fault | None:
        return self._armed.popleft() if self._armed else None

    @property
    def pending(self) -> int:
        return len(self._armed)
