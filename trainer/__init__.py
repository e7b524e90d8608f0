"""moe-tpu trainer: a JAX/Flax Mixture-of-Experts language model and its train loop.

cli (flags -> RunSpec) -> train (jitted step, loop, SIGTERM) with config (YAML -> frozen pydantic models),
model + layers (decoder; the MoE block comes from trainer.moe), sharding (logical names -> mesh),
data (deterministic sources) and datasets (Grain: prepared ArrayRecord shards, token arrays), checkpoint
(orbax), metrics (printing) and tensorboard (events), evaluation, flops (MFU), distributed (multi-host);
prepare (tokenize a corpus), sample (decode from a checkpoint) and plot (a run's metrics as a PNG).
Importing the package imports nothing heavy: jax starts only inside the command.
"""
