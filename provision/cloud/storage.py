"""Reading what the trainer leaves in its output directory: a gs:// URL or a local path.

Only small objects are read (status.json, metrics.jsonl). google-cloud-storage is imported
here, lazily, with the session's credentials.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from provision.errors import CloudError, MissingDependency


def join(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + name


def read_text(url: str, credentials: Any = None, project: str | None = None) -> str | None:
    """The object's text, or None when it does not exist (yet)."""
    if not url.startswith("gs://"):
        try:
            return Path(url).read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CloudError(f"cannot read {url}: {exc.strerror or exc}") from None
    try:
        from google.api_core import exceptions as gexc
        from google.cloud import storage
    except ImportError as exc:  # depends on the install
        raise MissingDependency(exc.name or "google-cloud-storage", "control") from exc
    bucket, _, blob = url[len("gs://"):].partition("/")
    try:
        client = storage.Client(project=project, credentials=credentials)
        return client.bucket(bucket).blob(blob).download_as_text()
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
