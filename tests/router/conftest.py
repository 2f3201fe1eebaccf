"""Fixtures for the router tests (the fakes live in router_fakes.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    from pdserve.model.prepare import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models"))
