"""One ModelBackend per configured model_id: its replicas (any mix of managed, native and openai
backends), their pool, and a MigratingStream per request."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TextIO

import aiohttp
from prometheus_client import CollectorRegistry

from ..api.errors import invalid
from ..config import ConfigError, ManagedBackend, ModelConfig, NativeBackend, OpenAIBackend
from .advertised_limits import (
    AdvertisedLimits,
    EngineLimitError,
    context_problem,
    merge_limits,
    request_problem,
    token_upper_bound,
    tools_problem,
)
from .backend import ChatMessage, GenerationError, GenerationRequest, ModelBackend
from .managed import ENGINE_API_KEYS_ENV, CommandFactory, EngineProcess, engine_command
from .migration import MigratingStream, MigrationMetrics
from .native import NativeClient, native_tools
from .openai import OpenAIClient
from .replicas import HEALTHY, UNHEALTHY, Replica, ReplicaPool
from .tls import client_ssl_context

log = logging.getLogger("guardstream.backends")

__all__ = ["ModelBackend", "ReplicatedModelBackend", "build_model_backends"]


def default_command(cfg: ManagedBackend) -> CommandFactory:
    return engine_command(
        cfg.model,
        cfg.device,
        cfg.enable_fault_injection,
        api_keys_env=ENGINE_API_KEYS_ENV,
        dtype=cfg.dtype,
        batch_invariant=cfg.batch_invariant,
        prefill_chunk_tokens=cfg.prefill_chunk_tokens,
        overlap=cfg.overlap,
        compile_step=cfg.compile,
    )


class ReplicatedModelBackend(ModelBackend):
    def __init__(
        self,
        model_id: str,
        config: ModelConfig,
        session: aiohttp.ClientSession,
        *,
        metrics: MigrationMetrics | None = None,
        health_interval_s: float = 2.0,
        command_factory: Callable[[ManagedBackend], CommandFactory] = default_command,
        engine_output: TextIO | None = None,
        hidden_env: frozenset[str] = frozenset(),
    ) -> None:
        self.model_id = model_id
        self.config = config
        self.metrics = metrics
        if metrics is not None:
            metrics.known_model(model_id)
        self.processes: list[EngineProcess] = []
        self.limits = AdvertisedLimits()
        replicas: list[Replica] = []
        for index, backend in enumerate(config.backends):
            if isinstance(backend, ManagedBackend):
                for _ in range(backend.replicas):
                    name = f"managed-{len(replicas)}"
                    process = EngineProcess(
                        f"{model_id}/{name}",
                        command_factory(backend),
                        session,
                        start_timeout_s=backend.start_timeout_s,
                        output=engine_output,
                        hidden_env=hidden_env,
                    )
                    client = NativeClient(name, process.url, session, api_key=process.api_key)
                    replica = Replica(name=name, client=client, process=process)
                    process.on_status = self._status_hook(replica, process)
                    self.processes.append(process)
                    replicas.append(replica)
            elif isinstance(backend, NativeBackend):
                name = f"native-{len(replicas)}"
                client = NativeClient(
                    name,
                    backend.url,
                    session,
                    ssl_context=client_ssl_context(
                        backend.tls, where=f"models.{model_id}.backends.{index}.tls"
                    ),
                    api_key=_native_key(backend, f"models.{model_id}.backends.{index}"),
                )
                replicas.append(Replica(name=name, client=client))
            elif isinstance(backend, OpenAIBackend):
                name = f"openai-{len(replicas)}"
                api_key = None
                if backend.api_key_env:
                    api_key = os.environ.get(backend.api_key_env)
                    if not api_key:
                        log.warning(
                            "model %s: %s is not set; calling %s without a key",
                            model_id,
                            backend.api_key_env,
                            backend.url,
                        )
                oa_client = OpenAIClient(
                    name,
                    backend.url,
                    backend.model,
                    session,
                    api=backend.api,
                    api_key=api_key,
                    tokenizer=backend.tokenizer,
                    ssl_context=client_ssl_context(
                        backend.tls, where=f"models.{model_id}.backends.{index}.tls"
                    ),
                )
                replicas.append(Replica(name=name, client=oa_client))
        self.pool = ReplicaPool(
            model_id,
            replicas,
            quarantine_s=config.migration.quarantine_s,
            health_interval_s=health_interval_s,
        )

    @staticmethod
    def _status_hook(replica: Replica, process: EngineProcess) -> Callable[[str], None]:
        """The supervisor knows first when its process is up or gone; a fresh process owes
        nothing to its predecessor's quarantine."""

        def hook(status: str) -> None:
            replica.status = status
            replica.client.url = process.url
            if status == HEALTHY:
                replica.quarantined_until = 0.0

        return hook

    @property
    def replicas(self) -> list[Replica]:
        return self.pool.replicas

    def stream(self, request: GenerationRequest) -> MigratingStream:
        return MigratingStream(
            model_id=self.model_id,
            pool=self.pool,
            request=request,
            migration=self.config.migration,
            metrics=self.metrics,
        )

    async def tokenize(
        self, prompt: str, chat: bool, messages: tuple[ChatMessage, ...] | None = None
    ) -> int:
        last: GenerationError | None = None
        for replica in self.pool.candidates():
            try:
                return await replica.client.tokenize(prompt, chat, messages)
            except GenerationError as exc:
                if not exc.migratable:
                    raise
                last = exc
        detail = f": {last.message}" if last is not None else ""
        raise GenerationError(
            f"no healthy replica of model `{self.model_id}` could tokenize{detail}",
            error_type="generation_unavailable",
            code=503,
        )

    async def count_privately(
        self, prompt: str, chat: bool, messages: tuple[ChatMessage, ...] | None = None
    ) -> int | None:
        """A refused prompt's count: by this deployment's own engines (native, managed), or
        by an `openai` replica's local `tokenizer`; never by an `openai` server, which would
        then have received what the input guardrails refused (DESIGN 4.5)."""
        for replica in self.pool.candidates():
            client = replica.client
            try:
                if isinstance(client, OpenAIClient):
                    if client.local is None:
                        continue
                    chat_mode = chat or client.api == "chat" or messages is not None
                    return await client.count_locally(prompt, chat_mode, messages)
                return await client.tokenize(prompt, chat, messages)
            except GenerationError:
                continue
        return None

    async def validate(self, request: GenerationRequest) -> GenerationRequest:
        """422 (`invalid_request`) for what the native replicas would reject: a parameter out
        of the range they advertise in `GET /v1/models`, or a prompt that with max_new_tokens
        does not fit their context (the smallest one: a request may migrate). A budget the
        client did not set shrinks to what fits instead (returned in the request). The prompt
        is tokenized only when its size could make it too long (advertised_limits.token_upper_bound).
        Replicas that advertise nothing (`openai` ones, unreachable ones) are not consulted;
        with none advertising, nothing is checked here and the engines' own 4xx still come
        back as invalid_request."""
        for replica in self.pool.replicas:
            client = replica.client
            if isinstance(client, OpenAIClient) and (refused := client.unhonoured(request)):
                raise invalid(
                    f"{refused[0]}: model `{self.model_id}` cannot honour it (the server of "
                    f"its replica {replica.name} refuses it)"
                )
        natives = [
            r.client
            for r in self.pool.replicas
            if isinstance(r.client, NativeClient) and r.status != UNHEALTHY
        ]
        advertised = await self.limits.gather(natives) if natives else []
        if not advertised:
            # engines that said nothing of themselves may still be asked for tools: only one
            # that says it takes them gets them (the others' 422 would name no request field)
            if natives and (why := tools_problem(None, request)) is not None:
                raise EngineLimitError(self.model_id, why)
            return request
        limits = merge_limits([lim for _, lim in advertised])
        problem = request_problem(limits, request)
        params = request.params
        budget = params.max_new_tokens
        if problem is None and token_upper_bound(request) + budget > limits.max_model_len:
            count = await self._count_tokens(request, [c for c, _ in advertised])
            if count is not None:
                problem = context_problem(limits, count, budget)
                fits = limits.max_model_len - count
                if problem and params.budget_is_default and fits >= max(1, params.min_new_tokens):
                    return replace(request, params=replace(params, max_new_tokens=fits))
        if problem is not None:
            raise EngineLimitError(self.model_id, problem)
        return request

    async def _count_tokens(
        self, request: GenerationRequest, clients: list[NativeClient]
    ) -> int | None:
        """The prompt's token count on an advertising replica (best first), or None when none
        answers (the engine's own check then applies at dispatch)."""
        ranked = [r.client for r in self.pool.candidates() if r.client in clients]
        for client in ranked:
            try:
                return await client.tokenize(
                    request.prompt, request.chat, request.messages, native_tools(request)
                )
            except GenerationError as exc:
                if exc.error_type == "invalid_request":  # e.g. the template refuses the roles
                    raise invalid(f"model `{self.model_id}`: {exc.message}") from None
                if not exc.migratable:
                    break  # a deployment problem (a wrong key): dispatch will report it
        log.warning("model %s: no replica could count the prompt's tokens", self.model_id)
        return None

    async def start(self) -> None:
        if self.processes:
            results = await asyncio.gather(*(p.start() for p in self.processes))
            others = len(self.pool.replicas) - len(self.processes)
            if not any(results) and not others:
                codes = ", ".join(str(p.last_exit) for p in self.processes)
                await self.close()
                raise RuntimeError(
                    f"model `{self.model_id}`: no managed engine became healthy "
                    f"(exit codes: {codes}); see the [engine ...] lines above"
                )
        self.pool.start_polling()

    async def close(self) -> None:
        await self.limits.close()
        await self.pool.stop_polling()
        await asyncio.gather(*(p.stop() for p in self.processes))

    def info(self) -> list[dict[str, Any]]:
        return self.pool.info()


