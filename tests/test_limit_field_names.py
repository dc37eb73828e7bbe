"""An engine's advertised-limit refusal is restated in the words of the request that caused it
(handlers/prepare.py `GenerationAsk.restate`): the first thing a 422 says is a field of the body
the client sent, whatever surface it came through. End to end: test_openai_chat_e2e.py (FMS and
chat over a real engine), test_openai_fuzz.py::test_an_engine_limit_names_the_request_field."""

from __future__ import annotations

import pytest

from orchestrator.clients.advertised_limits import EngineLimitError, LimitProblem
from orchestrator.handlers.fms_task import FMS_PARAM_FIELDS
from orchestrator.handlers.prepare import OPENAI_PARAM_FIELDS, Decoding, GenerationAsk


def ask(surface: str) -> GenerationAsk:
    fields = {
        "chat": ("messages", "max_completion_tokens", OPENAI_PARAM_FIELDS),
        "responses": ("input", "max_output_tokens", OPENAI_PARAM_FIELDS),
        "fms": ("inputs", "text_gen_parameters.max_new_tokens", FMS_PARAM_FIELDS),
    }[surface]
    return GenerationAsk(
        model="m",
        prompt="hi",
        inputs="hi",
        input_chars=2,
        input_field=fields[0],
        max_tokens=None,
        max_tokens_field=fields[1],
        decoding=Decoding(),
        input_detectors=None,
        output_detectors=None,
        input_detectors_field="detectors.input",
        output_detectors_field="detectors.output",
        stream=False,
        param_fields=fields[2],
        min_tokens_field="min_tokens" if surface != "fms" else "text_gen_parameters.min_new_tokens",
    )


STOPS = LimitProblem("stop_sequences", "stop_sequences has 17 entries; at most 16 are accepted")
LONG_STOP = LimitProblem(
    "stop_sequences[2]", "stop_sequences[2] is 300 characters long; at most 256 are accepted"
)
ROLE = LimitProblem(
    "messages[1].role", "messages[1].role `critic` is not accepted (use assistant, user)"
)
PROMPT = LimitProblem("prompt", "the prompt has 900 tokens: it must be shorter than 512 tokens")
BUDGET = LimitProblem(
    "max_new_tokens", "the prompt has 9 tokens and max_new_tokens is 600: 609 tokens exceed 512"
)
TOOLS = LimitProblem("tools", "tools: the model's engine does not say it takes tools")
METHOD = LimitProblem(
    "decoding_method", "decoding method SAMPLING is not supported (supported: greedy)"
)


@pytest.mark.parametrize(
    ("surface", "problem", "message"),
    [
        ("chat", STOPS, "stop: model `m`: stop has 17 entries; at most 16 are accepted"),
        (
            "fms",
            STOPS,
            "text_gen_parameters.stop_sequences: model `m`: text_gen_parameters.stop_sequences "
            "has 17 entries; at most 16 are accepted",
        ),
        (
            "chat",
            LONG_STOP,
            "stop[2]: model `m`: stop[2] is 300 characters long; at most 256 are accepted",
        ),
        (
            "chat",
            ROLE,
            "messages[1].role: model `m`: messages[1].role `critic` is not accepted "
            "(use assistant, user)",
        ),
        # a Responses `input` is not the engine's list of messages: no index into it
        (
            "responses",
            ROLE,
            "input: model `m`: input `critic` is not accepted (use assistant, user)",
        ),
        (
            "chat",
            PROMPT,
            "messages: model `m`: the prompt has 900 tokens: it must be shorter than 512 tokens",
        ),
        (
            "fms",
            PROMPT,
            "inputs: model `m`: the prompt has 900 tokens: it must be shorter than 512 tokens",
        ),
        (
            "chat",
            BUDGET,
            "max_completion_tokens: model `m`: the prompt has 9 tokens and "
            "max_completion_tokens is 600: 609 tokens exceed 512",
        ),
        ("responses", TOOLS, "tools: model `m`: the model's engine does not say it takes tools"),
        (
            "chat",
            METHOD,
            "temperature: model `m`: decoding method SAMPLING is not supported (supported: greedy)",
        ),
        (
            "fms",
            METHOD,
            "text_gen_parameters.decoding_method: model `m`: decoding method "
            "SAMPLING is not supported (supported: greedy)",
        ),
    ],
)
def test_a_refusal_names_the_requests_own_field(
    surface: str, problem: LimitProblem, message: str
) -> None:
    error = ask(surface).restate(EngineLimitError("m", problem))
    assert (error.code, error.details) == (422, message)


def test_the_backend_keeps_the_engines_words() -> None:
    """Below the surfaces (clients, logs) the refusal still reads as the engine said it."""
    assert EngineLimitError("m", STOPS).details == (
        "model `m`: stop_sequences has 17 entries; at most 16 are accepted"
    )
