"""The meshes a loaded config is started with, decided with the planner (provision.planner, imported where it
is called: it needs the trainer's packages), and the trainer's own checks of the trainer section. The config
package's root (provision/config/__init__.py) runs them after loading.py has read the file."""

from __future__ import annotations

from provision.config_sections import Config
from provision.errors import ConfigError, MoeTpuError, Problem


def trainer_problems(cfg: Config) -> list[Problem]:
    """The trainer section checked by the trainer's own config code (which imports no jax)."""
    try:
        from trainer import config as trainer_config
    except ImportError:  # an install without the trainer package: the container will check it
        return []
    overrides = [flag for flag in cfg.trainer.set_flags() if flag != "--set"]
    try:
        trainer_config.check(cfg.trainer.config, overrides, cfg.trainer.steps)
    except trainer_config.ConfigError as exc:
        message = str(exc)
        key = next((f"trainer.overrides.{k}" for k in cfg.trainer.overrides if k in message), None)
        if key is None:
            key = "trainer.steps" if "steps" in message and cfg.trainer.steps is not None else "trainer.config"
        return [Problem(str(cfg.source), key, f"the trainer rejects it: {message}")]
    try:
        from provision.planner import mesh_problems
    except ImportError:  # the planner needs the trainer's packages too
        return []
    return [Problem(str(cfg.source), key, message) for key, message in mesh_problems(cfg)]


def mesh_problem(cfg: Config, why: str) -> Problem:
    """trainer.mesh is unset and the plan cannot choose a mesh: say what to set."""
    target = cfg.kind.hardware(cfg)
    chips = target[0].chips * target[1]
    return Problem(str(cfg.source), "trainer.mesh",
                   f"not set, and {why}: set `trainer.mesh: data=D,expert=E` (D x E = the target's {chips} chips; "
                   "`moe-tpu plan --mesh ...` checks a choice), or a trainer config and target that fit")


def with_planned_mesh(cfg: Config) -> Config:
    """The config with the mesh its trainer is started with decided, once, here: trainer.mesh, or where it
    is unset the plan's choice for the config's own target (Config.planned_mesh, which every renderer
    reads through Config.trainer_mesh). ConfigError naming trainer.mesh where the plan cannot choose."""
    if cfg.trainer.mesh is not None or cfg.planned_mesh is not None:
        return cfg
    try:
        from provision.planner import mesh_choice
    except ImportError as exc:  # the planner needs the trainer's packages
        raise ConfigError([mesh_problem(cfg, f"the plan needs the trainer's packages ({exc.name} is missing)")]) \
            from None
    mesh, why = mesh_choice(cfg)
    if mesh is None:
        raise ConfigError([mesh_problem(cfg, why)])
    return cfg.model_copy(update={"planned_mesh": mesh})


def with_serving_mesh(cfg: Config) -> Config:
    """The config with the serving replica's mesh decided, once, here, as `plan --serve` states it:
    serve.mesh filled out on the replica's chips, or where it is unset the plan's choice for the replica
    (Config.planned_serve_mesh, which every serving container's argv reads through Config.serve_mesh).
    ConfigError naming serve.mesh where it does not fit the replica or the plan cannot choose."""
    if cfg.serve is None or cfg.planned_serve_mesh is not None:
        return cfg
    try:
        from provision.planner import plan_for, serve_plan_for

        served = serve_plan_for(cfg, plan_for(cfg))
    except ImportError as exc:  # the planner needs the trainer's packages
        why = f"the plan needs the trainer's packages to choose one ({exc.name or 'jax'} is missing)"
        raise ConfigError([_serve_mesh_problem(cfg, why)]) from None
    except MoeTpuError as exc:
        raise ConfigError([_serve_mesh_problem(cfg, exc.message.removeprefix("cannot plan serving: "))]) from None
    return cfg.model_copy(update={"planned_serve_mesh": served.mesh.text()})


def _serve_mesh_problem(cfg: Config, why: str) -> Problem:
    if cfg.serve.mesh is not None:
        return Problem(str(cfg.source), "serve.mesh", f"{why} (`moe-tpu plan --serve` checks a mesh)")
    return Problem(str(cfg.source), "serve.mesh",
                   f"not set, and {why}: set `serve.mesh: data=D,expert=E,model=T` on the replica's chips "
                   "(`moe-tpu plan --serve --mesh ...` checks a choice)")


def decided(cfg: Config, check_trainer: bool = False, plan_mesh: bool = False, serve_mesh: bool = False) -> Config:
    """A config just read with what `load_config`'s flags ask decided (provision.config.load_config says which);
    ConfigError listing the trainer's problems, or naming the mesh that cannot be chosen."""
    cfg = cfg.model_copy(update={"serve_mesh_decider": with_serving_mesh})
    if check_trainer and (trainer := trainer_problems(cfg)):
        if cfg.trainer.mesh is None and any(p.key.startswith("trainer.") and p.key != "trainer.mesh"
                                            for p in trainer):
            trainer.append(mesh_problem(cfg, "the plan cannot choose one while the trainer config is refused"))
        raise ConfigError(trainer)
    if check_trainer or plan_mesh:
        cfg = with_planned_mesh(cfg)
    return with_serving_mesh(cfg) if check_trainer or plan_mesh or serve_mesh else cfg


