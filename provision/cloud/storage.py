"""Cloud Storage: what the trainer leaves in its output directory (a gs:// URL or a local path), and
the objects of a Cloud Build (its source archive, its log).

`Session.storage` is a `Storage` on the session's credentials: one google-cloud-storage client, made
on first use, and every request it sends in the session's calls log as the JSON API's method
(`storage.objects.get`, `.insert`, `.list`, `.rewrite`, `.delete`) with its bucket and object, never
an object's bytes. A path that is not a gs:// URL is read from the local disk and logs nothing
(`LOCAL` does only that: a command with no gs:// output opens no session). The emulator serves no
Cloud Storage: a dry run's output directory is local.

Only small objects are read (status.json, metrics.jsonl, a build log's new bytes).
google-cloud-storage is imported here, lazily. Its client retries its own reads and conditional
writes, so these calls do not go through provision.cloud.api's retry policy as the gRPC adapters'
do, and a call it retried is still one entry in the log.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from provision.errors import CloudError, MissingDependency, UsageError
from provision.statefiles import file_kind


def join(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + name


def split_gs(url: str) -> tuple[str, str]:
    """gs://BUCKET/OBJECT -> (BUCKET, OBJECT)."""
    bucket, _, name = url.removeprefix("gs://").partition("/")
    return bucket, name


def _read_local(path: str) -> str | None:
    import os

    try:  # found without opening it: a FIFO would wait for a writer for ever, a device never end
        kind = file_kind(os.stat(path).st_mode)
    except OSError:
        kind = None  # the read below says why
    if kind:
        raise UsageError(f"cannot read {path}: it is {kind}, not a file", hint=f"move or delete {path}")
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CloudError(f"cannot read {path}: {exc.strerror or exc}") from None


