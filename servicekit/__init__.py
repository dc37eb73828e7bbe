"""What the three services (orchestrator, engine, detector service) share: the OpenTelemetry
set-up and request-span middleware (`tracing`), and Bearer-key checking (`auth`).

It imports none of them (each of `orchestrator`, `generation` and `detectors` may import it;
`generation` and `detectors` still never import `orchestrator`), and nothing here knows a
service's wire shapes: each service renders its own 401 body (DESIGN sections 4, 6, 7).
"""
