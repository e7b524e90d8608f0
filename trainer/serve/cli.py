"""`python -m trainer.serve --checkpoint DIR` (the serving container's entry point) and `moe-tpu serve`.

Reads the run's config and the latest checkpoint's parameters (not its optimizer state), checks that the
weights and the KV cache fit the device memory, starts the HTTP server (trainer/serve/server.py; /health
answers 503 meanwhile), compiles the engine's two steps and prints the URL once it serves. SIGTERM stops
admitting requests, lets those in flight finish within --grace-seconds, and exits 0.

Exit codes: 0 stopped by a signal; 2 a usage error (a bad flag, no checkpoint, a checkpoint of another
model, a shape that does not fit the device memory); 1 a runtime failure.
"""

from __future__ import annotations

import errno
import json
import math
import os
import signal
import socket
import sys

import click

from trainer.serve.http_serve import EXIT_RUNTIME, compile_ahead_thread, exit_past_threads, progress, serve_http
from trainer.serve.loop import STEP_TIMEOUT_S
from trainer.serve.memory import QUANTIZED_WEIGHTS
from trainer.serve.spans import DEFAULT_CHUNK, DEFAULT_WARM_UP, WARM_UPS
from trainer.serve.startup import ServeError, load
from trainer.serve.stopping import Stop, Stopped
from trainer.serve.streams import STREAM_INTERVAL

# Positions are int32 in the steps, and an idle slot sits at position max_len, drawing at max_len + 1.
POSITIONS_MAX = 2**31 - 2


def _default_port() -> int:
    """Vertex AI tells a custom container its port in AIP_HTTP_PORT."""
    text = os.environ.get("AIP_HTTP_PORT", "8000")
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ServeError(f"AIP_HTTP_PORT={text!r} is not a port number")
    return int(text)


def _chat_template(path: str | None) -> dict | None:
    if path is None:
        return None
    from trainer.files import not_a_file

    kind = not_a_file(path)  # found without opening it: a FIFO would wait for a writer for ever
    if kind:
        raise ServeError(f"--chat-template {path} is {kind}, not a file")
    try:
        template = json.loads(open(path, encoding="utf-8").read())
    except (OSError, ValueError) as e:
        raise ServeError(f"--chat-template {path}: {e}") from None
    if not (isinstance(template, dict) and isinstance(template.get("message"), str)
            and isinstance(template.get("generation"), str)):
        raise ServeError(f'--chat-template {path}: want {{"message": "...{{role}}...{{content}}...", '
                         '"generation": "..."}')
    try:
        template["message"].format(role="user", content="x")
    except (KeyError, IndexError, ValueError) as e:
        raise ServeError(f"--chat-template {path}: 'message' may use {{role}} and {{content}} only ({e})") from None
    if "{content}" not in template["message"]:  # every message's text would be dropped from the prompt
        raise ServeError(f"--chat-template {path}: 'message' has no {{content}}, so the messages' text would never "
                         f"reach the model; got {template['message']!r}")
    return template


def _listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before anything is loaded: a port in use or a host that is not an address
    of this machine is refused at once (exit 2), not after minutes of reading weights."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise ServeError(f"--host {host!r} is not an address or a name this machine resolves ({e}); give an IP "
                         "address, e.g. 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ServeError(f"--port {port}: {host}:{port} is in use by another process; pick a free port with "
                             "--port") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise ServeError(f"--host {host}: not an address of this machine ({e.strerror}); give one of its "
                             "addresses, 127.0.0.1 or 0.0.0.0") from None
        if e.errno == errno.EACCES:
            raise ServeError(f"--port {port}: listening on it needs privileges ({e.strerror}); pick a port above "
                             "1023") from None
        raise ServeError(f"--host {host} --port {port}: cannot listen there: {e}") from None
    sock.set_inheritable(True)
    return sock


@click.command("serve", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--checkpoint", "directory", required=True, metavar="DIR",
              help="A run's output directory (or the checkpoints directory in it), local or gs://, or a "
                   "Hugging Face checkpoint's directory (imported once into a cache).")
