"""The kinds' renderers called as their kinds call them, from a loaded config: the kind's sections and the
run's render context (provision.rendering.trainer_context, server_context), for the tests that hold one
renderer's output to an oracle. `renderer`: the command's (provision.context.renderer_for) by default."""

from __future__ import annotations

from provision.context import renderer_for
from provision.kinds.gke import gke_lws_render, gke_render, gke_serve_render
from provision.kinds.tpu_vm import slice_render
from provision.kinds.vertex import vertex_render
from provision.rendering import PROJECT_PLACEHOLDER, RenderContext, server_context, trainer_context


def slice_context(cfg, image: str, project: str | None = None) -> RenderContext:
    """A TPU VM trainer's: its status written where the VM's watcher reads it."""
    return trainer_context(cfg, image, project, status_file=slice_render.STATUS_FILE)


def startup_script(cfg, renderer=None) -> str:
    renderer = renderer or renderer_for(cfg)
    return slice_render.startup_script(slice_context(cfg, renderer.image), renderer)


def startup_spec(cfg, image: str):
    return slice_render.startup_spec(slice_context(cfg, image))


def queued_resource_request(cfg, zone: str, renderer=None, attempt: int = 0, project: str | None = None):
    renderer = renderer or renderer_for(cfg)
    return slice_render.create_queued_resource_request(cfg.slice, slice_context(cfg, renderer.image, project), zone,
                                                       renderer, attempt)


def custom_job_request(cfg, renderer=None, project: str | None = None):
    renderer = renderer or renderer_for(cfg)
    return vertex_render.create_custom_job_request(cfg.vertex, trainer_context(cfg, renderer.image, project), renderer)


def node_pool_specs(cfg, zone: str) -> list[gke_render.NodePoolSpec]:
    return gke_render.node_pool_specs(cfg.gke, cfg.slice, trainer_context(cfg, "img:v1"), zone)


def jobset_spec(cfg, image: str) -> gke_render.JobSetSpec:
    return gke_render.jobset_spec(cfg.gke, cfg.slice, trainer_context(cfg, image))


def jobset_manifest(cfg, renderer=None) -> dict:
    renderer = renderer or renderer_for(cfg)
    return gke_render.jobset_manifest(cfg.gke, cfg.slice, trainer_context(cfg, renderer.image), renderer)


def gke_files(cfg, renderer=None) -> dict[str, str]:
    """The training files of a gke config (its cluster, pools and JobSet), as `render` writes them."""
    renderer = renderer or renderer_for(cfg)
    training = trainer_context(cfg, renderer.image, PROJECT_PLACEHOLDER)
    return gke_render.render_files(cfg.gke, cfg.slice, training, renderer)


def serving_pool_spec(cfg, zone: str) -> gke_render.NodePoolSpec:
    return gke_serve_render.serving_pool_spec(cfg.serve, cfg.slice, trainer_context(cfg, "img:v1"), zone)


def serving_manifests(cfg, startup_s: float, renderer=None) -> dict[str, dict]:
    renderer = renderer or renderer_for(cfg)
    return gke_serve_render.manifests(cfg.gke, cfg.serve, server_context(cfg, renderer.image), renderer, startup_s)


def serving_files(cfg, startup_s: float, renderer=None) -> dict[str, str]:
    renderer = renderer or renderer_for(cfg)
    serving = server_context(cfg, renderer.image, PROJECT_PLACEHOLDER)
    return gke_serve_render.serving_files(cfg.gke, cfg.serve, cfg.slice, serving, renderer, startup_s)


def group_pool_specs(cfg, zone: str) -> list[gke_render.NodePoolSpec]:
    return gke_lws_render.group_pool_specs(cfg.gke, cfg.serve, cfg.slice, trainer_context(cfg, "img:v1"), zone)


def group_manifests(cfg, startup_s: float, renderer=None) -> dict[str, dict]:
    renderer = renderer or renderer_for(cfg)
    return gke_lws_render.manifests(cfg.gke, cfg.serve, server_context(cfg, renderer.image), renderer, startup_s)


def group_files(cfg, startup_s: float, renderer=None) -> dict[str, str]:
    renderer = renderer or renderer_for(cfg)
    serving = server_context(cfg, renderer.image, PROJECT_PLACEHOLDER)
    return gke_lws_render.group_files(cfg.gke, cfg.serve, cfg.slice, serving, renderer, startup_s)
