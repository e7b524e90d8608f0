"""The train step's levers side by side on one accelerator, in one process: step time, tokens/s, MFU and the
compiled program's memory for each variant of a config (attention kernel, remat policy, chunked loss, MoE
path, grouped-matmul kernel), and megablox's tiles against ragged_dot on the config's expert shapes.

    python benchmarks/train_levers.py [--config moe-1b] [--steps 10] [--json-out FIGURES.json]
    python benchmarks/train_levers.py --variants splash,splash+chunk   # some variants only (--list: all)

One process holds the chip (a TPU admits one program at a time), so the state is made once and each variant's
step continues from the last one's (the variants share the parameters' shapes). Each variant's step time is
the mean of --steps steps after two unmeasured ones, timed around the whole run with one read of the loss at
its end (the loop's own dispatch-ahead, trainer/train.py). MFU uses the trainer's FLOP count
(trainer/flops.py: 6 x active parameters + causal attention, MaxText's convention). A variant that fails
(out of memory, say) is reported with its error and the rest go on.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ONE_CHIP = ["param_dtype=bfloat16", "model.remat=true", "model.remat_policy=full", "model.num_heads=16",
            "train.loss_chunk=0"]  # moe-1b as it was first measured; each variant sets what it changes
CHUNK = "train.loss_chunk=256"
DROPLESS = "moe.capacity_factor=0"
H8 = ["model.attention=splash", CHUNK, "model.num_heads=8"]  # moe-1b's kernel, loss chunks and heads
VARIANTS = {
    "xla": ["model.attention=xla"],
    "splash": ["model.attention=splash"],
    "splash+chunk": ["model.attention=splash", CHUNK],
    "splash+chunk+dots_no_batch": ["model.attention=splash", CHUNK, "model.remat_policy=dots_no_batch"],
    "splash+chunk+dots": ["model.attention=splash", CHUNK, "model.remat_policy=dots"],
    "splash+chunk+no_remat": ["model.attention=splash", CHUNK, "model.remat=false"],
    "dropless_ragged+splash+chunk": ["model.attention=splash", CHUNK, DROPLESS, "moe.grouped_matmul=ragged_dot"],
    "dropless_megablox+splash+chunk": ["model.attention=splash", CHUNK, DROPLESS, "moe.grouped_matmul=megablox"],
    "b8+splash+chunk": ["model.attention=splash", CHUNK, "data.global_batch_size=8"],
    "b8+splash+chunk+dots": ["model.attention=splash", CHUNK, "data.global_batch_size=8", "model.remat_policy=dots"],
    "b8+splash+chunk+dots_no_batch": ["model.attention=splash", CHUNK, "data.global_batch_size=8",
                                      "model.remat_policy=dots_no_batch"],
    "splash+chunk+attention": ["model.attention=splash", CHUNK, "model.remat_policy=attention"],
    "h8+splash+chunk+attention": [*H8, "model.remat_policy=attention"],
    "h8+splash+chunk+attention_ffn": [*H8, "model.remat_policy=attention_ffn"],
    "h8+dropless_megablox+splash+chunk+attention": [*H8, "model.remat_policy=attention", DROPLESS,
                                                    "moe.grouped_matmul=megablox"],
    "h8+splash+chunk512+attention": ["model.attention=splash", "train.loss_chunk=512", "model.num_heads=8",
                                     "model.remat_policy=attention"],
    "h8+splash+attention": ["model.attention=splash", "model.num_heads=8", "model.remat_policy=attention"],
    "h8+splash+chunk+attention+g16": [*H8, "model.remat_policy=attention", "moe.routing_groups=16"],
    "h8+splash+chunk+attention+einsum_g16": [*H8, "model.remat_policy=attention", "moe.routing_groups=16",
                                             "moe.dispatch=einsum"],
    "h8+splash+chunk+attention+cf1": [*H8, "model.remat_policy=attention", "moe.capacity_factor=1.0"],
    "h8+splash+chunk+attention_moe": [*H8, "model.remat_policy=attention_moe"],
    "h8+dropless_megablox+splash+chunk+attention_moe": [*H8, "model.remat_policy=attention_moe", DROPLESS,
                                                        "moe.grouped_matmul=megablox"],
    "h8+splash+chunk512+attention_moe": ["model.attention=splash", "train.loss_chunk=512", "model.num_heads=8",
                                         "model.remat_policy=attention_moe"],
    "h8+splash+chunk+attention+position": [*H8, "model.remat_policy=attention", "moe.drop_priority=position"],
    "b8+dropless_megablox+splash+chunk+dots": ["model.attention=splash", CHUNK, "data.global_batch_size=8",
                                               "model.remat_policy=dots", DROPLESS, "moe.grouped_matmul=megablox"],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="moe-1b")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="applied to every variant")
    parser.add_argument("--no-gmm", action="store_true", help="leave out megablox's tiles")
    parser.add_argument("--components", action="store_true",
                        help="also time each part of the step alone (a dense and an MoE block, attention, the "
                             "head and loss), forward and forward+backward")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--profile", action="store_true",
                        help="each variant's device ops by time over 3 steps (benchmarks/profile_ops.py)")
    parser.add_argument("--json-out", metavar="PATH")
    args = parser.parse_args()
    if args.list:
        print("\n".join(f"{k}: {' '.join(v)}" for k, v in VARIANTS.items()))
        return 0
    import jax

    results = {"device": jax.devices()[0].device_kind, "variants": {}, "gmm": {}}
    held = []  # the state, handed from variant to variant; emptied before a state of another shape is made
    for name in [v.strip() for v in args.variants.split(",") if v.strip()]:
        try:
            row = measure(args.config, [*ONE_CHIP, *VARIANTS[name], *args.overrides], args.steps, held,
                          args.profile)
        except Exception as e:  # noqa: BLE001 - a variant's failure is a figure too
            row = {"error": f"{type(e).__name__}: {str(e)[:600]}", "trace": traceback.format_exc()[-1500:]}
            if "RESOURCE_EXHAUSTED" in str(e) or "memory" in str(e).lower():
                held.clear()
        results["variants"][name] = row
        print(name, json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)
        _save(args.json_out, results)
    if args.components:
        results["components"] = components(args.config, args.overrides)  # the config as written
        print(json.dumps(results["components"], indent=1), flush=True)
        _save(args.json_out, results)
    if not args.no_gmm:
        results["gmm"] = gmm_tiles(args.config)
        print(json.dumps(results["gmm"], indent=1), flush=True)
    _save(args.json_out, results)
    return 0


def _save(path: str | None, results: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(results, indent=2) + "\n")


def measure(config: str, overrides: list[str], steps: int, held: list, profile: bool = False) -> dict:
    import jax
    import numpy as np

    from trainer import flops, sharding
    from trainer.config import load_config
    from trainer.step import build_trainer, compile_step

    cfg = load_config(config, [*overrides, "train.program_cache=false"])  # compile_s: compiled, never loaded
    mesh = sharding.make_mesh({"data": 1, "expert": 1, "model": 1}, jax.devices()[:1])
    trainer = build_trainer(cfg, mesh, 1000)
    row = {"overrides": overrides}
    shapes = lambda tree: [(a.shape, a.dtype) for a in jax.tree.leaves(tree)]  # noqa: E731
    if held and shapes(held[0]) != shapes(trainer.abstract_state):
        held.clear()  # another shape of model: a state of its own, the last one's memory freed first
    state = held.pop() if held else None
    if state is None:
        t = time.perf_counter()
        init = trainer.init_fn.lower().compile()
        row["init_compile_s"] = time.perf_counter() - t
        state = init()
        jax.block_until_ready(state)
        row["init_s"] = time.perf_counter() - t
    t = time.perf_counter()
    step = compile_step(trainer)
    row["compile_s"] = time.perf_counter() - t
    mem = step.memory_analysis()
    if mem is not None:
        row.update({f"{k}_gib": getattr(mem, f"{k}_size_in_bytes") / 2**30
                    for k in ("argument", "output", "temp", "generated_code")})
    batch, length = cfg.data.global_batch_size, cfg.data.seq_len
    rng = np.random.default_rng(0)
    tokens = jax.device_put(rng.integers(0, cfg.data.synthetic_vocab, (batch, length + 1), np.int32),
                            trainer.batch_sharding)
    for _ in range(2):
        state, metrics = step(state, tokens)
    float(metrics["loss"])
    t = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, tokens)
    loss = float(metrics["loss"])
    step_s = (time.perf_counter() - t) / steps
    row.update(step_ms=step_s * 1e3, tokens_per_s=batch * length / step_s, loss=loss,
               mfu=flops.mfu(cfg, step_s, 1, jax.devices()[0].device_kind),
               flops_per_step=flops.flops_per_step(cfg))
    if profile:
        from profile_ops import op_table

        box = [state]

        def once():
            box[0], out = step(box[0], tokens)
            float(out["loss"])

        row["profile"] = op_table(once, calls=3, top=80)
        state = box[0]
    stats = jax.devices()[0].memory_stats() or {}
    row["peak_hbm_gib"] = stats.get("peak_bytes_in_use", 0) / 2**30
    held.append(state)
    return row


def _timed(fn, *args, repeats: int = 5) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / repeats * 1e3


def components(config: str, overrides: list[str]) -> dict:
    """Each part of the step alone at the config's batch, forward and forward+backward (ms), the config as
    written (with --set): a dense block, an
    MoE block, the attention sublayer, the head with the loss; the step's sum of them is in the closing row."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from trainer.config import load_config
    from trainer.model import Block

    cfg = load_config(config, overrides)
    m = cfg.model
    batch, length, dtype = cfg.data.global_batch_size, cfg.data.seq_len, jnp.dtype(cfg.dtype)
    x = jax.random.normal(jax.random.key(0), (batch, length, m.d_model), dtype)
    res = {"overrides": overrides}
    layers = {"dense": next((i for i in range(m.num_layers) if not m.is_moe_layer(i)), None),
              "moe": next((i for i in range(m.num_layers) if m.is_moe_layer(i)), None)}
    for name, layer in layers.items():
        if layer is None:
            res[f"{name}_block_fwdbwd_ms"] = 0.0
            continue
        with nnx.use_eager_sharding(False):
            block = Block(cfg, layer, mesh=None, rngs=nnx.Rngs(0))
        parts = {f"{name}_block": lambda b, h: b(h, train=True)[0],
                 "attention": lambda b, h: b.attn(b.attn_norm(h))}
        if name == "dense":
            parts["dense_ffn"] = lambda b, h: b.ffn(b.ffn_norm(h))
        else:
            parts["moe_ffn"] = lambda b, h: b.ffn(b.ffn_norm(h), train=True)[0]
        graphdef, params, rest = nnx.split(block, nnx.Param, ...)
        for part, fn in parts.items():
            def loss(params, h, fn=fn, graphdef=graphdef, rest=rest):
                return jnp.sum(fn(nnx.merge(graphdef, params, rest), h).astype(jnp.float32) ** 2)
            res[f"{part}_fwd_ms"] = _timed(jax.jit(loss), params, x)
            res[f"{part}_fwdbwd_ms"] = _timed(jax.jit(jax.grad(loss, argnums=(0, 1))), params, x)
    w = jax.random.normal(jax.random.key(1), (m.d_model, m.vocab_size), dtype) * 0.02
    targets = jax.random.randint(jax.random.key(2), (batch, length), 0, m.vocab_size)

    def head_loss(w, h):
        logits = jnp.einsum("bld,dv->blv", h, w, preferred_element_type=jnp.float32)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))

    res["head_loss_fwdbwd_ms"] = _timed(jax.jit(jax.grad(head_loss, argnums=(0, 1))), w, x)
    moe_layers = sum(m.is_moe_layer(i) for i in range(m.num_layers))
    res["sum_of_blocks_fwdbwd_ms"] = (res["moe_block_fwdbwd_ms"] * moe_layers
                                      + res["dense_block_fwdbwd_ms"] * (m.num_layers - moe_layers)
                                      + res["head_loss_fwdbwd_ms"])
    return res


