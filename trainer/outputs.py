"""The trainer's outputs as one contract: what it writes under its output directory, and the phases a run
goes through, named once for the trainer, the control plane (provision/) and the emulator.

Importable without jax (the control plane reads these files and never runs the trainer). A file the
trainer writes and something else reads is named here; its contents are documented where it is written
(trainer/status.py: the status object; trainer/metrics.py: one JSON row per logged step).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from enum import StrEnum

STATUS_FILE = "status.json"  # the run's state, rewritten whole at each change (trainer/status.py)
METRICS_FILE = "metrics.jsonl"  # one JSON object per logged step (trainer/metrics.py)
CONFIG_FILE = "config.json"  # the trainer config the run trains with (trainer/cli.py)
CHECKPOINTS_DIR = "checkpoints"  # Orbax checkpoints, one directory per saved step (trainer/checkpoint.py)
TRAINER_LOG = "trainer.log"  # the trainer's console output, where a host keeps it (a dry run, a VM)
# A Hugging Face model's own files (its config.json, tokenizer, chat template, generation config), which `hf
# import` keeps, a fine-tune carries, and `hf export`, `sample` and `serve` read (trainer/sidefiles.py)
HUB_DIR = "hf"


def join(base: str, name: str) -> str:
    """`name` in the directory `base`, local or a URL (gs://)."""
    return f"{base.rstrip('/')}/{name}" if "://" in base else os.path.join(base, name)


def fetched(remote: str, names: tuple[str, ...] | None = None) -> str | None:
    """The files of the remote directory `remote` (gs://; those of `names` alone, where given), copied into a
    new local directory, removed when the process ends; None where it holds none."""
    import atexit
    import shutil
    import tempfile

    from etils import epath  # the trainer's dependency: the control plane never fetches a run's files

    source = epath.Path(remote)
    try:
        files = ([source / name for name in names] if names is not None else
                 list(source.iterdir()) if source.is_dir() else [])
        files = [f for f in files if f.is_file()]
    except FileNotFoundError:
        files = []
    if not files:
        return None
    local = tempfile.mkdtemp(prefix="moe-tpu-hf-")
    atexit.register(shutil.rmtree, local, ignore_errors=True)
    for file in files:
        with open(os.path.join(local, file.name), "wb") as f:
            f.write(file.read_bytes())
    return local


class NoRun(ValueError):
    """A directory given for a run that names none (its text names the option and the directory); each
    command raises it as its own usage error (exit 2)."""


@dataclasses.dataclass(frozen=True)
class RunDirectory:
    """A run's output directory and where in it the trainer writes each output: every reader and writer
    asks it rather than joining the names itself. `checkpoints`: CHECKPOINTS_DIR in it, or the
    checkpoints directory a user named (`find`)."""

    path: str
    checkpoints: str

    @classmethod
    def at(cls, path: str) -> RunDirectory:
        """The run whose output directory is `path`."""
        return cls(path, join(path, CHECKPOINTS_DIR))

    @classmethod
    def find(cls, directory: str, option: str) -> RunDirectory:
        """The run a user named with `option` (`--checkpoint`, `--init-from`): its output directory (with
        CHECKPOINTS_DIR in it) or that checkpoints directory itself (step directories in it), local or
        gs://. NoRun, naming the option and the directory, when it is neither or cannot be read."""
        from etils import epath  # the trainer's dependency: the control plane never looks a run up

        path = epath.Path(directory)
        try:
            if not path.exists():
                raise NoRun(f"{option} {directory} does not exist")
            if (path / CHECKPOINTS_DIR).is_dir():
                return cls.at(directory)
            if path.is_dir() and any(child.name.isdigit() for child in path.iterdir()):
                return cls(str(path.parent), directory)
        except OSError as e:
            raise NoRun(f"{option} {directory} cannot be read: {e.strerror or e}") from None
        raise NoRun(f"{option} {directory} holds no checkpoint: give a run's output directory (with "
                    f"{CHECKPOINTS_DIR}/ in it) or its checkpoints directory")

    @property
    def config(self) -> str:
        """The trainer config the run trained with (CONFIG_FILE), which rebuilds its model."""
        return join(self.path, CONFIG_FILE)

    @functools.cached_property
    def hub(self) -> str | None:
        """A local directory of the model's own files (HUB_DIR: an import's, a fine-tune of one's), or None: a
        run with none. A run in gs:// (a copy of an import, a fine-tune written there) has them fetched once
        into a local directory (a tokenizer and its configs: kilobytes to megabytes), so every reader opens a
        path as it does for a local run."""
        if "://" in self.path:
            return fetched(join(self.path, HUB_DIR))
        side = os.path.join(self.path, HUB_DIR)
        return side if os.path.isdir(side) else None


class Phase(StrEnum):
    """A run's phase. The first five are the trainer's own states (its status file's "state"); the
    rest are what the control plane says of the place it runs (provision.kinds.Report.phase).

    A member is its string ("running" == Phase.RUNNING), so status files and JSON documents stay as
    they were."""

    STARTING = "starting"
    RUNNING = "running"
    FINISHED = "finished"
    STOPPED = "stopped"  # the trainer stopped on a signal, checkpoint saved (a preemption notice)
    FAILED = "failed"
    WAITING = "waiting"  # no trainer yet: the capacity is queued
    PREEMPTED = "preempted"  # the capacity went away; the run loop recovers
    RESTARTED = "restarted"  # the target recovered in place (a JobSet's failure policy)
    DELETED = "deleted"  # somebody deleted the run's resources; never recovered from
    READY = "ready"  # a service answers at its URL (a service's phases: starting, ready, failed, deleted)

    # Hashed as its string (Enum hashes the member's name), so that a set or a dict key finds a
    # phase by the text a status file holds.
    __hash__ = str.__hash__


# The trainer's states that end it (its status file's "state").
ENDED = (Phase.FINISHED, Phase.STOPPED, Phase.FAILED)
