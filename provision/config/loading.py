"""Reading a config file: the bounded YAML (trainer/safeyaml.py), the keys' lines, the config validated
as the union of the kinds' configs it is handed (provision.config_sections.config_union), the pydantic errors
and the broken rules between keys as messages naming the dotted key.

It imports no kind and no planner: the composition root (provision/config/__init__.py) hands it the registry's
kinds (`kinds`, read afresh at each call), and decides the meshes with the planner after it (meshes.py)."""

from __future__ import annotations

import functools
import typing
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from provision.config_sections import DEFAULT_TARGET, Config, config_union, kind_config, target_problem
from provision.core import Kind
from provision.errors import ConfigError, Problem
from provision.shapes import DEFAULT_CONFIG, RULES, brief, check
from trainer import safeyaml, schema

MAX_PROBLEMS = 50  # listed of a config's schema errors; the rest are counted
Kinds = Mapping[str, Kind]  # the config's `target` -> its kind (provision.kinds.KINDS, handed in)

# --- loading ---------------------------------------------------------------------------

def _key_lines(root: yaml.Node | None, lines: dict[str, int]) -> list[tuple[str, int]]:
    """Fill `lines` (dotted key -> line) and return (dotted key, line) of every key given twice.

    Walks the document as aliases expand it (safeyaml.compose bounded its size first)."""
    duplicates: list[tuple[str, int]] = []
    stack: list[tuple[yaml.Node | None, str]] = [(root, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                dotted = f"{path}.{key_node.value}" if path else str(key_node.value)
                if dotted in lines:
                    duplicates.append((dotted, key_node.start_mark.line + 1))
                lines[dotted] = key_node.start_mark.line + 1
                stack.append((value_node, dotted))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                lines[f"{path}[{i}]"] = item.start_mark.line + 1
                stack.append((item, f"{path}[{i}]"))
    return duplicates


def _load_yaml(text: str, lines: dict[str, int]) -> tuple[Any, list[tuple[str, int]]]:
    """Parse once, every bound checked first (trainer/safeyaml.py), then the keys' lines."""
    root = safeyaml.compose(text)
    duplicates = _key_lines(root, lines)
    return safeyaml.construct(root), duplicates


def _parse_yaml(text: str, file: str, lines: dict[str, int]) -> tuple[Any, list[Problem]]:
    try:
        data, duplicates = _load_yaml(text, lines)
    except safeyaml.Unbounded as exc:
        return None, [Problem(file, "", f"YAML is not a config: {exc}")]
    except yaml.YAMLError as exc:
        return None, [Problem(file, "", safeyaml.describe(exc))]
    return data, [Problem(file, key, f"key appears twice (again at line {line})") for key, line in duplicates]


def _dotted(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds (`X | None` too), or None."""
    for member in (annotation, *typing.get_args(annotation)):
        if isinstance(member, type) and issubclass(member, BaseModel):
            return member
    return None


def _kind_sections(kinds: Kinds) -> dict[str, Any]:
    """Each section a kind brings to the config (Kind.sections' fields), by key: the kind's sections
    model, the first kind's of those that read it (the slice section: two kinds')."""
    found: dict[str, Any] = {}
    for kind in kinds.values():
        fields = kind.sections.model_fields if kind.sections is not None else {}
        for key, field in fields.items():
            if _model_of(field.annotation) is not None:
                found.setdefault(key, kind.sections)
    return found


def _section_models(kinds: Kinds) -> dict[str, type[BaseModel]]:
    """Every section's model by its key, the common ones, the kinds' and those within them (gke.pathways)."""
    models: dict[str, type[BaseModel]] = {}
    fields = [*Config.model_fields.items(), *((key, sections.model_fields[key])
                                               for key, sections in _kind_sections(kinds).items())]
    while fields:
        key, field = fields.pop(0)
        model = _model_of(field.annotation)
        if model is not None and key not in models:
            models[key] = model
            fields += model.model_fields.items()
    return models


def top_sections(kinds: Kinds) -> dict[str, type[BaseModel]]:
    """The sections a config file may have at its top, by key: the common ones and every kind's."""
    return {key: _model_of(field.annotation) for key, field in _top_keys(kinds).model_fields.items()
            if _model_of(field.annotation) is not None}


def _top_keys(kinds: Kinds) -> Any:
    """The keys a config file may have at its top (for an unknown one's hint): the common ones, with
    every kind's sections after `target`."""
    common = [(key, field) for key, field in Config.model_fields.items() if not field.exclude]
    at = next(i for i, (key, _) in enumerate(common) if key == "target") + 1
    theirs = [(key, sections.model_fields[key]) for key, sections in _kind_sections(kinds).items()]
    return SimpleNamespace(model_fields=dict([*common[:at], *theirs, *common[at:]]))


def _message(err: Any, kinds: Kinds) -> str:
    """A pydantic error in the project's words (trainer.schema.explain: the trainer's config says the same)."""

    def model_at(loc: tuple[Any, ...]) -> Any:
        if not loc:
            return _top_keys(kinds)
        sections = _section_models(kinds)
        if loc[-1] in sections and all(isinstance(part, str) for part in loc):
            return sections[loc[-1]]
        return None

    return schema.explain(err, model_at, show=brief)


@functools.cache
def _union(kinds: tuple[Any, ...]) -> Any:
    return config_union(kinds)


def _as_kind(raw: dict[str, Any], file: str, kinds: Kinds) -> tuple[type[Config], dict[str, Any], dict[str, Any],
                                                                 list[Any], list[Problem]]:
    """The config `raw` is of (the kind's config, or where `target` names no kind the common one alone),
    its data, the sections of other kinds left in the file (key -> the model of the kind that reads it), the
    errors of those (each validated by that model) and a bad `target`'s problem."""
    target = raw["target"] if "target" in raw else DEFAULT_TARGET
    why = target_problem(target, list(kinds))
    model = kind_config(kinds[target]) if why is None else Config
    foreign = {key: sections for key, sections in _kind_sections(kinds).items()
               if key in raw and key not in model.model_fields}
    others, errors = {}, []
    for key, sections in foreign.items():
        try:
            others[key] = getattr(sections.model_validate({key: raw[key]}), key)
        except ValidationError as exc:
            errors += exc.errors()
    data = {key: value for key, value in raw.items() if key not in foreign and key != "target"}
    data.update(other_sections=others, source=Path(file))
    if why is not None:
        return model, data, foreign, errors, [Problem(file, "target", why)]
    return model, {**data, "target": target}, foreign, errors, []


def _stand_in(model: type[BaseModel], data: Any) -> Any:
    """`model` built from the file's values as given, unvalidated (a key left out: its default), for the rules
    between keys of a config that failed validation (provision.shapes.check passes over the failed keys)."""
    if not isinstance(data, dict):
        return data
    values = {}
    for name, field in model.model_fields.items():
        if name not in data:
            continue
        value, section = data[name], _model_of(field.annotation)
        if section is not None and value is None and (field.default is not None or field.default_factory):
            value = {}
        values[name] = _stand_in(section, value) if section is not None else value
    return model.model_construct(**values)


def _found(model: Any, failed: frozenset[str], prefix: str = "") -> list[tuple[str, str]]:
    """What the rules between keys of `model` and of its sections find, keys dotted below it."""
    found: list[tuple[str, str]] = []
    for name in type(model).model_fields:
        section = getattr(model, name, None)
        if isinstance(section, BaseModel):
            found += [(f"{name}.{key}", message) for key, message in _found(section, failed, f"{prefix}{name}.")]
    return found + check(model, failed, prefix)


def _rules_of_failed(model: type[Config], data: dict[str, Any], raw: dict[str, Any], foreign: dict[str, Any],
                     failed: frozenset[str]) -> list[tuple[str, str]]:
    """The rules between keys of a config whose keys `failed` their own rules (so validation ran none of the
    rules of a model with a failed key): each run on the file's values where no key it reads failed."""
    found = _found(_stand_in(model, data), failed)
    for key, sections in foreign.items():
        section = getattr(_stand_in(sections, {key: raw[key]}), key, None)
        if isinstance(section, BaseModel):
            found += [(f"{key}.{below}", message) for below, message in _found(section, failed, f"{key}.")]
    return found


def validated(raw: Any, kinds: Kinds, source: Path | str = DEFAULT_CONFIG) -> Config:
    """Already-parsed YAML validated as the union of `kinds`' configs; ConfigError lists every problem."""
    file = str(source)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError([Problem(file, "", "the config must be a YAML mapping of keys "
                                             "(project, region, zones, run, ...)")])
    return _validate(dict(raw), file, [], {}, kinds)


def _control_characters(raw: Any, path: str = "") -> list[tuple[str, str]]:
    """(dotted key, message) for every string value (or key) holding a NUL or another control character:
    values reach templates, a shell script and request bodies, where such a character is never meant."""
    found: list[tuple[str, str]] = []
    stack: list[tuple[Any, str]] = [(raw, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                dotted = f"{where}.{key}" if where else str(key)
                if isinstance(key, str) and not key.isprintable():
                    found.append((dotted, f"key {brief(key)} holds control characters"))
                stack.append((value, dotted))
        elif isinstance(node, list):
            stack.extend((item, f"{where}[{i}]") for i, item in enumerate(node))
        elif isinstance(node, str) and not node.isprintable():
            found.append((where, f"{brief(node)} holds a control character (NUL, a newline, an escape...); "
                                 "values reach templates and a shell script, so they must be plain text"))
    return found


def _in_file_order(problems: list[Problem], lines: dict[str, int]) -> list[Problem]:
    """Problems sorted by where their key is in the file; keys not in it (missing) go last."""
    def line(problem: Problem) -> int:
        key = problem.key
        while key:
            if key in lines:
                return lines[key]
            key = key.rsplit(".", 1)[0] if "." in key else (key.rsplit("[", 1)[0] if "[" in key else "")
        return 0 if not problem.key else 1 << 30
    return sorted(problems, key=line)


def _validate(raw: dict[str, Any], file: str, problems: list[Problem], lines: dict[str, int], kinds: Kinds) -> Config:
    for internal in (key for key, field in Config.model_fields.items() if field.exclude):
        if internal in raw:
            raw.pop(internal)
            problems.append(Problem(file, internal, f"unknown key {internal!r}"))
    model, data, foreign, errors, target = _as_kind(raw, file, kinds)
    problems += target
    members = tuple(kinds.values())
    member = int(model is not Config and len(members) > 1)  # the union's errors name its member first
    config: Config | None = None
    try:
        config = _union(members).validate_python(data) if member else model.model_validate(data)
    except ValidationError as exc:
        errors += [{**err, "loc": tuple(err["loc"])[member:]} for err in exc.errors()]
    failed: set[str] = set()
    found: list[tuple[str, str]] = []
    if len(errors) > MAX_PROBLEMS:  # each is a message with its closest key: a file of 100,000 keys took minutes
        problems.append(Problem(file, "", f"{len(errors) - MAX_PROBLEMS:,} more problems past the first "
                                          f"{MAX_PROBLEMS} (fix those first)"))
        errors = errors[:MAX_PROBLEMS]
    for err in errors:
        key = _dotted(err["loc"])
        if err["type"] == RULES:
            found += [(f"{key}.{below}" if key else below, message) for below, message in err["ctx"]["found"]]
        else:
            failed.add(key)
            problems.append(Problem(file, key, _message(err, kinds)))
    problems += [Problem(file, key, msg) for key, msg in _control_characters(raw) if key not in failed]
    if failed:
        found = _rules_of_failed(model, data, raw, foreign, frozenset(failed))
    problems += [Problem(file, key, message) for key, message in found]
    if problems or config is None:
        raise ConfigError(_in_file_order(problems, lines))
    return config


def read_config(path: Path | str, kinds: Kinds) -> Config:
    """Read a config file and validate it as the union of `kinds`' configs. ConfigError (exit 2) lists every
    problem at once."""
    path = Path(path)
    file = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        missing = Problem(file, "", "file not found (write a starter config with `moe-tpu init`)")
        raise ConfigError([missing]) from None
    except IsADirectoryError:
        raise ConfigError([Problem(file, "", "is a directory, not a config file")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([Problem(file, "", f"cannot read the file: {exc}")]) from None
    lines: dict[str, int] = {}
    raw, problems = _parse_yaml(text, file, lines)
    if raw is None and problems:
        raise ConfigError(problems)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(problems + [Problem(file, "", "the config must be a YAML mapping of keys "
                                                        "(project, region, zones, run, ...)")])
    return _validate(raw, file, problems, lines, kinds)