@click.option("--host", default="127.0.0.1", show_default=True, help="The address to listen on (0.0.0.0: all).")
@click.option("--port", type=click.IntRange(1, 65535), default=None, help="[$AIP_HTTP_PORT or 8000]")
@click.option("--slots", type=click.IntRange(min=1), default=8, show_default=True, help="Requests decoded at once.")
@click.option("--max-len", type=click.IntRange(min=2, max=POSITIONS_MAX), default=1024, show_default=True,
              help="Prompt plus generated tokens per request (the KV cache's length).")
@click.option("--chunk", type=click.IntRange(min=1), default=DEFAULT_CHUNK, show_default=True,
              help="Prompt tokens prefilled per engine step, between decode steps.")
@click.option("--decode-steps", type=click.IntRange(min=1, max=64), default=1, show_default=True,
              help="Decode steps one program runs while a lone stream decodes and no request waits: the host's "
                   "work a step (dispatch, reading the tokens back) done once for them all, where it is longer "
                   "than the device's (one v5e chip, a 1B MoE: 1.09x the tokens/s in bfloat16, 1.27x in int8); "
                   "the stream's tokens then come in bursts of this many. E.g. --decode-steps 8.")
@click.option("--mixed-prefill", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="While requests decode, the admitted prompt's next chunk goes with their decode step in one "
                   "program, which reads the weights once for both: a long prompt then barely slows the streams "
                   "(off: in a program of its own between decode steps; one more program a span to compile). "
                   "auto: on an accelerator, off on a CPU.")
@click.option("--max-waiting", type=click.IntRange(min=1), default=64, show_default=True,
              help="Requests queued for a slot; beyond them 429 with Retry-After.")
@click.option("--enable-prefix-caching/--no-enable-prefix-caching", "prefix_caching", default=True, show_default=True,
              help="Prompts sharing a prefix with an earlier one copy its cached keys and values rather than "
                   "prefill it again.")
@click.option("--prefix-cache-tokens", type=click.IntRange(min=16), default=None,
              help="Tokens of prefixes the prefix cache keeps, in blocks of 16; the least recently used go first "
                   "[a quarter of the KV cache's slots x max-len].")
@click.option("--kv-cache-dtype", type=click.Choice(["auto", "bfloat16", "float32", "int8"]), default="auto",
              show_default=True, help="auto: the model's compute dtype.")
@click.option("--weights", "weight_format", type=click.Choice(["auto", *QUANTIZED_WEIGHTS]), default="auto",
              show_default=True,
              help="int8: per-channel symmetric int8 weights (about half of bfloat16); int4: symmetric, a scale "
                   "per group of 128 input values, two a byte (about 0.27x); mxfp4: the routed experts as FP4 "
                   "values with a power-of-two scale a block of 32 inputs (4.25 bits; an MXFP4 checkpoint's "
                   "experts exactly as the Hub holds them), every other weight as saved.")
@click.option("--mesh", "mesh_text", default=None, metavar="data=D,expert=E,model=T",
              help="model=T splits each expert and attention's heads T ways [as many devices on expert as "
                   "divide the experts]")
@click.option("--devices", type=click.IntRange(min=1), default=None, help="CPU only: N fake XLA devices.")
@click.option("--tokenizer", "tokenizer_path", default=None, metavar="FILE",
              help="A tokenizer.json [the run's dataset's].")
@click.option("--chat-template", "chat_template_path", default=None, metavar="FILE",
              help='JSON {"message": "{role}: {content}\\n", "generation": "assistant:"} [that one].')
@click.option("--model-name", default=None, help="The model's id in the API [the config's name].")
@click.option("--warm-up", "warm_up", type=click.Choice(WARM_UPS), default=DEFAULT_WARM_UP, show_default=True,
              help="What compiles before the server says it is ready (/health 200). background: a short "
                   "request's prefill and a lone stream's decode (the shortest span of the cache, one slot), then "
                   "every other span and slot count on a thread while it serves (a request reaching one still "
                   "compiling waits for it); all: every one first, so no request ever waits on a compilation (a "
                   "slower start); smallest: the first two alone, the others compiling when a step first needs "
                   "them (every stream waits meanwhile). E.g. --warm-up all.")
