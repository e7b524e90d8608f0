"""`python -m trainer.sample` / `moe-tpu sample`: continue a prompt with a trained checkpoint.

Loads the latest checkpoint of a run (its output directory, or the checkpoints directory in it) with the
config the trainer saved beside it (`config.json`), its parameters only, and decodes through the serving
engine (trainer/serve/engine.py, one slot): the prompt prefilled, then one token per step, each attending to
the cached keys and values of all the tokens before it. MoE layers are dropless, as in serving.
Text goes through the dataset's tokenizer (a prepared dataset's `tokenizer.json`), bytes for byte-level
text, and token ids written as numbers otherwise. Prints the continuation on stdout and the speed on stderr.

Every limit is checked before anything is allocated: the prompt and --tokens against the positions and
the memory the key/value cache needs, --top-k against the vocabulary, the temperature finite, the prompt's
ids inside the vocabulary, a --tokenizer the one the run's dataset was prepared with (or --any-tokenizer).

Exit codes: 0 sampled; 2 a usage error (no checkpoint, no config, a prompt the tokenizer cannot read, a
limit above).
"""

from __future__ import annotations

import sys

import click

from trainer.config import MAX_SEED
from trainer.run_loader import Codec, RunError, find_run, load_run_config

# Positions are int32 in the engine's decode step.
MAX_CONTEXT = 2**31 - 1


class SampleError(RunError):
    """A request `sample` refuses (exit 2), naming the option."""


def check_request(cfg, ids: list[int], tokens: int, temperature: float, top_k: int) -> None:
    """Refuse (exit 2, naming the flag and value) what the model cannot take, before anything is built."""
    import math

    if not math.isfinite(temperature):
        raise SampleError(f"--temperature {temperature}: give a finite number >= 0 (0: greedy)")
    vocab = cfg.model.vocab_size
    if top_k > vocab:
        raise SampleError(f"--top-k {top_k} exceeds the model's vocabulary (model.vocab_size={vocab}); "
                          "0 samples from the whole vocabulary")
    culprit = next((i for i in ids if not 0 <= i < vocab), None)
    if culprit is not None:
        raise SampleError(f"--prompt: token id {culprit} is outside the model's vocabulary [0, {vocab})")
    if len(ids) + tokens > MAX_CONTEXT:
        raise SampleError(f"--tokens {tokens}: the prompt's {len(ids)} tokens plus {tokens} exceed the longest "
                          f"context a sample can hold ({MAX_CONTEXT:,} positions)")


def check_memory(model, prompt: int, tokens: int) -> None:
    """The weights and the key/value cache of `prompt + tokens` positions must fit the device (the host's
    memory on CPU, where the device reports none), checked before either is allocated."""
    import jax

    from trainer.serve.memory import HEADROOM, device_memory, host_memory, memory_plan

    device = jax.devices()[0]
    limit = device_memory(device) or (host_memory() if device.platform == "cpu" else None)
    plan = memory_plan(model, 1, prompt + tokens, jax.numpy.dtype(model.cfg.dtype), False)
    need = plan["weights"] + plan["kv_cache"]
    if limit is not None and need > limit * (1 - HEADROOM):
        gib = lambda n: f"{n / 2**30:,.2f} GiB"  # noqa: E731
        if plan["weights"] > limit * (1 - HEADROOM):  # no --tokens would do: the model itself is too large
            m = model.cfg.model
            raise SampleError(f"the run's model ({model.cfg.name}: model.vocab_size={m.vocab_size:,}, d_model="
                              f"{m.d_model:,}, {m.num_layers} layers) needs {gib(plan['weights'])} of weights, more "
                              f"than the {gib(limit * (1 - HEADROOM))} the {device.platform} device can hold: "
                              "is its config.json the one the trainer wrote?")
        raise SampleError(f"--tokens {tokens}: the prompt's {prompt} tokens plus {tokens} need a key/value cache "
                          f"of {gib(plan['kv_cache'])} beside {gib(plan['weights'])} of weights, more than the "
                          f"{gib(limit * (1 - HEADROOM))} the {device.platform} device can hold; ask for fewer")


def restore_params(cfg, checkpoints: str, prompt: int, tokens: int):
    """(the serving model on one device, its weights, the step) from the latest checkpoint in
    `checkpoints`: the parameters only, not the optimizer state; refused before reading if the weights and
    the cache of `prompt + tokens` positions do not fit."""
    import jax

    from trainer import sharding
    from trainer.serve.weights import WeightsError, build_serving_model, restore_weights

    mesh = sharding.make_mesh({"data": 1, "expert": 1}, jax.devices()[:1])
    try:
        model = build_serving_model(cfg, mesh)
        check_memory(model, prompt, tokens)
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
    # One span, the whole length: one slot's shorter reads save little, and each span is a compilation.
    engine = Engine(model, weights, slots=1, max_len=len(prompt) + tokens, chunk=chunk,
                    min_span=len(prompt) + tokens)
    engine.warm_up(every_span=True)  # compiled before the first token, so that the rate counts decoding only
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
@click.option("--seed", type=click.IntRange(0, MAX_SEED), default=0, show_default=True,
              help=f"The sampling's seed, 0 to {MAX_SEED}.")
@click.option("--tokenizer", "tokenizer_path", default=None, metavar="FILE",
              help="A tokenizer.json [the run's dataset's].")
@click.option("--any-tokenizer", is_flag=True,
              help="Use --tokenizer even if the run's dataset was prepared with another (its ids mean other text).")
def sample_command(directory, prompt, tokens, temperature, top_k, seed, tokenizer_path, any_tokenizer):
    """Continue a prompt with the latest checkpoint of a training run.

    \b
    Examples:
      python -m trainer.sample --checkpoint runs/demo --prompt "The cat" --tokens 40
      python -m trainer.sample --checkpoint gs://BUCKET/runs/demo --prompt "The" --temperature 0.7 --top-k 40
    """
    run = find_run(directory)
    cfg = load_run_config(run.config)
    from trainer.hf.orbax_io import imported_tokenizer  # an imported Hugging Face model's own

    codec = Codec(cfg, tokenizer_path or imported_tokenizer(run), any_tokenizer, checkpoints=run.checkpoints)
    ids = codec.encode(prompt)
    if not ids:
        raise SampleError("--prompt: the prompt has no tokens")
    check_request(cfg, ids, tokens, temperature, top_k)
    ids = _within_context(cfg, ids)
    model, weights, step = restore_params(cfg, run.checkpoints, len(ids), tokens)
    out, rate = generate(model, weights, ids, tokens, temperature=temperature, top_k=top_k, seed=seed)
    click.echo(codec.decode(out))
    click.echo(f"{len(out)} tokens from the checkpoint at step {step} ({cfg.name}), {rate:,.0f} tokens/s",
               err=True)


def _within_context(cfg, ids: list[int]) -> list[int]:
    """The prompt's last data.seq_len tokens (the context the model was trained on), saying so when that
    cuts it: positions past it mean nothing to the model, and their prefill grows with their square."""
    context = cfg.data.seq_len
    if len(ids) <= context:
        return ids
    click.echo(f"--prompt: its {len(ids):,} tokens exceed the model's context (data.seq_len={context}, the length "
               f"it was trained on): its last {context} are continued", err=True)
    return ids[-context:]


def main(args: list[str] | None = None, prog_name: str | None = None) -> None:
    sample_command.main(args=args, prog_name=prog_name or "python -m trainer.sample")


if __name__ == "__main__":
    main(sys.argv[1:])

