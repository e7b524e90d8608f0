"""Every shell example of README.md and docs/ that claims to run is run by the suite, so the documentation
cannot drift from the tool.

What claims to run: a fenced block whose language is `bash`. (A `yaml` block is a file to write, a `text`
block is output; neither is a command. A `yaml` block whose first line is `# NAME.yaml` is the file the
examples call NAME.yaml: the cheap commands below run with it written.) Each line of a `bash` block
(continuations joined, `# ...` comments dropped, `&&` split) must be one of these, and is checked as it says:

- `moe-tpu ...`, `python -m trainer[.prepare|.sample|.serve|.serve.evaluate|.hf] ...`: parsed on the real
  Click command tree with `make_context`, group by group down to the command (an unknown command, option or
  bad value fails here; nothing runs). The commands that hand their arguments to the trainer's own command
  line (`train`, `sample`, `serve`, `eval`, `hf`, `data prepare`) are parsed again by that command.
  Then it runs in the suite, one of two ways:
  - CHEAP commands (`plan`, `validate`, `--help`) whose files are in the repository or the docs run right
    here, in this process through the real entry point; they must exit 0, and `# ` lines under one in its
    block (its output as the docs show it) must be in what it printed (a trailing `...` marks an output cut
    short).
  - every other one is in RUN_BY, which names the test that runs that command: the test must exist in the
    file named, and the file must hold as string literals the command's words (`slice`, `up`, the root flags,
    each option given, under any of its names) and name every repository file the example names (e.g.
    `serve-vertex.yaml`). Values (paths to your own files, prompts, step counts, task names) are
    placeholders: the test may run the command with its own. A command that the trainer's own command line
    parses may be run as that command (`train_command`, `hf_group` with `import`): the words are then those
    after it. A RUN_BY entry no example uses fails too.
- `pip install` / `python3 -m pip install -e '.[A,B]'`: every extra is one of pyproject.toml's.
- `python3 -m pytest -q`: the README's second quickstart command (the suite itself).
- `PYTHONPATH=. python benchmarks/NAME.py ...`: the script exists and declares every flag given (its
  `add_argument` calls). Benchmarks are not run by the suite (each measures for minutes): parsed only.
- `curl localhost:8000/PATH ...`: the server registers PATH.

Any other line fails the test. Cost: parsing (no process, no compilation) and the cheap commands'
in-process runs, a few seconds with the session's plan cache.
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
import shlex
import tomllib
from pathlib import Path

import click
import pytest

from provision.cli import cli
from tests.control.cli_helpers import invoke

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# The trainer's own command behind each command line that hands its arguments on.
TRAINER_SIDE = {"train": "trainer.cli", "sample": "trainer.sample", "serve": "trainer.serve.cli",
                "eval": "trainer.serve.evaluate", "hf": "trainer.hf.cli", "data prepare": "trainer.prepare"}
PYTHON_M = {"trainer": "train", "trainer.prepare": "data prepare", "trainer.sample": "sample",
            "trainer.serve": "serve", "trainer.serve.evaluate": "eval", "trainer.hf": "hf"}
CHEAP = {"plan", "validate"}

# Example command (as shlex.join writes it, comments dropped) -> the test that runs it.
SV, SG = "tests/control/test_serve_vertex.py", "tests/control/test_serve_gke_dry_run.py"
RUN = "tests/control/test_run.py::test_run_trains_and_tears_down"
HF_TUNE = ("tests/trainer/test_hf_use.py::"
           "test_fine_tune_on_eight_devices_then_export_serves_and_loads_as_transformers_computes")
DEPLOYED = f"{SV}::test_deploy_predict_down_through_the_real_api"  # and `eval` local and --endpoint, through it
TRAINED = "tests/trainer/test_trainer_train.py::test_rerunning_a_finished_run_says_so_without_compiling"
JOBS = "tests/control/test_jobs.py::test_cli_submit_wait_then_status_down_list"
SLICE = "tests/control/test_cli.py::test_dry_run_lifecycle_json_documents"
LWS = f"{SG}::test_deploy_predict_down_a_leaderworkerset"
SERVED = "tests/trainer/test_serve_cli.py::test_a_served_process_frees_a_gone_clients_slot_and_drains_on_sigterm"
RUN_BY = {
    # the README
    "moe-tpu --dry-run run --config examples/v5e-64.yaml": RUN,
    "moe-tpu hf import ./Qwen3-30B-A3B -o runs/qwen3":
        "tests/trainer/test_hf_deepseek.py::test_the_multi_token_prediction_layer_is_skipped_with_a_note",
    "moe-tpu sample --checkpoint runs/qwen3 --prompt 'The cat' --temperature 0":
        "tests/trainer/test_hf_use.py::"
        "test_sample_reads_a_fine_tuned_import_with_its_own_tokenizer_as_transformers_reads_its_export",
    "moe-tpu data prepare 'corpus/*.jsonl' -o data/corpus --tokenizer runs/qwen3/hf/tokenizer.json":
        "tests/trainer/test_trainer_prepare.py::test_jsonl_text_and_parquet_in_shards_and_a_manifest_out",
    "moe-tpu train --config runs/qwen3/config.json --init-from runs/qwen3 --output-dir runs/qwen3-tuned --set "
    "data.source=records --set data.path=data/corpus --steps 200": HF_TUNE,
    "moe-tpu eval --checkpoint runs/qwen3-tuned --tasks arc_easy --limit 100": DEPLOYED,
    "moe-tpu serve --checkpoint runs/qwen3-tuned": SERVED,
    "moe-tpu --dry-run deploy -c serve.yaml": DEPLOYED,
    "moe-tpu --dry-run predict -c serve.yaml --prompt 'The cat' --max-tokens 16":
        DEPLOYED,
    "moe-tpu --dry-run eval --endpoint -c serve.yaml --tasks arc_easy --limit 20":
        DEPLOYED,
    "moe-tpu --dry-run down -c serve.yaml": DEPLOYED,
    # docs/running.md, docs/dry-runs.md, docs/reliability.md
    "moe-tpu --dry-run run -c examples/v5e-64.yaml": RUN,
    "moe-tpu --dry-run --scenario preempt run -c examples/v5e-64.yaml --restart":
        "tests/control/test_run.py::test_preemption_is_recovered_from_the_last_checkpoint",
    "moe-tpu --dry-run image build -c examples/v5e-64.yaml":
        "tests/control/test_image.py::test_dry_run_writes_the_context_and_prints_the_plan",
    "moe-tpu --dry-run run -c examples/vertex.yaml": RUN,
    "moe-tpu --dry-run job submit -c examples/vertex.yaml --wait": JOBS,
    "moe-tpu --dry-run down -c examples/vertex.yaml": JOBS,
    "moe-tpu --dry-run run -c examples/gke.yaml":
        "tests/control/test_gke.py::test_run_preempt_restarts_the_jobset_and_resumes_from_a_checkpoint",
    "moe-tpu --dry-run run -c examples/gke-pathways.yaml":
        "tests/control/test_gke.py::test_run_pathways_trains_and_leaves_nothing",
    "moe-tpu --dry-run slice up -c examples/v5e-64.yaml": SLICE,
    "moe-tpu --dry-run --scenario stockout slice up -c examples/v5e-64.yaml":
        "tests/control/test_cli.py::test_the_example_fails_over_to_its_second_zone_on_stockout",
    "moe-tpu --dry-run --output json slice status -c examples/v5e-64.yaml": SLICE,
    "moe-tpu --dry-run down -c examples/v5e-64.yaml": SLICE,
    "moe-tpu --dry-run logs --plot run.png":
        "tests/control/test_goodput_plot.py::test_a_preempted_dry_run_reports_goodput_and_its_logs_plot_to_a_png",
    # docs/deploying.md
    "moe-tpu --dry-run deploy -c examples/serve-vertex.yaml": DEPLOYED,
    "moe-tpu --dry-run eval --endpoint -c examples/serve-vertex.yaml --tasks arc_easy --limit 20":
        DEPLOYED,
    "moe-tpu --dry-run predict --prompt '1 2 3' --max-tokens 16": DEPLOYED,
    "moe-tpu --dry-run down": DEPLOYED,
    "moe-tpu --dry-run deploy -c examples/serve-gke.yaml": f"{SG}::test_deploy_predict_down_on_gke",
    "moe-tpu --dry-run deploy -c examples/serve-gke-multihost.yaml": LWS,
    "moe-tpu --dry-run predict -c examples/serve-gke-multihost.yaml --prompt '1 2 3'": LWS,
    "moe-tpu --dry-run down -c examples/serve-gke-multihost.yaml": LWS,
    # docs/hugging-face.md
    "moe-tpu data prepare 'corpus/*.jsonl' --tokenizer runs/qwen3/hf/tokenizer.json -o data/corpus-qwen3":
        "tests/trainer/test_trainer_prepare.py::test_jsonl_text_and_parquet_in_shards_and_a_manifest_out",
    "moe-tpu train --config runs/qwen3/config.json --init-from ./Qwen3-30B-A3B --output-dir runs/qwen3-tuned --set "
    "data.source=records --set data.path=data/corpus-qwen3 --set data.seq_len=2048": HF_TUNE,
    "moe-tpu hf export --checkpoint runs/qwen3-tuned -o exported/qwen3": HF_TUNE,
    # docs/serving.md
    "python -m trainer.serve --checkpoint runs/demo": SERVED,
    "moe-tpu serve --checkpoint runs/demo --warm-up smallest --port 8000": SERVED,
    "moe-tpu serve --checkpoint runs/demo --warm-up all": SERVED,
    "moe-tpu eval --checkpoint runs/demo --tasks arc_easy,hellaswag --limit 100": DEPLOYED,
    # docs/training.md
    "python -m trainer --config tiny --steps 20": TRAINED,
    "python -m trainer --config tiny --devices 8 --mesh data=2,expert=4 --steps 5":
        "tests/trainer/test_trainer_cli.py::test_expert_parallel_invariance_through_the_command_line",
    "python -m trainer --config tiny --steps 20 --output-dir runs/demo": TRAINED,
    "python -m trainer --config tiny --steps 10 --init-from runs/demo --output-dir runs/tuned":
        "tests/trainer/test_trainer_finetune.py::"
        "test_init_from_starts_a_new_run_from_another_runs_parameters_with_a_fresh_optimizer",
    "python -m trainer.prepare 'corpus/*.jsonl' -o data/corpus --vocab-size 8192":
        "tests/trainer/test_trainer_prepare.py::test_jsonl_text_and_parquet_in_shards_and_a_manifest_out",
    "python -m trainer --config tiny --set data.source=records --set data.path=data/corpus --set model.vocab_size=8192 "
    "--set data.eval_share=0.01 --set train.eval_every=100 --output-dir runs/demo":
        "tests/trainer/test_trainer_train.py::test_tiny_approaches_the_entropy_floor_of_the_markov_source",
    "python -m trainer.sample --checkpoint runs/demo --prompt 'The cat' --tokens 40":
        "tests/trainer/test_trainer_sample.py::test_a_trained_tiny_continues_the_source_with_allowed_transitions",
}
# Examples no test runs as written, and why: each is a gap to close, said here rather than hidden.
NOT_RUN = {
    "moe-tpu --dry-run run -c examples/moe-1.2t.yaml": "the LeaderWorkerSet dry run (test_serve_gke_dry_run.py) "
    "serves examples/v5e-64.yaml's run instead: a dry run of moe-1.2t's run is the same `run` on another config",
    "python -m trainer --config tiny --devices 8 --mesh expert=2,model=4 --steps 5": "training on a `model` axis is "
    "run through the trainer's functions (test_tensor_parallel.py, test_moe_balance.py); through the command line "
    "only a mesh it refuses",
}


def blocks(path: Path, language: str = "bash") -> list[tuple[int, list[str]]]:
    """The blocks of a page in that language: (line number of the fence, the block's lines)."""
    found, current, start = [], None, 0
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        fence = re.match(r"\s*```(\S*)", line)
        if fence and current is None:
            current, start = ([] if fence.group(1) == language else False), number
        elif fence:
            if current is not False:
                found.append((start, current))
            current = None
        elif current not in (None, False):
            current.append(line)
    return found


def commands(lines: list[str]) -> list[tuple[str, list[str]]]:
    """Each command of a block: (its text, the output lines shown under it as `# ...` comments)."""
    joined, pending = [], ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined.append(pending + line)
        pending = ""
    found: list[tuple[str, list[str]]] = []
    for line in joined:
        if line.startswith("# ") and found:
            found[-1][1].append(line[2:].strip())
        elif line.strip() and not line.startswith("#"):
            for part in line.split(" && "):
                found.append((shlex.join(shlex.split(part, comments=True)), []))
    return found


@functools.cache
def written_files() -> dict[str, str]:
    """The files the docs write out as `yaml` blocks that begin `# NAME.yaml`: name -> text."""
    found = {}
    for page in PAGES:
        for _, lines in blocks(page, "yaml"):
            name = re.fullmatch(r"# ([\w.-]+\.ya?ml)", lines[0].strip()) if lines else None
            if name:
                found[name.group(1)] = "\n".join(lines) + "\n"
    return found


def has_files(argv: list[str]) -> bool:
    written = written_files()
    return all((ROOT / f).is_file() or f in written for f in files_named(argv))


@functools.cache
def examples() -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    """(where, the command, the output shown) for every command of every `bash` block."""
    return tuple((f"{page.relative_to(ROOT)}:{start}", text, tuple(shown)) for page in PAGES
                 for start, lines in blocks(page) for text, shown in commands(lines))


# --- parsing on the real command tree ---------------------------------------------------------------------

def _rest(ctx: click.Context) -> list[str]:
    return [*getattr(ctx, "_protected_args", []), *ctx.args]


def _trainer_command(name: str) -> click.Command:
    module = importlib.import_module(TRAINER_SIDE[name])
    found = [v for v in vars(module).values() if isinstance(v, click.Command) and not isinstance(v, type)
             and v.name == name.split()[-1]]
    assert len(found) == 1, f"{TRAINER_SIDE[name]}: no single command {name!r}"
    return found[0]


def _walk(command: click.Command, name: str, args: list[str], parent: click.Context | None,
          path: list[str], seen: list[click.Context]) -> None:
    ctx = command.make_context(name, list(args), parent=parent)
    seen.append(ctx)
    if isinstance(command, click.Group):
        sub_name, sub, rest = command.resolve_command(ctx, _rest(ctx))
        path.append(sub_name)
        _walk(sub, sub_name, rest, ctx, path, seen)
        return
    joined = " ".join(path)
    if joined in TRAINER_SIDE and "args" in ctx.params:  # handed on: the trainer's command parses it
        served = ["--checkpoint", "RUN"] if ctx.params.get("endpoint") else []  # --endpoint adds the served run's
        _walk(_trainer_command(joined), joined, [*served, *ctx.params["args"]], None, path, seen)


def parse(argv: list[str]) -> tuple[list[str], list[click.Context]]:
    """The command path (['slice', 'up']) and the contexts made on the way; raises what Click raises."""
    path: list[str] = []
    seen: list[click.Context] = []
    if argv[0] == "moe-tpu":
        _walk(cli, "moe-tpu", argv[1:], None, path, seen)
    else:
        assert argv[:2] == ["python", "-m"] and argv[2] in PYTHON_M, argv
        path.extend(PYTHON_M[argv[2]].split())
        side = _trainer_command(PYTHON_M[argv[2]])
        _walk(side, PYTHON_M[argv[2]], argv[3:], None, path, seen)
    return path, seen


def option_names(contexts: list[click.Context], argv: list[str]) -> list[tuple[str, ...]]:
    """Every option the command line gives, each as all of its names (`('-c', '--config')`)."""
    given = []
    for ctx in contexts:
        for param in ctx.command.params:
            names = tuple(param.opts + param.secondary_opts) if isinstance(param, click.Option) else ()
            if any(a == n or a.startswith(n + "=") for a in argv for n in names):
                given.append(names)
    return given


# --- what the suite runs ----------------------------------------------------------------------------------

def _literals(path: Path) -> tuple[set[str], str, set[str]]:
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text)
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    tests = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    return strings, text, tests


