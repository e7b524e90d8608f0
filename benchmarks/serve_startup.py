"""A server's start, measured side by side in one run: from the process's start to /health 200 (and, for
`--warm-up background`, to its last program compiled), for each `--warm-up`, with a cold and a warm
persistent compilation cache.

    PYTHONPATH=. python benchmarks/serve_startup.py                        # tiny, trained 2 steps here
    PYTHONPATH=. python benchmarks/serve_startup.py --checkpoint runs/demo --modes all,background

Each mode starts `python -m trainer.serve --checkpoint DIR` on the CPU (one device, the server's default
slots, max length and chunk) twice: first with an empty JAX_COMPILATION_CACHE_DIR of its own (cold), then
again on what the first left there (warm), as a restarted server finds the trainer's cache
(~/.cache/moe-tpu/jax). Each server then answers one greedy completion reaching the longest span (its time
is `first_long_request_s`, counted after ready) and is stopped with SIGTERM. Prints one JSON line a run and
the ratios of each mode's ready time to `all`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_tiny(out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "trainer", "--config", "tiny", "--devices", "1", "--steps", "2",
                    "--output-dir", str(out)], check=True, capture_output=True, cwd=ROOT,
                   env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT)))
    return out


def start(checkpoint: str, mode: str, cache: str, max_len: int, timeout: float) -> dict:
    """One server's start: seconds to /health 200, to its last background program, one long request."""
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=cache, PYTHONPATH=str(ROOT),
               XLA_FLAGS="--xla_force_host_platform_device_count=1")
    log = tempfile.TemporaryFile("w+")
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "trainer.serve", "--checkpoint", checkpoint, "--port",
                                str(port), "--warm-up", mode, "--max-len", str(max_len)],
                               env=env, stderr=log, stdout=subprocess.DEVNULL, cwd=ROOT)
    out = {"mode": mode}
    try:
        base = f"http://127.0.0.1:{port}"
        while True:
            if process.poll() is not None or time.perf_counter() - started > timeout:
                log.seek(0)
                raise RuntimeError(f"the server did not become ready:\n{log.read()[-2000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        out["ready_s"] = round(time.perf_counter() - started, 2)
        asked = time.perf_counter()
        body = {"prompt": " ".join(["7"] * (max_len - 40)), "max_tokens": 8, "temperature": 0}
        answer = httpx.post(f"{base}/v1/completions", json=body, timeout=timeout)
        if answer.status_code != 200:
            raise RuntimeError(f"the long request failed: {answer.status_code} {answer.text}")
        out["first_long_request_s"] = round(time.perf_counter() - asked, 2)
        if mode == "background":
            while "compiled the other" not in _read(log):
                if time.perf_counter() - started > timeout:
                    raise RuntimeError("the background compilation did not finish")
                time.sleep(0.1)
            out["all_compiled_s"] = round(time.perf_counter() - started, 2)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
    return out


def _read(log) -> str:
    log.seek(0)
    return log.read()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None, help="a run's output directory [tiny, trained 2 steps here]")
    parser.add_argument("--modes", default="all,smallest,background", help="--warm-up values, comma-separated")
    parser.add_argument("--max-len", type=int, default=1024, help="serve --max-len (its default)")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    modes = args.modes.split(",")
    with tempfile.TemporaryDirectory() as work:
        checkpoint = args.checkpoint or str(train_tiny(Path(work) / "run"))
        caches = {mode: str(Path(work) / f"cache-{mode}") for mode in modes}
        results: dict[tuple[str, str], dict] = {}
        for cache in ("cold", "warm"):  # interleaved: load on the machine meets every mode alike
            for mode in modes:
                row = {**start(checkpoint, mode, caches[mode], args.max_len, args.timeout), "cache": cache}
                results[mode, cache] = row
                print(json.dumps(row), flush=True)
    print(f"# PYTHONPATH=. python benchmarks/serve_startup.py --modes {args.modes} --max-len {args.max_len}"
          f"{' --checkpoint ' + args.checkpoint if args.checkpoint else ''}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for cache in ("cold", "warm"):
        for mode in modes:
            row = results[mode, cache]
            ratio = (f", {row['ready_s'] / results['all', cache]['ready_s']:.2f}x all's"
                     if "all" in modes and mode != "all" else "")
            print(f"{cache:4} {mode:10} ready {row['ready_s']:6.1f} s{ratio}; first long request "
                  f"{row['first_long_request_s']:.1f} s"
                  + (f"; everything compiled at {row['all_compiled_s']:.1f} s" if "all_compiled_s" in row else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
