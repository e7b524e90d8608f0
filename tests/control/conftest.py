"""Fixtures the control-plane tests share."""

from __future__ import annotations

import pytest


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A fresh working directory for the test (dry-run state and remembered configs land there)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path
