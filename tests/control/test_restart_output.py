"""`run --restart` moves a finished run's output aside, on a local disk and in a bucket (a fake GCS
server, through the real google-cloud-storage client): every object kept, byte for byte, beside
the old directory; the output directory left empty, so the trainer starts from step 0."""

import json

import pytest

from provision.cloud import storage
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


def _put(bucket, prefix: str, objects: dict[str, str]) -> None:
    for name, text in objects.items():
        bucket.blob(f"{prefix}/{name}").upload_from_string(text)


def _under(bucket, prefix: str) -> dict[str, str]:
    return {b.name[len(prefix) + 1:]: b.download_as_text() for b in bucket.list_blobs(prefix=prefix + "/")}


def test_a_finished_run_in_a_bucket_is_moved_aside_whole_and_its_neighbours_untouched(bucket):
    from google.auth.credentials import AnonymousCredentials

    creds = AnonymousCredentials()
    _put(bucket, "runs/moe-demo", OBJECTS)
    _put(bucket, "runs/moe-demo-other", {"status.json": "{}"})  # a name sharing the prefix: not part of it
    assert finished_status("gs://runs-bucket/runs/moe-demo", 40, creds, "my-project") is not None

    moved = storage.move_aside("gs://runs-bucket/runs/moe-demo/", creds, "my-project", stamp="20261201-1200")

    assert moved == "gs://runs-bucket/runs/moe-demo-20261201-1200"
    assert _under(bucket, "runs/moe-demo-20261201-1200") == OBJECTS
    assert _under(bucket, "runs/moe-demo") == {}
    assert finished_status("gs://runs-bucket/runs/moe-demo", 40, creds, "my-project") is None  # step 0 next
    assert _under(bucket, "runs/moe-demo-other") == {"status.json": "{}"}

    _put(bucket, "runs/moe-demo", {"status.json": FINISHED})  # finished again, moved in the same second
    again = storage.move_aside("gs://runs-bucket/runs/moe-demo", creds, "my-project", stamp="20261201-1200")
    assert again == "gs://runs-bucket/runs/moe-demo-20261201-1200-1"
    assert _under(bucket, "runs/moe-demo-20261201-1200") == OBJECTS  # the first move's copy is not overwritten


def test_a_bucket_that_cannot_be_written_is_a_message_and_the_run_stays_where_it_was(bucket):
    from google.auth.credentials import AnonymousCredentials

    with pytest.raises(CloudError) as err:
        storage.move_aside("gs://no-such-bucket/runs/moe-demo", AnonymousCredentials(), "my-project")
    assert "cannot move gs://no-such-bucket/runs/moe-demo aside" in err.value.message
    with pytest.raises(CloudError, match="whole bucket"):
        storage.move_aside("gs://runs-bucket", AnonymousCredentials(), "my-project")


def test_a_local_output_directory_is_renamed_beside_itself(tmp_path):
    out = tmp_path / "moe-demo"
    (out / "checkpoints").mkdir(parents=True)
    (out / "status.json").write_text(FINISHED)
    (tmp_path / "moe-demo-20261201-1200").mkdir()  # taken already

    moved = storage.move_aside(str(out), stamp="20261201-1200")

    assert moved == str(tmp_path / "moe-demo-20261201-1200-1")
    assert json.loads((tmp_path / "moe-demo-20261201-1200-1" / "status.json").read_text())["step"] == 40
    assert not out.exists()