def repository_files(argv: list[str]) -> list[str]:
    return [a for a in argv if re.match(r"[\w./-]+\.(ya?ml|json|py)$", a) and (ROOT / a).is_file()]


def _imported_helpers(path: Path) -> list[Path]:
    """The suite's own modules a test file imports (tests.control.cli_helpers, ...): where its commands are built."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    found = [ROOT / (name.replace(".", "/") + ".py") for name in names if name.startswith("tests.")]
    found += [path.parent / f"{name}.py" for name in names if "." not in name]  # `from cli_helpers import`
    return [p for p in found if p.is_file()]


def run_by_problems(text: str, argv: list[str]) -> list[str]:
    where = RUN_BY.get(text)
    if where is None:
        return [] if text in NOT_RUN else [f"`{text}`: no test named in RUN_BY runs it"]
    file, _, test = where.partition("::")
    strings, source, tests = _literals(ROOT / file)
    conftest = (ROOT / file).parent / "conftest.py"
    for helper in {*_imported_helpers(ROOT / file), conftest, *_imported_helpers(conftest)}:
        if helper.is_file():
            more, more_source, _ = _literals(helper)
            strings, source = strings | more, source + more_source
    if "moe-tpu.yaml" in strings:  # the suite's dry runs write the config where a command looks without -c
        strings = strings | {"-c"}
    problems = [] if test in tests else [f"{file} has no test {test}"]
    path, contexts = parse(argv)
    # A command handed to the trainer's own command line may be run as that command (`hf_group` with `import`).
    side = next((s.split() for s in TRAINER_SIDE if path[:len(s.split())] == s.split()), [])
    words = path[len(side):]
    problems += [f"{where} never says {w!r}" for w in words if w not in strings and not any(
        s.split()[:len(w.split())] == w.split() for s in strings)]
    problems += [f"{where} never gives {'/'.join(names)}" for names in option_names(contexts, argv)
                 if not any(n in strings or any(s.startswith(n + "=") for s in strings) for n in names)]
    problems += [f"{where} never names {Path(f).name}" for f in repository_files(argv) if Path(f).name not in source]
    return problems


def test_every_bash_block_line_is_a_command_the_suite_knows():
    problems = []
    for where, text, _ in examples():
        argv = shlex.split(text)
        while argv and re.match(r"[A-Z_]+=", argv[0]):  # PYTHONPATH=. python benchmarks/...
            argv = argv[1:]
        try:
            problems += [f"{where}: {p}" for p in check_line(argv, text)]
        except (click.ClickException, click.exceptions.Exit, AssertionError) as exc:
            problems.append(f"{where}: `{text}` does not parse: {getattr(exc, 'message', exc)}")
    assert problems == []


def check_line(argv: list[str], text: str) -> list[str]:
    head = argv[0]
    if head == "moe-tpu" or argv[:3] in (["python", "-m", m] for m in PYTHON_M):
        if "--help" in argv or "-h" in argv:
            return []  # run by test_the_cheap_examples_run_and_print_what_the_docs_show
        path, _ = parse(argv)
        if path[0] in CHEAP and has_files(argv):
            return []  # run there too
        return run_by_problems(text, argv)
    if head in ("pip", "python3", "python") and "install" in argv:
        return check_extras(argv)
    if argv[:3] == ["python3", "-m", "pytest"]:
        return []
    if head == "python" and argv[1:2] and argv[1].startswith("benchmarks/"):
        return check_benchmark(argv[1], argv[2:])
    if head == "curl":
        return check_route(argv)
    return [f"`{text}`: not a command the docs test knows how to check"]


def files_named(argv: list[str]) -> list[str]:
    return [a for a in argv if re.search(r"\.(ya?ml|json)$", a)]


def check_extras(argv: list[str]) -> list[str]:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    spec = next(a for a in argv if "[" in a)
    extras = re.search(r"\[([\w,-]+)\]", spec).group(1).split(",")
    return [f"`{' '.join(argv)}`: no extra {e!r} in pyproject.toml" for e in extras if e not in declared]


def check_benchmark(script: str, args: list[str]) -> list[str]:
    path = ROOT / script
    if not path.is_file():
        return [f"{script} does not exist"]
    declared = {a.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)
                and getattr(n.func, "attr", "") == "add_argument" for a in n.args if isinstance(a, ast.Constant)}
    return [f"{script} declares no {a}" for a in args if a.startswith("-") and a.split("=")[0] not in declared]


def check_route(argv: list[str]) -> list[str]:
    route = re.sub(r"^(https?://)?[\w.]+:\d+", "", next(a for a in argv[1:] if ":8000/" in a))
    routes = (ROOT / "trainer" / "serve" / "routes.py").read_text()
    return [] if f'"{route}"' in routes else [f"the server has no route {route}"]


def test_the_cheap_examples_run_and_print_what_the_docs_show(tmp_path, monkeypatch):
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # the examples' paths, and nothing written in the tree
    for name, text in written_files().items():
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    ran = 0
    for where, text, shown in examples():
        argv = shlex.split(text)
        if argv[0] != "moe-tpu":
            continue
        cheap = "--help" in argv or (parse(argv)[0][0] in CHEAP and has_files(argv))
        if not cheap:
            continue
        code, out, err = invoke(*argv[1:], env={"COLUMNS": "200"})
        assert code == 0, f"{where}: `{text}` exited {code}:\n{err[-2000:]}"
        said = " ".join((out + err).split())
        expected = " ".join(shown)
        expected = expected[:-3].rstrip() if expected.endswith("...") else expected
        assert " ".join(expected.split()) in said, f"{where}: `{text}` no longer prints {expected!r}"
        ran += 1
    assert ran >= 4


def test_every_run_by_entry_is_an_example():
    written = {text for _, text, _ in examples()}
    assert sorted((set(RUN_BY) | set(NOT_RUN)) - written) == []
    assert set(RUN_BY).isdisjoint(NOT_RUN)


@pytest.mark.parametrize("bad", [["moe-tpu", "deploy", "--no-such-flag"], ["moe-tpu", "slice", "upp"],
                                 ["moe-tpu", "serve", "--warm-up", "some"],
                                 ["python", "-m", "trainer", "--stepz", "1"]])
def test_a_command_the_tool_does_not_have_fails_to_parse(bad):
    """The check above is not vacuous: what the tool would refuse, parsing refuses."""
    with pytest.raises(click.UsageError):
        parse(bad)


def _anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_docs_links_resolve():
    """A link between the pages names a file that exists and, after `#`, one of its headings: moving a
    section cannot leave a link behind."""
    broken = []
    for page in PAGES:
        for target, anchor in re.findall(r"\]\(([\w./-]+\.md)(?:#([\w-]+))?\)", page.read_text(encoding="utf-8")):
            linked = (page.parent / target).resolve()
            headings = [] if not linked.is_file() else [
                _anchor(h) for h in re.findall(r"^#+ (.*)$", linked.read_text(encoding="utf-8"), re.M)]
            if not linked.is_file() or (anchor and anchor not in headings):
                broken.append(f"{page.relative_to(ROOT)}: {target}#{anchor}")
    assert broken == []
