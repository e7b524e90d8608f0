"""The container as one contract: which of the image's commands runs, with what arguments, environment
and ports. Every renderer (the TPU VM startup script, the Vertex AI CustomJob, the GKE JobSet) and the
dry run's local workload take a `Container` from here; none assembles an argv of its own.

The image holds two commands: the trainer (`python -m trainer`, also the image's entry point) and the
server (`python -m trainer.serve`). A training workload runs the first, a service the second.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from provision.config_sections import Config

TRAINER_COMMAND = ("python", "-m", "trainer")
SERVER_COMMAND = ("python", "-m", "trainer.serve")
# The port the server listens on in its container; Vertex AI passes it as AIP_HTTP_PORT.
SERVER_PORT = 8080
RUN_ENV = "MOE_TPU_RUN"  # every container of a run carries the run's name


@dataclass(frozen=True)
class Container:
    """One container of a run: the image, the command (one of the image's two), its arguments, its
    environment and the ports it listens on."""

    image: str
    command: tuple[str, ...]
    args: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    ports: tuple[int, ...] = ()

    @property
    def argv(self) -> tuple[str, ...]:
        return (*self.command, *self.args)

    def with_env(self, **env: str) -> Container:
        """The same container with more environment (a renderer's own, e.g. a Pathways proxy's timeout)."""
        return replace(self, env={**self.env, **env})


def trainer_container(cfg: Config, image: str, status_file: str | None = None) -> Container:
    """`python -m trainer` with the config's trainer section: its model config, output directory,
    steps, mesh and overrides as --set (and `--status-file PATH` where the host watches the trainer's
    state there)."""
    args = ["--config", cfg.trainer.config, "--output-dir", cfg.trainer.output_dir, "--resume", "auto"]
    if cfg.trainer.steps is not None:
        args += ["--steps", str(cfg.trainer.steps)]
    if cfg.trainer_mesh is not None:  # trainer.mesh, or the plan's choice (resolved by the config's loader)
        args += ["--mesh", cfg.trainer_mesh]
    if status_file is not None:
        args += ["--status-file", status_file]
    return Container(image=image, command=TRAINER_COMMAND, args=(*args, *cfg.trainer.set_flags()),
                     env={RUN_ENV: cfg.run})


def server_container(cfg: Config, image: str, checkpoint: str | None = None) -> Container:
    """`python -m trainer.serve` on the run's checkpoints (`checkpoint`, else serve.checkpoint, else its
    trainer.output_dir), listening on SERVER_PORT on every interface of its container, with the serve
    section's engine limits (slots, max length, weight and KV cache precision) and mesh (Config.serve_mesh:
    the one `plan --serve` states) where the config has one."""
    serve = cfg.serve
    where = checkpoint or (serve.checkpoint if serve is not None else None) or cfg.trainer.output_dir
    args = ["--checkpoint", where, "--host", "0.0.0.0", "--port", str(SERVER_PORT)]
    if serve is not None:
        cfg = cfg.with_serve_mesh()  # loaded without it decided: decided now, as load_config would have
        args += ["--slots", str(serve.slots), "--max-len", str(serve.max_len), "--weights", serve.weights,
                 "--kv-cache-dtype", serve.kv_cache_dtype, "--mesh", cfg.serve_mesh]
    return Container(image=image, command=SERVER_COMMAND, args=tuple(args),
                     env={RUN_ENV: cfg.run, "AIP_HTTP_PORT": str(SERVER_PORT)}, ports=(SERVER_PORT,))
