"""The credentials every client of the session uses (a module of its own so that the clients' modules,
which the session imports, need not import the session's package back)."""

from __future__ import annotations

from typing import Any

CLOUD_PLATFORM_SCOPE = "https://www.googleapis.com/auth/cloud-platform"


def default_credentials() -> tuple[Any, str | None]:
    """(credentials, their project): Application Default Credentials for every API this tool calls
    (the cloud-platform scope). google.auth's DefaultCredentialsError when there are none."""
    import google.auth

    return google.auth.default(scopes=[CLOUD_PLATFORM_SCOPE])
