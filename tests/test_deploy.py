"""The deploy files parse and agree with the code (issue 7): Dockerfile, .dockerignore,
deploy/docker-compose.yaml, deploy/k8s/*.yaml and the configs they mount. Commands go through the
real CLI parsers, configs through the real loaders, ports and paths are compared across files.

Security: every engine and detector service requires a key, which comes from a Secret (k8s) or a
git-ignored env file (compose), and the orchestrator sends that same key; the NetworkPolicies are
evaluated with Kubernetes' rules for who may connect to whom. Monitoring: the Prometheus scrape
targets, the ServiceMonitor and the Grafana provisioning point at what the deployment runs (the
dashboard's queries are checked against real /metrics in tests/test_deploy_dashboard.py)."""

from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from aiohttp import web

import detectors
import detectors.__main__ as detectors_cli
import generation.__main__ as generation_cli
import orchestrator.__main__ as orchestrator_cli
from detectors import service as detector_service
from generation import models
from generation.server import create_app as engine_app
from orchestrator.app import create_app as orchestrator_app
from orchestrator.config import Config, ServerConfig, load_config, parse_config
from orchestrator.server import CLEANUP_GRACE_S, SHUTDOWN_GRACE_S
from orchestrator.state import STATE
from orchestrator.workers import WORKER_EXIT_GRACE_S, worker_count

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
# the shipped config.yaml's built-in detectors: the detector service serves them all; the
# deployments' orchestrators call the model-backed ones there (regex and pii_ner, the enforced
# `pii`, stay in-process: deploy/render.py IN_PROCESS)
IN_PROCESS = ("regex", "pii_ner")
_SHIPPED_DETECTORS = yaml.safe_load((DEPLOY.parent / "config.yaml").read_text())["detectors"]
SHIPPED_BUILTINS = sorted(d for d, c in _SHIPPED_DETECTORS.items() if "builtin" in c)
REMOTE_BUILTINS = sorted(
    d for d in SHIPPED_BUILTINS if _SHIPPED_DETECTORS[d]["builtin"] not in IN_PROCESS
)
REMOTE_JUDGES = {
    d: "spans"
    if detectors.detector_class(_SHIPPED_DETECTORS[d]["builtin"]).finds_spans
    else "chunks"
    for d in REMOTE_BUILTINS
}
COMPOSE: dict[str, Any] = yaml.safe_load((DEPLOY / "docker-compose.yaml").read_text())
K8S_FILES = sorted(p for p in (DEPLOY / "k8s").glob("*.yaml") if p.name != "kustomization.yaml")
KUSTOMIZATION: dict[str, Any] = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
K8S: dict[tuple[str, str], dict[str, Any]] = {
    (doc["kind"], doc["metadata"]["name"]): doc
    for path in K8S_FILES
    for doc in yaml.safe_load_all(path.read_text())
    if doc
}
MONITORING_FILES = sorted((DEPLOY / "k8s" / "monitoring").glob("*.yaml"))
MONITORING: dict[tuple[str, str], dict[str, Any]] = {
    (doc["kind"], doc["metadata"]["name"]): doc
    for path in MONITORING_FILES
    for doc in yaml.safe_load_all(path.read_text())
    if doc
}
PROMETHEUS: dict[str, Any] = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
GRAFANA_PROVISIONING = DEPLOY / "grafana" / "provisioning"
DOCKERFILE = (ROOT / "Dockerfile").read_text()
MAKEFILE = (ROOT / "Makefile").read_text()

ORCHESTRATOR_PORT = 8033
ENGINE_PORT = 8090
DETECTORS_PORT = 8080
CONFIG_PATH = "/etc/guardstream/config.yaml"
DETECTORS_CONFIG_PATH = "/etc/guardstream/detectors.yaml"
CLIENT_KEYS_ENV = "GUARDSTREAM_API_KEYS"
ENGINE_KEY_ENV = "GUARDSTREAM_ENGINE_KEY"
DETECTORS_KEY_ENV = "GUARDSTREAM_DETECTORS_KEY"
# compose services that run the guardstream image (the others are the monitoring profile's)
GUARDSTREAM_SERVICES = ("orchestrator", "engine-0", "engine-1", "detectors")
MONITORING_SERVICES = ("prometheus", "grafana")


# -- helpers -------------------------------------------------------------------------------------


