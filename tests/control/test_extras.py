"""Every third-party module the code imports is declared, in the extra that a missing one names.

The imports are read from the source (ast), so a new import without its declaration fails here.
Each module is traced to the distribution that installs it (importlib.metadata), and
`errors.extra_of` must name an extra (or the base install) that declares that distribution.
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import re
import sys
import tomllib
from functools import cache
from pathlib import Path

import pytest

from provision.errors import MissingDependency, extra_of

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
OWN = {"provision", "trainer", "__future__"}


def canonical(requirement: str) -> str:
    """The distribution's name of a requirement, normalised (PEP 503)."""
    name = re.match(r"^[A-Za-z0-9._-]+", requirement).group(0)
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(extra: str | None) -> set[str]:
    """The distributions the base install declares, plus those of `extra` (extras it includes too)."""
    names = {canonical(r) for r in PYPROJECT["project"]["dependencies"]}
    pending = [extra] if extra else []
    while pending:
        for requirement in PYPROJECT["project"]["optional-dependencies"][pending.pop()]:
            if requirement.startswith("moe-tpu["):
                pending += requirement[len("moe-tpu["):-1].split(",")
            else:
                names.add(canonical(requirement))
    return names


def imported_modules(package: str) -> set[str]:
    """Dotted names of the third-party modules `package` imports (absolute imports only)."""
    found: set[str] = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:  # `from google.cloud import storage`: storage may be a module
                    sub = f"{node.module}.{alias.name}"
                    found.add(sub if _is_module(sub) else node.module)
    return {m for m in found if m.split(".")[0] not in OWN and m.split(".")[0] not in sys.stdlib_module_names}


def _is_module(name: str) -> bool:
    return _installer(name) is not None


@cache
def _files_of(distribution: str) -> frozenset[str]:
    return frozenset(str(f) for f in metadata.distribution(distribution).files or ())


@cache
def _distributions() -> dict[str, list[str]]:
    return metadata.packages_distributions()


@cache
def _installer(module: str) -> str | None:
    """The installed distribution whose files hold `module`'s own file, read from the distributions'
    file lists (nothing is imported: namespace packages like google.* share a top-level name)."""
    parts = module.split(".")
    own = (str(Path(*parts, "__init__.py")), str(Path(*parts[:-1], parts[-1] + ".py")))
    for distribution in _distributions().get(parts[0], []):
        files = _files_of(distribution)
        if any(f in files for f in own) or any(f.startswith(str(Path(*parts[:-1], parts[-1] + "."))) and
                                               f.endswith((".so", ".pyd")) for f in files):
            return canonical(distribution)
    return None


def distribution_of(module: str) -> str:
    distribution = _installer(module)
    assert distribution is not None, f"{module} is imported but no installed distribution holds it"
    return distribution


@pytest.mark.parametrize("package", ["provision", "trainer"])
def test_every_import_is_declared_in_the_extra_a_missing_one_names(package):
    undeclared = {}
    for module in sorted(imported_modules(package)):
        distribution = distribution_of(module)
        extra = extra_of(module)
        if distribution not in declared(extra):
            undeclared[module] = (distribution, extra)
    assert undeclared == {}


def test_the_trainer_needs_only_the_trainer_extra():
    """The container installs [trainer] (and [pathways] for pathwaysutils, imported only there);
    [data] (Parquet corpora for trainer.prepare), [plot] (`logs --plot`), [serve] (trainer.serve's
    HTTP server, which the serving container installs) and [eval] (lm-evaluation-harness, for
    trainer.serve.evaluate) are imported only by the features that need them."""
    outside = {m: extra_of(m) for m in imported_modules("trainer") if distribution_of(m) not in declared(None)
               and extra_of(m) not in ("trainer", "pathways", "data", "plot", "serve", "eval")}
    assert outside == {}
    assert {"etils", "tensorstore", "orbax-checkpoint", "jax", "flax"} <= declared("trainer")


def test_a_missing_cloud_build_names_the_image_extra():
    error = MissingDependency.of(ModuleNotFoundError("No module named 'google.cloud.devtools'",
                                                     name="google.cloud.devtools"))
    assert error.hint == "install it with: pip install 'moe-tpu[image]'"
    assert "google-cloud-build" in declared("image") and "google-cloud-build" not in declared("control")
    storage = MissingDependency.of(ModuleNotFoundError(name="google.cloud.storage"))
    assert storage.hint.endswith("'moe-tpu[control]'") and "google-cloud-storage" in declared("control")
    assert MissingDependency.of(ModuleNotFoundError(name="left_pad")) is None
