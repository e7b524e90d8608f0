"""The tree as a whole: what its files cite exists in it, and the layering holds."""

from __future__ import annotations

import re
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
