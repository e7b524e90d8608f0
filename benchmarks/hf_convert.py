"""`hf import` of a synthetic 8-shard Mixtral-shaped checkpoint against a plain copy of the same bytes,
side by side in one run: MB/s of each, their ratio, and the import's peak resident memory against the
issue's bound (the largest shard + one layer + 0.5 GB).

    python benchmarks/hf_convert.py [--layers 8] [--d-model 1024] [--d-ff 3584] [--experts 8] [--json]

The checkpoint (about 2.9 GB at the defaults, float32, one shard a layer) is written with safetensors in a
temporary directory; each side runs in its own process, whose peak RSS is read from wait4.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def write_checkpoint(directory: Path, layers: int, d: int, f: int, experts: int, vocab: int = 32000) -> dict:
    """A Mixtral config.json and one shard a layer (the embedding, norm and head with the first and last);
    returns the sizes in bytes of the largest shard and of one layer."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    heads, kv, head = d // 128, max(1, d // 512), 128
    config = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": vocab, "hidden_size": d,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
              "head_dim": head, "intermediate_size": f, "num_local_experts": experts, "num_experts_per_tok": 2,
              "rms_norm_eps": 1e-5, "rope_theta": 1e6, "tie_word_embeddings": False}
    (directory / "config.json").write_text(json.dumps(config))
    weight_map, shard_sizes, layer_bytes = {}, [], 0
    rand = lambda *shape: (rng.standard_normal(shape, dtype=np.float32) * 0.02)  # noqa: E731
    for i in range(layers):
        p = f"model.layers.{i}"
        tensors = {f"{p}.input_layernorm.weight": np.ones(d, np.float32),
                   f"{p}.post_attention_layernorm.weight": np.ones(d, np.float32),
                   f"{p}.self_attn.q_proj.weight": rand(heads * head, d),
                   f"{p}.self_attn.k_proj.weight": rand(kv * head, d),
                   f"{p}.self_attn.v_proj.weight": rand(kv * head, d),
                   f"{p}.self_attn.o_proj.weight": rand(d, heads * head),
                   f"{p}.block_sparse_moe.gate.weight": rand(experts, d)}
        for e in range(experts):
            for w, shape in (("w1", (f, d)), ("w3", (f, d)), ("w2", (d, f))):
                tensors[f"{p}.block_sparse_moe.experts.{e}.{w}.weight"] = rand(*shape)
        layer_bytes = sum(t.nbytes for t in tensors.values())
        if i == 0:
            tensors["model.embed_tokens.weight"] = rand(vocab, d)
        if i == layers - 1:
            tensors.update({"model.norm.weight": np.ones(d, np.float32), "lm_head.weight": rand(vocab, d)})
        name = f"model-{i + 1:05d}-of-{layers:05d}.safetensors"
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        shard_sizes.append((directory / name).stat().st_size)
        weight_map.update({k: name for k in tensors})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return {"largest_shard": max(shard_sizes), "layer": layer_bytes, "total": sum(shard_sizes)}


def measured(cmd: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS in bytes) of one process."""
    start = time.perf_counter()
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               env=dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"))
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {process.stderr.read().decode()[-2000:]}")
    return seconds, usage.ru_maxrss * 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--d-ff", type=int, default=3584)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        src = Path(work) / "src"
        src.mkdir()
        sizes = write_checkpoint(src, args.layers, args.d_model, args.d_ff, args.experts)
        copy_s, copy_rss = measured(["cp", "-r", str(src), str(Path(work) / "copy")])
        import_s, import_rss = measured([sys.executable, "-m", "trainer.hf", "import", str(src), "-o",
                                         str(Path(work) / "imported")])
    mb = sizes["total"] / 1e6
    bound = sizes["largest_shard"] + sizes["layer"] + 500e6
    result = {"checkpoint_bytes": sizes["total"], "shards": args.layers, "copy_mb_per_s": mb / copy_s,
              "import_mb_per_s": mb / import_s, "import_over_copy_time": import_s / copy_s,
              "import_peak_rss_bytes": import_rss, "copy_peak_rss_bytes": copy_rss, "rss_bound_bytes": int(bound),
              "rss_within_bound": import_rss <= bound}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"checkpoint      {mb:,.0f} MB in {args.layers} shards (largest {sizes['largest_shard'] / 1e6:,.0f} MB, "
              f"a layer {sizes['layer'] / 1e6:,.0f} MB)")
        print(f"plain copy      {result['copy_mb_per_s']:8,.0f} MB/s")
        print(f"hf import       {result['import_mb_per_s']:8,.0f} MB/s   "
              f"{result['import_over_copy_time']:.1f}x the copy's time")
        print(f"import peak RSS {import_rss / 1e6:8,.0f} MB     bound (largest shard + a layer + 500 MB) "
              f"{bound / 1e6:,.0f} MB: {'within' if result['rss_within_bound'] else 'OVER'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