@click.option("--grace-seconds", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="After SIGTERM, how long requests in flight may take to finish.")
@click.option("--stream-interval", type=click.FloatRange(min=0, max=1), default=STREAM_INTERVAL, show_default=True,
              metavar="SECONDS",
              help="A stream's chunks come at most this often, each with every token since (0: a chunk a token); "
                   "a decode step longer than this makes every token a chunk.")
@click.option("--step-timeout", type=click.FloatRange(min=0, min_open=True), default=STEP_TIMEOUT_S, show_default=True,
              metavar="SECONDS",
              help="An engine step not done after this long is stuck (one that compiles a program may take 15 "
                   "minutes): /health answers 503 and, in a multi-host group, every process exits 1.")
@click.option("--device-memory-gb", type=click.FloatRange(min=0, min_open=True), default=None, hidden=True,
              help="The memory per device to plan for [what the device reports].")
def serve_command(directory, host, port, slots, max_len, chunk, decode_steps, mixed_prefill, max_waiting,
                  prefix_caching, prefix_cache_tokens, kv_cache_dtype, weight_format, mesh_text,
                  devices, tokenizer_path, chat_template_path, model_name, warm_up, grace_seconds, stream_interval,
                  step_timeout, device_memory_gb):
    """Serve a training run's latest checkpoint over an OpenAI-compatible HTTP API.

    \b
    Examples:
      python -m trainer.serve --checkpoint runs/demo
      python -m trainer.serve --checkpoint runs/demo --warm-up all  # ready once nothing is left to compile
      python -m trainer.serve --checkpoint gs://BUCKET/runs/demo --host 0.0.0.0 --weights int8
      curl localhost:8000/v1/completions -H 'content-type: application/json' \\
           -d '{"prompt": "The cat", "max_tokens": 20}'
    """
    _check_server_packages()
    for flag, value in (("--grace-seconds", grace_seconds), ("--step-timeout", step_timeout),
                        ("--device-memory-gb", device_memory_gb)):
        if value is not None and not math.isfinite(value):
            raise ServeError(f"{flag} must be a finite number of {'GiB' if 'memory' in flag else 'seconds'}, "
                             f"got {value}")
    port = port or _default_port()
    template = _chat_template(chat_template_path)
    if chunk > max_len:
        raise ServeError(f"--chunk {chunk} must not exceed --max-len {max_len}")
    with Stop() as stop:  # SIGTERM/SIGINT noted; loading and compiling check between their stages
        try:
            code = _start(directory, host, port, slots, max_len, chunk, decode_steps,
                          {"auto": None, "on": True, "off": False}[mixed_prefill], max_waiting, prefix_caching,
                          prefix_cache_tokens, kv_cache_dtype, weight_format, mesh_text, devices, tokenizer_path,
                          template, model_name, warm_up, grace_seconds, stream_interval, step_timeout,
                          device_memory_gb, stop)
        except Stopped:
            progress(f"stopped by {stop.name} before serving")
            code = 0
            from trainer.serve.startup import compiling_early

            if compiling_early():  # its program still compiling: exiting past XLA's compiler, not through it
                exit_past_threads(code)
    sys.exit(code)


