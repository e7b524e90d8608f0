"""`image build`: a thin wrapper over provision.image."""

from __future__ import annotations

from pathlib import Path

import click

from provision.cli.options import config_option


@click.group("image")
def image() -> None:
    """The trainer's container image.

    \b
    Examples:
      moe-tpu --dry-run image build -c examples/v5e-64.yaml   # the plan; nothing built
      moe-tpu image build --push -c examples/v5e-64.yaml
    """


@image.command("build")
@config_option
@click.option("--push", is_flag=True, help="Push the image to Artifact Registry (Cloud Build always pushes).")
@click.option("--builder", type=click.Choice(["auto", "docker", "cloud-build"]), default="auto",
              show_default=True, help="auto: local docker when its daemon answers, else Cloud Build.")
@click.option("--context", "context_dir", type=click.Path(file_okay=False), default=None,
              help="Where to write the build context [.moe-tpu/image].")
@click.option("--source", "source_dir", type=click.Path(file_okay=False, exists=True), default=None,
              help="The moe-tpu source tree to build [the one this moe-tpu runs from].")
@click.pass_obj
def build(app, config_path: str, push: bool, builder: str, context_dir: str | None, source_dir: str | None) -> None:
    """Build the trainer's container image (and push it) from this source tree.

    The tag is a hash of what goes in (the sources the wheel is built from and the
    Dockerfile): an unchanged tree is neither rebuilt nor pushed again, and `run` and
    `slice up` use that tag when the config sets no image.tag. With a docker daemon
    the image is built here; without one, Cloud Build builds it from a source archive
    in the staging bucket (image.staging, else gs://OUTPUT-BUCKET/staging) and pushes
    it. --dry-run writes the build context and prints the plan: no docker, no network.

    \b
    Examples:
      moe-tpu --dry-run image build -c examples/v5e-64.yaml
      moe-tpu --dry-run --output json image build -c examples/v5e-64.yaml
      moe-tpu image build --push -c examples/v5e-64.yaml
      moe-tpu image build --builder cloud-build -c examples/v5e-64.yaml
    """
    import importlib.util

    from provision import image as images
    from provision.errors import MissingDependency

    app.command = "image build"
    if importlib.util.find_spec("jinja2") is None:  # the Dockerfile is rendered
        raise MissingDependency("jinja2", "control")
    cfg = app.load_config(config_path)
    plan = images.plan_image(cfg, app.context(cfg).templates_dir, Path(source_dir).resolve() if source_dir else None)
    context = Path(context_dir).resolve() if context_dir else (app.state_dir / "image").resolve()
    console = app.console
    console.info(f"image build: {plan.uri}" + (" [dry run: nothing is built or uploaded]" if app.dry_run else ""))
    if app.dry_run:
        files = images.write_context(plan, context)
        _show_plan(app, plan, context, files, push, builder)
        console.emit(app.document("ok", resources=[], **_fields(plan, context, files, push),
                                  builder=builder, built=False, pushed=[]))
        return
    result = images.build_image(plan, context, push=push, requested=builder, run_context=app.context(cfg))
    state = "PUSHED" if result.pushed else ("BUILT" if result.built else "UNCHANGED")
    console.text(f"{plan.uri}: {state.lower()}" + (f" by {result.builder}" if result.built else "")
                 + (f" (Cloud Build {result.build_id})" if result.build_id else ""))
    for uri in result.pushed:
        console.text(f"  pushed {uri}")
    if not push and result.builder == images.DOCKER_BUILDER:
        console.info("not pushed: add --push to send it to Artifact Registry")
    console.emit(app.document("ok", resources=[{"kind": "container_image", "name": plan.uri, "state": state}],
                              **_fields(plan, context, result.files, push), builder=result.builder,
                              built=result.built, pushed=result.pushed, build_id=result.build_id))


def _fields(plan, context: Path, files: list[str], push: bool) -> dict:
    return {"image": plan.uri, "tag": plan.tag, "images": plan.uris, "context": str(context), "files": files,
            "wheel": f"dist/{plan.wheel}", "inputs": list(plan.inputs), "push": push,
            "upload": ({"to": plan.archive_uri, "files": sorted([*plan.files, f"dist/{plan.wheel}"])}
                       if plan.archive_uri else None)}


def _show_plan(app, plan, context: Path, files: list[str], push: bool, builder: str) -> None:
    from provision import image as images

    text = app.console.text
    text(f"image    {plan.uri}")
    for uri in plan.uris[1:]:
        text(f"also     {uri} (image.tag)")
    text(f"inputs   {len(plan.inputs)} files ({', '.join(images.WHEEL_INPUTS)}) and the Dockerfile")
    text(f"context  {context}: {', '.join(files)}; dist/{plan.wheel} comes from `python -m build`")
    tags = " ".join(f"--tag {uri}" for uri in plan.uris)
    if builder in ("auto", images.DOCKER_BUILDER):
        text(f"docker   docker build --platform {images.PLATFORM} {tags} {context}"
             + ("; docker push of every tag the registry lacks" if push else " (not pushed without --push)"))
    if builder in ("auto", images.CLOUD_BUILDER):
        if plan.archive_uri:
            text(f"cloud    upload the context to {plan.archive_uri}, then Cloud Build builds it and pushes "
                 f"{', '.join(plan.uris)}")
        else:
            text("cloud    no staging location for Cloud Build: set image.staging (gs://BUCKET/PREFIX)")
    text("unchanged sources give the same tag: a tag already built or in the registry is not built or pushed again")
