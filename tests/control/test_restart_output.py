"""`run --restart` moves a finished run's output aside, on a local disk and in a bucket (a fake GCS
server, through the real google-cloud-storage client): every object kept, byte for byte, beside
the old directory; the output directory left empty, so the trainer starts from step 0. The reads
and the move go through the session's Storage, and each request is in the session's calls log."""

import json

import pytest

from provision.cloud import Endpoint, Session, storage
from provision.console import Console
from provision.errors import CloudError
from provision.runs import finished_status
from tests.gcs_server import fake_gcs_server

pytest.importorskip("gcp_storage_emulator")

FINISHED = json.dumps({"state": "finished", "step": 40, "total_steps": 40})
OBJECTS = {"status.json": FINISHED, "metrics.jsonl": '{"step": 1, "loss": 5.5}\n',
           "checkpoints/40/state/data.bin": "x" * 70_000, "checkpoints/40/_CHECKPOINT_METADATA": "{}"}


@pytest.fixture
def bucket(monkeypatch):
    with fake_gcs_server("runs-bucket") as url:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage as gcs

        yield gcs.Client(project="my-project", credentials=AnonymousCredentials()).bucket("runs-bucket")


@pytest.fixture
def session():
    """A session on Google's hosts as `run` opens one (the fake server stands in for Cloud Storage's)."""
    from google.auth.credentials import AnonymousCredentials

    from provision.clock import SimClock

    opened = Session(Endpoint(SimClock(), credentials=AnonymousCredentials(), default_project="my-project"), [],
                     Console())
    yield opened
    opened.close()


def _put(bucket, prefix: str, objects: dict[str, str]) -> None:
    for name, text in objects.items():
        bucket.blob(f"{prefix}/{name}").upload_from_string(text)


def _under(bucket, prefix: str) -> dict[str, str]:
    return {b.name[len(prefix) + 1:]: b.download_as_text() for b in bucket.list_blobs(prefix=prefix + "/")}


def test_a_finished_run_in_a_bucket_is_moved_aside_whole_and_its_neighbours_untouched(bucket, session):
    store = session.storage
    _put(bucket, "runs/moe-demo", OBJECTS)
    _put(bucket, "runs/moe-demo-other", {"status.json": "{}"})  # a name sharing the prefix: not part of it
    assert finished_status(store, "gs://runs-bucket/runs/moe-demo", 40) is not None
    assert session.calls == [{"rpc": "storage.objects.get", "status": "OK",
                              "request": {"bucket": "runs-bucket", "object": "runs/moe-demo/status.json"}}]

    moved = store.move_aside("gs://runs-bucket/runs/moe-demo/", stamp="20261201-1200")

    assert moved == "gs://runs-bucket/runs/moe-demo-20261201-1200"
    assert _under(bucket, "runs/moe-demo-20261201-1200") == OBJECTS
    assert _under(bucket, "runs/moe-demo") == {}
    move = session.calls[1:]
    assert [(c["rpc"], c["status"]) for c in move] == [
        ("storage.objects.list", "OK"), ("storage.objects.list", "OK"),
        *[("storage.objects.rewrite", "OK")] * len(OBJECTS), *[("storage.objects.delete", "OK")] * len(OBJECTS)]
    assert move[0]["request"] == {"bucket": "runs-bucket", "prefix": "runs/moe-demo-20261201-1200/", "maxResults": 1}
    assert {c["request"]["destinationObject"] for c in move if c["rpc"].endswith("rewrite")} == {
        f"runs/moe-demo-20261201-1200/{name}" for name in OBJECTS}
    assert move[-1]["request"] == {"bucket": "runs-bucket", "object": "runs/moe-demo/status.json"}  # deleted last
    assert finished_status(store, "gs://runs-bucket/runs/moe-demo", 40) is None  # step 0 next
    assert session.calls[-1]["status"] == "NOT_FOUND"
    assert _under(bucket, "runs/moe-demo-other") == {"status.json": "{}"}

    _put(bucket, "runs/moe-demo", {"status.json": FINISHED})  # finished again, moved in the same second
    again = store.move_aside("gs://runs-bucket/runs/moe-demo", stamp="20261201-1200")
    assert again == "gs://runs-bucket/runs/moe-demo-20261201-1200-1"
    assert _under(bucket, "runs/moe-demo-20261201-1200") == OBJECTS  # the first move's copy is not overwritten


def test_a_bucket_that_cannot_be_written_is_a_message_and_the_run_stays_where_it_was(bucket, session):
    with pytest.raises(CloudError) as err:
        session.storage.move_aside("gs://no-such-bucket/runs/moe-demo")
    assert "cannot move gs://no-such-bucket/runs/moe-demo aside" in err.value.message
    assert (session.calls[-1]["rpc"], session.calls[-1]["status"]) == ("storage.objects.list", "NOT_FOUND")
    with pytest.raises(CloudError, match="whole bucket"):
        session.storage.move_aside("gs://runs-bucket")


def test_a_local_output_directory_is_renamed_beside_itself(tmp_path):
    out = tmp_path / "moe-demo"
    (out / "checkpoints").mkdir(parents=True)
    (out / "status.json").write_text(FINISHED)
    (tmp_path / "moe-demo-20261201-1200").mkdir()  # taken already

    moved = storage.LOCAL.move_aside(str(out), stamp="20261201-1200")

    assert moved == str(tmp_path / "moe-demo-20261201-1200-1")
    assert json.loads((tmp_path / "moe-demo-20261201-1200-1" / "status.json").read_text())["step"] == 40
    assert not out.exists()
