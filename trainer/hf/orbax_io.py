"""The trainer's side of a conversion: parameters written as the orbax checkpoint `train` writes, and a run's
checkpoint read back a layer at a time (orbax's partial restore), as host numpy arrays."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable

import numpy as np

from trainer.config import Config
from trainer.hf.errors import HFError

HF_DIR = "hf"  # the source's own files inside an imported checkpoint (config.json, tokenizer, generation)
RUN_CONFIG = "config.json"
CHECKPOINTS = "checkpoints"
# Parameters named so are the MoE selection biases: state beside the parameters ("moe_bias"), as train keeps them.
BIAS_SUFFIX = ".expert_bias"


def save_params(directory: str, params: Iterable[tuple[str, np.ndarray]], cfg: Config, source: str) -> None:
    """Step 0 of a checkpoints directory holding `params` (no optimizer state: a fine-tune makes its own)."""
    import orbax.checkpoint as ocp

    from trainer.checkpoint import quiet_orbax
    from trainer.resume import model_identity

    values = dict(params)
    state = {"step": np.zeros((), np.int32), "params": {n: v for n, v in values.items() if not n.endswith(BIAS_SUFFIX)}}
    biases = {n: v for n, v in values.items() if n.endswith(BIAS_SUFFIX)}
    if biases:
        state["moe_bias"] = biases
    meta = {"model": model_identity(cfg), "imported_from": source}
    with quiet_orbax():
        manager = ocp.CheckpointManager(os.path.abspath(directory), options=ocp.CheckpointManagerOptions(
            create=True, enable_async_checkpointing=False), item_handlers={
            "state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler()})
        try:
            manager.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    data=ocp.args.JsonSave(meta)))
            manager.wait_until_finished()
        finally:
            manager.close()


@dataclasses.dataclass
class SavedRun:
    """A run's checkpoint opened for reading: its config, step, and `read(names)` of parameters."""

    run: str  # the run's output directory (config.json, checkpoints/, hf/)
    cfg: Config
    step: int
    manager: object
    shapes: dict[str, tuple[int, ...]]

    def read(self, wanted: set[str]) -> dict[str, np.ndarray]:
        import orbax.checkpoint as ocp

        from trainer.checkpoint import _reason, quiet_orbax

        missing = sorted(wanted - set(self.shapes))
        if missing:
            raise HFError(f"the checkpoint at step {self.step} in {self.run} has no parameter '{missing[0]}', which "
                          "its config.json needs")
        where = lambda n: "moe_bias" if n.endswith(BIAS_SUFFIX) else "params"  # noqa: E731
        item, restore = {}, {}
        for n in wanted:
            item.setdefault(where(n), {})[n] = np.zeros(self.shapes[n])
            restore.setdefault(where(n), {})[n] = ocp.RestoreArgs(restore_type=np.ndarray)
        with quiet_orbax():
            try:
                restored = self.manager.restore(self.step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                    item=item, restore_args=restore, partial_restore=True)))
            except Exception as e:  # noqa: BLE001 - tensorstore and file errors alike
                raise HFError(f"cannot read step {self.step} in {self.run}: {_reason(e)}") from None
        return {n: np.asarray(v) for part in restored["state"].values() for n, v in part.items()}


def open_run(run: str, step: int | None) -> SavedRun:
    """A run's output directory (or its checkpoints directory), at `step` or its latest."""
    import orbax.checkpoint as ocp

    from trainer.checkpoint import _reason, quiet_orbax
    from trainer.hf.families import load_trainer_config

    run = os.path.abspath(run)
    if os.path.isdir(os.path.join(run, CHECKPOINTS)):
        checkpoints = os.path.join(run, CHECKPOINTS)
    elif os.path.isdir(run) and any(name.isdigit() for name in os.listdir(run)):
        checkpoints, run = run, os.path.dirname(run)
    else:
        raise HFError(f"--checkpoint {run} holds no checkpoint: give a run's output directory (with checkpoints/ "
                      "in it) or an imported checkpoint")
    cfg = load_trainer_config(os.path.join(run, RUN_CONFIG))
    with quiet_orbax():
        manager = ocp.CheckpointManager(checkpoints, item_handlers={"state": ocp.PyTreeCheckpointHandler()},
                                        options=ocp.CheckpointManagerOptions(read_only=True))
        steps = list(manager.all_steps())
        if not steps:
            raise HFError(f"--checkpoint {checkpoints} holds no finished checkpoint")
        if step is not None and step not in steps:
            raise HFError(f"--step {step}: {checkpoints} holds steps {sorted(steps)}")
        step = max(steps) if step is None else step
        try:
            state = manager.item_metadata(step)["state"]
            saved = {**state["params"], **(state.get("moe_bias") or {})}
        except Exception as e:  # noqa: BLE001 - a damaged or foreign directory
            raise HFError(f"cannot read the checkpoint at step {step} in {checkpoints}: {_reason(e)}") from None
    return SavedRun(run, cfg, step, manager, {n: tuple(meta.shape) for n, meta in saved.items()})


def imported_tokenizer(config_path: str) -> str | None:
    """The tokenizer.json an import keeps beside the run's config.json (in hf/), or None: what `sample` and
    `serve` read an imported model's text with when no --tokenizer is given."""
    if "://" in config_path:
        return None
    path = os.path.join(os.path.dirname(config_path), HF_DIR, "tokenizer.json")
    return path if os.path.isfile(path) else None
