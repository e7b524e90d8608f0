"""trainer/serve/startup.py load: the checkpoint read while the engine's first programs compile beside it."""

import contextlib
import threading

import jax
import pytest

from trainer.serve.engine import Request, SamplingParams
from trainer.serve.startup import EARLY_THREAD as EARLY
from trainer.serve.startup import ServeError, compiling_early, load


def compiles_by_thread(events: list[str], idents: list[int] | None = None):
    """A listener that appends the name of the thread each XLA compile ran on to `events` (and its ident to
    `idents`), and each program loaded instead (trainer/program_cache.py: one an earlier test's server kept)."""
    from trainer.program_cache import LOADED_EVENT

    def listener(name, *_, **__):
        if "/jax/core/compile/backend" in name or name == LOADED_EVENT:
            events.append(threading.current_thread().name)
            if idents is not None:
                idents.append(threading.get_ident())

    return listener


@contextlib.contextmanager
def compiles(events: list[str], idents: list[int] | None = None):
    """XLA's compiles (and programs loaded) meanwhile, each as the name of the thread it ran on, appended to
    `events` (and the thread's ident to `idents`)."""
    listener = compiles_by_thread(events, idents)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def loaded_engine(run, **extra):
    return load(str(run), tokenizer_path=None, mesh_text=None, slots=8, max_len=64, chunk=16, kv_dtype=None,
                quantized=None, device_memory_gb=None, progress=lambda _: None, **extra).engine


def test_the_first_programs_compile_on_a_thread_on_the_weights_shapes_and_the_warm_up_finds_them(trained_tiny):
    """EarlyEngine as load starts it once the checkpoint's shapes match (here left to finish): the first programs
    compiled on abstract weights, each on a thread of its own, then the weights read handed over; the warm-up
    compiles none of them again, and the engine answers."""
    from trainer import sharding
    from trainer.run_loader import find_run, load_run_config
    from trainer.serve.engine import Engine
    from trainer.serve.startup import EarlyEngine, serving_mesh
    from trainer.serve.weights import build_serving_model, restore_weights

    run = find_run(str(trained_tiny.output_dir), progress=lambda _: None)
    cfg = load_run_config(run.config)
    mesh = sharding.make_mesh(serving_mesh(cfg, None, len(jax.devices())), jax.devices())
    model = build_serving_model(cfg, mesh)
    early = EarlyEngine(model, lambda w: Engine(model, w, slots=8, max_len=64, chunk=16), alone=True)
    idents: list[int] = []
    with compiles([], idents) as ahead:
        weights, step = restore_weights(model, run.checkpoints, on_checked=early.start)
        for thread in early.threads:
            thread.join(timeout=300)
    engine = early.take(weights)
    first = engine.runner.first_programs()
    assert ahead.count(EARLY) == len(first) and step == 120  # no burst: the first programs lead the warm-up's order
    assert len({i for i, name in zip(idents, ahead, strict=True) if name == EARLY}) == len(first)  # side by side
    with compiles([]) as warming:
        engine.warm_up()
    assert warming == []
    request = engine.submit(Request([3, 17, 9], SamplingParams(max_tokens=4)))
    engine.run()
    assert len(request.output) == 4 and request.finish_reason == "length"


def test_load_compiles_each_first_program_once_on_the_thread_or_in_the_warm_up(trained_tiny):
    """(serve --mixed-prefill on: the engine takes chunks along with its decode steps; not a first program.)"""
    with compiles([]) as events:
        engine = loaded_engine(trained_tiny.output_dir, mixed_prefill=True)
        for thread in [t for t in threading.enumerate() if t.name == EARLY]:
            thread.join(timeout=300)
        loaded = len(events)
        engine.warm_up()
    assert all(not isinstance(w, jax.ShapeDtypeStruct) for w in jax.tree.leaves(engine.weights))
    assert events.count(EARLY) + len(events[loaded:]) == len(engine.runner.first_programs())
    assert engine.runner.mixed and not any(name.startswith("mixed/") for name in engine.runner.first_programs())


def test_a_restarted_server_loads_the_programs_the_first_one_compiled_and_answers_the_same(trained_tiny,
                                                                                          own_compilation_cache):
    """trainer/program_cache.py for the engine: a server compiles its first programs and keeps them; a second
    one of the same run and shapes (here a new model in this process, as a restart builds it, over a
    compilation cache of its own) loads them, compiles none of its steps, and draws the same tokens."""
    from trainer import program_cache

    loads: list[float] = []
    heard = lambda name, secs, **_: loads.append(secs) if name == program_cache.LOADED_EVENT else None  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(heard)
    try:
        served = []
        for _ in range(2):
            del loads[:]
            with compiles([]) as events:
                engine = loaded_engine(trained_tiny.output_dir)
                for thread in [t for t in threading.enumerate() if t.name == EARLY]:
                    thread.join(timeout=300)
                warm_up = len(events)
                engine.warm_up()
                made = events.count(EARLY) + len(events[warm_up:])  # on the thread, or left to the warm-up
                request = engine.submit(Request([3, 17, 9, 4], SamplingParams(max_tokens=6)))
                engine.run()
            for thread in [t for t in threading.enumerate() if t.name.startswith("keep-")]:
                thread.join(timeout=60)
            served.append((request.output, len(loads), made))
        first = engine.runner.first_programs()
        kept = list((own_compilation_cache / program_cache.SUBDIR).glob("[0-9a-f]*"))
    finally:
        jax.monitoring.unregister_event_duration_listener(heard)
    (tokens, loaded, made), (again, loaded_again, made_again) = served
    assert loaded == 0 and made == len(first) and len(kept) == len(first)
    assert loaded_again == len(first) == made_again  # each loaded, none compiled
    assert again == tokens and len(tokens) == 6


def test_a_checkpoint_of_another_shape_is_refused_before_anything_compiles_early(trained_tiny, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained_tiny.output_dir, run, ignore=shutil.ignore_patterns(".lock"))
    config = (run / "config.json").read_text()
    (run / "config.json").write_text(config.replace('"vocab_size": 256', '"vocab_size": 512'))
    with compiles([]) as events, pytest.raises(ServeError, match="the run's config needs"):
        loaded_engine(run)
    assert EARLY not in events and not [t for t in threading.enumerate() if t.name == EARLY]


def test_a_stop_before_serving_knows_when_the_early_compile_is_still_running():
    """serve's exit on a signal before it serves goes past XLA's compiler (not through it, which aborts the
    process) exactly while EarlyEngine's thread is alive."""
    release = threading.Event()
    thread = threading.Thread(target=release.wait, name=EARLY, daemon=True)
    assert not compiling_early()
    thread.start()
    try:
        assert compiling_early()
    finally:
        release.set()
        thread.join(timeout=10)
    assert not compiling_early()
