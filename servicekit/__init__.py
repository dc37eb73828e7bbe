"""What the three services (orchestrator, engine, detector service) share: the OpenTelemetry
set-up and request-span middleware (`tracing`), Bearer keys and their loading (`auth`), the
engine and detector service's common CLI flags (`cli`), and the two pieces of the engine's
knowledge the orchestrator needs without importing the engine (DESIGN 1: they talk only over
HTTP): stop-sequence hold-back (`text_gate`) and which model specs an engine accepts
(`model_specs`).

It imports none of them (each of `orchestrator`, `generation` and `detectors` may import it;
`generation` and `detectors` still never import `orchestrator`), and nothing here knows a
service's wire shapes: each service renders its own 401 body (DESIGN sections 4, 6, 7).
"""
