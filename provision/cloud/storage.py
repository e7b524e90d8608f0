"""Cloud Storage: what the trainer leaves in its output directory (a gs:// URL or a local path), and
the objects of a Cloud Build (its source archive, its log).

Only small objects are read (status.json, metrics.jsonl, a build log's new bytes).
google-cloud-storage is imported here, lazily, with the session's credentials; it retries its own
reads and conditional writes, so nothing here retries on top of it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from provision.errors import CloudError, MissingDependency


def join(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + name


def split_gs(url: str) -> tuple[str, str]:
    """gs://BUCKET/OBJECT -> (BUCKET, OBJECT)."""
    bucket, _, name = url.removeprefix("gs://").partition("/")
    return bucket, name


def _blob(url: str, credentials: Any, project: str | None):
    try:
        from google.cloud import storage
    except ImportError as exc:  # depends on the install
        raise MissingDependency(exc.name or "google-cloud-storage", "control") from exc
    bucket, name = split_gs(url)
    return storage.Client(project=project, credentials=credentials).bucket(bucket).blob(name)


def create(url: str, data: bytes, content_type: str, credentials: Any, project: str | None) -> bool:
    """Write a new gs:// object; False when one is already there (it is left as it is)."""
    from google.api_core import exceptions as gexc

    blob = _blob(url, credentials, project)
    try:
        blob.upload_from_string(data, content_type=content_type, if_generation_match=0)
    except gexc.PreconditionFailed:
        return False
    except gexc.GoogleAPICallError as exc:
        raise CloudError(f"cannot upload to {url}: {exc.message}",
                         hint="check that the bucket exists and that you may write to it (terraform/ makes it)") \
            from None
    return True


def read_bytes_after(url: str, offset: int, credentials: Any, project: str | None) -> bytes:
    """A gs:// object's bytes after `offset`: none while it does not exist, has no more, or cannot be read
    (a log being written: the next read catches up)."""
    from google.api_core import exceptions as gexc

    try:
        return _blob(url, credentials, project).download_as_bytes(start=offset)
    except gexc.GoogleAPICallError:  # NotFound and RequestRangeNotSatisfiable among them
        return b""


def read_text(url: str, credentials: Any = None, project: str | None = None) -> str | None:
    """The object's text, or None when it does not exist (yet)."""
    if not url.startswith("gs://"):
        try:
            return Path(url).read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CloudError(f"cannot read {url}: {exc.strerror or exc}") from None
    blob = _blob(url, credentials, project)
    from google.api_core import exceptions as gexc

    try:
        return blob.download_as_text()
    except gexc.NotFound:
        return None
    except gexc.GoogleAPICallError as exc:
        raise CloudError(f"cannot read {url}: {exc.message}",
                         hint="check that the bucket exists and your account may read it") from None


def read_json(url: str, credentials: Any = None, project: str | None = None) -> dict | None:
    """A JSON object, or None when the object is missing or not (yet) a whole JSON object."""
    text = read_text(url, credentials, project)
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def read_jsonl(url: str, credentials: Any = None, project: str | None = None) -> list[dict]:
    """The JSON objects of a JSON-lines file (lines that are not whole objects are skipped)."""
    rows = []
    for line in (read_text(url, credentials, project) or "").splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            rows.append(value)
    return rows


def move_aside(url: str, credentials: Any = None, project: str | None = None, stamp: str | None = None) -> str:
    """Move a finished run's output out of the way (`run --restart`) and return where it went: a
    sibling named `<dir>-<UTC stamp>` (a suffix added while that name is taken).

    A local directory is renamed. Under gs:// every object below the prefix is copied server-side
    within its bucket (Blob.rewrite: no bytes pass through this machine, and large objects are
    copied in the service's own steps), and only when all copies exist are the originals deleted,
    status.json last: a move cut short leaves the finished run where it was, whole, with at most a
    partial copy beside it, never a directory that looks resumable with checkpoints missing."""
    import time

    stamp = stamp or time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    if not url.startswith("gs://"):
        path = Path(url)
        moved, n = path.with_name(f"{path.name}-{stamp}"), 1
        while moved.exists():
            moved, n = path.with_name(f"{path.name}-{stamp}-{n}"), n + 1
        try:
            path.rename(moved)
        except OSError as exc:
            raise CloudError(f"cannot move {url} aside: {exc.strerror or exc}") from None
        return str(moved)
    try:
        from google.api_core import exceptions as gexc
        from google.cloud import storage
    except ImportError as exc:  # depends on the install
        raise MissingDependency(exc.name or "google-cloud-storage", "control") from exc
    bucket_name, prefix = split_gs(url.rstrip("/"))
    if not prefix:
        raise CloudError(f"cannot move {url} aside: it is a whole bucket",
                         hint="point trainer.output_dir at a directory inside the bucket")
    try:
        client = storage.Client(project=project, credentials=credentials)
        bucket = client.bucket(bucket_name)
        target, n = f"{prefix}-{stamp}", 1
        while any(True for _ in client.list_blobs(bucket, prefix=target + "/", max_results=1)):
            target, n = f"{prefix}-{stamp}-{n}", n + 1
        blobs = list(client.list_blobs(bucket, prefix=prefix + "/"))
        for blob in blobs:
            copy = bucket.blob(target + blob.name[len(prefix):])
            token, _, _ = copy.rewrite(blob)
            while token is not None:
                token, _, _ = copy.rewrite(blob, token=token)
        for blob in sorted(blobs, key=lambda b: b.name.endswith("/status.json")):
            blob.delete()
    except gexc.GoogleAPICallError as exc:
        raise CloudError(f"cannot move {url} aside: {exc.message}",
                         hint="your account needs to create and delete objects in the bucket; "
                              "the finished run's objects stay where they are until every copy exists") from None
    return f"gs://{bucket_name}/{target}"
