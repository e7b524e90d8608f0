"""`--init-from DIR` where DIR is a Hugging Face checkpoint (config.json and safetensors): a fine-tune
straight from the Hub's files, nothing converted first.

The run's config must describe DIR's model: its shapes, and what changes the model without changing a
shape (RoPE theta, the norms' epsilon, top-k renormalisation, the layer pattern); the first key that
differs is named. `moe-tpu hf import DIR -o OUT` writes that config (OUT/config.json). The parameters are
read a tensor at a time and put straight onto the run's mesh, each in its own sharding.
"""

from __future__ import annotations

import functools
import hashlib
import os
from typing import Any

from trainer.config import Config, ConfigError
from trainer.hf import names
from trainer.hf.errors import HFError
from trainer.hf.safetensors_io import CONFIG, INDEX, SINGLE, is_hub_directory

__all__ = ["is_hub_directory", "initial_state"]

# What must agree between the run's config and the checkpoint's beyond the parameters' shapes.
_MEANING = (("model", ("rope_theta", "norm_eps", "moe_every", "dense_layers", "tie_embeddings", "tied_head_scale",
                       "qk_norm", "qkv_bias", "mla")),
            ("moe", ("num_experts", "top_k", "renormalize", "softmax_before_topk", "score", "num_shared_experts",
                     "shared_gate", "route_scale", "expert_groups", "routing_groups_limit", "group_score")))


def _differences(run: Config, theirs: Config, source: str) -> str | None:
    for section, keys in _MEANING:
        for key in keys:
            ours, wanted = getattr(getattr(run, section), key), getattr(getattr(theirs, section), key)
            if ours != wanted:
                return (f"{section}.{key} is {ours!r} in this run's config, {wanted!r} in {source}'s model")
    return None


def fingerprint(directory: str) -> str:
    """sha256 of config.json and the index (or the single file's header size and length): the metadata that
    names the weights, not gigabytes of them."""
    digest = hashlib.sha256()
    for name in (CONFIG, INDEX, SINGLE):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            data = open(path, "rb").read() if name != SINGLE else str(os.path.getsize(path)).encode()
            digest.update(name.encode() + b"\0" + data)
    return f"hf:sha256:{digest.hexdigest()[:32]}"


def initial_state(trainer, directory: str) -> tuple[dict[str, Any], tuple[str, int, str]]:
    """(the state a fine-tune starts from, (its path, step 0, its fingerprint)) for a Hugging Face DIR.
    ConfigError (exit 2) naming the file and key when DIR is unreadable or another model than the run's."""
    import jax
    import jax.numpy as jnp

    from trainer.hf.convert import open_hub, read_param

    try:
        hub = open_hub(directory)
        problem = _differences(trainer.cfg, hub.cfg, directory)
        if problem:
            raise HFError(f"--init-from: {problem}; `moe-tpu hf import {directory} -o DIR` writes its config "
                          "(DIR/config.json)")
        params, biases = _read_onto_mesh(trainer, hub, read_param)
    except HFError as e:
        raise ConfigError(str(e)) from None
    shardings = trainer.state_shardings
    state = {"step": jax.device_put(jnp.zeros((), jnp.int32), shardings["step"]), "params": params,
             "opt_state": jax.jit(trainer.optimizer.init, out_shardings=shardings["opt_state"])(params)}
    if "moe_bias" in trainer.abstract_state:  # DeepSeek-V3's selection bias from the file, else a fresh one
        state["moe_bias"] = biases or jax.jit(lambda: trainer.init_fn()["moe_bias"],
                                              out_shardings=shardings["moe_bias"])()
    return state, (os.path.abspath(directory), 0, fingerprint(directory))


def _read_onto_mesh(trainer, hub, read_param) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the parameters, the MoE selection biases the file holds), each on the run's mesh: a layer's tensor goes
    straight into its slice of the stacked parameter (trainer/stacks.py), on the devices that hold that slice,
    so that the host holds one tensor at a time."""
    import jax

    from trainer import stacks
    from trainer.hf.orbax_io import BIAS_SUFFIX

    wanted = {**trainer.abstract_state["params"], **trainer.abstract_state.get("moe_bias", {})}
    specs = [spec for group in names.all_specs(hub.cfg, hub.family, hub.layouts) for spec in group]
    places = {spec.param: stacks.locate(trainer.cfg.model, spec.param) for spec in specs}
    found = {target for target, _ in places.values()}
    if set(wanted) != found:
        extra = sorted(set(wanted) ^ found)[0]
        raise HFError(f"--init-from: the parameter {extra} is in {'this run' if extra in wanted else hub.directory}"
                      f"'s model only")
    out = {"params": {}, "moe_bias": {}}
    for spec in specs:
        target, index = places[spec.param]
        want = wanted[target]
        shape = tuple(want.shape) if index is None else tuple(want.shape[1:])
        if shape != spec.shape:
            raise HFError(f"--init-from: {spec.param} is {list(shape)} in this run's model, {list(spec.shape)} "
                          f"in {hub.directory}")
        value = read_param(hub, spec).astype(want.dtype)
        part = "moe_bias" if spec.param.endswith(BIAS_SUFFIX) else "params"
        where = trainer.state_shardings[part][target]
        if index is None:
            out[part][target] = jax.device_put(value, where)
            continue
        held = out[part].get(target)
        if held is None:
            held = jax.numpy.zeros(want.shape, want.dtype, device=where)
        out[part][target] = _layer_writer(where)(held, jax.device_put(value, _slice_sharding(where)), index)
    return out["params"], out["moe_bias"]


def _slice_sharding(where):
    """A stacked parameter's sharding for one of its layers (the leading axis, never split, dropped)."""
    from jax.sharding import NamedSharding, PartitionSpec

    return NamedSharding(where.mesh, PartitionSpec(*tuple(where.spec)[1:]))


@functools.lru_cache(maxsize=64)
def _layer_writer(where):
    """stacked.at[index].set(layer) in place (the stacked array donated), laid out as `where`."""
    import jax

    return jax.jit(lambda stacked, layer, index: jax.lax.dynamic_update_index_in_dim(stacked, layer, index, 0),
                   out_shardings=where, donate_argnums=0)
