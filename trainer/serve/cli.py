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
import threading
import time

import click

from trainer.serve.memory import QUANTIZED_WEIGHTS
from trainer.serve.startup import ServeError, load

EXIT_RUNTIME = 1
# Positions are int32 in the steps, and an idle slot sits at position max_len, drawing at max_len + 1.
POSITIONS_MAX = 2**31 - 2


def _progress(message: str) -> None:
    click.echo(f"serve: {message}", err=True)


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
              help="A run's output directory (or the checkpoints directory in it), local or gs://.")
@click.option("--host", default="127.0.0.1", show_default=True, help="The address to listen on (0.0.0.0: all).")
@click.option("--port", type=click.IntRange(1, 65535), default=None, help="[$AIP_HTTP_PORT or 8000]")
@click.option("--slots", type=click.IntRange(min=1), default=8, show_default=True, help="Requests decoded at once.")
@click.option("--max-len", type=click.IntRange(min=2, max=POSITIONS_MAX), default=1024, show_default=True,
              help="Prompt plus generated tokens per request (the KV cache's length).")
@click.option("--chunk", type=click.IntRange(min=1), default=64, show_default=True,
              help="Prompt tokens prefilled per engine step, between decode steps.")
@click.option("--max-waiting", type=click.IntRange(min=0), default=64, show_default=True,
              help="Requests queued for a slot; beyond them 429 with Retry-After.")
@click.option("--kv-cache-dtype", type=click.Choice(["auto", "bfloat16", "float32", "int8"]), default="auto",
              show_default=True, help="auto: the model's compute dtype.")
@click.option("--weights", "weight_format", type=click.Choice(["auto", *QUANTIZED_WEIGHTS]), default="auto",
              show_default=True,
              help="int8: per-channel symmetric int8 weights (about half of bfloat16); int4: symmetric, a scale "
                   "per group of 128 input values, two a byte (about 0.27x).")
@click.option("--mesh", "mesh_text", default=None, metavar="data=D,expert=E,model=T",
              help="model=T splits each expert and attention's heads T ways [as many devices on expert as "
                   "divide the experts]")
@click.option("--devices", type=click.IntRange(min=1), default=None, help="CPU only: N fake XLA devices.")
@click.option("--tokenizer", "tokenizer_path", default=None, metavar="FILE",
              help="A tokenizer.json [the run's dataset's].")
@click.option("--chat-template", "chat_template_path", default=None, metavar="FILE",
              help='JSON {"message": "{role}: {content}\\n", "generation": "assistant:"} [that one].')
@click.option("--model-name", default=None, help="The model's id in the API [the config's name].")
@click.option("--grace-seconds", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="After SIGTERM, how long requests in flight may take to finish.")
@click.option("--device-memory-gb", type=click.FloatRange(min=0, min_open=True), default=None, hidden=True,
              help="The memory per device to plan for [what the device reports].")
def serve_command(directory, host, port, slots, max_len, chunk, max_waiting, kv_cache_dtype, weight_format, mesh_text,
                  devices, tokenizer_path, chat_template_path, model_name, grace_seconds, device_memory_gb):
    """Serve a training run's latest checkpoint over an OpenAI-compatible HTTP API.

    \b
    Examples:
      python -m trainer.serve --checkpoint runs/demo
      python -m trainer.serve --checkpoint gs://BUCKET/runs/demo --host 0.0.0.0 --weights int8
      curl localhost:8000/v1/completions -H 'content-type: application/json' \\
           -d '{"prompt": "The cat", "max_tokens": 20}'
    """
    _check_server_packages()
    if devices is not None:
        from trainer.cli import set_fake_devices

        set_fake_devices(devices)
    for flag, value in (("--grace-seconds", grace_seconds), ("--device-memory-gb", device_memory_gb)):
        if value is not None and not math.isfinite(value):
            raise ServeError(f"{flag} must be a finite number of {'seconds' if 'grace' in flag else 'GiB'}, "
                             f"got {value}")
    port = port or _default_port()
    template = _chat_template(chat_template_path)
    if chunk > max_len:
        raise ServeError(f"--chunk {chunk} must not exceed --max-len {max_len}")
    sock = _listen(host, port)
    loaded = load(directory, tokenizer_path=tokenizer_path, mesh_text=mesh_text, slots=slots, max_len=max_len,
                  chunk=chunk, kv_dtype=None if kv_cache_dtype == "auto" else kv_cache_dtype,
                  quantized=None if weight_format == "auto" else weight_format, device_memory_gb=device_memory_gb,
                  progress=_progress)
    template = template or loaded.chat_template  # --chat-template, else an imported model's own
    code = _serve(loaded, sock, host, port, max_waiting, template, model_name or loaded.cfg.name, grace_seconds)
    sys.exit(code)


