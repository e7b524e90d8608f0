"""`moe-tpu deploy` and `moe-tpu predict`: a run's checkpoint served by the config's kind (a Vertex AI endpoint,
a GKE Deployment) and a prompt sent through that platform's own prediction path. Both ask the kind's
ServiceTarget (provision.kinds) and never name a platform."""

from __future__ import annotations

import click

from provision.cli.options import config_option

SMOKE_REQUEST = {"prompt": "1 2 3", "max_tokens": 4, "temperature": 0.0}


@click.command("deploy")
@config_option
@click.option("--keep", is_flag=True,
              help="On Ctrl-C, SIGTERM or SIGHUP, leave what was made in place (by default it is deleted).")
@click.pass_obj
def deploy(app, config_path: str, keep: bool) -> None:
    """Serve the run's checkpoint: provision, wait until healthy, send one request, print how to call it.

    The config's target decides where (`target: vertex`: a model uploaded to Vertex AI, a dedicated
    endpoint, the model deployed on single-host TPU v5e; `target: gke`: a Deployment, a Service and an
    autoscaler on the gke section's cluster), its serve section how (machine type, replicas, the
    autoscaling target, the engine's slots, max length and precisions). A re-run adopts what an earlier
    attempt made. A deploy that fails deletes what it made. In a dry run the real server runs on this
    machine on the run's local checkpoint (train it first with `moe-tpu --dry-run run`).

    \b
    Exit codes: 0 serving; 1 the deploy failed (quota, capacity, a server that never became healthy:
    its last words are shown), everything it made deleted; 2 a config error; 130 Ctrl-C, 143 SIGTERM,
    129 SIGHUP (what was made is deleted unless --keep).

    \b
    Examples:
      moe-tpu --dry-run run -c examples/v5e-64.yaml
      moe-tpu --dry-run deploy -c examples/serve-vertex.yaml
      moe-tpu --dry-run --scenario quota deploy -c examples/serve-vertex.yaml
      moe-tpu --output json deploy -c examples/serve-vertex.yaml --keep
    """
    from provision.kinds import kind_of
    from provision.services import ServiceFollower

    app.command = "deploy"
    cfg = app.load_config(config_path, serve_mesh=True)  # each replica's server started on one mesh, the plan's
    context = app.context(cfg)
    service = kind_of(cfg).service(context)
    app.console.info(f"deploy {cfg.run}: {service.describe()}" + (" [dry run]" if app.dry_run else ""))
    follower = ServiceFollower(context, service)
    outcome = _guarded(app, follower, keep, follower.deploy)
    resources = [r.as_dict(context.clock.now()) for r in service.left()] if outcome.ok else []
    if not outcome.ok:
        _emit(app, follower, "error", resources, error=outcome.report.detail)
        from provision.errors import CloudError

        raise CloudError(f"the deploy failed: {outcome.report.detail}",
                         hint="everything it made is deleted; the timeline above shows what happened")
    smoke = _guarded(app, follower, keep, lambda: _smoke(service))
    text = _text(smoke[0]) if smoke else ""
    url = outcome.report.url
    app.console.text(f"serving at {url}")
    app.console.text(f"smoke request: {SMOKE_REQUEST['prompt']!r} -> {text!r}")
    for line in _examples(service, url):
        app.console.text(line)
    _emit(app, follower, "ok", resources, url=url, smoke={"request": SMOKE_REQUEST, "text": text})


def _smoke(service) -> list[dict]:
    """One request through the platform's prediction path; a refusal leaves the service up, saying so."""
    from provision.errors import CloudError, MoeTpuError

    try:
        return list(service.predict(dict(SMOKE_REQUEST)))
    except MoeTpuError as exc:
        raise CloudError(f"the service is up, but its smoke request failed: {exc.message}",
                         hint="try `moe-tpu predict --prompt ...`; `moe-tpu down` deletes it") from exc


