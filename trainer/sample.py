"""`python -m trainer.sample` / `moe-tpu sample`: continue a prompt with a trained checkpoint.

Loads the latest checkpoint of a run (its output directory, or the checkpoints directory in it) with the
config the trainer saved beside it (`config.json`), its parameters only, and decodes through the serving
engine (trainer/serve/engine.py, one slot): the prompt prefilled, then one token per step, each attending to
the cached keys and values of all the tokens before it. MoE layers are dropless, as in serving.
Text goes through the dataset's tokenizer (a prepared dataset's `tokenizer.json`), bytes for byte-level
text, and token ids written as numbers otherwise. Prints the continuation on stdout, exactly (no newline of
its own: the line is ended on stderr), or with --output json the prompt's and the new ids with the text, and
the speed on stderr. As the server does, it stops at the end-of-document token and keeps the prompt whole up
to the model's context (trainer/run_loader.py context_of; a longer prompt's last tokens are continued), and
`--weights int8|int4|mxfp4` stores the weights as `serve --weights` does.

Every limit is checked before anything is allocated: the prompt and --tokens against the positions and
the memory the key/value cache needs, --top-k against the vocabulary, the temperature finite, the prompt's
ids inside the vocabulary, a --tokenizer the one the run's dataset was prepared with (or --any-tokenizer).

Exit codes: 0 sampled; 2 a usage error (no checkpoint, no config, a prompt the tokenizer cannot read, a
limit above).
"""

from __future__ import annotations

import json
import sys

import click

from trainer.config import MAX_SEED
from trainer.run_loader import Codec, RunError, context_of, end_of_document, find_run, load_run_config
from trainer.serve.memory import QUANTIZED_WEIGHTS

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


def check_memory(model, prompt: int, tokens: int, quantized: str | None = None) -> None:
    """The weights and the key/value cache of `prompt + tokens` positions must fit the device (the host's
    memory on CPU, where the device reports none), checked before either is allocated."""
    import jax

    from trainer.serve.memory import HEADROOM, device_memory, host_memory, memory_plan

    device = jax.devices()[0]
    limit = device_memory(device) or (host_memory() if device.platform == "cpu" else None)
    plan = memory_plan(model, 1, prompt + tokens, jax.numpy.dtype(model.cfg.dtype), quantized)
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


def restore_params(cfg, checkpoints: str, prompt: int, tokens: int, quantized: str | None = None):
    """(the serving model on one device, its weights, the step) from the latest checkpoint in
    `checkpoints`: the parameters only, not the optimizer state, stored as `serve --weights QUANTIZED` stores
    them; refused before reading if the weights and the cache of `prompt + tokens` positions do not fit."""
    import jax

    from trainer import sharding
    from trainer.serve.weights import build_serving_model, restore_weights

    mesh = sharding.make_mesh({"data": 1, "expert": 1}, jax.devices()[:1])
    try:
        model = build_serving_model(cfg, mesh)
        check_memory(model, prompt, tokens, quantized)
        weights, step = restore_weights(model, checkpoints, quantized)  # as `serve --weights` reads them
    except ValueError as e:  # a WeightsError, or --weights mxfp4 on experts not in whole blocks of 32
        raise SampleError(str(e)) from None
    return model, weights, step


def generate(model, weights, prompt: list[int], tokens: int, *, temperature: float, top_k: int,
             seed: int, eos_id: int | None = None, stop_ids: tuple[int, ...] = ()) -> tuple[list[int], float]:
    """(the new ids, at most `tokens`, the last one `eos_id` (or one of `stop_ids`) where generation stopped at
    it, as the server's do; tokens per second after the first one), through the serving engine with one slot:
    the prompt prefilled, then one token per step through the key/value cache."""
    from trainer.serve.engine import Engine, Request, SamplingParams

    chunk = min(len(prompt), 256)
    # One span, the whole length: one slot's shorter reads save little, and each span is a compilation.
    engine = Engine(model, weights, slots=1, max_len=len(prompt) + tokens, chunk=chunk,
                    min_span=len(prompt) + tokens, eos_id=eos_id, stop_ids=stop_ids)
    engine.warm_up(every_span=True)  # compiled before the first token, so that the rate counts decoding only
    request = engine.submit(Request(prompt, SamplingParams(max_tokens=tokens, temperature=temperature,
                                                           top_k=top_k, seed=seed)))
    engine.run()
    out, times = request.output, request.token_times
    seconds = times[-1] - times[0]
    return out, (len(out) - 1) / seconds if seconds > 0 and len(out) > 1 else float("nan")


