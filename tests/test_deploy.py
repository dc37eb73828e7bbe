"""The deploy files parse and agree with the code (issue 7): Dockerfile, .dockerignore,
deploy/docker-compose.yaml, deploy/k8s/*.yaml and the configs they mount. Commands go through the
real CLI parsers, configs through the real loaders, ports and paths are compared across files."""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import shlex
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

import detectors.__main__ as detectors_cli
import generation.__main__ as generation_cli
import orchestrator.__main__ as orchestrator_cli
from detectors import service as detector_service
from generation import models
from orchestrator.app import create_app as orchestrator_app
from orchestrator.config import Config, ServerConfig, load_config, parse_config

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
COMPOSE: dict[str, Any] = yaml.safe_load((DEPLOY / "docker-compose.yaml").read_text())
K8S_FILES = sorted((DEPLOY / "k8s").glob("*.yaml"))
K8S: dict[tuple[str, str], dict[str, Any]] = {
    (doc["kind"], doc["metadata"]["name"]): doc
    for path in K8S_FILES
    for doc in yaml.safe_load_all(path.read_text())
    if doc
}
DOCKERFILE = (ROOT / "Dockerfile").read_text()
MAKEFILE = (ROOT / "Makefile").read_text()

ORCHESTRATOR_PORT = 8033
ENGINE_PORT = 8090
DETECTORS_PORT = 8080
CONFIG_PATH = "/etc/guardstream/config.yaml"
DETECTORS_CONFIG_PATH = "/etc/guardstream/detectors.yaml"


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


def test_k8s_manifests_parse_into_the_expected_objects() -> None:
    assert [p.name for p in K8S_FILES] == ["detectors.yaml", "engine.yaml", "orchestrator.yaml"]
    assert set(K8S) == {
        ("ConfigMap", "guardstream-config"),
        ("Deployment", "guardstream-orchestrator"),
        ("Service", "guardstream"),
        ("Service", "guardstream-engine"),
        ("StatefulSet", "guardstream-engine"),
        ("ConfigMap", "guardstream-detectors-config"),
        ("Deployment", "guardstream-detectors"),
        ("Service", "guardstream-detectors"),
    }
    for doc in K8S.values():
        assert doc["apiVersion"] in ("v1", "apps/v1")


def test_compose_services() -> None:
    assert set(COMPOSE["services"]) == {"orchestrator", "engine-0", "engine-1", "detectors"}
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
    assert sorted(built) == ["hap", "injection", "pii"]
    # the same format as config.yaml: the orchestrator's loader accepts it as well
    assert sorted(load_config(DEPLOY / "detectors.yaml").detectors) == ["hap", "injection", "pii"]
    assert k8s_config("guardstream-detectors-config", "detectors.yaml") == config


def test_probe_paths_are_routes_of_the_apps() -> None:
    app = orchestrator_app(parse_config({}))
    routes = {r.resource.canonical for r in app.router.routes() if r.resource is not None}
    assert {"/health", "/info"} <= routes
    det_app = detector_service.create_app({})
    assert "/health" in {r.resource.canonical for r in det_app.router.routes() if r.resource}
    assert 'add_get("/health"' in (ROOT / "generation" / "server.py").read_text()


# -- commands go through the real CLI parsers ----------------------------------------------------


def all_commands() -> list[tuple[str, list[str]]]:
    out = [(f"compose:{name}", svc["command"]) for name, svc in COMPOSE["services"].items()]
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
    assert sorted(remote) == ["hap"]
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
        assert f"http://127.0.0.1:{port}/health" in test, name


# -- kubernetes wiring ---------------------------------------------------------------------------


def test_k8s_orchestrator_wiring() -> None:
    c = k8s_container("Deployment", "guardstream-orchestrator")
    assert c["ports"] == [{"name": "http", "containerPort": ORCHESTRATOR_PORT}]
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": ORCHESTRATOR_PORT}
    assert c["readinessProbe"]["httpGet"] == {"path": "/info", "port": ORCHESTRATOR_PORT}
    assert c["volumeMounts"] == [{"name": "config", "mountPath": str(Path(CONFIG_PATH).parent)}]
    spec = K8S[("Deployment", "guardstream-orchestrator")]["spec"]["template"]["spec"]
    assert spec["volumes"] == [{"name": "config", "configMap": {"name": "guardstream-config"}}]
    assert Path(CONFIG_PATH).name in K8S[("ConfigMap", "guardstream-config")]["data"]
    svc = K8S[("Service", "guardstream")]["spec"]
    assert svc["ports"] == [
        {"name": "http", "port": ORCHESTRATOR_PORT, "targetPort": ORCHESTRATOR_PORT}
    ]
    assert svc["selector"] == {"app": "guardstream-orchestrator"}
    # SIGTERM drains streams for drain_timeout_s; the pod must be given longer than that
    config = parse_config(k8s_config("guardstream-config", "config.yaml"))
    assert spec["terminationGracePeriodSeconds"] > config.server.drain_timeout_s


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
    assert sorted(remote) == ["hap"]
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
        {"name": "config", "mountPath": str(Path(DETECTORS_CONFIG_PATH).parent)}
    ]
    spec = K8S[("Deployment", "guardstream-detectors")]["spec"]["template"]["spec"]
    assert spec["volumes"] == [
        {"name": "config", "configMap": {"name": "guardstream-detectors-config"}}
    ]
    assert list(K8S[("ConfigMap", "guardstream-detectors-config")]["data"]) == [
        Path(DETECTORS_CONFIG_PATH).name
    ]


