"""`moe-tpu hf import|export` (also `python -m trainer.hf`): Hugging Face checkpoints in and out.

Exit codes: 0 converted; 1 the output could not be written (a full disk); 2 bad input (the file and the
key named; nothing left in -o); 130 / 143 when interrupted (what was half-written is removed).
"""

from __future__ import annotations

import sys

import click

from trainer.status import EXIT_USAGE

MB = 10**6


@click.group("hf")
def hf_group() -> None:
    """Hugging Face checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3, GPT-OSS): import and export."""


@hf_group.command("import")
@click.argument("source")
@click.option("-o", "--output", required=True, type=click.Path(), help="New directory for the trainer checkpoint.")
@click.option("--seq-len", type=click.IntRange(min=2), default=None,
              help="The run's context (data.seq_len), at most the model's [its max_position_embeddings].")
def import_command(source: str, output: str, seq_len: int | None) -> None:
    """Convert the Hugging Face checkpoint in SOURCE (a directory or gs:// prefix with config.json,
    *.safetensors, the tokenizer) into a trainer checkpoint that `sample`, `serve` and `--init-from` read.
    Its config.json names no data: a fine-tune from it gives --set data.source=records --set data.path=DIR.

    \b
    Examples:
      moe-tpu hf import ./Qwen3-30B-A3B -o runs/qwen3
      moe-tpu hf import gs://BUCKET/models/OLMoE-1B-7B -o runs/olmoe --seq-len 4096
    """
    from trainer.hf.convert import import_checkpoint

    done = import_checkpoint(source, output, seq_len)
    click.echo(f"imported {done['family']} ({done['dtype']}, experts {' and '.join(done['layouts'])}, context "
               f"{done['seq_len']:,} tokens) into {done['output']}")
    if done["skipped"]:
        click.echo(f"note: skipped {len(done['skipped'])} tensors of the multi-token-prediction layer "
                   f"({done['skipped'][0]}, ...), which the model does not use")


@hf_group.command("export")
@click.option("--checkpoint", "run", required=True, type=click.Path(), help="A run's output directory, or an import.")
@click.option("--step", type=click.IntRange(min=0), default=None, help="The step to export (default: the latest).")
@click.option("-o", "--output", required=True, type=click.Path(), help="New directory for the Hugging Face files.")
@click.option("--max-shard-mb", type=click.IntRange(min=1), default=5000, show_default=True,
              help="Largest safetensors shard, in MB.")
def export_command(run: str, step: int | None, output: str, max_shard_mb: int) -> None:
    """Write a trainer checkpoint as Hugging Face files: config.json with the Hub's keys, safetensors shards
    and their index, generation_config.json and the tokenizer: an imported (or fine-tuned import's) model's
    own files, else the run's dataset's tokenizer.json with a tokenizer_config.json.

    \b
    Examples:
      moe-tpu hf export --checkpoint runs/qwen3-finetune -o exported/qwen3
    """
    from trainer.hf.convert import export_checkpoint

    done = export_checkpoint(run, output, step, max_shard_mb * MB)
    click.echo(f"exported step {done['step']} as {done['family']} ({done['shards']} shards"
               f"{'' if done['tokenizer'] else ', no tokenizer'}) into {done['output']}")
    if done["note"]:
        click.echo(f"note: no tokenizer: {done['note']}")


def main(args: list[str] | None = None, prog_name: str | None = None) -> None:
    from trainer import signals
    from trainer.hf.errors import HFError, WriteError

    try:
        # Ctrl-C, SIGTERM and SIGHUP are recorded and acted on between two tensors (trainer/signals.py): a
        # handler that raised could be swallowed wherever the main thread was; the half-written output is
        # removed on the way out (convert.staged).
        with signals.latch():
            hf_group.main(args=args, prog_name=prog_name or "python -m trainer.hf", standalone_mode=False)
    except HFError as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(EXIT_USAGE)
    except WriteError as e:  # the output could not be written: a runtime failure, nothing left of it
        click.echo(f"Error: {e}", err=True)
        sys.exit(1)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt):
        click.echo("interrupted: nothing was written", err=True)
        sys.exit(130)
    except signals.Signalled as e:
        click.echo(f"stopped by {e.name}: nothing was written", err=True)
        sys.exit(e.exit_code)