"""`python -m trainer.sample` / `moe-tpu sample`: continue a prompt with a trained checkpoint.

Loads the latest checkpoint of a run (its output directory, or the checkpoints directory in it) with the
config the trainer saved beside it (`config.json`), and decodes with a key/value cache: the prompt in one
pass, then one token per step, each attending to the cached keys and values of all the tokens before it.
Text goes through the dataset's tokenizer (a prepared dataset's `tokenizer.json`), bytes for byte-level
text, and token ids written as numbers otherwise. Prints the continuation on stdout and the speed on stderr.

Exit codes: 0 sampled; 2 a usage error (no checkpoint, no config, a prompt the tokenizer cannot read).
"""

from __future__ import annotations

import json
import os
import sys
import time

import click

from trainer.status import EXIT_USAGE

CONFIG_FILE = "config.json"


class SampleError(click.UsageError):
    exit_code = EXIT_USAGE


def _join(base: str, name: str) -> str:
    return f"{base.rstrip('/')}/{name}" if "://" in base else os.path.join(base, name)


def locate(directory: str) -> tuple[str, str]:
    """(checkpoints directory, config.json path) for a run's output directory or its checkpoints directory."""
    from etils import epath

    path = epath.Path(directory)
    if not path.exists():
        raise SampleError(f"--checkpoint {directory} does not exist")
    if (path / "checkpoints").exists():
        return _join(directory, "checkpoints"), _join(directory, CONFIG_FILE)
    return directory, str(path.parent / CONFIG_FILE)


def load_run_config(path: str):
    import pydantic
    from etils import epath

    from trainer.config import Config, describe

    if not epath.Path(path).exists():
        raise SampleError(f"{path} does not exist: the run's config is needed to rebuild its model (the trainer "
                          "writes it to OUTPUT_DIR/config.json)")
    try:
        return Config.model_validate(json.loads(epath.Path(path).read_text()))
    except pydantic.ValidationError as e:
        raise SampleError(f"{path}: {describe(e.errors()[0])}") from None
    except ValueError as e:
        raise SampleError(f"{path} is not a config: {e}") from None


class Codec:
    """Text <-> token ids as the run's data saw them."""

    def __init__(self, cfg, tokenizer_path: str | None):
        self.kind, self.tokenizer = "ids", None
        if tokenizer_path is None and cfg.data.source == "records":
            from trainer.datasets import join, load_manifest

            manifest = load_manifest(cfg.data.path)
            tokenizer_path = join(manifest["directory"], manifest.get("tokenizer", {}).get("file", "tokenizer.json"))
        if tokenizer_path is not None:
            from trainer.prepare import PrepareError, load_tokenizer

            try:
                self.tokenizer, self.kind = load_tokenizer(tokenizer_path), "tokenizer"
            except PrepareError as e:
                raise SampleError(e.message) from None
        elif cfg.data.source == "text":
            self.kind = "bytes"

    def encode(self, text: str) -> list[int]:
        if self.kind == "tokenizer":
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.kind == "bytes":
            return list(text.encode("utf-8"))
        try:
            return [int(t) for t in text.split()]
        except ValueError:
            raise SampleError(f"--prompt: this run's data has no tokenizer; give token ids separated by spaces, "
                              f"got '{text}'") from None

    def decode(self, ids: list[int]) -> str:
        if self.kind == "tokenizer":
            return self.tokenizer.decode(ids)
        if self.kind == "bytes":
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return " ".join(map(str, ids))


def restore_params(cfg, checkpoints: str):
    """(trainer pieces, params, step) from the latest checkpoint in `checkpoints`."""
    import jax

    from trainer import sharding
    from trainer.checkpoint import Checkpointer
    from trainer.train import build_trainer

    mesh = sharding.make_mesh({"data": 1, "expert": 1}, jax.devices()[:1])
    trainer = build_trainer(cfg, mesh, max(cfg.train.steps, 1))
    ckpt = Checkpointer(checkpoints, every=1, keep=1 << 30, async_save=False)
    try:
        restored = ckpt.restore_latest(trainer.abstract_state)
    finally:
        ckpt.close()
    if restored is None:
        raise SampleError(f"--checkpoint: {checkpoints} holds no checkpoint")
    return trainer, restored.state["params"], restored.step


