"""The `--mesh` text (`data=D,expert=E,model=T`), read once for the trainer, the planner and the config checks.

Imports nothing but the standard library: the control plane reads a config's mesh with it before any
jax is loaded; trainer/sharding.py builds the device mesh from the shape it returns. The model's own
divisibility by the `model` axis (`model_axis_problems`) is checked here too, from plain integers, so
that the trainer and the control plane's validate refuse the same meshes with the same words.
"""

from __future__ import annotations

# Outermost first: `model` is innermost, so a tensor-parallel group is neighbouring chips.
MESH_AXES = ("data", "expert", "model")
USAGE = "data=D,expert=E,model=T"


def mesh_axes(text: str) -> dict[str, int]:
    """`data=D,expert=E,model=T` (any may be left out) -> the axes given. Raises ValueError naming the mistake."""
    given: dict[str, int] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep:
            raise ValueError(f"--mesh expects {USAGE}; got '{text}'")
        if key not in MESH_AXES:
            raise ValueError(f"--mesh names an unknown axis '{key}' (the axes are {', '.join(MESH_AXES)}); "
                             f"got '{text}'")
        if key in given:
            raise ValueError(f"--mesh names '{key}' twice")
        try:
            given[key] = int(value)
        except ValueError:
            raise ValueError(f"--mesh {key} must be an integer, got '{value}'") from None
        if given[key] < 1:
            raise ValueError(f"--mesh {key} must be at least 1")
    return given


def filled(given: dict[str, int], devices: int) -> tuple[int, int, int]:
    """(data, expert, model) of the given axes on `devices`: expert and model default to 1, data to every
    device left."""
    expert, model = given.get("expert", 1), given.get("model", 1)
    return given.get("data", devices // (expert * model)), expert, model


def text_of(data: int, expert: int, model: int = 1) -> str:
    """The `--mesh` text of a shape; `model` is left out at 1, as meshes were written before it."""
    return f"data={data},expert={expert}" + (f",model={model}" if model > 1 else "")


def parse_mesh(text: str | None, num_devices: int) -> dict[str, int]:
    """`data=D,expert=E,model=T` -> {"data": D, "expert": E, "model": T}; default all devices on data.
    Raises ValueError."""
    given = mesh_axes(text) if text else {}
    data, expert, model = filled(given, num_devices) if text else (num_devices, 1, 1)
    if data * expert * model != num_devices:
        if "data" not in given:  # data fills the devices left: expert x model must divide them
            raise ValueError(f"--mesh {text} needs a multiple of expert x model = {expert * model} devices, "
                             f"but there are {num_devices}")
        raise ValueError(f"--mesh {text_of(data, expert, model)} needs {data * expert * model} devices, "
                         f"but there are {num_devices}")
    return {"data": data, "expert": expert, "model": model}


def mesh_size(text: str | None) -> int | None:
    """The device count a `--mesh` asks for (the fewest, expert x model, where it leaves data to fill the
    devices); None without one."""
    if not text:
        return None
    given = mesh_axes(text)
    return given.get("data", 1) * given.get("expert", 1) * given.get("model", 1)


def model_axis_problems(model: int, *, num_heads: int, kv_heads: int, dense_d_ff: int | None,
                        expert_d_ff: int | None, shared_d_ff: int | None = None,
                        sharded_vocab: int | None = None) -> list[str]:
    """What a `model` axis of this size cannot split, one message each naming the number to change.

    Attention's heads are split over `model`; KV heads too when `model` divides them, and replicated
    when they are fewer and divide `model` (each device's query heads then share one KV head). The
    FFNs' hidden sizes (None: the model has no such FFN) are split over `model`, and the vocabulary
    when `train.shard_vocab` asks for it (sharded_vocab: its size; None: kept whole)."""
    if model <= 1:
        return []
    found = []
    if num_heads % model:
        found.append(f"model.num_heads ({num_heads}) must be divisible by the mesh's model axis ({model})")
    if kv_heads % model and model % kv_heads:
        found.append(f"model.kv_heads ({kv_heads}) must divide or be divisible by the mesh's model axis ({model})")
    for key, size in (("model.d_ff", dense_d_ff), ("moe.d_ff", expert_d_ff), ("the shared experts' d_ff",
                                                                               shared_d_ff)):
        if size is not None and size % model:
            found.append(f"{key} ({size}) must be divisible by the mesh's model axis ({model})")
    if sharded_vocab is not None and sharded_vocab % model:
        found.append(f"model.vocab_size ({sharded_vocab}) must be divisible by the mesh's model axis ({model}) "
                     "to split it (train.shard_vocab)")
    return found


def config_problems(cfg, shape: dict[str, int]) -> list[str]:
    """What a trainer config (trainer.config.Config, read by attribute: no import here) cannot do on a
    mesh of this shape: the batch over data x expert, the experts over expert, and model_axis_problems."""
    data, expert, model = shape["data"], shape["expert"], shape.get("model", 1)
    m, moe = cfg.model, cfg.moe
    found = []
    if cfg.data.global_batch_size % (data * expert):
        found.append(f"data.global_batch_size ({cfg.data.global_batch_size}) must be divisible by the "
                     f"mesh size data x expert = {data * expert}")
    has_moe = m.num_moe_layers > 0
    if has_moe and moe.num_experts % expert:
        found.append(f"moe.num_experts ({moe.num_experts}) must be divisible by the mesh's expert axis ({expert})")
    return found + tensor_problems(cfg, model)


def tensor_problems(cfg, model: int) -> list[str]:
    """model_axis_problems for a trainer config (read by attribute): its heads and the hidden sizes of
    the FFNs it has (dense layers, experts, shared experts)."""
    m, moe = cfg.model, cfg.moe
    has_moe = m.num_moe_layers > 0
    shared = moe.num_shared_experts * (moe.shared_d_ff or moe.d_ff) if has_moe and moe.num_shared_experts else None
    return model_axis_problems(
        model, num_heads=m.num_heads, kv_heads=m.kv_heads, dense_d_ff=m.d_ff if m.num_moe_layers < m.num_layers
        else None, expert_d_ff=moe.d_ff if has_moe else None, shared_d_ff=shared,
        sharded_vocab=m.vocab_size if cfg.train.shard_vocab else None)