def _guarded(app, follower, keep: bool, body):
    """body(), with Ctrl-C (130), SIGTERM (143) and SIGHUP (129) deleting what the deploy made unless --keep,
    as `run` does."""
    from provision.runs import Interrupted, Signalled, Terminated, terminate_on_signals
    from trainer import signals

    with terminate_on_signals():  # held through the teardown: a second signal does not cut it short
        try:
            result = body()
            signals.checkpoint()  # one that came after the body's last wait
            return result
        except KeyboardInterrupt:
            signals.acted()
            _stop(app, follower, keep, "interrupted")
            raise Interrupted("interrupted; " + _left_what(keep), hint=None if not keep else
                              "run `moe-tpu down` to delete it") from None
        except Signalled as exc:
            signals.acted()
            _stop(app, follower, keep, "terminated")
            error = Terminated(f"terminated by {exc.name}; " + _left_what(keep),
                               hint=None if not keep else "run `moe-tpu down` to delete it")
            error.exit_code = exc.exit_code
            raise error from None


def _left_what(keep: bool) -> str:
    return "what the deploy made is left as it is (--keep)" if keep else "everything the deploy made is deleted"


def _stop(app, follower, keep: bool, event: str) -> None:
    follower.timeline.add(event, app.console)
    if not keep:
        deleted = follower.service.teardown()
        follower.timeline.billing(False)
        follower.timeline.add("deleted", app.console, resources=len(deleted))


def _finite(param, value: float) -> float:
    """FloatRange lets nan through (it compares false with both ends); the server would refuse it."""
    if value != value:
        raise click.BadParameter(f"{value} is not a number in the range 0<=x<=2", param=param)
    return value


def _text(document: dict) -> str:
    choices = document.get("choices") or [{}]
    return str(choices[0].get("text", ""))


def _examples(service, url: str) -> list[str]:
    """How to call the service (its kind's words, provision.core.ServiceTarget.examples)."""
    return service.examples(url, '{"prompt": "1 2 3", "max_tokens": 32}')


def _emit(app, follower, result: str, resources: list, **fields) -> None:
    app.console.emit(app.document(result, timeline=follower.timeline.events, resources=resources, **fields))


@click.command("predict")
@config_option
@click.option("--prompt", required=True, help="The text to continue (token ids separated by spaces for a run "
                                              "whose data has no tokenizer).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0, max=2), default=0.0, show_default=True,
              callback=lambda _ctx, param, value: _finite(param, value),
              help="0: greedy, the tokens `moe-tpu sample --temperature 0` gives for the checkpoint.")
@click.option("--stream/--no-stream", default=True, show_default=True,
              help="Print the tokens as they come (StreamRawPredict on Vertex AI), or the whole answer at once.")
@click.pass_obj
def predict(app, config_path: str, prompt: str, max_tokens: int, temperature: float, stream: bool) -> None:
    """Send one prompt to the run's deployed model through the platform's own API (Vertex AI's
    PredictionService, or the GKE Service), and print the continuation.

    \b
    Examples:
      moe-tpu --dry-run predict --prompt "1 2 3"
      moe-tpu predict -c examples/serve-vertex.yaml --prompt "The cat" --max-tokens 64 --no-stream
      moe-tpu --output json predict --prompt "The cat" --temperature 0.7
    """
    from provision.kinds import kind_of

    app.command = "predict"
    cfg = app.load_config(config_path)
    service = kind_of(cfg).service(app.context(cfg))
    request = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature}
    pieces: list[str] = []
    for document in service.predict(request, stream=stream):
        piece = _text(document)
        pieces.append(piece)
        if stream and not app.console.json_mode:
            click.echo(piece, nl=False)
    text = "".join(pieces)
    if stream and not app.console.json_mode:
        click.echo()
    else:
        app.console.text(text)
    app.console.emit(app.document("ok", request=request, stream=stream, text=text))
