"""The `moe-tpu` command. Subcommands load lazily so `--help` imports neither jax nor google.cloud."""

from __future__ import annotations

import importlib
import os
import sys

import click
from click.core import ParameterSource

from provision.app import App
from provision.errors import MissingDependency, MoeTpuError, UsageError

# name -> "module:attribute"; a command appears here only once it is built.
COMMANDS: dict[str, str] = {
    "init": "provision.cli.config_cmds:init",
    "validate": "provision.cli.config_cmds:validate",
    "render": "provision.cli.config_cmds:render",
    "plan": "provision.cli.plan_cmd:plan",
    "image": "provision.cli.image_cmd:image",
    "slice": "provision.cli.kind_cmds:slice",
    "job": "provision.cli.kind_cmds:job",
    "gke": "provision.cli.kind_cmds:gke",
    "run": "provision.cli.run_cmd:run",
    "logs": "provision.cli.logs_cmd:logs",
    "up": "provision.cli.lifecycle_cmds:up",
    "status": "provision.cli.lifecycle_cmds:status",
    "list": "provision.cli.lifecycle_cmds:list_cmd",
    "down": "provision.cli.lifecycle_cmds:down",
    "emulator": "provision.cli.emulator_cmd:emulator",
    "train": "provision.cli.train_cmd:train",
    "data": "provision.cli.data_cmds:data_group",
    "sample": "provision.cli.data_cmds:sample",
    "serve": "provision.cli.serve_cmd:serve",
    "eval": "provision.cli.serve_cmd:evaluate",
    "hf": "provision.cli.hf_cmd:hf",
    "deploy": "provision.cli.deploy_cmd:deploy",
    "predict": "provision.cli.deploy_cmd:predict",
}

SHORT_HELP = {
    "init": "Write a commented starter moe-tpu.yaml.",
    "validate": "Check the config and render every template; list all problems.",
    "render": "Write every rendered template and request body to a directory.",
    "plan": "Memory per chip, step-time bound, MFU ceiling, cost per hour and per run.",
    "image": "The trainer's container image: build (local docker or Cloud Build) and push.",
    "up": "Make what the config's target asks for (any kind) and wait until it is up.",
    "status": "What of the run exists on its target (any kind), with state and cost.",
    "slice": "TPU v5e queued-resource lifecycle: up, status, down.",
    "job": "Vertex AI custom job lifecycle: submit, status, wait, cancel.",
    "gke": "GKE node pool lifecycle (and the cluster when asked): up, status, down.",
    "run": "The main job: provision, train, follow, recover from preemption, tear down.",
    "logs": "The run's trainer output and metrics, from wherever they are.",
    "list": "Every resource this tool manages, with state, age and cost so far.",
    "down": "Delete every resource of the run, also after a crash, and verify.",
    "emulator": "The embedded Cloud TPU and Vertex AI API emulator as a standalone server.",
    "train": "Run the MoE trainer locally (the container's entry point).",
    "data": "Datasets for the trainer: prepare (tokenize into ArrayRecord shards).",
    "sample": "Continue a prompt with a run's latest checkpoint.",
    "serve": "Serve a run's latest checkpoint over an OpenAI-compatible API.",
    "eval": "Evaluate a run's checkpoint with lm-evaluation-harness through the engine.",
    "hf": "Hugging Face checkpoints (Mixtral, Qwen-MoE, OLMoE): import and export.",
    "deploy": "Serve the run's checkpoint on a Vertex AI endpoint or GKE; wait until healthy.",
    "predict": "Send a prompt to the deployed model through the platform's API.",
}


class Invocation:
    """What `main` keeps of one command: its App, once the group made it (the errors after click
    returns are reported through it)."""

    app: App | None = None


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, attr = COMMANDS[name].split(":")
        return getattr(importlib.import_module(module), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(n, SHORT_HELP.get(n, "")) for n in self.list_commands(ctx)]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


EPILOG = """\b
Examples:
  moe-tpu init                                   # write moe-tpu.yaml
  moe-tpu --dry-run slice up -c examples/v5e-64.yaml
  moe-tpu --dry-run --output json slice status -c examples/v5e-64.yaml
  moe-tpu --dry-run --scenario stockout slice up -c examples/v5e-64.yaml
  moe-tpu --dry-run down -c examples/v5e-64.yaml
"""


