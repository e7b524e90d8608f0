"""A server's start where it runs, in process (the chip's machine has no TCP sockets, so no /health to poll): from
a new process to the engine ready as `serve --warm-up background` has it before /health answers 200 (the
checkpoint read by the server's own start-up, trainer/serve/startup.py load, and the programs the first requests
need compiled), first with an empty persistent compilation cache (cold), then with the one that start left
(warm: a restarted server).

    python benchmarks/serve_ready.py --accelerator --json ready.json     # moe-1b, trained one step here first
    python benchmarks/serve_ready.py --checkpoint runs/demo              # a run of yours, on the default backend
    python benchmarks/serve_ready.py --accelerator --restore-parts --set train.checkpoint_compression=false

Each start is a process of its own (`--child`), with the server's defaults (8 slots x 1,024 tokens, chunks of 64,
the prefix cache); it prints its stages' seconds since its interpreter started (`imports`, `loaded`: the
checkpoint read and the engine built, with the start-up's progress lines on the way in `stages`; `ready`), and
the parent the wall time from its launch. One JSON line a start; --json writes them all. --restore-parts adds
where the checkpoint's read goes (the files read whole, orbax onto the host, onto the devices); --set trains
the run with overrides. benchmarks/serve_startup.py measures the same over HTTP on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def python_path(env: dict) -> str:
    """The checkout first, then whatever the environment's own path holds (where its packages may be)."""
    return os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)


