"""Hugging Face interchange: a checkpoint of Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2
or DeepSeek-V3 (config.json, safetensors shards and their index, the tokenizer) to a trainer checkpoint and
back.

families.py maps the Hub's config.json to the trainer's config and back (no jax); names.py maps each trainer
parameter to the Hub's tensors (both on-disk expert layouts); safetensors_io.py reads shards a tensor at a
time and writes them; deepseek.py holds DeepSeek's config, latent attention and routing; fp8.py dequantises
FP8 weights; convert.py runs an import or an export; cli.py is `moe-tpu hf import|export`.
Importing this package imports neither jax nor the control plane.
"""
