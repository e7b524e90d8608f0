"""Cloud Build: the image built from an archived context in Cloud Storage, and the credentials for it.

`moe-tpu image build` without docker lands here (provision/image.py plans the build). The archive
goes to the plan's staging location, the build runs docker with every tag of the plan and logs to
staging, and its log is streamed from there until the build ends. The plan is an
provision.image.ImagePlan (not imported: the image module imports this one).
"""

from __future__ import annotations

import time
from typing import Any

from provision.cloud import CLOUD_PLATFORM_SCOPE
from provision.cloud.messages import proto_dict
from provision.errors import CloudError, UsageError

STEP_IMAGE = "gcr.io/cloud-builders/docker"
TIMEOUT_S = 3600
DONE = {"SUCCESS", "FAILURE", "INTERNAL_ERROR", "TIMEOUT", "CANCELLED", "EXPIRED"}


def credentials() -> tuple[Any, str | None, str]:
    """(credentials, their project, why not): Application Default Credentials, or None and the reason."""
    try:
        import google.auth
        from google.auth import exceptions as auth_exceptions
    except ImportError:
        return None, None, "google-auth is not installed (pip install 'moe-tpu[image]')"
    try:
        credentials, project = google.auth.default(scopes=[CLOUD_PLATFORM_SCOPE])
    except auth_exceptions.DefaultCredentialsError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return None, None, f"no Google Cloud credentials ({first})"
    return credentials, project, "Application Default Credentials"



def split_gs(location: str) -> tuple[str, str]:
    """gs://BUCKET/OBJECT -> (BUCKET, OBJECT)."""
    bucket, _, name = location.removeprefix("gs://").partition("/")
    return bucket, name


def build_request(plan: Any, project: str) -> Any:
    """The CreateBuildRequest: build the archived context with docker, push every tag, log to staging."""
    from google.cloud.devtools import cloudbuild_v1
    from google.protobuf import duration_pb2

    if plan.archive_uri is None or plan.staging is None:
        raise UsageError("Cloud Build needs a Cloud Storage location for the source archive, and the config "
                         "gives none (trainer.output_dir is not in gs://)",
                         hint="set image.staging: gs://YOUR-BUCKET/staging")
    bucket, name = split_gs(plan.archive_uri)
    build = cloudbuild_v1.Build(
        source=cloudbuild_v1.Source(storage_source=cloudbuild_v1.StorageSource(bucket=bucket, object_=name)),
        steps=[cloudbuild_v1.BuildStep(name=STEP_IMAGE, args=[*plan.docker_build_args, "."])],
        images=plan.uris, timeout=duration_pb2.Duration(seconds=TIMEOUT_S),
        logs_bucket=f"{plan.staging}/cloud-build-logs", tags=["moe-tpu", "trainer-image"],
    )
    if plan.build_service_account:
        build.service_account = f"projects/{project}/serviceAccounts/{plan.build_service_account}"
    return cloudbuild_v1.CreateBuildRequest(project_id=project, build=build)


def registry_has(uri: str, credentials: Any) -> bool | None:
    """Whether Artifact Registry holds `uri` (HEAD on its manifest); None when it cannot tell."""
    import urllib.error
    import urllib.request

    from google.auth.transport.requests import Request

    repository, _, tag = uri.rpartition(":")
    host, _, path = repository.partition("/")
    try:
        if not credentials.valid:
            credentials.refresh(Request())
        request = urllib.request.Request(
            f"https://{host}/v2/{path}/manifests/{tag}", method="HEAD",
            headers={"Authorization": f"Bearer {credentials.token}",
                     "Accept": "application/vnd.oci.image.index.v1+json, "
                               "application/vnd.docker.distribution.manifest.v2+json"})
        with urllib.request.urlopen(request, timeout=30):
            return True
    except urllib.error.HTTPError as exc:
        return False if exc.code == 404 else None
    except Exception:  # noqa: BLE001 - unknown: the build goes ahead
        return None


def upload_archive(plan: Any, data: bytes, credentials: Any, project: str, console: Any) -> None:
    from google.api_core import exceptions as api_exceptions
    from google.cloud import storage

    assert plan.archive_uri is not None
    bucket, name = split_gs(plan.archive_uri)
    blob = storage.Client(project=project, credentials=credentials).bucket(bucket).blob(name)
    console.info(f"uploading the source archive ({len(data) / 1e6:.1f} MB) to {plan.archive_uri}")
    try:
        blob.upload_from_string(data, content_type="application/gzip", if_generation_match=0)
    except api_exceptions.PreconditionFailed:
        console.info("the same archive is already there")
    except api_exceptions.GoogleAPICallError as exc:
        raise CloudError(f"cannot upload to {plan.archive_uri}: {exc.message}",
                         hint="check that the bucket exists and that you may write to it (terraform/ makes it)") \
            from None


def submit(plan: Any, archive: bytes, credentials: Any, project: str, console: Any,
           calls: list[dict[str, Any]]) -> str:
    """Upload the context's archive, submit the build, stream its log until it ends; the build's id."""
    from google.api_core import exceptions as api_exceptions
    from google.cloud.devtools import cloudbuild_v1

    request = build_request(plan, project)
    upload_archive(plan, archive, credentials, project, console)
    client = cloudbuild_v1.CloudBuildClient(credentials=credentials)
    calls.append({"rpc": "google.devtools.cloudbuild.v1.CloudBuild/CreateBuild",
                  "request": proto_dict(request)})
    try:
        operation = client.create_build(request=request)
    except api_exceptions.GoogleAPICallError as exc:
        raise CloudError(f"Cloud Build refused the build: {exc.message}",
                         hint="enable the Cloud Build API (terraform/ does) and check your roles") from None
    build_id = operation.metadata.build.id
    console.info(f"Cloud Build {build_id}: {operation.metadata.build.log_url}")
    build = _follow_build(client, project, build_id, f"{plan.staging}/cloud-build-logs/log-{build_id}.txt",
                          credentials, console, calls)
    if build.status.name != "SUCCESS":
        raise CloudError(f"Cloud Build {build_id} ended {build.status.name}: {build.status_detail or 'see its log'}",
                         hint=f"its whole log: {build.log_url}")
    return build_id


def _follow_build(client: Any, project: str, build_id: str, log_uri: str, credentials: Any, console: Any,
                  calls: list[dict[str, Any]], poll_s: float = 3.0) -> Any:
    from google.cloud import storage

    bucket, name = split_gs(log_uri)
    blob = storage.Client(project=project, credentials=credentials).bucket(bucket).blob(name)
    offset = 0
    while True:
        calls.append({"rpc": "google.devtools.cloudbuild.v1.CloudBuild/GetBuild",
                      "request": {"project_id": project, "id": build_id}})
        build = client.get_build(project_id=project, id=build_id)
        offset = _print_new_log(blob, offset, console)
        if build.status.name in DONE:
            _print_new_log(blob, offset, console)
            return build
        time.sleep(poll_s)


def _print_new_log(blob: Any, offset: int, console: Any) -> int:
    """Print the log's bytes after `offset` to stderr; the new offset."""
    from google.api_core import exceptions as api_exceptions

    try:
        data = blob.download_as_bytes(start=offset)
    except (api_exceptions.NotFound, api_exceptions.RequestRangeNotSatisfiable):
        return offset
    except api_exceptions.GoogleAPICallError:
        return offset
    for line in data.decode(errors="replace").splitlines():
        console.info(f"  | {line}")
    return offset + len(data)