@click.group(cls=LazyGroup, context_settings={"auto_envvar_prefix": "MOE_TPU",
                                               "help_option_names": ["-h", "--help"]},
             epilog=EPILOG)
@click.option("--dry-run", is_flag=True, envvar="MOE_TPU_DRY_RUN",
              help="Talk to the embedded emulator instead of Google Cloud (no account, no network).")
@click.option("--scenario", default="happy", envvar="MOE_TPU_SCENARIO", show_default=True,
              help="Dry run only: happy, stockout, long-queue, quota, flaky, preempt.")
@click.option("--output", type=click.Choice(["text", "json"]), default="text", envvar="MOE_TPU_OUTPUT",
              show_default=True, help="json: one JSON document on stdout, progress on stderr.")
@click.option("-v", "--verbose", count=True, help="More detail; -vv shows every RPC.")
@click.option("--templates", "templates_dir", type=click.Path(file_okay=False), envvar="MOE_TPU_TEMPLATES",
              help="Use your own copies of the templates from this directory.")
@click.version_option(package_name="moe-tpu")
@click.pass_context
def cli(ctx: click.Context, dry_run: bool, scenario: str, output: str, verbose: int,
        templates_dir: str | None) -> None:
    """moe-tpu: train Mixture-of-Experts models on Cloud TPU v5e from one config file."""
    app = App(dry_run=dry_run, scenario=scenario, output=output, verbose=verbose, templates_dir=templates_dir)
    if isinstance(ctx.obj, Invocation):
        ctx.obj.app = app
    ctx.obj = app
    ctx.call_on_close(ctx.obj.close)
    # The emulator's own commands take the scenario as is; every other command only in a dry run.
    scenario_given = ctx.get_parameter_source("scenario") not in (None, ParameterSource.DEFAULT)
    if scenario_given and not dry_run and ctx.invoked_subcommand != "emulator":
        raise UsageError(f"--scenario {scenario} only applies to a dry run",
                         hint="add --dry-run (or MOE_TPU_DRY_RUN=1), or drop --scenario / MOE_TPU_SCENARIO")


def _name_the_variable(exc: click.BadParameter, args: list[str]) -> None:
    """A bad value that came from an environment variable names the variable, not the flag."""
    ctx, param = exc.ctx, exc.param
    if ctx is None or not isinstance(param, click.Option) or not param.name:
        return
    on_command_line = any(arg == opt or arg.startswith(f"{opt}=") for arg in args for opt in param.opts)
    if not on_command_line:
        names = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or [])
        if not names and ctx.auto_envvar_prefix:
            names = [f"{ctx.auto_envvar_prefix}_{param.name.upper()}"]
        envvar = next((name for name in names if os.environ.get(name) is not None), None)
        if envvar:
            exc.param_hint = f"environment variable {envvar}"


def main(argv: list[str] | None = None) -> None:
    """Entry point: every failure becomes a message and an exit code, never a traceback."""
    # gRPC's C core logs on stderr past the console (connection events at INFO, a busy port at
    # ERROR); every failure it logs also reaches us as an exception that the console reports with
    # a fix. Set before grpc is imported; a user's value (e.g. GRPC_VERBOSITY=debug) wins.
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    invocation = Invocation()
    try:
        rv = cli.main(args=argv, prog_name="moe-tpu", standalone_mode=False, obj=invocation)
    except (click.exceptions.Abort, KeyboardInterrupt):
        App.report_interrupt(invocation.app)
        sys.exit(130)
    except click.BadParameter as exc:
        _name_the_variable(exc, list(sys.argv[1:] if argv is None else argv))
        exc.show()
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except MoeTpuError as exc:
        App.report_error(invocation.app, exc)
        sys.exit(exc.exit_code)
    except ModuleNotFoundError as exc:  # an extra that this install lacks
        missing = MissingDependency.of(exc)
        if missing is None:
            App.report_unexpected(invocation.app, exc)
            sys.exit(1)
        App.report_error(invocation.app, missing)
        sys.exit(missing.exit_code)
    except Exception as exc:  # the last line of defence: a message, not a traceback
        App.report_unexpected(invocation.app, exc)
        sys.exit(1)
    sys.exit(rv if isinstance(rv, int) else 0)
