"""The errors the CLI turns into messages and exit codes (never tracebacks).

Exit 2: the user's input is wrong (flags, config). Exit 1: the cloud or the run failed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# A quoted value in a message is cut to this many characters: a message names a bad value, it
# does not print a pasted file back.
MAX_QUOTED = 200
_LONG_QUOTED = re.compile(f"'[^'\n]{{{MAX_QUOTED},}}'|\"[^\"\n]{{{MAX_QUOTED},}}\"")


def shorten_quoted(message: str) -> str:
    """`message` with every quoted value longer than MAX_QUOTED cut, saying how long it was."""
    def cut(match: re.Match) -> str:
        text = match.group(0)
        return f"{text[:MAX_QUOTED - 40]}...{text[-20:]} ({len(text) - 2} characters)"

    return _LONG_QUOTED.sub(cut, message)


class MoeTpuError(Exception):
    """An error with a message for the user and, where we know one, a fix."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class UsageError(MoeTpuError):
    exit_code = 2


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config file: where, and what."""

    file: str
    key: str
    message: str

    def __post_init__(self) -> None:
        if len(self.key) > MAX_QUOTED:
            object.__setattr__(self, "key", f"{self.key[:MAX_QUOTED - 40]}... ({len(self.key)} characters)")
        object.__setattr__(self, "message", shorten_quoted(self.message))

    def __str__(self) -> str:
        where = f"{self.file}: {self.key}" if self.key else self.file
        return f"{where}: {self.message}"


class ConfigError(UsageError):
    """Every problem found in a config, reported together."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = list(problems)
        n = len(self.problems)
        head = f"{n} problem{'s' if n != 1 else ''} in the config"
        super().__init__(head + ":\n" + "\n".join(f"  {p}" for p in self.problems))


class CloudError(MoeTpuError):
    """The cloud (or the emulator) refused or failed; exit 1."""


class QuotaError(CloudError):
    pass


class StockoutError(CloudError):
    pass


class WaitTimeout(CloudError):
    """A wait (provision.waiting.poll) that gave up: what it waited for did not happen in time."""


# Modules of each extra's packages (a dotted prefix: the longest one that matches a missing
# module wins), so a command that needs one names the extra that installs it. Google's packages
# share the `google` namespace: [control] installs most of them, [image] Cloud Build.
EXTRA_OF_MODULE = {
    "jinja2": "control", "tenacity": "control", "grpc": "control", "grpc_status": "control",
    "google": "control", "google.cloud.devtools": "image", "build": "image",
    "jax": "trainer", "jaxlib": "trainer", "flax": "trainer", "optax": "trainer", "orbax": "trainer",
    "numpy": "trainer", "etils": "trainer", "tensorstore": "trainer", "gcsfs": "trainer", "fsspec": "trainer",
    "grain": "trainer", "array_record": "trainer", "tokenizers": "trainer", "tensorboardX": "trainer",
    "safetensors": "trainer", "ml_dtypes": "trainer", "tokamax": "trainer", "qwix": "trainer", "absl": "trainer",
    "matplotlib": "plot", "pyarrow": "data",
    "pathwaysutils": "pathways",
    "kubernetes": "control", "urllib3": "control", "cryptography": "control",
    "fastapi": "serve", "starlette": "serve", "uvicorn": "serve", "prometheus_client": "serve",
    # the server renders an imported model's chat template in jinja2's sandbox (trainer/serve/chat.py)
    "jinja2.sandbox": "serve", "jinja2.exceptions": "serve",
    "llguidance": "serve",  # structured output (trainer/serve/structured.py)
    "lm_eval": "eval",
}


def extra_of(module: str) -> str | None:
    """The extra that installs `module` (a dotted name), or None when no extra does."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        extra = EXTRA_OF_MODULE.get(".".join(parts[:end]))
        if extra is not None:
            return extra
    return None


class MissingDependency(UsageError):
    def __init__(self, package: str, extra: str) -> None:
        super().__init__(
            f"this command needs the Python package {package!r}, which is not installed",
            hint=f"install it with: pip install 'moe-tpu[{extra}]'",
        )

    @classmethod
    def of(cls, exc: ModuleNotFoundError) -> MissingDependency | None:
        """The error to show for a module an extra would have installed; None for any other module."""
        name = exc.name or ""
        extra = extra_of(name)
        return cls(name, extra) if extra else None
