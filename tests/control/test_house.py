"""The tree as a whole: what its files cite exists in it, and the layering holds."""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEXT_SUFFIXES = {".py", ".md", ".j2", ".toml", ".yaml", ".yml", ".tf", ".sh", ".txt", ".cfg"}
# A path on the machine a file was written on, or a document that lives outside the repository.
FOREIGN = re.compile("|".join([r"/wo" r"rk/", r"/Us" r"ers/", r"/home/[a-z]", r"\bSP" r"EC\.md", r"API-FA" r"CTS",
                               r"ST" r"YLE\.md"]))


def project_files() -> list[Path]:
    roots = [ROOT / name for name in ("provision", "trainer", "templates", "docs", "tests", "terraform",
                                      "examples", "benchmarks")]
    files = [p for root in roots if root.is_dir() for p in root.rglob("*")
             if p.is_file() and p.suffix in TEXT_SUFFIXES and "goldens" not in p.parts]
    return files + [p for p in ROOT.glob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES]


def test_files_cite_nothing_outside_the_repository():
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in project_files()
             for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
             if FOREIGN.search(line)]
    assert found == []


def test_the_docs_files_cite_exist():
    cited = {m for p in project_files() for m in re.findall(r"\bdocs/[\w.-]+\.md\b", p.read_text(errors="replace"))}
    assert cited and all((ROOT / name).is_file() for name in cited), sorted(cited)


# --- the import graph -------------------------------------------------------------------------------

OWN = ("provision", "trainer")


