"""`python -m trainer.serve.evaluate --checkpoint DIR --tasks T1,T2`: lm-evaluation-harness against the engine.

The checkpoint is served on 127.0.0.1 (the same engine and OpenAI-compatible server as `python -m
trainer.serve`), and lm-evaluation-harness's `local-completions` model evaluates it through the server's
completions (log-probabilities with `echo`, for loglikelihood tasks) and its tokenizer routes (`/tokenize`,
so the harness downloads no tokenizer). Tasks are the harness's registry names and tasks of YAML files in
`--include-path`. The results (lm-eval's results JSON) are written to `--output`, by default
`<run>/eval/results.json` beside the run's checkpoints, and its table is printed.

`moe-tpu eval --endpoint` evaluates the run's deployed model instead, through the platform's prediction API
(`main`'s `forward`; trainer.serve.relay carries lm-eval's requests to it), into `<run>/eval/endpoint-results.json`.

Exit codes: 0 evaluated; 2 a usage error (a flag, the checkpoint, an unknown task, lm-eval not installed);
1 a runtime failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time

import click

from trainer.serve.startup import ServeError


@contextlib.contextmanager
def served(state, host: str = "127.0.0.1"):
    """The server for `state` (its engine loop started) on a free port of `host`, in a thread: yields its
    completions URL; stops it on exit."""
    import uvicorn

    from trainer.serve.server import create_app

    server = uvicorn.Server(uvicorn.Config(create_app(state), host=host, port=0, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, name="moe-tpu-eval-server", daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise ServeError(f"the evaluation's server could not listen on {host}")
            time.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://{host}:{port}/v1/completions"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def task_manager(tasks: list[str], include_path: str | None):
    """lm-eval's TaskManager that knows every one of `tasks`, else a ServeError naming those it lacks."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise ServeError("evaluating needs lm-evaluation-harness, which is not installed: "
                         "pip install 'moe-tpu[eval]'") from None
    # The registry's index takes some 10 s to build: tasks all in --include-path are looked up there alone.
    manager = TaskManager(include_path=include_path, include_defaults=False) if include_path else None
    if manager is None or any(not manager.match_tasks([t]) for t in tasks):
        manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        where = f" nor in --include-path {include_path}" if include_path else ""
        raise ServeError(f"--tasks: {', '.join(unknown)}: no task of lm-evaluation-harness's registry{where}")
    return manager


def harness(url: str, model: str, max_len: int, tasks: list[str], manager, *, limit, batch_size: int,
            num_fewshot: int | None) -> dict:
    """lm-eval's simple_evaluate of `tasks` with its local-completions model on the server at `url`."""
    import lm_eval

    model_args = {"model": model, "base_url": url, "tokenizer_backend": "remote", "tokenized_requests": True,
                  "max_length": max_len, "max_retries": 1}
    return lm_eval.simple_evaluate(model="local-completions", model_args=model_args, tasks=tasks,
                                   task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                                   log_samples=True, batch_size=batch_size)


def _limit(text: str | None):
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        raise ServeError(f"--limit {text!r}: give a number of examples per task (or a fraction below 1)") from None
    if not value > 0:
        raise ServeError(f"--limit {text}: must be above 0")
    return value if value < 1 else int(value)


@click.command("eval", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--checkpoint", "directory", required=True, metavar="DIR", help="A run's output directory.")
@click.option("--tasks", required=True, help="Comma-separated lm-eval task names.")
@click.option("--include-path", type=click.Path(exists=True, file_okay=False), default=None,
              help="A directory of task YAML files of your own.")
@click.option("--limit", default=None, help="At most this many examples per task (below 1: a fraction).")
@click.option("--num-fewshot", type=click.IntRange(min=0), default=None)
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True,
              help="Prompts per request (and decode slots).")
