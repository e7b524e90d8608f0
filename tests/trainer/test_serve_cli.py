"""`python -m trainer.serve`: bad flags and checkpoints exit 2 with a message; a served process frees the
slot of a client that goes away, and on SIGTERM finishes the 8 streams in flight, then exits 0."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from trainer.cli import set_fake_devices
from trainer.config import load_config
from trainer.serve.cli import serve_command

pytestmark = pytest.mark.compile_bound


def test_bad_flags_and_checkpoints_exit_2_with_a_message(trained_tiny, tmp_path):
    run = trained_tiny.output_dir
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(load_config("deepseek-tiny").to_dict()))
    (other / "checkpoints").symlink_to(run / "checkpoints")
    template = tmp_path / "template.json"
    template.write_text('{"message": "{speaker}"}')
    no_content = tmp_path / "no-content.json"
    no_content.write_text('{"message": "{role}: ", "generation": "assistant:"}')
    truncated = tmp_path / "truncated"
    shutil.copytree(run, truncated, ignore=shutil.ignore_patterns(".lock"))
    latest = max((p for p in (truncated / "checkpoints").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    metadata = latest / "state" / "_METADATA"
    metadata.write_bytes(metadata.read_bytes()[:len(metadata.read_bytes()) // 2])
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    busy_port = busy.getsockname()[1]
    cases = [
        (["--checkpoint", str(tmp_path / "none")], f"--checkpoint {tmp_path / 'none'} does not exist"),
        (["--checkpoint", str(other)],
         "holds nothing for params.stacks.0.0.attn.kv_norm.scale; the run's config needs [2, 32]"),  # latent attention
        (["--checkpoint", str(run), "--device-memory-gb", "0.0001"], "--kv-cache-dtype int8"),
        (["--checkpoint", str(run), "--device-memory-gb", "0.0001"], "--weights int8 or int4"),
        (["--checkpoint", str(run), "--device-memory-gb", "0.0001", "--weights", "int8"], "--weights int4 (about"),
        (["--checkpoint", str(run), "--weights", "int2"], "'int2' is not one of 'auto', 'int8', 'int4'"),
        (["--checkpoint", str(run), "--chat-template", str(template)], f"--chat-template {template}"),
        (["--checkpoint", str(run), "--chunk", "64", "--max-len", "32"], "--chunk 64 must not exceed --max-len 32"),
        (["--checkpoint", str(run), "--mesh", "data=1,expert=3"], "--mesh"),
        (["--checkpoint", str(run), "--slots", "0"], "'--slots'"),
        (["--checkpoint", str(run), "--max-waiting", "0"], "'--max-waiting'"),  # every request would be a 429
        (["--checkpoint", str(run), "--chat-template", str(no_content)], "'message' has no {content}"),
        (["--checkpoint", str(truncated)], f"the metadata of step {latest.name} in"),
        # The socket is bound before the weights are read: no minutes of loading for a port in use.
        (["--checkpoint", str(tmp_path / "none"), "--port", str(busy_port)], f"--port {busy_port}: 127.0.0.1:"),
        (["--checkpoint", str(run), "--host", "999.1.1.1"], "--host '999.1.1.1' is not an address"),
        (["--checkpoint", str(run), "--grace-seconds", "nan"], "--grace-seconds must be a finite number"),
        (["--checkpoint", str(run), "--step-timeout", "inf"], "--step-timeout must be a finite number of seconds"),
        (["--checkpoint", str(run), "--step-timeout", "0"], "'--step-timeout'"),
        (["--checkpoint", str(run), "--stream-interval", "-0.5"], "'--stream-interval'"),
        (["--checkpoint", str(run), "--device-memory-gb", "inf"], "--device-memory-gb must be a finite number"),
        (["--checkpoint", str(run), "--max-len", str(2**31)], "--max-len"),  # past int32 positions
        # On CPU the host's memory bounds the cache: refused before it is allocated.
        (["--checkpoint", str(run), "--slots", "1000000", "--max-len", "1000000"], "the model does not fit a device"),
    ]
    try:
        for args, needle in cases:
            result = CliRunner().invoke(serve_command, args)
            assert result.exit_code == 2, (args, result.output)
            assert needle in result.output and "Traceback" not in result.output, (args, result.output)
    finally:
        busy.close()


def test_sigterm_while_compiling_exits_0_at_once_saying_so(tmp_path):
    """A server stopped before its steps are compiled exits without waiting for the compile thread (exiting
    past XLA compiling aborts the process): here a warm-up that never ends stands in for a compile."""
    script = tmp_path / "serve.py"
    script.write_text(
        "import socket, sys, threading, types\n"
        "from trainer.serve import cli, http_serve\n"
        "engine = types.SimpleNamespace(slots=1, max_len=2,\n"
        "                               warm_up=lambda every_span, between: threading.Event().wait())\n"
        "loaded = types.SimpleNamespace(engine=engine, encode=None, decode=None, eos_token=None,\n"
        "                                tokenizer_class='ids', tokenizer=None)\n"
        "sock = cli._listen('127.0.0.1', int(sys.argv[1]))\n"
        "sys.exit(http_serve.serve_http(loaded, sock, '127.0.0.1', int(sys.argv[1]), 1, None, 'tiny', 1.0))\n")
    process = subprocess.Popen([sys.executable, str(script), str(free_port())], stderr=subprocess.PIPE, text=True)
    try:
        for line in process.stderr:
            if "compiling the prefill" in line:
                break
        time.sleep(0.5)  # uvicorn has installed its handlers
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        assert "stopped before the steps were compiled" in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_the_server_is_ready_while_it_compiles_ahead_and_a_sigterm_then_exits_0(tmp_path):
    """--warm-up background: /health says ready once the first programs ran, while the others still compile
    on a thread (here one that never ends stands in for XLA compiling); SIGTERM then exits 0 at once, not past
    the compiling thread (an abort). uvicorn's start is slowed here: "ready" waits for it (it had been said
    while a request to the address was still refused)."""
    script = tmp_path / "serve.py"
    script.write_text(
        "import asyncio, sys, threading, types\n"
        "import uvicorn\n"
        "from trainer.serve import cli, http_serve\n"
        "quick = uvicorn.Server.startup\n"
        "async def slow(self, sockets=None):\n"
        "    await asyncio.sleep(1.0)\n"
        "    await quick(self, sockets)\n"
        "uvicorn.Server.startup = slow\n"
        "def warm_up(every_span, between):\n"
        "    print(f'warm_up every_span={every_span}', file=sys.stderr, flush=True)\n"
        "def compile_ahead(between):\n"
        "    print('compiling ahead', file=sys.stderr, flush=True)\n"
        "    threading.Event().wait()\n"
        "engine = types.SimpleNamespace(slots=1, max_len=2, warm_up=warm_up, compile_ahead=compile_ahead,\n"
        "                               runner=types.SimpleNamespace(first_calls=0), snapshot=None, busy=False,\n"
        "                               scheduler=types.SimpleNamespace(waiting=[]))\n"
        "loaded = types.SimpleNamespace(engine=engine, encode=None, decode=None, eos_token=None,\n"
        "                                tokenizer_class='ids', tokenizer=None)\n"
        "sock = cli._listen('127.0.0.1', int(sys.argv[1]))\n"
        "sys.exit(http_serve.serve_http(loaded, sock, '127.0.0.1', int(sys.argv[1]), 1, None, 'tiny', 1.0, "
        "warm_up='background'))\n")
    port = free_port()
    process = subprocess.Popen([sys.executable, str(script), str(port)], stderr=subprocess.PIPE, text=True)
    try:
        said = []
        for line in process.stderr:
            said.append(line)
            if "compiling ahead" in line:
                break
        assert "warm_up every_span=False" in "".join(said) and "ready: tiny" in "".join(said), said
        assert httpx.get(f"http://127.0.0.1:{port}/health").json() == {"status": "ok"}
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        rest = process.stderr.read()
        assert "stopped\n" in rest and "compiled the other" not in rest and "Traceback" not in rest, rest
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_sigint_while_the_checkpoint_is_read_stops_the_server_before_it_compiles(trained_tiny):
    """The signal handler only notes the signal (a KeyboardInterrupt raised inside the checkpoint's reading was
    swallowed there, and the server went on to compile and serve); loading checks it between its stages."""
    env = one_device_env()
    process = subprocess.Popen([sys.executable, "-m", "trainer.serve", "--checkpoint", str(trained_tiny.output_dir),
                                "--port", str(free_port()), "--warm-up", "smallest"],
                               env=env, stderr=subprocess.PIPE, text=True)
    try:
        for line in process.stderr:
            if "reading the parameters" in line:
                break
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
        said = process.stderr.read()
        assert "stopped by SIGINT before serving" in said and "compiling" not in said, said
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def one_device_env() -> dict[str, str]:
    """This environment with one CPU device: the suite's XLA flags kept (tests/conftest.py: compiling is what
    costs here), only the device count replaced."""
    env = dict(os.environ)
    set_fake_devices(1, env)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def generated_and_running(base: str) -> tuple[float, float]:
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{base}/metrics").text)}
    total = next(s.value for s in families["vllm:generation_tokens"].samples if s.name.endswith("_total"))
    return total, families["vllm:num_requests_running"].samples[0].value


def test_a_served_process_frees_a_gone_clients_slot_and_drains_on_sigterm(trained_tiny):
    port = free_port()
    env = one_device_env()
    process = subprocess.Popen([sys.executable, "-m", "trainer.serve", "--checkpoint", str(trained_tiny.output_dir),
                                "--port", str(port), "--slots", "8", "--max-len", "512", "--chunk", "16",
                                "--warm-up", "smallest",  # its requests are short: the other spans never compile
                                "--stream-interval", "0.5"],  # a stream's chunks: at most one each half second
                               env=env, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in process.stderr:  # progress while loading and compiling, then the URL
            lines.append(line)
            if "ready:" in line:
                break
        assert f"ready: tiny at http://127.0.0.1:{port}/v1" in "".join(lines), "".join(lines)
        assert "KV cache 8 slots x 512 tokens = 4,096 positions" in "".join(lines)
        base = f"http://127.0.0.1:{port}"
        body = {"prompt": "3 17 9", "max_tokens": 480, "stream": True, "temperature": 0}
        with httpx.stream("POST", f"{base}/v1/completions", json=body) as r:
            next(r.iter_lines())  # the first chunk, then the client goes away
        for _ in range(1000):  # the engine notices at its next step
            generated, running = generated_and_running(base)
            if running == 0:
                break
        assert running == 0 and generated < 480

        done, chunk_counts, first = [], [], threading.Barrier(9)

        def stream(i):
            with httpx.stream("POST", f"{base}/v1/completions", timeout=60,
                              json={**body, "max_tokens": 120, "seed": i, "temperature": 1.0,
                                    "stream_options": {"include_usage": True}}) as r:
                lines = r.iter_lines()
                next(lines)
                first.wait()
                rest = [line for line in lines if line]
            chunk_counts.append(len(rest))
            done.append((time.monotonic(), rest[-1], json.loads(rest[-2][6:])["usage"]["completion_tokens"]))

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        first.wait()  # all 8 are streaming
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=120)
        assert process.wait(timeout=120) == 0
        assert len(done) == 8 and all(end == "data: [DONE]" and n == 120 for _, end, n in done)
        # 120 tokens each in chunks of every token since the last, at most one each half second
        assert all(chunks < 40 for chunks in chunk_counts), chunk_counts
        assert any(at > signalled for at, _, _ in done)  # they were still running when the signal came
        assert "stopping: no new requests" in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_grace_period_that_runs_out_sends_each_stream_an_error_event_and_logs_one_line(tmp_path):
    """SIGTERM with streams that cannot finish within --grace-seconds: each gets an error event and [DONE]
    (not a dropped connection), the log one line (not a traceback per stream), and the server exits 0."""
    script = tmp_path / "serve.py"
    script.write_text(
        "import sys, types, jax\n"
        "from trainer import sharding\n"
        "from trainer.config import load_config\n"
        "from trainer.serve import cli, http_serve\n"
        "from trainer.serve.engine import Engine\n"
        "from trainer.serve.weights import build_serving_model, init_weights\n"
        "model = build_serving_model(load_config('tiny', []), sharding.make_mesh({'data': 1, 'expert': 1}, "
        "jax.devices()[:1]))\n"
        "engine = Engine(model, init_weights(model), slots=4, max_len=4096, chunk=16)\n"
        "loaded = types.SimpleNamespace(engine=engine, encode=lambda t: [int(w) for w in t.split()],\n"
        "                               decode=lambda ids: ' '.join(map(str, ids)), eos_token=None,\n"
        "                               tokenizer_class='ids', tokenizer=None)\n"
        "sock = cli._listen('127.0.0.1', int(sys.argv[1]))\n"
        "sys.exit(http_serve.serve_http(loaded, sock, '127.0.0.1', int(sys.argv[1]), 8, None, 'tiny', 0.5, "
        "warm_up='smallest'))\n")  # the quick start: 4,096 tokens are six spans, and the test needs none warm
    port = free_port()
    env = {**one_device_env(), "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}
    process = subprocess.Popen([sys.executable, str(script), str(port)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        for line in process.stderr:
            if "ready:" in line:
                break
        ended, first = [], threading.Barrier(4)

        def stream():
            body = {"prompt": "1 2 3", "max_tokens": 4000, "stream": True}
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
                lines = r.iter_lines()
                next(lines)
                first.wait()
                ended.append([line for line in lines if line][-2:])

        threads = [threading.Thread(target=stream) for _ in range(3)]
        for t in threads:
            t.start()
        first.wait()
        process.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=60)
        assert process.wait(timeout=60) == 0
        log = process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert len(ended) == 3
    for last, done in ended:
        assert done == "data: [DONE]" and "grace period" in json.loads(last[6:])["error"]["message"]
    assert log.count("ran out: 3 request(s) still running ended with an error") == 1 and "Traceback" not in log