@functools.cache
def own_modules() -> dict[str, Path]:
    modules = {}
    for package in ("provision", "trainer"):
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def all_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth: at the top, in a function, and under `if TYPE_CHECKING:` (never
    run, but a dependence all the same: a circle closed only there is a circle of the house)."""
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def import_base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The module `from BASE import ...` names, absolute (a relative one read from `module`)."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    return ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))


def imported_names(module: str, path: Path) -> set[str]:
    """The dotted names a module imports, anywhere in it (relative imports made absolute)."""
    names = set()
    for node in all_imports(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
            continue
        base = import_base(module, path.name == "__init__.py", node)
        # `from package import module` imports that module (its package's __init__ runs first
        # anyway); `from module import name` imports the module, and so does `from package import
        # module, name` for the name that is no module of it.
        subs = {f"{base}.{alias.name}" for alias in node.names} & set(own_modules())
        names |= subs | ({base} if len(subs) < len(node.names) else set())
        names |= {f"{base}.{alias.name}" for alias in node.names} if not base.startswith(OWN) else set()
    return names


def import_graph() -> dict[str, set[str]]:
    """Each module of provision/ and trainer/ -> the project's modules it imports (a copy: the tests plant
    edges in it)."""
    return {module: set(imported) for module, imported in _import_graph().items()}


@functools.cache
def _import_graph() -> dict[str, set[str]]:
    modules = own_modules()

    def own(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    return {m: {o for o in map(own, imported_names(m, p)) if o and o != m} for m, p in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def with_package_inits(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph with the edges importing a module makes to the packages above it: `import a.b.c` runs
    a/__init__.py and a/b/__init__.py first. The importer's own packages are left out (they are running
    already when it is imported)."""
    packages = {m for m, path in own_modules().items() if path.name == "__init__.py"}

    def above(name: str) -> set[str]:
        parts = name.split(".")
        return {".".join(parts[:i]) for i in range(1, len(parts))}

    return {m: imported | {p for o in imported for p in above(o) & packages if p not in above(m) and p != m}
            for m, imported in graph.items()}


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Each import seen where the two modules' paths part: `a.b.x -> a.c.y` is `a.b -> a.c` (a package, or a
    module, beside another in the same package); an import within one path (a package and a module of it)
    is none."""
    found: dict[str, set[str]] = {}
    for module, imported in graph.items():
        for other in imported:
            mine, theirs = module.split("."), other.split(".")
            common = next((i for i, (x, y) in enumerate(zip(mine, theirs, strict=False)) if x != y), None)
            if common is not None:
                found.setdefault(".".join(mine[:common + 1]), set()).add(".".join(theirs[:common + 1]))
                found.setdefault(".".join(theirs[:common + 1]), set())
    return found


def test_no_cycle_through_a_package_init_and_no_package_cycle():
    plain, graph = import_graph(), with_package_inits(import_graph())
    # `from provision.cloud import storage` runs provision/cloud/__init__.py: an edge the plain walk does not see
    assert "provision.cloud" not in plain["provision.runs"] and "provision.cloud" in graph["provision.runs"]
    assert cycles(graph) == []
    assert cycles(package_graph(graph)) == []
    # Planted, as the kinds' registry once had it: a lifecycle module importing a leaf module of the kinds'
    # package, whose __init__ imports every kind, one of which imports that lifecycle module. No cycle of
    # modules, one through the package's __init__.
    planted = {**plain, "provision.kinds.shared": set()}
    planted["provision.services"] = plain["provision.services"] | {"provision.kinds.shared"}
    planted["provision.kinds.vertex.kind"] = plain["provision.kinds.vertex.kind"] | {"provision.services"}
    assert cycles(planted) == []
    assert any({"provision.kinds", "provision.services"} <= set(c) for c in cycles(with_package_inits(planted)))
    # Planted, as trainer.sample and trainer.serve once were: two packages (here a module and a package) that
    # import each other's modules, with no cycle of modules.
    two = {**graph, "trainer.serve.startup": graph["trainer.serve.startup"] | {"trainer.sample"}}
    assert cycles(two) == [] and ["trainer.sample", "trainer.serve"] in cycles(package_graph(two))


def test_no_import_cycle_among_the_projects_modules(tmp_path):
    graph = import_graph()
    assert "provision.kinds" in graph["provision.cli.config_cmds"]  # the walk sees function-level imports
    assert "provision.config_sections" in graph["provision.rendering"]  # and those under TYPE_CHECKING
    assert cycles(graph) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # it finds one
    # Planted: provision.errors importing the CLI inside a function, and a module importing a name (not a
    # module) of its package beside a module of it; each makes a cycle the walk must find.
    planted = tmp_path / "errors.py"
    planted.write_text("def f():\n    from provision.cli import main\n")
    with_cli = {**graph, "provision.errors": graph["provision.errors"] | {
        o for o in imported_names("provision.errors", planted) if o in graph}}
    assert any("provision.errors" in cycle and "provision.cli" in cycle for cycle in cycles(with_cli))
    planted.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from provision.cli import main\n")
    assert "provision.cli" in imported_names("provision.errors", planted)  # never run, a circle all the same
    planted.write_text("from provision.cloud import storage, Session\n")
    names = imported_names("provision.cloud.storage", planted)
    assert {"provision.cloud", "provision.cloud.storage"} <= names


# The layers of the house, highest first: a module may import its own layer's and lower layers' modules
# (function-level and TYPE_CHECKING imports too), never a higher one's. A kind of target (provision.kinds)
# is one unit that the spec asks (its checks, sections, files); the config's models (the common sections,
# provision.config_sections, and each kind's) lie below everything that reads a config, the config's
# composition root (provision.config: the registry and the planner handed to the loader) above the kinds;
# the core the kinds and the lifecycle share (provision.core: placement, workload, deployment, reports,
# Kind) is a leaf of the base.
LAYERS = (
    ("cli", ("provision.cli", "provision.app", "provision.__main__")),
    ("spec", ("provision.config", "provision.planner", "provision.kinds", "provision.kinds.common",
              "provision.kinds.tpu_vm.kind", "provision.kinds.vertex.kind", "provision.kinds.gke.kind",
              "provision.foundation")),
    ("lifecycle", ("provision.runs", "provision.services", "provision.context", "provision.goodput",
                   "provision.kinds.tpu_vm.slices", "provision.kinds.vertex.jobs", "provision.kinds.vertex.endpoints",
                   "provision.kinds.gke.gke", "provision.kinds.gke.gke_serve",
                   "provision.kinds.gke.gke_lws", "provision.kinds.gke.gke_pools")),
    ("render", ("provision.rendering", "provision.container", "provision.templates", "provision.image",
                "provision.kinds.tpu_vm.slice_render", "provision.kinds.vertex.vertex_render",
                "provision.kinds.gke.gke_render", "provision.kinds.gke.gke_serve_render",
                "provision.kinds.gke.gke_lws_render")),
    ("sections", ("provision.config_sections", "provision.kinds.slice_section",
                  "provision.kinds.tpu_vm.slice_sections", "provision.kinds.vertex.vertex_sections",
                  "provision.kinds.gke.gke_sections")),
    ("cloud", ("provision.cloud",)),
    ("adapters", ("provision.cloud.api", "provision.cloud.calls", "provision.cloud.messages",
                  "provision.cloud.credentials", "provision.cloud.tpu", "provision.cloud.vertex",
                  "provision.cloud.container", "provision.cloud.build", "provision.cloud.storage",
                  "provision.cloud.kube")),
    ("base", ("provision.core", "provision.errors", "provision.console", "provision.clock", "provision.catalogue",
              "provision.resources", "provision.statefiles", "provision.waiting", "provision.guest_attributes",
              "provision.shapes")),
    # The arithmetic the planner and the trainer share (parameters, counts, mesh rules, quantized layouts, KV
    # positions): below every layer, and importing nothing but the standard library and itself (ARITH_OWN).
    ("arith", ("trainer.arith",)),
)


def layer_of(module: str) -> str | None:
    """The layer of a module of provision/ or of the arithmetic core (the longest prefix that names it); None:
    the emulator, the package itself, or the rest of the trainer."""
    found = [(len(prefix), name) for name, prefixes in LAYERS for prefix in prefixes
             if module == prefix or module.startswith(prefix + ".")]
    return max(found)[1] if found else None


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import against the house's rules: a layer importing a higher one, anything but the CLI
    importing the emulator, the trainer importing the control plane."""
    rank = {name: i for i, (name, _) in enumerate(LAYERS)}
    found = []
    for module, imported in sorted(graph.items()):
        mine = layer_of(module)
        for other in sorted(imported):
            theirs = layer_of(other)
            if mine and theirs and rank[theirs] < rank[mine]:
                found.append(f"{module} ({mine}) imports {other} ({theirs})")
            elif mine not in (None, "cli") and other.startswith("provision.emulator"):
                found.append(f"{module} ({mine}) imports the emulator ({other})")
            elif module.startswith("trainer") and other.startswith("provision"):
                found.append(f"{module} (the trainer) imports the control plane ({other})")
    return found


