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


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth, except those under `if TYPE_CHECKING:` (never run)."""
    found = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def imported_names(module: str, path: Path) -> set[str]:
    """The dotted names a module imports at run time (relative imports made absolute)."""
    names = set()
    for node in _runtime_imports(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
            continue
        base = node.module or ""
        if node.level:
            package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
        # `from package import module` imports that module (its package's __init__ runs first
        # anyway); `from module import name` imports the module.
        subs = {f"{base}.{alias.name}" for alias in node.names} & set(own_modules())
        names |= subs if subs else {base}
        names |= {f"{base}.{alias.name}" for alias in node.names} if not base.startswith(OWN) else set()
    return names


def import_graph() -> dict[str, set[str]]:
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


def test_no_import_cycle_among_the_projects_modules():
    graph = import_graph()
    assert "provision.targets" in graph["provision.cli.config_cmds"]  # the walk sees function-level imports
    assert cycles(graph) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # it finds one


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