class Storage:
    """Objects in Cloud Storage through the session's client, and files on the local disk.

    `log` is the session's provision.cloud.calls.CallLog (None: local paths only)."""

    def __init__(self, log: Any, credentials: Any = None, project: str | None = None) -> None:
        self._log = log
        self._credentials = credentials
        self._project = project
        self._client = None

    def _gcs(self):
        """The google-cloud-storage client, made once."""
        if self._log is None:
            raise ValueError("a gs:// URL needs the session's Storage (Session.storage), not LOCAL")
        if self._client is None:
            try:
                from google.cloud import storage
            except ImportError as exc:  # depends on the install
                raise MissingDependency(exc.name or "google-cloud-storage", "control") from exc
            self._client = storage.Client(project=self._project, credentials=self._credentials)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _blob(self, url: str):
        bucket, name = split_gs(url)
        return self._gcs().bucket(bucket).blob(name)

    def _call(self, rpc: str, **request: Any):
        """The block's request, logged as `rpc` (its status: OK, or the error that leaves the block)."""
        return self._log.call(f"storage.objects.{rpc}", request)

    # --- whole objects ---------------------------------------------------------------------------
    def create(self, url: str, data: bytes, content_type: str) -> bool:
        """Write a new gs:// object; False when one is already there (it is left as it is)."""
        from google.api_core import exceptions as gexc

        blob = self._blob(url)
        try:
            with self._call("insert", bucket=blob.bucket.name, object=blob.name, contentType=content_type,
                            size=len(data), ifGenerationMatch=0):
                blob.upload_from_string(data, content_type=content_type, if_generation_match=0)
        except gexc.PreconditionFailed:
            return False
        except gexc.GoogleAPICallError as exc:
            raise CloudError(f"cannot upload to {url}: {exc.message}",
                             hint="check that the bucket exists and that you may write to it (terraform/ makes it)") \
                from None
        return True

    def read_bytes_after(self, url: str, offset: int) -> bytes:
        """A gs:// object's bytes after `offset`: none while it does not exist, has no more, or cannot be
        read (a log being written: the next read catches up)."""
        from google.api_core import exceptions as gexc

        blob = self._blob(url)
        try:
            with self._call("get", bucket=blob.bucket.name, object=blob.name, offset=offset):
                return blob.download_as_bytes(start=offset)
        except gexc.GoogleAPICallError:  # NotFound and RequestRangeNotSatisfiable among them
            return b""

    def read_text(self, url: str) -> str | None:
        """The object's (or local file's) text, or None when it does not exist (yet)."""
        if not url.startswith("gs://"):
            return _read_local(url)
        from google.api_core import exceptions as gexc

        blob = self._blob(url)
        try:
            with self._call("get", bucket=blob.bucket.name, object=blob.name):
                return blob.download_as_text()
        except gexc.NotFound:
            return None
        except gexc.GoogleAPICallError as exc:
            raise CloudError(f"cannot read {url}: {exc.message}",
                             hint="check that the bucket exists and your account may read it") from None

    def read_json(self, url: str) -> dict | None:
        """A JSON object, or None when the object is missing or not (yet) a whole JSON object."""
        text = self.read_text(url)
        if not text:
            return None
        try:
            value = json.loads(text)
        except ValueError:
            return None
        return value if isinstance(value, dict) else None

    def read_jsonl(self, url: str) -> list[dict]:
        """The JSON objects of a JSON-lines file (lines that are not whole objects are skipped)."""
        rows = []
        for line in (self.read_text(url) or "").splitlines():
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                rows.append(value)
        return rows

    # --- a run's output, moved aside ---------------------------------------------------------------
    def move_aside(self, url: str, stamp: str | None = None) -> str:
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
            return _rename_aside(url, stamp)
        bucket_name, prefix = split_gs(url.rstrip("/"))
        if not prefix:
            raise CloudError(f"cannot move {url} aside: it is a whole bucket",
                             hint="point trainer.output_dir at a directory inside the bucket")
        client = self._gcs()
        from google.api_core import exceptions as gexc

        try:
            bucket = client.bucket(bucket_name)
            target, n = f"{prefix}-{stamp}", 1
            while self._list(bucket, target + "/", max_results=1):
                target, n = f"{prefix}-{stamp}-{n}", n + 1
            blobs = self._list(bucket, prefix + "/")
            for blob in blobs:
                copy = bucket.blob(target + blob.name[len(prefix):])
                token = None
                while True:
                    with self._call("rewrite", sourceBucket=bucket_name, sourceObject=blob.name,
                                    destinationBucket=bucket_name, destinationObject=copy.name):
                        token, _, _ = copy.rewrite(blob, token=token)
                    if token is None:
                        break
            for blob in sorted(blobs, key=lambda b: b.name.endswith("/status.json")):
                with self._call("delete", bucket=bucket_name, object=blob.name):
                    blob.delete()
        except gexc.GoogleAPICallError as exc:
            raise CloudError(f"cannot move {url} aside: {exc.message}",
                             hint="your account needs to create and delete objects in the bucket; "
                                  "the finished run's objects stay where they are until every copy exists") from None
        return f"gs://{bucket_name}/{target}"

    def _list(self, bucket, prefix: str, max_results: int | None = None) -> list:
        """The objects under `prefix` (every page: one entry per list, the client follows the pages)."""
        extra = {"maxResults": max_results} if max_results else {}
        with self._call("list", bucket=bucket.name, prefix=prefix, **extra):
            return list(self._gcs().list_blobs(bucket, prefix=prefix, max_results=max_results))


def _rename_aside(path_text: str, stamp: str) -> str:
    path = Path(path_text)
    moved, n = path.with_name(f"{path.name}-{stamp}"), 1
    while moved.exists():
        moved, n = path.with_name(f"{path.name}-{stamp}-{n}"), n + 1
    try:
        path.rename(moved)
    except OSError as exc:
        raise CloudError(f"cannot move {path_text} aside: {exc.strerror or exc}") from None
    return str(moved)


# Local paths only: what reads a local output directory without a session.
LOCAL = Storage(None)
