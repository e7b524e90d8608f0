"""Reading a config file: the bounded YAML (trainer/safeyaml.py), the keys' lines, the pydantic
errors as messages naming the dotted key, the rules between keys, and the trainer's own checks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from provision import catalogue
from provision.config.sections import _SECTIONS, Config
from provision.errors import ConfigError, Problem
from provision.kinds import KINDS
from provision.shapes import _ZONE, DEFAULT_CONFIG, _brief
from trainer import safeyaml, schema

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


def _own_sections() -> dict[str, type[BaseModel]]:
    """The sections the kinds of target bring to the file (provision.kinds.Kind.own_sections)."""
    return {key: model for kind in KINDS.values() for key, model in kind.own_sections.items()
            if key not in Config.model_fields}


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    if not loc:
        return Config
    sections = {**_own_sections(), **_SECTIONS}
    if loc[-1] in sections and all(isinstance(part, str) for part in loc):
        return sections[loc[-1]]
    return None


def _message(err: Any) -> str:
    """A pydantic error in the project's words (trainer.schema.explain: the trainer's config says the same)."""
    return schema.explain(err, _model_at, show=_brief)


def _get(raw: dict[str, Any], failed: set[str], key: str) -> Any:
    """The raw value of a dotted key (or its schema default); _BAD where that key failed."""
    parts = key.split(".")
    if any(".".join(parts[:i]) in failed for i in range(1, len(parts) + 1)):
        return _BAD
    node: Any = raw
    model: type[BaseModel] = Config
    for part in parts:
        if model is Config and part not in Config.model_fields:  # a kind's own section
            model = _own_sections()[part]
            node = node.get(part) if isinstance(node, dict) and isinstance(node.get(part), dict) else {}
            continue
        field = model.model_fields[part]
        if isinstance(node, dict) and node.get(part) is not None:
            node = node[part]
        else:
            node = None if field.is_required() else field.get_default(call_default_factory=True)
            if isinstance(node, BaseModel):
                node = node.model_dump()
        model = _SECTIONS.get(part, model)
    return node


_BAD = object()


def _cross_checks(get: Callable[[str], Any]) -> list[tuple[str, str]]:
    """Rules between keys, as (dotted key, message)."""
    found = _zone_checks(get)
    region, zones = get("region"), get("zones")
    acc_name, runtime = get("slice.accelerator"), get("slice.runtime_version")
    if isinstance(acc_name, str) and isinstance(runtime, str) and acc_name in catalogue.ACCELERATORS:
        fits = catalogue.accelerator(acc_name).runtime_versions
        if runtime not in fits:
            found.append(("slice.runtime_version", f"runtime version {runtime!r} does not fit {acc_name}; "
                                                   f"use {', '.join(fits)}"))
    capacity, reservation = get("slice.capacity"), get("slice.reservation")
    if capacity == "reserved" and reservation is None:
        found.append(("slice.reservation",
                      "capacity 'reserved' needs slice.reservation (the reservation's name)"))
    if capacity in ("spot", "on-demand") and isinstance(reservation, str):
        found.append(("slice.reservation", f"a reservation is only used with capacity 'reserved' "
                                           f"(capacity is {capacity!r})"))
    if isinstance(reservation, str) and reservation.count("/") == 5 and isinstance(zones, list):
        res_zone = reservation.split("/")[3]
        others = [z for z in zones if isinstance(z, str) and z != res_zone]
        if others:  # a TPU consumes a reservation in its own zone only
            found.append(("slice.reservation", f"reservation {reservation!r} is in {res_zone}; it cannot serve "
                                               f"zone(s) {', '.join(others)} (list only {res_zone} in `zones:`, "
                                               "or give the reservation's short name)"))
    machine, topology = get("vertex.machine_type"), get("vertex.topology")
    allowed = catalogue.VERTEX_MACHINE_TOPOLOGIES.get(machine) if isinstance(machine, str) else None
    if allowed and isinstance(topology, str) and topology not in allowed:
        found.append(("vertex.topology", f"topology {topology!r} does not fit machine type {machine!r}; "
                                         f"it takes {', '.join(allowed)}"))
    tensorboard = get("vertex.tensorboard")
    if isinstance(tensorboard, str) and get("vertex.service_account") is None:
        found.append(("vertex.tensorboard", "a Vertex AI TensorBoard needs vertex.service_account (the job "
                                            "writes to TensorBoard as that account)"))
    if isinstance(tensorboard, str) and isinstance(region, str) and f"/locations/{region}/" not in tensorboard:
        found.append(("vertex.tensorboard", f"TensorBoard {tensorboard!r} is not in the job's region {region!r}"))
    found += _kind_checks(get)
    return found


def _kind_checks(get: Callable[[str], Any]) -> list[tuple[str, str]]:
    """The rules of the config's kind of target (provision.kinds.Kind.checks); none when the
    target itself is not a kind."""
    target = get("target")
    kind = KINDS.get(target) if isinstance(target, str) else None
    return kind.checks(get) if kind is not None else []


def _zone_checks(get: Callable[[str], Any]) -> list[tuple[str, str]]:
    """Each zone against the region it must lie in: `region`, unless the config's kind of target says
    otherwise (Kind.zone_region: a TPU VM slice's zones lie anywhere unless its subnetwork ties them)."""
    zones, target = get("zones"), get("target")
    if not isinstance(zones, list):
        return []
    kind = KINDS.get(target) if isinstance(target, str) else None
    rule = kind.zone_region(get) if kind is not None else (get("region"), "")
    if rule is None:
        return []
    region, where = rule
    if not isinstance(region, str):
        return []
    return [(f"zones[{i}]", f"zone {zone!r} is not in region {region!r}{where}")
            for i, zone in enumerate(zones)
            if isinstance(zone, str) and _ZONE.match(zone) and catalogue.zone_region(zone) != region]


def trainer_problems(cfg: Config) -> list[Problem]:
    """The trainer section checked by the trainer's own config code (which imports no jax)."""
    try:
        from trainer import config as trainer_config
    except ImportError:  # an install without the trainer package: the container will check it
        return []
    overrides = [flag for flag in cfg.trainer.set_flags() if flag != "--set"]
    try:
        trainer_config.check(cfg.trainer.config, overrides, cfg.trainer.steps)
    except trainer_config.ConfigError as exc:
        message = str(exc)
        key = next((f"trainer.overrides.{k}" for k in cfg.trainer.overrides if k in message), None)
        if key is None:
            key = "trainer.steps" if "steps" in message and cfg.trainer.steps is not None else "trainer.config"
        return [Problem(str(cfg.source), key, f"the trainer rejects it: {message}")]
    try:
        from provision.planner import mesh_problems
    except ImportError:  # the planner needs the trainer's packages too
        return []
    return [Problem(str(cfg.source), key, message) for key, message in mesh_problems(cfg)]


def config_from_dict(raw: Any, source: Path | str = DEFAULT_CONFIG) -> Config:
    """Validate already-parsed YAML; ConfigError lists every problem."""
    file = str(source)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError([Problem(file, "", "the config must be a YAML mapping of keys "
                                             "(project, region, zones, run, ...)")])
    return _validate(dict(raw), file, [], {})


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
                    found.append((dotted, f"key {_brief(key)} holds control characters"))
                stack.append((value, dotted))
        elif isinstance(node, list):
            stack.extend((item, f"{where}[{i}]") for i, item in enumerate(node))
        elif isinstance(node, str) and not node.isprintable():
            found.append((where, f"{_brief(node)} holds a control character (NUL, a newline, an escape...); "
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


def _validate(raw: dict[str, Any], file: str, problems: list[Problem], lines: dict[str, int]) -> Config:
    for internal in ("source", "kind_sections", "planned_mesh", "planned_serve_mesh", "serve_mesh_decider"):
        if internal in raw:
            raw.pop(internal)
            problems.append(Problem(file, internal, f"unknown key {internal!r}"))
    config: Config | None = None
    failed: set[str] = set()
    own, errors = _own_sections_of(raw)
    fields = {key: value for key, value in raw.items() if key not in _own_sections()}
    try:
        config = Config.model_validate({**fields, "kind_sections": own, "source": Path(file)})
    except ValidationError as exc:
        errors += exc.errors()
    for err in errors:
        key = _dotted(err["loc"])
        failed.add(key)
        problems.append(Problem(file, key, _message(err)))
    problems += [Problem(file, key, msg) for key, msg in _control_characters(raw) if key not in failed]
    problems += [Problem(file, key, msg) for key, msg in _cross_checks(lambda k: _get(raw, failed, k))]
    if problems or config is None:
        raise ConfigError(_in_file_order(problems, lines))
    return config


def _own_sections_of(raw: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """The kinds' own sections in `raw`, each validated by its model, and the errors (their locations
    under the section's key)."""
    sections, errors = {}, []
    for key, model in _own_sections().items():
        if key not in raw:
            continue
        try:
            sections[key] = model.model_validate({} if raw[key] is None else raw[key])
        except ValidationError as exc:
            errors += [{**err, "loc": (key, *err["loc"])} for err in exc.errors()]
    return sections, errors


def mesh_problem(cfg: Config, why: str) -> Problem:
    """trainer.mesh is unset and the plan cannot choose a mesh: say what to set."""
    target = cfg.kind.hardware(cfg)
    chips = target[0].chips * target[1]
    return Problem(str(cfg.source), "trainer.mesh",
                   f"not set, and {why}: set `trainer.mesh: data=D,expert=E` (D x E = the target's {chips} chips; "
                   "`moe-tpu plan --mesh ...` checks a choice), or a trainer config and target that fit")


def with_planned_mesh(cfg: Config) -> Config:
    """The config with the mesh its trainer is started with decided, once, here: trainer.mesh, or where it
    is unset the plan's choice for the config's own target (Config.planned_mesh, which every renderer
    reads through Config.trainer_mesh). ConfigError naming trainer.mesh where the plan cannot choose."""
    if cfg.trainer.mesh is not None or cfg.planned_mesh is not None:
        return cfg
    try:
        from provision.planner import mesh_choice
    except ImportError as exc:  # the planner needs the trainer's packages
        raise ConfigError([mesh_problem(cfg, f"the plan needs the trainer's packages ({exc.name} is missing)")]) \
            from None
    mesh, why = mesh_choice(cfg)
    if mesh is None:
        raise ConfigError([mesh_problem(cfg, why)])
    return cfg.model_copy(update={"planned_mesh": mesh})


def with_serving_mesh(cfg: Config) -> Config:
    """The config with the serving replica's mesh decided, once, here, as `plan --serve` states it:
    serve.mesh filled out on the replica's chips, or where it is unset the plan's choice for the replica
    (Config.planned_serve_mesh, which every serving container's argv reads through Config.serve_mesh).
    ConfigError naming serve.mesh where it does not fit the replica or the plan cannot choose."""
    if cfg.serve is None or cfg.planned_serve_mesh is not None:
        return cfg
    from provision.errors import MoeTpuError

    try:
        from provision.planner import plan_for, serve_plan_for

        served = serve_plan_for(cfg, plan_for(cfg))
    except ImportError as exc:  # the planner needs the trainer's packages
        why = f"the plan needs the trainer's packages to choose one ({exc.name or 'jax'} is missing)"
        raise ConfigError([_serve_mesh_problem(cfg, why)]) from None
    except MoeTpuError as exc:
        raise ConfigError([_serve_mesh_problem(cfg, exc.message.removeprefix("cannot plan serving: "))]) from None
    return cfg.model_copy(update={"planned_serve_mesh": served.mesh.text()})


def _serve_mesh_problem(cfg: Config, why: str) -> Problem:
    if cfg.serve.mesh is not None:
        return Problem(str(cfg.source), "serve.mesh", f"{why} (`moe-tpu plan --serve` checks a mesh)")
    return Problem(str(cfg.source), "serve.mesh",
                   f"not set, and {why}: set `serve.mesh: data=D,expert=E,model=T` on the replica's chips "
                   "(`moe-tpu plan --serve --mesh ...` checks a choice)")


def load_config(path: Path | str, check_trainer: bool = False, plan_mesh: bool = False,
                serve_mesh: bool = False) -> Config:
    """Read and validate a config file. ConfigError (exit 2) lists every problem at once.

    `check_trainer` also runs the trainer's own checks on the trainer section and decides the mesh the
    trainer is started with (`with_planned_mesh`): commands that start training ask for it; `down` and
    `list` must work whatever the trainer thinks. `plan_mesh` decides the mesh alone (`render`). Each
    also decides the serving replica's mesh where the config has a serve section (`with_serving_mesh`),
    and `serve_mesh` that alone (`deploy`)."""
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
    cfg = _validate(raw, file, problems, lines).model_copy(update={"serve_mesh_decider": with_serving_mesh})
    if check_trainer and (trainer := trainer_problems(cfg)):
        if cfg.trainer.mesh is None and any(p.key.startswith("trainer.") and p.key != "trainer.mesh"
                                            for p in trainer):
            trainer.append(mesh_problem(cfg, "the plan cannot choose one while the trainer config is refused"))
        raise ConfigError(trainer)
    if check_trainer or plan_mesh:
        cfg = with_planned_mesh(cfg)
    return with_serving_mesh(cfg) if check_trainer or plan_mesh or serve_mesh else cfg


