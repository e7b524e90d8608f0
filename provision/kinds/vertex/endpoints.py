"""A Vertex AI endpoint serving a run's checkpoint: upload the server's model, create a dedicated endpoint,
deploy the model on single-host TPU v5e machines, predict through PredictionService, and undeploy, delete
and verify on `down`.

Everything here talks to `session.serving(region)` and waits on `session.clock`; it does not know whether
the other end is Google Cloud or the emulator. What it makes carries the run's labels and the run's name
as display name, so a re-run adopts what an earlier attempt made (no second model, no second endpoint).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from provision import catalogue
from provision.cloud import messages
from provision.core import Holding, Phase, ServiceReport
from provision.errors import UsageError
from provision.kinds.vertex.vertex_render import deployed_model_body, serving_endpoint_body, serving_model_body
from provision.rendering import RenderContext, server_context
from provision.resources import RUN_LABEL, Resource, is_managed, location_path, project_of, short, verify_deleted

OPERATION_TIMEOUT_S = 3600.0


def _seconds(ts) -> float | None:
    return ts.timestamp() if ts else None


def _ours(items: list, run: str | None) -> list:
    found = [item for item in items if is_managed(dict(item.labels), run)]
    return sorted(found, key=lambda item: (_seconds(item.create_time) or 0.0, item.name))


def run_models(session, project: str, region: str, run: str | None = None) -> list:
    """The models this tool uploaded in `region` (by label; with `run`, that run's), oldest first."""
    server_filter = f'display_name="{run}"' if run is not None else ""
    return _ours(session.serving(region).list_models(location_path(project, region), server_filter), run)


def run_endpoints(session, project: str, region: str, run: str | None = None) -> list:
    server_filter = f'display_name="{run}"' if run is not None else ""
    return _ours(session.serving(region).list_endpoints(location_path(project, region), server_filter), run)


def deployed_resource(endpoint, deployed, region: str) -> Resource:
    """A deployed model as a Resource: it bills for its replicas' chips from its creation."""
    spec = deployed.dedicated_resources.machine_spec
    acc = catalogue.accelerator_for_topology(spec.tpu_topology) if spec.tpu_topology else None
    replicas = deployed.status.available_replica_count or deployed.dedicated_resources.min_replica_count
    capacity = "spot" if deployed.dedicated_resources.spot else "on-demand"
    return Resource(kind="deployed_model", name=f"{endpoint.name}/deployedModels/{deployed.id}",
                    state=(deployed.status.message or "DEPLOYING").upper(), zone=region,
                    run=endpoint.labels.get(RUN_LABEL), accelerator=f"{spec.machine_type} {spec.tpu_topology}".strip(),
                    created=_seconds(deployed.create_time), chips=(acc.chips if acc else 0) * replicas,
                    price_per_chip_hour=catalogue.price_per_chip_hour(capacity))


def managed_serving(session, project: str, region: str, run: str | None = None) -> list[Resource]:
    """The run's (or every run's) endpoints, their deployed models and the uploaded models, in `region`."""
    found: list[Resource] = []
    for endpoint in run_endpoints(session, project, region, run):
        found.append(Resource(kind="endpoint", name=endpoint.name, state="DEPLOYED" if endpoint.deployed_models
                              else "EMPTY", zone=region, run=endpoint.labels.get(RUN_LABEL),
                              created=_seconds(endpoint.create_time)))
        found += [deployed_resource(endpoint, d, region) for d in endpoint.deployed_models]
    found += [Resource(kind="model", name=model.name, state="UPLOADED", zone=region, run=model.labels.get(RUN_LABEL),
                       created=_seconds(model.create_time)) for model in run_models(session, project, region, run)]
    return found


def endpoints_down(context) -> list[Resource]:
    """Undeploy every model of the run's endpoints, delete the endpoints and the run's models; verify by
    listing that none is left."""
    cfg, session, console = context.config, context.session, context.console
    project = project_of(cfg, session)
    serving = session.serving(cfg.region)
    deleted: list[Resource] = []
    for endpoint in run_endpoints(session, project, cfg.region, cfg.run):
        for deployed in endpoint.deployed_models:
            operation = serving.undeploy_model(endpoint.name, deployed.id)
            if operation is not None:
                console.info(f"  undeploying model {deployed.id} from endpoint {short(endpoint.name)}")
                serving.wait_operation(operation, f"undeploy {deployed.id}", timeout_s=OPERATION_TIMEOUT_S)
                deleted.append(deployed_resource(endpoint, deployed, cfg.region))
        _delete(serving, console, "endpoint", endpoint, serving.delete_endpoint, deleted, cfg.region)
    for model in run_models(session, project, cfg.region, cfg.run):
        _delete(serving, console, "model", model, serving.delete_model, deleted, cfg.region)
    verify_deleted(managed_serving(session, project, cfg.region, cfg.run))
    return deleted


def _delete(serving, console, kind: str, item, delete, deleted: list[Resource], region: str) -> None:
    operation = delete(item.name)
    if operation is None:
        return
    console.info(f"  deleting {kind} {short(item.name)}")
    serving.wait_operation(operation, f"delete {kind} {short(item.name)}", timeout_s=OPERATION_TIMEOUT_S)
    deleted.append(Resource(kind=kind, name=item.name, state="DELETED", zone=region, run=item.labels.get(RUN_LABEL),
                            created=_seconds(item.create_time)))


class Endpoint(Holding):
    """The serving workload on Vertex AI: the run's model deployed to a dedicated endpoint. `startup_s`: how
    long the server may take to load the weights and compile before its startup probe gives up."""

    def __init__(self, context, *, startup_s: float) -> None:
        super().__init__(context)
        self.startup_s = startup_s
        self.endpoint: str | None = None
        self.model: str | None = None
        self.operation = None  # the DeployModel operation this process started, if any

    @property
    def serving(self):
        return self.session.serving(self.cfg.region)

    def start(self) -> list[Resource]:
        """Upload the model, create the endpoint and start the deploy, each adopted where an earlier attempt
        made it; returns what exists then."""
        project = project_of(self.cfg, self.session)
        self.model = self._model(project)
        endpoint = self._endpoint(project)
        self.endpoint = endpoint.name
        mine = [d for d in endpoint.deployed_models if d.model.split("@")[0] == self.model]
        if mine:
            self.console.info(f"  following model {mine[0].id} that an earlier attempt deployed to endpoint "
                              f"{short(endpoint.name)} ({mine[0].status.message or 'deploying'})")
        else:
            self._deploy(endpoint)
        return managed_serving(self.session, project, self.cfg.region, self.cfg.run)

    def _render_context(self, project: str | None = None) -> RenderContext:
        return server_context(self.cfg, self.context.image, project)

    def _model(self, project: str) -> str:
        found = [m for m in run_models(self.session, project, self.cfg.region, self.cfg.run)
                 if m.display_name == self.cfg.run]
        if found:
            self.console.info(f"  using model {short(found[-1].name)} that an earlier attempt uploaded")
            return found[-1].name
        body = messages.serving_model(serving_model_body(self._render_context(project), self.startup_s))
        self.console.info(f"  uploading model {self.cfg.run} (image {self.context.image})")
        operation = self.serving.upload_model(location_path(project, self.cfg.region), body)
        return self.serving.wait_operation(operation, "upload model", timeout_s=OPERATION_TIMEOUT_S).model

    def _endpoint(self, project: str):
        found = [e for e in run_endpoints(self.session, project, self.cfg.region, self.cfg.run)
                 if e.display_name == self.cfg.run]
        if found:
            self.console.info(f"  using endpoint {short(found[-1].name)} that an earlier attempt created")
            return found[-1]
        body = messages.serving_endpoint(serving_endpoint_body(self._render_context(project)))
        self.console.info(f"  creating dedicated endpoint {self.cfg.run} in {self.cfg.region}")
        operation = self.serving.create_endpoint(location_path(project, self.cfg.region), body)
        return self.serving.wait_operation(operation, "create endpoint", timeout_s=OPERATION_TIMEOUT_S)

    def _deploy(self, endpoint) -> None:
        serve = self.cfg.serve
        body = messages.deployed_model(deployed_model_body(serve, self._render_context(), self.model))
        self.console.info(f"  deploying to endpoint {short(endpoint.name)}: {serve.machine_type} "
                          f"{serve.replica_topology}, {serve.min_replicas}-{serve.max_replicas} replica(s)")
        self.operation = self.serving.deploy_model(endpoint.name, body, {"0": 100})

    def report(self) -> ServiceReport:
        replicas = self.cfg.serve.min_replicas
        if self.operation is not None:
            if not self.serving._call("poll deploy model", self.operation.done):
                return ServiceReport(Phase.STARTING, replicas=replicas, detail="deploying")
            raw = self.operation.operation  # google.longrunning.Operation, as last read
            if raw.HasField("error"):
                return ServiceReport(Phase.FAILED, replicas=replicas,
                                     detail=f"DeployModel failed (code {raw.error.code}): {raw.error.message}")
        endpoint = self.serving.get_endpoint(self.endpoint)
        if endpoint is None:
            return ServiceReport(Phase.DELETED, detail=f"endpoint {short(self.endpoint)} is gone")
        mine = [d for d in endpoint.deployed_models if d.model.split("@")[0] == self.model]
        if not mine:
            return ServiceReport(Phase.FAILED, replicas=replicas,
                                 detail=f"endpoint {short(self.endpoint)} has no deployed model (the deploy failed)")
        ready = mine[0].status.available_replica_count
        url = (f"https://{endpoint.dedicated_endpoint_dns}/v1/{endpoint.name}:rawPredict"
               if endpoint.dedicated_endpoint_dns else endpoint.name)
        return ServiceReport(Phase.READY if ready else Phase.STARTING, url=url, replicas_ready=ready,
                             replicas=replicas, detail=mine[0].status.message or None)

    def predict(self, request: dict, stream: bool = False) -> Iterator[dict]:
        """One completions request through RawPredict (StreamRawPredict when `stream`)."""
        if self.endpoint is None:
            self.endpoint = self._find_endpoint()
        body = json.dumps({**request, "stream": stream}).encode()
        if not stream:
            answer = self.serving.raw_predict(self.endpoint, body)
            yield json.loads(answer.data)
            return
        yield from sse_events(chunk.data for chunk in self.serving.stream_raw_predict(self.endpoint, body))

    def _find_endpoint(self) -> str:
        project = project_of(self.cfg, self.session)
        found = [e for e in run_endpoints(self.session, project, self.cfg.region, self.cfg.run) if e.deployed_models]
        if not found:
            raise UsageError(f"run {self.cfg.run} has no endpoint with a deployed model in {self.cfg.region}",
                             hint=f"deploy it first: `moe-tpu deploy -c {self.cfg.source}`")
        return found[-1].name

    def examples(self, url: str, body: str) -> list[str]:
        """How to call the endpoint: a completions body on rawPredict, by curl and by Python. RawPredict hands
        the body as it is to the container's predict route, which is the server's /v1/completions
        (vertex_render.PREDICT_ROUTE); the endpoint has no /completions of its own (Vertex AI's OpenAI-compatible
        routes are chat completions for Model Garden's containers), so the openai client pointed at the
        endpoint would reach no route of this server."""
        quoted = body.replace('"', '\\"')
        return ["  curl -X POST -H \"Authorization: Bearer $(gcloud auth print-access-token)\" "
                f"-H 'content-type: application/json' {url} -d '{body}'",
                "  python3 -c \"import json, subprocess, urllib.request; token = subprocess.check_output(['gcloud', "
                "'auth', 'print-access-token'], text=True).strip(); request = urllib.request.Request("
                f"'{url}', data=b'{quoted}', headers={{'Authorization': 'Bearer ' + token, "
                "'content-type': 'application/json'}); "
                "print(json.load(urllib.request.urlopen(request))['choices'][0]['text'])\""]

    def teardown(self) -> list[Resource]:
        """The run's deployed models, endpoints and models; nothing else of the run (its job stays)."""
        return endpoints_down(self.context)

    def left(self) -> list[Resource]:
        return managed_serving(self.session, project_of(self.cfg, self.session), self.cfg.region, run=self.cfg.run)


def sse_events(chunks) -> Iterator[dict]:
    """The JSON documents of server-sent events (`data: {...}` lines) arriving in chunks of bytes, until
    `data: [DONE]`."""
    pending = b""
    for chunk in chunks:
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            data = line.strip()
            if not data.startswith(b"data:"):
                continue
            payload = data[len(b"data:"):].strip()
            if payload == b"[DONE]":
                return
            yield json.loads(payload)
