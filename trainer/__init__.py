"""moe-tpu trainer: a JAX/Flax Mixture-of-Experts language model and its train loop.

cli (flags -> RunSpec) -> train (jitted step, loop, SIGTERM) with config (YAML -> frozen pydantic models),
model + layers (decoder; the MoE block comes from trainer.moe), sharding (logical names -> mesh),
data (deterministic sources), checkpoint (orbax), metrics (printing), flops (MFU), distributed (multi-host).
Importing the package imports nothing heavy: jax starts only inside the command.
"""
