"""Runs that several test modules assert on, trained once per test session; XLA's optimisations off
where they cost more than they save."""

import contextlib
import fcntl
import json
from types import SimpleNamespace

import pytest
from click.testing import CliRunner


def once_per_run(tmp_path_factory, worker_id, name: str, make) -> tuple:
    """`make(directory)`'s printed output, made once per test run, not once per pytest-xdist worker: the
    first worker to ask makes it in a directory all workers share (the run's base temporary directory),
    under a lock the others wait on. Returns (that directory, what `make` printed)."""
    import jax

    # jax started here with the test session's 8 fake devices: a command's `--devices 1` would otherwise
    # start it with one, for every later test of this worker.
    jax.devices()
    shared = tmp_path_factory.getbasetemp() if worker_id == "master" else tmp_path_factory.getbasetemp().parent
    tmp = shared / name
    tmp.mkdir(exist_ok=True)
    printed = tmp / "output.txt"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not printed.exists():
            printed.write_text(make(tmp))
    return tmp, printed.read_text()


@pytest.fixture(scope="session")
def trained_tiny(tmp_path_factory, worker_id):
    """`tiny` trained 120 steps on one device through the command line, as a user runs it: its output
    directory (checkpoint at step 120, config.json), its metric rows and what it printed. Read it, never
    write into it: the tests that share it run in any order. Trained once per test run (once_per_run)."""
    from trainer.cli import train_command

    def make(tmp):
        result = CliRunner().invoke(train_command, [
            "--config", "tiny", "--devices", "1", "--steps", "120", "--output-dir", str(tmp / "run"),
            "--metrics", str(tmp / "m.jsonl")])
        assert result.exit_code == 0, result.output
        return result.output

    tmp, printed = once_per_run(tmp_path_factory, worker_id, "trained-tiny", make)
    rows = [json.loads(line) for line in (tmp / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 121))
    return SimpleNamespace(output_dir=tmp / "run", rows=rows, output=printed)


@pytest.fixture(scope="session")
def trained_on_prepared(tmp_path_factory, worker_id):
    """`tiny` trained 150 steps through the command line on a corpus that `data prepare` made (4,000 short
    English-like documents, a byte-level BPE of 320 tokens, 5% held out and evaluated every 50 steps, steps
    3-5 profiled; data.path given relative to the directory it trained in): its dataset, its output directory
    and the records arguments it trained with (data.path absolute). Read them, never write into them. Trained once
    per test run (once_per_run)."""
    from text_corpus import corpus
    from trainer.cli import train_command
    from trainer.prepare import prepare_command

    def records(tmp):
        return ["--config", "tiny", "--devices", "1", "--set", "data.source=records", "--set",
                f"data.path={tmp / 'ds'}", "--set", "data.eval_share=0.05"]

    def make(tmp):
        import os

        (tmp / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus(4000)))
        prepared = CliRunner().invoke(prepare_command, [str(tmp / "docs.jsonl"), "-o", str(tmp / "ds"),
                                                        "--vocab-size", "320", "--quiet"])
        assert prepared.exit_code == 0, prepared.output
        here = os.getcwd()
        os.chdir(tmp)  # data.path given relative to the directory trained in, as the README writes it
        try:
            result = CliRunner().invoke(train_command, [
                *records(tmp), "--set", "data.path=ds", "--set", "model.vocab_size=320", "--set",
                "train.eval_every=50", "--set", "train.eval_batches=2", "--set", "train.log_every=10",
                "--set", "train.profile_steps=[3, 5]", "--steps", "150", "--output-dir", str(tmp / "out"),
                "--metrics", str(tmp / "m.jsonl")])
        finally:
            os.chdir(here)
        assert result.exit_code == 0, result.output
        return result.output

    tmp, printed = once_per_run(tmp_path_factory, worker_id, "trained-on-prepared", make)
    return SimpleNamespace(dataset=tmp / "ds", output_dir=tmp / "out", records_args=records(tmp), output=printed)


