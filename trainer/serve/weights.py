"""The model for inference: built on a mesh without an optimizer, its parameters restored alone.

A checkpoint holds {"step", "params", "opt_state", "moe_bias"?}; serving reads "params" and "moe_bias"
(the routing bias is part of the model) and never the optimizer's moments, which are twice the weights.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from trainer import sharding
from trainer.config import Config
from trainer.model import ParamCodec, Transformer, abstract_split, step_rngs
from trainer.moe.layer import ExpertBias


class WeightsError(ValueError):
    """A checkpoint that cannot serve this config; the message names the directory and the reason."""


def serving_config(cfg: Config) -> Config:
    """The config the engine builds: MoE dropless in evaluation (a token dropped at capacity is a wrong
    answer at decode), routing groups left to the mesh (they only count capacity)."""
    if cfg.moe.routing != "token_choice":
        raise WeightsError(f"moe.routing={cfg.moe.routing}: serving needs token_choice routing "
                           "(expert choice picks tokens across the batch, which decoding does not have)")
    moe = cfg.moe.model_copy(update={"eval_capacity_factor": 0.0, "routing_groups": 0})
    return cfg.model_copy(update={"moe": moe})


@dataclasses.dataclass
class ServingModel:
    """The model's structure (graphdef, codecs, RNG state) and its flat parameters and biases, placed
    on `mesh` as training places them (experts over `expert`)."""

    cfg: Config
    mesh: Mesh
    graphdef: nnx.GraphDef
    codec: ParamCodec
    bias_codec: ParamCodec
    rest: nnx.State
    shardings: dict[str, Any]
    weights: dict[str, Any] | None = None  # {"params": {name: array}, "moe_bias": {name: array}}
    # The engines' jitted step programs (trainer.serve.runner.ModelRunner.program), one for all the engines of this
    # model with the same shapes: a later engine runs what an earlier one traced and compiled. A copy
    # (dataclasses.replace) starts with none.
    programs: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)
    executables: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)  # compiled

    def module(self, weights: dict[str, Any]) -> Transformer:
        """The model with `weights`, for use inside jit."""
        biases = (self.bias_codec.unflatten(weights["moe_bias"]),) if self.bias_codec.names else ()
        # int8, int4 and MXFP4 weights (trainer/serve/quant.py, quant4.py, mxfp4.py) stand as they are: each layer
        # widens its own slice where it reads it, never a float copy of the whole stack
        return nnx.merge(self.graphdef, self.codec.unflatten(weights["params"]), *biases,
                         step_rngs(self.rest, jnp.zeros((), jnp.int32)))

    def abstract(self) -> dict[str, Any]:
        """ShapeDtypeStructs (with their shardings) of the weights, what a restore reads."""
        def spec(var, shard):
            value = var.get_value()
            return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=shard)

        tree = {"params": {n: spec(self.codec.variables[n], self.shardings["params"][n]) for n in self.codec.names}}
        if self.bias_codec.names:
            tree["moe_bias"] = {n: spec(self.bias_codec.variables[n], self.shardings["moe_bias"][n])
                                for n in self.bias_codec.names}
        return tree


def build_serving_model(cfg: Config, mesh: Mesh) -> ServingModel:
    cfg = serving_config(cfg)

    def make_model():  # on the mesh: the draws loop over the axes it leaves whole (trainer/initializers.py)
        with nnx.use_eager_sharding(False), sharding.logical_mesh(mesh):
            return Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(cfg.train.seed))

    graphdef, params, biases, rest = abstract_split(make_model)
    codec, bias_codec = ParamCodec(params), ParamCodec(biases)
    specs = sharding.param_specs(codec.variables, mesh, cfg.train.fsdp)
    shardings = {"params": {n: NamedSharding(mesh, specs[n]) for n in codec.names},
                 "moe_bias": {n: sharding.replicated(mesh) for n in bias_codec.names}}
    return ServingModel(cfg, mesh, graphdef, codec, bias_codec, rest, shardings)


def init_weights(model: ServingModel) -> dict[str, Any]:
    """Fresh weights (tests and benchmarks without a checkpoint), laid out on the mesh."""
    return init_program(model)()


def init_program(model: ServingModel) -> Callable[[], dict[str, Any]]:
    """The jitted program that makes `init_weights`' weights (its compile: benchmarks/init_compile.py)."""
    cfg = model.cfg

    def init():
        with nnx.use_eager_sharding(False), sharding.logical_mesh(model.mesh):
            m = Transformer(cfg, mesh=model.mesh, rngs=nnx.Rngs(cfg.train.seed))
        _, params, biases, _ = nnx.split(m, nnx.Param, ExpertBias, ...)
        out = {"params": model.codec.flatten(params)}
        if model.bias_codec.names:
            out["moe_bias"] = model.bias_codec.flatten(biases)
        return out

    out_shardings = {k: v for k, v in model.shardings.items() if k == "params" or model.bias_codec.names}
    return jax.jit(init, out_shardings=out_shardings)


