"""No import cycle inside the product packages, type-only imports included (issue 25).

A cycle, even one that only type checkers follow (`if TYPE_CHECKING:`), blurs which layer a
module belongs to: handlers → streaming → clients → api, a low module (`tracing`, `clients/
backend`) must not know the pipeline above it. grimp (import-linter's graph library) builds the
import graph from the source: every `import`, at module level, inside functions and under
`TYPE_CHECKING`; for every direct import a → b the test asks for a chain b → … → a.

The other tests pin DESIGN section 1's one-way dependencies between packages (the engine and the
orchestrator talk only over HTTP: the orchestrator imports nothing from `generation`), and the
layers inside the orchestrator.
"""

from __future__ import annotations

import json
import subprocess
import sys

import grimp
import pytest

from tests.engine_processes import child_environment

PACKAGES = ("orchestrator", "detectors", "generation", "chunkers", "servicekit")


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(*PACKAGES, cache_dir=None)


def cycles(graph: grimp.ImportGraph) -> list[str]:
    """Each cycle once, as `a -> b -> ... -> a` (the shortest through each import in it)."""
    found: dict[frozenset[str], str] = {}
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back is not None:
                chain = (importer, *back)
                found.setdefault(frozenset(chain), " -> ".join(chain))
    return sorted(found.values())


def test_no_import_cycle_type_only_imports_included(graph: grimp.ImportGraph) -> None:
    assert cycles(graph) == []


def test_the_check_sees_type_only_imports() -> None:
    """The check is only as good as the graph: a TYPE_CHECKING import is an edge in it."""
    graph = grimp.build_graph("orchestrator", cache_dir=None)
    # orchestrator/clients/replicas.py imports EngineProcess only for type checkers
    assert graph.direct_import_exists(
        importer="orchestrator.clients.replicas", imported="orchestrator.clients.managed"
    )
    graph.add_import(
        importer="orchestrator.clients.managed", imported="orchestrator.clients.replicas"
    )
    assert cycles(graph) == [
        "orchestrator.clients.managed -> orchestrator.clients.replicas -> "
        "orchestrator.clients.managed"
    ]


@pytest.mark.parametrize(
    ("importer", "imported"),
    [
        ("generation", "orchestrator"),
        ("orchestrator", "generation"),
        ("detectors", "orchestrator"),
        ("chunkers", "orchestrator"),
        ("servicekit", "orchestrator"),
        ("servicekit", "generation"),
        ("servicekit", "detectors"),
    ],
)
def test_packages_depend_one_way(graph: grimp.ImportGraph, importer: str, imported: str) -> None:
    assert graph.find_shortest_chains(importer=importer, imported=imported) == set()


def test_the_orchestrator_layers_import_downwards_only(graph: grimp.ImportGraph) -> None:
    """handlers → streaming → clients → api (issue 25): a lower layer never reaches up, not even
    for a type (the API models and the clients know nothing of the pipeline)."""
    illegal = graph.find_illegal_dependencies_for_layers(
        layers=(
            "orchestrator.handlers",
            "orchestrator.streaming",
            "orchestrator.clients",
            "orchestrator.api",
        )
    )
    assert sorted((d.importer, d.imported) for d in illegal) == []


def test_a_finding_knows_no_surface(graph: grimp.ImportGraph) -> None:
    """A Finding is the pipeline's detection; what each surface shows of it is
    `streaming.finding_wire`'s (issue 33), so the Finding itself imports no API model."""
    imported = graph.find_modules_directly_imported_by("orchestrator.streaming.findings")
    assert sorted(m for m in imported if m.startswith("orchestrator.api")) == []


# What importing `generation` sets in the process (generation/__init__.py): offline hubs, idle
# OpenMP threads that sleep. The engine's choices, not the orchestrator's.
ENGINE_DEFAULTS = (
    "HF_HUB_DISABLE_TELEMETRY",
    "HF_HUB_OFFLINE",
    "OMP_WAIT_POLICY",
    "TOKENIZERS_PARALLELISM",
    "TRANSFORMERS_OFFLINE",
)

# Imports the named package and, for a package given with `/all`, every module under it (the
# static graph does not see an `importlib` import, nor what a lazily imported module pulls in);
# prints the `generation` modules loaded and the environment variables that changed.
IMPORT_PROBE = """
import importlib, json, os, pkgutil, sys
before = dict(os.environ)
name, _, scope = sys.argv[1].partition("/")
package = importlib.import_module(name)
if scope == "all":
    for module in pkgutil.walk_packages(package.__path__, name + "."):
        importlib.import_module(module.name)
print(json.dumps({
    "generation": sorted(m for m in sys.modules if m.partition(".")[0] == "generation"),
    "changed": sorted(k for k in {*before, *os.environ} if before.get(k) != os.environ.get(k)),
}))
"""


def probe_imports(target: str) -> dict[str, list[str]]:
    """`IMPORT_PROBE` in a fresh interpreter whose environment holds none of ENGINE_DEFAULTS."""
    env = {k: v for k, v in child_environment().items() if k not in ENGINE_DEFAULTS}
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_PROBE, target],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_the_probe_sees_the_engine_defaults() -> None:
    """The probe below is only as good as this: importing `generation` shows up in both."""
    seen = probe_imports("generation")
    assert seen["generation"] == ["generation"]
    assert set(ENGINE_DEFAULTS) <= set(seen["changed"])


def test_the_orchestrator_process_loads_nothing_of_the_engine() -> None:
    """Every orchestrator module imported (the entry points and those imported lazily): no
    `generation` module is loaded, and none of its environment defaults is set."""
    seen = probe_imports("orchestrator/all")
    assert seen["generation"] == []
    assert sorted(set(seen["changed"]) & set(ENGINE_DEFAULTS)) == []
