"""Vertex AI online prediction in the emulator, through the session's real aiplatform_v1 ModelService,
EndpointService and PredictionService clients: what Vertex refuses (each rule of docs/emulator-fidelity.md's
serving table), operations with their own response types, the scenarios. No model server here (an emulator
without a state directory): deploys end on the clock."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.api_core import exceptions as gexc
from google.cloud import aiplatform_v1 as v1
from google.rpc import error_details_pb2

from provision.cloud import Endpoint, Session
from provision.console import Console
from provision.errors import CloudError
from provision.emulator import Emulator
from provision.emulator import vertex_serving as vs

PARENT = "projects/my-project/locations/us-west4"


@pytest.fixture
def emu(request):
    scenario = getattr(request, "param", "happy")
    with Emulator(scenario=scenario) as emulator:
        yield emulator


@pytest.fixture
def api(emu):
    session = Session(Endpoint(clock=emu.clock, address=emu.address), [], Console())
    yield session.serving("us-west4")
    session.close()


def model(display_name: str = "moe-demo") -> v1.Model:
    return v1.Model(display_name=display_name, labels={"moe-tpu-run": "moe-demo"}, container_spec=v1.ModelContainerSpec(
        image_uri="img:1", command=["python", "-m", "trainer.serve"], predict_route="/v1/completions",
        health_route="/health", ports=[v1.Port(container_port=8080)]))


def deployed(model_name: str, machine_type: str = "ct5lp-hightpu-4t", topology: str = "2x2", low: int = 1,
             high: int = 2, metric: str = vs.AUTOSCALING_METRICS[1]) -> v1.DeployedModel:
    return v1.DeployedModel(model=model_name, display_name="moe-demo", dedicated_resources=v1.DedicatedResources(
        machine_spec=v1.MachineSpec(machine_type=machine_type, tpu_topology=topology), min_replica_count=low,
        max_replica_count=high, autoscaling_metric_specs=[v1.AutoscalingMetricSpec(metric_name=metric, target=60)]))


@pytest.fixture
def made(api):
    """An uploaded model and an empty endpoint: (model name, endpoint)."""
    name = api.wait_operation(api.models.upload_model(parent=PARENT, model=model()), "upload").model
    endpoint = api.wait_operation(api.endpoints.create_endpoint(parent=PARENT, endpoint=v1.Endpoint(
        display_name="moe-demo", dedicated_endpoint_enabled=True)), "create")
    return name, endpoint


def _refused(call, code: type, text: str) -> None:
    with pytest.raises(code) as caught:
        call()
    assert text in caught.value.message


def test_operations_answer_with_each_methods_own_types_and_a_deploy_ends(emu, api, made):
    name, endpoint = made
    assert name.startswith(PARENT + "/models/") and endpoint.dedicated_endpoint_dns
    operation = api.endpoints.deploy_model(endpoint=endpoint.name, deployed_model=deployed(name),
                                           traffic_split={"0": 100})
    assert not operation.done()
    emu.clock.advance(vs.DEPLOYING_S)
    result = operation.result()
    assert result.deployed_model.dedicated_resources.machine_spec.tpu_topology == "2x2"
    view = api.endpoints.get_endpoint(name=endpoint.name)
    assert view.deployed_models[0].status.available_replica_count == 1
    assert view.traffic_split[result.deployed_model.id] == 100
    assert api.models.get_model(name=name).deployed_models[0].endpoint == endpoint.name
    # No server here: a prediction is refused as unavailable, not answered.
    _refused(lambda: api.predictions.raw_predict(endpoint=endpoint.name, http_body={"data": b"{}"}),
             gexc.ServiceUnavailable, "runs no model server")
    _refused(lambda: api.endpoints.delete_endpoint(name=endpoint.name), gexc.FailedPrecondition, "undeploy them first")
    _refused(lambda: api.models.delete_model(name=name), gexc.FailedPrecondition, "undeploy it first")
    for operation in (api.endpoints.undeploy_model(endpoint=endpoint.name, deployed_model_id=result.deployed_model.id),
                      api.endpoints.delete_endpoint(name=endpoint.name), api.models.delete_model(name=name)):
        api.wait_operation(operation, "teardown")
    assert list(api.models.list_models(parent=PARENT)) == [] and list(api.endpoints.list_endpoints(parent=PARENT)) == []


@pytest.mark.parametrize(("change", "text"), [
    ({"machine_type": "n1-standard-8"}, 'Machine type "n1-standard-8" is not supported.'),
    ({"machine_type": "ct5lp-hightpu-4t", "topology": "8x8"}, 'TPU topology "8x8" is not supported'),
    ({"low": 3, "high": 2}, "max_replica_count (2) must be greater than or equal to min_replica_count (3)"),
    ({"metric": "aiplatform.googleapis.com/prediction/online/gpu/duty_cycle"}, "Unsupported autoscaling metric"),
])
def test_deploy_refuses_what_online_prediction_refuses(api, made, change, text):
    name, endpoint = made
    _refused(lambda: api.endpoints.deploy_model(endpoint=endpoint.name, deployed_model=deployed(name, **change)),
             gexc.InvalidArgument, text)
    no_resources = v1.DeployedModel(model=name, display_name="x")
    _refused(lambda: api.endpoints.deploy_model(endpoint=endpoint.name, deployed_model=no_resources),
             gexc.InvalidArgument, "dedicated_resources is required")
    assert not api.endpoints.get_endpoint(name=endpoint.name).deployed_models


def test_upload_refuses_a_model_without_its_container(api):
    bare = model()
    bare.container_spec.image_uri = ""
    _refused(lambda: api.models.upload_model(parent=PARENT, model=bare), gexc.InvalidArgument, "image_uri is required")
    _refused(lambda: api.models.upload_model(parent=PARENT, model=model(display_name="")), gexc.InvalidArgument,
             "display_name is required")


@pytest.mark.parametrize("emu", ["quota"], indirect=True)
def test_quota_refuses_the_deploy_with_the_v5e_serving_quota(api, made):
    name, endpoint = made
    with pytest.raises(gexc.ResourceExhausted) as caught:
        api.endpoints.deploy_model(endpoint=endpoint.name, deployed_model=deployed(name))
    assert caught.value.message == ("Quota limit 'TPUV5sLitepodServingPerProjectPerZoneForTPUAPI' has been exceeded. "
                                    "Limit: 0 in zone us-west4-a.")
    failure = next(d for d in caught.value.details if isinstance(d, error_details_pb2.QuotaFailure))
    assert failure.violations[0].quota_id == vs.QUOTA_ID


@pytest.mark.parametrize("emu", ["stockout"], indirect=True)
def test_stockout_fails_the_first_regions_deploy_for_lack_of_capacity(emu, api, made):
    name, endpoint = made
    operation = api.endpoints.deploy_model(endpoint=endpoint.name, deployed_model=deployed(name))
    emu.clock.advance(vs.STOCKOUT_AFTER_S)
    with pytest.raises(gexc.GoogleAPICallError) as caught:
        operation.result()
    assert caught.value.code == 429 or "insufficient in region: us-west4" in str(caught.value)
    assert operation.operation.error.code == vs.STOCKOUT_CODE
    assert not api.endpoints.get_endpoint(name=endpoint.name).deployed_models  # a failed deploy leaves no model


def test_a_deploys_server_starts_once_the_deploy_is_saved_and_again_if_it_never_ran(tmp_path):
    """With a state directory the emulator runs the model's container. Its server starts after the deploy's
    transaction is saved; a deploy whose server is not running (its process ended between the two) gets it
    started by the next call, and the deploy ends when it is ready."""
    fake = str(Path(__file__).with_name("fake_server.py"))
    with Emulator(state_path=tmp_path / "emulator.json") as emu:
        emu.clock.gate = emu.servers  # as a command's: real time counts while a server starts
        session = Session(Endpoint(clock=emu.clock, address=emu.address), [], Console())
        try:
            api = session.serving("us-west4")
            spec = model()
            spec.container_spec.command[:] = ["python", fake, "--host", "0.0.0.0"]
            name = api.wait_operation(api.models.upload_model(parent=PARENT, model=spec), "upload").model
            endpoint = api.wait_operation(api.endpoints.create_endpoint(parent=PARENT, endpoint=v1.Endpoint(
                display_name="moe-demo", dedicated_endpoint_enabled=True)), "create")
            operation = api.endpoints.deploy_model(endpoint=endpoint.name, deployed_model=deployed(name),
                                                   traffic_split={"0": 100})
            [key] = emu.servers.keys()
            assert key.startswith(endpoint.name + "/deployedModels/")
            assert emu.servers.stop(key) and emu.servers.keys() == []  # as if it never started
            result = api.wait_operation(operation, "deploy")
            assert emu.servers.keys() == [key] and emu.servers.state(key).phase == "ready"
            assert result.deployed_model.id == key.rsplit("/", 1)[-1]
            api.wait_operation(api.endpoints.undeploy_model(endpoint=endpoint.name,
                                                            deployed_model_id=result.deployed_model.id), "undeploy")
            assert emu.servers.keys() == []
        finally:
            session.close()
            for key in emu.servers.keys():  # a test that failed halfway leaves no server running
                emu.servers.stop(key)


def test_a_server_still_starting_at_the_deployment_timeout_fails_the_deploy(tmp_path):
    """Vertex AI fails a deploy whose container does not answer its health route within the deployment
    timeout: the deploy's operation ends with that error, and no deployed model or server is left."""
    from provision.emulator.vertex_serving import READY_TIMEOUT_S

    with Emulator(state_path=tmp_path / "emulator.json") as emu:  # no gate: the clock runs past the timeout
        session = Session(Endpoint(clock=emu.clock, address=emu.address), [], Console())
        try:
            api = session.serving("us-west4")
            spec = model()
            spec.container_spec.command[:] = ["python", "-c", "import time; time.sleep(600)", "--"]
            name = api.wait_operation(api.models.upload_model(parent=PARENT, model=spec), "upload").model
            endpoint = api.wait_operation(api.endpoints.create_endpoint(parent=PARENT, endpoint=v1.Endpoint(
                display_name="moe-demo", dedicated_endpoint_enabled=True)), "create")
            start = emu.clock.now()
            with pytest.raises(CloudError, match="never became ready within the deployment timeout"):
                api.wait_operation(api.endpoints.deploy_model(endpoint=endpoint.name, deployed_model=deployed(name),
                                                              traffic_split={"0": 100}), "deploy",
                                   timeout_s=2 * READY_TIMEOUT_S)
            assert emu.clock.now() - start >= READY_TIMEOUT_S
            assert emu.servers.keys() == [] and not api.endpoints.get_endpoint(name=endpoint.name).deployed_models
        finally:
            session.close()
            for key in emu.servers.keys():  # a test that failed halfway leaves no server running
                emu.servers.stop(key)
