"""`python -m trainer.sample` / `moe-tpu sample`: continue a prompt with a trained checkpoint.

Loads the latest checkpoint of a run (its output directory, or the checkpoints directory in it) with the
config the trainer saved beside it (`config.json`), its parameters only, and decodes through the serving
engine (trainer/serve/engine.py, one slot): the prompt prefilled, then one token per step, each attending to
the cached keys and values of all the tokens before it. MoE layers are dropless, as in serving.
Text goes through the dataset's tokenizer (a prepared dataset's `tokenizer.json`), bytes for byte-level
text, and token ids written as numbers otherwise. Prints the continuation on stdout and the speed on stderr.

Exit codes: 0 sampled; 2 a usage error (no checkpoint, no config, a prompt the tokenizer cannot read).
"""

from __future__ import annotations

import json
import os
import sys

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
    """(the serving model on one device, its weights, the step) from the latest checkpoint in
    `checkpoints`: the parameters only, not the optimizer state."""
    import jax

    from trainer import sharding
    from trainer.serve.weights import WeightsError, build_serving_model, restore_weights

    mesh = sharding.make_mesh({"data": 1, "expert": 1}, jax.devices()[:1])
    try:
        model = build_serving_model(cfg, mesh)
        weights, step = restore_weights(model, checkpoints)
    except WeightsError as e:
        raise SampleError(str(e)) from None
    return model, weights, step


def generate(model, weights, prompt: list[int], tokens: int, *, temperature: float, top_k: int,
             seed: int) -> tuple[list[int], float]:
    """(the `tokens` new ids, tokens per second after the first one), through the serving engine with
    one slot: the prompt prefilled, then one token per step through the key/value cache."""
    from trainer.serve.engine import Engine, Request, SamplingParams

    chunk = min(len(prompt), 256)
    engine = Engine(model, weights, slots=1, max_len=len(prompt) + tokens, chunk=chunk)
    engine.warm_up()  # compiled before the first token, so that the rate counts decoding only
    request = engine.submit(Request(prompt, SamplingParams(max_tokens=tokens, temperature=temperature,
                                                           top_k=top_k, seed=seed)))
    engine.run()
    out, times = request.output, request.token_times
    seconds = times[-1] - times[0]
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
    model, weights, step = restore_params(cfg, checkpoints)
    out, rate = generate(model, weights, ids, tokens, temperature=temperature, top_k=top_k, seed=seed)
    click.echo(codec.decode(out))
    click.echo(f"{len(out)} tokens from the checkpoint at step {step} ({cfg.name}), {rate:,.0f} tokens/s",
               err=True)


def main(args: list[str] | None = None, prog_name: str | None = None) -> None:
    sample_command.main(args=args, prog_name=prog_name or "python -m trainer.sample")


if __name__ == "__main__":
    main(sys.argv[1:])
