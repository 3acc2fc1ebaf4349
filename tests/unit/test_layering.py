"""The layering the design promises, checked on the source: the library and the scripts never
import a service, no service imports another service, weights/ (store, fleet, transport) imports
neither the learner nor the rollout, the catalog of names sits below everything that uses it, a few
packages never import a few others, and imports outside functions (those under `if TYPE_CHECKING:`
too: a type is knowledge of the module) form no circle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT / "libs" if path.is_relative_to(ROOT / "libs") else ROOT).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_source_module(name: str) -> bool:
    """Whether the dotted `name` is a module (or package) of this repository."""
    rel = Path(*name.split("."))
    return any((base / rel).with_suffix(".py").is_file() or (base / rel / "__init__.py").is_file()
               for base in (ROOT / "libs", ROOT))


def imports(path: Path, outside_functions_only: bool) -> set[str]:
    """Modules `path` imports (for outside_functions_only: not inside a function; `if TYPE_CHECKING:`
    counts)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if outside_functions_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                named = {f"{child.module}.{a.name}" for a in child.names}
                found.update(named)
                if not all(map(is_source_module, named)):  # `from pkg import submodule` knows the submodule only
                    found.add(child.module)
            visit(child)

    visit(tree)
    return found


def sources(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py") if "/v1/" not in str(p))


def test_library_and_scripts_never_import_services():
    offenders = {str(p.relative_to(ROOT)): sorted(m for m in imports(p, False) if m.split(".")[0] == "services")
                 for p in sources("libs", "scripts")}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_no_service_imports_another_service():
    offenders = {}
    for path in sources("services"):
        own = path.relative_to(ROOT / "services").parts[0]
        other = sorted(m for m in imports(path, False) if m.startswith("services.")
                       and m.split(".")[1] != own)
        if other:
            offenders[str(path.relative_to(ROOT))] = other
    assert offenders == {}


def test_weights_import_neither_learner_nor_rollout():
    """Both sides depend on weights/, never the reverse (not even inside a function)."""
    sides = (["rlserve", "learner"], ["rlserve", "rollout"])
    offenders = {str(p.relative_to(ROOT)): sorted(m for m in imports(p, False) if m.split(".")[:2] in sides)
                 for p in sources("libs/rlserve/weights")}
    assert {k: v for k, v in offenders.items() if v} == {}


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


# Packages that never import another, not even inside a function or for a type (the first may know the
# second only by a name in `rlserve.catalog`), each with the reason.
NEVER_IMPORTS = {
    ("rlserve.config", "rlserve.learner"): "the spec takes backend names from the catalog; backends read the spec",
    ("rlserve.config", "rlserve.data"): "the spec takes task names from the catalog; data/ reads the spec",
    ("rlserve.config", "rlserve.algorithms"): "the spec takes loss and estimator names from the catalog",
    ("rlserve.rollout", "rlserve.config"): "an engine serves any run; the spec is the coordinator's and learner's",
    ("rlserve.rollout", "rlserve.runs"): "an engine knows no run record",
    ("rlserve.security", "rlserve.rewards"): "the policy checks names and paths, below what it guards",
    ("rlserve.models", "rlserve.data"): "models (presets, tokenizers) come before the data fed to them",
    ("rlserve.rewards", "rlserve.rollout"): "scoring runs beside generation, never on its engines",
}


def test_packages_never_import_the_packages_below_them():
    offenders = {}
    for path in sources("libs/rlserve"):
        name = module_name(path)
        for (importer, imported), _ in NEVER_IMPORTS.items():
            if within(name, importer):
                found = sorted(m for m in imports(path, False) if within(m, imported))
                if found:
                    offenders[name] = found
    assert offenders == {}


def test_the_catalog_imports_nothing_of_rlserve_above_the_registry():
    """Everything that names things imports it: it must sit below all of them."""
    for name in ("catalog", "registry"):
        found = imports(ROOT / "libs" / "rlserve" / f"{name}.py", False)
        assert sorted(m for m in found if within(m, "rlserve") and not within(m, "rlserve.registry")) == []


def test_imports_outside_functions_form_no_circle():
    paths = sources("libs/rlserve", "services")
    names = {module_name(p): p for p in paths}
    graph = {name: {m for m in imports(path, True) if m in names and m != name} for name, path in names.items()}
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def cycle_from(node: str, stack: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt] if nxt in stack else [node, nxt]
            if nxt not in state and (found := cycle_from(nxt, stack + [nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = cycle_from(start, [start])
            assert found is None, " -> ".join(found)


# Modules of the library that may import Ray, each with the reason: they move data or calls between
# processes. Everything else (the loop, the backends, the engines, the losses) runs without Ray.
RAY_ALLOWED = {
    "rlserve.rpc": "reads the gRPC status out of what a Serve handle call raised",
    "rlserve.cluster.deployment": "builds the Serve applications",
    "rlserve.cluster.lifecycle": "starts, stops and inspects the Ray cluster",
    "rlserve.cluster.join": "joins a node to the cluster",
    "rlserve.cluster.loopback": "binds Ray's own listeners to loopback",
    "rlserve.weights.store": "the publication store actor (the newest version's buckets in the object store)",
    "rlserve.weights.fleet": "the fleet mailbox actor (membership, weight-transfer commands)",
    "rlserve.learner.publisher": "the learner's sender: buckets into the object store, commands to the fleet",
    "rlserve.learner.ray_group": "the learner's worker group: one Ray actor per rank in a placement group",
    "rlserve.rollout.follower": "a rollout replica's follower: fetches publications from the object store",
    "rlserve.rollout.adapters": "a rollout replica's table of runs' adapters: fetches them from the object store",
    "rlserve.bundle.check": "checks an offline install: that Ray imports and its binaries are executable",
}


def test_ray_is_imported_only_where_data_moves_between_processes():
    found = {module_name(p) for p in sources("libs/rlserve")
             if any(m == "ray" or m.startswith("ray.") for m in imports(p, False))}
    assert found - set(RAY_ALLOWED) == set(), "import Ray only in modules that move data between processes"
    assert set(RAY_ALLOWED) - found == set(), "stale entries in RAY_ALLOWED"


def test_the_serve_config_names_real_application_builders():
    from rlserve.cluster.serve_config import APPS

    for name, import_path in APPS.items():
        module, _, attr = import_path.partition(":")
        path = ROOT / Path(*module.split(".")).with_suffix(".py")
        assert path.is_file(), f"{name}: {module} is not a module of this repository"
        tree = ast.parse(path.read_text())
        assert any(isinstance(n, ast.FunctionDef) and n.name == attr for n in tree.body), \
            f"{name}: {module} has no top-level {attr}()"
