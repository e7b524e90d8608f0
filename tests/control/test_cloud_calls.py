"""Cloud Storage and Cloud Build go through the Session, and each of their requests is in its calls log:
the real google-cloud-storage client against a fake GCS server, and Cloud Build's real gRPC client against
a fake CloudBuild service on a loopback port (the emulator serves neither: a dry run builds nothing and
keeps its output directory on the local disk)."""

from __future__ import annotations

from concurrent import futures
from pathlib import Path

import pytest
import yaml

from provision import image
from provision.cli import logs_cmd
from provision.cloud import Endpoint, Session
from provision.cloud import build as cloud_build
from provision.config import config_from_dict
from provision.console import Console
from tests.gcs_server import fake_gcs_server

pytest.importorskip("gcp_storage_emulator")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "v5e-64.yaml"
OUT = "gs://runs-bucket/runs/moe-demo"
BUILD = "google.devtools.cloudbuild.v1.CloudBuild"


@pytest.fixture
def bucket(monkeypatch):
    with fake_gcs_server("runs-bucket") as url:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage as gcs

        yield gcs.Client(project="my-project", credentials=AnonymousCredentials()).bucket("runs-bucket")


def open_session(address: str | None = None) -> Session:
    """A session as a command opens one (on `address`: there the fake Cloud Build answers)."""
    from google.auth.credentials import AnonymousCredentials

    from provision.clock import SimClock

    return Session(Endpoint(SimClock(), address=address, credentials=AnonymousCredentials(),
                            default_project="my-project"), [], Console(output="text", verbose=0))


def test_logs_reads_a_gs_output_directory_through_the_session_and_logs_each_read(bucket):
    bucket.blob("runs/moe-demo/metrics.jsonl").upload_from_string('{"step": 1, "loss": 5.5}\n{"step": 2}\n')
    bucket.blob("runs/moe-demo/status.json").upload_from_string('{"state": "finished", "step": 2}')
    session = open_session()
    try:
        from provision.clock import SimClock

        seen = logs_cmd.read_output(logs_cmd.reader_of(session.storage, OUT), None, session.console, SimClock(),
                                    follow=False, tail=0)
    finally:
        session.close()
    assert (seen.status["state"], [r["step"] for r in seen.rows], seen.text) == ("finished", [1, 2], "")
    assert [(c["rpc"], c["request"], c["status"]) for c in session.calls] == [
        ("storage.objects.get", {"bucket": "runs-bucket", "object": f"runs/moe-demo/{name}"}, status)
        for name, status in [("metrics.jsonl", "OK"), ("metrics.jsonl", "OK"), ("trainer.log", "NOT_FOUND"),
                             ("status.json", "OK")]]


class FakeCloudBuild:
    """CreateBuild answers with the build's operation; GetBuild says WORKING until the third look."""

    def __init__(self) -> None:
        self.requests: list = []
        self.looks = 0

    def create(self, request, context):
        from google.cloud.devtools import cloudbuild_v1
        from google.longrunning import operations_pb2
        from google.protobuf import any_pb2

        self.requests.append(request)
        metadata = any_pb2.Any()
        metadata.Pack(cloudbuild_v1.BuildOperationMetadata.pb(cloudbuild_v1.BuildOperationMetadata(
            build=cloudbuild_v1.Build(id="b-1", log_url="https://console.cloud.google.com/b-1"))))
        return operations_pb2.Operation(name="operations/build/my-project/b-1", metadata=metadata)

    def get(self, request, context):
        from google.cloud.devtools import cloudbuild_v1

        self.looks += 1
        status = cloudbuild_v1.Build.Status.SUCCESS if self.looks >= 3 else cloudbuild_v1.Build.Status.WORKING
        return cloudbuild_v1.Build(id=request.id, status=status)

    def serve(self):
        import grpc
        from google.cloud.devtools import cloudbuild_v1
        from google.longrunning import operations_pb2

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(BUILD, {
            "CreateBuild": grpc.unary_unary_rpc_method_handler(
                self.create, request_deserializer=cloudbuild_v1.CreateBuildRequest.deserialize,
                response_serializer=operations_pb2.Operation.SerializeToString),
            "GetBuild": grpc.unary_unary_rpc_method_handler(
                self.get, request_deserializer=cloudbuild_v1.GetBuildRequest.deserialize,
                response_serializer=cloudbuild_v1.Build.serialize)})])
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        return server, f"127.0.0.1:{port}"


def test_a_cloud_build_uploads_builds_and_reads_its_log_through_the_session_and_logs_every_call(bucket, capsys):
    raw = yaml.safe_load(EXAMPLE.read_text())
    raw["image"]["staging"] = "gs://runs-bucket/staging"
    plan = image.plan_image(config_from_dict(raw))
    bucket.blob("staging/cloud-build-logs/log-b-1.txt").upload_from_string("Step 1/9\npushed\n")
    fake = FakeCloudBuild()
    server, address = fake.serve()
    session = open_session(address)
    try:
        assert cloud_build.submit(plan, b"the archive", session, "my-project") == "b-1"
    finally:
        session.close()
        server.stop(None)

    assert bucket.blob(plan.archive_uri.removeprefix("gs://runs-bucket/")).download_as_bytes() == b"the archive"
    assert [r.project_id for r in fake.requests] == ["my-project"] and fake.looks == 3
    log = "staging/cloud-build-logs/log-b-1.txt"
    assert [(c["rpc"], c["status"]) for c in session.calls] == [
        ("storage.objects.insert", "OK"), (f"{BUILD}/CreateBuild", "OK"),
        *[(f"{BUILD}/GetBuild", "OK"), ("storage.objects.get", "OK")] * 3, ("storage.objects.get", "OK")]
    upload = session.calls[0]["request"]
    assert upload == {"bucket": "runs-bucket", "object": plan.archive_uri.removeprefix("gs://runs-bucket/"),
                      "contentType": "application/gzip", "size": len(b"the archive"), "ifGenerationMatch": 0}
    assert session.calls[1]["request"]["project_id"] == "my-project"
    assert [c["request"] for c in session.calls if c["rpc"] == "storage.objects.get"][:2] == [
        {"bucket": "runs-bucket", "object": log, "offset": 0},
        {"bucket": "runs-bucket", "object": log, "offset": len("Step 1/9\npushed\n")}]
    printed = [line for line in capsys.readouterr().err.splitlines() if line.startswith("  | ")]
    assert printed == ["  | Step 1/9", "  | pushed"]


def test_the_look_in_the_registry_is_in_the_calls_log_and_an_unreachable_one_cannot_tell():
    import socket

    with socket.socket() as s:  # a loopback port where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    session = open_session()
    uri = f"127.0.0.1:{port}/my-project/moe/trainer:0.1.0-abc"
    assert cloud_build.registry_has(uri, session) is None
    assert session.calls == [{"rpc": "registry.manifests.head", "request": {"image": uri}, "status": "URLError"}]
