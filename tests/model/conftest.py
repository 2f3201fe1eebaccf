"""Fixtures for the model provisioning tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Model code in tests runs with one torch thread (the machines have two shared cores)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache folder holding a freshly built tiny model."""
    from pdserve.model.prepare import build_tiny_model

    cache = tmp_path_factory.mktemp("tiny-cache")
    build_tiny_model(cache)
    return cache


@pytest.fixture(scope="session")
def tiny_dir(tiny_cache: Path) -> Path:
    """The tiny model folder inside ``tiny_cache``."""
    from pdserve.model.prepare import TINY, model_dir

    return model_dir(TINY, tiny_cache)