@click.option("--max-len", type=click.IntRange(min=2, max=2**31 - 2), default=1024, show_default=True)
@click.option("--output", default=None, metavar="FILE", help="[<run>/eval/results.json]")
@click.option("--tokenizer", "tokenizer_path", default=None, metavar="FILE")
@click.option("--devices", type=click.IntRange(min=1), default=None, help="CPU only: N fake XLA devices.")
@click.pass_obj
def eval_command(forward, directory, tasks, include_path, limit, num_fewshot, batch_size, max_len, output,
                 tokenizer_path, devices):
    """Evaluate a run's latest checkpoint with lm-evaluation-harness, through the serving engine.

    \b
    Examples:
      python -m trainer.serve.evaluate --checkpoint runs/demo --tasks hellaswag --limit 100
      python -m trainer.serve.evaluate --checkpoint runs/demo --tasks my_task --include-path tasks/
    """
    if devices is not None:
        from trainer.cli import set_fake_devices

        set_fake_devices(devices)
    names, count = [t.strip() for t in tasks.split(",") if t.strip()], _limit(limit)
    if not names:
        raise ServeError(f"--tasks {tasks!r}: name at least one task")
    manager = task_manager(names, include_path)  # before minutes of loading
    options = {"limit": count, "batch_size": batch_size, "num_fewshot": num_fewshot}
    if forward is not None:
        results = through_endpoint(forward, directory, tokenizer_path, max_len, names, manager, **options)
    else:
        results = through_engine(directory, tokenizer_path, max_len, names, manager, **options)
    path = output or os.path.join(str(directory).rstrip("/"), "eval", "endpoint-results.json" if forward is not None
                                  else "results.json")
    write_results(results, path)
    from lm_eval.utils import make_table

    click.echo(make_table(results))
    click.echo(f"eval: results written to {path}", err=True)


def through_engine(directory, tokenizer_path, max_len: int, names: list[str], manager, **options) -> dict:
    """The harness against the run's latest checkpoint, served here by the engine on 127.0.0.1."""
    from trainer.serve.loop import EngineLoop
    from trainer.serve.server import ServerState
    from trainer.serve.startup import load

    batch_size = options["batch_size"]
    loaded = load(directory, tokenizer_path=tokenizer_path, mesh_text=None, slots=batch_size, max_len=max_len,
                  chunk=min(64, max_len), kv_dtype=None, quantized=None, device_memory_gb=None,
                  progress=lambda m: click.echo(f"eval: {m}", err=True))
    loaded.engine.warm_up()
    state = ServerState(loaded.cfg.name, encode=loaded.encode, decode=loaded.decode, max_waiting=max(batch_size, 8),
                        eos_token=loaded.eos_token, tokenizer_class=loaded.tokenizer_class)
    state.loop = EngineLoop(loaded.engine).start()
    try:
        with served(state) as url:
            return harness(url, state.model_name, max_len, names, manager, **options)
    finally:
        state.loop.stop()


def through_endpoint(forward, directory, tokenizer_path, max_len: int, names: list[str], manager, **options) -> dict:
    """The harness against the deployed model that `forward` (a completions body -> its answer) reaches through
    the platform's prediction API, by a relay on 127.0.0.1 (trainer.serve.relay says why a relay); the run in
    `directory` gives the tokenizer the endpoint's server loaded. One request first, so that an endpoint that is
    not there fails with the platform's words before the harness starts."""
    from trainer.serve.relay import Relay, relayed, run_tokenizer

    relay = Relay(forward, run_tokenizer(directory, tokenizer_path, max_len))
    forward({"prompt": [0], "max_tokens": 1, "temperature": 0.0, "stream": False})
    click.echo("eval: the endpoint answers; evaluating through it", err=True)
    with relayed(relay) as url:
        try:
            results = harness(url, relay.tokenizer.model_name, max_len, names, manager, **options)
        except Exception:
            if relay.error is not None:  # the platform's refusal, not lm-eval's report of a 502
                raise relay.error from None
            raise
    if relay.error is not None:
        raise relay.error
    return results


def write_results(results: dict, path: str) -> None:
    from etils import epath
    from lm_eval.utils import handle_non_serializable

    target = epath.Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(results, indent=2, default=handle_non_serializable))


def main(args: list[str] | None = None, prog_name: str = "python -m trainer.serve.evaluate", forward=None) -> None:
    """The command; `forward` (a completions body -> its answer's JSON) evaluates a deployed model through it
    rather than the checkpoint through a local engine (`moe-tpu eval --endpoint`), the checkpoint then naming
    the run whose tokenizer the endpoint's server loaded."""
    eval_command.main(args=args, prog_name=prog_name, obj=forward)


if __name__ == "__main__":
    main(sys.argv[1:])
