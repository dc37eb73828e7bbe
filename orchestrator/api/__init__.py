"""Every wire shape of the orchestrator API, defined once (pydantic)."""
