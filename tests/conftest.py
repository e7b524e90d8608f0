"""Test-wide setup: CPU only, eight fake XLA devices and a compilation cache, set before anything imports jax."""

import importlib.util
import os
import re

_flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
# XLA's CPU compiler, set for every process of the run (the trainers and servers the tests start inherit it):
# - Code generation on one thread: split over threads with a worker a core busy, it costs more CPU than it
#   saves time (test_moe_structure + test_scan 42.0 -> 38.1 CPU seconds).
# - Its older emitters and LLVM's optimisation level 1 rather than 2: the suite's programs are small and run
#   for seconds at most, so compiling them is the cost. Unoptimised programs compile about three times
#   faster (benchmarks/xla_cpu_compile.py); a tiny train step with XLA's optimisations on 35% faster, for 15%
#   more per step (test_moe_balance's 20-step run 10.3 -> 6.4 CPU s, its 150-step one 14.9 -> 10.8), with
#   the same losses to the bit. The whole suite, with the serving tests' compile cuts made beside it:
#   1,361 -> 1,092 CPU s, pytest 564 s on 2 cores.
_flags = re.sub(r"--xla_cpu_parallel_codegen_split_count=\d+", "", _flags)
_flags = re.sub(r"--xla_cpu_use_fusion_emitters=\S+|--xla_backend_optimization_level=\d+", "", _flags)
os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8"
                           " --xla_cpu_parallel_codegen_split_count=1"
                           " --xla_cpu_use_fusion_emitters=false --xla_backend_optimization_level=1").strip()
# CPU only, but for the `tpu` tests on a chip (MOE_TPU_TESTS=1, tests/trainer/test_tpu.py): the chip, and the
# CPU beside it for their references. MOE_TPU_TESTS=cpu runs those tests with a CPU device for the chip.
os.environ["JAX_PLATFORMS"] = "tpu,cpu" if os.environ.get("MOE_TPU_TESTS") == "1" else "cpu"
# gcsfs reads this once, at import, and with it on asks a real GCS endpoint over gRPC for a bucket's type: off
# for the whole run, so that the fake GCS server's tests pass whichever test imported gcsfs first.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
os.environ.setdefault("NO_COLOR", "1")

# A suite started in the background by a non-interactive shell (`.ci/run &`, some CI runners) begins with
# SIGINT ignored, and every process it starts would inherit that: the tests that press Ctrl-C on a
# command would then see it run on. Python's own handler is reset to the default in the processes it
# starts, so putting it back here lets them hear Ctrl-C as a user's terminal delivers it.
import signal  # noqa: E402

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# --- one persistent XLA compilation cache for the whole run ---------------------------------------
# Many tests compile the same programs (tiny's train step on one device, its initialisation) and XLA
# takes seconds for each on a CPU; a cache hit takes a fraction of that. The cache lives in a directory
# of this run alone, removed when the run ends: this process, the trainers it starts and pytest-xdist's
# workers inherit the variables, so every one of them reuses what another compiled first.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="moe-tpu-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


# --- the suite never writes into the checkout ------------------------------------------------
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

CHECKOUT = Path(__file__).resolve().parents[1]


def _checkout_state() -> tuple:
    """What a test could leave behind in the checkout: git's view (ignored files left out) and every
    file of the dry-run state directory, which git ignores."""
    try:
        git = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=CHECKOUT,
                             capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        git = ""
    state = CHECKOUT / ".moe-tpu"
    files = sorted((str(p.relative_to(CHECKOUT)), p.stat().st_size, p.stat().st_mtime_ns)
                   for p in state.rglob("*") if p.is_file()) if state.is_dir() else []
    return git, files


@pytest.fixture(autouse=True, scope="session")
def checkout_unchanged():
    """Fails the session (an error at the last test's teardown) when the suite changed the checkout."""
    before = _checkout_state()
    yield
    after = _checkout_state()
    assert after == before, f"the test suite changed the checkout {CHECKOUT}: before {before}, after {after}"