def _start(directory, host, port, slots, max_len, chunk, decode_steps, mixed_prefill, max_waiting, prefix_caching,
           prefix_cache_tokens, kv_cache_dtype, weight_format, mesh_text, devices, tokenizer_path, template,
           model_name, warm_up, grace_seconds, stream_interval, step_timeout, device_memory_gb, stop) -> int:
    group = _group(devices)
    sock = _listen(host, port) if group is None or group.is_leader else None  # workers serve no HTTP
    _start_processes(group, devices)
    prefix_tokens = (prefix_cache_tokens or max(16, slots * max_len // 4)) if prefix_caching else 0
    if group is not None and prefix_tokens:
        # The prefix cache's copies are programs the leader runs outside ModelRunner.run, which its workers
        # would not follow: a group serves without it rather than with caches that differ between hosts.
        progress("prefix caching is off in a multi-host group (each host would need the same copies)")
        prefix_tokens = 0
    loaded = load(directory, tokenizer_path=tokenizer_path, mesh_text=mesh_text, slots=slots, max_len=max_len,
                  chunk=chunk, prefix_tokens=prefix_tokens, decode_steps=decode_steps, mixed_prefill=mixed_prefill,
                  kv_dtype=None if kv_cache_dtype == "auto" else kv_cache_dtype,
                  quantized=None if weight_format == "auto" else weight_format, device_memory_gb=device_memory_gb,
                  progress=lambda message: (stop.check(), progress(message)))
    if group is not None and not group.is_leader:
        sys.exit(_follow(loaded, group, ahead=warm_up == "background"))
    leader = _lead(loaded, group) if group is not None else None
    template = template or loaded.chat_template  # --chat-template, else an imported model's own
    return serve_http(loaded, sock, host, port, max_waiting, template, model_name or loaded.cfg.name, grace_seconds,
                  leader, warm_up=warm_up, stream_interval=stream_interval, step_timeout=step_timeout,
                  stop=stop)


def _group(devices: int | None):
    """The multi-host group the environment describes (trainer/serve/multihost.py), or None."""
    from trainer.serve import multihost

    try:
        group = multihost.group_of(os.environ)
        if group is not None:
            multihost.local_device_count(group, devices)
    except ValueError as e:
        raise ServeError(str(e)) from None
    return group


def _start_processes(group, devices: int | None) -> None:
    """Before anything starts jax: the group's jax.distributed (trainer/serve/multihost.py), else the Pathways
    proxy's start-up (trainer/distributed.py: one controller drives the slice, no group); fake CPU devices
    for --devices (in a group, this process's share, or MOE_SERVE_LOCAL_DEVICES)."""
    from trainer import distributed
    from trainer.cli import set_fake_devices
    from trainer.serve import multihost

    local = multihost.local_device_count(group, devices) if group is not None else devices
    if local is not None:
        set_fake_devices(local)
    if group is not None:
        progress(f"process {group.index} of a group of {group.size}: joining the coordinator at {group.coordinator}")
        multihost.start(group)
    elif distributed.wants_pathways(os.environ):
        try:
            distributed.initialize(os.environ)
        except RuntimeError as e:
            raise ServeError(str(e)) from None


def _follow(loaded, group, ahead: bool = False) -> int:
    """A worker of a multi-host group: runs each program call the leader hands over until it says stop (0);
    the leader gone: 1. With `ahead` it compiles the programs the leader's warm-up leaves on a thread meanwhile,
    as the leader does (a program compiles on each process: a call the leader hands over finds it compiled)."""
    from trainer.serve import multihost

    # A group being deleted gets SIGTERM in every process: the leader drains its requests, then stops the
    # workers, which must keep stepping with it until then.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    worker = multihost.Worker(group).connect()
    progress(f"worker {group.index} of {group.size}: following the leader at {group.leader}")
    compiling = compile_ahead_thread(loaded.engine, None) if ahead else None
    code = 0
    if worker.follow(loaded.engine.runner.run):
        progress("the leader is gone: exiting")
        code = EXIT_RUNTIME
    else:
        progress("stopped by the leader")
    if compiling is not None and compiling.is_alive():  # inside XLA: exiting past it would abort the process
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _lead(loaded, group):
    """The leader of a multi-host group: its workers joined, each program call handed to them."""
    from trainer.serve import multihost

    progress(f"waiting for the group's {group.size - 1} worker(s)")
    leader = multihost.Leader(group).connect()
    loaded.engine.runner.on_call = leader.mirror
    return leader


def _check_server_packages() -> None:
    """The HTTP server's packages come with the `serve` extra, which the trainer's container may lack."""
    import importlib

    for module in ("fastapi", "uvicorn", "prometheus_client"):
        try:
            importlib.import_module(module)
        except ImportError:
            raise ServeError(f"serving needs the Python package {module!r}, which is not installed: "
                             "pip install 'moe-tpu[serve]'") from None


def main(args: list[str] | None = None, prog_name: str | None = None) -> None:
    from trainer.serve import multihost

    try:
        serve_command.main(args=args, prog_name=prog_name or "python -m trainer.serve")
    except SystemExit as e:  # in a multi-host group, any way out but 0 leaves at once (multihost.leave)
        multihost.leave(e.code if isinstance(e.code, int) else EXIT_RUNTIME)
        raise
    except BaseException:
        if multihost.joined:
            import traceback

            traceback.print_exc()
            multihost.leave(EXIT_RUNTIME)
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