def test_the_layers_of_the_house():
    graph = import_graph()
    unplaced = sorted(m for m in graph if m.startswith("provision.") and layer_of(m) is None
                      and not m.startswith("provision.emulator") and m != "provision.__main__")
    assert unplaced == []  # a new module of the control plane says where it belongs (LAYERS)
    assert layer_violations(graph) == []
    planted = {module: set(imported) for module, imported in graph.items()}
    planted["provision.rendering"].add("provision.runs")
    planted["provision.kinds.tpu_vm.slices"].add("provision.emulator.world")
    planted["trainer.train"].add("provision.config")
    assert layer_violations(planted) == [
        "provision.kinds.tpu_vm.slices (lifecycle) imports the emulator (provision.emulator.world)",
        "provision.rendering (render) imports provision.runs (lifecycle)",
        "trainer.train (the trainer) imports the control plane (provision.config)"]



def test_the_config_loader_is_handed_the_kinds_and_the_gke_world_is_a_layer_over_its_controllers():
    """The arrows that closed the house's two circles run one way: the config's root (provision.config) hands
    the loader the registry and calls the planner, the loader and the models import neither; the emulator's
    GKE world imports its controllers, which take GKE's records (gke_state) and never see the world."""
    graph = import_graph()
    assert {"provision.kinds", "provision.config.loading"} <= graph["provision.config"]
    assert "provision.planner" in graph["provision.config.meshes"]
    assert [m for module in ("provision.config.loading", "provision.config_sections") for m in graph[module]
            if m.startswith(("provision.kinds", "provision.planner"))] == []
    emulator = "provision.emulator."
    assert {emulator + "gke_lws", emulator + "gke_serving", emulator + "gke_state"} <= graph[emulator + "gke_world"]
    assert [m for m in ("gke_state", "gke_serving", "gke_lws", "local_server", "local_trainer")
            if emulator + "gke_world" in graph[emulator + m]] == []

def documented_layers(text: str) -> dict[str, set[str]]:
    """The layers table of docs/architecture.md: layer -> the modules its second column names (paths under
    provision/, or from the root where they start with trainer/: `a/` and `a/__init__.py` a package, `a/b.py`
    a module)."""
    section = text.split("## The layers", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\w+) \| (.*?) \|[^|]*\|$", section, re.M)
    names = {}
    for layer, cell in rows[1:]:  # the header's row first
        paths = [p.removesuffix("/").removesuffix("/__init__.py").removesuffix(".py")
                 for p in re.findall(r"`([^`]+)`", cell)]
        names[layer] = {p.replace("/", ".") if p.startswith("trainer/") else "provision." + p.replace("/", ".")
                        for p in paths}
    return names