# Modules whose tests each compile several small programs (oracles, sharded blocks on 8 fake devices,
# compiled HLO read for its collectives, trainers stopped after a few steps) and run each briefly: there
# XLA's optimisation passes take longer than the programs they speed up. Measured on 2 cores, one module
# at a time with a cold compilation cache, CPU seconds with them and without: test_moe_parallel +
# test_moe_structure 264 -> 189, test_moe_layer + test_moe_routing + test_trainer_model 88 -> 58,
# test_trainer_cli 93 -> 69, test_trainer_multiprocess 30 -> 19, test_trainer_sample 41 -> 35. Modules
# that train for hundreds of steps keep them (test_moe_balance's 300-step runs take twice as long
# without; test_trainer_train and test_trainer_prepare gain nothing). The variable reaches the trainers
# the tests start as processes. test_hf_use's module fixture fine-tunes 20 steps on 8 devices (its train step
# compiled in 53 s with them, far longer than its steps run). test_trainer_finetune's runs train a step or two
# each, compiled anew (its module alone, twice each way: 38, 37 -> 32, 31 CPU s; its changed-data test 7.9 -> 3.2).
COMPILE_BOUND = {"test_moe_parallel", "test_moe_structure", "test_moe_layer", "test_moe_routing",
                 "test_trainer_model", "test_trainer_cli", "test_trainer_multiprocess", "test_trainer_sample",
                 "test_hf_use", "test_kernels", "test_trainer_finetune"}


@contextlib.contextmanager
def fewer_xla_optimisations():
    """Most of XLA's optimisations off for what compiles in this process meanwhile and in the processes it
    starts (XLA's CPU code generator for the whole suite: tests/conftest.py)."""
    import jax

    if jax.config.read("jax_disable_most_optimizations"):
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
        jax.config.update("jax_disable_most_optimizations", True)
        try:
            yield
        finally:
            jax.config.update("jax_disable_most_optimizations", False)


def _compile_bound(node) -> bool:
    return (node.module.__name__.rsplit(".", 1)[-1] in COMPILE_BOUND
            or node.get_closest_marker("compile_bound") is not None)


# Module-scoped: pytest sets up a module's wider-scoped fixtures before any function-scoped one, so a switch
# of function scope alone came too late for them (test_serve_engine's engine compiled its nine programs
# optimised, 23 CPU s where 9 do).
@pytest.fixture(autouse=True, scope="module")
def fewer_xla_optimisations_where_a_module_compiles_mostly(request):
    """For the modules above and those marked `compile_bound` as a whole, their module fixtures included."""
    if _compile_bound(request.node):
        with fewer_xla_optimisations():
            yield
    else:
        yield


@pytest.fixture(autouse=True)
def fewer_xla_optimisations_where_compiling_dominates(request):
    """For the tests marked `compile_bound` in other modules."""
    if _compile_bound(request.node):
        with fewer_xla_optimisations():
            yield
    else:
        yield


@pytest.fixture
def own_compilation_cache(tmp_path):
    """jax's persistent compilation cache in a directory of this test's while it runs (the suite's again after):
    what it compiles is compiled here, not served from another test's programs, so that trainer/program_cache.py
    keeps it (it keeps only programs compiled in its process). Yields the directory."""
    import jax
    from jax._src import compilation_cache

    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "cache"))
    compilation_cache.reset_cache()
    try:
        yield tmp_path / "cache"
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
        compilation_cache.reset_cache()


def byte_codec():
    return (lambda text: list(text.encode("utf-8")),
            lambda ids: bytes(i for i in ids if i < 256).decode("utf-8", errors="replace"))


@pytest.fixture(scope="session")
def served():
    """`tiny` behind the server (bytes as tokens), its engine warmed up; the client is a TestClient. Shared by
    the server's test modules: a test that changes the state or the engine puts it back.

    The model and the engine's shapes are test_serve_engine.py's: the run's persistent compilation cache
    (tests/conftest.py) then holds all four programs (initialisation, prefill, decode) when that module ran
    first, in either pytest-xdist worker."""
    import jax
    from fastapi.testclient import TestClient

    from trainer import sharding
    from trainer.config import load_config
    from trainer.serve.engine import Engine
    from trainer.serve.loop import EngineLoop
    from trainer.serve.server import ServerState, create_app
    from trainer.serve.weights import build_serving_model, init_weights

    cfg = load_config("tiny", ["model.num_kv_heads=2"])
    model = build_serving_model(cfg, sharding.make_mesh({"data": 1, "expert": 1}, jax.devices()[:1]))
    encode, decode = byte_codec()
    engine = Engine(model, init_weights(model), slots=8, max_len=288, chunk=16, detokenize=decode, prefix_cache=512)
    with fewer_xla_optimisations():  # as its modules compile (all compile_bound), and test_serve_engine's programs
        engine.warm_up()
    state = ServerState("tiny", encode=encode, decode=decode, max_waiting=8)
    app = create_app(state)
    with TestClient(app) as client:
        assert client.get("/health").status_code == 503  # not loaded yet
        state.loop = EngineLoop(engine).start()
        try:
            yield client, state
        finally:
            state.loop.stop()