def _check_server_packages() -> None:
    """The HTTP server's packages come with the `serve` extra, which the trainer's container may lack."""
    import importlib

    for module in ("fastapi", "uvicorn", "prometheus_client"):
        try:
            importlib.import_module(module)
        except ImportError:
            raise ServeError(f"serving needs the Python package {module!r}, which is not installed: "
                             "pip install 'moe-tpu[serve]'") from None


def _serve(loaded, sock: socket.socket, host: str, port: int, max_waiting: int, template, name: str,
           grace_seconds: float) -> int:
    import uvicorn

    from trainer.serve.loop import EngineLoop
    from trainer.serve.server import ServerState, create_app, http_protocol

    state = ServerState(name, encode=loaded.encode, decode=loaded.decode, max_waiting=max_waiting,
                        eos_token=loaded.eos_token, tokenizer_class=loaded.tokenizer_class)
    if template is not None:
        state.chat_template = template
    # uvicorn's own limit is a backstop past ours: by then every open request has had its error (expire).
    config = uvicorn.Config(create_app(state), host=host, port=port, log_level="warning", http=http_protocol(),
                            timeout_graceful_shutdown=grace_seconds + 5, lifespan="off")
    server = _draining_server(config, state, grace_seconds)
    failed: list[str] = []

    def compile_then_serve():
        try:
            started = time.perf_counter()
            _progress(f"compiling the prefill and decode steps ({loaded.engine.slots} slots x "
                      f"{loaded.engine.max_len} tokens)")
            loaded.engine.warm_up()
            state.loop = EngineLoop(loaded.engine).start()
            _progress(f"compiled in {time.perf_counter() - started:.1f}s")
            _progress(f"ready: {name} at http://{host}:{port}/v1 (health /health, metrics /metrics)")
        except Exception as e:  # noqa: BLE001 - reported, and the server stops with exit code 1
            failed.append(f"{type(e).__name__}: {e}")
            server.should_exit = True

    compiling = threading.Thread(target=compile_then_serve, name="moe-tpu-compile", daemon=True)
    compiling.start()
    # uvicorn raises the signal it stopped for again once it has shut down, for the handler it found:
    # with the default one SIGTERM would end the process by the signal rather than with exit code 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        if state.loop is not None:
            state.loop.stop()
    if compiling.is_alive():  # stopped while XLA compiles: exiting past it aborts the process (SIGABRT, 134)
        _progress("stopped before the steps were compiled")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if failed:
        click.echo(f"serve: compiling failed: {failed[0]}", err=True)
        return EXIT_RUNTIME
    if not server.started:
        click.echo(f"serve: cannot listen on {host}:{port}", err=True)
        return EXIT_RUNTIME
    _progress("stopped")
    return 0


def _draining_server(config, state, grace_seconds: float):
    """uvicorn's server for `state`. On SIGTERM/SIGINT uvicorn closes its socket and waits for the connections in
    flight; this one also answers 503 to requests arriving meanwhile on connections kept alive, and when the
    grace period runs out ends the requests still open with an error (an event on a stream) rather than
    dropping their connections, in one line of its log. The signal handler only sets flags; what follows runs
    on the event loop."""
    import asyncio

    import uvicorn

    def grace_ran_out():
        cut = state.expire()
        if cut:
            _progress(f"--grace-seconds {grace_seconds:g} ran out: {cut} request(s) still running ended with an "
                      "error")

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame):
            state.draining = True
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None):
            _progress("stopping: no new requests; finishing those in flight")
            cutoff = asyncio.get_running_loop().call_later(grace_seconds, grace_ran_out)
            try:
                await super().shutdown(sockets)
            finally:
                cutoff.cancel()

    return DrainingServer(config)


def main(args: list[str] | None = None, prog_name: str | None = None) -> None:
    serve_command.main(args=args, prog_name=prog_name or "python -m trainer.serve")


if __name__ == "__main__":
    main(sys.argv[1:])