def gmm_tiles(config: str) -> dict:
    """megablox's forward+backward time per tile choice against ragged_dot's, on the config's expert shapes
    (rows: batch x length x top_k, spread evenly over the experts)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    from trainer.config import load_config

    cfg = load_config(config, [])
    experts, d, f = cfg.moe.num_experts, cfg.model.d_model, cfg.moe.d_ff
    rows = cfg.data.global_batch_size * cfg.data.seq_len * cfg.moe.top_k
    x = jax.random.normal(jax.random.key(0), (rows, d), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (experts, d, f), jnp.bfloat16)
    sizes = jnp.full((experts,), rows // experts, jnp.int32)

    def timed(fn) -> float:
        g = jax.jit(jax.grad(lambda x, w: jnp.sum(fn(x, w).astype(jnp.float32) ** 2), argnums=(0, 1)))
        jax.block_until_ready(g(x, w))
        t = time.perf_counter()
        for _ in range(10):
            out = g(x, w)
        jax.block_until_ready(out)
        return (time.perf_counter() - t) / 10 * 1e3

    flop = 3 * 2 * rows * d * f
    res = {"shape": [rows, d, f, experts]}
    ragged = timed(lambda x, w: jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32))
    res["ragged_dot_ms"] = ragged
    res["ragged_dot_tflops"] = flop / ragged / 1e9
    for tiles in [(128, 128, 128), (256, 512, 512), (512, 512, 512), (512, 1024, 1024), (512, 256, 1408),
                  (1024, 512, 512), (256, 1024, 256), (512, 1024, 512)]:
        try:
            ms = timed(lambda x, w, t=tiles: gmm(x, w, sizes, jnp.float32, t))
            res[f"megablox_{tiles}_ms"] = ms
            res[f"megablox_{tiles}_tflops"] = flop / ms / 1e9
        except Exception as e:  # noqa: BLE001
            res[f"megablox_{tiles}"] = f"{type(e).__name__}: {str(e)[:200]}"
    return res


if __name__ == "__main__":
    sys.exit(main())
