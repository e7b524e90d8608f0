"""The Jinja templates: the builtin ones (templates/, or provision/_templates in a wheel) and a
directory of the user's own copies (`--templates`) searched first.

One Environment per directory, with StrictUndefined and two filters: `shquote` (a value made safe
for a shell) and `json` (any text made a valid YAML scalar). Templates receive a typed spec.
"""

from __future__ import annotations

import functools
import json
import shlex
from pathlib import Path
from typing import Any

import provision
from provision.errors import UsageError


def builtin_templates_dir() -> Path:
    """templates/ of the checkout, or provision/_templates inside an installed wheel."""
    packaged = Path(provision.__file__).resolve().parent / "_templates"
    if packaged.is_dir():
        return packaged
    return Path(provision.__file__).resolve().parent.parent / "templates"


@functools.lru_cache(maxsize=8)
def _environment(templates_dir: str | None) -> Any:
    import jinja2

    search = [builtin_templates_dir()]
    if templates_dir is not None:
        search.insert(0, Path(templates_dir))
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader([str(p) for p in search]),
        undefined=jinja2.StrictUndefined, autoescape=False,
        keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True,
    )
    env.filters["shquote"] = lambda value: shlex.quote(str(value))
    # A JSON string is a valid YAML scalar: the safe way to put any text into a YAML template.
    env.filters["json"] = lambda value: json.dumps(value, ensure_ascii=False)
    return env


def render(name: str, spec: object, templates_dir: Path | None = None) -> str:
    """Render one template with `spec`; any template problem becomes a UsageError naming it."""
    import jinja2

    if templates_dir is not None and not Path(templates_dir).is_dir():
        raise UsageError(f"templates directory {templates_dir} does not exist",
                         hint="point --templates at a directory holding your copies of the templates")
    env = _environment(str(Path(templates_dir).resolve()) if templates_dir is not None else None)
    try:
        return env.get_template(name).render(spec=spec)
    except jinja2.TemplateNotFound:
        raise UsageError(f"template {name} not found", hint=where(templates_dir)) from None
    except jinja2.TemplateSyntaxError as exc:
        raise UsageError(f"template {name}, line {exc.lineno}: {exc.message}",
                         hint=where(templates_dir)) from None
    except jinja2.TemplateError as exc:
        raise UsageError(f"template {name}: {exc}", hint=where(templates_dir)) from None


def where(templates_dir: Path | None) -> str:
    builtin = builtin_templates_dir()
    where = f"{templates_dir}, then {builtin}" if templates_dir else str(builtin)
    return f"templates are read from {where}"