@click.command("sample", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--checkpoint", "directory", required=True, metavar="DIR",
              help="A run's output directory (or the checkpoints directory in it), local or gs://, or a "
                   "Hugging Face checkpoint's directory (imported once into a cache).")
@click.option("--prompt", required=True, help="The text to continue (token ids separated by spaces for data "
                                              "without a tokenizer).")
@click.option("--tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="How many tokens to add (fewer where the model ends its text, as the server stops).")
@click.option("--temperature", type=click.FloatRange(min=0), default=1.0, show_default=True, help="0: greedy.")
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0: the whole vocabulary.")
@click.option("--seed", type=click.IntRange(0, MAX_SEED), default=0, show_default=True,
              help=f"The sampling's seed, 0 to {MAX_SEED}.")
@click.option("--weights", "weight_format", type=click.Choice(["auto", *QUANTIZED_WEIGHTS]), default="auto",
              show_default=True, help="int8, int4 or mxfp4: the weights quantized as `serve --weights` quantizes "
                                      "them, so that greedy tokens are those of a deployment with the same --weights.")
@click.option("--output", "output_format", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="text: the continuation on stdout, exactly (no newline added); json: one object with the "
                   "prompt's and the new token ids, the text and why it ended.")
@click.option("--tokenizer", "tokenizer_path", default=None, metavar="FILE",
              help="A tokenizer.json [the run's dataset's].")
@click.option("--any-tokenizer", is_flag=True,
              help="Use --tokenizer even if the run's dataset was prepared with another (its ids mean other text).")
def sample_command(directory, prompt, tokens, temperature, top_k, seed, weight_format, output_format, tokenizer_path,
                   any_tokenizer):
    """Continue a prompt with the latest checkpoint of a training run.

    \b
    Examples:
      python -m trainer.sample --checkpoint runs/demo --prompt "The cat" --tokens 40
      python -m trainer.sample --checkpoint gs://BUCKET/runs/demo --prompt "The" --temperature 0.7 --top-k 40
      python -m trainer.sample --checkpoint runs/demo --prompt "The" --temperature 0 --weights int4 --output json
    """
    run = find_run(directory)
    cfg = load_run_config(run.config)
    from trainer.sidefiles import stop_token_ids, tokenizer_file  # the model's own (an import, a fine-tune of one)

    codec = Codec(cfg, tokenizer_path or tokenizer_file(run), any_tokenizer, checkpoints=run.checkpoints)
    ids = codec.encode(prompt)
    if not ids:
        raise SampleError("--prompt: the prompt has no tokens")
    check_request(cfg, ids, tokens, temperature, top_k)
    ids = _within_context(cfg, run, ids)
    quantized = None if weight_format == "auto" else weight_format
    model, weights, step = restore_params(cfg, run.checkpoints, len(ids), tokens, quantized)
    eos_id, _ = end_of_document(cfg, codec, run)  # where the server stops, this stops
    stop_ids = stop_token_ids(run, codec.tokenizer)
    out, rate = generate(model, weights, ids, tokens, temperature=temperature, top_k=top_k, seed=seed, eos_id=eos_id,
                         stop_ids=stop_ids)
    stopped = bool(out) and (out[-1] == eos_id or out[-1] in stop_ids)
    text = codec.decode(out[:-1] if stopped else out)
    if output_format == "json":
        click.echo(json.dumps({"model": cfg.name, "step": step, "weights": weight_format, "prompt_ids": ids,
                               "ids": out, "text": text, "finish_reason": "stop" if stopped else "length"}))
    else:  # the text alone: a newline after it would read as one the model wrote (stderr ends the line)
        click.echo(text, nl=False)
    ended = f", ended by the end token {out[-1]}" if stopped else ""
    line_end = "\n" if output_format == "text" and text and not text.endswith("\n") else ""
    stored = f", {quantized} weights" if quantized else ""
    click.echo(f"{line_end}{len(out)} tokens from the checkpoint at step {step} ({cfg.name}{stored}){ended}, "
               f"{rate:,.0f} tokens/s", err=True)


def _within_context(cfg, run, ids: list[int]) -> list[int]:
    """The prompt's last tokens that the model's context holds (run_loader.context_of, which `serve` reads too),
    saying so when that cuts it: positions past it mean nothing to the model, and their prefill grows with
    their square."""
    context, what = context_of(cfg, run)
    if len(ids) <= context:
        return ids
    click.echo(f"--prompt: its {len(ids):,} tokens exceed the model's context ({what}): its last {context} are "
               "continued", err=True)
    return ids[-context:]


def main(args: list[str] | None = None, prog_name: str | None = None) -> None:
    sample_command.main(args=args, prog_name=prog_name or "python -m trainer.sample")


if __name__ == "__main__":
    main(sys.argv[1:])

