"""`--init-from DIR` (train.init_from): a new run that starts from another run's weights, a fine-tune.

The parameters (and the MoE routing biases, part of the model) of DIR's latest checkpoint are read
straight onto this run's mesh; the optimizer's moments, the step and the data position are not: the
run starts at step 0 with a fresh optimizer and data stream. A checkpoint of another shape is refused
before anything is read, naming the parameter that differs. The source is recorded (status.json,
the log) with a fingerprint of the checkpoint, so that a fine-tune says which weights it began from.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Any

import jax
import jax.numpy as jnp

from trainer.checkpoint import (
    CheckpointError,
    holds_per_layer_layout,
    per_layer_layout,
    quiet_orbax,
    short_reason,
    stacked_layout,
)
from trainer.config import ConfigError
from trainer.outputs import NoRun, RunDirectory, join

# A step directory's metadata and manifests (which name its data files) are a few hundred kilobytes
# at most; its data files live in directories named `d` and are left out of the fingerprint (reading
# gigabytes of weights twice to name them is not worth it: the manifests change whenever they do).
DATA_DIR = "d"
MAX_HASHED_BYTES = 16 << 20


@dataclasses.dataclass(frozen=True)
class Source:
    """The checkpoint a run started from."""

    checkpoints: str  # its checkpoints directory
    step: int
    fingerprint: str  # "checkpoint:sha256:..." of the step directory's metadata and manifests
    data: str | None  # the fingerprint of the data it was trained on, as its checkpoint records it

    def as_dict(self) -> dict[str, Any]:
        path = self.checkpoints if self.fingerprint.startswith("hf:") else f"{self.checkpoints.rstrip('/')}/{self.step}"
        return {"path": path, "step": self.step,
                "fingerprint": self.fingerprint, "data": self.data}


def checkpoints_of(directory: str) -> str:
    """The checkpoints directory of a run's output directory (or DIR itself when it holds step
    directories). ConfigError naming DIR when it is neither."""
    try:
        return RunDirectory.find(directory, "--init-from").checkpoints
    except NoRun as e:
        raise ConfigError(str(e)) from None


def fingerprint(step_dir: str) -> str:
    """sha256 over the step directory's files outside its data directories, by relative path."""
    from etils import epath

    digest, total = hashlib.sha256(), 0
    for relative, path in _metadata_files(epath.Path(step_dir)):
        data = path.read_bytes()
        total += len(data)
        if total > MAX_HASHED_BYTES:
            raise ConfigError(f"--init-from {step_dir}: its metadata is over {MAX_HASHED_BYTES >> 20} MiB, "
                              "not a checkpoint this trainer wrote")
        digest.update(relative.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return f"checkpoint:sha256:{digest.hexdigest()[:32]}"


def _metadata_files(root, prefix: str = ""):
    """(relative path, path) of every file under `root` but those in data directories, sorted (a walk by
    hand: gs:// paths take no recursive glob)."""
    for child in sorted(root.iterdir(), key=lambda p: p.name):
        if child.is_dir():
            if child.name != DATA_DIR:
                yield from _metadata_files(child, f"{prefix}{child.name}/")
        else:
            yield f"{prefix}{child.name}", child


def _mismatch(saved, target: dict, where: str) -> str | None:
    """The first parameter whose saved shape differs from this config's (and how many more), or None."""
    problems = []
    for group, arrays in target.items():
        held = saved.get(group) if hasattr(saved, "get") else None
        held = held if hasattr(held, "get") else {}
        for name, want in arrays.items():
            meta = held.get(name)
            if meta is None:
                problems.append(f"it has no parameter {group}.{name} (this config needs {list(want.shape)})")
            elif tuple(meta.shape) != tuple(want.shape):
                problems.append(f"{group}.{name} is {list(meta.shape)} in it, this config needs {list(want.shape)}")
        problems += [f"it holds {group}.{name}, which this config does not have"
                     for name in sorted(set(held) - set(arrays))]
    if not problems:
        return None
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return (f"--init-from: the checkpoint {where} is of another model: {problems[0]}{more}. Start from a "
            "checkpoint of this config's model (or set the model back)")


def initial_state(trainer, directory: str) -> tuple[dict[str, Any], Source]:
    """(the state a fine-tune starts from, its Source): DIR's latest parameters and routing biases on
    this run's mesh, a fresh optimizer state for them, step 0. ConfigError (exit 2) naming what is
    wrong with DIR; CheckpointError (exit 1) when its files cannot be read. A Hugging Face checkpoint's
    directory is read by trainer.hf.init."""
    import orbax.checkpoint as ocp

    from trainer.hf import init as from_hub

    if "://" not in directory and from_hub.is_hub_directory(directory):
        state, (path, step, digest) = from_hub.initial_state(trainer, directory)
        return state, Source(path, step, digest, None)

    checkpoints = checkpoints_of(directory)
    if "://" not in checkpoints:  # orbax takes absolute paths only; a user types a relative one
        checkpoints = os.path.abspath(checkpoints)
    with quiet_orbax():
        try:
            manager = ocp.CheckpointManager(checkpoints, item_handlers={
                "state": ocp.PyTreeCheckpointHandler(), "data": ocp.JsonCheckpointHandler()},
                options=ocp.CheckpointManagerOptions(read_only=True))
        except Exception as e:  # noqa: BLE001 - a file-system error: one message naming the path
            raise CheckpointError(f"--init-from: cannot read {checkpoints}: {short_reason(e)}") from None
        try:
            return _restore(ocp, manager, trainer, checkpoints)
        finally:
            manager.close()


def _restore(ocp, manager, trainer, checkpoints: str) -> tuple[dict[str, Any], Source]:
    step = manager.latest_step()
    if step is None:
        raise ConfigError(f"--init-from {checkpoints} holds no finished checkpoint")
    where = join(checkpoints, str(step))
    groups = [g for g in ("params", "moe_bias") if g in trainer.abstract_state]
    try:
        saved = manager.item_metadata(step)["state"]
    except Exception as e:  # noqa: BLE001 - a damaged or foreign directory
        raise CheckpointError(f"--init-from: cannot read the checkpoint {where}: {short_reason(e)}") from None
    if "moe_bias" in groups and not hasattr(saved.get("moe_bias") if hasattr(saved, "get") else None, "get"):
        groups.remove("moe_bias")  # trained without routing biases: this run's start from zero
    wanted = {g: trainer.abstract_state[g] for g in groups}
    # A checkpoint written before the layers were stacked is read a layer at a time and stacked.
    target = per_layer_layout(trainer.cfg.model, wanted) if holds_per_layer_layout(saved) else wanted
    problem = _mismatch(saved, target, where)
    if problem:
        raise ConfigError(problem)
    state_args = ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                        partial_restore=True)
    try:
        restored = manager.restore(step, args=ocp.args.Composite(state=state_args, data=ocp.args.JsonRestore()))
        meta = dict(restored["data"] or {})
        source = Source(checkpoints, step, fingerprint(where), meta.get("source"))
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - tensorstore, JSON and file errors alike
        raise CheckpointError(f"--init-from: cannot read the checkpoint {where}: {short_reason(e)}") from None
    read = dict(restored["state"])
    if target is not wanted:
        read = stacked_layout(trainer.cfg.model, {g: dict(read[g]) for g in groups}, wanted)
    params = dict(read["params"])
    shardings = trainer.state_shardings
    state = {"step": jax.device_put(jnp.zeros((), jnp.int32), shardings["step"]), "params": params,
             "opt_state": jax.jit(trainer.optimizer.init, out_shardings=shardings["opt_state"])(params)}
    if "moe_bias" in trainer.abstract_state:
        state["moe_bias"] = (dict(read["moe_bias"]) if "moe_bias" in groups else
                             jax.jit(lambda: trainer.init_fn()["moe_bias"], out_shardings=shardings["moe_bias"])())
    return state, source
