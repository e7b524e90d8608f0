"""The one place where logical axis names meet the device mesh.

Layers name their parameter axes ("embed", "mlp", "vocab", "heads", "kv", "expert", ...); the rules
(trainer/arith/mesh.py, jax-free for the planner) map those names to the mesh axes "data", "expert" and
"model", and this module applies them to jax's meshes. Experts go over `expert`, the batch over data
and expert, and with FSDP the `embed` axis over `data`. Tensor parallelism (Megatron-style) is the `model`
axis: the FFNs' hidden dimension (dense and each expert's) and attention's heads and KV heads (replicated
when fewer than the axis). Activations between layers are whole on `model`; inside a layer its hidden
activations are split there (`constrain`), so XLA gathers nothing before the column-parallel products and
all-reduces the row-parallel products' partial sums. Attention's q, k and v are one product on `model`
(trainer/layers.py), so that the backward pass all-reduces its input gradient once. With
`train.shard_vocab` the vocabulary goes over `model` too (`vocab_axis`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trainer.arith.mesh import BATCH_AXES, FSDP_RULES, RULES, rules, spec_entries  # noqa: F401 - the rules, one place
from trainer.arith.params import vocab_axis  # noqa: F401 - the vocabulary's logical name
from trainer.meshspec import MESH_AXES, mesh_size, parse_mesh  # noqa: F401 - the mesh text, read once


def logical_to_spec(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh, fsdp: bool = False) -> P:
    """The PartitionSpec for an array with logical axis `names`; a dim the mesh cannot divide stays whole."""
    return P(*spec_entries(names, shape, dict(mesh.shape), fsdp))


def variable_names(var: nnx.Variable) -> tuple[str | None, ...] | None:
    """The logical names a Param was created with (`out_sharding=`, or the older `sharding=`)."""
    meta = var.get_metadata()
    names = meta.get("out_sharding", meta.get("sharding", meta.get("sharding_names")))
    return tuple(names) if names is not None else None


def param_specs(variables: Mapping[str, nnx.Variable], mesh: Mesh, fsdp: bool = False) -> dict[str, P]:
    """PartitionSpecs for named Params (name -> Variable); a Param without logical names replicates."""
    specs = {}
    for name, var in variables.items():
        names = variable_names(var)
        shape = var.get_value().shape
        if names is not None and len(names) != len(shape):
            raise ValueError(f"param {name}: logical names {names} do not match shape {shape}")
        specs[name] = P() if names is None else logical_to_spec(names, shape, mesh, fsdp)
    return specs


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batch rows over data and expert (the MoE block's shard_map expects this), sequence whole."""
    return NamedSharding(mesh, P(BATCH_AXES, None))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def activation_spec(mesh: Mesh | None) -> NamedSharding | None:
    return None if mesh is None else NamedSharding(mesh, P(BATCH_AXES, None, None))


# The mesh the model being traced runs on, for `constrain` in layers that hold no mesh of their own.
_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("logical_mesh", default=None)


@contextlib.contextmanager
def logical_mesh(mesh: Mesh | None):
    """While tracing a model on `mesh`, `constrain` lays activations out on it (None: does nothing)."""
    token = _MESH.set(mesh)
    try:
        yield
    finally:
        _MESH.reset(token)


def current_mesh() -> Mesh | None:
    """The mesh of the current `logical_mesh` (None outside one)."""
    return _MESH.get()


def on_one_device() -> bool:
    """Whether the model being traced runs on one device (no `logical_mesh`, or one of one device): where a
    Pallas kernel may take its operands whole, since XLA's partitioner does not split a kernel over a mesh."""
    mesh = _MESH.get()
    return mesh is None or mesh.size == 1


def current_platform() -> str:
    """The platform the model being traced runs on: its `logical_mesh`'s devices', else the default backend's
    (the TPU kernels pick by it: the kernel on a TPU, Pallas' interpreter elsewhere)."""
    mesh = _MESH.get()
    return mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()


def model_ways() -> int:
    """The size of the current `logical_mesh`'s model axis (1 without one)."""
    mesh = _MESH.get()
    return 1 if mesh is None else dict(mesh.shape).get("model", 1)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """x constrained to the layout of its logical axis `names` on the current `logical_mesh`; unchanged
    without one, or where the mesh has no `model` axis to split (the only layout this adds)."""
    mesh = _MESH.get()
    if mesh is None or dict(mesh.shape).get("model", 1) == 1:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(names, x.shape, mesh)))


def make_mesh(shape: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ("data", "expert", "model") mesh (model 1 when the shape leaves it out). With several slices
    (multislice), data spans slices over DCN; expert and model stay within a slice."""
    devices = list(devices if devices is not None else jax.devices())
    dims = (shape["data"], shape["expert"], shape.get("model", 1))
    num_slices = len({getattr(d, "slice_index", 0) for d in devices})
    if num_slices > 1 and dims[0] % num_slices == 0:
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_hybrid_device_mesh(
            (dims[0] // num_slices, *dims[1:]), (num_slices, 1, 1), devices=devices)
        return Mesh(grid, MESH_AXES)
    if len(devices) > 1 and devices[0].platform == "tpu":
        from jax.experimental import mesh_utils

        return Mesh(mesh_utils.create_device_mesh(dims, devices=devices), MESH_AXES)
    return Mesh(np.asarray(devices).reshape(dims), MESH_AXES)


def global_batch(trainer, rows_BxT: np.ndarray) -> jax.Array:
    """This process's rows of a batch as the global batch array, sharded as the trainer's batches are."""
    global_shape = (trainer.cfg.data.global_batch_size, rows_BxT.shape[1])
    return jax.make_array_from_process_local_data(trainer.batch_sharding, rows_BxT, global_shape)


def devices_hint(mesh_text: str | None, count: int) -> str:
    """On CPU a mesh of another size is one flag away: `--devices N` fakes N devices."""
    if jax.devices()[0].platform != "cpu":
        return ""
    try:
        wanted = mesh_size(mesh_text)
    except ValueError:
        return ""
    return f"; on CPU, add --devices {wanted} to run on {wanted} fake devices" if wanted and wanted != count else ""