def _native_key(backend: NativeBackend, where: str) -> str | None:
    """The key a `native` backend's engine requires; a named variable that is unset or empty
    is a config error (calling a keyed engine without its key would fail every request)."""
    if not backend.api_key_env:
        return None
    key = os.environ.get(backend.api_key_env, "").strip()
    if not key:
        state = "is not set" if backend.api_key_env not in os.environ else "holds no key"
        name = backend.api_key_env
        raise ConfigError([f"{where}.api_key_env: environment variable {name} {state}"])
    return key


def build_model_backends(
    models: dict[str, ModelConfig],
    session: aiohttp.ClientSession,
    *,
    metrics: MigrationMetrics | None = None,
    registry: CollectorRegistry | None = None,
    health_interval_s: float = 2.0,
    command_factory: Callable[[ManagedBackend], CommandFactory] = default_command,
    engine_output: TextIO | None = None,
    hidden_env: frozenset[str] = frozenset(),
) -> dict[str, ModelBackend]:
    """Backends for every configured model; migration counters go on `metrics`, or on new ones
    registered on `registry`; managed engines start without the variables in `hidden_env`."""
    if metrics is None:
        metrics = MigrationMetrics(registry)
    return {
        model_id: ReplicatedModelBackend(
            model_id,
            config,
            session,
            metrics=metrics,
            health_interval_s=health_interval_s,
            command_factory=command_factory,
            engine_output=engine_output,
            hidden_env=hidden_env,
        )
        for model_id, config in models.items()
    }