@pytest.fixture(autouse=True)
def _elsewhere(tmp_path_factory, monkeypatch):
    """Every test runs in a fresh working directory of its own, never in the checkout: a command that
    keeps state where it runs (.moe-tpu/last-config) keeps it there."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


# --- the longest files start first ------------------------------------------------------------
# pytest-xdist hands each worker whole files (--dist loadfile) in collection order; a long file handed
# out last keeps one worker busy while the others have nothing left. Longest first keeps that tail short:
# every file of 8 s or more (worker seconds from a whole run's --junitxml on 2 cores, session fixtures
# counted where they are first asked for; last measured 2026-12-07, when six files of 20-91 s added since had
# gone unlisted and so started after all of these), longest first; the rest keep their order after them. The
# multi-host file goes first: its processes wait on each other, and the others' work fills the wait.
# test_terraform.py (93 s on a new machine, nearly all of it making checkov's environment) is left out: that
# is made on a thread from the session's start (below), and the file's own tests take 3 s.
LONGEST_FIRST = (
    "trainer/test_serve_multihost.py", "trainer/test_tensor_parallel.py", "trainer/test_moe_parallel.py",
    "trainer/test_hf_oracle.py", "control/test_run.py", "trainer/test_serve_engine.py",
    "trainer/test_moe_balance.py", "trainer/test_trainer_train.py", "trainer/test_hf_deepseek.py",
    "trainer/test_serve_quant.py", "trainer/test_hf_gpt_oss.py", "control/test_plan.py", "trainer/test_hf_use.py",
    "control/test_serve_vertex.py", "trainer/test_moe_structure.py", "trainer/test_trainer_cli.py",
    "control/test_gke.py", "trainer/test_serve_cli.py", "control/test_serve_gke_dry_run.py",
    "trainer/test_scan.py", "trainer/test_trainer_prepare.py", "trainer/test_serve_window.py",
    "control/test_run_signals.py", "trainer/test_kernels.py", "control/test_cli.py", "trainer/test_hf_errors.py",
    "trainer/test_serve_openai.py", "control/test_hardening.py", "trainer/test_trainer_finetune.py",
    "control/test_plan_words.py", "trainer/test_moe_layer.py", "trainer/test_moe_routing.py",
    "trainer/test_hf_named.py", "control/test_two_runs.py", "control/test_plan_serve.py",
    "trainer/test_trainer_multiprocess.py", "trainer/test_trainer_model.py", "trainer/test_serve_startup.py",
    "trainer/test_sample_limits.py", "trainer/test_trainer_untrusted.py", "trainer/test_serve_structured.py",
    "control/test_image.py", "control/test_jobs.py", "control/test_gke_serve.py",
    "trainer/test_serve_tensor_parallel.py", "trainer/test_trainer_packaging.py", "trainer/test_trainer_gcs.py",
    "trainer/test_serve_evaluate.py", "control/test_workload_teardown.py", "trainer/test_quant_rows.py",
    "control/test_goodput_plot.py", "control/test_house.py", "control/test_lifecycle.py",
    "trainer/test_trainer_sample.py", "control/test_extras.py", "control/test_docs_examples.py")


if importlib.util.find_spec("xdist") is not None:  # a TPU host runs the `tpu` tests with plain pytest
    def pytest_xdist_auto_num_workers(config) -> int:
        """`-n auto`: a worker more than the cores. Many tests spend much of their time waiting (on a trainer
        or server subprocess, an emulator's poll, a lock), and a worker that waits leaves its core idle."""
        return (os.cpu_count() or 1) + 1


def pytest_configure(config):
    """pytest-xdist hands out the files with the most tests first unless told otherwise (its
    `--loadscope-reorder`, on by default), whatever order the items below come in: a long file of few tests
    (test_two_runs.py has 3) then starts near the end. The order below is the one wanted."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


# --- checkov's environment, made while the suite runs ----------------------------------------------
# On a machine without it (every CI run), making checkov's environment (tests/isolated_tools.py) took 89 s
# of one worker at test_terraform's fixture, mostly waiting on the package index, and that file is handed
# out late. The session's first process (pytest-xdist's controller, which runs no test) starts it on a thread
# instead, so the wait overlaps the other files' work; the fixture then finds it made, or waits on the same
# lock for the rest. Only where the run includes test_terraform.py; the session's end waits for it unless
# interrupted (pip left running would go on writing into an environment the next run makes again).
_making_checkov: list = []
_TERRAFORM_TESTS = Path(__file__).resolve().parent / "control" / "test_terraform.py"


def _runs_terraform_tests(config) -> bool:
    """Whether a path the run was given (or its testpaths, relative to the root) holds test_terraform.py."""
    for arg in config.args:
        for base in (Path(config.invocation_params.dir), config.rootpath):
            path = (base / arg.split("::", 1)[0]).resolve()
            if path == _TERRAFORM_TESTS or path in _TERRAFORM_TESTS.parents:
                return True
    return False


def pytest_sessionstart(session):
    if hasattr(session.config, "workerinput") or not _runs_terraform_tests(session.config):
        return
    import threading

    import isolated_tools

    def make():
        try:
            isolated_tools.executable("checkov", isolated_tools.CHECKOV)
        except Exception:  # noqa: BLE001 - the fixture tries again and reports what fails
            pass

    thread = threading.Thread(target=make, name="make-checkov", daemon=True)
    thread.start()
    _making_checkov.append(thread)


def pytest_sessionfinish(session, exitstatus):
    if exitstatus != pytest.ExitCode.INTERRUPTED:  # Ctrl-C is not kept waiting on the package index
        for thread in _making_checkov:
            thread.join()


def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        path = item.nodeid.split("::", 1)[0].removeprefix("tests/")
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: within a file and among the rest, the collected order stays
    if os.environ.get("MOE_TPU_TESTS") not in ("1", "cpu"):
        skip = pytest.mark.skip(reason="a TPU test: set MOE_TPU_TESTS=1 on a machine with a chip")
        for item in items:
            if item.get_closest_marker("tpu") is not None:
                item.add_marker(skip)