def test_the_architecture_page_lists_the_layers_module_by_module():
    documented = documented_layers((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8"))
    assert documented == {name: set(prefixes) for name, prefixes in LAYERS}
    assert {prefix for _, prefixes in LAYERS for prefix in prefixes} <= set(own_modules())  # each one exists
    planted = "## The layers\n\n| layer | modules | what |\n| --- | --- | --- |\n| base | `core.py`, `cloud/` | x |\n"
    assert documented_layers(planted) == {"base": {"provision.core", "provision.cloud"}}


def test_the_emulators_services_import_by_name_and_never_see_the_emulator():
    # A module imported by string is an edge the walk above cannot see (a cycle it would miss).
    graph = import_graph()
    assert {"provision.emulator.tpu", "provision.emulator.vertex"} <= graph["provision.emulator.operations"]
    emulator = ROOT / "provision" / "emulator"
    by_string = [f"{p.name}: {line.strip()}" for p in emulator.glob("*.py")
                 for line in p.read_text(encoding="utf-8").splitlines()
                 if re.search(r"\bimport_module\(|__import__\(|^\s*import importlib", line)]
    assert by_string == []
    # Only the package (lazily) and the server itself name the Emulator's module: handlers get a transaction.
    sees_server = sorted(p.name for p in emulator.glob("*.py") if p.name not in ("__init__.py", "server.py")
                         and "provision.emulator.server" in p.read_text(encoding="utf-8"))
    assert sees_server == []


# The arithmetic core imports the standard library, its own modules and these (themselves standard-library only):
# the planner runs it where jax, numpy, flax or a cloud SDK is not installed (tests/control/test_arith.py).
ARITH_OWN = ("trainer.arith", "trainer.stacks")


def arith_imports(modules: dict[str, Path]) -> list[str]:
    """Each import of a module of the arithmetic core (and of what it may import) beyond the standard library and
    ARITH_OWN, as "MODULE: NAME"."""
    return sorted(f"{module}: {name}" for module, path in modules.items()
                  if module.startswith(ARITH_OWN) for name in imported_names(module, path)
                  if name.split(".")[0] not in sys.stdlib_module_names
                  and not any(name == own or name.startswith(own + ".") for own in ARITH_OWN))


def test_the_arithmetic_core_imports_only_the_standard_library(tmp_path):
    modules = own_modules()
    assert {"trainer.arith.params", "trainer.arith.mesh", "trainer.arith.quant"} <= set(modules)
    assert arith_imports(modules) == []
    planted = tmp_path / "mesh.py"
    planted.write_text("import math\nfrom trainer.stacks import is_stacked\ndef f():\n    import numpy as np\n"
                       "    from trainer import sharding\n    from pydantic import BaseModel\n")
    assert arith_imports({"trainer.arith.mesh": planted}) == [
        "trainer.arith.mesh: numpy", "trainer.arith.mesh: pydantic", "trainer.arith.mesh: pydantic.BaseModel",
        "trainer.arith.mesh: trainer.sharding"]


# --- private names --------------------------------------------------------------------------------------

# What modules share has a public name in the module that owns it: no module of provision/ or trainer/ uses
# another's private name (`_x`; `__x__` is no private name).


def private_uses(module: str, source: str, is_package: bool = False) -> list[str]:
    """Each private name of another of the project's modules that `source` (the module `module`) uses, as
    "LINE: USE": `from m import _x` (relative imports too), and `m._x` where `m` is a module of the
    project's bound to a name (`import a.b as m`, `import a.b` then `a.b._x`, `from a import b` then
    `b._x`), at any depth of the file."""
    modules = own_modules()
    private = re.compile(r"^_(?!_.*__$)")
    bound: dict[str, str] = {}
    found = []
    nodes = list(ast.walk(ast.parse(source)))
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                name = alias.name if alias.asname else alias.name.split(".")[0]
                if name in modules:
                    bound[alias.asname or name] = name
        elif isinstance(node, ast.ImportFrom):
            base = import_base(module, is_package, node)
            if not base.startswith(OWN):
                continue
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    bound[alias.asname or alias.name] = f"{base}.{alias.name}"
                if private.match(alias.name) and base != module:
                    found.append((node.lineno, f"from {base} import {alias.name}"))
    for node in nodes:
        if isinstance(node, ast.Attribute) and private.match(node.attr):
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            owner = ".".join([bound[value.id], *reversed(chain)]) if isinstance(value, ast.Name) and \
                value.id in bound else None
            if owner in modules and owner != module:
                found.append((node.lineno, f"{owner}.{node.attr}"))
    return [f"{line}: {use}" for line, use in sorted(found)]


def test_no_module_uses_another_modules_private_name():
    found = [f"{path.relative_to(ROOT).as_posix()}:{hit}" for module, path in sorted(own_modules().items())
             for hit in private_uses(module, path.read_text(encoding="utf-8"), path.name == "__init__.py")]
    assert found == []
    planted = """
import provision.shapes
import provision.kinds.gke.gke as lifecycle
from provision.kinds.gke import gke_serve, gke_render as render
from provision.kinds.gke.gke import _delete_pool, pool_in_zone
from .base import _Keys, Spec
from . import names
import os

def f(pool):
    _delete_pool(pool), lifecycle._labels(pool), provision.shapes._ZONE, render.__name__, os._exit
    gke_serve._crash(pool), names._t(pool), lifecycle.pool_labels(pool), _local(pool)
    from trainer.hf.base import _same
"""
    assert private_uses("trainer.hf.deepseek", planted) == [
        "5: from provision.kinds.gke.gke import _delete_pool", "6: from trainer.hf.base import _Keys",
        "11: provision.kinds.gke.gke._labels", "11: provision.shapes._ZONE", "12: provision.kinds.gke.gke_serve._crash",
        "12: trainer.hf.names._t", "13: from trainer.hf.base import _same"]
    assert private_uses("trainer.hf.base", planted)[1:2] == ["11: provision.kinds.gke.gke._labels"]  # its own _Keys


# --- the kinds of target ------------------------------------------------------------------------------

KIND_NAMES = frozenset({"tpu-vm", "vertex", "gke"})
# Where a kind's name may decide something: the kinds themselves and the emulator (its services are
# Google's, whatever kind of target a run calls them through).
KINDS_OWN = ("provision/kinds/", "provision/emulator/")
# Tables of command names, not branches: the `gke` command group shares its name with its kind.
COMMAND_TABLES = {"provision/cli/__init__.py": ("COMMANDS", "SHORT_HELP")}


def kind_branches(source: str, tables: tuple[str, ...] = ()) -> list[str]:
    """Where a kind's name decides something in `source`, as "LINE: NAME": an operand of a comparison (or an
    element of a tuple, list or set compared), a dict literal's key, a subscript's or `.get`'s key, a `match`
    case's value. `tables`: module-level assignments by these names are passed over."""
    tree = ast.parse(source)
    passed = set()
    for statement in tree.body:
        if isinstance(statement, ast.Assign):
            assigned = statement.targets
        elif isinstance(statement, ast.AnnAssign):
            assigned = [statement.target]
        else:
            continue
        if any(isinstance(target, ast.Name) and target.id in tables for target in assigned):
            passed |= {id(node) for node in ast.walk(statement)}

    def named(node: ast.AST | None) -> bool:
        return isinstance(node, ast.Constant) and node.value in KIND_NAMES

    found = []
    for node in ast.walk(tree):
        if id(node) in passed:
            continue
        keys: list[ast.AST | None] = []
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                keys += operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
        elif isinstance(node, ast.Dict):
            keys = list(node.keys)
        elif isinstance(node, ast.Subscript):
            keys = [node.slice]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            keys = node.args[:1]
        elif isinstance(node, ast.MatchValue):
            keys = [node.value]
        found += [(key.lineno, key.col_offset, key.value) for key in keys if named(key)]
    return [f"{line}: {name}" for line, _, name in sorted(found)]


def test_no_kind_of_target_is_named_in_a_branch_outside_the_kinds():
    found = []
    for path in sorted([*(ROOT / "provision").rglob("*.py"), *(ROOT / "trainer").rglob("*.py")]):
        name = path.relative_to(ROOT).as_posix()
        if not name.startswith(KINDS_OWN):
            found += [f"{name}:{hit}" for hit in kind_branches(path.read_text(encoding="utf-8"),
                                                               COMMAND_TABLES.get(name, ()))]
    assert found == []
    planted = """
def f(cfg, table):
    if cfg.target == "gke" or cfg.target not in ("vertex", "other"):
        return {"tpu-vm": 1}[cfg.target], table["vertex"], table.get("gke")
    match cfg.target:
        case "tpu-vm" | "x":
            pass
kind = "vertex"  # a value, not a branch
@click.group("gke")
def group(): pass
COMMANDS = {"gke": "provision.cli.gke_cmds:gke_group"}
"""
    assert kind_branches(planted) == ["3: gke", "3: vertex", "4: tpu-vm", "4: vertex", "4: gke", "6: tpu-vm",
                                      "11: gke"]
    assert kind_branches(planted, ("COMMANDS",))[-1] == "6: tpu-vm"


def test_the_emulators_shared_world_names_no_kind():
    """The services' own records are their parts, which their modules register (provision/emulator/world.py's
    `Part`): the shared world neither branches on a kind's name nor imports a service's world."""
    world = ROOT / "provision" / "emulator" / "world.py"
    assert kind_branches(world.read_text(encoding="utf-8")) == []
    assert [m for m in imported_names("provision.emulator.world", world) if re.search(r"gke|vertex|kube", m)] == []


# A kind's package: everything of the kind (provision/kinds/NAME/). Outside it only the registry
# (provision/kinds/__init__.py: the one line) imports it, and no kind imports another; no module path
# elsewhere carries a kind's name, but for Google's APIs (their clients and their emulator), which are the
# services' own and serve every kind.
KIND_PACKAGES = ("tpu_vm", "vertex", "gke")
GOOGLES_OWN = ("provision/cloud/", "provision/emulator/")


def kind_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a kind's package from outside it (the registry's aside), as "IMPORTER -> IMPORTED"."""
    found = []
    for module, imported in sorted(graph.items()):
        mine = module.split(".")[2] if module.startswith("provision.kinds.") else None
        for other in sorted(imported):
            parts = other.split(".")
            theirs = parts[2] if other.startswith("provision.kinds.") and len(parts) > 2 else None
            if theirs in KIND_PACKAGES and theirs != mine and module != "provision.kinds":
                found.append(f"{module} -> {other}")
    return found


def test_a_kind_is_one_package_that_only_the_registry_imports():
    graph = import_graph()
    assert sorted(p.name for p in (ROOT / "provision" / "kinds").iterdir() if (p / "__init__.py").is_file()) == \
        sorted(KIND_PACKAGES)
    assert kind_imports(graph) == []
    assert {"provision.kinds.gke.kind", "provision.kinds.vertex.kind"} <= graph["provision.kinds"]
    paths = [path.relative_to(ROOT) for path in (ROOT / "provision").rglob("*.py")]
    elsewhere = [path for path in paths if not path.as_posix().startswith(("provision/kinds/", *GOOGLES_OWN))]
    named = sorted(path.as_posix() for path in elsewhere
                   if any(name in part for part in path.parts for name in (*KIND_PACKAGES, *KIND_NAMES)))
    assert named == []
    planted = {module: set(imported) for module, imported in graph.items()}
    planted["provision.kinds.gke.kind"].add("provision.kinds.vertex.kind")  # a kind importing another
    planted["provision.cli.config_cmds"].add("provision.kinds.tpu_vm.slices")  # a command importing a kind's module
    assert kind_imports(planted) == ["provision.cli.config_cmds -> provision.kinds.tpu_vm.slices",
                                     "provision.kinds.gke.kind -> provision.kinds.vertex.kind"]


def test_a_kinds_own_command_group_is_the_kinds():
    """The groups that `--help` lists (provision.cli's COMMANDS, read without importing a kind) are the
    kinds' own, each made from its kind."""
    from provision.cli import COMMANDS
    from provision.kinds import KINDS

    made = {name for name, where in COMMANDS.items() if where.startswith("provision.cli.kind_cmds:")}
    assert made == {kind.group for kind in KINDS.values()}
    assert all(COMMANDS[name] == f"provision.cli.kind_cmds:{name}" for name in made)


# A kind's renderers (provision/kinds/NAME/*render*.py) take the kind's own sections and one
# provision.rendering.RenderContext, made from the config in that one place by the kind's `render` or its
# lifecycle; never the whole config.
def config_parameters(source: str) -> list[str]:
    """Each parameter in `source` named `cfg` or annotated with `Config` (bare, dotted, quoted, in a union), of
    a function, a method or a lambda, as "LINE: FUNCTION(PARAMETER)"."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        given = node.args
        for arg in (*given.posonlyargs, *given.args, given.vararg, *given.kwonlyargs, given.kwarg):
            annotation = ast.unparse(arg.annotation) if arg is not None and arg.annotation is not None else ""
            if arg is not None and (arg.arg == "cfg" or re.search(r"\bConfig\b", annotation)):
                found.append(f"{node.lineno}: {getattr(node, 'name', '<lambda>')}({arg.arg})")
    return found


def test_a_kinds_renderers_never_take_the_whole_config():
    renderers = sorted((ROOT / "provision" / "kinds").glob("*/*render*.py"))
    assert len(renderers) >= 5  # each kind's: the slice, the custom job, GKE's three
    found = [f"{path.relative_to(ROOT).as_posix()}:{hit}" for path in renderers
             for hit in config_parameters(path.read_text(encoding="utf-8"))]
    assert found == []
    planted = """
def fine(gke: GkeConfig, slice: SliceConfig, ctx: RenderContext, zone: str) -> str: ...
def named(cfg, zone): ...
def annotated(zone: str, config: Config): ...
def quoted(*, c: "provision.config.Config | None" = None, **rest: Config): ...
class Spec:
    def method(self, cfg): ...
check = lambda ctx, cfg=None: ctx
"""
    assert config_parameters(planted) == ["3: named(cfg)", "4: annotated(config)", "5: quoted(c)", "5: quoted(rest)",
                                          "7: method(cfg)", "8: <lambda>(cfg)"]


def test_google_is_imported_only_under_cloud_and_the_emulator():
    allowed = ("provision/cloud/", "provision/emulator/")
    found = sorted(f"{path.relative_to(ROOT)}: {name}" for module, path in own_modules().items()
                   for name in imported_names(module, path)
                   if name.split(".")[0] == "google" and not str(path.relative_to(ROOT)).startswith(allowed))
    assert found == []


def test_help_imports_no_cloud_client_and_no_jax():
    # Measured against the interpreter's own start: google-cloud packages install a .pth file that
    # creates the empty `google` namespace package before any code runs.
    probe = ("import sys\nbefore = set(sys.modules)\nfrom provision.cli import main\ntry:\n    main(['--help'])\n"
             "except SystemExit:\n    pass\nnew = set(sys.modules) - before\n"
             "print(sorted({m for m in new if m.split('.')[0] in {'google', 'grpc', 'jax', 'kubernetes'}}))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "moe-tpu" in result.stdout and result.stdout.strip().endswith("[]")


# --- sizes ----------------------------------------------------------------------------------------------

MAX_FUNCTION_LINES, MAX_MODULE_LINES = 60, 450
# Over the rule, each with its reason (none now).
OVERSIZED: set[str] = set()


def oversized(name: str, source: str) -> list[str]:
    """Where `source` breaks the house's size rule: the module past MAX_MODULE_LINES lines, a function past
    MAX_FUNCTION_LINES (from its `def`, docstring included), as "NAME:FUNCTION (N lines)"."""
    found = [f"{name} ({source.count(chr(10))} lines)"] if source.count("\n") > MAX_MODULE_LINES else []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES and f"{name}:{node.name}" not in OVERSIZED:
                found.append(f"{name}:{node.name} ({lines} lines)")
    return found


def test_no_function_over_60_lines_and_no_module_over_450_in_the_control_plane():
    found = [hit for path in sorted((ROOT / "provision").rglob("*.py"))
             for hit in oversized(path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8"))]
    assert found == []
    planted = "def f():\n" + "    x = 1\n" * 60 + "\n" * 400
    assert oversized("p.py", planted) == ["p.py (461 lines)", "p.py:f (61 lines)"]


def test_the_suites_longest_first_schedule_names_only_files_that_exist():
    """tests/conftest.py's LONGEST_FIRST hands the long files out first; a listed file renamed or removed
    would leave its entry dead and the file under its new name handed out last, unnoticed."""
    tree = ast.parse((ROOT / "tests" / "conftest.py").read_text(encoding="utf-8"))
    listed = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                  and any(getattr(target, "id", None) == "LONGEST_FIRST" for target in node.targets))
    missing = [path for path in listed if not (ROOT / "tests" / path).is_file()]
    assert len(listed) > 20 and not missing and len(set(listed)) == len(listed), missing