def parse_command(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[str, Any]:
    """`python -m MODULE serve ...` through MODULE's real argparse parser: (module, namespace)."""
    assert argv[:2] == ["python", "-m"], argv
    module, rest = argv[2], argv[3:]
    if module == "orchestrator":
        seen: list[argparse.Namespace] = []
        monkeypatch.setattr(orchestrator_cli, "_serve", lambda args: seen.append(args) or 0)
        assert orchestrator_cli.main(rest) == 0
        return module, seen[0]
    if module == "generation":
        return module, generation_cli._parser().parse_args(rest)
    if module == "detectors":
        return module, detectors_cli._parser().parse_args(rest)
    raise AssertionError(f"unknown module {module}")


def k8s_container(kind: str, name: str) -> dict[str, Any]:
    (container,) = K8S[(kind, name)]["spec"]["template"]["spec"]["containers"]
    return container


def k8s_config(configmap: str, key: str) -> dict[str, Any]:
    return yaml.safe_load(K8S[("ConfigMap", configmap)]["data"][key])


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None, url
    return parts.hostname, parts.port


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines = [ln for ln in DOCKERFILE.splitlines() if not ln.lstrip().startswith("#")]
    joined = "\n".join(lines).replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        if line.strip():
            instr, _, rest = line.strip().partition(" ")
            out.append((instr.upper(), rest.strip()))
    return out


def pip_requirement_installs(commands: list[str]) -> dict[str, bool]:
    """{requirements file: installed with --no-deps} for every `pip install -r` in `commands`."""
    found: dict[str, bool] = {}
    for command in commands:
        for part in re.split(r"&&|;", command):
            if "pip install" not in part:
                continue
            words = shlex.split(part)
            files = [words[i + 1] for i, w in enumerate(words) if w == "-r"]
            for f in files:
                found[f] = "--no-deps" in words
    return found


def requirement_pins(name: str) -> dict[str, str]:
    pins = {}
    for line in (ROOT / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            package, _, version = line.partition("==")
            pins[package.lower()] = version
    return pins


# -- every file parses; the configs validate -----------------------------------------------------


API_VERSIONS = {
    "ConfigMap": "v1",
    "Service": "v1",
    "Deployment": "apps/v1",
    "StatefulSet": "apps/v1",
    "NetworkPolicy": "networking.k8s.io/v1",
    "ServiceMonitor": "monitoring.coreos.com/v1",
    "PodDisruptionBudget": "policy/v1",
    "HorizontalPodAutoscaler": "autoscaling/v2",
}


def test_k8s_manifests_parse_into_the_expected_objects() -> None:
    assert [p.name for p in K8S_FILES] == [
        "detectors.yaml",
        "engine.yaml",
        "network-policy.yaml",
        "orchestrator.yaml",
    ]
    assert set(K8S) == {
        ("ConfigMap", "guardstream-config"),
        ("Deployment", "guardstream-orchestrator"),
        ("Service", "guardstream"),
        ("Service", "guardstream-engine"),
        ("StatefulSet", "guardstream-engine"),
        ("ConfigMap", "guardstream-detectors-config"),
        ("Deployment", "guardstream-detectors"),
        ("Service", "guardstream-detectors"),
        ("NetworkPolicy", "guardstream-engine"),
        ("NetworkPolicy", "guardstream-detectors"),
        ("PodDisruptionBudget", "guardstream-orchestrator"),
    }
    # the ServiceMonitor needs the Prometheus Operator's CRDs and the autoscaler the Prometheus
    # Adapter's metric: a folder of their own, applied apart
    assert [p.name for p in MONITORING_FILES] == ["hpa.yaml", "servicemonitor.yaml"]
    assert set(MONITORING) == {
        ("ServiceMonitor", "guardstream"),
        ("HorizontalPodAutoscaler", "guardstream-orchestrator"),
    }
    for (kind, _), doc in [*K8S.items(), *MONITORING.items()]:
        assert doc["apiVersion"] == API_VERSIONS[kind]
        # one namespace for everything: `kubectl apply -n NS` puts it where the operator wants
        assert "namespace" not in doc["metadata"]


def test_compose_services() -> None:
    assert set(COMPOSE["services"]) == {*GUARDSTREAM_SERVICES, *MONITORING_SERVICES}
    # `up` starts guardstream; `--profile monitoring up` adds Prometheus and Grafana
    profiles = {n: s["profiles"] for n, s in COMPOSE["services"].items() if "profiles" in s}
    assert profiles == {name: ["monitoring"] for name in MONITORING_SERVICES}
    assert COMPOSE["services"]["orchestrator"]["build"] == {
        "context": "..",
        "dockerfile": "Dockerfile",
    }
    assert (
        DEPLOY / COMPOSE["services"]["orchestrator"]["build"]["context"] / "Dockerfile"
    ).is_file()


@pytest.mark.parametrize(
    "name", ["config.yaml", "deploy/config.compose.yaml", "k8s:guardstream-config"]
)
def test_orchestrator_configs_validate(name: str) -> None:
    if name.startswith("k8s:"):
        config = parse_config(k8s_config(name[4:], "config.yaml"))
    else:
        config = load_config(ROOT / name)
    assert isinstance(config, Config)
    assert list(config.models) == ["smollm2-135m"]
    assert config.server.port == ORCHESTRATOR_PORT
    assert config.server.host == "0.0.0.0"


def test_detector_service_configs_validate() -> None:
    config = detector_service.load_config(DEPLOY / "detectors.yaml")
    built = detector_service.detectors_from_config(config, device="cpu")
    assert sorted(built) == SHIPPED_BUILTINS
    # the same format as config.yaml: the orchestrator's loader accepts it as well
    assert sorted(load_config(DEPLOY / "detectors.yaml").detectors) == SHIPPED_BUILTINS
    assert k8s_config("guardstream-detectors-config", "detectors.yaml") == config
    assert detector_service_key_env(config) == DETECTORS_KEY_ENV


def get_routes(app: web.Application) -> set[str]:
    """The paths an app answers GET on: its router, not its source text."""
    return {r.resource.canonical for r in app.router.routes() if r.method == "GET" and r.resource}


def test_probe_paths_are_routes_of_the_apps(tiny_model: models.LoadedModel) -> None:
    assert {"/health", "/info"} <= get_routes(orchestrator_app(parse_config({})))
    assert "/health" in get_routes(detector_service.create_app({}))
    assert "/health" in get_routes(engine_app(tiny_model))


# -- commands go through the real CLI parsers ----------------------------------------------------


def all_commands() -> list[tuple[str, list[str]]]:
    out = [
        (f"compose:{name}", COMPOSE["services"][name]["command"]) for name in GUARDSTREAM_SERVICES
    ]
    for kind, name in K8S:
        if kind in ("Deployment", "StatefulSet"):
            out.append((f"k8s:{name}", k8s_container(kind, name)["command"]))
    cmd = next(args for instr, args in dockerfile_instructions() if instr == "CMD")
    out.append(("Dockerfile:CMD", json.loads(cmd)))
    return out


EXPECTED_PORT = {
    "orchestrator": ORCHESTRATOR_PORT,
    "generation": ENGINE_PORT,
    "detectors": DETECTORS_PORT,
}


@pytest.mark.parametrize(("where", "argv"), all_commands(), ids=[w for w, _ in all_commands()])
def test_commands_are_accepted_by_the_cli(
    where: str, argv: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    module, args = parse_command(argv, monkeypatch)
    assert args.port == EXPECTED_PORT[module]
    if module == "orchestrator":
        assert args.config == CONFIG_PATH
        assert args.host is None  # the config's server.host (0.0.0.0) applies
    elif module == "generation":
        assert args.command == "serve"
        assert (args.model, args.host, args.device) == ("smollm2-135m", "0.0.0.0", "auto")
        assert args.api_keys_env == ENGINE_KEY_ENV  # never an open engine
    else:
        assert args.command == "serve"
        assert (args.config, args.host) == (DETECTORS_CONFIG_PATH, "0.0.0.0")


def test_default_ports_are_the_deployed_ones() -> None:
    assert ServerConfig().port == ORCHESTRATOR_PORT
    assert generation_cli._parser().parse_args(["serve"]).port == ENGINE_PORT
    assert detectors_cli._parser().parse_args(["serve", "--config", "x"]).port == DETECTORS_PORT
    exposed = next(args for instr, args in dockerfile_instructions() if instr == "EXPOSE")
    assert [int(p) for p in exposed.split()] == [ORCHESTRATOR_PORT, ENGINE_PORT, DETECTORS_PORT]


# -- docker compose wiring -----------------------------------------------------------------------


def compose_mounts(service: str) -> dict[str, Path]:
    """{container path: host file} of a service's bind mounts."""
    mounts = {}
    for volume in COMPOSE["services"][service].get("volumes", []):
        host, container, *_ = volume.split(":")
        mounts[container] = (DEPLOY / host).resolve()
    return mounts


def test_compose_mounts_the_configs_the_commands_read() -> None:
    assert compose_mounts("orchestrator") == {CONFIG_PATH: DEPLOY / "config.compose.yaml"}
    assert compose_mounts("detectors") == {DETECTORS_CONFIG_PATH: DEPLOY / "detectors.yaml"}
    assert COMPOSE["services"]["orchestrator"]["ports"] == [
        f"{ORCHESTRATOR_PORT}:{ORCHESTRATOR_PORT}"
    ]


def test_compose_config_points_at_the_compose_services() -> None:
    config = load_config(DEPLOY / "config.compose.yaml")
    backends = config.models["smollm2-135m"].backends
    assert [host_port(b.url) for b in backends] == [  # type: ignore[union-attr]
        ("engine-0", ENGINE_PORT),
        ("engine-1", ENGINE_PORT),
    ]
    served = detector_service.load_config(DEPLOY / "detectors.yaml")["detectors"]
    remote = {d: c for d, c in config.detectors.items() if c.url is not None}
    assert sorted(remote) == REMOTE_BUILTINS
    assert {d: c.judges for d, c in remote.items()} == REMOTE_JUDGES
    for detector_id, det in remote.items():
        assert det.url is not None
        assert host_port(det.url) == ("detectors", DETECTORS_PORT)
        assert detector_id in served  # the detector service answers under the same id


def test_compose_healthchecks_use_health_on_the_served_port() -> None:
    ports = {
        "orchestrator": ORCHESTRATOR_PORT,
        "engine-0": ENGINE_PORT,
        "engine-1": ENGINE_PORT,
        "detectors": DETECTORS_PORT,
    }
    for name, port in ports.items():
        test = " ".join(COMPOSE["services"][name]["healthcheck"]["test"])
        # the orchestrator's is readiness (/info): 503 until its detectors are warm, and
        # while it drains (issue 41: compose checked liveness)
        path = "/info" if name == "orchestrator" else "/health"
        assert f"http://127.0.0.1:{port}{path}" in test, name


# -- kubernetes wiring ---------------------------------------------------------------------------


def test_k8s_orchestrator_wiring() -> None:
    c = k8s_container("Deployment", "guardstream-orchestrator")
    assert c["ports"] == [{"name": "http", "containerPort": ORCHESTRATOR_PORT}]
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": ORCHESTRATOR_PORT}
    assert c["readinessProbe"]["httpGet"] == {"path": "/info", "port": ORCHESTRATOR_PORT}
    assert c["volumeMounts"] == [
        {"name": "config", "mountPath": str(Path(CONFIG_PATH).parent)},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    spec = K8S[("Deployment", "guardstream-orchestrator")]["spec"]["template"]["spec"]
    assert spec["volumes"] == [
        {"name": "config", "configMap": {"name": "guardstream-config"}},
        {"name": "tmp", "emptyDir": {}},
    ]
    assert Path(CONFIG_PATH).name in K8S[("ConfigMap", "guardstream-config")]["data"]
    svc = K8S[("Service", "guardstream")]["spec"]
    assert svc["ports"] == [
        {"name": "http", "port": ORCHESTRATOR_PORT, "targetPort": ORCHESTRATOR_PORT}
    ]
    assert svc["selector"] == {"app": "guardstream-orchestrator"}


def test_k8s_config_points_at_the_k8s_services() -> None:
    config = parse_config(k8s_config("guardstream-config", "config.yaml"))
    sts = K8S[("StatefulSet", "guardstream-engine")]["spec"]
    headless = K8S[("Service", "guardstream-engine")]["spec"]
    assert headless["clusterIP"] == "None" and sts["serviceName"] == "guardstream-engine"
    assert headless["ports"] == [{"name": "http", "port": ENGINE_PORT, "targetPort": ENGINE_PORT}]
    pods = [f"guardstream-engine-{i}.guardstream-engine" for i in range(sts["replicas"])]
    backends = config.models["smollm2-135m"].backends
    assert [host_port(b.url) for b in backends] == [(p, ENGINE_PORT) for p in pods]  # type: ignore[union-attr]
    served = k8s_config("guardstream-detectors-config", "detectors.yaml")["detectors"]
    det_svc = K8S[("Service", "guardstream-detectors")]["spec"]
    assert det_svc["ports"] == [
        {"name": "http", "port": DETECTORS_PORT, "targetPort": DETECTORS_PORT}
    ]
    remote = {d: c for d, c in config.detectors.items() if c.url is not None}
    assert sorted(remote) == REMOTE_BUILTINS
    assert {d: c.judges for d, c in remote.items()} == REMOTE_JUDGES
    for detector_id, det in remote.items():
        assert det.url is not None
        assert host_port(det.url) == ("guardstream-detectors", DETECTORS_PORT)
        assert detector_id in served


def test_k8s_engine_requests_a_gpu_and_probes_health() -> None:
    c = k8s_container("StatefulSet", "guardstream-engine")
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["ports"] == [{"name": "http", "containerPort": ENGINE_PORT}]
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": ENGINE_PORT}
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": ENGINE_PORT}
    assert c["image"] == "guardstream:cuda"


def test_k8s_detectors_wiring() -> None:
    c = k8s_container("Deployment", "guardstream-detectors")
    assert c["ports"] == [{"name": "http", "containerPort": DETECTORS_PORT}]
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": DETECTORS_PORT}
    assert c["volumeMounts"] == [
        {"name": "config", "mountPath": str(Path(DETECTORS_CONFIG_PATH).parent)},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    spec = K8S[("Deployment", "guardstream-detectors")]["spec"]["template"]["spec"]
    assert spec["volumes"] == [
        {"name": "config", "configMap": {"name": "guardstream-detectors-config"}},
        {"name": "tmp", "emptyDir": {}},
    ]
    assert list(K8S[("ConfigMap", "guardstream-detectors-config")]["data"]) == [
        Path(DETECTORS_CONFIG_PATH).name
    ]


def test_k8s_pods_run_as_the_image_user() -> None:
    uid = int(re.search(r"useradd .*--uid (\d+) .*guardstream", DOCKERFILE)[1])  # type: ignore[index]
    for kind, name in [
        ("Deployment", "guardstream-orchestrator"),
        ("Deployment", "guardstream-detectors"),
        ("StatefulSet", "guardstream-engine"),
    ]:
        ctx = K8S[(kind, name)]["spec"]["template"]["spec"]["securityContext"]
        assert ctx == {"runAsNonRoot": True, "runAsUser": uid}, name


# -- keys: required by every engine and detector service, from Secrets / env files only -----------


def compose_key_envs(service: str, secrets: Path) -> dict[str, str]:
    """{variable: env file} of a compose service, with the files make-secrets.sh wrote."""
    out: dict[str, str] = {}
    for entry in COMPOSE["services"][service].get("env_file", []):
        assert isinstance(entry, str) and entry.startswith("secrets/"), (service, entry)
        for line in (secrets / Path(entry).name).read_text().splitlines():
            name, _, _ = line.partition("=")
            assert name not in out, (service, name)
            out[name] = entry
    return out


def k8s_env(kind: str, name: str) -> dict[str, Any]:
    return {e["name"]: e for e in k8s_container(kind, name).get("env", [])}


def detector_service_key_env(config: dict[str, Any]) -> str | None:
    return (config.get("server") or {}).get("api_keys_env")


def orchestrator_sends(config: Config) -> dict[str, str | None]:
    """{downstream host: the api_key_env the orchestrator sends it} for every engine and remote
    detector the config names."""
    out: dict[str, str | None] = {}
    for model in config.models.values():
        for b in model.backends:
            assert b.type == "native"
            out[host_port(b.url)[0]] = b.api_key_env
    for det in config.detectors.values():
        if det.url is not None:
            out[host_port(det.url)[0]] = det.api_key_env
    return out


def orchestrator_key_envs(config: Config) -> set[str]:
    """Every variable the orchestrator reads a key from: its clients' and the downstream ones."""
    names = {config.server.api_keys_env, *orchestrator_sends(config).values()}
    return {n for n in names if n is not None}


@pytest.fixture(scope="module")
def secrets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What `sh deploy/make-secrets.sh DIR` writes, as an operator would run it."""
    out = tmp_path_factory.mktemp("secrets") / "secrets"
    subprocess.run(["sh", str(DEPLOY / "make-secrets.sh"), str(out)], check=True, timeout=30)
    return out


def test_make_secrets_writes_one_random_key_per_file_and_never_replaces_one(
    secrets: Path, tmp_path: Path
) -> None:
    files = {p.name: p.read_text() for p in sorted(secrets.iterdir())}
    assert {n: t.partition("=")[0] for n, t in files.items()} == {
        "orchestrator.env": CLIENT_KEYS_ENV,
        "engine.env": ENGINE_KEY_ENV,
        "detectors.env": DETECTORS_KEY_ENV,
        "grafana.env": "GF_SECURITY_ADMIN_PASSWORD",
    }
    keys = [t.partition("=")[2] for t in files.values()]
    assert all(re.fullmatch(r"[0-9a-f]{64}\n", k) for k in keys), keys  # 32 bytes, one line
    assert len(set(keys)) == len(keys)
    for path in secrets.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path  # the owner's only
    # a second run keeps every key (a running deployment's keys never change under it) ...
    again = subprocess.run(
        ["sh", str(DEPLOY / "make-secrets.sh"), str(secrets)],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert {p.name: p.read_text() for p in secrets.iterdir()} == files
    assert again.stdout.count("kept ") == 4
    # ... and a deleted file gets a new key, the others stay
    (secrets / "engine.env").unlink()
    subprocess.run(["sh", str(DEPLOY / "make-secrets.sh"), str(secrets)], check=True, timeout=30)
    assert (secrets / "engine.env").read_text() != files["engine.env"]
    assert (secrets / "detectors.env").read_text() == files["detectors.env"]
    # the default folder is deploy/secrets, where git ignores everything the script writes
    for name in files:
        rel = f"deploy/secrets/{name}"
        assert subprocess.run(["git", "check-ignore", "-q", rel], cwd=ROOT).returncode == 0, rel
    kept = subprocess.run(["git", "check-ignore", "-q", "deploy/secrets/.gitignore"], cwd=ROOT)
    assert kept.returncode == 1


def test_compose_engines_and_detector_service_require_the_key_the_orchestrator_sends(
    secrets: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = load_config(DEPLOY / "config.compose.yaml")
    assert config.server.api_keys_env == CLIENT_KEYS_ENV  # clients need a key too
    required = {}
    for name in ("engine-0", "engine-1"):
        _, args = parse_command(COMPOSE["services"][name]["command"], monkeypatch)
        required[name] = args.api_keys_env
    detectors_cfg = detector_service.load_config(DEPLOY / "detectors.yaml")
    required["detectors"] = detector_service_key_env(detectors_cfg)
    assert required == {
        "engine-0": ENGINE_KEY_ENV,
        "engine-1": ENGINE_KEY_ENV,
        "detectors": DETECTORS_KEY_ENV,
    }
    # the orchestrator sends each service the key that service requires
    assert orchestrator_sends(config) == required
    # every service gets exactly the variables it reads, from the git-ignored env files; and the
    # orchestrator reads the engine's and the detector service's from the very same files
    orchestrator_envs = compose_key_envs("orchestrator", secrets)
    assert orchestrator_envs == {
        CLIENT_KEYS_ENV: "secrets/orchestrator.env",
        ENGINE_KEY_ENV: "secrets/engine.env",
        DETECTORS_KEY_ENV: "secrets/detectors.env",
    }
    assert set(orchestrator_envs) == orchestrator_key_envs(config)
    for name, env in required.items():
        assert compose_key_envs(name, secrets) == {env: orchestrator_envs[env]}, name
    assert compose_key_envs("grafana", secrets) == {
        "GF_SECURITY_ADMIN_PASSWORD": "secrets/grafana.env"
    }
    # no key, nor any other variable, is written into the compose file itself
    for name, svc in COMPOSE["services"].items():
        assert "environment" not in svc, name


def test_k8s_engines_and_detector_service_require_the_key_the_orchestrator_sends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = parse_config(k8s_config("guardstream-config", "config.yaml"))
    assert config.server.api_keys_env == CLIENT_KEYS_ENV
    _, engine_args = parse_command(
        k8s_container("StatefulSet", "guardstream-engine")["command"], monkeypatch
    )
    detectors_cfg = k8s_config("guardstream-detectors-config", "detectors.yaml")
    sts = K8S[("StatefulSet", "guardstream-engine")]["spec"]
    required = {
        f"guardstream-engine-{i}.guardstream-engine": engine_args.api_keys_env
        for i in range(sts["replicas"])
    }
    required["guardstream-detectors"] = detector_service_key_env(detectors_cfg)
    assert set(required.values()) == {ENGINE_KEY_ENV, DETECTORS_KEY_ENV}
    assert orchestrator_sends(config) == required
    secret_refs = {
        ("Deployment", "guardstream-orchestrator"): orchestrator_key_envs(config),
        ("StatefulSet", "guardstream-engine"): {ENGINE_KEY_ENV},
        ("Deployment", "guardstream-detectors"): {DETECTORS_KEY_ENV},
    }
    seen: dict[str, Any] = {}
    for (kind, name), names in secret_refs.items():
        env = k8s_env(kind, name)
        assert set(env) == names, name  # exactly the variables the process reads
        for var, entry in env.items():
            # from a Secret, never a literal value
            assert set(entry) == {"name", "valueFrom"}, (name, var)
            assert set(entry["valueFrom"]) == {"secretKeyRef"}, (name, var)
            ref = entry["valueFrom"]["secretKeyRef"]
            assert set(ref) == {"name", "key"} and "optional" not in ref
            # the side that requires a key and the side that sends it read the same entry
            assert seen.setdefault(var, ref) == ref, var
    assert seen == {
        CLIENT_KEYS_ENV: {"name": "guardstream-api-keys", "key": "keys"},
        ENGINE_KEY_ENV: {"name": "guardstream-internal-keys", "key": "engine"},
        DETECTORS_KEY_ENV: {"name": "guardstream-internal-keys", "key": "detectors"},
    }
    # no Secret ships with the manifests: the operator creates them (orchestrator.yaml says how),
    # and until then the pods do not start, rather than start with a published key
    assert not [k for k in K8S if k[0] == "Secret"]
    header = (DEPLOY / "k8s" / "orchestrator.yaml").read_text()
    for ref in seen.values():
        assert f"kubectl create secret generic {ref['name']}" in header
        assert f"--from-literal={ref['key']}=" in header


# -- NetworkPolicy: evaluated with Kubernetes' ingress rules ------------------------------------

APP_NAMESPACE = "guardstream"  # wherever the manifests are applied; the policies name no namespace
MONITORING_NAMESPACE = "monitoring"
PROMETHEUS_LABELS = {"app.kubernetes.io/name": "prometheus"}  # the Prometheus Operator's pods


@dataclass(frozen=True)
class Pod:
    labels: dict[str, str]
    namespace: str = APP_NAMESPACE
    ports: dict[str, int] = field(default_factory=dict)  # named container ports

    @property
    def namespace_labels(self) -> dict[str, str]:
        # every namespace carries this label (Kubernetes >= 1.21)
        return {"kubernetes.io/metadata.name": self.namespace}


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions) against labels; {} selects all."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def peer_matches(peer: dict[str, Any], src: Pod) -> bool:
    """One `from` entry: podSelector alone means the policy's namespace; with a
    namespaceSelector, pods of the selected namespaces; a namespaceSelector alone, all of them."""
    assert "ipBlock" not in peer, "pods are selected by labels, never by address"
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], src.namespace_labels):
            return False
    elif src.namespace != APP_NAMESPACE:
        return False
    return selects(peer.get("podSelector") or {}, src.labels)


def port_matches(rule: dict[str, Any], dst: Pod, port: int) -> bool:
    if not rule.get("ports"):
        return True  # no ports: every port
    for p in rule["ports"]:
        assert p.get("protocol", "TCP") == "TCP"
        number = dst.ports[p["port"]] if isinstance(p["port"], str) else p["port"]
        if number <= port <= p.get("endPort", number):
            return True
    return False


def may_connect(src: Pod, dst: Pod, port: int) -> bool:
    """Whether the NetworkPolicies of the manifests let `src` open a TCP connection to `dst`:port
    (a pod selected by no Ingress policy accepts everything; otherwise some rule of a policy that
    selects it must match both the peer and the port)."""
    policies = [doc for (kind, _), doc in K8S.items() if kind == "NetworkPolicy"]
    if dst.namespace != APP_NAMESPACE:
        return True
    isolating = [
        p
        for p in policies
        if selects(p["spec"]["podSelector"], dst.labels)
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
    ]
    if not isolating:
        return True
    return any(
        port_matches(rule, dst, port)
        and (not rule.get("from") or any(peer_matches(peer, src) for peer in rule["from"]))
        for p in isolating
        for rule in p["spec"].get("ingress") or []
    )


def workload_pod(kind: str, name: str) -> Pod:
    template = K8S[(kind, name)]["spec"]["template"]
    (container,) = template["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    return Pod(dict(template["metadata"]["labels"]), ports=ports)


def test_only_the_orchestrator_and_prometheus_reach_the_engines_and_detector_service() -> None:
    orchestrator = workload_pod("Deployment", "guardstream-orchestrator")
    engine = workload_pod("StatefulSet", "guardstream-engine")
    detectors = workload_pod("Deployment", "guardstream-detectors")
    prometheus = Pod(PROMETHEUS_LABELS, MONITORING_NAMESPACE)
    stranger = Pod({"app": "something-else"})
    for dst, port in [(engine, ENGINE_PORT), (detectors, DETECTORS_PORT)]:
        assert may_connect(orchestrator, dst, port)
        assert may_connect(prometheus, dst, port)  # the /metrics scrape
        # no one else: not the other backends, not another replica, not a pod in the namespace
        assert not may_connect(engine, dst, port)
        assert not may_connect(detectors, dst, port)
        assert not may_connect(stranger, dst, port)
        assert not may_connect(Pod({}), dst, port)
        # labels alone do not do it: Prometheus' label outside `monitoring`, the orchestrator's
        # label in another namespace, any other pod in `monitoring`
        assert not may_connect(Pod(PROMETHEUS_LABELS), dst, port)
        assert not may_connect(Pod(orchestrator.labels, "elsewhere"), dst, port)
        assert not may_connect(Pod({"app": "grafana"}, MONITORING_NAMESPACE), dst, port)
        # and only on the service's port
        assert not may_connect(orchestrator, dst, port + 1)
        assert not may_connect(prometheus, dst, port + 1)
    # the orchestrator's own port stays open to clients, wherever they are
    for src in [stranger, prometheus, Pod({}, "elsewhere"), engine]:
        assert may_connect(src, orchestrator, ORCHESTRATOR_PORT)


def test_network_policies_select_the_backend_pods_by_their_workloads_labels() -> None:
    orchestrator_labels = K8S[("Deployment", "guardstream-orchestrator")]["spec"]["template"][
        "metadata"
    ]["labels"]
    for kind, name, port in [
        ("StatefulSet", "guardstream-engine", ENGINE_PORT),
        ("Deployment", "guardstream-detectors", DETECTORS_PORT),
    ]:
        spec = K8S[("NetworkPolicy", name)]["spec"]
        # the workload's own selector, so a new replica is covered the moment it exists
        assert spec["podSelector"] == K8S[(kind, name)]["spec"]["selector"]
        assert spec["policyTypes"] == ["Ingress"]
        rules = spec["ingress"]
        assert [r["ports"] for r in rules] == [[{"protocol": "TCP", "port": port}]] * 2
        assert rules[0]["from"] == [{"podSelector": {"matchLabels": orchestrator_labels}}]
        assert rules[1]["from"] == [
            {
                "namespaceSelector": {
                    "matchLabels": {"kubernetes.io/metadata.name": MONITORING_NAMESPACE}
                },
                "podSelector": {"matchLabels": PROMETHEUS_LABELS},
            }
        ]


# -- monitoring: Prometheus scrape targets, ServiceMonitor, Grafana provisioning ----------------

METRICS_PORTS = {
    "orchestrator": ORCHESTRATOR_PORT,
    "engine-0": ENGINE_PORT,
    "engine-1": ENGINE_PORT,
    "detectors": DETECTORS_PORT,
}


def test_metrics_is_a_route_of_every_app(tiny_model: models.LoadedModel) -> None:
    assert "/metrics" in get_routes(orchestrator_app(parse_config({})))
    assert "/metrics" in get_routes(detector_service.create_app({}))
    assert "/metrics" in get_routes(engine_app(tiny_model))


def test_compose_prometheus_scrapes_every_guardstream_process() -> None:
    jobs = {job["job_name"]: job for job in PROMETHEUS["scrape_configs"]}
    targets = {
        target
        for job in jobs.values()
        for static in job["static_configs"]
        for target in static["targets"]
    }
    assert targets == {f"{name}:{port}" for name, port in METRICS_PORTS.items()}
    for job in jobs.values():
        assert job.get("metrics_path", "/metrics") == "/metrics"
        assert job.get("scheme", "http") == "http"
        assert "authorization" not in job  # /metrics needs no key (tests/test_deploy_dashboard.py)
    prom = COMPOSE["services"]["prometheus"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    assert "./prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prom["volumes"]
    assert (DEPLOY / "prometheus" / "prometheus.yml").is_file()


def test_compose_networks_keep_the_backends_private() -> None:
    services = COMPOSE["services"]
    assert COMPOSE["networks"] == {"default": {}, "backend": {"internal": True}}
    for name in ("engine-0", "engine-1", "detectors"):
        # only on the internal network, nothing published: the orchestrator and Prometheus
        # reach them, the host and the outside world do not, and they reach nothing outside
        assert services[name]["networks"] == ["backend"], name
        assert "ports" not in services[name], name
    assert services["orchestrator"]["networks"] == ["default", "backend"]
    assert services["prometheus"]["networks"] == ["default", "backend"]
    assert services["grafana"]["networks"] == ["default"]
    # the monitoring UIs are published on the host's loopback only
    assert services["prometheus"]["ports"] == ["127.0.0.1:9090:9090"]
    assert services["grafana"]["ports"] == ["127.0.0.1:3000:3000"]


def test_compose_grafana_provisions_the_dashboard_on_the_compose_prometheus() -> None:
    grafana = COMPOSE["services"]["grafana"]
    mounts = {}
    for volume in grafana["volumes"]:
        host, container, *_ = volume.split(":")
        mounts[container] = host
    assert mounts["/etc/grafana/provisioning"] == "./grafana/provisioning"
    (datasource,) = yaml.safe_load(
        (GRAFANA_PROVISIONING / "datasources" / "prometheus.yaml").read_text()
    )["datasources"]
    assert (datasource["type"], datasource["url"]) == ("prometheus", "http://prometheus:9090")
    assert datasource["isDefault"] is True
    (provider,) = yaml.safe_load(
        (GRAFANA_PROVISIONING / "dashboards" / "guardstream.yaml").read_text()
    )["providers"]
    assert provider["type"] == "file"
    dashboards = {
        c: h for c, h in mounts.items() if c.startswith(provider["options"]["path"] + "/")
    }
    assert dashboards == {"/etc/grafana/dashboards/guardstream.json": "./grafana/guardstream.json"}
    dashboard = json.loads((DEPLOY / "grafana" / "guardstream.json").read_text())
    # the dashboard's data source is a variable of type prometheus: the provisioned default here,
    # whichever Prometheus a Kubernetes Grafana has
    (variable,) = dashboard["templating"]["list"]
    assert (variable["type"], variable["query"]) == ("datasource", "prometheus")


def test_service_monitor_scrapes_every_service_that_the_network_policies_let_it_reach() -> None:
    monitor = MONITORING[("ServiceMonitor", "guardstream")]["spec"]
    services = {
        name: doc
        for (kind, name), doc in K8S.items()
        if kind == "Service" and selects(monitor["selector"], doc["metadata"].get("labels", {}))
    }
    assert sorted(services) == ["guardstream", "guardstream-detectors", "guardstream-engine"]
    (endpoint,) = monitor["endpoints"]
    assert endpoint["path"] == "/metrics" and "bearerTokenSecret" not in endpoint
    prometheus = Pod(PROMETHEUS_LABELS, MONITORING_NAMESPACE)
    workloads = {
        "guardstream": ("Deployment", "guardstream-orchestrator"),
        "guardstream-engine": ("StatefulSet", "guardstream-engine"),
        "guardstream-detectors": ("Deployment", "guardstream-detectors"),
    }
    for name, svc in services.items():
        (port,) = [p for p in svc["spec"]["ports"] if p["name"] == endpoint["port"]]
        pod = workload_pod(*workloads[name])
        assert selects({"matchLabels": svc["spec"]["selector"]}, pod.labels)
        assert may_connect(prometheus, pod, port["targetPort"]), name


def test_guardstream_cache_is_where_the_image_prepared_the_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    envs = [args for instr, args in dockerfile_instructions() if instr == "ENV"]
    caches = [re.search(r"GUARDSTREAM_CACHE=(\S+)", e)[1] for e in envs if "GUARDSTREAM_CACHE" in e]  # type: ignore[index]
    assert caches == ["/opt/guardstream-cache", "/opt/guardstream-cache"]  # build and runtime
    monkeypatch.setenv("GUARDSTREAM_CACHE", caches[0])
    assert models.cache_root() == Path(caches[0])
    assert "RUN /opt/venv/bin/python -m generation prepare smollm2-135m" in DOCKERFILE
    # owned by the image's user, group 0: see test_model_cache_is_readable_by_any_uid_in_group_0
    assert f"COPY --from=build --chown=10001:0 {caches[0]} {caches[0]}" in DOCKERFILE


# -- the Dockerfile ------------------------------------------------------------------------------


def test_dockerfile_is_multi_stage_with_a_cuda_base_arg_and_a_non_root_user() -> None:
    instructions = dockerfile_instructions()
    froms = [args for instr, args in instructions if instr == "FROM"]
    assert froms == [
        "${BUILD_IMAGE} AS build",
        "${BASE_IMAGE} AS python-for-base",
        "${BASE_IMAGE} AS runtime",
    ]
    assert "ARG BASE_IMAGE=python:3.11-slim" in DOCKERFILE
    assert "--build-arg BASE_IMAGE=nvidia/cuda:" in DOCKERFILE  # the documented CUDA build
    assert "--build-arg TORCH_VARIANT=cu" in DOCKERFILE
    assert "download.pytorch.org/whl/${TORCH_VARIANT}" in DOCKERFILE
    # numeric, so that Kubernetes' runAsNonRoot can tell it is not root
    users = [args for instr, args in instructions if instr == "USER"]
    assert users == ["10001"]
    runtime = instructions[instructions.index(("FROM", froms[2])) :]
    assert ("USER", "10001") in runtime
    assert [i for i, _ in runtime].index("USER") < [i for i, _ in runtime].index("CMD")
    assert any(i == "COPY" and a.startswith("--from=build /opt/venv") for i, a in runtime)
    # the venv's interpreter comes along where the base lacks it (a CUDA base, Ubuntu 24.04,
    # has no python3.11 package), and only the files it lacks: no second /usr/local on the
    # default base (test_runtime_gets_only_the_python_files_its_base_lacks)
    assert ("COPY", "--from=python-for-base /opt/python-extra /usr/local") in runtime
    assert not any(i == "COPY" and a.startswith("--from=build /usr/local") for i, a in runtime)


def test_dockerfile_installs_the_makefile_requirements() -> None:
    make = pip_requirement_installs([ln for ln in MAKEFILE.splitlines() if "pip install" in ln])
    assert make == {
        "requirements.txt": False,
        "requirements-dev.txt": False,
        "requirements-nodeps.txt": True,
    }
    runs = [args for instr, args in dockerfile_instructions() if instr == "RUN"]
    docker = pip_requirement_installs(runs)
    # the image has no test tools; everything else is installed the same way
    assert docker == {k: v for k, v in make.items() if k != "requirements-dev.txt"}
    # torch is pinned in the same file, so the same pip command, as transformers
    pins = requirement_pins("requirements.txt")
    assert pins["torch"] == "2.13.0"
    assert pins["transformers"]
    (install,) = [r for r in runs if "-r requirements.txt" in r]
    assert "requirements-nodeps.txt" in install.split("&&")[1]
    assert any("pip install --no-deps --no-build-isolation ." in r for r in runs)


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


def ignored(path: str, patterns: list[str]) -> bool:
    parts = Path(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        pat = pattern.removeprefix("**/")
        for prefix in prefixes:
            if fnmatch.fnmatch(prefix, pattern) or (
                pattern.startswith("**/") and fnmatch.fnmatch(Path(prefix).name, pat)
            ):
                return True
    return False


def test_dockerfile_copies_files_that_exist_and_are_not_dockerignored() -> None:
    patterns = dockerignore_patterns()
    sources = []
    for instr, args in dockerfile_instructions():
        if instr == "COPY" and not args.startswith("--from"):
            *srcs, _dest = args.split()
            sources += srcs
    assert sources == [
        "requirements.txt",
        "requirements-nodeps.txt",
        "pyproject.toml",
        "README.md",
        "orchestrator",
        "chunkers",
        "detectors",
        "generation",
        "servicekit",
        "config.yaml",
    ]
    for src in sources:
        assert (ROOT / src).exists(), src
        assert not ignored(src, patterns), src
    assert ignored("tests", patterns) and ignored("orchestrator/__pycache__", patterns)
    assert not ignored("orchestrator/app.py", patterns)


def test_dockerfile_default_command_serves_the_bundled_config() -> None:
    assert f"COPY config.yaml {CONFIG_PATH}" in DOCKERFILE
    cmd = json.loads(next(a for i, a in dockerfile_instructions() if i == "CMD"))
    assert cmd == [
        "python",
        "-m",
        "orchestrator",
        "serve",
        "--config",
        CONFIG_PATH,
        "--port",
        str(ORCHESTRATOR_PORT),
    ]


# -- issue 28: what the first real build and run found -------------------------------------------


def dockerfile_run(marker: str) -> str:
    """The one RUN instruction whose command contains `marker`."""
    (run,) = [a for i, a in dockerfile_instructions() if i == "RUN" and marker in a]
    return run


def shutdown_budget_s(config: Config) -> float:
    """The longest a SIGTERM'd orchestrator runs: the drain, then the streams that are left end
    with server_shutdown (SHUTDOWN_GRACE_S), then aiohttp's cleanup (CLEANUP_GRACE_S). With
    server.workers > 1 the supervisor waits up to drain + WORKER_EXIT_GRACE_S for its workers."""
    drain = config.server.drain_timeout_s
    if worker_count(config.server.workers) > 1:
        return drain + WORKER_EXIT_GRACE_S
    return drain + SHUTDOWN_GRACE_S + CLEANUP_GRACE_S


def duration_s(text: str) -> float:
    """A compose duration (`45s`, `1m30s`)."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, text
    return sum(float(n) * units[u] for n, u in parts)


def test_compose_gives_the_orchestrator_longer_than_its_drain_to_stop() -> None:
    # compose's default is 10 s: `stop` SIGKILLed a draining orchestrator, exit 137, and its
    # streams ended without a terminal event (issue 28)
    config = load_config(DEPLOY / "config.compose.yaml")
    assert config.server.drain_timeout_s == 30
    grace = duration_s(COMPOSE["services"]["orchestrator"]["stop_grace_period"])
    assert grace > shutdown_budget_s(config)
    assert grace == 45
    # nothing else holds streams; the others stop after the orchestrator (depends_on)
    assert set(COMPOSE["services"]["orchestrator"]["depends_on"]) == {
        "engine-0",
        "engine-1",
        "detectors",
    }
    # the stop signal is the one the orchestrator drains on
    assert ("STOPSIGNAL", "SIGTERM") in dockerfile_instructions()


def test_k8s_gives_the_orchestrator_its_prestop_wait_and_drain_before_the_kill() -> None:
    spec = K8S[("Deployment", "guardstream-orchestrator")]["spec"]["template"]["spec"]
    container = k8s_container("Deployment", "guardstream-orchestrator")
    config = parse_config(k8s_config("guardstream-config", "config.yaml"))
    # preStop runs first (the endpoints controller takes the pod out of the Service meanwhile),
    # then SIGTERM; terminationGracePeriodSeconds counts from the start of preStop
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop_s = float(command[1])
    assert pre_stop_s >= 5
    grace = spec["terminationGracePeriodSeconds"]
    assert grace > pre_stop_s + shutdown_budget_s(config)
    assert (pre_stop_s, config.server.drain_timeout_s, grace) == (5, 25, 45)
    # and while it drains, readiness is false (/info answers 503): tests/test_orchestrator_capacity.py
    assert container["readinessProbe"]["httpGet"]["path"] == "/info"


def test_k8s_orchestrator_has_a_disruption_budget_over_its_own_pods() -> None:
    pdb = K8S[("PodDisruptionBudget", "guardstream-orchestrator")]["spec"]
    deployment = K8S[("Deployment", "guardstream-orchestrator")]["spec"]
    assert pdb["selector"] == deployment["selector"]
    # maxUnavailable, not minAvailable: a budget of minAvailable 1 on a single replica would
    # block every node drain; one pod at a time drains its streams
    assert pdb == {"maxUnavailable": 1, "selector": deployment["selector"]}


def test_model_cache_is_readable_by_any_uid_in_group_0(tmp_path: Path) -> None:
    """OpenShift runs containers as an arbitrary UID in group 0: `--user 12345:0` failed to load
    model.safetensors, created 0600 for uid 10001 (issue 28). The Dockerfile's permission step,
    run here on a tree made the way `generation prepare` makes it."""
    run = dockerfile_run("chmod -R g=u")
    assert run == ("chgrp -R 0 /opt/guardstream-cache && chmod -R g=u /opt/guardstream-cache")
    # it runs after the model was prepared, in the build stage, and the COPY keeps group 0
    runs = [a for i, a in dockerfile_instructions() if i == "RUN"]
    assert (
        runs.index(run) == runs.index("/opt/venv/bin/python -m generation prepare smollm2-135m") + 1
    )
    cache = tmp_path / "opt" / "guardstream-cache"
    folder = cache / "models" / "smollm2-135m-instruct-v1"
    folder.mkdir(parents=True, mode=0o700)
    weights = folder / "model.safetensors"
    weights.write_bytes(b"weights")
    weights.chmod(0o600)
    (cache / "models").chmod(0o700)
    if os.geteuid() != 0:
        pytest.skip("chgrp 0 needs root")
    os.chown(weights, 10001, 10001)
    subprocess.run(
        ["sh", "-c", run.replace("/opt/guardstream-cache", str(cache))], check=True, timeout=30
    )
    for path in [cache, cache / "models", folder, weights]:
        st = path.stat()
        assert st.st_gid == 0, path
        mode = stat.S_IMODE(st.st_mode)
        assert (mode >> 3) & 0o7 == (mode >> 6) & 0o7, (path, oct(mode))  # group = owner
    assert stat.S_IMODE(weights.stat().st_mode) == 0o660
    assert stat.S_IMODE(folder.stat().st_mode) & 0o050 == 0o050  # group may list and enter
    # the image's user is in group 0 too, and its home is group 0's as well
    assert re.search(r"useradd --create-home --uid 10001 --gid 0 guardstream", DOCKERFILE)
    assert "chmod g=u /home/guardstream" in DOCKERFILE


@pytest.fixture
def fake_venv(tmp_path: Path) -> tuple[Path, Path]:
    """A bin folder whose `python` prints $FAKE_TORCH for `import torch; print(version)` and
    whose `pip list --format=freeze` prints the file $FAKE_PIP_LIST; and that file."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text('#!/bin/sh\necho "$FAKE_TORCH"\n')
    (bin_dir / "pip").write_text('#!/bin/sh\ncat "$FAKE_PIP_LIST"\n')
    for exe in bin_dir.iterdir():
        exe.chmod(0o755)
    return bin_dir, tmp_path / "pip-list.txt"


@pytest.mark.parametrize(
    ("variant", "torch", "packages", "ok"),
    [
        ("cpu", "2.13.0+cpu", ["torch==2.13.0+cpu", "numpy==2.4.6"], True),
        # download.pytorch.org unreachable: pip fell back to PyPI's CUDA build (issue 28)
        ("cpu", "2.13.0", ["torch==2.13.0", "nvidia-cudnn-cu13==9.1", "cuda-toolkit==13.0"], False),
        ("cpu", "2.13.0+cu128", ["torch==2.13.0+cu128"], False),
        # the right version string, but CUDA packages came along anyway
        ("cpu", "2.13.0+cpu", ["torch==2.13.0+cpu", "triton==3.5.0"], False),
        ("cu128", "2.13.0+cu128", ["torch==2.13.0+cu128", "nvidia-cudnn-cu12==9.1"], True),
        ("cu128", "2.13.0+cpu", ["torch==2.13.0+cpu"], False),
        ("cu128", "2.13.0", ["torch==2.13.0"], False),
    ],
)
def test_build_fails_loudly_when_torch_is_not_the_requested_variant(
    fake_venv: tuple[Path, Path], variant: str, torch: str, packages: list[str], ok: bool
) -> None:
    """The Dockerfile's check, run as the build runs it (sh, TORCH_VARIANT from the ARG)."""
    run = dockerfile_run("torch.__version__")
    bin_dir, pip_list = fake_venv
    pip_list.write_text("".join(p + "\n" for p in packages))
    result = subprocess.run(
        ["sh", "-c", run.replace("/opt/venv/bin/", f"{bin_dir}/")],
        env={
            "PATH": os.environ["PATH"],
            "TORCH_VARIANT": variant,
            "TORCH_INDEX_URL": f"https://download.pytorch.org/whl/{variant}",
            "FAKE_TORCH": torch,
            "FAKE_PIP_LIST": str(pip_list),
        },
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert (result.returncode == 0) == ok, result.stderr
    if ok:
        assert result.stdout == f"torch {torch} ({variant})\n"
    else:
        assert result.stderr.startswith("ERROR: ")
    # the check comes right after the install, before anything else uses torch
    runs = [a for i, a in dockerfile_instructions() if i == "RUN"]
    assert "-r requirements.txt" in runs[runs.index(run) - 1]
    assert "ARG TORCH_VARIANT=cpu" in DOCKERFILE
    # a mirror or local index can stand in for download.pytorch.org (issue 41 item 6)
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}" in DOCKERFILE
    assert '--extra-index-url "${TORCH_INDEX_URL}"' in runs[runs.index(run) - 1]


def test_runtime_gets_only_the_python_files_its_base_lacks(tmp_path: Path) -> None:
    """`COPY --from=build /usr/local /usr/local` duplicated 51 MB of python:3.11-slim (issue
    28). The python-for-base stage's diff, run on two trees: a base with the same Python gets
    nothing; a base without one (CUDA) gets all of it; files that differ come along."""
    run = dockerfile_run("/opt/python-extra")

    def tree(root: Path, files: dict[str, str], links: dict[str, str]) -> None:
        for rel, text in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
        for rel, target in links.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).symlink_to(target)

    python_files = {
        "bin/python3.11": "ELF python",
        "lib/libpython3.11.so.1.0": "ELF lib",
        "lib/python3.11/os.py": "import abc",
        "lib/python3.11/__pycache__/os.cpython-311.pyc": "bytecode",
    }
    python_links = {"bin/python3": "python3.11", "bin/python": "python3"}

    def diff(base_files: dict[str, str], base_links: dict[str, str]) -> dict[str, str]:
        work = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
        src, base, out = work / "build-usrlocal", work / "usrlocal", work / "python-extra"
        tree(src, python_files, python_links)
        base.mkdir(parents=True)
        tree(base, base_files, base_links)
        script = (
            run.replace("/opt/build-usrlocal", str(src))
            .replace("/usr/local", str(base))
            .replace("/opt/python-extra", str(out))
        )
        subprocess.run(["sh", "-c", script], check=True, capture_output=True, timeout=30)
        found = {}
        for path in sorted(out.rglob("*")):
            if path.is_symlink():
                found[str(path.relative_to(out))] = "-> " + os.readlink(path)
            elif path.is_file():
                found[str(path.relative_to(out))] = path.read_text()
        return found

    # python:3.11-slim on both sides: only the bytecode the build wrote (the official images
    # ship without .pyc files) comes along
    same = {k: v for k, v in python_files.items() if "__pycache__" not in k}
    assert diff(same, python_links) == {"lib/python3.11/__pycache__/os.cpython-311.pyc": "bytecode"}
    # a base without Python (nvidia/cuda on Ubuntu 24.04): everything, links as links
    assert diff({"bin/other-tool": "x"}, {}) == {
        **python_files,
        **{k: "-> " + v for k, v in python_links.items()},
    }
    # a different python3.11 in the base, a link pointing elsewhere: replaced
    changed = {**same, "bin/python3.11": "ELF another python"}
    assert diff(changed, {"bin/python3": "python3.11", "bin/python": "python3.12"}) == {
        "bin/python": "-> python3",
        "bin/python3.11": "ELF python",
        "lib/python3.11/__pycache__/os.cpython-311.pyc": "bytecode",
    }


def test_image_leaves_out_what_nothing_imports() -> None:
    run = dockerfile_run("torch/test")
    site = "/opt/venv/lib/python3.11/site-packages/torch"
    # the headers serve C++ extensions (none here) and torch.compile's C++ code: the engine's
    # `--compile` (CUDA) needs them, so only a CPU image drops them
    assert run.split() == [
        "rm", "-rf", f"{site}/test;",
        "if", "[", '"$TORCH_VARIANT"', "=", '"cpu"', "];",
        "then", "rm", "-rf", f"{site}/include;", "fi",
    ]  # fmt: skip
    for package in ("orchestrator", "generation", "detectors", "chunkers"):
        for path in (ROOT / package).rglob("*.py"):
            assert "cpp_extension" not in path.read_text(), path
    # no test tools in the image (requirements-dev.txt is not installed), no pip cache
    assert "requirements-dev.txt" not in DOCKERFILE
    assert "PIP_NO_CACHE_DIR=1" in DOCKERFILE


def kustomized_images() -> dict[str, tuple[str, str | None]]:
    """{workload: (image, imagePullPolicy)} after kustomization.yaml's `images:`, applied with
    kustomize's rule (an entry matches the image's name without its tag; newName replaces the
    name, newTag the tag)."""
    rules = {entry["name"]: entry for entry in KUSTOMIZATION["images"]}
    out = {}
    for (kind, name), doc in K8S.items():
        if kind not in ("Deployment", "StatefulSet"):
            continue
        (container,) = doc["spec"]["template"]["spec"]["containers"]
        image_name, _, tag = container["image"].partition(":")
        rule = rules.get(image_name, {})
        image = rule.get("newName", image_name) + ":" + rule.get("newTag", tag)
        out[name] = (image, container.get("imagePullPolicy"))
    return out


def registry_qualified(image: str) -> bool:
    """Docker's rule: the first path component names a registry when it has a dot or a port, or
    is localhost; otherwise the image is docker.io/library/... (which is where the kubelet went
    for `guardstream:latest`, issue 28)."""
    first, sep, _ = image.partition("/")
    return bool(sep) and ("." in first or ":" in first or first == "localhost")


def test_k8s_images_are_registry_qualified_in_one_place() -> None:
    assert KUSTOMIZATION["kind"] == "Kustomization"
    # the kustomization applies every manifest of the folder
    assert sorted(KUSTOMIZATION["resources"]) == [p.name for p in K8S_FILES]
    assert [e["name"] for e in KUSTOMIZATION["images"]] == ["guardstream"]
    images = kustomized_images()
    assert images == {
        "guardstream-orchestrator": ("registry.example.com/guardstream:cpu", "IfNotPresent"),
        "guardstream-detectors": ("registry.example.com/guardstream:cpu", "IfNotPresent"),
        "guardstream-engine": ("registry.example.com/guardstream:cuda", "IfNotPresent"),
    }
    for image, _ in images.values():
        assert registry_qualified(image) and not image.endswith(":latest"), image
    # the bare names are what `make image` tags (and the CUDA build the Dockerfile documents)
    assert "IMAGE ?= guardstream:cpu" in MAKEFILE
    assert "-t guardstream:cuda" in DOCKERFILE
    assert not registry_qualified("guardstream:cpu")
    assert registry_qualified("localhost:5000/guardstream:cpu")
    assert registry_qualified("ghcr.io/acme/guardstream:cpu")


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_kustomize_renders_the_same_images() -> None:
    """kubectl's own kustomize agrees with kustomized_images() (it runs offline)."""
    out = subprocess.run(
        ["kubectl", "kustomize", str(DEPLOY / "k8s")],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    rendered = {}
    for doc in yaml.safe_load_all(out):
        if doc and doc["kind"] in ("Deployment", "StatefulSet"):
            (container,) = doc["spec"]["template"]["spec"]["containers"]
            rendered[doc["metadata"]["name"]] = (
                container["image"],
                container.get("imagePullPolicy"),
            )
    assert rendered == kustomized_images()


def test_readme_and_compose_header_name_the_compose_file() -> None:
    """From the repository root `docker compose --profile monitoring up` found no compose file
    (issue 28): every compose command names it."""
    texts = {
        "README.md": (ROOT / "README.md").read_text(),
        "deploy/docker-compose.yaml": (DEPLOY / "docker-compose.yaml").read_text(),
        "Dockerfile": DOCKERFILE,
    }
    commands = [
        (where, m.group(0))
        for where, text in texts.items()
        for m in re.finditer(r"docker compose\b[^`\n]*", text)
    ]
    assert len(commands) >= 5, commands
    for where, command in commands:
        assert re.match(r"docker compose -f deploy/docker-compose\.yaml\b", command), (
            where,
            command,
        )
    readme = texts["README.md"]
    assert "docker compose -f deploy/docker-compose.yaml --profile monitoring up" in readme
    assert "make image" in readme


def run_make_image(tmp_path: Path, tools: dict[str, int], **variables: str) -> tuple[int, str]:
    """`make image` with only `tools` on PATH, each a stub that exits with its code and records
    its argv; returns (make's exit code, the recorded calls)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    for tool, code in tools.items():
        exe = bin_dir / tool
        exe.write_text(f'#!/bin/sh\necho "{tool} $*" >> {calls}\nexit {code}\n')
        exe.chmod(0o755)
    make = shutil.which("make")
    assert make is not None
    result = subprocess.run(
        [make, "-s", "-C", str(ROOT), "image", *(f"{k}={v}" for k, v in variables.items())],
        env={"PATH": str(bin_dir), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return result.returncode, calls.read_text() if calls.exists() else ""


BUILD = "--build-arg TORCH_VARIANT=cpu -t guardstream:cpu -f Dockerfile ."


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.parametrize(
    ("tools", "expected"),
    [
        ({"docker": 0, "podman": 0, "buildah": 0}, f"docker info\ndocker build {BUILD}\n"),
        # a docker CLI without a daemon (this machine): podman, else buildah
        ({"docker": 1, "podman": 0, "buildah": 0}, f"docker info\npodman build {BUILD}\n"),
        ({"docker": 1, "buildah": 0}, f"docker info\nbuildah bud --layers {BUILD}\n"),
        ({"buildah": 0}, f"buildah bud --layers {BUILD}\n"),
    ],
)
def test_make_image_builds_with_the_builder_that_is_installed(
    tmp_path: Path, tools: dict[str, int], expected: str
) -> None:
    code, calls = run_make_image(tmp_path, tools)
    assert code == 0
    assert calls == expected


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_image_says_what_is_missing_and_takes_a_chosen_builder(tmp_path: Path) -> None:
    (tmp_path / "none").mkdir()
    (tmp_path / "chosen").mkdir()
    code, calls = run_make_image(tmp_path / "none", {})
    assert code != 0 and calls == ""
    code, calls = run_make_image(
        tmp_path / "chosen",
        {"docker": 0, "podman": 0},
        CONTAINER_TOOL="podman",
        IMAGE="guardstream:cuda",
        TORCH_VARIANT="cu128",
        BUILD_ARGS="--build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04",
    )
    assert code == 0
    assert calls == (
        "podman build --build-arg TORCH_VARIANT=cu128 --build-arg "
        "BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 -t guardstream:cuda -f Dockerfile .\n"
    )


# -- issue 26: scaling out on Kubernetes ---------------------------------------------------------

ADAPTER_VALUES: dict[str, Any] = yaml.safe_load(
    (DEPLOY / "k8s" / "monitoring" / "prometheus-adapter" / "values.yaml").read_text()
)


def test_hpa_scales_the_orchestrator_on_active_streams_per_pod() -> None:
    hpa = MONITORING[("HorizontalPodAutoscaler", "guardstream-orchestrator")]["spec"]
    assert hpa["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "guardstream-orchestrator",
    }
    assert ("Deployment", "guardstream-orchestrator") in K8S
    (metric,) = hpa["metrics"]
    assert metric["type"] == "Pods"
    name = metric["pods"]["metric"]["name"]
    assert name == "guardstream_active_streams"
    # a gauge the orchestrator exports (per pod: the sum over its workers, livesum)
    app = orchestrator_app(parse_config({}))
    exported = {m.name: m.type for m in app[STATE].metrics.registry.collect()}
    assert exported[name] == "gauge"
    target = metric["pods"]["target"]
    assert target["type"] == "AverageValue"
    # below the per-pod cap, so pods are added before any pod turns streams away
    config = parse_config(k8s_config("guardstream-config", "config.yaml"))
    assert int(target["averageValue"]) * 2 < config.server.max_concurrent_streams
    assert 2 <= hpa["minReplicas"] < hpa["maxReplicas"]
    # never more than one pod a minute goes, each draining its streams
    assert hpa["behavior"]["scaleDown"]["policies"] == [
        {"type": "Pods", "value": 1, "periodSeconds": 60}
    ]


def test_prometheus_adapter_rule_serves_the_metric_the_hpa_reads() -> None:
    hpa = MONITORING[("HorizontalPodAutoscaler", "guardstream-orchestrator")]["spec"]
    wanted = hpa["metrics"][0]["pods"]["metric"]["name"]
    assert ADAPTER_VALUES["rules"]["default"] is False
    (rule,) = ADAPTER_VALUES["rules"]["custom"]
    series = re.fullmatch(r"(\w+)\{(.*)\}", rule["seriesQuery"])
    assert series is not None and series[1] == wanted
    assert set(series[2].split(",")) == {'namespace!=""', 'pod!=""'}
    assert re.fullmatch(rule["name"]["matches"], series[1])
    assert rule["name"]["as"] == wanted
    # the ServiceMonitor's namespace and pod labels tie each series to its pod
    assert rule["resources"]["overrides"] == {
        "namespace": {"resource": "namespace"},
        "pod": {"resource": "pod"},
    }
    assert rule["metricsQuery"] == "max(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)"
    # the values file is not applied by `kubectl apply -f deploy/k8s/monitoring/` (no
    # recursion), and it is no Kubernetes object
    assert "kind" not in ADAPTER_VALUES and "apiVersion" not in ADAPTER_VALUES
    monitor = MONITORING[("ServiceMonitor", "guardstream")]["spec"]
    svc = K8S[("Service", "guardstream")]
    assert selects(monitor["selector"], svc["metadata"]["labels"])


def test_k8s_orchestrator_config_sets_the_capacity_knobs() -> None:
    config = parse_config(k8s_config("guardstream-config", "config.yaml"))
    assert config.server.max_concurrent_streams == 384
    assert config.server.listen_backlog >= config.server.max_concurrent_streams
    assert config.server.workers == 1  # the pod requests one core
    c = k8s_container("Deployment", "guardstream-orchestrator")
    assert c["resources"]["requests"]["cpu"] == "1"


# -- one source of truth (issue 41 item 4) and the container as deployments run it (item 6) -----


def _render_module() -> Any:
    spec = importlib.util.spec_from_file_location("deploy_render", DEPLOY / "render.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_deploy_configs_are_rendered_from_config_yaml() -> None:
    """compose and k8s run what `make run` runs: deploy/render.py's output is what is checked
    in, and it equals config.yaml but for the server, the backends (one per engine replica)
    and where the model-backed detectors run."""
    render = _render_module()
    assert render.main(["--check"]) == 0, "stale: python deploy/render.py"
    shipped = load_config(ROOT / "config.yaml")
    for config in (
        load_config(DEPLOY / "config.compose.yaml"),
        parse_config(k8s_config("guardstream-config", "config.yaml")),
    ):
        for model_id, model in shipped.models.items():
            deployed = config.models[model_id]
            for key in ("limits", "decoding_defaults", "guardrails", "migration", "chat"):
                assert getattr(deployed, key) == getattr(model, key), key
        assert config.chunkers == shipped.chunkers
        assert list(config.detectors) == list(shipped.detectors)
        for detector_id, det in config.detectors.items():
            mine = shipped.detectors[detector_id]
            assert (det.chunker_id, det.on_detection, det.default_threshold) == (
                mine.chunker_id,
                mine.on_detection,
                mine.default_threshold,
            )
            assert (det.builtin is not None) == (mine.builtin in IN_PROCESS)
    served = detector_service.load_config(DEPLOY / "detectors.yaml")["detectors"]
    assert {d: e["builtin"] for d, e in served.items()} == {
        d: c.builtin for d, c in shipped.detectors.items() if c.builtin is not None
    }


def test_a_new_engine_replica_gets_its_backend() -> None:
    """Backends follow the replica count: the StatefulSet's replicas give one URL each."""
    render = _render_module()
    base = yaml.safe_load((ROOT / "config.yaml").read_text())
    urls = [f"http://guardstream-engine-{i}.guardstream-engine:8090" for i in range(3)]
    config = render.orchestrator_config(base, render.K8S_SERVER, urls, "http://d:8080")
    [model] = config["models"].values()
    assert [b["url"] for b in model["backends"]] == urls
    assert (
        len(render.k8s_engines()) == K8S[("StatefulSet", "guardstream-engine")]["spec"]["replicas"]
    )


def test_compose_declares_its_networks_and_runs_read_only() -> None:
    assert "default" in COMPOSE["networks"]  # podman-compose: `missing networks: default`
    for name in GUARDSTREAM_SERVICES:
        service = COMPOSE["services"][name]
        assert service["read_only"] is True, name
        assert service["tmpfs"] == ["/tmp"], name


def test_k8s_containers_run_with_a_read_only_root() -> None:
    for kind, name in (
        ("Deployment", "guardstream-orchestrator"),
        ("Deployment", "guardstream-detectors"),
        ("StatefulSet", "guardstream-engine"),
    ):
        c = k8s_container(kind, name)
        assert c["securityContext"]["readOnlyRootFilesystem"] is True, name
        assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"], name


def test_the_cpu_overlay_runs_the_engines_without_a_gpu() -> None:
    out = subprocess.run(
        ["kubectl", "kustomize", str(DEPLOY / "k8s-cpu")],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out) if d}
    sts = docs[("StatefulSet", "guardstream-engine")]["spec"]["template"]["spec"]
    (engine,) = sts["containers"]
    base = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    registry = base["images"][0]["newName"]
    assert engine["image"] == f"{registry}:cpu"
    assert engine["command"][engine["command"].index("--device") + 1] == "cpu"
    assert "nvidia.com/gpu" not in str(engine["resources"])
    # the rest is the base as it is
    assert (
        docs[("Deployment", "guardstream-orchestrator")]["spec"]["template"]["spec"]["containers"][
            0
        ]["image"]
        == f"{registry}:cpu"
    )
