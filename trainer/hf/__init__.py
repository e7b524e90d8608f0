"""Hugging Face interchange: a checkpoint of Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE (config.json, safetensors
shards and their index, the tokenizer) to a trainer checkpoint and back.

families.py maps the Hub's config.json to the trainer's config and back (no jax); names.py maps each trainer
parameter to the Hub's tensors (both on-disk expert layouts); safetensors_io.py reads shards a tensor at a
time and writes them; convert.py runs an import or an export; cli.py is `moe-tpu hf import|export`.
Importing this package imports neither jax nor the control plane.
"""