def restore_weights(model: ServingModel, checkpoints: str, quantized: str | None = None,
                    on_array: Callable[[str], None] | None = None,
                    on_checked: Callable[[int], None] | None = None) -> tuple[dict[str, Any], int]:
    """(the latest checkpoint's parameters and biases, its step), read straight onto the mesh; the
    optimizer state in the checkpoint is not read. `quantized` ("int8", "int4", "mxfp4" or None: as saved) reads the
    parameters one array at a time, each quantized as it arrives, so the device never holds more than the
    quantized model and one float array (memory_plan's "loading"); `on_array(name)` is called as each float
    array arrives, before it is quantized. `on_checked(step)` is called once the checkpoint's arrays are known to
    be the config's, before any is read, where they are read as the model holds them, model.abstract() (not
    quantized, not a checkpoint of the per-layer layout, which is converted after reading): what the caller
    does meanwhile (trainer/serve/startup.py compiles the first programs) never waits on a checkpoint that a
    quick look refuses.
    Raises WeightsError naming what is wrong."""
    import orbax.checkpoint as ocp

    from trainer.checkpoint import quiet_orbax, short_reason

    with quiet_orbax():
        return _restore(ocp, short_reason, model, checkpoints, quantized, on_array, on_checked)


def _restore(ocp, short_reason, model: ServingModel, checkpoints: str, quantized,
             on_array, on_checked=None) -> tuple[dict[str, Any], int]:
    if "://" not in checkpoints:  # orbax takes absolute paths only; a user types a relative one
        checkpoints = os.path.abspath(checkpoints)
    try:
        manager = ocp.CheckpointManager(checkpoints, item_handlers={"state": ocp.PyTreeCheckpointHandler()},
                                        options=ocp.CheckpointManagerOptions(read_only=True))
    except Exception as e:  # noqa: BLE001 - a file-system error: one message naming the path
        raise WeightsError(f"--checkpoint: cannot read {checkpoints}: {short_reason(e)}") from None
    try:
        step = manager.latest_step()
        if step is None:
            raise WeightsError(f"--checkpoint: {checkpoints} holds no checkpoint")
        wanted = model.abstract()
        saved = _saved_arrays(manager, step, checkpoints)  # read once (tiny, on a CPU: 0.07 s a time)
        target = _layout_of(saved, model, wanted)
        _check_shapes(saved, step, target, checkpoints)

        def read(tree: dict) -> dict:
            args = ocp.args.PyTreeRestore(item=tree, restore_args=ocp.checkpoint_utils.construct_restore_args(tree),
                                          partial_restore=True)
            try:
                restored = manager.restore(step, args=ocp.args.Composite(state=args))["state"]
            except Exception as e:  # noqa: BLE001 - tensorstore and file errors alike
                raise WeightsError(f"--checkpoint: cannot read step {step} in {checkpoints}: "
                                   f"{short_reason(e)}") from None
            return {k: dict(restored[k]) for k in tree}

        if target is wanted and quantized:
            return _read_quantized(read, wanted, quantized, on_array), step
        if target is wanted and on_checked is not None:
            on_checked(step)
        restored = read(target)
        if target is not wanted:  # a checkpoint of the per-layer layout: read whole, stacked, then quantized
            from trainer.checkpoint import stacked_layout

            restored = stacked_layout(model.cfg.model, restored, wanted)
        if quantized:
            restored["params"] = {n: quantizer(quantized)(n, p) for n, p in restored["params"].items()}
        return restored, step
    finally:
        manager.close()