def test_k8s_pods_run_as_the_image_user() -> None:
    uid = int(re.search(r"useradd .*--uid (\d+) guardstream", DOCKERFILE)[1])  # type: ignore[index]
    for kind, name in [
        ("Deployment", "guardstream-orchestrator"),
        ("Deployment", "guardstream-detectors"),
        ("StatefulSet", "guardstream-engine"),
    ]:
        ctx = K8S[(kind, name)]["spec"]["template"]["spec"]["securityContext"]
        assert ctx == {"runAsNonRoot": True, "runAsUser": uid}, name


# -- environment variables -----------------------------------------------------------------------


def container_envs() -> dict[str, dict[str, Any]]:
    """{where: {env name: value or valueFrom}} for every compose service and k8s container."""
    out: dict[str, dict[str, Any]] = {}
    for name, svc in COMPOSE["services"].items():
        out[f"compose:{name}"] = dict(svc.get("environment") or {})
    for kind, name in K8S:
        if kind in ("Deployment", "StatefulSet"):
            env = k8s_container(kind, name).get("env") or []
            out[f"k8s:{name}"] = {e["name"]: e.get("value", e.get("valueFrom")) for e in env}
    return out


def test_env_vars_named_by_configs_are_set_and_every_set_one_is_used() -> None:
    envs = container_envs()
    compose_cfg = load_config(DEPLOY / "config.compose.yaml")
    k8s_cfg = parse_config(k8s_config("guardstream-config", "config.yaml"))
    for where, config in [
        ("compose:orchestrator", compose_cfg),
        ("k8s:guardstream-orchestrator", k8s_cfg),
    ]:
        named = {config.server.api_keys_env} - {None}
        named |= {
            b.api_key_env
            for m in config.models.values()
            for b in m.backends
            if getattr(b, "api_key_env", None)
        }
        assert set(envs[where]) == named, where
    assert envs["k8s:guardstream-orchestrator"] == {
        "GUARDSTREAM_API_KEYS": {"secretKeyRef": {"name": "guardstream-api-keys", "key": "keys"}}
    }
    # an empty key list makes the orchestrator refuse to start
    for where, env in envs.items():
        assert all(v != "" for v in env.values()), where
    # the engines and the detector service read no deployment-specific variables
    assert {w: e for w, e in envs.items() if "orchestrator" not in w and e} == {}


def test_guardstream_cache_is_where_the_image_prepared_the_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    envs = [args for instr, args in dockerfile_instructions() if instr == "ENV"]
    caches = [re.search(r"GUARDSTREAM_CACHE=(\S+)", e)[1] for e in envs if "GUARDSTREAM_CACHE" in e]  # type: ignore[index]
    assert caches == ["/opt/guardstream-cache", "/opt/guardstream-cache"]  # build and runtime
    monkeypatch.setenv("GUARDSTREAM_CACHE", caches[0])
    assert models.cache_root() == Path(caches[0])
    assert "RUN /opt/venv/bin/python -m generation prepare smollm2-135m" in DOCKERFILE
    assert (
        f"COPY --from=build --chown=guardstream:guardstream {caches[0]} {caches[0]}" in DOCKERFILE
    )


# -- the Dockerfile ------------------------------------------------------------------------------


def test_dockerfile_is_multi_stage_with_a_cuda_base_arg_and_a_non_root_user() -> None:
    instructions = dockerfile_instructions()
    froms = [args for instr, args in instructions if instr == "FROM"]
    assert froms == ["${BUILD_IMAGE} AS build", "${BASE_IMAGE} AS runtime"]
    assert "ARG BASE_IMAGE=python:3.11-slim" in DOCKERFILE
    assert "--build-arg BASE_IMAGE=nvidia/cuda:" in DOCKERFILE  # the documented CUDA build
    assert "--build-arg TORCH_VARIANT=cu" in DOCKERFILE
    assert "download.pytorch.org/whl/${TORCH_VARIANT}" in DOCKERFILE
    users = [args for instr, args in instructions if instr == "USER"]
    assert users == ["guardstream"]
    runtime = instructions[instructions.index(("FROM", froms[1])) :]
    assert ("USER", "guardstream") in runtime
    assert [i for i, _ in runtime].index("USER") < [i for i, _ in runtime].index("CMD")
    assert any(i == "COPY" and a.startswith("--from=build /opt/venv") for i, a in runtime)
    # the venv's interpreter comes along: a CUDA base (Ubuntu 24.04) has no python3.11 package
    assert ("COPY", "--from=build /usr/local /usr/local") in runtime


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