def since_start() -> float:
    """Seconds since this process's interpreter started (its start time in /proc, where there is one)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter()


def child(checkpoint: str, slots: int, max_len: int) -> int:
    """One start, as `python -m trainer.serve --checkpoint DIR` makes it up to ready (no socket)."""
    marks = {}
    if os.environ.get("JAX_LOG_COMPILES") == "1":  # each compile log line stamped with ms since the start
        import logging

        logging.basicConfig(level=logging.WARNING, format="%(relativeCreated)7.0f ms %(message)s")
        import threading

        import jax.monitoring

        from trainer.program_cache import LOADED_EVENT

        def heard(event: str, seconds: float, **_) -> None:  # the kept programs' loads, in the same log
            if event == LOADED_EVENT:
                logging.warning("Finished loading a kept program (program cache) in %.3f sec on %s", seconds,
                                threading.current_thread().name)

        jax.monitoring.register_event_duration_secs_listener(heard)
        from trainer import program_cache
        from trainer.serve import startup

        def timed(owner, name: str, what: str) -> None:  # the early engine's other steps, in the same log
            plain = getattr(owner, name)

            def logged(*args, **kwargs):
                started = time.perf_counter()
                try:
                    return plain(*args, **kwargs)
                finally:
                    logging.warning("Finished %s in %.3f sec on %s", what, time.perf_counter() - started,
                                    threading.current_thread().name)

            setattr(owner, name, logged)

        timed(program_cache, "key", "a kept program's key")
        timed(startup.EarlyEngine, "start", "building the engine on the weights' shapes (the read waits)")
    from trainer.serve import startup
    from trainer.serve.spans import DEFAULT_CHUNK
    from trainer.serve.startup import load

    variant = os.environ.get("SERVE_READY_VARIANT", "")  # --warm-variants: where the first programs load
    if variant == "no-early":  # in the warm-up, one after the other, once the read is done
        startup.EarlyEngine.start = lambda self, step: None
    elif variant == "loads-first":  # on their threads, the read waiting for them
        beside = startup.EarlyEngine.start

        def first(self, step):
            beside(self, step)
            for thread in self.threads:
                thread.join()

        startup.EarlyEngine.start = first

    marks["imports"] = since_start()
    stages = []  # the start-up's own progress lines, each with its seconds since the start: where `loaded` goes
    loaded = load(checkpoint, tokenizer_path=None, mesh_text=None, slots=slots, max_len=max_len, chunk=DEFAULT_CHUNK,
                  kv_dtype=None, quantized=None, device_memory_gb=None,
                  progress=lambda message: stages.append([round(since_start(), 2), message[:80]]),
                  prefix_tokens=max(16, slots * max_len // 4))
    marks["loaded"] = since_start()
    if os.environ.get("JAX_LOG_COMPILES") == "1":  # each warm-up call's seconds, its outputs waited for
        import jax

        runner, plain = loaded.engine.runner, loaded.engine.runner.run

        def waited_for(name, *inputs):
            started = time.perf_counter()
            outputs = plain(name, *inputs)
            jax.block_until_ready(outputs)
            logging.warning("Finished the warm-up call of %s in %.3f sec", name, time.perf_counter() - started)
            return outputs

        runner.run = waited_for
        started = time.perf_counter()  # a read's arrays may still be on their way to the devices
        jax.block_until_ready(loaded.engine.weights)
        logging.warning("Finished waiting for the weights read onto the devices in %.3f sec",
                        time.perf_counter() - started)
    loaded.engine.warm_up(False)  # what --warm-up background compiles before ready
    marks["ready"] = since_start()
    marks["programs"] = loaded.engine.compilations()
    marks["stages"] = stages
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in marks.items()}), flush=True)
    return 0


def restore_parts(checkpoint: str) -> int:
    """Where a server's checkpoint read goes, in one process, each part twice (the second with the files in the
    page cache): the checkpoint's files read whole (the bytes the disk gives), the parameters read by orbax onto
    the host (numpy), and as the server reads them onto the devices (restore_weights). Prints one JSON line."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from trainer import sharding
    from trainer.run_loader import find_run, load_run_config
    from trainer.serve.startup import serving_mesh
    from trainer.serve.weights import build_serving_model, restore_weights

    run = find_run(checkpoint, progress=lambda _: None)
    cfg = load_run_config(run.config)
    mesh = sharding.make_mesh(serving_mesh(cfg, None, len(jax.devices())), jax.devices())
    model = build_serving_model(cfg, mesh)
    parts: dict = {"files": [], "host": [], "devices": []}
    step_dir = max((p for p in Path(run.checkpoints).iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    files = [p for p in step_dir.rglob("*") if p.is_file()]
    for _ in range(2):
        started = time.perf_counter()
        read = sum(len(p.read_bytes()) for p in files)
        parts["files"].append(round(time.perf_counter() - started, 2))
        parts["file_bytes"] = read
        manager = ocp.CheckpointManager(run.checkpoints, item_handlers={"state": ocp.PyTreeCheckpointHandler()},
                                        options=ocp.CheckpointManagerOptions(read_only=True))
        wanted = {"params": model.abstract()["params"]}
        host = jax.tree.map(lambda a: ocp.RestoreArgs(restore_type=np.ndarray), wanted)
        started = time.perf_counter()
        manager.restore(int(step_dir.name), args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item=wanted, restore_args=host, partial_restore=True)))
        parts["host"].append(round(time.perf_counter() - started, 2))
        manager.close()
        started = time.perf_counter()
        weights, _ = restore_weights(model, run.checkpoints)
        jax.block_until_ready(weights)
        parts["devices"].append(round(time.perf_counter() - started, 2))
        parts["param_bytes"] = sum(a.nbytes for a in jax.tree.leaves(weights))
        del weights
    print(json.dumps({"restore_parts": parts}), flush=True)
    return 0


def start(checkpoint: str, cache: str, slots: int, max_len: int, env: dict) -> dict:
    launched = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--child", checkpoint, "--slots", str(slots), "--max-len",
                           str(max_len)], capture_output=True, text=True, cwd=ROOT,
                          env=dict(env, JAX_COMPILATION_CACHE_DIR=cache, PYTHONPATH=python_path(env)))
    wall = time.perf_counter() - launched
    if done.returncode:
        raise RuntimeError(f"the start failed ({done.returncode}):\n{done.stderr[-3000:]}")
    marks = json.loads(done.stdout.strip().splitlines()[-1])
    if env.get("JAX_LOG_COMPILES") == "1":
        from train_step import telling  # one rule for both benchmarks' compile logs

        marks["compile_log"] = [line.strip()[-200:] for line in done.stderr.splitlines() if telling(line)]
    return {"wall_s": round(wall, 2), **marks}


