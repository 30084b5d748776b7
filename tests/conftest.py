"""Fixtures every test gets. Helpers live in ``tests/helpers`` (``from helpers import ...``)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _no_soakd_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test depends on the developer's SOAKD_* environment."""
    for key in list(os.environ):
        if key.startswith("SOAKD_"):
            monkeypatch.delenv(key)
