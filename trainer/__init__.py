"""moe-tpu trainer: a JAX/Flax Mixture-of-Experts language model and its train loop."""
