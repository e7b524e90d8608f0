"""Cloud Build: the image built from an archived context in Cloud Storage.

`moe-tpu image build` without docker lands here (provision/image.py plans the build). The archive
goes to the plan's staging location, the build runs docker with every tag of the plan and logs to
staging, and its log is streamed from there until the build ends. All of it goes through the
command's Session: Cloud Build's client is `session.build` (its calls through our retry policy),
the archive and the log are objects of `session.storage`, and the look in Artifact Registry uses
the session's credentials; each of these calls is in the session's calls log. The plan is an
provision.image.ImagePlan (not imported: the image module imports this one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from provision.cloud import storage
from provision.cloud.api import RetryingApi, is_transient
from provision.cloud.credentials import default_credentials
from provision.errors import CloudError, UsageError
from provision.waiting import PollPolicy, call_with_retry, poll

STEP_IMAGE = "gcr.io/cloud-builders/docker"
TIMEOUT_S = 3600
DONE = {"SUCCESS", "FAILURE", "INTERNAL_ERROR", "TIMEOUT", "CANCELLED", "EXPIRED"}
# The build and its log are read this often until it ends.
LOG_POLL = PollPolicy(initial_s=3.0, factor=1.0, cap_s=3.0, jitter=0.0)


def credentials() -> tuple[Any, str | None, str]:
    """(credentials, their project, why not): Application Default Credentials, or None and the reason."""
    try:
        from google.auth import exceptions as auth_exceptions
    except ImportError:
        return None, None, "google-auth is not installed (pip install 'moe-tpu[image]')"
    try:
        credentials, project = default_credentials()
    except auth_exceptions.DefaultCredentialsError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return None, None, f"no Google Cloud credentials ({first})"
    return credentials, project, "Application Default Credentials"



def build_request(plan: Any, project: str) -> Any:
    """The CreateBuildRequest: build the archived context with docker, push every tag, log to staging."""
    from google.cloud.devtools import cloudbuild_v1
    from google.protobuf import duration_pb2

    if plan.archive_uri is None or plan.staging is None:
        raise UsageError("Cloud Build needs a Cloud Storage location for the source archive, and the config "
                         "gives none (trainer.output_dir is not in gs://)",
                         hint="set image.staging: gs://YOUR-BUCKET/staging")
    bucket, name = storage.split_gs(plan.archive_uri)
    build = cloudbuild_v1.Build(
        source=cloudbuild_v1.Source(storage_source=cloudbuild_v1.StorageSource(bucket=bucket, object_=name)),
        steps=[cloudbuild_v1.BuildStep(name=STEP_IMAGE, args=[*plan.docker_build_args, "."])],
        images=plan.uris, timeout=duration_pb2.Duration(seconds=TIMEOUT_S),
        logs_bucket=f"{plan.staging}/cloud-build-logs", tags=["moe-tpu", "trainer-image"],
    )
    if plan.build_service_account:
        build.service_account = f"projects/{project}/serviceAccounts/{plan.build_service_account}"
    return cloudbuild_v1.CreateBuildRequest(project_id=project, build=build)


def registry_has(uri: str, session: Any) -> bool | None:
    """Whether Artifact Registry holds `uri` (HEAD on its manifest with the session's credentials, in its
    calls log as `registry.manifests.head`); None when it cannot tell."""
    import urllib.error
    import urllib.request

    from google.auth.transport.requests import Request

    repository, _, tag = uri.rpartition(":")
    host, _, path = repository.partition("/")
    credentials = session.endpoint.credentials
    try:
        with session.log.call("registry.manifests.head", {"image": uri}):
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


def upload_archive(plan: Any, data: bytes, session: Any) -> None:
    assert plan.archive_uri is not None
    session.console.info(f"uploading the source archive ({len(data) / 1e6:.1f} MB) to {plan.archive_uri}")
    if not session.storage.create(plan.archive_uri, data, "application/gzip"):
        session.console.info("the same archive is already there")


def submit(plan: Any, archive: bytes, session: Any, project: str) -> str:
    """Upload the context's archive, submit the build, stream its log until it ends; the build's id.
    Everything goes through `session` (a provision.cloud.Session): its Cloud Build and Cloud Storage,
    their calls in its log, the waits on its clock."""
    request = build_request(plan, project)
    upload_archive(plan, archive, session)
    api = session.build
    operation = api.create(request)
    build_id = operation.metadata.build.id
    session.console.info(f"Cloud Build {build_id}: {operation.metadata.build.log_url}")
    build = api.follow(project, build_id, f"{plan.staging}/cloud-build-logs/log-{build_id}.txt",
                       session.storage.read_bytes_after)
    if build.status.name != "SUCCESS":
        raise CloudError(f"Cloud Build {build_id} ended {build.status.name}: {build.status_detail or 'see its log'}",
                         hint=f"its whole log: {build.log_url}")
    return build_id


class CloudBuildApi(RetryingApi):
    """Cloud Build behind our retry policy, waiting on our clock."""

    def create(self, request: Any) -> Any:
        """CreateBuild: its long-running operation (whose metadata names the build)."""
        from google.api_core import exceptions as gexc

        def on_retry(attempt: int, exc: BaseException | None) -> None:
            self.console.detail(f"submit the build: transient error ({type(exc).__name__}), retry {attempt}")

        try:
            return call_with_retry(lambda: self.client.create_build(request=request), self.clock,
                                   on_retry=on_retry, transient=is_transient)
        except gexc.GoogleAPICallError as exc:
            raise CloudError(f"Cloud Build refused the build: {exc.message}",
                             hint="enable the Cloud Build API (terraform/ does) and check your roles") from None

    def follow(self, project: str, build_id: str, log_url: str, read_after: Callable[[str, int], bytes]) -> Any:
        """GetBuild until the build ends (waiting.poll on our clock), printing the log's new lines as they
        come (read_after(url, offset): its bytes after offset); the build as it ended."""
        offset = 0

        def look() -> Any:
            nonlocal offset
            build = self._call(f"get Cloud Build {build_id}", lambda: self.client.get_build(project_id=project,
                                                                                               id=build_id))
            offset = _print_new_log(read_after(log_url, offset), offset, self.console)
            return build

        build = poll(look, lambda b: b.status.name in DONE, self.clock, timeout_s=float("inf"),
                     policy=LOG_POLL, what=f"Cloud Build {build_id}")
        _print_new_log(read_after(log_url, offset), offset, self.console)
        return build


def _print_new_log(data: bytes, offset: int, console: Any) -> int:
    """Print the log's new bytes (`data`, after `offset`) to stderr; the new offset."""
    for line in data.decode(errors="replace").splitlines():
        console.info(f"  | {line}")
    return offset + len(data)
