"""The import contract (docs/design.md#layers): which package may import which, no cycle between modules
(imports inside functions included), and what each program's start may cost.

Read from the source with `ast`, nothing imported: a rule broken in a branch never taken still fails.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Each layer (a package or module, dotted) and the first-party layers it may import, besides itself and
# its own submodules; `x.*` is x and every layer under it. A module belongs to the longest layer that
# names it. The product is hami_guard, initcheck, sidecar and doctor; testing/ is the rig, which the
# product never imports.
_PLUMBING = frozenset(
    {
        "hami_guard",
        "sidecar.proto",
        "sidecar.rpc",
        "sidecar.health",
        "sidecar.reasons",
        "sidecar.tasks",
        "sidecar.kube.*",
    }
)
LAYERS: Mapping[str, frozenset[str]] = {
    "hami_guard": frozenset(),
    "initcheck": frozenset({"hami_guard"}),
    # The sidecar's vocabulary and plumbing: what the two halves and the server build on.
    "sidecar": frozenset(),  # the package's __init__ (its version)
    "sidecar.proto": frozenset(),
    "sidecar.health": frozenset(),
    # The reason codes the checks publish as a metric's label: the judges' and the metrics' words.
    "sidecar.reasons": frozenset(),
    "sidecar.tasks": frozenset(),
    "sidecar.rpc": frozenset({"sidecar.proto"}),
    "sidecar.watcher": frozenset(),
    # The project's own reader of the API server: where and how (standard library), and one bounded GET.
    "sidecar.kube": frozenset({"sidecar.kube.access"}),
    "sidecar.kube.access": frozenset(),
    # The settings, and the halves' configuration types they are made of.
    "sidecar.config": frozenset(
        {
            "hami_guard",
            "sidecar.watcher",
            "sidecar.deviceplugin.hamiconfig",
            "sidecar.deviceplugin.hostdevices",
            "sidecar.dra.spec",
            "sidecar.kube.access",
        }
    ),
    "sidecar.deviceplugin.hamiconfig": frozenset({"hami_guard", "sidecar.deviceplugin.hostdevices"}),
    # The host's GPUs (their driver's list, vfio-pci) and the bounded read of the host's files.
    "sidecar.deviceplugin.hostdevices": frozenset({"hami_guard"}),
    "sidecar.dra.spec": frozenset({"hami_guard", "sidecar.kube.access"}),
    # The two halves mirror each other and never meet: their evidence and verdicts build on the
    # plumbing; their watches (the rounds) also read the settings.
    "sidecar.deviceplugin": _PLUMBING,
    "sidecar.dra": _PLUMBING,
    "sidecar.deviceplugin.watch": _PLUMBING | {"sidecar.config", "sidecar.deviceplugin.*"},
    # The device plugins' readings of the node (pod-resources, sockets, the checkpoint), which HAMi's
    # registration reads too.
    "sidecar.deviceplugin.probes": _PLUMBING | {"sidecar.deviceplugin"},
    "sidecar.dra.watch": _PLUMBING | {"sidecar.config", "sidecar.dra.*"},
    # HAMi's own registration (its Node annotations): the API reader, and the device plugins' readings
    # of the kubelet's devices (pod-resources, a plugin socket's identity); its watch reads the settings.
    "sidecar.hami": _PLUMBING | {"sidecar.deviceplugin.probes"},
    "sidecar.hami.watch": _PLUMBING | {"sidecar.config", "sidecar.hami.*", "sidecar.deviceplugin.probes"},
    "sidecar.server.serving": frozenset(),
    "sidecar.server.metrics": frozenset({"sidecar.health", "sidecar.reasons"}),
    "sidecar.app": frozenset(
        {
            "hami_guard",
            "sidecar.config",
            "sidecar.health",
            "sidecar.rpc",
            "sidecar.tasks",
            "sidecar.watcher",
            "sidecar.deviceplugin.*",
            "sidecar.dra.*",
            "sidecar.hami.*",
            "sidecar.server.metrics",
            "sidecar.server.status",
        }
    ),
    # The views and the status document: what the app knows, as JSON and text.
    "sidecar.server": frozenset(
        {"hami_guard", "sidecar", "sidecar.app", "sidecar.config", "sidecar.health", "sidecar.server.*"}
        | {"sidecar.deviceplugin.*", "sidecar.dra.*", "sidecar.hami.*"}
    ),
    "sidecar.cli": frozenset(
        {"hami_guard", "sidecar.app", "sidecar.config", "sidecar.server.*", "sidecar.watcher"}
    ),
    "sidecar.__main__": frozenset({"sidecar.cli"}),
    "doctor": frozenset({"hami_guard", "initcheck", "sidecar.*"}),
    "testing": frozenset({"hami_guard", "sidecar.*"}),
}

# Third-party packages a layer may import at all (the standard library is always allowed): initcheck runs
# at every plugin start on every node from an image with the standard library alone, and so does what it
# imports (tests/test_images.py holds the image's requirements to what it imports).
THIRD_PARTY: Mapping[str, frozenset[str]] = {
    "hami_guard": frozenset(),
    "initcheck": frozenset(),
}

PRODUCT = ("hami_guard", "initcheck", "sidecar", "doctor")
FIRST_PARTY = (*PRODUCT, "testing", "tests", "bench", "fuzz")


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    line: int
    in_function: bool
    type_only: bool = False  # under `if TYPE_CHECKING:`: for annotations, never run

    def __str__(self) -> str:
        where = " (inside a function)" if self.in_function else ""
        return f"{self.importer}:{self.line} imports {self.imported}{where}"


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if "bin" in path.relative_to(root).parts:
                continue
            found[module_name(root, path)] = path
    return found


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    if not is_package:
        base.pop()
    base = base[: len(base) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports(name: str, path: Path, known: Mapping[str, Path]) -> list[Edge]:
    """Every import in the module, wherever it stands, as the modules it names (`from p import m` names
    the module p.m where that is one)."""
    tree = ast.parse(path.read_text(), str(path))
    edges = []
    functions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
    inside: set[int] = set()
    typing: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, functions):
            inside.update(id(n) for n in ast.walk(node) if n is not node)
        elif isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            typing.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, path.name == "__init__.py", node)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        edges += [
            Edge(name, t, node.lineno, id(node) in inside, id(node) in typing) for t in dict.fromkeys(targets)
        ]
    return edges


def layer_of(module: str, layers: Iterable[str]) -> str | None:
    best = None
    for layer in layers:
        if (module == layer or module.startswith(layer + ".")) and (best is None or len(layer) > len(best)):
            best = layer
    return best


def broken_rules(
    edges: Iterable[Edge], layers: Mapping[str, frozenset[str]], first_party: Iterable[str]
) -> list[str]:
    """The edges between first-party modules that the layers do not allow."""
    top = set(first_party)
    broken = []
    for e in edges:
        if e.imported.split(".")[0] not in top:
            continue
        mine = layer_of(e.importer, layers)
        if mine is None:
            continue  # tests, benchmarks and fuzzers may import anything
        theirs = layer_of(e.imported, layers)
        allowed = layers[mine]
        ok = (
            theirs is not None
            and (
                theirs == mine
                or theirs.startswith(mine + ".")  # its own sublayers
                or theirs in allowed
                or any(a.endswith(".*") and (theirs + ".").startswith(a[:-1]) for a in allowed)
            )
        )
        if not ok:
            broken.append(str(e))
    return broken


def cycles(edges: Iterable[Edge], known: Iterable[str]) -> list[list[str]]:
    """The import cycles between modules (Tarjan's strongly connected components of two or more). An import
    for annotations only (under `if TYPE_CHECKING:`) never runs, and makes none."""
    names = set(known)
    graph: dict[str, set[str]] = {n: set() for n in names}
    for e in edges:
        if e.imported in names and e.imported != e.importer and not e.type_only:
            graph[e.importer].add(e.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return found


def third_party(
    edges: Iterable[Edge], allowed: Mapping[str, frozenset[str]], first_party: Iterable[str]
) -> list[str]:
    """The imports of packages neither first-party nor the standard library that a layer may not make."""
    top = set(first_party)
    out = []
    for e in edges:
        package = e.imported.split(".")[0]
        if package in top or package in sys.stdlib_module_names or package == "__future__":
            continue
        layer = layer_of(e.importer, allowed)
        if layer is not None and package not in allowed[layer]:
            out.append(str(e))
    return out


@pytest.fixture(scope="module")
def graph() -> tuple[dict[str, Path], list[Edge]]:
    known = modules(ROOT, FIRST_PARTY)
    edges = [e for name, path in known.items() for e in imports(name, path, known)]
    return known, edges


def test_every_product_module_has_a_layer(graph: tuple[dict[str, Path], list[Edge]]) -> None:
    known, _ = graph
    assert [m for m in known if m.split(".")[0] in (*PRODUCT, "testing") and not layer_of(m, LAYERS)] == []


def test_imports_follow_the_layers(graph: tuple[dict[str, Path], list[Edge]]) -> None:
    _, edges = graph
    assert broken_rules(edges, LAYERS, FIRST_PARTY) == []


def test_the_product_never_imports_the_rig(graph: tuple[dict[str, Path], list[Edge]]) -> None:
    _, edges = graph
    rig = ("testing", "tests", "bench", "fuzz")
    assert [str(e) for e in edges if e.importer.startswith(PRODUCT) and e.imported.startswith(rig)] == []


def test_no_import_cycles(graph: tuple[dict[str, Path], list[Edge]]) -> None:
    known, edges = graph
    assert cycles(edges, known) == []


def test_the_init_container_imports_the_standard_library_only(
    graph: tuple[dict[str, Path], list[Edge]],
) -> None:
    _, edges = graph
    assert third_party(edges, THIRD_PARTY, FIRST_PARTY) == []


def test_the_checker_finds_what_breaks_the_contract(tmp_path: Path) -> None:
    """The checks above on a small tree that breaks each rule once: they must say so."""
    files = {
        "low/__init__.py": "",
        "low/a.py": "import json\nimport grpc\n\ndef f():\n    from high import b\n",
        "high/__init__.py": "",
        "high/b.py": "from low.a import f\nfrom . import c\n",
        "high/c.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from high.b import x\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    known = modules(tmp_path, ("low", "high"))
    edges = [e for name, path in known.items() for e in imports(name, path, known)]
    layers = {"low": frozenset(), "high": frozenset({"low"})}
    assert broken_rules(edges, layers, ("low", "high")) == ["low.a:5 imports high.b (inside a function)"]
    assert cycles(edges, known) == [["high.b", "low.a"]]
    assert third_party(edges, {"low": frozenset()}, ("low", "high")) == ["low.a:2 imports grpc"]
    assert Edge("high.b", "high.c", 2, False) in edges  # a relative import of a submodule
    assert Edge("high.c", "high.b", 4, False, type_only=True) in edges  # no cycle: never run