def variant_env(env: dict, variant: str) -> dict:
    """The environment of a start of `variant` (--warm-variants): "env:KEY=VALUE" sets KEY, another names the
    child's own variant (SERVE_READY_VARIANT)."""
    if variant.startswith("env:"):
        key, _, value = variant[4:].partition("=")
        return dict(env, **{key: value})
    return dict(env, SERVE_READY_VARIANT=variant)


def train_one_step(config: str, out: Path, env: dict, overrides: list[str] = ()) -> Path:
    """A run of `config` (with `overrides`, KEY=VALUE) trained one step, its checkpoint written: what the server
    reads."""
    devices = ["--devices", "1"] if env.get("JAX_PLATFORMS") == "cpu" else []  # one CPU device, as the server's
    sets = [arg for override in overrides for arg in ("--set", override)]
    done = subprocess.run([sys.executable, "-m", "trainer", "--config", config, "--steps", "1", *devices, *sets,
                           "--output-dir", str(out)], capture_output=True, text=True, cwd=ROOT,
                          env=dict(env, PYTHONPATH=python_path(env)))
    if done.returncode:
        raise RuntimeError(f"training {config} one step failed:\n{done.stderr[-3000:]}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", default=None, help="a run's directory [--config trained one step here]")
    p.add_argument("--accelerator", action="store_true", help="the default backend (TPU) rather than the CPU")
    p.add_argument("--config", default="moe-1b", help="what to train one step where no --checkpoint is given")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for the run trained here (e.g. train.checkpoint_compression=false)")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--log-compiles", action="store_true",
                   help="each start's compile log (jax's tracing, lowering, compiles and cache hits, stamped with "
                        "ms since its start) in its row")
    p.add_argument("--restore-parts", action="store_true",
                   help="after the starts, where the checkpoint read goes (files, onto the host, onto the devices)")
    p.add_argument("--warm-variants", type=lambda v: v.split(","), default=[],
                   help="more warm starts after the first, comma-separated: 'again' as it is, 'no-early' (the first "
                        "programs loaded in the warm-up, after the read), 'loads-first' (loaded before the read), "
                        "'env:KEY=VALUE' (as it is, KEY set: TPU_PREMAPPED_BUFFER_SIZE=1073741824)")
    p.add_argument("--restore-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)
    if args.log_compiles:
        os.environ["JAX_LOG_COMPILES"] = "1"
    if args.child:
        return child(args.child, args.slots, args.max_len)
    if args.restore_child:
        return restore_parts(args.restore_child)
    env = dict(os.environ) if args.accelerator else dict(os.environ, JAX_PLATFORMS="cpu")
    rows = []
    with tempfile.TemporaryDirectory() as work:
        checkpoint = args.checkpoint
        if checkpoint is None:
            started = time.perf_counter()
            checkpoint = str(train_one_step(args.config, Path(work) / "run", env, args.overrides))
            print(json.dumps({"trained_one_step_s": round(time.perf_counter() - started, 1)}), flush=True)
        cache = str(Path(work) / "cache")  # empty: the cold start's, then the warm one's
        for which, variant in [("cold", ""), ("warm", ""), *(("warm", v) for v in args.warm_variants)]:
            rows.append({"cache": which, **({"variant": variant} if variant else {}),
                         **start(checkpoint, cache, args.slots, args.max_len, variant_env(env, variant))})
            print(json.dumps(rows[-1]), flush=True)
        if args.restore_parts:
            done = subprocess.run([sys.executable, __file__, "--restore-child", checkpoint], capture_output=True,
                                  text=True, cwd=ROOT, env=dict(env, JAX_COMPILATION_CACHE_DIR=cache,
                                                                PYTHONPATH=python_path(env)))
            if done.returncode:
                raise RuntimeError(f"the restore parts failed ({done.returncode}):\n{done.stderr[-3000:]}")
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"checkpoint": args.checkpoint or args.config, "starts": rows},
                                                   indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