def make_decoder(trainer, batch: int, max_len: int):
    """forward(params, cache, tokens_BxL, start) -> (logits of the last position, cache), for jax.jit.

    The cache holds every layer's keys and values, [layers, B, max_len, kv heads, head size]; the tokens
    sit at positions start..start+L-1 and attend to cached positions up to their own.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from trainer.layers import rotary
    from trainer.model import step_rngs

    m = trainer.cfg.model
    graphdef, codec, rest = trainer.graphdef, trainer.codec, trainer.rest
    dtype = jnp.dtype(trainer.cfg.dtype)
    shape = (m.num_layers, batch, max_len, m.kv_heads, m.head_size)
    empty = {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}

    def forward(params, cache, tokens_BxL, start):
        model = nnx.merge(graphdef, codec.unflatten(params), step_rngs(rest, jnp.zeros((), jnp.int32)))
        length = tokens_BxL.shape[1]
        x = jnp.take(model.embed[...], tokens_BxL, axis=0).astype(dtype)
        keys_S = jnp.arange(max_len)
        mask_LxS = keys_S[None, :] <= (start + jnp.arange(length))[:, None]
        ks, vs = [], []
        for i, block in enumerate(model.blocks):
            attn = block.attn
            h = block.attn_norm(x)
            q = rotary(jnp.einsum("bld,dnh->blnh", h, attn.wq[...].astype(dtype)), attn.rope_theta, start)
            k = rotary(jnp.einsum("bld,dkh->blkh", h, attn.wk[...].astype(dtype)), attn.rope_theta, start)
            v = jnp.einsum("bld,dkh->blkh", h, attn.wv[...].astype(dtype))
            k_all = jax.lax.dynamic_update_slice(cache["k"][i], k, (0, start, 0, 0))
            v_all = jax.lax.dynamic_update_slice(cache["v"][i], v, (0, start, 0, 0))
            ks.append(k_all)
            vs.append(v_all)
            o = jax.nn.dot_product_attention(q, k_all, v_all, mask=mask_LxS[None, None])
            x = x + jnp.einsum("blnh,nhd->bld", o, attn.wo[...].astype(dtype))
            hf = block.ffn_norm(x)
            y = block.ffn(hf, train=False)[0] if block.is_moe else block.ffn(hf)
            x = x + y.astype(x.dtype)
        x = model.final_norm(x[:, -1:])
        w = model.embed[...].T * (model.embed.shape[-1] ** -0.5) if model.head is None else model.head[...]
        logits = jnp.einsum("bld,dv->blv", x, w.astype(dtype), preferred_element_type=jnp.float32)[:, 0]
        return logits, {"k": jnp.stack(ks), "v": jnp.stack(vs)}

    return forward, empty


def pick(logits_BxV, key, temperature: float, top_k: int):
    """The next token: greedy at temperature 0, else sampled from the (top-k) softmax at `temperature`."""
    import jax
    import jax.numpy as jnp

    if temperature <= 0:
        return jnp.argmax(logits_BxV, axis=-1)
    logits = logits_BxV / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1)


def generate(trainer, params, prompt: list[int], tokens: int, *, temperature: float, top_k: int,
             seed: int) -> tuple[list[int], float]:
    """(the `tokens` new ids, tokens per second after the first one)."""
    import functools

    import jax
    import jax.numpy as jnp

    max_len = len(prompt) + tokens
    forward, cache = make_decoder(trainer, 1, max_len)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(params, cache, tokens_BxL, start, key):
        logits, cache = forward(params, cache, tokens_BxL, start)
        return pick(logits, key, temperature, top_k).astype(jnp.int32), cache

    key = jax.random.key(seed)
    key, sub = jax.random.split(key)
    token, cache = step(params, cache, jnp.asarray([prompt], jnp.int32), 0, sub)
    out = [int(token[0])]
    started = time.perf_counter()
    for position in range(len(prompt), max_len - 1):
        key, sub = jax.random.split(key)
        token, cache = step(params, cache, token[:, None], position, sub)
        out.append(int(token[0]))
    seconds = time.perf_counter() - started
    return out, (len(out) - 1) / seconds if seconds > 0 and len(out) > 1 else float("nan")


@click.command("sample", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--checkpoint", "directory", required=True, metavar="DIR",
              help="A run's output directory (or the checkpoints directory in it), local or gs://.")
@click.option("--prompt", required=True, help="The text to continue (token ids separated by spaces for data "
                                              "without a tokenizer).")
@click.option("--tokens", type=click.IntRange(min=1), default=64, show_default=True, help="How many tokens to add.")
@click.option("--temperature", type=click.FloatRange(min=0), default=1.0, show_default=True, help="0: greedy.")
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0: the whole vocabulary.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--tokenizer", "tokenizer_path", default=None, metavar="FILE",
              help="A tokenizer.json [the run's dataset's].")
def sample_command(directory, prompt, tokens, temperature, top_k, seed, tokenizer_path):
    """Continue a prompt with the latest checkpoint of a training run.

    \b
    Examples:
      python -m trainer.sample --checkpoint runs/demo --prompt "The cat" --tokens 40
      python -m trainer.sample --checkpoint gs://BUCKET/runs/demo --prompt "The" --temperature 0.7 --top-k 40
    """
    checkpoints, config_path = locate(directory)
    cfg = load_run_config(config_path)
    codec = Codec(cfg, tokenizer_path)
    ids = codec.encode(prompt)
    if not ids:
        raise SampleError("--prompt: the prompt has no tokens")
    if max(ids) >= cfg.model.vocab_size or min(ids) < 0:
        raise SampleError(f"--prompt: token id {max(ids)} is outside the model's vocabulary "
                          f"(model.vocab_size={cfg.model.vocab_size})")
    trainer, params, step = restore_params(cfg, checkpoints)
    out, rate = generate(trainer, params, ids, tokens, temperature=temperature, top_k=top_k, seed=seed)
    click.echo(codec.decode(out))
    click.echo(f"{len(out)} tokens from the checkpoint at step {step} ({cfg.name}), {rate:,.0f} tokens/s",
               err=True)


def main(args: list[str] | None = None, prog_name: str | None = None) -> None:
    sample_command.main(args=args, prog_name=prog_name or "python -m trainer.sample")


if __name__ == "__main__":
    main(sys.argv[1:])
