"""The pieces of text a client sent in a conversation, each judged on its own by the input
detectors (DESIGN 4.8, 4.9). The OpenAI request models say what their pieces are; the pipeline
(streaming/text_judgement.py) judges them: the type lives here, below both.
"""

from __future__ import annotations

from dataclasses import dataclass

# `field` of a stop sequence judged as input (DESIGN 4.6a), `message_index` its index: stop
# sequences reach the engine, so the input guardrails judge them like the prompt
STOP_SEQUENCE_FIELD = "stop"


@dataclass(frozen=True, slots=True)
class InputPiece:
    """One piece of text a client sent in a conversation, judged on its own (DESIGN 4.8, 4.9):
    a message's content (`field` None), its `name` or `refusal`, or Responses `instructions`
    (`message_index` None). Every piece is judged, whatever its role: a guardrail that saw only
    the last user message would let a system message or an earlier turn carry what it refuses."""

    text: str
    message_index: int | None = None
    field: str | None = None
    # the index of the message this text is in the generation request (None: it never reaches
    # the engine, like a `name`): where an input redaction goes
    target: int | None = None
    # the arguments of that message's tool call at this index (an assistant turn's call sent
    # back), not its content
    tool_call: int | None = None
