"""The Terraform foundation's outputs as a new config (`moe-tpu init --from-terraform`).

terraform/outputs.tf names each output after the config key it fills: `project`, `zones`,
`slice_service_account` for slice.service_account, `image_repository` for image.repository.
The starter config's template (templates/moe-tpu.yaml.j2) is rendered with those values, its
comments kept; `trainer_output_dir` is the runs' directory, and the run's own directory below it
becomes trainer.output_dir.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from provision.config import Config, config_from_dict, starter_config, top_sections
from provision.errors import UsageError

# Outputs that are a directory under which the run gets its own.
_RUN_DIRECTORIES = {"trainer.output_dir"}


def read_outputs(path: Path) -> dict[str, Any]:
    """name -> value, from a saved `terraform output -json` file or by running it in a directory."""
    if path.is_dir():
        text = _terraform_output(path)
        where = f"`terraform output -json` in {path}"
    else:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"cannot read {path}: {exc}") from None
        where = str(path)
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"{where} is not JSON ({exc})",
                         hint="save them with `terraform -chdir=terraform output -json > outputs.json`") from None
    if not isinstance(raw, dict) or not all(isinstance(v, dict) and "value" in v for v in raw.values()):
        raise UsageError(f"{where} is not what `terraform output -json` prints (a mapping of name to "
                         '{"value": ...})')
    if not raw:
        raise UsageError(f"{where} has no outputs", hint="run `terraform apply` in terraform/ first")
    return {name: item["value"] for name, item in raw.items()}


def _terraform_output(directory: Path) -> str:
    terraform = shutil.which("terraform")
    if terraform is None:
        raise UsageError("terraform is not installed here, and reading the outputs of a directory runs it",
                         hint=f"save them where terraform runs: `terraform -chdir={directory} output -json "
                              "> outputs.json`, and pass that file")
    result = subprocess.run([terraform, f"-chdir={directory}", "output", "-json"], capture_output=True,
                            text=True, check=False)
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        raise UsageError(f"`terraform output -json` in {directory} failed: {' '.join(lines[-3:])}",
                         hint="run `terraform init` and `terraform apply` there first")
    return result.stdout


def config_keys(outputs: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(dotted config key -> value for the outputs named after one, the names that are not)."""
    sections = top_sections()
    keys: dict[str, Any] = {}
    other: list[str] = []
    for name, value in outputs.items():
        section = next((s for s in sections if name.startswith(f"{s}_")), None)
        if section is not None and name[len(section) + 1:] in sections[section].model_fields:
            keys[f"{section}.{name[len(section) + 1:]}"] = value
        elif section is None and name in Config.model_fields and name not in sections \
                and not Config.model_fields[name].exclude:
            keys[name] = value
        else:
            other.append(name)
    return keys, other


def config_text(outputs: dict[str, Any], source: Path | str) -> str:
    """The starter config with the values of the outputs named after config keys, checked
    (ConfigError names every bad value)."""
    keys, _ = config_keys(outputs)
    run = keys.get("run") or yaml.safe_load(starter_config())["run"]
    for key in _RUN_DIRECTORIES & keys.keys():
        keys[key] = f"{str(keys[key]).rstrip('/')}/{run}"
    text = starter_config(keys)
    config_from_dict(yaml.safe_load(text), source)
    return text
