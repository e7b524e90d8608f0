"""Command-line checkers whose dependencies fight the project's, each in a virtual environment of
its own, made once per machine and reused by every later test run.

checkov pins `packaging<24` in every release while the project's build tools need a newer one:
installed beside the project, pip backtracks through hundreds of checkov releases and downgrades
libraries under the project. Here it gets its own environment, so the project's stays consistent
(`pip check` clean) and resolves at once. pip has no notion of a per-tool environment and the
tool managers that do (pipx, uv) are not test dependencies, hence these few lines.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
from pathlib import Path

CHECKOV = "checkov>=3.2,<4"


def tools_dir() -> Path:
    """Where the environments live: $MOE_TPU_TOOLS_DIR, else the user's cache directory."""
    if os.environ.get("MOE_TPU_TOOLS_DIR"):
        return Path(os.environ["MOE_TPU_TOOLS_DIR"])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "moe-tpu" / "tools"


def executable(command: str, requirement: str) -> Path:
    """The path of `command` in an environment that holds `requirement` alone, made the first
    time (under a lock, so concurrent test runs make it once); a half-made one is made again."""
    digest = hashlib.sha256(f"{requirement} {sys.version_info[:2]}".encode()).hexdigest()[:12]
    home = tools_dir() / f"{command}-{digest}"
    tool = home / "bin" / command
    ready = home / ".ready"
    home.parent.mkdir(parents=True, exist_ok=True)
    with open(home.parent / f".{command}-{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if ready.is_file() and tool.is_file():
            return tool
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(home)], check=True, timeout=600)
        install = subprocess.run([str(home / "bin" / "python"), "-m", "pip", "install", "-q", requirement],
                                 capture_output=True, text=True, timeout=1800)
        if install.returncode != 0:
            raise RuntimeError(f"could not install {requirement!r} into {home}:\n{install.stderr[-3000:]}")
        ready.write_text(requirement + "\n")
    return tool
