"""Whether a model's training state fits in the devices' memory, decided before anything is allocated.

A config with a typo'd size (d_model=4000000) would otherwise have XLA trace, compile and then try to
allocate terabytes, which on a host without that much memory ends with the process killed or swapping
for hours. The count is the trainer's own (trainer.params builds the model abstractly); the bound is the
state alone (parameters, gradients and two Adam moments), so a config refused here could never train.
"""

from __future__ import annotations

from trainer.config import Config, ConfigError

STATE_COPIES = 4  # parameters, gradients, Adam's first and second moments, each with the parameters' shape
GIB = 1 << 30


def rough_state_bytes(cfg: Config) -> int:
    """An upper bound of the whole state's bytes from the config alone (no tracing): the gate of the exact
    count, which costs a trace."""
    m, moe = cfg.model, cfg.moe
    head = m.num_heads * m.head_size
    attention = 2 * m.d_model * head + 2 * m.d_model * m.kv_heads * m.head_size
    expert = 3 * m.d_model * max(moe.d_ff, moe.shared_d_ff or moe.d_ff) * (moe.num_experts + moe.num_shared_experts + 1)
    per_layer = attention + max(3 * m.d_model * m.d_ff, expert) + 4 * m.d_model
    params = 2 * m.vocab_size * m.d_model + m.num_layers * per_layer
    return params * STATE_COPIES * 4


def state_bytes_per_device(cfg: Config, mesh_shape: dict[str, int]) -> int:
    """The state's bytes on one device: each parameter's bytes over the ways the mesh splits it, times four."""
    from trainer.params import param_inventory, shard_ways

    mesh = tuple(mesh_shape.items())
    return STATE_COPIES * sum(p.nbytes // shard_ways(p.axes, p.shape, mesh, cfg.train.fsdp)
                              for p in param_inventory(cfg))


def logits_bytes_per_device(cfg: Config, mesh_shape: dict[str, int]) -> int:
    """One batch's float32 logits and their gradient on one device (the batch is split over data x expert), or
    one chunk's with train.loss_chunk: the smallest part of the activations, and alone enough to refuse a
    batch far too big."""
    rows = -(-cfg.data.global_batch_size // (mesh_shape.get("data", 1) * mesh_shape.get("expert", 1)))
    return 2 * 4 * rows * (cfg.train.loss_chunk or cfg.data.seq_len) * cfg.model.vocab_size


def device_memory(devices) -> tuple[int, str] | None:
    """(bytes one device has, what they are): the accelerator's limit, or on CPU the host's available
    memory shared by its devices; None when unknown."""
    import jax

    mine = [d for d in devices if d.process_index == jax.process_index()] or list(devices)
    try:  # only this process's devices answer; some platforms have no statistics at all
        stats = mine[0].memory_stats()
    except Exception:  # noqa: BLE001 - then the host's memory is the bound
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"the {mine[0].device_kind} device's memory"
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    return available // len(mine), f"the host's available memory shared by {len(mine)} device(s)"


def check_fits(cfg: Config, mesh_shape: dict[str, int], devices) -> None:
    """ConfigError (exit 2) when the training state alone cannot fit on a device."""
    memory = device_memory(devices)
    logits = logits_bytes_per_device(cfg, mesh_shape)
    if memory is None or rough_state_bytes(cfg) // max(len(devices), 1) + logits < memory[0] // 4:
        return
    problem = fit_problem(cfg, mesh_shape, *memory)
    if problem:
        raise ConfigError(problem)


# What makes a float32-parameter model fit where it does not: bfloat16 parameters and optimizer state (half
# the state's bytes), with the blocks' activations recomputed in the backward pass (one v5e chip with moe-1b:
# bfloat16 alone passes this count but XLA then wants 46.7 GiB of temporaries; with remat 6.7 GiB).
SMALLER_STATE = {"param_dtype": "bfloat16"}
SMALLER_STATE_FLAGS = "--set param_dtype=bfloat16 --set model.remat=true"


def fit_problem(cfg: Config, mesh_shape: dict[str, int], memory_bytes: int, memory_name: str) -> str | None:
    """Why the state and one batch's logits cannot fit in `memory_bytes` per device (None: they can), naming
    the change that makes them fit where bfloat16 parameters would."""
    logits = logits_bytes_per_device(cfg, mesh_shape)
    need = state_bytes_per_device(cfg, mesh_shape) + logits
    if need <= memory_bytes:
        return None
    remedy = ("make the model or the batch smaller (model.d_model, model.num_layers, moe.num_experts, "
              "data.global_batch_size) or use more devices")
    if cfg.param_dtype == "float32":
        smaller = cfg.model_copy(update=SMALLER_STATE)
        half = state_bytes_per_device(smaller, mesh_shape) + logits
        if half <= memory_bytes:
            remedy = (f"{SMALLER_STATE_FLAGS} make it fit ({half / GIB:,.1f} GiB: bfloat16 parameters and "
                      f"optimizer state, the activations recomputed in the backward pass), or {remedy}")
    return (f"the model cannot fit: its parameters, gradients and optimizer state and one batch's logits need "
            f"{need / GIB:,.1f} GiB per device on the mesh {mesh_shape}, more than {memory_name} "
            f"({memory_bytes / GIB:,.1f} GiB); {remedy}")