def quantizer(quantized: str) -> Callable[[str, jax.Array], Any]:
    """quantize_array of `quantized`'s module ("int8": trainer/serve/quant.py, "int4": quant4.py, its storage
    the backend's: quant4.storage_for; "mxfp4": mxfp4.py, the routed experts only)."""
    from trainer.serve import mxfp4, quant, quant4

    return {"int8": quant.quantize_array, "int4": quant4.quantize_array, "mxfp4": mxfp4.quantize_array}[quantized]


def _read_quantized(read, wanted: dict, quantized: str, on_array) -> dict[str, Any]:
    """The weights read a parameter at a time, each quantized on its devices before the next is read."""
    out = {k: read({k: v})[k] for k, v in wanted.items() if k != "params"}
    out["params"] = {}
    for name, spec in wanted["params"].items():
        value = read({"params": {name: spec}})["params"][name]
        if on_array is not None:  # the most the load holds: the quantized arrays so far and this float one
            on_array(name)
        value = quantizer(quantized)(name, value)
        out["params"][name] = jax.block_until_ready(value)  # the float array is freed before the next is read
        del value
    return out


def _saved_arrays(manager, step: int, checkpoints: str):
    """The metadata of the arrays saved at `step` (orbax's tree of them); WeightsError where it cannot be read."""
    from trainer.checkpoint import short_reason

    try:
        return manager.item_metadata(step)["state"]
    except Exception as e:  # noqa: BLE001 - orbax's JSON, tensorstore and file errors alike
        raise WeightsError(f"--checkpoint: the metadata of step {step} in {checkpoints} cannot be read (a truncated "
                           f"or corrupt checkpoint?): {short_reason(e)}; serve an intact one, or move step {step}'s "
                           "directory aside to serve the step before it") from None


def _layout_of(saved, model: ServingModel, wanted: dict) -> dict:
    """What to read: `wanted`, or its per-layer layout for a checkpoint written before the layers were stacked
    (converted after reading)."""
    from trainer.checkpoint import holds_per_layer_layout, per_layer_layout

    return per_layer_layout(model.cfg.model, wanted) if holds_per_layer_layout(saved) else wanted


def _check_shapes(saved, step: int, target: dict, checkpoints: str) -> None:
    """Compares the saved arrays' shapes with the config's before reading: another model's checkpoint
    fails here with the array's name rather than deep in tensorstore."""
    for group, arrays in target.items():
        held = saved.get(group) if hasattr(saved, "get") else None
        if held is None:
            raise WeightsError(f"--checkpoint: step {step} in {checkpoints} has no '{group}' (is it a moe-tpu "
                               "training checkpoint of this config?)")
        for name, want in arrays.items():
            meta = held.get(name)
            if meta is None or tuple(meta.shape) != tuple(want.shape):
                got = "nothing" if meta is None else f"shape {list(meta.shape)}"
                raise WeightsError(f"--checkpoint: step {step} in {checkpoints} holds {got} for {group}.{name}; "
                                   f"the run's config needs {list(want.shape)}")


def decode_weight_bytes(model: ServingModel, weights: dict[str, Any], tokens: int = 1) -> int:
    """Bytes of weights the busiest device reads in a decode step of `tokens` tokens, from the arrays'
    shardings: its shard of every weight but the routed experts', and of those the shards of the experts
    the step touches. A batch of B tokens touches E(1-(1-k/E)^B) of a layer's E experts (SPEC's rule; k at
    B=1); the busiest device holds as many of them as it holds experts, at most."""
    moe = model.cfg.moe
    touched = math.ceil(moe.num_experts * (1 - (1 - moe.top_k / moe.num_experts) ** tokens) - 1e-9)
    per_device: dict[Any, float] = collections.defaultdict(float)
    for name, value in weights["params"].items():
        names = sharding.variable_names(model.codec.variables[name]) or ()
        for leaf in jax.tree.leaves(value):  # an int8 weight's values and scales
            for shard in leaf.addressable_shards:
                # experts on this device (a stacked weight's: of each of its layers)
                held = shard.data.shape[names.index("expert")] if "expert" in names else 1
                per_device[shard.device] += stored_bytes(shard.data) * min(touched, held) / held
    return round(max(per_device.values()))


def stored_bytes(x: jax.Array) -> int:
    """An array's bytes as a device stores it: jnp.int4's and FP4's two values a byte (jax reports a byte a
    value)."""
    bits = 4 if x.dtype in (jnp.int4, jnp.uint4, jnp.float4_e2m1fn) else 8 * x.dtype.itemsize
    return x.size * bits // 8
