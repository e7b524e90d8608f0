"""Running `moe-tpu` from tests: in this process through the real entry point, or as a real process."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from provision.cli import main
from tests.lm_eval_tasks import MULTIPLE_CHOICE

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {"tpu-vm": ROOT / "examples" / "v5e-64.yaml", "vertex": ROOT / "examples" / "vertex.yaml",
            "gke": ROOT / "examples" / "gke.yaml"}
# The trainer of the tests' dry runs: smaller than the examples' dry_run section (fewer steps, two fake
# devices). One size for every run, so that the session's compilation cache compiles its train step once.
SMALL = {"steps": 12, "devices": 2, "mesh": "data=1,expert=2", "checkpoint_every": 4}

# Variables a developer's shell may set that would change what a test sees.
CLEAN_ENV = {"NO_COLOR": "1", "MOE_TPU_CONFIG": None, "MOE_TPU_OUTPUT": None, "MOE_TPU_TEMPLATES": None,
             "MOE_TPU_DRY_RUN": None, "MOE_TPU_SCENARIO": None, "MOE_TPU_EMULATOR_RESERVATIONS": None}


# What no command may ever print, whatever it was given: every run of `moe-tpu` from the suite is
# checked for them, so each bad input a test tries also counts toward "no tracebacks, no internal
# errors" without a test having to say so.
NEVER = ("Traceback (most recent call last)", "internal error:")


def check_no_crash(args, stdout: str, stderr: str) -> None:
    for text in NEVER:
        assert text not in stderr and text not in stdout, f"`moe-tpu {' '.join(map(str, args))}` printed " \
                                                          f"{text!r}:\n{stderr[-4000:]}"


def invoke(*args: str, env: dict[str, str | None] | None = None) -> tuple[int, str, str]:
    """`moe-tpu ARGS` in-process through the real entry point: (exit code, stdout, stderr)."""
    with CliRunner().isolation(env={**CLEAN_ENV, **(env or {})}) as (out, err, _):
        try:
            main(list(args))
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        result = code, out.getvalue().decode(), err.getvalue().decode()
    check_no_crash(args, result[1], result[2])
    return result


def run_process(args: list[str], cwd: Path, env: dict | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess:
    """`moe-tpu ARGS` as its own process in `cwd` (for signals, concurrency and a fresh interpreter)."""
    full_env = {k: v for k, v in {**os.environ, **CLEAN_ENV, **(env or {})}.items() if v is not None}
    result = subprocess.run([sys.executable, "-m", "provision", *args], cwd=cwd, capture_output=True, text=True,
                            timeout=timeout, env=full_env)
    check_no_crash(args, result.stdout, result.stderr)
    return result


def run_here(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """run_process's answer for `moe-tpu ARGS` in `cwd`, run in this process through the real entry point
    (invoke): for the commands a test neither signals nor kills, whose interpreter of their own would cost
    about a second of imports each."""
    with contextlib.chdir(cwd):
        code, out, err = invoke(*args)
    return subprocess.CompletedProcess(["moe-tpu", *args], code, out, err)


def changed(doc: dict, **changes) -> dict:
    """`doc` with dotted__keys changed in place (value None deletes the key); returns it."""
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        node = doc
        for part in parents:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return doc


def config_from(example: Path, tmp_path: Path, name: str = "moe-tpu.yaml", **changes) -> Path:
    """A copy of a config file with dotted__keys changed, written to tmp_path/NAME."""
    path = tmp_path / name
    path.write_text(yaml.safe_dump(changed(yaml.safe_load(example.read_text()), **changes)))
    return path


def loaded_config(example: Path, tmp_path: Path, name: str = "moe-tpu.yaml", **changes):
    """config_from, loaded (provision.config.load_config)."""
    from provision.config import load_config

    return load_config(config_from(example, tmp_path, name, **changes))


def write_config(tmp_path: Path, target: str, **changes) -> Path:
    """tmp_path/moe-tpu.yaml: the target's example with the SMALL dry-run trainer and dotted__keys changed."""
    return config_from(EXAMPLES[target], tmp_path, dry_run=dict(SMALL), **changes)


def run_json(tmp_path: Path, scenario: str = "happy") -> tuple[int, dict, str]:
    """`moe-tpu --dry-run --scenario SCENARIO --output json run` in tmp_path: (exit code, document, stderr).
    Run in this process (its trainer is a process of its own all the same): an interpreter of its own for
    the command costs about a second of imports each time. The tests that signal or kill a run start it as
    a process (test_run.py's start_run)."""
    with contextlib.chdir(tmp_path):
        code, out, err = invoke("--dry-run", "--scenario", scenario, "--output", "json", "run")
    try:
        doc = json.loads(out)
    except ValueError:
        pytest.fail(f"no JSON document (exit {code}): {out[-2000:]}\n{err[-4000:]}")
    return code, doc, err


def nothing_left(cwd: Path) -> bool:
    """Whether `moe-tpu --dry-run --output json list` in `cwd` succeeds and lists no resource (run in this
    process: the dry runs' tests ask it often, and an interpreter of its own costs seconds each time)."""
    with contextlib.chdir(cwd):
        code, out, _ = invoke("--dry-run", "--output", "json", "list")
    return code == 0 and json.loads(out)["resources"] == []


@contextlib.contextmanager
def unoptimised_xla():
    """The processes started meanwhile (a dry run's trainer, its servers) compile as the compile-bound tests do
    (tests/trainer/conftest.py): most of XLA's optimisations off. Where the programs run briefly, compiling
    them is what costs."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
        yield


@contextlib.contextmanager
def serving_from(work: Path):
    """While a module's deploys serve from `work`: their servers compile unoptimised (unoptimised_xla), and
    none is left running after, whatever failed halfway."""
    from provision.emulator.local_server import LocalServers

    with unoptimised_xla():
        try:
            yield
        finally:
            servers = LocalServers(work / ".moe-tpu")
            for key in servers.keys():
                servers.stop(key)


def trained_copy(trained: Path, to: Path) -> Path:
    """`to`: a copy of trained_demo's directory (conftest.py), as that run left it but for the config it
    remembered (the shared directory's: the next command here names its own)."""
    shutil.copytree(trained, to, dirs_exist_ok=True)
    (to / ".moe-tpu" / "last-config").unlink(missing_ok=True)
    return to


def write_ids_task(work: Path, rows: list[dict]) -> Path:
    """lm-eval's local multiple-choice task `tiny_ids_mc` over `rows` ({"question", "choices", "answer"}) in
    work/tasks, in a dry run's text (token ids separated by spaces: the trained demo has no tokenizer), for
    `eval --endpoint`'s tests on every kind that serves; returns that directory."""
    tasks = work / "tasks"
    tasks.mkdir(exist_ok=True)
    (tasks / "ids.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tasks / "ids.yaml").write_text(MULTIPLE_CHOICE.format(name="tiny_ids_mc", data=tasks / "ids.jsonl"))
    return tasks
