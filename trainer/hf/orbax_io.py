"""The trainer's side of a conversion: parameters written as the orbax checkpoint `train` writes, and a run's
checkpoint read back a layer at a time (orbax's partial restore), as host numpy arrays."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable

import numpy as np

from trainer import stacks
from trainer.config import Config
from trainer.hf.errors import HFError, WriteError
from trainer.outputs import NoRun, RunDirectory

# Parameters named so are the MoE selection biases: state beside the parameters ("moe_bias"), as train keeps them.
BIAS_SUFFIX = ".expert_bias"


def save_params(directory: str, params: Iterable[tuple[str, np.ndarray]], cfg: Config, source: str) -> None:
    """Step 0 of a checkpoints directory holding `params` (no optimizer state: a fine-tune makes its own)."""
    import jax
    import orbax.checkpoint as ocp

    from trainer.checkpoint import _reason, quiet_orbax
    from trainer.resume import model_identity

    # Each parameter moved into a jax array once it is whole (its numpy copy freed): orbax writes jax arrays
    # from their own buffers, where numpy arrays cost it a copy each (peak 3.9 GB against 5.7 GB for a
    # 1.7 GB checkpoint, measured with benchmarks/hf_convert.py's model at 4 layers); and at most 1 GB of
    # them in flight while writing (6.8 GB -> 5.5 GB peak for the benchmark's 3.2 GB checkpoint). Orbax
    # writes the state whole, so the model is held once: streaming the write too would need a writer of
    # the checkpoint's format of our own. A layer's parameter goes straight into its slice of the stacked one
    # (trainer/stacks.py), which becomes a jax array when its last layer is in.
    values = {name: jax.device_put(value) for name, value in stacked(cfg, params)}
    state = {"step": np.zeros((), np.int32),
             "params": {n: v for n, v in values.items() if not n.endswith(BIAS_SUFFIX)}}
    biases = {n: v for n, v in values.items() if n.endswith(BIAS_SUFFIX)}  # DeepSeek-V3's selection bias
    if biases:
        state["moe_bias"] = biases
    meta = {"model": model_identity(cfg), "imported_from": source}
    with quiet_orbax():
        manager = ocp.CheckpointManager(os.path.abspath(directory), options=ocp.CheckpointManagerOptions(
            create=True, enable_async_checkpointing=False), item_handlers={
            "state": ocp.StandardCheckpointHandler(save_concurrent_gb=1), "data": ocp.JsonCheckpointHandler()})
        try:
            manager.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    data=ocp.args.JsonSave(meta)))
            manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - a full disk, a file-system error: exit 1 naming the directory
            raise WriteError(f"cannot write the checkpoint to {directory}: {_reason(e)}") from None
        finally:
            manager.close()


def stacked(cfg: Config, params: Iterable[tuple[str, np.ndarray]]) -> Iterable[tuple[str, np.ndarray]]:
    """(name, array) of the stacked layout from (name, array) of layers' own names (`blocks.{i}.…`), each layer's
    array copied into its slice of the stacked one as it comes (and freed); a stacked array is yielded once
    all its layers are in. Names outside the layers pass as they are."""
    filling: dict[str, tuple[np.ndarray, set[int]]] = {}
    for name, value in params:
        target, index = stacks.locate(cfg.model, name)
        if index is None:
            yield name, value
            continue
        layers = len(stacks.layer_names(cfg.model, target))
        buffer, done = filling.setdefault(target, (np.empty((layers, *value.shape), value.dtype), set()))
        buffer[index] = value
        done.add(index)
        if len(done) == layers:
            del filling[target]
            yield target, buffer
    if filling:
        name = min(filling)
        missing = sorted(set(range(len(filling[name][0]))) - filling[name][1])
        raise HFError(f"the parameter {name} lacks layers {missing}")


@dataclasses.dataclass
class SavedRun:
    """A run's checkpoint opened for reading: its config, step, and `read(names)` of parameters by the layers'
    own names (`blocks.{i}.…`), whether it holds them stacked (trainer/stacks.py) or a layer at a time (written
    before the layers were stacked). A stacked array is read whole once and kept while layers of it remain
    to be read: orbax restores whole arrays."""

    run: str  # the run's output directory (config.json, checkpoints/, hf/)
    cfg: Config
    step: int
    manager: object
    shapes: dict[str, tuple[int, ...]]  # as saved
    _kept: dict = dataclasses.field(default_factory=dict)  # stacked name -> (array, its layers not yet read)

    def layer_shapes(self) -> dict[str, tuple[int, ...]]:
        """The saved parameters' shapes by the layers' own names."""
        out = {}
        for name, shape in self.shapes.items():
            out.update({n: shape[1:] for n in stacks.layer_names(self.cfg.model, name)} if stacks.is_stacked(name)
                       else {name: shape})
        return out

    def read(self, wanted: set[str]) -> dict[str, np.ndarray]:
        missing = sorted(wanted - set(self.shapes) - set(self.layer_shapes()))
        if missing:
            raise HFError(f"the checkpoint at step {self.step} in {self.run} has no parameter '{missing[0]}', which "
                          "its config.json needs")
        places = {n: stacks.locate(self.cfg.model, n) if n not in self.shapes else (n, None) for n in wanted}
        needed = {target for target, _ in places.values()} - set(self._kept)
        for target, value in self._read_saved(needed).items():
            self._kept[target] = (value, set(stacks.layer_names(self.cfg.model, target)) if stacks.is_stacked(
                target) else {target})
        out = {}
        for name, (target, index) in places.items():
            value, left = self._kept[target]
            out[name] = value if index is None else value[index]
            left.discard(name)
            if not left:
                del self._kept[target]
        return out

    def _read_saved(self, wanted: set[str]) -> dict[str, np.ndarray]:
        """Arrays by their saved names, read whole."""
        import orbax.checkpoint as ocp

        from trainer.checkpoint import _reason, quiet_orbax

        if not wanted:
            return {}
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

    try:
        found = RunDirectory.find(os.path.abspath(run), "--checkpoint")  # orbax takes absolute paths only
    except NoRun as e:
        raise HFError(str(e)) from None
    run, checkpoints = found.path, found.checkpoints
    cfg = load_trainer_config(found.config)
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


def imported_tokenizer(run: RunDirectory) -> str | None:
    """The tokenizer.json an import keeps in its side directory (HUB_DIR), or None: what `sample` and `serve`
    read an imported model's text with when no --tokenizer is given."""
    path = os.path.join(run.hub, "tokenizer.json") if run.hub else None
    return path if path and os.path.isfile(path) else None


def imported_eos(run: RunDirectory) -> int | None:
    """The end-of-sequence token id an imported model stops at (its generation_config.json's, else its
    config.json's `eos_token_id`; the first of a list), or None: not an import, or none named."""
    for name in ("generation_config.json", "config.json") if run.hub else ():
        try:
            with open(os.path.join(run.hub, name), encoding="utf-8") as f:
                value = json.load(f).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        value = value[0] if isinstance(value, list) and value else value
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None
